"""No code from a checkpoint runs; broken and hostile files are refused with one clear line.

Every hostile case has a control showing that the payload is live (an unrestricted load runs
it), so a test cannot pass because the payload was inert.
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import fsdpcheck
from fsdpcheck.errors import CheckpointError, CoverageError
from fsdpcheck.sources.base import Region
from fsdpcheck.sources.dcp.load import SafeFileSystemReader, SafeLoadPlanner
from fsdpcheck.sources.dcp.source import DCPSource
from fsdpcheck.sources.memory import MemorySource
from fsdpcheck.sources.merged import MergedSource
from fsdpcheck.sources.safetensors_files import SafetensorsSource
from fsdpcheck.sources.tiling import uncovered
from fsdpcheck.sources.torch_save import TorchSaveSource
from tests.fuzz_cases import (
    Planted,
    bounded,
    compare_checkpoints,
    edit_metadata,
    release_fifo,
    save_dcp,
    tiny_state,
)

CPU = torch.device("cpu")


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text.strip(), f"not one line: {text!r}"
    return text


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


@pytest.fixture
def canary(tmp_path):
    c = tmp_path / "CANARY"
    yield c
    assert not c.exists(), "code from the checkpoint ran"


@pytest.fixture
def hostile_metadata(tmp_path, canary):
    """A real checkpoint whose .metadata also carries a payload (in planner_data)."""
    p = save_dcp(tmp_path / "ck")
    edit_metadata(p, lambda md: md.planner_data.update(x=Planted(canary)))
    return p


# ---------------------------------------------------------------------------------------------
# 1. No code runs: a hostile .metadata.
def test_hostile_metadata_payload_is_live(hostile_metadata, canary):
    pickle.loads((hostile_metadata / ".metadata").read_bytes())  # the control: it runs
    assert canary.exists()
    canary.unlink()


def test_hostile_metadata_refused_by_source(hostile_metadata, canary):
    with pytest.raises(ValueError, match=r"names (io|builtins)\.open") as e:
        DCPSource(hostile_metadata)
    assert ".metadata" in one_line(e.value)


def test_hostile_metadata_audit(hostile_metadata, canary):
    r = fsdpcheck.audit(hostile_metadata)
    assert not r.ok
    assert any("io.open" in f.message for f in r.findings)


def test_hostile_metadata_fingerprint_checkpoint(hostile_metadata, canary):
    with pytest.raises(ValueError, match=r"names (io|builtins)\.open"):
        fsdpcheck.fingerprint_checkpoint(hostile_metadata)


def test_hostile_metadata_compare_checkpoints(hostile_metadata, canary, tmp_path):
    good = save_dcp(tmp_path / "good")
    for a, b in ((hostile_metadata, good), (good, hostile_metadata)):
        try:
            r = compare_checkpoints(a, b)
        except ValueError as exc:
            assert "io.open" in str(exc)
        else:
            assert not r.ok


def test_hostile_metadata_verify(hostile_metadata, canary):
    try:
        r = fsdpcheck.verify(model(), hostile_metadata)
    except ValueError as exc:
        assert "io.open" in str(exc)
    else:
        assert not r.ok


def test_hostile_metadata_dcp_load_with_safe_reader(hostile_metadata, canary):
    state = tiny_state(seed=1)
    with warnings.catch_warnings(), pytest.raises(BaseException) as e:
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeFileSystemReader(hostile_metadata),
                 planner=SafeLoadPlanner(), no_dist=True)  # fmt: skip
    assert "io.open" in str(e.value)
    assert torch.equal(state["model"]["0.weight"], tiny_state(seed=1)["model"]["0.weight"])


# ---------------------------------------------------------------------------------------------
# 1. No code runs: a hostile BYTE_IO value (a non-tensor entry).
@pytest.fixture
def hostile_bytes(tmp_path, canary):
    state = tiny_state()
    state["extra"] = Planted(canary)  # DCP stores non-tensors as torch.save'd BYTE_IO blobs
    return save_dcp(tmp_path / "ck", state)


def test_hostile_bytes_payload_is_live(hostile_bytes, canary):
    state = tiny_state(seed=1)
    state["extra"] = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(hostile_bytes), no_dist=True)  # torch's defaults
    assert canary.exists()
    canary.unlink()


def test_hostile_bytes_refused_by_source(hostile_bytes, canary):
    src = DCPSource(hostile_bytes)
    assert src.read_objects(["optim.param_groups.0.lr"]) == {"optim.param_groups.0.lr": 0.01}
    with pytest.raises(CheckpointError, match="weights_only") as e:
        src.read_object("extra")
    assert "extra" in one_line(e.value)


@pytest.mark.parametrize("planner", ["safe", "torch-default"])
def test_hostile_bytes_dcp_load_with_safe_reader(hostile_bytes, canary, planner):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = tiny_state(seed=1)
    state["extra"] = None
    plan = SafeLoadPlanner() if planner == "safe" else DefaultLoadPlanner()
    with warnings.catch_warnings(), pytest.raises(BaseException) as e:
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeFileSystemReader(hostile_bytes), planner=plan,
                 no_dist=True)  # fmt: skip
    assert "weights_only" in str(e.value)


def test_safe_reader_loads_a_clean_checkpoint_exactly(tmp_path):
    truth = tiny_state()
    truth["extra"] = {"epoch": 3, "name": "run"}
    truth["cl"] = torch.arange(24.0).reshape(1, 2, 3, 4).to(memory_format=torch.channels_last)
    truth["empty"] = torch.zeros(0, 3)
    truth["scalar"] = torch.tensor(2.5)
    p = save_dcp(tmp_path / "ck", truth)
    state = tiny_state(seed=1)
    state.update(extra={"epoch": 0, "name": ""}, cl=torch.zeros(1, 2, 3, 4), empty=torch.ones(0, 3),
                 scalar=torch.tensor(0.0))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeFileSystemReader(p), planner=SafeLoadPlanner(),
                 no_dist=True)  # fmt: skip
    assert state["extra"] == {"epoch": 3, "name": "run"}
    for k in ("0.weight", "0.bias", "2.weight"):
        assert torch.equal(state["model"][k], truth["model"][k])
    assert torch.equal(state["cl"], truth["cl"]) and torch.equal(state["scalar"], truth["scalar"])
    exp_avg = state["optim"]["state"]["0.weight"]["exp_avg"]
    assert torch.equal(exp_avg, truth["optim"]["state"]["0.weight"]["exp_avg"])
    src = DCPSource(p)
    assert src.problems() == [] and src.is_sharded and src.requires_grad("model.0.weight") is None
    (got,) = src.read([Region("model.0.weight", (2, 1), (3, 4))], CPU)
    assert torch.equal(got, truth["model"]["0.weight"][2:5, 1:5])


def test_torch_save_is_loaded_weights_only(tmp_path, canary):
    f = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2), "x": Planted(canary)}, f)
    with pytest.raises(CheckpointError, match=r"WeightsUnpickler error") as e:
        TorchSaveSource(f)
    assert "\x1b" not in one_line(e.value)


# ---------------------------------------------------------------------------------------------
# 2. The safetensors index is the authority.
def _shards(tmp_path: Path, weight_map: dict[str, str], files: dict[str, dict]) -> Path:
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    for name, tensors in files.items():
        save_file(tensors, str(d / name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


@pytest.mark.parametrize("name", ["../outside.safetensors", "/abs/outside.safetensors"])
def test_index_entry_outside_the_folder(tmp_path, name):
    from safetensors.torch import save_file

    save_file({"b": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    d = _shards(
        tmp_path, {"a": "s1.safetensors", "b": name}, {"s1.safetensors": {"a": torch.ones(3)}}
    )
    src = SafetensorsSource.from_path(d)
    assert set(src.entries()) == {"a"}
    assert [(k, kind) for k, kind, _ in src.problems()] == [("b", "error")]
    assert "outside" in src.problems()[0][2] or "absolute" in src.problems()[0][2]
    r = fsdpcheck.audit(d)
    assert [(f.key, f.kind) for f in r.findings] == [("b", "error")]


def test_index_entry_through_a_symlink_out_of_the_folder(tmp_path):
    from safetensors.torch import save_file

    save_file({"b": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    d = _shards(tmp_path, {"a": "s1.safetensors", "b": "link.safetensors"},
                {"s1.safetensors": {"a": torch.ones(3)}})  # fmt: skip
    (d / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    src = SafetensorsSource.from_path(d)
    assert set(src.entries()) == {"a"} and "link" in src.problems()[0][2]


def test_index_names_a_tensor_its_shard_lacks(tmp_path):
    d = _shards(tmp_path, {"a": "s1.safetensors", "b": "s1.safetensors"},
                {"s1.safetensors": {"a": torch.ones(3)}})  # fmt: skip
    src = SafetensorsSource.from_path(d)
    assert set(src.entries()) == {"a"}
    (key, kind, msg) = src.problems()[0]
    assert (key, kind) == ("b", "error") and "no such tensor" in msg
    assert not fsdpcheck.audit(d).ok


def test_stray_copy_in_another_shard_is_a_finding_and_reads_follow_the_index(tmp_path):
    right, stray = torch.arange(4.0), torch.zeros(4)
    files = {"s1.safetensors": {"a": right}, "s2.safetensors": {"a": stray, "b": right}}
    d = _shards(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"}, files)
    src = SafetensorsSource.from_path(d)
    (got,) = src.read([Region("a", (0,), (4,))], CPU)
    assert torch.equal(got, right)
    # The stray copy is named as what it is (another shard's copy), not as the listed tensor.
    assert [(k, kind) for k, kind, _ in src.problems()] == [("s2.safetensors/a", "error")]
    assert "stray copy" in src.problems()[0][2] and "s2.safetensors" in src.problems()[0][2]
    r = fsdpcheck.audit(d)
    assert [(f.key, f.kind) for f in r.findings] == [("s2.safetensors/a", "error")]
    # compare reads the copy the index names: `a` is compared (and differs), not skipped.
    other = {"a": right.clone(), "b": right.clone()}
    other["a"][2] = 7.0
    r = fsdpcheck.compare_checkpoints(d, other)
    assert [(f.key, f.kind) for f in r.findings] == [("a", "value"),
                                                    ("s2.safetensors/a", "error")]  # fmt: skip
    assert r.findings[0].max_abs_index == (2,) and r.keys_checked == 2


def test_folder_without_index_duplicate_key_names_both_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "y.safetensors"))
    src = SafetensorsSource.from_path(tmp_path)
    (key, kind, msg) = src.problems()[0]
    assert (key, kind) == ("a", "error") and "x.safetensors" in msg and "y.safetensors" in msg
    with pytest.raises(CheckpointError, match=r"y\.safetensors"):
        src.read([Region("a", (0,), (2,))], CPU)


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(torch.uint32, "U32"), (torch.uint16, "U16"), (torch.uint64, "U64"),
     (torch.complex64, "C64"), (torch.float8_e8m0fnu, "F8_E8M0")],
)  # fmt: skip
def test_unsupported_safetensors_dtype_is_named_when_opening(tmp_path, dtype, name):
    from safetensors.torch import save_file

    f = tmp_path / "m.safetensors"
    save_file({"ok": torch.ones(2), "odd": torch.zeros(3, dtype=dtype)}, str(f))
    with pytest.raises(CheckpointError) as e:
        SafetensorsSource.from_path(f)
    msg = one_line(e.value)
    assert str(f) in msg and "odd" in msg and name in msg


def test_safetensors_header_past_the_end_of_the_file(tmp_path):
    import struct

    from safetensors.torch import save_file

    f = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(4.0)}, str(f))
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["a"].update(shape=[400], data_offsets=[0, 1600])
    h = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])
    with pytest.raises(CheckpointError, match=str(f)) as e:
        SafetensorsSource.from_path(f)
    one_line(e.value)


# ---------------------------------------------------------------------------------------------
# 3. Coverage before data: a gap in .metadata.
@pytest.fixture
def gapped(tmp_path):
    p = save_dcp(tmp_path / "ck")

    def drop_rows(md):  # keep rows 0:4 of the 7x5 weight: rows 4:7 are saved by no chunk
        md.state_dict_metadata["model.0.weight"].chunks = [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 5]))
        ]

    edit_metadata(p, drop_rows)
    return p


def test_gap_is_a_problem_and_never_read(gapped):
    truth = tiny_state()["model"]["0.weight"]
    src = DCPSource(gapped)
    assert src.problems() == [
        ("model.0.weight", "gap", "gap at [4:7] (no chunk covers these rows): no saved chunk "
         "holds this region")
    ]  # fmt: skip
    with pytest.raises(CoverageError) as e:
        src.read([Region("model.0.weight", (0, 0), (7, 5))], CPU)
    msg = one_line(e.value)
    assert "model.0.weight" in msg and "[4:7, 0:5]" in msg and ".metadata" in msg
    with pytest.raises(CoverageError):
        src.read([Region("model.0.weight", (3, 2), (2, 1))], CPU)  # one row inside the gap
    (got,) = src.read([Region("model.0.weight", (1, 0), (3, 5))], CPU)  # covered: exact data
    assert torch.equal(got, truth[1:4])
    assert src.chunks("model.0.weight") == [((0, 0), (4, 5))]


def test_gap_in_audit_fingerprint_and_compare(gapped, tmp_path):
    r = fsdpcheck.audit(gapped)
    assert [(f.key, f.kind) for f in r.findings] == [("model.0.weight", "gap")]
    good = save_dcp(tmp_path / "good")
    try:
        fps = fsdpcheck.fingerprint_checkpoint(gapped)
    except ValueError as exc:
        assert "gap" in str(exc)
    else:  # never the fingerprint of the whole tensor as if the gap held data
        assert fps.get("0.weight") != fsdpcheck.fingerprint_checkpoint(good).get("0.weight")
    try:
        rep = compare_checkpoints(gapped, good)
    except ValueError as exc:
        assert "gap" in str(exc) or "not covered" in str(exc)
    else:
        assert not rep.ok


def test_storage_entry_outside_the_directory_or_past_the_end(tmp_path):
    p = save_dcp(tmp_path / "ck")
    (tmp_path / "outside.distcp").write_bytes((p / "__0_0.distcp").read_bytes())

    def escape(md):
        for idx, info in md.storage_data.items():
            if idx.fqn == "model.0.bias":
                info.relative_path = "../outside.distcp"
            if idx.fqn == "model.0.weight":
                info.offset = 10**9

    edit_metadata(p, escape)
    src = DCPSource(p)
    probs = {k: m for k, _, m in src.problems()}
    assert "outside the checkpoint" in probs["model.0.bias"]
    assert "truncated" in probs["model.0.weight"]
    for key, size in (("model.0.bias", (7,)), ("model.0.weight", (7, 5))):
        with pytest.raises(CheckpointError, match=key) as e:
            src.read([Region(key, (0,) * len(size), size)], CPU)
        one_line(e.value)
    (ok,) = src.read([Region("model.2.weight", (0, 0), (3, 7))], CPU)
    assert torch.equal(ok, tiny_state()["model"]["2.weight"])


def _second_entry_for_a_chunk(p: Path) -> None:
    """Appends to ``.metadata``'s pickle a storage entry stored under another key, then renamed.

    The key is changed (a second BUILD of the same object) after the dict stored it, so the dict
    holds two equal keys under different hashes: DCP's lookups find the original entry while a
    check that walked the entries would see the hostile one (pointing outside the directory).
    """
    f = p / ".metadata"
    md = pickle.loads(f.read_bytes())  # trusted test-side read of a real save
    raw = pickle.dumps(md, protocol=2)
    ops = list(pickletools.genops(raw))
    # The memo slot of the storage_data dict: 'storage_data' (memoized), EMPTY_DICT, BINPUT n.
    names = [op.name for op, _, _ in ops]
    at = next(i for i, (_, arg, _) in enumerate(ops) if arg == "storage_data")
    at = names.index("EMPTY_DICT", at)
    memo = ops[at + 1][1]
    assert names[at + 1] in ("BINPUT", "LONG_BINPUT") and isinstance(memo, int)
    assert raw.endswith(b".")

    def text(s: str) -> bytes:
        return b"X" + struct.pack("<I", len(s)) + s.encode()

    module = b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\n"
    info = b"ctorch.distributed.checkpoint.filesystem\n_StorageInfo\n"
    offset = b"K\x00\x85"  # the tuple (0,)
    tail = (
        b"h" + bytes([memo]) if memo < 256 else b"j" + struct.pack("<I", memo)
    ) + (  # storage_data
        module + b")\x81}(" + text("fqn") + text("zzz") + text("offset") + offset + b"ub"
        + b"r" + struct.pack("<I", 60000)  # the key, memoized
        + info + b")\x81}(" + text("relative_path") + text("../outside.distcp")
        + text("offset") + b"K\x00" + text("length") + b"M\x00\x04" + b"ub"
        + b"s0"  # storage_data[key] = info; drop the dict
        + b"j" + struct.pack("<I", 60000) + b"}(" + text("fqn") + text("model.0.bias") + b"ub0"
    )  # fmt: skip
    f.write_bytes(raw[:-1] + tail + b".")


def test_a_storage_entry_renamed_after_it_was_stored_is_refused(tmp_path: Path) -> None:
    p = save_dcp(tmp_path / "ck")
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 1024)
    _second_entry_for_a_chunk(p)
    trusting = pickle.loads((p / ".metadata").read_bytes())
    keys = [i for i in trusting.storage_data if i.fqn == "model.0.bias"]
    assert len(keys) == 2 and keys[0] == keys[1]  # the attack is in place
    for attempt in (lambda: DCPSource(p), lambda: SafeFileSystemReader(p).read_metadata()):
        with pytest.raises(CheckpointError, match="two storage entries") as e:
            attempt()
        one_line(e.value)
    report = fsdpcheck.audit(p)
    assert not report.ok and any("two storage entries" in f.message for f in report.findings)


def test_self_referencing_or_exponentially_shared_metadata_gives_a_short_error(
    tmp_path: Path,
) -> None:
    from fsdpcheck.sources.dcp.metadata import read_dcp_metadata, validate_metadata

    p = save_dcp(tmp_path / "ck")
    md = read_dcp_metadata(p)
    chunk = md.state_dict_metadata["model.0.weight"].chunks[0]
    chunk.offsets = chunk  # a cycle: its repr must not recurse
    with pytest.raises(CheckpointError, match="chunk offsets is ChunkStorageMetadata") as e:
        validate_metadata(md, "m")
    assert len(one_line(e.value)) < 400
    md = read_dcp_metadata(p)
    shared: list = ["x"]
    for _ in range(60):  # 2**60 leaves if printed in full
        shared = [shared, shared]
    md.planner_data = {"model.0.bias": ["model", shared]}
    with pytest.raises(CheckpointError, match="not made of names") as e:
        bounded(lambda: validate_metadata(md, "m"), 10)
    assert len(one_line(e.value)) < 400


@pytest.mark.slow
def test_deeply_nested_metadata_is_refused_not_a_crash(tmp_path: Path) -> None:
    """2 MB of TUPLE1 opcodes: a tuple nested 2M deep, hashed as a dict key while unpickling.

    The hash recurses in C without Python's recursion check; on an 8 MiB stack the process
    would die of SIGSEGV. Run in a child so that a crash fails this test, not the session.
    """
    import subprocess
    import sys

    d = tmp_path / "deep"
    d.mkdir()
    (d / ".metadata").write_bytes(b"\x80\x04}" + b")" + b"\x85" * 2_000_000 + b"K\x01s.")
    code = (
        "import sys\nfrom fsdpcheck.sources.dcp.source import DCPSource\n"
        "from fsdpcheck.errors import CheckpointError\n"
        "try:\n    DCPSource(sys.argv[1])\nexcept CheckpointError as e:\n    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "holds a dict, not DCP Metadata" in done.stdout


@pytest.mark.slow
def test_deeply_nested_torch_save_is_read_not_a_crash(tmp_path: Path) -> None:
    """The same nesting in a torch.save file's data.pkl (torch's weights-only unpickler)."""
    import io
    import subprocess
    import sys
    import zipfile

    buf = io.BytesIO()
    torch.save({"a": torch.ones(2)}, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z, zipfile.ZipFile(out, "w") as w:
        for info in z.infolist():
            data = z.read(info.filename)
            if info.filename.endswith("data.pkl"):  # {((...(),...),): 1}, 2M levels
                data = b"\x80\x02}" + b")" + b"\x85" * 2_000_000 + b"K\x01s."
            w.writestr(info, data)
    f = tmp_path / "deep.pt"
    f.write_bytes(out.getvalue())
    code = (
        "import sys\nfrom fsdpcheck.sources.torch_save import TorchSaveSource\n"
        "s = TorchSaveSource(sys.argv[1])\nprint(sorted(s.entries()), s.problems())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(f)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    # Loaded: one non-tensor entry, named by a bounded repr of its key.
    assert done.stdout == "['((((...),),),)'] []\n", done.stdout


def test_chunk_declaring_more_elements_than_its_bytes(tmp_path):
    p = save_dcp(tmp_path / "ck")

    def grow(md):  # a 2**40-element tensor whose one chunk is stored in ~1.5 kB
        meta = md.state_dict_metadata["model.0.bias"]
        meta.size = torch.Size([2**40])
        meta.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([2**40]))]

    edit_metadata(p, grow)
    src = DCPSource(p)
    assert any(k == "model.0.bias" and "declares" in m for k, _, m in src.problems())
    with pytest.raises(CheckpointError, match="declares"):
        bounded(lambda: src.read([Region("model.0.bias", (0,), (2**40,))], CPU), 30)


# ---------------------------------------------------------------------------------------------
# 4. Non-regular files and declared sizes.
def test_fifo_named_model_pt_is_refused_without_blocking(tmp_path):
    f = tmp_path / "model.pt"
    os.mkfifo(f)
    with pytest.raises(CheckpointError, match="is a FIFO") as e:
        bounded(lambda: TorchSaveSource(f), 20, release_fifo(f))
    one_line(e.value)
    with pytest.raises(ValueError, match=r"FIFO|not a regular file") as e:
        bounded(lambda: fsdpcheck.fingerprint_checkpoint(f), 20, release_fifo(f))
    one_line(e.value)


def test_fifo_named_distcp_is_refused_without_blocking(tmp_path):
    p = save_dcp(tmp_path / "ck")
    (p / "__0_0.distcp").unlink()
    os.mkfifo(p / "__0_0.distcp")
    unblock = release_fifo(p / "__0_0.distcp")
    src = bounded(lambda: DCPSource(p), 20, unblock)
    assert all(kind == "error" and "FIFO" in m for _, kind, m in src.problems())
    with pytest.raises(CheckpointError, match="FIFO"):
        bounded(lambda: src.read([Region("model.0.bias", (0,), (7,))], CPU), 20, unblock)
    r = bounded(lambda: fsdpcheck.audit(p), 20, unblock)
    assert not r.ok and all("FIFO" in f.message for f in r.findings)


def test_fifo_metadata_is_refused(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    os.mkfifo(d / ".metadata")
    with pytest.raises(CheckpointError, match="FIFO"):
        bounded(lambda: DCPSource(d), 20, release_fifo(d / ".metadata"))


def test_expanded_tensor_in_torch_save_is_refused_in_bounded_time(tmp_path):
    f = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3), "big": torch.zeros(1).expand(2**36)}, f)
    assert f.stat().st_size < 4096
    src = TorchSaveSource(f)
    assert [(k, kind) for k, kind, _ in src.problems()] == [("big", "error")]
    with pytest.raises(CheckpointError, match="expanded") as e:
        src.read([Region("big", (0,), (2**36,))], CPU)
    one_line(e.value)
    (w,) = src.read([Region("w", (0,), (3,))], CPU)
    assert torch.equal(w, torch.ones(3))

    def fingerprint():
        try:
            fps = fsdpcheck.fingerprint_checkpoint(f)
        except ValueError as exc:
            return exc
        assert "big" not in fps  # never a fingerprint of 2**36 stride-0 reads
        return fps

    bounded(fingerprint, 60)
    other = tmp_path / "other.pt"
    torch.save({"w": torch.ones(3), "big": torch.zeros(2**10)}, other)

    def compare():
        try:
            rep = compare_checkpoints(f, other)
        except ValueError as exc:
            return exc
        assert not rep.ok
        return rep

    bounded(compare, 60)


class _Huge:
    """torch.save's pickle of a tensor declaring 2**40 elements on a 4-element storage."""

    def __init__(self) -> None:
        self.storage = torch.zeros(4).untyped_storage()

    def __reduce_ex__(self, proto):
        from collections import OrderedDict

        from torch._utils import _rebuild_tensor_v2

        typed = torch.storage.TypedStorage(wrap_storage=self.storage, dtype=torch.float32,
                                           _internal=True)  # fmt: skip
        return (_rebuild_tensor_v2, (typed, 0, (2**40,), (1,), False, OrderedDict()))


