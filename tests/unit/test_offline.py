"""The offline read paths give exactly what the safe slow paths give, and find planted faults.

Raw DCP chunks (byte ranges straight into the destination) against the safe reader (torch.load
weights_only of each blob); safetensors compared in place from the mapping against get_slice;
torch.save views; blocks and batches cut by tiny memory budgets; the prefetch pipeline's order
and errors (its stream/event protocol: tests/unit/test_prefetch.py).
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpcheck.box import Box
from fsdpcheck.comparison import compare_checkpoints
from fsdpcheck.errors import CheckpointError
from fsdpcheck.fingerprints import fingerprint_checkpoint
from fsdpcheck.kernels import fingerprint_tensor
from fsdpcheck.sources.base import Region
from fsdpcheck.sources.dcp.source import DCPSource
from fsdpcheck.sources.memory import MemorySource
from fsdpcheck.sources.prefetch import Prefetcher
from fsdpcheck.sources.safetensors_files import SafetensorsSource
from fsdpcheck.sources.torch_save import TorchSaveSource
from fsdpcheck.verification import verify

CPU = torch.device("cpu")
WORLD = 4


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(10, 6, generator=g).to(torch.bfloat16),  # rows 3, 3, 3, 1
        "c": torch.randn(5, 9, generator=g),  # Shard(1): columns 3, 3, 3, 0
        "e": torch.randint(-9, 9, (3, 4), generator=g, dtype=torch.int64),  # rows 1, 1, 1, 0
        "f8": torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn),
    }


def _save_sharded(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sd = {}
        for k, v in _full().items():
            # Each rank's torch.chunk share, built locally (gloo cannot scatter float8).
            dim = 1 if k == "c" else 0
            step = -(-v.shape[dim] // world)
            start = min(rank * step, v.shape[dim])
            local = v.narrow(dim, start, min(v.shape[dim], start + step) - start).clone()
            sd[k] = DTensor.from_local(
                local, mesh, [Shard(dim)], run_check=False, shape=v.shape, stride=v.stride()
            )
        dcp.save(sd, checkpoint_id=path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-rank DCP save (uneven, empty and column chunks); one spawn for the module."""
    from fsdpcheck._spawn import spawn

    path = tmp_path_factory.mktemp("offline") / "dcp4"
    spawn(_save_sharded, WORLD, (str(path),), timeout=120)
    assert (path / ".metadata").exists(), "the 4-rank save failed"
    return path


def _odd() -> dict[str, torch.Tensor]:
    """Single-process save: a transposed (non-contiguous) tensor, 0-d, bool, odd sizes."""
    g = torch.Generator().manual_seed(2)
    return {
        "t": torch.randn(7, 5, generator=g).t(),  # saved with strides (1, 5)
        "s": torch.tensor(3.25, dtype=torch.float64),
        "b": torch.rand(13, generator=g) > 0.5,
        "h": torch.randn(3, 3, generator=g).to(torch.float16),
        "i8": torch.randint(-100, 100, (17,), generator=g, dtype=torch.int8),
        "bf": torch.randn(9, 7, generator=g).to(torch.bfloat16),
    }


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("offline") / "dcp1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_odd(), checkpoint_id=str(path), no_dist=True)
    return path


def _regions(full: dict[str, torch.Tensor]) -> list[Region]:
    """Whole tensors, regions straddling chunk boundaries, column windows, single elements."""
    out = []
    for k, v in full.items():
        shape = tuple(v.shape)
        out.append(Region(k, (0,) * v.dim(), shape))
        if v.dim() == 2 and shape[0] > 2 and shape[1] > 2:
            out.append(Region(k, (1, 1), (shape[0] - 2, shape[1] - 2)))
            out.append(Region(k, (shape[0] - 1, shape[1] - 1), (1, 1)))
            out.append(Region(k, (2, 0), (min(4, shape[0] - 2), shape[1])))
    return out


