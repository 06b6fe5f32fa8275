"""The reading layer at scale and under change: metadata columns, chunk lookups, guarded maps.

* ``.metadata`` read as it streams (``dcp_pickle``, with column runs or into objects) gives
  exactly what pickle gives, for every pickle protocol, shared or fresh objects, transforms and
  values, and reads again into objects where columns cannot answer (hypothesis over generated
  metadata, real saves, mutated bytes).
* ``chunks_overlapping`` by bisection equals a scan, for grids and for irregular chunks.
* A trusted digest skips the whole-checkpoint check and still refuses what a read touches.
* Files truncated between two batches or while the kernel reads them, a FIFO swapped in after
  a check, ``.metadata`` linked to ``/dev/zero``, a storage transform that inflates without
  end, 10,000 data files under ``ulimit -n 1024``, files unreadable for permissions: one line
  each, naming the file, and no crash, hang or unbounded memory.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpcheck
from fsdpcheck._unpickle import UnsafePickleError
from fsdpcheck.errors import CheckpointError, CoverageError
from fsdpcheck.sources.base import Region
from fsdpcheck.sources.dcp import index as dcp_index
from fsdpcheck.sources.dcp import stream as dcp_pickle
from fsdpcheck.sources.dcp.source import DCPSource
from tests import REPO_ROOT, examples

CPU = torch.device("cpu")
REPO = REPO_ROOT


# ---------------------------------------------------------------------------------------------
# A DCP checkpoint written the way dcp.save writes one, from DCP's own classes, with real data.
def write_dcp(
    path: Path,
    tensors: dict[str, torch.Tensor],
    ranks: int,
    *,
    dim: int = 0,
    protocol: int = pickle.DEFAULT_PROTOCOL,
    shared: bool = False,
    values: dict[str, Any] | None = None,
    transform: str | None = None,
    paths: str = "shared",
    order: str = "rank",
    offsets: str = "own",
) -> Path:
    """Each tensor cut along `dim` into `ranks` chunks (torch.chunk), rank r's in its own file.

    Like dcp.save, each rank's plan and write results reach the coordinator pickled (fresh
    objects per rank: fqn strings are new in every storage record). `shared` makes every chunk
    of a tensor share one ``sizes`` object (a later record then refers back into an earlier
    one). `transform` puts a storage transform descriptor on the first chunk's entry.

    The other ways ``pickle.dump`` writes the same metadata (NOTE: [any pickling] in
    ``dcp_runs``): `paths` "fresh" builds a new path string per storage entry (written in full
    each time, not as a memo reference), "alternate" for every other entry (a run's records
    differ one from the next); `order` "tensor" lists storage entries tensor by tensor (every
    rank's entry of a tensor, then the next tensor); `offsets` "shared" gives each
    ``MetadataIndex`` its chunk's own offsets object (a reference into the chunk).
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    path.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for k, t in tensors.items():
        state[k] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.size(), [])
    for k in values or {}:
        state[k] = BytesStorageMetadata()
    per_rank: list[list[Any]] = []
    split = {}  # each tensor's chunks, with where each starts
    for k, t in tensors.items():
        if t.dim():
            d = min(dim, t.dim() - 1)
            pieces = torch.chunk(t, ranks, d) if t.shape[d] else (t,)
            starts = [0]
            for piece in pieces:
                starts.append(starts[-1] + piece.shape[d])
            split[k] = list(zip(starts, pieces))
    for rank in range(ranks):
        rel = f"__{rank}_0.distcp"
        blob = io.BytesIO()
        chunks, results = [], []
        for k, t in tensors.items():
            scalar = [(0, t)] if rank == 0 else []
            parts = split[k][rank : rank + 1] if t.dim() else scalar
            for start, piece in parts:
                off = [0] * t.dim()
                if t.dim():
                    off[min(dim, t.dim() - 1)] = start
                at = blob.tell()
                torch.save(piece.clone(), blob)
                # "fresh": a new string each; "alternate": every other entry's
                fresh = paths == "fresh" or (paths == "alternate" and len(results) % 2 == 1)
                where = f"__{rank}_0.distcp" if fresh else rel
                info = _StorageInfo(where, at, blob.tell() - at)
                chunk = ChunkStorageMetadata(torch.Size(off), piece.size())
                chunks.append((k, chunk))
                idx = MetadataIndex(k, off)
                if offsets == "shared":
                    object.__setattr__(idx, "offset", chunk.offsets)
                results.append((idx, info))
        if rank == 0:
            for k, v in (values or {}).items():
                at = blob.tell()
                torch.save(v, blob)
                results.append((MetadataIndex(k), _StorageInfo(rel, at, blob.tell() - at)))
        (path / rel).write_bytes(blob.getvalue())
        chunks, results = pickle.loads(pickle.dumps((chunks, results)))
        for k, c in chunks:
            state[k].chunks.append(c)
        per_rank.append(results)
    if order == "tensor":  # each key's entries (every rank's), key after key
        for k in [*tensors, *(values or {})]:
            storage.update((i, v) for results in per_rank for i, v in results if i.fqn == k)
    else:
        for results in per_rank:
            storage.update(results)
    if shared:
        for m in state.values():
            if isinstance(m, TensorStorageMetadata) and m.chunks:
                first = m.chunks[0].sizes
                for c in m.chunks:
                    if c.sizes == first:
                        c.sizes = first
    if transform is not None:
        storage[next(iter(storage))].transform_descriptors = [transform]
    md = Metadata(
        state_dict_metadata=state,
        planner_data={k: (k,) for k in state},
        storage_data=storage,
        version="1.0.0",
    )
    (path / ".metadata").write_bytes(pickle.dumps(md, protocol=protocol))
    return path


