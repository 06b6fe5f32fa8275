"""Sharded torch.save checkpoints (``*.bin.index.json``): the index is the authority.

The clean, planted and live checks of accelerate's ``save_model(safe_serialization=False)``
folders run with the corpus (tests/corpus/test_corpus.py, ``hf_bin_*``); here: the same weights
against transformers' safetensors save, every way an index or a shard can be wrong (each one
line), and many shards under a small descriptor limit.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fsdpcheck
from fsdpcheck.errors import CheckpointError
from fsdpcheck.reading.references import open_source
from fsdpcheck.sources.base import Region
from fsdpcheck.sources.bin_index import BinIndexSource
from tests import REPO_ROOT

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")

ROOT = REPO_ROOT
INDEX = "pytorch_model.bin.index.json"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """accelerate's sharded .bin save and transformers' sharded safetensors save of one model."""
    from tests.corpus.hf import make_untied
    from tests.corpus.hf_bin import save_model

    root = tmp_path_factory.mktemp("bin")
    model = make_untied()
    save_model(model, root / "bin")
    model.save_pretrained(root / "safetensors", max_shard_size="20KB")  # type: ignore[operator]
    return {"bin": root / "bin", "safetensors": root / "safetensors"}


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX).read_text())["weight_map"]


def test_same_weights_as_safetensors_every_element(folders: dict[str, Path]) -> None:
    r = fsdpcheck.compare_checkpoints(folders["bin"], folders["safetensors"])
    source = open_source(folders["bin"])
    numel = sum(math.prod(e.shape) for e in source.entries().values())
    assert r.ok, str(r)
    assert (r.keys_a, r.keys_b, r.keys_checked, r.elements_checked) == (21, 21, 21, numel)
    assert len(list(folders["bin"].glob("pytorch_model-*-of-*.bin"))) > 1


def test_index_file_and_folder_recognised(folders: dict[str, Path]) -> None:
    by_folder = fsdpcheck.describe_path(folders["bin"])
    by_file = fsdpcheck.describe_path(folders["bin"] / INDEX)
    assert (by_folder.layout, by_folder.kind, by_folder.paths) == (
        "torch.save",
        "full",
        [folders["bin"] / INDEX],
    )
    assert by_folder.description == f"a sharded torch.save checkpoint ({INDEX})"
    assert (by_file.layout, by_file.paths) == ("torch.save", [folders["bin"] / INDEX])
    assert fsdpcheck.compare_checkpoints(folders["bin"] / INDEX, folders["bin"]).ok


def test_other_prefixes_and_two_indexes(folders: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(folders["bin"], d)
    (d / INDEX).rename(d / "model.bin.index.json")
    assert fsdpcheck.describe_path(d).paths == [d / "model.bin.index.json"]
    assert fsdpcheck.compare_checkpoints(d, folders["safetensors"]).ok
    shutil.copy(d / "model.bin.index.json", d / "adapter_model.bin.index.json")
    with pytest.raises(ValueError) as err:
        fsdpcheck.describe_path(d)
    assert str(err.value) == (
        f"{d} holds 2 torch.save indexes (adapter_model.bin.index.json, model.bin.index.json); "
        "pass the one to use"
    )


# ------------------------------------------------------------------------------ hostile
def _edit_index(change: Callable[[dict[str, str]], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        doc = json.loads((d / INDEX).read_text())
        change(doc["weight_map"])
        (d / INDEX).write_text(json.dumps(doc))

    return damage


def _shard_of(d: Path, key: str) -> Path:
    return d / weight_map(d)[key]


def _outside(d: Path) -> None:
    shutil.copy(_shard_of(d, "lm_head.weight"), d.parent / "elsewhere.bin")
    _edit_index(lambda m: m.update({"lm_head.weight": "../elsewhere.bin"}))(d)


def _truncated(d: Path) -> None:
    f = _shard_of(d, "lm_head.weight")
    f.write_bytes(f.read_bytes()[:200])


class _Run:
    """Runs a command when unpickled by a full unpickler (never by a weights-only one)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _pickle_bomb(d: Path) -> None:
    f = _shard_of(d, "lm_head.weight")
    held = torch.load(f, weights_only=True)
    held["lm_head.weight"] = _Run(d / "ran")
    torch.save(held, f, pickle_module=pickle)