def _view(t: torch.Tensor, r: Region) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(r.offset, r.size))] if r.size else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (exact comparison whatever the dtype: -0.0, NaN payloads, float8)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["sharded", "single"])
@pytest.mark.parametrize("use_out", [False, True])
def test_raw_dcp_reads_equal_safe_reader_and_truth(
    which: str, use_out: bool, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(which)
    full = _full() if which == "sharded" else _odd()
    regions = _regions(full)
    fast, slow = DCPSource(path), DCPSource(path)
    slow.raw_reads = False
    try:
        in_place = filled = misaligned = 0
        for r in regions:
            dtype = full[r.key].dtype
            outs = [torch.full(r.size, 7, dtype=torch.float32).to(dtype)] if use_out else None
            # read_views may hand over the mapped file; read never does (its result is kept).
            (got,) = fast.read_views([r], outs) if outs is not None else fast.read([r], CPU)
            (ref,) = slow.read([r], CPU, None)
            if outs is not None:
                (kept,) = fast.read([r], CPU, [torch.empty_like(outs[0])])
                assert torch.equal(_bits(kept), _bits(got)) and kept.data_ptr() != got.data_ptr()
            want = _view(full[r.key], r)
            assert torch.equal(_bits(got), _bits(want)), r
            assert torch.equal(_bits(ref), _bits(want)), r
            fast.check_views()
            if outs is not None:
                in_place += got is not outs[0]  # a view of the mapped file
                filled += got is outs[0]  # byte-range read (a region over several chunks)
                misaligned += got is not outs[0] and got.data_ptr() % got.element_size() != 0
        # Every region inside one chunk is handed over where it lies, misaligned ones too (DCP
        # writes chunks back to back); only the sharded save has regions over several chunks.
        assert not use_out or (in_place and misaligned and bool(filled) == (which == "sharded"))
        # The fast path was taken for every non-empty chunk (else this test proves nothing).
        assert fast._raw and all(rc is not None for rc, _ in fast._raw.values())
        assert not slow._raw
        if which == "single":
            t = next(rc for (key, _), (rc, _) in fast._raw.items() if key == "t")
            assert t is not None and not t.row_major and t.stride == (1, 5)
        # Chunks whose bytes start at an offset that is not a multiple of the page size, nor of
        # the element size, are among those read.
        offsets = [rc.data_offset for rc, _ in fast._raw.values() if rc is not None]
        assert any(o % 4096 for o in offsets)
        items = [rc.dtype.itemsize for rc, _ in fast._raw.values() if rc is not None]
        assert any(o % i for o, i in zip(offsets, items) if i > 1)
    finally:
        fast.close()
        slow.close()


@pytest.mark.slow  # its fixture spawns 4 ranks
def test_raw_dcp_batch_read_into_an_arena_and_noncontiguous_out(sharded: Path) -> None:
    from fsdpcheck.readplan import Arena

    full = _full()
    regions = _regions(full)
    src = DCPSource(sharded)
    try:
        outs = Arena().carve(CPU, [(r.size, full[r.key].dtype) for r in regions])
        got = src.read(regions, CPU, outs)
        for r, g in zip(regions, got):
            assert torch.equal(_bits(g), _bits(_view(full[r.key], r)))
        # A destination that is itself a strided view (filled in place, not replaced).
        r = Region("c", (0, 0), (5, 9))
        big = torch.zeros(9, 5).t()
        (g,) = src.read([r], CPU, [big])
        assert g is big and torch.equal(big, full["c"])
    finally:
        src.close()


def test_raw_dcp_file_shrinking_after_open_raises(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.arange(4096.0)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    src = DCPSource(tmp_path / "d")
    try:
        data = next((tmp_path / "d").glob("*.distcp"))
        os.truncate(data, data.stat().st_size // 2)
        with pytest.raises(CheckpointError, match=r"bytes could be read|cannot load|truncated"):
            src.read([Region("x", (0,), (4096,))], CPU)
    finally:
        src.close()


def _metadata_summary(md: Any) -> tuple[Any, ...]:
    """Everything fsdpcheck reads from DCP metadata, as plain values (mirror or DCP classes)."""
    from fsdpcheck.sources.dcp.metadata import is_tensor_meta, position

    sdm = {}
    for key, m in md.state_dict_metadata.items():
        if is_tensor_meta(m):
            p = m.properties
            props = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks]
            sdm[key] = ("tensor", props, tuple(m.size), chunks)
        else:
            sdm[key] = ("bytes", type(m).__name__)
    storage = {
        position(i): (s.relative_path, s.offset, s.length, s.transform_descriptors)
        for i, s in md.storage_data.items()
    }
    sm = md.storage_meta
    meta = None if sm is None else (str(sm.checkpoint_id), sm.save_id, list(sm.modules))
    return sdm, md.planner_data, storage, meta, getattr(md, "version", None)


@pytest.mark.slow  # its fixture spawns 4 ranks
def test_mirror_metadata_reads_as_dcps_own_classes(
    sharded: Path, single: Path, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata as dcp_md

    from fsdpcheck._unpickle import ADMITTED
    from fsdpcheck.sources.dcp import index as dcp_index
    from fsdpcheck.sources.dcp import metadata as mirror

    # Every DCP class the unpickler admits has a mirror, so no valid file reads differently.
    admitted = {(m, n) for m, names in ADMITTED.items() for n in names if m.startswith("torch.")}
    assert admitted == set(mirror._MIRRORS)
    values = tmp_path / "values"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"x": torch.arange(6.0).view(2, 3), "step": 3, "groups": [{"lr": 0.1}]}
        dcp.save(state, checkpoint_id=str(values), no_dist=True)
    for path in (sharded, single, values):
        ours = mirror.read_dcp_metadata(path)
        theirs = mirror.read_dcp_metadata(path, dcp_classes=True)
        assert type(ours) is mirror.Metadata and type(theirs) is dcp_md.Metadata
        assert _metadata_summary(ours) == _metadata_summary(theirs), path.name
        assert _metadata_summary(ours) == _metadata_summary(
            dcp.FileSystemReader(path).read_metadata()
        )
        assert dcp_index.check_storage(path, ours) == dcp_index.check_storage(path, theirs)
        assert mirror.planner_paths(ours) == mirror.planner_paths(theirs)
    # The mirror index is equal and hashed by (fqn, offset) like DCP's, the hint ignored.
    a, b = mirror.MetadataIndex("w", [3, 0], index=1), mirror.MetadataIndex("w", (3, 0))
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1 and a != mirror.MetadataIndex("w")
    assert a != dcp_md.MetadataIndex("w", (3, 0))  # never mixed: positions bridge the two


@pytest.mark.slow
def test_dcp_offline_commands_never_import_dcp(sharded: Path, single: Path) -> None:
    """inspect, audit (deep), fingerprint and compare of raw DCP saves run without DCP's code."""
    import subprocess
    import sys

    code = f"""
import sys
import fsdpcheck
from fsdpcheck.inspection import inspect_checkpoint
for p in ({str(sharded)!r}, {str(single)!r}):
    inspect_checkpoint(p)
    fsdpcheck.fingerprint_checkpoint(p)
    assert fsdpcheck.audit(p, deep=True).findings == []
    assert fsdpcheck.compare_checkpoints(p, p).ok
bad = sorted(m for m in sys.modules if m.startswith(("torch.distributed.checkpoint",
                                                     "torch.distributed.tensor")))
assert not bad, bad
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow  # its fixture spawns 4 ranks
def test_fingerprint_dcp_equals_whole_tensor_at_any_budget(sharded: Path, single: Path) -> None:
    for path, full in ((sharded, _full()), (single, _odd())):
        want = {k: fingerprint_tensor(v) for k, v in full.items()}
        for budget in (1 << 30, 64, 1):
            got = fingerprint_checkpoint(path, memory_budget=budget)
            assert got == want, (path.name, budget)


@pytest.mark.slow  # its fixture spawns 4 ranks
def test_verify_against_dcp_raw_and_safe_agree_and_name_the_element(sharded: Path) -> None:
    live = {k: v.clone() for k, v in _full().items()}
    live["w"][7, 4] = live["w"][7, 4] + 1  # in the third chunk (rows 6..8)
    reports = []
    for raw in (True, False):
        src = DCPSource(sharded)
        src.raw_reads = raw
        try:
            reports.append(verify(live, src, memory_budget=100))
        finally:
            src.close()
    src = DCPSource(sharded)
    try:  # a budget that holds every tensor: each whole live tensor is cut along the chunks
        reports.append(verify(live, src, memory_budget=1 << 30))
    finally:
        src.close()
    fast, slow, big = reports
    assert [(f.key, f.kind) for f in fast.findings] == [("w", "value")]
    assert fast.findings[0].max_abs_index == (7, 4) and fast.findings[0].mismatched == 1
    assert fast.findings == slow.findings == big.findings
    assert fast.keys_checked == slow.keys_checked == big.keys_checked


def test_verify_cuts_local_pieces_along_saved_chunks_only_when_they_tile() -> None:
    from fsdpcheck.verification import _along_chunks

    rows = [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (4, 6))]
    assert _along_chunks((0, 0), (10, 6), rows) == rows
    assert _along_chunks((2, 0), (5, 6), rows) == [
        ((2, 0), (1, 6)),
        ((3, 0), (3, 6)),
        ((6, 0), (1, 6)),
    ]
    assert _along_chunks((4, 0), (1, 6), rows) == [((4, 0), (1, 6))]  # inside one chunk
    # A gap or an overlap: the piece stays whole, so that reading it names the problem.
    gap = [((0, 0), (3, 6)), ((4, 0), (6, 6))]
    assert _along_chunks((0, 0), (10, 6), gap) == [((0, 0), (10, 6))]
    overlap = [((0, 0), (4, 6)), ((3, 0), (7, 6)), ((0, 0), (1, 6))]
    assert _along_chunks((0, 0), (10, 6), overlap) == [((0, 0), (10, 6))]
    # Columns (a Shard(1) save) and an empty chunk.
    cols = [((0, 0), (5, 3)), ((0, 3), (5, 3)), ((0, 6), (5, 3)), ((0, 9), (5, 0))]
    assert _along_chunks((0, 0), (5, 9), cols) == cols[:3]


_ST_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int8: "I8", torch.bool: "BOOL", torch.uint8: "U8",
}  # fmt: skip


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], base_mod8: int) -> int:
    """A safetensors file written by hand, in the given order, without alignment padding.

    The header is padded with spaces so that the data starts at a byte offset that is
    `base_mod8` modulo 8; returns that offset.
    """
    header: dict[str, Any] = {}
    blobs, pos = [], 0
    for k, v in tensors.items():
        raw = bytes(v.contiguous().reshape(-1).view(torch.uint8).tolist())
        header[k] = {"dtype": _ST_NAMES[v.dtype], "shape": list(v.shape),
                     "data_offsets": [pos, pos + len(raw)]}  # fmt: skip
        blobs.append(raw)
        pos += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((base_mod8 - 8 - len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return 8 + len(text)


def test_safetensors_mapped_compare_equals_get_slice_and_finds_the_element(
    tmp_path: Path,
) -> None:
    g = torch.Generator().manual_seed(3)
    a = {
        "n": torch.randn(6, 10, generator=g),  # 240 bytes
        "odd": torch.rand(5, generator=g) > 0.5,  # 5 bytes: what follows starts at an odd offset
        "m": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "z": torch.zeros(0, 4),
    }
    b = {k: v.clone() for k, v in a.items()}
    b["n"][4, 9] = 100.0
    b["m"][32, 0] = -b["m"][32, 0] - 1
    base_a = _write_safetensors(tmp_path / "a.safetensors", a, 0)  # n aligned, m odd
    base_b = _write_safetensors(tmp_path / "b.safetensors", b, 1)  # n odd, m even
    assert base_a % 4096 and base_b % 4096  # tensors that do not start on a page
    results = []
    for mapped in (True, False):
        for budget in (1 << 30, 40):
            sa = SafetensorsSource.from_path(tmp_path / "a.safetensors")
            sb = SafetensorsSource.from_path(tmp_path / "b.safetensors")
            sa.mapped_reads = sb.mapped_reads = mapped
            r = compare_checkpoints(sa, sb, device="cpu", memory_budget=budget)
            results.append([(f.key, f.kind, f.mismatched, f.max_abs_index) for f in r.findings])
            assert r.elements_checked == sum(v.numel() for v in a.values())
    assert all(x == results[0] for x in results)
    assert results[0] == [("m", "value", 1, (32, 0)), ("n", "value", 1, (4, 9))]
    # Every tensor is read in place, at offsets that are multiples of its element size and at
    # offsets that are not (both were compared with get_slice above).
    sa = SafetensorsSource.from_path(tmp_path / "a.safetensors")
    sb = SafetensorsSource.from_path(tmp_path / "b.safetensors")
    for src, key, misaligned in (
        (sa, "n", False), (sa, "m", True), (sb, "n", True), (sb, "m", False)
    ):  # fmt: skip
        t = src._mapped_tensor(key)
        assert t is not None and (t.data_ptr() % t.element_size() != 0) == misaligned, key
        assert torch.equal(_bits(t), _bits((a if src is sa else b)[key]))
    (v,) = sa.read([Region("n", (1, 2), (3, 4))], CPU)
    assert not v.is_contiguous() and torch.equal(v, a["n"][1:4, 2:6])  # a view, no copy


def test_safetensors_file_shrinking_after_open_raises(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    f = tmp_path / "s.safetensors"
    save_file({"x": torch.arange(4096.0), "y": torch.ones(3)}, str(f))
    for mapped in (True, False):  # a read of either mapping past the end would be SIGBUS
        src = SafetensorsSource.from_path(f)
        src.mapped_reads = mapped
        (got,) = src.read([Region("x", (0,), (4096,))], CPU)
        assert torch.equal(got, torch.arange(4096.0))
        os.truncate(f, f.stat().st_size // 2)
        changed = r"s\.safetensors shrank from \d+ to \d+|s\.safetensors changed while it was read"
        with pytest.raises(CheckpointError, match=changed):
            src.read([Region("x", (0,), (4096,))], CPU)
        save_file({"x": torch.arange(4096.0), "y": torch.ones(3)}, str(f))


def test_safetensors_duplicate_header_key_is_not_mapped(tmp_path: Path) -> None:
    f = tmp_path / "d.safetensors"
    _write_safetensors(f, {"x": torch.arange(4.0)}, 0)
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8 : 8 + n].decode()
    dup = header[:-1] + ', "x": ' + json.dumps(json.loads(header)["x"]) + "}"
    f.write_bytes(struct.pack("<Q", len(dup)) + dup.encode() + raw[8 + n :])
    try:
        src = SafetensorsSource.from_path(f)
    except CheckpointError:
        return  # safetensors itself refused it: nothing is read either way
    assert src._mapped_tensor("x") is None


def test_torch_save_views_noncontiguous_and_blocks(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    full = {"t": torch.randn(12, 7, generator=g).t(), "u": torch.randn(40, generator=g)}
    torch.save(full, tmp_path / "x.pt")
    src = TorchSaveSource(tmp_path / "x.pt")
    (v,) = src.read([Region("t", (1, 2), (5, 6))], CPU)
    assert not v.is_contiguous() and torch.equal(v, full["t"][1:6, 2:8])
    other = {k: v.clone() for k, v in full.items()}
    other["t"][6, 11] = -1.0
    for budget in (1 << 30, 16):
        r = compare_checkpoints(tmp_path / "x.pt", other, device="cpu", memory_budget=budget)
        assert [(f.key, f.kind, f.max_abs_index) for f in r.findings] == [("t", "value", (6, 11))]


@pytest.mark.slow  # its fixture spawns 4 ranks
def test_compare_dcp_against_memory_across_budgets(sharded: Path) -> None:
    full = _full()
    other = {k: v.clone() for k, v in full.items()}
    other["c"][3, 8] = 5.0  # the last column chunk
    msgs = set()
    for budget in (1 << 30, 50, 1):
        r = compare_checkpoints(sharded, MemorySource(other), device="cpu", memory_budget=budget)
        assert [(f.key, f.kind, f.max_abs_index) for f in r.findings] == [("c", "value", (3, 8))]
        msgs.add(str(r.findings[0]))
    assert len(msgs) == 1


# -- the pipeline ---------------------------------------------------------------------------
class _Recorder(MemorySource):
    """A source that records reads and can fail on one key."""

    def __init__(self, values: dict[str, torch.Tensor], fail: str | None = None) -> None:
        super().__init__(values)
        self.fail = fail

    def read(self, regions: Any, device: Any, out: Any = None) -> list[torch.Tensor]:
        if any(r.key == self.fail for r in regions):
            raise CheckpointError(f"{self.fail}: planted")
        # Fill `out` (as byte-range reads do), so arena reuse would show as wrong values.
        got = super().read(regions, device, None)
        return [o.copy_(g) for o, g in zip(out, got)] if out is not None else got


def test_prefetcher_order_values_and_arena_reuse() -> None:
    values = {f"k{i}": torch.full((64,), float(i)) for i in range(7)}
    src = _Recorder(values)
    plan = ((i, [(src, [Region(f"k{i}", (0,), (64,))])]) for i in range(7))
    seen = []
    for tag, ((t,),) in Prefetcher(CPU).run(plan):
        # Batch tag+1 is being read into the other arena now; this one must be intact.
        assert torch.equal(t, values[f"k{tag}"])
        seen.append(tag)
    assert seen == list(range(7))


def test_prefetcher_raises_at_the_failing_batch() -> None:
    values = {f"k{i}": torch.full((8,), float(i)) for i in range(5)}
    src = _Recorder(values, fail="k3")
    plan = ((i, [(src, [Region(f"k{i}", (0,), (8,))])]) for i in range(5))
    seen = []
    with pytest.raises(CheckpointError, match="k3: planted"):
        for tag, _ in Prefetcher(CPU).run(plan):
            seen.append(tag)
    assert seen == [0, 1, 2]


@pytest.mark.slow  # its fixture spawns 4 ranks
def test_fingerprint_of_boxes_adds_up_in_batches(sharded: Path) -> None:
    """The per-chunk sums of a DCP fingerprint equal the box fingerprints of the full tensor."""
    full = _full()["w"]
    src = DCPSource(sharded)
    try:
        total = 0
        for off, size in src.chunks("w"):
            if size[0] == 0:
                continue
            (t,) = src.read([Region("w", off, size)], CPU)
            total = (total + fingerprint_tensor(t, box=Box(tuple(full.shape), off))) % 2**64
        assert total == fingerprint_tensor(full)
    finally:
        src.close()


# The 4-rank save's fixture spawns 4 ranks (slow); the single-process save has zip blobs too.
@pytest.mark.parametrize("which", [pytest.param("sharded", marks=pytest.mark.slow), "single"])
def test_zip_scan_fast_path_agrees_with_the_zipfile_module(
    which: str, request: pytest.FixtureRequest
) -> None:
    from fsdpcheck.sources import rawio

    path = request.getfixturevalue(which)
    src = DCPSource(path)
    idx = src._index
    try:
        for e in range(idx.entry_where.shape[0]):
            rel, offset, length, _ = idx.storage(e)
            with src._files.open(rel) as fd:
                fast = rawio._scan_fast(fd, offset, length)
                assert fast is not None and fast == rawio._scan_zipfile(fd, offset, length)
                # One byte short of the blob (a storage entry cut short) is no zip for either.
                assert rawio._scan_fast(fd, offset, length - 1) is None
    finally:
        src.close()
