"""torch's HuggingFaceStorageWriter per-rank shards, read as one sharded checkpoint.

Live checks run as scenarios of tests/dist/hf_storage/hf_storage_scenarios.py in the shared 2-rank
spawn (the ``spawns`` fixture); the folders they saved with torch's own writer are then read
offline here, and copies of them are damaged header by header. A hypothesis property drives the
reader with random chunkings (gaps, overlaps, empty boxes) written the way the writer writes them.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsdpcheck
from fsdpcheck.cli import main
from fsdpcheck.errors import CheckpointError, CoverageError
from fsdpcheck.inspection import inspect_checkpoint
from fsdpcheck.reading.references import open_source
from fsdpcheck.sources.base import Region
from fsdpcheck.sources.hf_storage import HFStorageSource
from tests.corpus.hf_storage import KEYS, PLANTED
from tests.dist.hf_storage.hf_storage_scenarios import REGISTRY
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.hf_storage.hf_storage_scenarios"
CASES = REGISTRY.cases()
CHECKS = checks = Checks(REGISTRY)
RANK1 = "shard-00002-model-00001-of-00001.safetensors"
# Elements of the saved model (TinyTransformer(7, 6, 10, 1)).
NUMEL = 7 * 6 + 2 * (6 + 6 + 10 * 6 + 10 + 10 * 6) + 6 + 1


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    CHECKS[name](spawns.result(SCENARIOS_MODULE, world, name))


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


@checks("verify_clean")
def clean_shards_verify(r: dict) -> None:
    assert r["ok"], r["text"]
    assert r["keys"] == [13, 13, 13] and r["elements"] == NUMEL


@checks("verify_planted")
def planted_element_named_at_key_index_and_rank(r: dict) -> None:
    assert r["findings"] == [[PLANTED[0], "value", list(PLANTED[1]), 1]], r["text"]


@checks("verify_consolidated")
def consolidated_and_its_shards_verify(r: dict) -> None:
    for side in ("consolidated", "sharded"):
        assert r[side]["ok"], r[side]["text"]
        assert r[side]["keys"] == [13, 13, 13] and r[side]["elements"] == NUMEL
    assert "model.safetensors.index.json" in r["consolidated"]["text"]
    assert "HuggingFaceStorageWriter shards" in r["sharded"]["text"]


@checks("fingerprint_live")
def live_fingerprint_has_every_key(fp: dict) -> None:
    assert sorted(fp) == KEYS  # equal to the checkpoint's: test_fingerprint_equals_live


@checks("load_into_fresh_model")
def load_reads_the_shards(r: dict) -> None:
    assert not r["before_ok"]  # another seed: every value differs before the load
    assert r["loaded"]["ok"], r["loaded"]["text"]
    assert r["loaded"]["keys"] == [13, 13, 13]


@checks("last_rank_file_missing")
def missing_last_file_shrinks_the_extents(r: dict) -> None:
    # NOTE: [HF shard extents]: no global shape is stored, so a missing file at the end of a
    # dim is a shape finding against the live model. The head's rows are all in rank 0's file.
    shapes = {k for k, kind, _, _ in r["findings"] if kind == "shape"}
    assert shapes == set(KEYS) - {"head.weight", "head.bias"}, r["text"]
    assert "[shape] emb.weight: global shape (7, 6) live but (4, 6) in the checkpoint" in r["text"]


# ------------------------------------------------------------------------------ offline
@pytest.fixture(scope="module")
def saved(spawns: Spawns) -> dict[str, Path]:
    paths = spawns.get(2)[0][SCENARIOS_MODULE]["__ckpts__"]
    return {k: Path(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def live_fingerprint(spawns: Spawns) -> dict[str, int]:
    fp = spawns.result(SCENARIOS_MODULE, 2, "fingerprint_live")
    return {k: int(v, 16) for k, v in fp.items()}


def test_recognised_with_each_files_box(saved: dict[str, Path]) -> None:
    info = fsdpcheck.describe_path(saved["clean"])
    assert (info.layout, info.kind, info.paths, info.notes) == (
        "hf_storage",
        "full",
        [saved["clean"]],
        [],
    )
    assert info.description == (
        "per-rank safetensors shards from torch's HuggingFaceStorageWriter (2 file(s) in "
        f"{saved['clean']})"
    )
    source = open_source(saved["clean"])
    assert source.is_sharded and source.problems() == []
    assert source.entries()["emb.weight"].shape == (7, 6)
    assert source.chunks("emb.weight") == [((0, 0), (4, 6)), ((4, 0), (3, 6))]
    assert source.chunks("head.bias") == [((0,), (1,)), ((1,), (0,))]  # rank 1: an empty box


def test_consolidated_folder_reads_the_consolidated_files(saved: dict[str, Path]) -> None:
    folder = saved["consolidated"]
    info = fsdpcheck.describe_path(folder)
    assert (info.layout, info.paths) == ("safetensors", [folder / "model.safetensors.index.json"])
    assert info.notes == [
        "sharded/ holds the per-rank shards these consolidated files were made from: not read "
        f"(pass {folder / 'sharded'} to check them)"
    ]
    assert fsdpcheck.describe_path(folder / "sharded").layout == "hf_storage"


def test_sharded_folder_without_consolidated_index(saved: dict[str, Path], tmp_path: Path) -> None:
    shutil.copytree(saved["consolidated"] / "sharded", tmp_path / "sharded")
    info = fsdpcheck.describe_path(tmp_path)
    assert (info.layout, info.paths) == ("hf_storage", [tmp_path / "sharded"])
    assert info.notes == [
        "no model.safetensors.index.json beside sharded/ (consolidation not run or not "
        "finished): the per-rank shards are read"
    ]
    assert fsdpcheck.compare_checkpoints(tmp_path, saved["clean"]).ok


def test_one_shard_file_is_one_ranks_boxes(saved: dict[str, Path]) -> None:
    f = saved["clean"] / RANK1
    info = fsdpcheck.describe_path(f)
    assert info.layout == "hf_storage"
    assert info.notes == [f"1 other shard file(s) beside it not read (pass {saved['clean']})"]
    problems = HFStorageSource(f).problems()
    assert ("emb.weight", "gap", "gap at [0:4] (no chunk covers these rows): no shard file "
            "read holds it") in problems  # fmt: skip


def test_inspect_and_audit(saved: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(saved["clean"])]) == 0
    out = capsys.readouterr().out
    assert "layout: hf_storage (full)" in out
    described = inspect_checkpoint(saved["clean"])
    assert {t["key"]: (t["chunks"], t["coverage"]) for t in described["tensors"]} == dict.fromkeys(
        KEYS, (2, "complete")
    )
    for name in ("clean", "planted"):
        r = fsdpcheck.audit(saved[name])
        assert r.ok and r.keys_checked == 13, str(r)


def test_compare_with_consolidated_every_element(saved: dict[str, Path]) -> None:
    for a, b in (("clean", "consolidated"), ("consolidated", "clean")):
        r = fsdpcheck.compare_checkpoints(saved[a], saved[b])
        assert r.ok, str(r)
        assert (r.keys_a, r.keys_b, r.keys_checked, r.elements_checked) == (13, 13, 13, NUMEL)


def test_compare_planted_named_at_key_and_index(saved: dict[str, Path]) -> None:
    r = fsdpcheck.compare_checkpoints(saved["planted"], saved["consolidated"])
    assert [(f.key, f.kind, f.max_abs_index) for f in r.findings] == [
        (PLANTED[0], "value", PLANTED[1])
    ], str(r)


def test_fingerprint_equals_live(saved: dict[str, Path], live_fingerprint: dict) -> None:
    assert fsdpcheck.fingerprint_checkpoint(saved["clean"]) == live_fingerprint
    assert fsdpcheck.fingerprint_checkpoint(saved["consolidated"]) == live_fingerprint
    planted = fsdpcheck.fingerprint_checkpoint(saved["planted"])
    assert {k for k in planted if planted[k] != live_fingerprint[k]} == {PLANTED[0]}


def test_reads_assemble_across_files_and_map_in_place(saved: dict[str, Path]) -> None:
    source = open_source(saved["clean"])
    full = open_source(saved["consolidated"])
    whole = Region("emb.weight", (0, 0), (7, 6))
    inside = Region("emb.weight", (4, 1), (2, 3))  # in rank 1's box only
    got = source.read([whole, inside], torch.device("cpu"))
    want = full.read([whole, inside], torch.device("cpu"))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # The region inside one box is a view of the mapped file (no copy).
    assert got[1].untyped_storage().nbytes() == (saved["clean"] / RANK1).stat().st_size
    out = [torch.full((7, 6), float("nan")), torch.full((2, 3), float("nan"))]
    filled = source.read([whole, inside], torch.device("cpu"), out)
    assert filled[0] is out[0] and torch.equal(filled[0], want[0])


# ------------------------------------------------------------------------------ hostile
def rewrite(f: Path, change: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Rewrites a shard's header: `change(header, sharding_info)` edits both in place."""
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    change(header, info)
    if "DCP_SHARDING_INFO" in header.get("__metadata__", {}):
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def _offsets(key: str, offsets: list[int]) -> Callable[[Path], None]:
    return lambda d: rewrite(d / RANK1, lambda h, i: i[key].update(saved_offsets=offsets))