def summary(index: dcp_index.DcpIndex) -> tuple[Any, ...]:
    """Everything a DcpIndex says, as plain values."""
    per_key = []
    for k, key in enumerate(index.keys):
        if index.tensor[k]:
            chunks = index.chunks(key)
            where = [
                index.storage(e) if (e := index.chunk_entry(key, i)) >= 0 else None
                for i in range(len(chunks))
            ]
            per_key.append((key, index.shapes[k], index.dtypes[k], chunks, where))
        else:
            e = index.value_entry.get(key)
            per_key.append((key, None if e is None else index.storage(e)))
    return tuple(per_key), index.paths


def trusted_summary(path: Path) -> tuple[Any, ...]:
    """The same, from DCP's own classes (a plain unpickle: these files are the test's own)."""
    md = pickle.loads((path / ".metadata").read_bytes())
    storage = {}
    for idx, info in md.storage_data.items():
        pos = (idx.fqn, None if idx.offset is None else tuple(idx.offset))
        storage[pos] = (info.relative_path, info.offset, info.length,
                        tuple(info.transform_descriptors or ()))  # fmt: skip
    per_key = []
    for key, m in md.state_dict_metadata.items():
        if hasattr(m, "chunks"):
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks]
            where = [storage.get((key, o)) for o, _ in chunks]
            per_key.append((key, tuple(m.size), m.properties.dtype, chunks, where))
        else:
            per_key.append((key, storage.get((key, None))))
    return tuple(per_key), {k: tuple(str(x) for x in v) for k, v in md.planner_data.items()}


def read_both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, int]:
    """The index read with column runs and into objects, and how many runs were columns."""
    runs = []
    real = dcp_pickle.read_metadata_stream

    def counting(*a: Any, **k: Any) -> Any:
        got = real(*a, **k)
        runs.append(got.chunk_runs)
        return got

    with monkeypatch.context() as m:
        m.setattr(dcp_index, "SMALL", 0)
        m.setattr(dcp_index, "read_metadata_stream", counting)
        streamed = summary(dcp_index.open_index(path)[0])
    with monkeypatch.context() as m:
        m.setattr(dcp_index, "SMALL", 1 << 40)
        objects = summary(dcp_index.open_index(path)[0])
    return streamed, objects, sum(runs)


_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn]


@st.composite
def checkpoints(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 4))
    tensors = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=5)))
        dtype = draw(st.sampled_from(_DTYPES))
        tensors[f"m.layer{i}.{'w' * draw(st.integers(1, 30))}"] = torch.zeros(shape).to(dtype)
    return {
        "tensors": tensors,
        "ranks": draw(st.integers(1, 12)),
        "dim": draw(st.integers(0, 3)),
        "protocol": draw(st.sampled_from([2, 3, 4, 5])),
        "shared": draw(st.booleans()),
        "values": draw(st.sampled_from([None, {"opt.lr": 0.1, "opt.step": 3}])),
        "transform": draw(st.sampled_from([None, "stream.zstd/1"])),
        "paths": draw(st.sampled_from(["shared", "fresh", "alternate"])),
        "order": draw(st.sampled_from(["rank", "tensor"])),
        "offsets": draw(st.sampled_from(["own", "shared"])),
    }