def test_absurdly_large_declared_tensor_is_refused(tmp_path):
    f = tmp_path / "model.pt"
    torch.save({"big": _Huge()}, f)
    with pytest.raises(CheckpointError) as e:
        bounded(lambda: TorchSaveSource(f), 30)
    assert str(f) in one_line(e.value)


# ---------------------------------------------------------------------------------------------
# 5. audit: no input is not a finding.
def test_audit_of_nothing_is_unreadable_input(tmp_path):
    with pytest.raises(FileNotFoundError):
        fsdpcheck.audit(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        fsdpcheck.audit(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="holds no checkpoint"):
        fsdpcheck.audit(tmp_path / "other")


# ---------------------------------------------------------------------------------------------
# The Source protocol, without getattr probing.
def test_source_protocol_defaults_and_merging(tmp_path):
    m = model()
    m[2].bias.requires_grad_(False)
    mem = MemorySource(m)
    assert mem.requires_grad("0.weight") is True and mem.requires_grad("2.bias") is False
    assert mem.chunks("0.weight") == [((0, 0), (7, 5))] and not mem.is_sharded
    assert mem.problems() == []
    d = save_dcp(tmp_path / "ck", {"x": torch.ones(2, 2)})
    merged = MergedSource([mem, DCPSource(d)])
    assert merged.is_sharded and merged.chunks("x") == [((0, 0), (2, 2))]
    assert merged.requires_grad("2.bias") is False and merged.requires_grad("x") is None


def test_uncovered_names_the_missing_boxes():
    grid = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    assert uncovered(((0, 0), (4, 6)), grid) == []
    assert uncovered(((1, 1), (2, 4)), grid[:3]) == [((2, 3), (1, 2))]
    assert uncovered(((0, 0), (4, 6)), grid[:2]) == [((2, 0), (2, 6))]
    # Overlapping boxes whose volumes add up to the region's still leave a gap.
    assert uncovered(((0,), (4,)), [((0,), (2,)), ((1,), (2,))]) == [((3,), (1,))]
    assert uncovered(((0,), (0,)), []) == []
