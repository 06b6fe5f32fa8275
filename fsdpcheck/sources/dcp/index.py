"""A DCP checkpoint's ``.metadata`` as columns: read once, checked once, searched by bisection.

`open_index` reads ``.metadata`` (streamed, NOTE: [metadata columns] in ``dcp_runs``) into a
`DcpIndex`: per tensor its shape, dtype and a range of rows in shared column tensors (each
chunk's offsets and sizes, and where its storage entry's bytes lie), per value its storage
entry. Nothing holds an object per chunk: ~56 bytes per chunk of a 2-d tensor in all, where
DCP's own objects take ~2.2 KB.

`check` is the one structural checker of DCP metadata (columns read from the stream, and,
through `check_storage`, objects already read): tensor ops over every chunk at once, stat'ing
each data file once; `DcpIndex.overlapping`
answers "which chunks of this key meet this box" in O(log n + hits) for chunks that form a
grid (stacked along one dim, 2-d grids, ...), the layouts sharded saves write.

NOTE: [trusted metadata] `metadata_digest` is the sha256 of the ``.metadata`` bytes that were
parsed. A process given the digest of a checkpoint another process has validated (one rank
checks, the verdict and digest travel) opens it with ``trusted_digest=``: when the bytes it
read hash to that digest it skips the whole-checkpoint checks (tiling, a stat of every data
file); its reads still refuse anything unsafe they touch (a non-regular file, bytes past the
end of a file, a region no chunk or two chunks cover). A different digest validates in full.
"""

from __future__ import annotations

import itertools
import math
import os
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdpcheck._collector import paused
from fsdpcheck._unpickle import UnsafePickleError
from fsdpcheck.errors import CheckpointError
from fsdpcheck.sources.base import Problem, boxes_meet
from fsdpcheck.sources.dcp.metadata import (
    MAX_METADATA,
    METADATA_FILE,
    Position,
    StorageCheck,
    _mirror,
    chunk_finding,
    is_tensor_meta,
    no_entry,
    outside_shape,
    planner_paths,
    position,
    short_data,
    storage_by_position,
    validate_metadata,
)
from fsdpcheck.sources.dcp.stream import (
    SMALL,
    ChunkRun,
    Fallback,
    Parsed,
    StorageRun,
    Stream,
    StreamError,
    read_metadata_stream,
)
from fsdpcheck.sources.fileio import file_size, open_regular, past_the_end
from fsdpcheck.sources.remote import RemotePath, object_size, open_object
from fsdpcheck.sources.tiling import Box, tiling_problems

_NOTHING = torch.empty(0, 0, dtype=torch.int64)
_BLOCK = 1 << 18  # rows per block of per-chunk tensor work (bounded temporaries)
_GRIDS = 1024  # keys whose chunk index is kept (reads go key by key)