def _unlisted(d: Path) -> None:
    _edit_index(lambda m: m.pop("model.norm.weight"))(d)


def _other_shard_key(d: Path, key: str) -> str:
    return next(k for k, f in weight_map(d).items() if f != weight_map(d)[key])


def _stray(d: Path) -> None:
    f = _shard_of(d, _other_shard_key(d, "model.norm.weight"))
    held = torch.load(f, weights_only=True)
    held["model.norm.weight"] = torch.ones(32)
    torch.save(held, f)


def _wrong_file(d: Path) -> None:
    other = weight_map(d)[_other_shard_key(d, "lm_head.weight")]
    _edit_index(lambda m: m.update({"lm_head.weight": other}))(d)


class Prefix(str):
    """An expected message of which only the start is pinned (torch's own words follow)."""


# name -> (damage, expected problems as (key, message) with {src}, {d}, {was}: the shard that
# held lm_head.weight, {norm}: the one holding model.norm.weight, {now}: the index's entry for
# lm_head.weight after the damage), the kinds compare reports (a key left out of the entries is
# also "missing" against the other side).
HOSTILE: dict[str, tuple[Callable[[Path], None], list[tuple[str, str]], list[str]]] = {
    "outside": (
        _outside,
        [
            ("lm_head.weight", "{src}: index entry '../elsewhere.bin' names '../elsewhere.bin', "
             "outside the checkpoint directory"),
            ("lm_head.weight", "a stray copy of lm_head.weight is in {was}; {src} names "
             "../elsewhere.bin, which is what is read"),
        ],
        ["error", "missing"],
    ),
    "missing_file": (
        _edit_index(lambda m: m.update({"lm_head.weight": "gone.bin"})),
        [
            ("lm_head.weight", "{src}: index entry 'gone.bin': data file {d}/gone.bin does not "
             "exist"),
            ("lm_head.weight", "a stray copy of lm_head.weight is in {was}; {src} names "
             "gone.bin, which is what is read"),
        ],
        ["error", "missing"],
    ),
    "wrong_file": (
        _wrong_file,
        [
            ("lm_head.weight", "{src} names {now} for lm_head.weight, but {now} has no such "
             "tensor"),
            ("lm_head.weight", "a stray copy of lm_head.weight is in {was}; {src} names {now}, "
             "which is what is read"),
        ],
        ["error", "missing"],
    ),
    "truncated": (
        _truncated,
        [("*", Prefix("{src}: torch.save file {d}/{was} cannot be loaded: "))],
        ["error", "missing"],
    ),
    "pickle_bomb": (
        _pickle_bomb,
        [("*", Prefix("{src}: torch.save file {d}/{was} cannot be loaded: Weights only load "
          "failed"))],
        ["error", "missing"],
    ),
    "unlisted": (
        _unlisted,
        [("model.norm.weight", "{norm} holds model.norm.weight, which {src} does not list (not "
          "read)")],
        ["error", "missing"],
    ),
    "stray": (
        _stray,
        [("model.norm.weight", "a stray copy of model.norm.weight is in {stray}; {src} names "
          "{norm}, which is what is read")],
        ["error"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_each_one_line(folders: dict[str, Path], tmp_path: Path, name: str) -> None:
    damage, expected, compare_kinds = HOSTILE[name]
    d = tmp_path / "ckpt"
    shutil.copytree(folders["bin"], d)
    before = weight_map(d)
    was, norm = before["lm_head.weight"], before["model.norm.weight"]
    stray = before[_other_shard_key(d, "model.norm.weight")]
    damage(d)
    now = weight_map(d).get("lm_head.weight")
    src = f"torch.save index {d / INDEX}"
    # A shard that cannot be loaded fails every key the index places in it.
    keys = {"*": [k for k, f in weight_map(d).items() if f == was]}
    want = [
        (key, "error", text.format(src=src, d=d, was=was, norm=norm, now=now, stray=stray))
        for k, text in expected
        for key in keys.get(k, [k])
    ]
    problems = BinIndexSource(d / INDEX).problems()
    assert len(problems) == len(want), problems
    for (key, kind, message), (wkey, wkind, wmessage) in zip(problems, want):
        assert (key, kind) == (wkey, wkind)
        prefix = isinstance(dict(expected).get("*"), Prefix)
        assert message.startswith(wmessage) if prefix else message == wmessage, message
        assert "\n" not in message and message.isprintable()
    assert not (d / "ran").exists()  # nothing from the file ran
    audit = fsdpcheck.audit(d)
    assert sorted((f.key, f.kind, f.message) for f in audit.findings) == sorted(problems)
    compared = fsdpcheck.compare_checkpoints(d, folders["safetensors"])
    assert {f.kind for f in compared.findings} == set(compare_kinds), str(compared)
    assert {f.key for f in compared.findings} == {k for k, _, _ in problems}
    with pytest.raises(CheckpointError) as err:
        fsdpcheck.fingerprint_checkpoint(d)
    assert "\n" not in str(err.value) and "refusing" in str(err.value)


def test_bad_index_is_one_line(folders: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(folders["bin"], d)
    (d / INDEX).write_text('{"weight_map": {"a": 3}}')
    with pytest.raises(CheckpointError) as err:
        open_source(d)
    assert str(err.value) == (
        f"torch.save index {d / INDEX}: weight_map['a'] is 3, not a file name"
    )


def test_shard_changed_after_opening(folders: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(folders["bin"], d)
    source = open_source(d)
    f = _shard_of(d, "lm_head.weight")
    held = torch.load(f, weights_only=True)
    held["lm_head.weight"] = held["lm_head.weight"][:3].clone()
    torch.save(held, f)
    with pytest.raises(CheckpointError) as err:
        source.read([Region("lm_head.weight", (0, 0), (3, 32))], torch.device("cpu"))
    assert str(err.value) == (
        f"torch.save index {d / INDEX}: {f.name} changed since it was opened: lm_head.weight is "
        "no longer (64, 32) torch.float32; refusing to read it"
    )


# ------------------------------------------------------------------------------ bounded
@pytest.mark.slow
def test_more_shard_files_than_descriptors(tmp_path: Path) -> None:
    """More shard files than descriptors: 400 .bin shards and 400 HuggingFaceStorageWriter
    files, read with at most 64 descriptors open (a reader that kept one per file would fail)."""
    from safetensors.torch import save_file

    n = 400
    full = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)
    (tmp_path / "bin").mkdir()
    (tmp_path / "hf").mkdir()
    index = {}
    for i in range(n):
        name = f"pytorch_model-{i + 1:05d}-of-{n:05d}.bin"
        torch.save({f"w.{i}": full[i].clone()}, tmp_path / "bin" / name)
        index[f"w.{i}"] = name
        save_file(
            {"w": full[i : i + 1].clone()},
            tmp_path / "hf" / f"shard-{i + 1:05d}-model-00001-of-00001.safetensors",
            metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [i, 0]}})},
        )
    (tmp_path / "bin" / INDEX).write_text(json.dumps({"weight_map": index}))
    script = textwrap.dedent(
        f"""
        import resource, torch, fsdpcheck
        from fsdpcheck.reading.references import open_source
        from fsdpcheck.sources.base import Region
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        for name in ("bin", "hf"):
            path = {str(tmp_path)!r} + "/" + name
            assert fsdpcheck.compare_checkpoints(path, path).ok
            print(name, len(fsdpcheck.fingerprint_checkpoint(path)))
        whole = Region("w", (0, 0), ({n}, 4))
        (whole,) = open_source({str(tmp_path / "hf")!r}).read([whole], torch.device("cpu"))
        assert torch.equal(whole, torch.arange({n} * 4, dtype=torch.float32).reshape({n}, 4))
        print("ok")
        """
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["bin", str(n), "hf", "1", "ok"]