def _shape(key: str, shape: list[int]) -> Callable[[Path], None]:
    return lambda d: rewrite(d / RANK1, lambda h, i: h[key].update(shape=shape))


def _no_info(d: Path) -> None:
    rewrite(d / RANK1, lambda h, i: h["__metadata__"].pop("DCP_SHARDING_INFO"))


def _truncate(d: Path) -> None:
    f = d / RANK1
    f.write_bytes(f.read_bytes()[:-40])


def _link_outside(d: Path) -> None:
    outside = d.parent / f"{d.name}-outside.safetensors"
    (d / RANK1).rename(outside)
    (d / RANK1).symlink_to(outside)


def _dtype(d: Path) -> None:
    rewrite(d / RANK1, lambda h, i: h["blocks.0.w1.bias"].update(dtype="I32"))


HOSTILE = {
    # rank 1's emb.weight box placed at row 40: the extent grows to 43 rows, with a gap.
    "offsets_outside": (
        _offsets("emb.weight", [40, 0]),
        [("emb.weight", "gap", "gap at [4:40] (no chunk covers these rows): no shard file "
          "read holds it")],
    ),
    "overlapping_boxes": (
        _offsets("blocks.0.w1.weight", [4, 0]),
        [("blocks.0.w1.weight", "layout", "overlap at [4:5, 0:6]: saved in more than one "
          "shard file")],
    ),
    "box_bigger_than_stored": (
        _shape("blocks.0.w1.weight", [6, 6]),
        [("blocks.0.w1.weight", "error", "{src}: " + RANK1 + ": blocks.0.w1.weight: its box "
          "[6, 6] of F32 needs 144 bytes but its data_offsets hold 120; not read")],
    ),
    "offsets_wrong_dims": (
        _offsets("emb.weight", [4]),
        [("emb.weight", "error", "{src}: " + RANK1 + ": emb.weight: its saved_offsets "
          "{'saved_offsets': [4]} in DCP_SHARDING_INFO do not place a 2-dim box in a global "
          "tensor")],
    ),
    # offsets that place a box beyond any tensor the kernels can index
    "offsets_far_away": (
        _offsets("emb.weight", [1 << 62, 0]),
        [("emb.weight", "layout", "{src}: emb.weight: its boxes span (4611686018427387907, 6), "
          "more than 2**62 elements: the saved offsets are wrong")],
    ),
    "no_sharding_info": (_no_info, None),
    "truncated": (_truncate, None),
    "link_outside": (
        _link_outside,
        [("*", "error", "{src}: " + RANK1 + " names '" + RANK1 + "', a link that leads outside "
          "the checkpoint directory")],
    ),
    "dtype_disagrees": (
        _dtype,
        [("blocks.0.w1.bias", "layout", "{src}: " + RANK1 + " holds a 1-dim torch.int32 box of "
          "blocks.0.w1.bias but shard-00001-model-00001-of-00001.safetensors a 1-dim "
          "torch.float32 one; the former is not read")],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_each_one_line(saved: dict[str, Path], tmp_path: Path, name: str) -> None:
    damage, expected = HOSTILE[name]
    d = tmp_path / "ckpt"
    shutil.copytree(saved["clean"], d)
    damage(d)
    src = f"HuggingFaceStorageWriter shards {d}"
    problems = HFStorageSource(d).problems()
    assert problems, name
    if expected is not None:
        assert problems == [(k, kind, m.replace("{src}", src)) for k, kind, m in expected]
    for _, _, message in problems:
        assert "\n" not in message and message.isprintable()
    audit = fsdpcheck.audit(d)
    assert sorted((f.key, f.kind, f.message) for f in audit.findings) == sorted(problems)
    compared = fsdpcheck.compare_checkpoints(d, saved["consolidated"])
    assert not compared.ok
    with pytest.raises(CheckpointError) as err:
        fsdpcheck.fingerprint_checkpoint(d)
    assert "\n" not in str(err.value) and "refusing" in str(err.value)


def test_hostile_whole_file_problems(saved: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(saved["clean"], d)
    _no_info(d)
    problems = HFStorageSource(d).problems()
    assert len(problems) == 13  # every tensor of rank 1's file; rank 0's boxes remain
    assert problems[0] == (
        "blocks.0.norm.bias",
        "error",
        f"HuggingFaceStorageWriter shards {d}: {RANK1}: blocks.0.norm.bias: its file has no "
        "DCP_SHARDING_INFO in its header metadata: where its box lies in the global tensor is "
        "unknown",
    )
    (d / RANK1).write_bytes(b"\x10\x00\x00")
    assert HFStorageSource(d).problems() == [
        (
            "*",
            "error",
            f"HuggingFaceStorageWriter shards {d}: {RANK1} has 3 bytes, too few for the "
            "safetensors header it starts (truncated, or not safetensors)",
        )
    ]


def test_truncated_names_the_tensors_past_the_end(saved: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(saved["clean"], d)
    _truncate(d)
    problems = HFStorageSource(d).problems()
    assert problems and all(
        m.endswith(f"but the file has {(d / RANK1).stat().st_size} bytes (truncated?)")
        for _, _, m in problems
        if _ == "error"
    ), problems


def test_reads_refuse_gaps_and_overlaps(saved: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(saved["clean"], d)
    _offsets("emb.weight", [5, 0])(d)  # rows 4 missing... a gap at [4:5], extent 8 rows
    _offsets("blocks.0.w1.weight", [4, 0])(d)  # overlap at row 4
    source = HFStorageSource(d)
    assert source.entries()["emb.weight"].shape == (8, 6)
    with pytest.raises(CoverageError, match=r"emb.weight: region \[4:5, 0:6\] is in no shard"):
        source.read([Region("emb.weight", (0, 0), (8, 6))], torch.device("cpu"))
    (fine,) = source.read([Region("emb.weight", (5, 0), (3, 6))], torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"region \[4:5, 0:6\] is saved in both"):
        source.read([Region("blocks.0.w1.weight", (3, 0), (3, 6))], torch.device("cpu"))
    assert fine.shape == (3, 6)


def test_vanished_file_is_one_line(saved: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(saved["clean"], d)
    source = HFStorageSource(d)
    (d / RANK1).unlink()
    with pytest.raises(CheckpointError) as err:
        source.read([Region("emb.weight", (4, 0), (3, 6))], torch.device("cpu"))
    assert str(err.value) == f"safetensors shard {d / RANK1}: No such file or directory"


def test_shrunk_file_is_refused_not_mapped(saved: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(saved["clean"], d)
    source = HFStorageSource(d)
    _truncate(d)  # after opening: a mapped page past the end would be SIGBUS
    with pytest.raises(CheckpointError, match="shrank from"):
        source.read([Region("emb.weight", (4, 0), (3, 6))], torch.device("cpu"))


# ------------------------------------------------------------------------------ property
def _write_shards(root: Path, key: str, boxes: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
    """One shard file per box, as the writer lays them out (header metadata, safetensors)."""
    from safetensors.torch import save_file

    for i, (offsets, data) in enumerate(boxes, start=1):
        info = json.dumps({key: {"saved_offsets": list(offsets)}})
        save_file(
            {key: data.contiguous()},
            root / f"shard-{i:05d}-model-00001-of-00001.safetensors",
            metadata={"DCP_SHARDING_INFO": info, "DCP_VERSION": "1.0", "format": "pt"},
        )


@st.composite
def chunkings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], ...]]]:
    """A shape, its grid of boxes, and faults: a box dropped, repeated or shifted by one."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    cuts = [sorted(draw(st.sets(st.integers(0, s), max_size=2)) | {0, s}) for s in shape]
    boxes = [
        (tuple(c[0] for c in cell), tuple(c[1] - c[0] for c in cell))
        for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts])
    ]
    fault = draw(st.sampled_from(["none", "drop", "repeat", "shift"]))
    i = draw(st.integers(0, len(boxes) - 1))
    if fault == "drop" and len(boxes) > 1:
        boxes.pop(i)
    elif fault == "repeat":
        boxes.append(boxes[i])
    elif fault == "shift":
        o, s = boxes[i]
        d = draw(st.integers(0, len(shape) - 1))
        boxes[i] = (tuple(v + (k == d) for k, v in enumerate(o)), s)
    if draw(st.booleans()):  # an empty box, as a rank with no rows saves one
        boxes.append((tuple(draw(st.integers(0, s)) for s in shape), (0, *shape[1:])))
    return shape, boxes


@given(chunkings(), st.data())
def test_reads_match_the_boxes_or_refuse(case: Any, data: st.DataObject) -> None:
    import tempfile

    shape, boxes = case
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    written = []
    for o, s in boxes:
        src = tuple(min(v, g - n) for v, n, g in zip(o, s, shape))  # shifted: the same data
        written.append((o, full[tuple(slice(a, a + n) for a, n in zip(src, s))]))
    extent = tuple(max(o[d] + s[d] for o, s in boxes) for d in range(len(shape)))
    count = torch.zeros(extent, dtype=torch.int64)
    value = torch.zeros(extent)
    for o, t in written:
        at = tuple(slice(a, a + n) for a, n in zip(o, t.shape))
        count[at] += 1
        value[at] = t
    with tempfile.TemporaryDirectory() as tmp:
        _write_shards(Path(tmp), "w", written)
        source = HFStorageSource(Path(tmp))
        assert source.entries()["w"].shape == extent
        assert bool(source.problems()) == bool((count != 1).any())
        lo = [data.draw(st.integers(0, g - 1)) for g in extent]
        size = tuple(data.draw(st.integers(1, g - a)) for a, g in zip(lo, extent))
        at = tuple(slice(a, a + n) for a, n in zip(lo, size))
        region = Region("w", tuple(lo), size)
        if (count[at] == 0).any():
            with pytest.raises(CoverageError):
                source.read([region], torch.device("cpu"))
        elif (count[at] > 1).any():
            with pytest.raises(CheckpointError):
                source.read([region], torch.device("cpu"))
        else:
            (got,) = source.read([region], torch.device("cpu"))
            assert torch.equal(got, value[at])