@dataclass
class DcpIndex:
    """A DCP checkpoint's metadata as columns (see the module docstring).

    Attributes:
        root: The checkpoint directory (or its prefix in an object store).
        digest: sha256 (hex) of the ``.metadata`` bytes parsed.
        keys: Every key, in metadata order.
        paths: Each key's structural path (``planner_paths``).
        tensor: Per key: whether it is a tensor.
        shapes / dtypes: Per key (tensors; ``()`` and None for values).
        first / count: Per key: its chunks' rows in the columns.
        coords: int64 [rows, 2 * D]: each chunk's offsets then sizes (D: the largest ndim;
            a key of ndim d uses columns [0:d] and [D:D + d]).
        entry: int64 [rows]: each chunk's storage entry (a row of the entry columns), or -1.
        odd: Keys whose chunks do not all have the key's number of dims: their chunks as
            boxes (they have no rows).
        files: Relative paths storage entries name.
        transforms: Distinct ``transform_descriptors`` tuples.
        entry_file / entry_where / entry_transform: Per storage entry: file (index into
            `files`), byte offset and length, transforms (index into `transforms`, -1: none).
        entry_names: Per storage entry: its fqn (index into `names`).
        names: Strings the entries name.
        value_entry: Per value key: its storage entry row.
    """

    root: Path | RemotePath
    digest: str
    keys: list[str]
    paths: dict[str, tuple[str, ...]]
    tensor: list[bool]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype | None]
    first: list[int]
    count: list[int]
    coords: torch.Tensor
    entry: torch.Tensor
    odd: dict[str, list[Box]]
    odd_entries: dict[str, list[int]]
    files: list[str]
    transforms: list[tuple[str, ...]]
    entry_file: torch.Tensor
    entry_where: torch.Tensor
    entry_transform: torch.Tensor
    entry_names: torch.Tensor
    names: list[str]
    value_entry: dict[str, int]
    key_id: dict[str, int] = field(default_factory=dict)
    _grids: dict[int, Any] = field(default_factory=dict, repr=False)
    _shapes: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    # -- per key ------------------------------------------------------------------------------
    def chunks(self, key: str) -> list[Box]:
        """Every chunk of a tensor key as (offsets, sizes), as ``.metadata`` lists them."""
        k = self.key_id[key]
        if key in self.odd:
            return list(self.odd[key])
        d = len(self.shapes[k])
        D = self.coords.shape[1] // 2
        rows = self.coords[self.first[k] : self.first[k] + self.count[k]]
        sel = torch.cat([rows[:, :d], rows[:, D : D + d]], 1).tolist()
        return [(tuple(r[:d]), tuple(r[d:])) for r in sel]

    def chunk_count(self, key: str) -> int:
        """Number of chunks of a tensor key."""
        k = self.key_id[key]
        return len(self.odd[key]) if key in self.odd else self.count[k]

    def box(self, row: int, ndim: int) -> Box:
        """The chunk in column row `row`, for a key of `ndim` dims."""
        D = self.coords.shape[1] // 2
        r = self.coords[row].tolist()
        return tuple(r[:ndim]), tuple(r[D : D + ndim])

    def storage(self, e: int) -> tuple[str, int, int, tuple[str, ...]]:
        """Storage entry `e`: (relative path, byte offset, length, transform descriptors)."""
        off, length = self.entry_where[e].tolist()
        t = int(self.entry_transform[e])
        return self.files[int(self.entry_file[e])], off, length, (
            self.transforms[t] if t >= 0 else ())  # fmt: skip

    def chunk(self, key: str, i: int) -> Box:
        """Chunk `i` of `key` (as `chunks` lists them)."""
        if key in self.odd:
            return self.odd[key][i]
        k = self.key_id[key]
        grid = self._grids.get(k)
        if grid is not None:
            return grid.boxes[i]
        return self.box(self.first[k] + i, len(self.shapes[k]))

    def singles(self, keys: Iterable[str]) -> dict[str, tuple[Box, int, Storage | None]]:
        """For the keys saved as one chunk: (its box, its entry row, where its bytes lie).

        All at once (a few tensor ops for any number of keys): a batch of a hundred thousand
        one-chunk tensors would otherwise pay several tensor lookups each.
        """
        ks = [k for k in set(keys) if k in self.key_id and k not in self.odd
              and self.count[self.key_id[k]] == 1]  # fmt: skip
        if not ks:
            return {}
        rows = torch.tensor([self.first[self.key_id[k]] for k in ks], dtype=torch.int64)
        D = self.coords.shape[1] // 2
        coords = self.coords[rows].tolist()
        ents = self.entry[rows].tolist()
        have = [e for e in ents if e >= 0]
        at = torch.tensor(have, dtype=torch.int64)
        where = self.entry_where[at].tolist() if have else []
        files = self.entry_file[at].tolist() if have else []
        trans = self.entry_transform[at].tolist() if have else []
        info = {e: (self.files[f], w[0], w[1], self.transforms[t] if t >= 0 else ())
                for e, w, f, t in zip(have, where, files, trans)}  # fmt: skip
        out = {}
        for k, c, e in zip(ks, coords, ents):
            d = len(self.shapes[self.key_id[k]])
            out[k] = ((tuple(c[:d]), tuple(c[D : D + d])), e, info.get(e))
        return out

    def position_of(self, key: str, offsets: Sequence[int]) -> int | None:
        """The position of the (last) chunk of `key` starting at `offsets`, or None."""
        offsets = tuple(offsets)
        if len(offsets) == len(self.shapes[self.key_id[key]]):
            point = [i for i in self.overlapping(key, offsets, (1,) * len(offsets))
                     if self.chunk(key, i)[0] == offsets]  # fmt: skip
            if point:
                return point[-1]
        found = [i for i, b in enumerate(self.chunks(key)) if b[0] == offsets]  # empty ones
        return found[-1] if found else None

    def chunk_entry(self, key: str, i: int) -> int:
        """Storage entry row of chunk `i` of `key` (as `chunks` lists them), or -1."""
        if key in self.odd:
            return self.odd_entries[key][i]
        k = self.key_id[key]
        grid = self._grids.get(k)
        if grid is not None:
            return grid.entries[i]
        return int(self.entry[self.first[k] + i])

    def overlapping(self, key: str, offset: Sequence[int], size: Sequence[int]) -> list[int]:
        """Positions (in `chunks(key)`) of the non-empty chunks that share an element with a box.

        O(log n + hits) where the key's non-empty chunks form a grid (each dim's distinct
        (offset, size) pairs disjoint and every chunk one cell); a scan otherwise.
        """
        k = self.key_id[key]
        if key not in self.odd and self.count[k] == 1:  # one chunk: nothing to index
            one = self.box(self.first[k], len(self.shapes[k]))
            return [0] if boxes_meet(one, (tuple(offset), tuple(size))) else []
        grid = self._grids.pop(k, None)
        if grid is None:
            grid = _Grid.build(self.chunks(key))
            if key not in self.odd:  # each chunk's entry, as a list (reads ask chunk by chunk)
                grid.entries = self.entry[self.first[k] : self.first[k] + self.count[k]].tolist()
        self._grids[k] = grid  # most recently used last
        if len(self._grids) > _GRIDS:
            del self._grids[next(iter(self._grids))]
        return grid.query(tuple(offset), tuple(size))


class _Grid:
    """Chunks indexed by their (offset, size) band in each dim (see `DcpIndex.overlapping`)."""

    def __init__(self, boxes: list[Box]) -> None:
        self.boxes = boxes
        self.entries: list[int] = []
        self.starts: list[list[int]] | None = None
        self.ends: list[list[int]] = []
        self.cell: dict[tuple[int, ...], int] = {}

    @classmethod
    def build(cls, boxes: list[Box]) -> _Grid:
        g = cls(boxes)
        live = [i for i, (_, s) in enumerate(boxes) if all(x > 0 for x in s)]
        if not live or not boxes[live[0]][0]:
            g.starts = None  # scalars or nothing non-empty: scan
            return g
        ndim = len(boxes[live[0]][0])
        bands: list[list[tuple[int, int]]] = []
        for d in range(ndim):
            uniq = sorted({(boxes[i][0][d], boxes[i][1][d]) for i in live})
            if any(a[0] + a[1] > b[0] for a, b in itertools.pairwise(uniq)):
                return g  # bands overlap: scan
            bands.append(uniq)
        where = [{b: j for j, b in enumerate(bs)} for bs in bands]
        for i in live:
            cell = tuple(where[d][(boxes[i][0][d], boxes[i][1][d])] for d in range(ndim))
            if cell in g.cell:
                return g  # two chunks in one cell (they overlap): scan
            g.cell[cell] = i
        g.starts = [[o for o, _ in bs] for bs in bands]
        g.ends = [[o + s for o, s in bs] for bs in bands]
        return g

    def query(self, offset: tuple[int, ...], size: tuple[int, ...]) -> list[int]:
        if self.starts is None:
            return [i for i, b in enumerate(self.boxes) if boxes_meet(b, (offset, size))]
        ranges = []
        for d, (o, s) in enumerate(zip(offset, size)):
            if s <= 0:
                return []
            lo = bisect_right(self.ends[d], o)
            hi = bisect_left(self.starts[d], o + s)
            if lo >= hi:
                return []
            ranges.append(range(lo, hi))
        out = []
        total = math.prod(len(r) for r in ranges)
        if total > len(self.cell):  # a box covering most cells: walk the chunks instead
            return sorted(i for c, i in self.cell.items() if all(c[d] in r for d, r in
                                                                  enumerate(ranges)))  # fmt: skip
        for cell in _product(ranges):
            i = self.cell.get(cell)
            if i is not None:
                out.append(i)
        return sorted(out)


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*c, j) for c in out for j in r]
    return out