@settings(max_examples=examples(40), deadline=None)
@given(case=checkpoints())
def test_streamed_metadata_equals_the_unpickler_and_dcp(
    case: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = write_dcp(tmp_path_factory.mktemp("md") / "ck", **case)
    mp = pytest.MonkeyPatch()
    try:
        streamed, objects, _ = read_both(path, mp)
    finally:
        mp.undo()
    assert streamed == objects
    assert streamed == trusted_summary(path)


def columns_read(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[bool], int, int]:
    """Reads ``.metadata`` with column runs: (each pass's `columns`, chunk and storage records
    read as objects rather than in runs)."""
    from fsdpcheck.sources.dcp.metadata import _mirror

    passes: list[bool] = []
    real = dcp_pickle._read

    def watch(*a: Any) -> Any:
        passes.append(a[-1])
        return real(*a)

    monkeypatch.setattr(dcp_pickle, "_read", watch)
    with open(path / ".metadata", "rb") as f:
        parsed = dcp_pickle.read_metadata_stream(f.fileno(), "m", _mirror, 1 << 30)
    monkeypatch.undo()
    md = parsed.metadata
    chunks = sum(1 for m in md.state_dict_metadata.values() for c in getattr(m, "chunks", ())
                 if type(c) is not dcp_pickle.ChunkRun)  # fmt: skip
    return passes, chunks, len(md.storage_data)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize(
    "how",
    [
        {},  # as dcp.save writes it
        {"paths": "fresh"},
        {"paths": "alternate"},
        {"order": "tensor"},
        {"offsets": "shared"},
        {"shared": True},
        {"paths": "fresh", "order": "tensor", "offsets": "shared", "shared": True},
    ],
    ids=[
        "dcp-save",
        "fresh-paths",
        "alternate-paths",
        "by-tensor",
        "shared-offsets",
        "shared-sizes",
        "all",
    ],
)
def test_every_way_of_pickling_is_read_as_columns(
    how: dict[str, Any], protocol: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE: [any pickling]: whatever pickle.dump shares and whatever protocol it writes, the
    records are read in runs (in one pass: no reference sends the file back to objects) and
    give what the object read and DCP's own classes give."""
    tensors = {f"layers.{i}.weight": torch.arange(64.0 * (i + 1)).view(-1, 4) for i in range(3)}
    tensors["layers.scale"] = torch.ones(5)  # 1-d (another template), fewer chunks than ranks
    path = write_dcp(tmp_path / "ck", tensors, 8, protocol=protocol, **how)
    passes, plain_chunks, plain_entries = columns_read(path, monkeypatch)
    assert passes == [True]
    # The first record of each kind is read op by op (the names its pattern needs are memoized
    # inside it), and a record whose fresh path has a length not seen before: nothing else.
    assert plain_chunks <= 2, plain_chunks
    assert plain_entries <= 2, plain_entries
    streamed, objects, _ = read_both(path, monkeypatch)
    assert streamed == objects == trusted_summary(path)


def test_past_the_templates_a_read_makes_records_are_read_op_by_op(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file could make a template per record (a field name memoized again before each): past
    a bound, records of a new template are read op by op, and read the same."""
    from fsdpcheck.sources.dcp import runs as dcp_runs

    tensors = {f"layers.{i}.weight": torch.arange(64.0 * (i + 1)).view(-1, 4) for i in range(3)}
    tensors["layers.scale"] = torch.ones(5)  # 1-d: another template
    path = write_dcp(tmp_path / "ck", tensors, 8)
    monkeypatch.setattr(dcp_runs, "_TEMPLATES", 1)
    passes, plain_chunks, plain_entries = columns_read(path, monkeypatch)  # (undoes the patch)
    assert passes == [True]
    assert plain_chunks + plain_entries > 8  # the 1-d chunks and every storage entry
    monkeypatch.setattr(dcp_runs, "_TEMPLATES", 1)
    streamed, objects, _ = read_both(path, monkeypatch)
    assert streamed == objects == trusted_summary(path)


def _frames(raw: bytes) -> list[int]:
    """Where the FRAME ops of a pickle are."""
    return [pos for op, _, pos in pickletools.genops(raw) if op.name == "FRAME"]


@pytest.fixture(scope="module")
def framed_metadata(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """~200 KB of metadata at protocol 4: pickle.dump frames it every 64 KB, mid-record."""
    tensors = {f"layers.{i}.weight": torch.zeros(48, 2) for i in range(24)}
    p = write_dcp(tmp_path_factory.mktemp("fr") / "ck", tensors, 48, protocol=4)
    return p, (p / ".metadata").read_bytes()


@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize(
    "how",
    [{}, {"paths": "fresh", "order": "tensor", "offsets": "shared", "shared": True}],
    ids=["dcp-save", "all"],
)
def test_records_split_by_frames_are_read_in_their_runs(
    how: dict[str, Any], protocol: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FRAME op between two ops of a record (pickle.dump writes one every 64 KB) is no op to
    the machine: the record is read as columns in its run, without it, and reads the same."""
    tensors = {f"layers.{i}.weight": torch.zeros(64, 2) for i in range(40)}
    path = write_dcp(tmp_path / "ck", tensors, 64, protocol=protocol, **how)
    assert len(_frames((path / ".metadata").read_bytes())) >= 6
    passes, plain_chunks, plain_entries = columns_read(path, monkeypatch)
    assert passes == [True]
    # As with one frame: the first record of each kind, and a fresh path of a new length.
    assert plain_chunks + plain_entries <= 3, (plain_chunks, plain_entries)
    streamed, objects, _ = read_both(path, monkeypatch)
    assert streamed == objects == trusted_summary(path)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_frames_moved_or_grown_read_as_the_unpickler_reads_them(
    framed_metadata: tuple[Path, bytes], data: st.DataObject
) -> None:
    """A FRAME header moved into the middle of an op, one added, or one claiming more bytes
    than the file may hold: column runs give what the objects give."""
    path, raw = framed_metadata
    frames = _frames(raw)
    buf = bytearray(raw)
    at = data.draw(st.sampled_from(frames[1:]))  # the first, after PROTO, is read op by op
    how = data.draw(st.sampled_from(["move", "add", "grow"]))
    if how == "grow":
        buf[at + 1 : at + 9] = data.draw(st.sampled_from([1 << 62, 1 << 40])).to_bytes(8, "little")
    else:
        header = bytes(buf[at : at + 9])
        if how == "move":
            del buf[at : at + 9]
        to = at + data.draw(st.integers(-120, 120))
        buf[to:to] = header
    _streamed_as_objects(path, raw, buf)


def test_a_reference_into_a_record_read_as_columns_reads_the_file_as_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk object listed twice (pickle refers back to the object): columns cannot answer
    for a record object, so the file is read again, every record an object, and reads the same."""
    tensors = {f"layers.{i}.weight": torch.arange(64.0 * (i + 1)).view(-1, 4) for i in range(3)}
    path = write_dcp(tmp_path / "fresh", tensors, 8)
    md = pickle.loads((path / ".metadata").read_bytes())
    chunks = md.state_dict_metadata["layers.2.weight"].chunks
    chunks.append(chunks[3])
    (path / ".metadata").write_bytes(pickle.dumps(md))
    passes, _, _ = columns_read(path, monkeypatch)
    assert passes == [True, False]  # the column pass gave up, the object pass read it
    streamed, objects, _ = read_both(path, monkeypatch)
    assert streamed == objects == trusted_summary(path)


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_binput_naming_another_slot_reads_as_objects_read_it(
    protocol: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Protocols 2 and 3 name the slot each BINPUT sets: a run whose records name other slots
    than MEMOIZE would set is not columns' to answer (read as objects, the same outcome)."""
    tensors = {f"layers.{i}.weight": torch.arange(64.0 * (i + 1)).view(-1, 4) for i in range(3)}
    path = write_dcp(tmp_path / "ck", tensors, 8, protocol=protocol)
    raw = (path / ".metadata").read_bytes()
    outcomes = set()
    # Every BINPUT (q, one byte) of the last tensor's chunk records, its slot moved by one.
    at = raw.index(b"layers.2.weight")
    puts = [i for i in range(at, len(raw) - 1) if raw[i] == ord("q")][:40]
    for i in puts:
        bad = bytearray(raw)
        bad[i + 1] = (bad[i + 1] + 1) % 256
        (path / ".metadata").write_bytes(bytes(bad))
        objects = _outcome(path, 1 << 40)
        streamed = _outcome(path, 0)
        assert streamed == objects if objects[0] == "ok" else streamed[0] == "error"
        outcomes.add(objects[0])
    # The records were found and moved, and a moved slot is not always harmless: both kinds of
    # outcome were compared (a test that only ever saw one would prove half of it).
    assert len(puts) >= 8, puts
    assert outcomes == {"ok", "error"}, outcomes
    (path / ".metadata").write_bytes(raw)
    assert passes_once(path, monkeypatch)


def passes_once(path: Path, monkeypatch: pytest.MonkeyPatch) -> bool:
    return columns_read(path, monkeypatch)[0] == [True]


def test_real_sharded_saves_stream_equal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = {"w": torch.randn(7, 3), "s": torch.tensor(2.0), "g": [{"lr": 0.5}], "n": 4}
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    streamed, objects, _ = read_both(tmp_path / "ck", monkeypatch)
    assert streamed == objects == trusted_summary(tmp_path / "ck")


def test_hostile_metadata_through_the_streaming_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The streaming reader refuses what the unpickler refuses, with the same one line."""
    monkeypatch.setattr(dcp_index, "SMALL", 0)
    d = tmp_path / "h"
    d.mkdir()
    cases = {
        b"\x80\x04cos\nsystem\n(S'touch x'\ntR.": "names os.system",
        b"\x80\x04\x8c\x02os\x8c\x06system\x93.": "names os.system",
        b"\x80\x04}\x94.": "holds a dict, not DCP Metadata",
        b"\x80\x04(K\x01": "unreadable",
        b"\x80\x04h\x05.": "unreadable",
        b"\x80\x04P0\n.": "persistent",
    }
    for data, message in cases.items():
        (d / ".metadata").write_bytes(data)
        with pytest.raises((CheckpointError, UnsafePickleError), match=message) as e:
            DCPSource(d)
        assert "\n" not in str(e.value)
    assert not (Path.cwd() / "x").exists()


# ---------------------------------------------------------------------------------------------
# Chunks by bisection.
@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[Any, Any]]]:
    kind = draw(st.sampled_from(["stacked", "grid", "irregular"]))
    if kind == "irregular":
        shape = (draw(st.integers(1, 12)), draw(st.integers(1, 12)))
        boxes = []
        for _ in range(draw(st.integers(1, 8))):
            o = (draw(st.integers(0, shape[0] - 1)), draw(st.integers(0, shape[1] - 1)))
            s = (draw(st.integers(0, shape[0] - o[0])), draw(st.integers(0, shape[1] - o[1])))
            boxes.append((o, s))
        return shape, boxes
    ndim = 1 if kind == "stacked" else 2
    shape = (*(draw(st.integers(1, 20)) for _ in range(ndim)), 3)
    cuts = [sorted(set(draw(st.lists(st.integers(1, g - 1), max_size=6))) if g > 1 else [])
            for g in shape[:ndim]]  # fmt: skip
    bands = [list(zip([0, *c], [*c, g])) for c, g in zip(cuts, shape)]
    boxes = []
    for b0 in bands[0]:
        for b1 in bands[1] if ndim == 2 else [(0, shape[1])]:
            boxes.append(((b0[0], b1[0], 0), (b0[1] - b0[0], b1[1] - b1[0], 3)))
    if draw(st.booleans()):
        boxes.append(((shape[0], 0, 0), (0, shape[1], 3)))  # an empty chunk at the end
    order = draw(st.permutations(range(len(boxes))))
    return shape, [boxes[i] for i in order]


@settings(max_examples=examples(150), deadline=None)
@given(layout=layouts(), data=st.data())
def test_chunks_overlapping_equals_a_scan(layout: Any, data: st.DataObject) -> None:
    from fsdpcheck.sources.base import Source, boxes_meet

    shape, boxes = layout
    grid = dcp_index._Grid.build(boxes)
    for _ in range(10):
        o = tuple(data.draw(st.integers(0, g)) for g in shape)
        s = tuple(data.draw(st.integers(0, g - x)) for x, g in zip(o, shape))
        want = [i for i, b in enumerate(boxes) if boxes_meet(b, (o, s))]
        assert grid.query(o, s) == want
    del Source


def test_a_grid_is_searched_by_bisection_not_scanned() -> None:
    """4,096 stacked chunks, listed in any order: a query meets only the cells it overlaps."""
    from fsdpcheck.sources.dcp.index import _Grid

    boxes = [((4 * r, 0), (4, 64)) for r in range(4096)][::-1]
    g = _Grid.build(boxes)
    assert g.starts is not None and len(g.starts[0]) == 4096 and len(g.starts[1]) == 1
    hits = g.query((4003, 10), (6, 5))
    assert sorted(boxes[i][0] for i in hits) == [(4000, 0), (4004, 0), (4008, 0)]
    g.boxes = []  # a scan would now find nothing: the answer comes from the bands alone
    assert len(g.query((0, 0), (1, 1))) == 1


def test_dcp_source_chunks_overlapping_and_coverage(tmp_path: Path) -> None:
    t = torch.arange(120.0).view(12, 10)
    p = write_dcp(tmp_path / "ck", {"w": t, "c": t.t().contiguous()}, 4, dim=0)
    src = DCPSource(p)
    try:
        assert src.chunk_count("w") == 4 and src.coverage("w") == []
        assert src.chunks_overlapping("w", (2, 0), (3, 10)) == [((0, 0), (3, 10)),
                                                               ((3, 0), (3, 10))]  # fmt: skip
        assert src.chunks_overlapping("w", (12, 0), (0, 10)) == []
        (got,) = src.read([Region("w", (2, 1), (3, 4))], CPU)
        assert torch.equal(got, t[2:5, 1:5])
    finally:
        src.close()


# ---------------------------------------------------------------------------------------------
# Read once, check once.
def test_metadata_digest_and_a_trusted_open(tmp_path: Path) -> None:
    t = torch.arange(40.0).view(8, 5)
    p = write_dcp(tmp_path / "ck", {"w": t, "v": torch.ones(3)}, 4)
    checked = DCPSource(p)
    digest = checked.metadata_digest
    assert digest == hashlib.sha256((p / ".metadata").read_bytes()).hexdigest()
    assert checked.validated and checked.problems() == []
    checked.close()
    trusted = DCPSource(p, trusted_digest=digest)
    try:
        assert not trusted.validated and trusted.problems() == []
        (got,) = trusted.read([Region("w", (0, 0), (2, 5))], CPU)  # rank 0's file only
        assert torch.equal(got, t[0:2])
        # What a read touches is still refused: a data file that became a FIFO ...
        fifo = p / "__1_0.distcp"
        fifo.unlink()
        os.mkfifo(fifo)
        with pytest.raises(CheckpointError, match="is a FIFO"):
            trusted.read([Region("w", (2, 0), (1, 5))], CPU)
        # ... and a file cut short.
        data = (p / "__3_0.distcp").read_bytes()
        (p / "__3_0.distcp").write_bytes(data[: len(data) // 2])
        with pytest.raises(CheckpointError, match=r"__3_0\.distcp"):
            trusted.read([Region("w", (7, 0), (1, 5))], CPU)
    finally:
        trusted.close()
    # Another digest (the file changed, or another checkpoint): checked in full.
    other = DCPSource(p, trusted_digest="0" * 64)
    try:
        assert other.validated and other.problems()
    finally:
        other.close()


def test_a_trusted_open_still_refuses_a_gap(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata  # noqa: F401

    p = write_dcp(tmp_path / "ck", {"w": torch.arange(40.0).view(8, 5)}, 4)
    md = pickle.loads((p / ".metadata").read_bytes())
    del md.state_dict_metadata["w"].chunks[1]  # rows 2:4 no longer covered
    (p / ".metadata").write_bytes(pickle.dumps(md))
    digest = hashlib.sha256((p / ".metadata").read_bytes()).hexdigest()
    src = DCPSource(p, trusted_digest=digest)
    try:
        with pytest.raises(CoverageError, match=r"\[2:4, 0:5\]"):
            src.read([Region("w", (0, 0), (8, 5))], CPU)
    finally:
        src.close()


def test_the_safe_reader_reuses_the_parsed_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values and non-raw chunks go through DCP's reader without a second parse."""
    t = torch.arange(12.0).view(4, 3)
    p = write_dcp(tmp_path / "ck", {"w": t}, 2, values={"lr": 0.25})
    src = DCPSource(p)
    try:
        src.raw_reads = False

        def never(*a: Any, **k: Any) -> Any:
            raise AssertionError(".metadata parsed a second time")

        monkeypatch.setattr(dcp_index, "read_parsed", never)
        monkeypatch.setattr("fsdpcheck.sources.dcp.metadata.read_dcp_metadata", never)
        monkeypatch.setattr("fsdpcheck.sources.dcp.load.read_dcp_metadata", never)
        assert src.read_objects(["lr"]) == {"lr": 0.25}
        (got,) = src.read([Region("w", (1, 0), (2, 3))], CPU)
        assert torch.equal(got, t[1:3])
    finally:
        src.close()


# ---------------------------------------------------------------------------------------------
# Bounded inflation, non-regular files, descriptors, permissions.
def test_a_storage_transform_that_inflates_without_end_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint import filesystem

    p = write_dcp(tmp_path / "ck", {"w": torch.ones(4, 4)}, 1, transform="stream.zstd/1")

    class Bomb(io.RawIOBase):
        """Zeros without end, as a stream.zstd entry of 262 KB can inflate to 8 GiB."""

        served = 0

        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            Bomb.served += len(b)
            b[:] = bytes(len(b))
            return len(b)

    def bomb(self: Any, read_item: Any, descriptors: Any, stream: Any) -> Any:
        return io.BufferedReader(Bomb())

    monkeypatch.setattr(filesystem._StorageReaderTransforms, "transform_load_stream", bomb)
    src = DCPSource(p)
    try:
        with pytest.raises(CheckpointError) as e:
            src.read([Region("w", (0, 0), (4, 4))], CPU)
    finally:
        src.close()
    msg = str(e.value)
    assert "w" in msg and "__0_0.distcp" in msg and "inflates past" in msg and "\n" not in msg
    assert Bomb.served < 4 << 20  # the chunk's 64 bytes + the record's slack, not gigabytes


def test_files_swapped_for_a_fifo_after_their_check_never_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdpcheck.sources import fileio
    from fsdpcheck.sources.torch_save import TorchSaveSource

    real = fileio.check_regular
    for target, call in (
        ("__1_0.distcp", fsdpcheck.fingerprint_checkpoint),
        (".metadata", DCPSource),
        ("model.pt", lambda p: TorchSaveSource(p / "model.pt")),
    ):
        p = write_dcp(tmp_path / target / "ck", {"w": torch.arange(16.0).view(4, 4)}, 2)
        torch.save({"w": torch.ones(3)}, p / "model.pt")

        def swap(path: Any, what: str = "file", target: str = target) -> Path:
            got = real(path, what)  # checked while regular ...
            if Path(path).name == target and Path(path).is_file():
                Path(path).unlink()
                os.mkfifo(path)  # ... then a FIFO, before it is opened
            return got

        monkeypatch.setattr(fileio, "check_regular", swap)
        with pytest.raises(CheckpointError, match=f"{target} is a FIFO") as e:
            call(p)
        assert "\n" not in str(e.value)
        monkeypatch.setattr(fileio, "check_regular", real)


def test_metadata_linked_to_dev_zero_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "z"
    d.mkdir()
    (d / ".metadata").symlink_to("/dev/zero")
    for call in (lambda: DCPSource(d), lambda: fsdpcheck.audit(d)):
        try:
            got = call()
        except CheckpointError as e:
            assert "is a device" in str(e)
            continue
        assert not got.ok and "is a device" in got.findings[0].message


def test_metadata_past_the_size_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = write_dcp(tmp_path / "ck", {"w": torch.ones(4)}, 1)
    monkeypatch.setattr(dcp_index, "MAX_METADATA", 64)
    with pytest.raises(CheckpointError, match=r"more than the 64 fsdpcheck reads"):
        DCPSource(p)


def _child(code: str, *args: str, limit_files: int | None = None) -> subprocess.CompletedProcess:
    pre = ""
    if limit_files:
        lim = f"({limit_files}, {limit_files})"
        pre = f"import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, {lim})\n"
    return subprocess.run(
        [sys.executable, "-c", pre + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )


@pytest.mark.slow
def test_ten_thousand_data_files_under_ulimit_1024(tmp_path: Path) -> None:
    tensors = {"w": torch.arange(20000.0).view(10000, 2), "b": torch.ones(3)}
    p = write_dcp(tmp_path / "ck", tensors, 10000)
    assert len(list(p.glob("*.distcp"))) == 10000
    want = fsdpcheck.fingerprint(tensors)  # the same content, hashed in memory
    done = _child(
        """
        import sys, fsdpcheck
        from fsdpcheck.comparison import compare_checkpoints
        print(sorted(fsdpcheck.fingerprint_checkpoint(sys.argv[1]).items()))
        r = compare_checkpoints(sys.argv[1], sys.argv[1])
        print(r.ok, r.keys_checked)
        """,
        str(p),
        limit_files=1024,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == str(sorted(want.items())) and lines[1] == "True 2"


@pytest.mark.slow
def test_unreadable_files_say_permission_denied() -> None:
    import shutil
    import tempfile

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a command as nobody")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run(
        [*nobody, sys.executable, "-c", "import fsdpcheck"], capture_output=True, cwd="/"
    )
    if probe.returncode != 0:  # e.g. a checkout under a folder only root may enter
        pytest.skip("nobody cannot import fsdpcheck from this checkout")
    from safetensors.torch import save_file

    home = Path(tempfile.mkdtemp(prefix="fsdpcheck-perm-", dir="/tmp"))
    try:
        save_file({"a": torch.ones(2)}, str(home / "m.safetensors"))
        write_dcp(home / "ck", {"w": torch.ones(4)}, 1)
        (home / "shut").mkdir()
        save_file({"a": torch.ones(2)}, str(home / "shut" / "s.safetensors"))
        for p in (home / "m.safetensors", home / "ck" / ".metadata"):
            os.chmod(p, 0)
        os.chmod(home / "shut", 0)
        os.chmod(home, 0o755)
        os.chmod(home / "ck", 0o755)
        cases = (
            ("m.safetensors", "safetensors file"),
            ("ck", "DCP metadata"),
            ("shut/s.safetensors", "a folder on its path may not be searched"),
        )
        for target, what in cases:
            done = subprocess.run(
                [*nobody, sys.executable, "-m", "fsdpcheck", "inspect", str(home / target)],
                capture_output=True, text=True, timeout=120, cwd="/",
            )  # fmt: skip
            assert done.returncode == 2, (done.stdout, done.stderr)
            err = done.stderr.strip()
            assert "permission denied" in err and what in err and target in err, err
            assert "No such file" not in err and "Errno" not in err, err
            assert len(err.splitlines()) == 1
    finally:
        os.chmod(home / "shut", 0o755)
        shutil.rmtree(home, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Files truncated while they are read: between two batches, and while the kernel reads them.
_TRUNCATE = """
import os, sys
import fsdpcheck
from fsdpcheck import ops
from fsdpcheck.sources import safetensors_files, torch_save
from fsdpcheck.sources.dcp import source as dcp
from fsdpcheck.errors import CheckpointError

path, target, when = sys.argv[1], sys.argv[2], sys.argv[3]
state = {"batches": 0}

def cut():
    os.truncate(target, 4096)

if when == "between":  # after the kernel ran on the first batch, before the next is read
    for mod, name in ((ops, "fingerprint_rows"), (ops, "compare_rows")):
        def hooked(*a, real=getattr(mod, name), **k):
            got = real(*a, **k)
            state["batches"] += 1
            if state["batches"] == 1:
                cut()
            return got
        setattr(mod, name, hooked)
else:  # "during": the pages were mapped for the kernel, then the file lost them
    for mod in (dcp, safetensors_files, torch_save):
        real_populate = mod.populate
        def hooked(t, real_populate=real_populate):
            real_populate(t)
            if not state["batches"]:
                state["batches"] = 1
                cut()
        mod.populate = hooked
try:
    if path.endswith(".safetensors"):
        from fsdpcheck.comparison import compare_checkpoints
        r = compare_checkpoints(path, sys.argv[4], memory_budget=1 << 20)
        print("REPORT", r.ok)
    else:
        print("FPS", len(fsdpcheck.fingerprint_checkpoint(path, memory_budget=1 << 20)))
except CheckpointError as e:
    print("ERROR", e)
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["between", "during"])
@pytest.mark.parametrize("kind", ["dcp", "safetensors"])
def test_a_file_truncated_while_it_is_read_is_named_not_a_crash(
    tmp_path: Path, when: str, kind: str
) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"l{i}.w": torch.randn(256, 1024, generator=g) for i in range(4)}  # 1 MiB each
    if kind == "dcp":
        p = write_dcp(tmp_path / "ck", tensors, 1)
        target, args = p / "__0_0.distcp", [str(p), str(p / "__0_0.distcp"), when]
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp_path / "a.safetensors"))
        save_file(tensors, str(tmp_path / "b.safetensors"))
        target = tmp_path / "a.safetensors"
        args = [str(target), str(target), when, str(tmp_path / "b.safetensors")]
    done = _child(_TRUNCATE, *args)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])  # not SIGBUS (-7)
    out = done.stdout.strip().splitlines()[-1]
    assert out.startswith("ERROR"), out
    assert str(target) in out and "changed while it was read" in out and "truncated" in out
    assert target.stat().st_size == 4096


@pytest.mark.slow
def test_the_guard_leaves_other_faults_alone(tmp_path: Path) -> None:
    """A SIGBUS outside fsdpcheck's mappings still ends the process, as it would without it."""
    f = tmp_path / "x"
    f.write_bytes(b"\1" * 8192)
    done = _child(
        """
        import mmap, os, sys, torch
        from fsdpcheck.sources import rawio
        fd = os.open(sys.argv[1], os.O_RDWR)
        m = rawio.map_guarded(fd, 8192, sys.argv[1])  # installs the handler
        plain = mmap.mmap(fd, 8192)
        os.truncate(sys.argv[1], 0)
        print("guarded", int(m.data.sum()), rawio.damaged([m.id]) == {m.id}, flush=True)
        plain[5000]
        print("not reached")
        """,
        str(f),
    )
    assert done.stdout.splitlines() == ["guarded 0 True"]
    assert done.returncode == -7  # SIGBUS


def test_pread_mode_reads_the_same_without_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import save_file

    from fsdpcheck.comparison import compare_checkpoints
    from fsdpcheck.sources import rawio

    g = torch.Generator().manual_seed(5)
    tensors = {f"l{i}": torch.randn(33, 17, generator=g).to(torch.bfloat16) for i in range(3)}
    p = write_dcp(tmp_path / "ck", tensors, 3)
    save_file(tensors, str(tmp_path / "a.safetensors"))
    other = {k: v.clone() for k, v in tensors.items()}
    other["l1"][20, 3] += 1

    def both() -> tuple[Any, Any]:
        fps = fsdpcheck.fingerprint_checkpoint(p, memory_budget=4096)
        return fps, compare_checkpoints(tmp_path / "a.safetensors", other, memory_budget=4096)

    mapped = both()
    made = rawio._next_id
    monkeypatch.setattr(rawio, "READ_MODE", "pread")
    preads = both()
    assert rawio._next_id == made  # no file was mapped
    assert preads[0] == mapped[0] == fsdpcheck.fingerprint(tensors)
    found = [[(f.key, f.kind, f.max_abs_index) for f in r.findings] for r in (mapped[1], preads[1])]
    assert found[0] == found[1] == [("l1", "value", (20, 3))]


def _streamed_as_objects(path: Path, raw: bytes, buf: bytearray) -> None:
    """`buf` as the `.metadata` of `path` reads as the object path reads it (or fails); `raw`
    is put back after."""
    try:
        (path / ".metadata").write_bytes(bytes(buf))
        objects = _outcome(path, 1 << 40)
        streamed = _outcome(path, 0)
    finally:
        (path / ".metadata").write_bytes(raw)
    if objects[0] == "ok":
        assert streamed == objects
    else:
        assert streamed[0] == "error"


def _outcome(path: Path, small: int) -> tuple[str, Any]:  # small=0: column runs
    """What opening the index gives: ("ok", summary) or ("error", the exception's type)."""
    old = dcp_index.SMALL
    dcp_index.SMALL = small
    try:
        return "ok", summary(dcp_index.open_index(path)[0])
    except (CheckpointError, UnsafePickleError, FileNotFoundError) as exc:
        assert "\n" not in str(exc)
        return "error", type(exc).__name__
    finally:
        dcp_index.SMALL = old


@pytest.fixture(scope="module")
def pristine_metadata(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    tensors = {f"layers.{i}.w": torch.arange(48.0 * (i + 1)).view(-1, 4) for i in range(4)}
    tensors["step"] = torch.tensor(3.0)
    p = write_dcp(tmp_path_factory.mktemp("fz") / "ck", tensors, 6, values={"lr": 0.5})
    return p, (p / ".metadata").read_bytes()


@settings(max_examples=examples(80), deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_fuzzed_metadata_streams_as_the_unpickler_reads_it(
    pristine_metadata: tuple[Path, bytes], data: st.DataObject
) -> None:
    """Mutated bytes: read with column runs, they give what they give read into objects."""
    path, raw = pristine_metadata
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        if not buf:
            break
        at = data.draw(st.integers(0, len(buf) - 1))
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "copy", "cut"]))
        if op == "flip":
            buf[at] = data.draw(st.integers(0, 255))
        elif op == "insert":
            buf[at:at] = bytes(data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=6)))
        elif op == "delete":
            del buf[at : at + data.draw(st.integers(1, 6))]
        elif op == "copy":
            n = data.draw(st.integers(1, 200))
            buf[at:at] = buf[at : at + n]
        else:
            del buf[at:]
    _streamed_as_objects(path, raw, buf)


@pytest.mark.slow
def test_a_memo_index_from_the_file_sizes_nothing(tmp_path: Path) -> None:
    """LONG_BINPUT 2**31 - 1: an unpickler sizes its memo by it (16 GiB, then the OOM killer)."""
    d = tmp_path / "bomb"
    d.mkdir()
    for data in (b"\x80\x02N" + b"r\xff\xff\xff\x7f" + b".", b"\x80\x02Np2147483647\n."):
        (d / ".metadata").write_bytes(data)
        done = _child(
            """
            import resource, sys
            from fsdpcheck.sources.dcp.source import DCPSource
            from fsdpcheck.errors import CheckpointError
            # 3 GiB more than the interpreter maps once torch is in (a CUDA build of torch maps
            # several GiB of libraries and reservations before anything is read).
            with open("/proc/self/status") as f:
                vm = next(int(v.split()[1]) << 10 for v in f if v.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), vm + (3 << 30)))
            try:
                DCPSource(sys.argv[1])
            except CheckpointError as e:
                print(e)
            """,
            str(d),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "holds a NoneType, not DCP Metadata" in done.stdout


def test_a_position_set_twice_reads_as_a_dict_reads_it(
    pristine_metadata: tuple[Path, bytes],
) -> None:
    """A storage record copied into the middle of ``storage_data`` (found by the fuzzer): the
    same position is set by a plain record and again inside a run; a dict keeps the last, and
    so does the index (read again as objects)."""
    path, raw = pristine_metadata
    try:
        (path / ".metadata").write_bytes(raw[:3551] + raw[3551:3703] + raw[3551:])
        assert _outcome(path, 0) == _outcome(path, 1 << 40)
    finally:
        (path / ".metadata").write_bytes(raw)