#: Where a storage entry's bytes lie: (relative path, byte offset, length, transforms).
Storage = tuple[str, int, int, tuple[str, ...]]


# -------------------------------------------------------------------------------------------
def read_parsed(root: Path | RemotePath, columns: bool | None = None) -> Parsed:
    """``.metadata`` of `root`, opened by what it is and read as it streams.

    Files of `SMALL` bytes and more read their runs of chunk and storage records as columns;
    smaller ones are read into objects (fewer records than the fast path's set-up is worth).
    Every file goes through the same restricted machine: no unpickler whose memo a file can
    size (NOTE: [metadata columns] in ``dcp_runs``).

    Raises:
        FileNotFoundError / PermissionError / CheckpointError / UnsafePickleError: as
        `read_dcp_metadata`.
    """
    what = f"DCP metadata {root / METADATA_FILE}"
    fd: int | Stream
    if isinstance(root, RemotePath):  # its size from the listing: refused before it is fetched
        fd = open_object(root / METADATA_FILE, "DCP metadata").stream()
        size = fd.size
    else:
        fd, st = open_regular(root / METADATA_FILE, "DCP metadata")
        size = st.st_size
    try:
        if size > MAX_METADATA:
            raise CheckpointError(
                f"{what} has {size} bytes, more than the {MAX_METADATA} fsdpcheck reads; "
                "refusing it"
            )
        if columns is None:
            columns = size >= SMALL
        return read_metadata_stream(fd, what, _mirror, MAX_METADATA, columns=columns)
    except (UnsafePickleError, CheckpointError):
        raise
    except (StreamError, ValueError) as exc:
        raise CheckpointError(f"{what} is unreadable: {exc}") from None
    finally:
        if isinstance(fd, int):
            os.close(fd)


def _trim() -> None:
    """Hands memory freed by a large read back to the system (glibc keeps it otherwise).

    NOTE: [returning memory] glibc raises its mmap threshold after large blocks are freed and
    then keeps later ones on its heap: reading a 151 MB ``.metadata`` left ~60 MB of freed
    windows resident, and the objects of a 20 MB one (100k tensors) ~190 MB, which every later
    phase stacked its peak on.
    """
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def open_index(
    root: str | os.PathLike[str] | RemotePath, *, trusted_digest: str | None = None
) -> tuple[DcpIndex, StorageProblems | None]:
    """Reads and (unless `trusted_digest` matches) checks a DCP checkpoint's metadata.

    Args:
        root: The checkpoint directory, or its prefix in an object store.
        trusted_digest: See NOTE: [trusted metadata].

    Returns:
        The index and what `check` found (None when the digest matched: not checked here).
    """
    root = root if isinstance(root, RemotePath) else Path(root)
    # NOTE: [one thread] The column work is hundreds of mid-sized tensor ops: on 2 cores
    # shared with other work, torch's intra-op threads doubled its CPU time (1M chunks: 8.4 s
    # of CPU against 4.0 s on one thread) for no gain in wall time, so it runs on one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # NOTE: [collector] in ``fsdpcheck._collector``: the read makes millions of short-lived
        # tuples (the records' matches), each counting towards a young collection.
        with paused():
            return _open(root, trusted_digest)
    finally:
        torch.set_num_threads(threads)


def _open(
    root: Path | RemotePath, trusted_digest: str | None
) -> tuple[DcpIndex, StorageProblems | None]:
    parsed = read_parsed(root)
    if parsed.nbytes >= 4 << 20:
        _trim()  # the windows and records of the read, before the columns are built
    try:
        index = build_index(parsed, root)
    except Fallback:
        # Column runs and plain objects disagree where the same position is set twice (or
        # the file is malformed there): what a dict makes of it decides, read as objects.
        parsed = read_parsed(root, columns=False)
        index = build_index(parsed, root)
    big = parsed.nbytes >= 4 << 20
    del parsed
    if big:
        _trim()
    if trusted_digest is not None and trusted_digest == index.digest:
        return index, None
    return index, check(index)


def build_index(parsed: Parsed, root: Path | RemotePath) -> DcpIndex:
    """The columns of parsed metadata (objects, with column runs where the stream had them).

    Raises:
        CheckpointError: It is not well-typed DCP metadata (as `validate_metadata`).
    """
    md = parsed.metadata
    what = f"DCP metadata {root / METADATA_FILE}"
    runs = bool(parsed.runs)
    try:
        validate_metadata(md, what)
    except RecursionError:
        raise CheckpointError(f"{what} is nested too deeply to be DCP metadata") from None
    except CheckpointError:
        if runs:  # the objects decide (a stale plain entry a run overwrites, ...)
            raise Fallback("invalid next to column runs") from None
        raise
    paths = planner_paths(md)
    keys: list[str] = []
    tensor: list[bool] = []
    shapes: list[tuple[int, ...]] = []
    dtypes: list[torch.dtype | None] = []
    first: list[int] = []
    count: list[int] = []
    odd: dict[str, list[Box]] = {}
    # Regular chunks: (key id, column block) in order, blocks are [n, 2d] tensors or rows.
    blocks: list[tuple[int, Any]] = []
    rows = 0
    big = 0
    for key, meta in md.state_dict_metadata.items():
        k = len(keys)
        keys.append(key)
        if not is_tensor_meta(meta):
            tensor.append(False)
            shapes.append(())
            dtypes.append(None)
            first.append(rows)
            count.append(0)
            continue
        shape = tuple(meta.size)
        d = len(shape)
        big = max(big, d)
        tensor.append(True)
        shapes.append(shape)
        dtypes.append(meta.properties.dtype)
        first.append(rows)
        regular = all(
            (c.coords.shape[1] == 2 * d) if type(c) is ChunkRun
            else (len(c.offsets) == d and len(c.sizes) == d)
            for c in meta.chunks
        )  # fmt: skip
        if not regular:
            odd[key] = [b for c in meta.chunks for b in _boxes(c)]
            count.append(0)
            continue
        n = 0
        plain: list[list[int]] = []
        for c in meta.chunks:
            if type(c) is ChunkRun:
                if plain:
                    blocks.append((k, plain))
                    plain = []
                blocks.append((k, c))
                n += len(c)
            else:
                plain.append([*c.offsets, *c.sizes])
                n += 1
        if plain:
            blocks.append((k, plain))
        count.append(n)
        rows += n
    D = max(big, 1)
    coords = _columns(blocks, shapes, D, rows)
    index = DcpIndex(
        root=root,
        digest=parsed.digest,
        keys=keys,
        paths=paths,
        tensor=tensor,
        shapes=shapes,
        dtypes=dtypes,
        first=first,
        count=count,
        coords=coords,
        entry=torch.full((rows,), -1, dtype=torch.int32),
        odd=odd,
        odd_entries={},
        files=[],
        transforms=[],
        entry_file=torch.empty(0, dtype=torch.int64),
        entry_where=torch.empty(0, 2, dtype=torch.int64),
        entry_transform=torch.empty(0, dtype=torch.int64),
        entry_names=torch.empty(0, dtype=torch.int64),
        names=[],
        value_entry={},
        key_id={k: i for i, k in enumerate(keys)},
    )
    _storage(index, parsed, what, runs)
    return index


def _boxes(c: Any) -> list[Box]:
    if type(c) is ChunkRun:
        d = c.coords.shape[1] // 2
        return [(tuple(r[:d]), tuple(r[d:])) for r in c.coords.tolist()]
    return [(tuple(c.offsets), tuple(c.sizes))]


def _columns(
    blocks: list[tuple[int, Any]], shapes: list[tuple[int, ...]], D: int, rows: int
) -> torch.Tensor:
    """[rows, 2D] of every regular chunk: offsets in [0:d], sizes in [D:D + d]."""
    out = torch.zeros(rows, 2 * D, dtype=torch.int64)
    at = 0
    # Rows given as lists are gathered into one tensor per width (one call, not one per key).
    pending: dict[int, list[tuple[int, list[list[int]]]]] = {}
    for j, (k, block) in enumerate(blocks):
        d = len(shapes[k])
        if isinstance(block, ChunkRun):
            n = block.n
            out[at : at + n, :d] = block.coords[:, :d]
            out[at : at + n, D : D + d] = block.coords[:, d:]
            block.coords = _NOTHING  # copied: its memory goes now, not after the whole build
            blocks[j] = (k, None)
        else:
            n = len(block)
            pending.setdefault(d, []).append((at, block))
        at += n
    for d, parts in pending.items():
        if d == 0:
            continue  # scalars: no coordinates
        flat = [r for _, b in parts for r in b]
        t = torch.tensor(flat, dtype=torch.int64).view(-1, 2 * d) if flat else None
        if t is None:
            continue
        # Row numbers of every part, at once: each part's first row, repeated, plus 0..n-1.
        lens = torch.tensor([len(b) for _, b in parts], dtype=torch.int64)
        firsts = torch.tensor([a for a, _ in parts], dtype=torch.int64)
        within = torch.arange(int(lens.sum())) - torch.repeat_interleave(
            torch.cumsum(lens, 0) - lens, lens
        )
        starts = torch.repeat_interleave(firsts, lens) + within
        out[starts, :d] = t[:, :d]
        out[starts, D : D + d] = t[:, d:]
    return out


def _storage(index: DcpIndex, parsed: Parsed, what: str, runs: bool) -> None:
    """Fills the entry columns and joins chunks and values to their entries (last one wins)."""
    md = parsed.metadata
    names: list[str] = list(parsed.names)
    name_id = {s: i for i, s in enumerate(names)}
    files: dict[str, int] = {}
    transforms: dict[tuple[str, ...], int] = {}

    def nid(s: str) -> int:
        i = name_id.get(s)
        if i is None:
            i = name_id[s] = len(names)
            names.append(s)
        return i

    D = index.coords.shape[1] // 2
    # Entries in dict order, runs where they were set. The plain entries between runs (the
    # first of their kind, one whose fresh path has a length not seen before, whatever no
    # pattern matched) are gathered into lists across all their pieces and the runs' columns
    # joined, each made into tensors once: a run costs no tensor op of its own (1M entries
    # are a thousand runs or more).
    flat: list[int] = []  # the offsets of every plain entry, padded to D
    dims: list[int] = []
    fqs: list[int] = []
    fis: list[int] = []
    whs: list[int] = []
    trs: list[int] = []
    order: list[tuple[bool, int]] = []  # per piece: (a run, its number of entries)
    kept: list[StorageRun] = []

    def plain(items: list[tuple[Any, Any]]) -> None:
        if not items:
            return
        for idx, info in items:
            fqn, offsets = position(idx)
            fqs.append(nid(fqn))
            path = info.relative_path
            fis.append(files.setdefault(path, len(files)))
            whs.extend((info.offset, info.length))
            td = tuple(info.transform_descriptors or ())
            trs.append(transforms.setdefault(td, len(transforms)) if td else -1)
            if offsets is None or len(offsets) > D:
                dims.append(-1 if offsets is None else -2)  # -2: matches no chunk
                flat.extend((0,) * D)
            else:
                dims.append(len(offsets))
                flat.extend(offsets)
                flat.extend((0,) * (D - len(offsets)))
        order.append((False, len(items)))

    items = list(md.storage_data.items())
    at = 0
    pieces = parsed.storage_runs.pop(id(md.storage_data), [])
    for before, run in pieces:
        plain(items[at:before])
        at = max(at, before)
        kept.append(run)
        order.append((True, len(run)))
    plain(items[at:])
    del pieces, items
    i32, i64 = torch.int32, torch.int64
    n_plain = len(fqs)
    p_fq = torch.tensor(fqs, dtype=i32)
    p_fi = torch.tensor(fis, dtype=i32)
    p_wh = torch.tensor(whs, dtype=i64).view(n_plain, 2)
    p_tr = torch.tensor(trs, dtype=i32)
    p_off = torch.tensor(flat, dtype=i64).view(n_plain, D)
    p_nd = torch.tensor(dims, dtype=torch.int8)
    if kept:
        r_wh = torch.cat([r.where for r in kept])
        if bool((r_wh < 0).any()):  # the first such entry of the first such run
            bad = int((r_wh < 0).any(1).nonzero()[0])
            col = 0 if int(r_wh[bad, 0]) < 0 else 1
            fqn = parsed.names[int(_joined(kept, "fqns")[bad])]
            name = ("offset", "length")[col]
            raise CheckpointError(f"{what}: {fqn}: storage {name} is {int(r_wh[bad, col])}")
        r_fq = _joined(kept, "fqns").to(i32)
        # Paths as name ids, then file ids: files the plain entries name first (in their
        # order), then the runs' in name order.
        r_fi = _joined(kept, "paths")
        table = torch.full((len(names),), -1, dtype=i32)
        for p in r_fi.unique().tolist():
            table[p] = files.setdefault(names[p], len(files))
        r_fi = table[r_fi]
        # Offsets padded (or cut) to D columns; an entry of more dims than any key matches
        # none. The runs of one decoded batch share its width.
        r_off = torch.cat([r.offsets if r.offsets.shape[1] == D else _width(r.offsets, D)
                           for r in kept])  # fmt: skip
        r_nd = torch.cat([r.ndims for r in kept])
        r_nd = torch.where(r_nd > D, -2, r_nd).to(torch.int8)
        r_tr = torch.full((r_fq.shape[0],), -1, dtype=i32)
        kept.clear()  # the runs' columns go once joined
        if n_plain:  # interleaved in dict order
            p_sizes = [n for run, n in order if not run]
            r_sizes = [n for run, n in order if run]

            def merge(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
                ps, rs = iter(p.split(p_sizes)), iter(r.split(r_sizes))
                return torch.cat([next(rs) if run else next(ps) for run, _ in order])

            pairs = ((p_fq, r_fq), (p_fi, r_fi), (p_wh, r_wh), (p_tr, r_tr), (p_off, r_off),
                     (p_nd, r_nd))  # fmt: skip
            cols = [merge(p, r) for p, r in pairs]
            del pairs
        else:
            cols = [r_fq, r_fi, r_wh, r_tr, r_off, r_nd]
        del r_fq, r_fi, r_wh, r_tr, r_off, r_nd
    else:
        cols = [p_fq, p_fi, p_wh, p_tr, p_off, p_nd]
    del p_fq, p_fi, p_wh, p_tr, p_off, p_nd
    index.entry_names, index.entry_file, index.entry_where, index.entry_transform = cols[:4]
    e_off, e_nd = cols[4], cols[5]
    del cols
    index.names = names
    index.files = list(files)
    index.transforms = list(transforms)
    _join(index, e_off, e_nd, runs)


def _joined(runs: list[StorageRun], field: str) -> torch.Tensor:
    """int64 [n]: the runs' name ids of `field` ("fqns" or "paths"), one after another."""
    out = array("q")
    for r in runs:
        out += getattr(r, field)
    return torch.frombuffer(out, dtype=torch.int64) if out else torch.empty(0, dtype=torch.int64)


def _width(offsets: torch.Tensor, D: int) -> torch.Tensor:
    """Offsets columns padded with zeros (or cut) to `D`."""
    o = torch.zeros(offsets.shape[0], D, dtype=torch.int64)
    d = min(offsets.shape[1], D)
    o[:, :d] = offsets[:, :d]
    return o


def _join(index: DcpIndex, e_off: torch.Tensor, e_nd: torch.Tensor, runs: bool) -> None:
    """Each chunk's and value's storage entry: the last entry at its position (as a dict).

    Raises:
        Fallback: Column runs and two entries at one position (a dict keeps one key object
            with the last value; read as objects, exactly).
    """
    D = index.coords.shape[1] // 2
    n_entries = e_off.shape[0]
    key_of_name = torch.tensor(
        [index.key_id.get(s, -1) for s in index.names], dtype=torch.int64
    ) if index.names else torch.empty(0, dtype=torch.int64)  # fmt: skip
    e_key = key_of_name[index.entry_names.long()] if n_entries else torch.empty(
        0, dtype=torch.int64)  # fmt: skip
    e_nd = e_nd.to(torch.int64)
    shape_pad, ndim = _shape_table(index)
    is_tensor = torch.tensor(index.tensor, dtype=torch.bool)
    if n_entries:
        for e in ((e_nd == -1) & (e_key >= 0)).nonzero().flatten().tolist():
            k = int(e_key[e])
            if not index.tensor[k]:
                index.value_entry[index.keys[k]] = e  # later ones win, as in a dict
    rows = index.coords.shape[0]
    slow: set[int] = set()
    if rows and n_entries:
        c_key = torch.repeat_interleave(
            torch.arange(len(index.keys), dtype=torch.int32),
            torch.tensor(index.count, dtype=torch.int64),
        )
        ok = (e_key >= 0) & (e_nd >= 0)
        kk = e_key.clamp(min=0)
        ok &= is_tensor[kk] & (e_nd == ndim[kk])
        # NOTE: [position codes] A position (key, offsets) as one int64: the key id above bit
        # 43 and the offsets ravelled in base (dim + 1), so offsets 0..dim (an empty chunk
        # sits at the end) are distinct. Keys whose positions do not fit are joined in Python.
        base = shape_pad + 1
        stride = torch.ones_like(base)
        for d in range(D - 2, -1, -1):
            stride[:, d] = stride[:, d + 1] * base[:, d + 1]
        span = stride[:, 0] * base[:, 0]
        fits = (span < (1 << 43)) & (torch.arange(len(index.keys)) < (1 << 19))
        for k in (~fits & is_tensor).nonzero().flatten().tolist():
            slow.add(k)

        def code(key: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            n = key.shape[0]
            codes = torch.empty(n, dtype=torch.int64)
            inside = torch.empty(n, dtype=torch.bool)
            for lo in range(0, n, _BLOCK):  # bounded temporaries
                k = key[lo : lo + _BLOCK].long()
                off = offs[lo : lo + _BLOCK]
                ins = ((off >= 0) & (off <= shape_pad[k])).all(1) & fits[k]
                c = (off * stride[k]).sum(1) + (k << 43)
                codes[lo : lo + _BLOCK] = torch.where(ins, c, -1)
                inside[lo : lo + _BLOCK] = ins
            return codes, inside

        e_code, e_in = code(kk, e_off)
        e_code = torch.where(ok & e_in, e_code, -1)
        del e_in, ok, kk
        sorted_codes, order = torch.sort(e_code, stable=True)
        if runs:
            # Sorted, two entries at one position are neighbours (-1s, no position, first).
            same = sorted_codes[1:] == sorted_codes[:-1]
            if bool((same & (sorted_codes[1:] >= 0)).any()):
                raise Fallback("two storage entries at one position")
            del same
            others = (e_code < 0).nonzero().flatten().tolist()  # rare: Python is fine
            seen = {(int(index.entry_names[e]), int(e_nd[e]), tuple(e_off[e].tolist()))
                    for e in others}  # fmt: skip
            if len(seen) != len(others):
                raise Fallback("two storage entries at one position")
        del e_code
        # The chunks' positions looked up a block at a time (bounded temporaries).
        coords = index.coords[:, :D]
        for lo in range(0, rows, _BLOCK):
            hi = min(rows, lo + _BLOCK)
            c_code, c_in = code(c_key[lo:hi], coords[lo:hi])
            for k in c_key[lo:hi][~c_in].unique().tolist():
                slow.add(k)  # a chunk outside its shape: its key is joined in Python
            at = (torch.searchsorted(sorted_codes, c_code, right=True) - 1).clamp(min=0)
            hit = (sorted_codes[at] == c_code) & c_in & (c_code >= 0)
            index.entry[lo:hi] = torch.where(hit, order[at], -1).to(torch.int32)
        del order, sorted_codes
    for k in sorted(slow):
        key = index.keys[k]
        if key in index.odd or not index.count[k]:
            continue
        found = _entry_map(index, key, e_off, e_nd, e_key)
        lo = index.first[k]
        for i, (o, _) in enumerate(index.chunks(key)):
            index.entry[lo + i] = found.get(o, -1)
    for key, boxes in index.odd.items():
        found = _entry_map(index, key, e_off, e_nd, e_key)
        index.odd_entries[key] = [found.get(b[0], -1) for b in boxes]


def _entry_map(
    index: DcpIndex, key: str, e_off: torch.Tensor, e_nd: torch.Tensor, e_key: torch.Tensor
) -> dict[tuple[int, ...], int]:
    """Offsets -> entry row for one key (Python; keys whose chunks have odd dims)."""
    k = index.key_id[key]
    out: dict[tuple[int, ...], int] = {}
    for e in (e_key == k).nonzero().flatten().tolist():
        d = int(e_nd[e])
        if d >= 0:
            out[tuple(e_off[e, :d].tolist())] = e
    return out


# -------------------------------------------------------------------------------------------
@dataclass
class StorageProblems:
    """What `check` found (the vocabulary of ``dcp_metadata.StorageCheck``).

    Attributes:
        findings: ``(key, kind, message)``, kind "gap", "layout", "missing" or "error".
        bad_chunks: Per key, chunk position -> why its storage must not be read.
        bad_values: Per value key: why its storage must not be read.
        overlapping: Keys whose chunks overlap.
        gaps: Keys with a region no chunk covers.
        tiling: Per key with any: what keeps its chunks from tiling its shape (gap and
            overlap lines, as ``tiling_problems``).
    """

    findings: list[Problem] = field(default_factory=list)
    tiling: dict[str, list[str]] = field(default_factory=dict)
    bad_chunks: dict[str, dict[int, str]] = field(default_factory=dict)
    bad_values: dict[str, str] = field(default_factory=dict)
    overlapping: set[str] = field(default_factory=set)
    gaps: set[str] = field(default_factory=set)

    @property
    def problems(self) -> list[Problem]:
        """The findings with kind "gap" or "error" (the Source.problems vocabulary)."""
        return [(k, "gap" if kind == "gap" else "error", m) for k, kind, m in self.findings]


def _more_than(sizes: torch.Tensor, mask: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Per row: the product of its sizes (where `mask`; >= 1 each) exceeds `cap` (>= 0).

    ``prod(s) <= cap`` exactly when each size is at most the cap divided (floor) by the sizes
    before it; the product itself, up to 2**(63 * D), is never formed (NOTE: [claimed sizes]).
    The empty product (a 0-d chunk) is 1.
    """
    rem = cap.clone()
    over = cap < 1
    for d in range(sizes.shape[1]):
        s = torch.where(mask[:, d], sizes[:, d], 1).clamp(min=1)
        over |= s > rem
        rem = rem // s
    return over


def check(index: DcpIndex) -> StorageProblems:
    """Every structural problem of the checkpoint that shows without reading data.

    Per tensor: chunks with the wrong number of dims or outside the global shape, chunks that
    leave gaps ("gap") or overlap, chunks without a storage entry, and chunks whose stored
    bytes are fewer than their elements need. Per storage entry: a path outside the directory,
    a missing or non-regular file, bytes past the end of the file. One stat per data file.
    """
    out = StorageProblems()
    root = index.root
    n_entries = index.entry_where.shape[0]
    entry_bad: dict[int, str] = {}
    if n_entries:
        # NOTE: [claimed sizes] Offsets, lengths and sizes are the file's claims (up to
        # 2**63 - 1 each): sums and products of them are never formed in int64 (they wrap), they
        # are compared by subtraction and division of values known to be >= 0.
        e_off, e_len = index.entry_where[:, 0], index.entry_where[:, 1]
        nfiles = len(index.files)
        sizes = torch.zeros(nfiles, dtype=torch.int64)
        unreadable = torch.zeros(nfiles, dtype=torch.bool)
        whys: dict[int, str] = {}
        # An object store: the sizes of its listing (NOTE: [object storage] in ``remote``).
        real_root = None if isinstance(root, RemotePath) else root.resolve()
        for f, rel in enumerate(index.files):
            if isinstance(root, RemotePath):
                why, size = object_size(root, rel, "storage entry")
            else:
                why, size = file_size(root, rel, "storage entry", real_root)
            if why is not None:
                whys[f] = why
                unreadable[f] = True
            sizes[f] = size
        ef = index.entry_file.long()
        size_e = sizes[ef]
        past = ((e_off > size_e) | (e_len > size_e - e_off)) & ~unreadable[ef]
        for e in (unreadable[ef] | past).nonzero().flatten().tolist():
            f = int(index.entry_file[e])
            entry_bad[e] = whys.get(f) or past_the_end(
                "its data", int(e_off[e]) + int(e_len[e]), index.files[f], int(sizes[f])
            )
    D = index.coords.shape[1] // 2
    shapes = index.shapes
    problems = out.findings
    # Per-chunk conditions, for all chunks at once (in blocks of rows: bounded temporaries).
    rows = index.coords.shape[0]
    c_key = torch.repeat_interleave(
        torch.arange(len(index.keys), dtype=torch.int32),
        torch.tensor(index.count, dtype=torch.int64),
    )
    outside = torch.zeros(rows, dtype=torch.bool)
    live = torch.zeros(rows, dtype=torch.bool)
    spans = torch.zeros(rows, D, dtype=torch.bool)  # the chunk spans dim d whole (or no dim d)
    flag = torch.zeros(rows, dtype=torch.bool)
    if rows:
        shape_pad, nd = _shape_table(index)
        mask_pad = torch.arange(D).unsqueeze(0) < nd.unsqueeze(1)
        itemsizes = torch.tensor(
            [d.itemsize if d is not None else 0 for d in index.dtypes], dtype=torch.int64
        )
        for lo in range(0, rows, _BLOCK):
            hi = min(rows, lo + _BLOCK)
            ck = c_key[lo:hi].long()
            off, sz = index.coords[lo:hi, :D], index.coords[lo:hi, D:]
            g, m = shape_pad[ck], mask_pad[ck]
            out_here = (((off < 0) | (sz < 0) | (sz > g - off)) & m).any(1)
            ent = index.entry[lo:hi].long()
            has = ent >= 0
            stored = torch.where(has, index.entry_where[ent.clamp(min=0), 1], 0)
            live_here = ((sz > 0) | ~m).all(1)  # no element: not live (a 0-d chunk is)
            missing = ~out_here & ~has & live_here
            cap = stored // itemsizes[ck].clamp(min=1)  # elements the entry can hold
            # NOTE: [transformed entries] An entry with a storage transform (DCP's zstd
            # extension) stores fewer bytes than its elements need: its size is checked when it
            # is decoded (bounded by what the chunk declares), not here.
            plain = torch.where(has, index.entry_transform[ent.clamp(min=0)] < 0, True)
            short = ~out_here & has & live_here & plain & _more_than(sz, m, cap)
            outside[lo:hi] = out_here
            live[lo:hi] = live_here
            flag[lo:hi] = out_here | missing | short
            spans[lo:hi] = ((off == 0) & (sz == g)) | ~m
        tiled_ok = _tiles(index, c_key, outside, live, spans)
    else:
        tiled_ok = set()
    flagged = flag.nonzero().flatten().tolist()
    del flag
    declared: list[tuple[str, str]] = []
    flagged_by_key: dict[int, list[int]] = {}
    for r in flagged:
        flagged_by_key.setdefault(int(c_key[r]), []).append(r)
    del c_key
    for k, key in enumerate(index.keys):
        if not index.tensor[k]:
            e = index.value_entry.get(key)
            if e is None:
                problems.append((key, "missing", "no storage entry holds this value"))
            elif e in entry_bad:
                out.bad_values[key] = entry_bad[e]
            continue
        shape = shapes[k]
        d = len(shape)
        if key in index.odd:
            boxes = index.odd[key]
            entries = index.odd_entries[key]
            declared += _check_odd(key, shape, index.dtypes[k], boxes, entries, index, entry_bad,
                                   out)  # fmt: skip
            continue
        bad = out.bad_chunks.setdefault(key, {})
        itemsize = index.dtypes[k].itemsize  # type: ignore[union-attr]
        for r in flagged_by_key.get(k, []):
            i = r - index.first[k]
            o = tuple(index.coords[r, :d].tolist())
            s = tuple(index.coords[r, D : D + d].tolist())
            if any(a < 0 or b < 0 or a + b > gg for a, b, gg in zip(o, s, shape)):
                problems.append((key, "layout", outside_shape(o, s, shape)))
                continue
            e = int(index.entry[r])
            n = math.prod(s)
            if e < 0:
                problems.append((key, "missing", no_entry(o)))
                continue
            length = int(index.entry_where[e, 1])
            problems.append((key, "error", short_data(o, n, itemsize, length)))
            if e not in entry_bad:
                declared.append((key, problems[-1][2]))
            bad.setdefault(i, problems[-1][2])
        if k not in tiled_ok:
            lo = index.first[k]
            out_k = outside[lo : lo + index.count[k]].tolist()
            boxes = [b for b, o in zip(index.chunks(key), out_k)
                     if not o and (math.prod(b[1]) > 0 or not shape)]  # fmt: skip
            _tiling(key, shape, boxes, out)
        if entry_bad and index.count[k]:
            ents = index.entry[index.first[k] : index.first[k] + index.count[k]].tolist()
            for i, e in enumerate(ents):
                if e in entry_bad:
                    bad.setdefault(i, entry_bad[e])
        if not bad:
            del out.bad_chunks[key]
    # Every entry that must not be read, once per (key, reason): storage
    # entries by file first, then chunks whose data is shorter than they declare.
    final = [(index.names[int(index.entry_names[e])], why) for e, why in entry_bad.items()]
    final += declared
    seen = {(key, why) for key, kind, why in problems if kind == "error"}  # listed already
    for key, why in final:
        if (key, why) not in seen:
            seen.add((key, why))
            problems.append((key, "error", why))
    return out


def check_storage(root: str | os.PathLike[str], md: Any) -> StorageCheck:
    """`check` of metadata already read into objects (the mirrors or DCP's own classes).

    The one structural checker: the objects are made into the same columns a streamed read
    gives (`build_index`, no column runs) and checked by `check`, so a checkpoint handed to
    ``dcp.load`` is judged exactly as ``audit`` and ``compare`` judge it.

    Raises:
        CheckpointError: `md` is not well-typed DCP metadata (as `validate_metadata`).
    """
    index = build_index(Parsed(md), Path(root))
    found = check(index)
    bad: dict[Position, str] = {}
    for key, whys in found.bad_chunks.items():
        boxes = index.chunks(key)
        for i, why in whys.items():
            bad[(key, tuple(boxes[i][0]))] = why
    for key, why in found.bad_values.items():
        bad[(key, None)] = why
    return StorageCheck(found.findings, bad, found.overlapping, found.gaps,
                        storage_by_position(md))  # fmt: skip


def _check_odd(
    key: str,
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
    boxes: list[Box],
    entries: list[int],
    index: DcpIndex,
    entry_bad: dict[int, str],
    out: StorageProblems,
) -> list[tuple[str, str]]:
    """`check` for a key whose chunks have odd dims (chunk by chunk, as ``chunk_finding``).

    Returns:
        (key, reason) of its chunks whose data is shorter than they declare.
    """
    declared = []
    problems = out.findings
    bad = out.bad_chunks.setdefault(key, {})
    good: list[Box] = []
    itemsize = dtype.itemsize if dtype is not None else 0
    for i, ((o, s), e) in enumerate(zip(boxes, entries)):
        stored = int(index.entry_where[e, 1]) if e >= 0 else None
        found, live = chunk_finding(
            o, s, shape, itemsize, stored, e >= 0 and int(index.entry_transform[e]) >= 0
        )
        if live:
            good.append((o, s))
        if found is not None:
            problems.append((key, *found))
            if found[0] == "error":
                if e not in entry_bad:
                    declared.append((key, found[1]))
                bad.setdefault(i, found[1])
        inside = found is None or found[0] == "error"  # in the shape, with an entry
        if inside and e in entry_bad:
            bad.setdefault(i, entry_bad[e])
    _tiling(key, shape, good, out)
    if not bad:
        del out.bad_chunks[key]
    return declared


def _tiling(key: str, shape: tuple[int, ...], boxes: list[Box], out: StorageProblems) -> None:
    """Gap and overlap findings of one key's (readable, non-empty) chunks."""
    found = tiling_problems(shape, boxes)
    if not found:
        return
    out.tiling[key] = found
    for p in found:
        if p.startswith("gap"):
            out.gaps.add(key)
            out.findings.append((key, "gap", f"{p}: no saved chunk holds this region"))
        else:
            out.overlapping.add(key)
            out.findings.append((key, "layout", p))


def _shape_table(index: DcpIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key: its shape padded to D with zeros, and its number of dims (0 for values)."""
    if index._shapes is not None:  # made once per index
        return index._shapes
    D = index.coords.shape[1] // 2
    pad = [list(s) + [0] * (D - len(s)) if t else [0] * D for s, t in
           zip(index.shapes, index.tensor)]  # fmt: skip
    ndim = [len(s) if t else 0 for s, t in zip(index.shapes, index.tensor)]
    table = (torch.tensor(pad, dtype=torch.int64).view(-1, D),
             torch.tensor(ndim, dtype=torch.int64))  # fmt: skip
    index._shapes = table
    return table


def _tiles(
    index: DcpIndex,
    c_key: torch.Tensor,
    outside: torch.Tensor,
    live: torch.Tensor,
    spans: torch.Tensor,
) -> set[int]:
    """Keys whose chunks (none outside the shape) tile the shape exactly, found at once.

    Recognised without a per-key sweep: chunks stacked along one dim (sorted by their offset
    there, each starting where the one before ends, spanning every other dim whole), which is
    what data-parallel and FSDP saves write, and 0-d tensors saved once. Other keys go through
    `tiling_problems`, which also names what is wrong.
    """
    D = index.coords.shape[1] // 2
    nkeys = len(index.keys)
    ok: set[int] = set()
    shape_pad, ndim = _shape_table(index)
    count = torch.tensor(index.count, dtype=torch.int64)
    any_out = torch.zeros(nkeys, dtype=torch.bool)
    if outside.numel():
        any_out[c_key[outside].long()] = True
    cand = (~any_out) & (count > 0) & torch.tensor(
        [t and key not in index.odd for t, key in zip(index.tensor, index.keys)], dtype=torch.bool
    )  # fmt: skip
    for k in ((ndim == 0) & cand & (count == 1)).nonzero().flatten().tolist():
        ok.add(k)  # 0-d: exactly one chunk
    for d in range(D):
        # Keys stacked along d: every live chunk spans the other dims whole.
        other = torch.ones(D, dtype=torch.bool)
        other[d] = False
        rows_ok = (spans | ~other).all(1) | ~live
        key_ok = cand & (ndim > d)
        key_ok[c_key[~rows_ok].long()] = False
        if not bool(key_ok.any()):
            continue
        sel = (key_ok[c_key.long()] & live).nonzero().flatten()
        if not sel.numel():
            continue
        k_s = c_key[sel].long()
        o_s = index.coords[sel, d]
        s_s = index.coords[sel, D + d]
        # By key, then offset (ties in row order). Rows come by key, and a save lists each
        # key's chunks by offset along the dim it cuts: then they are in order already.
        if not bool(((k_s[1:] > k_s[:-1]) | ((k_s[1:] == k_s[:-1]) & (o_s[1:] >= o_s[:-1])))
                    .all()):  # fmt: skip
            perm = torch.sort(o_s, stable=True).indices
            perm = perm[torch.sort(k_s[perm], stable=True).indices]
            k_s, o_s, s_s = k_s[perm], o_s[perm], s_s[perm]
            del perm
        start = torch.ones_like(k_s, dtype=torch.bool)
        start[1:] = k_s[1:] != k_s[:-1]
        end = torch.ones_like(k_s, dtype=torch.bool)
        end[:-1] = k_s[1:] != k_s[:-1]
        prev_end = torch.zeros_like(o_s)
        prev_end[1:] = o_s[:-1] + s_s[:-1]
        good = torch.where(start, o_s == 0, o_s == prev_end)
        good &= torch.where(end, o_s + s_s == shape_pad[k_s, d], True)
        bad_keys = torch.zeros(nkeys, dtype=torch.bool)
        bad_keys[k_s[~good]] = True
        has_live = torch.zeros(nkeys, dtype=torch.bool)
        has_live[k_s] = True
        for k in (key_ok & has_live & ~bad_keys).nonzero().flatten().tolist():
            ok.add(k)
    return ok


__all__ = [
    "MAX_METADATA",
    "DcpIndex",
    "StorageProblems",
    "build_index",
    "check",
    "open_index",
    "read_parsed",
]
