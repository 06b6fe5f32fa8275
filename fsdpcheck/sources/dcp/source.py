"""A torch.distributed.checkpoint (DCP) directory, read chunk by chunk without a process group."""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.errors import CheckpointError, CoverageError
from fsdpcheck.sources.base import Entry, Problem, Region, Source
from fsdpcheck.sources.dcp.index import DcpIndex, Storage, StorageProblems, open_index
from fsdpcheck.sources.dcp.metadata import Position
from fsdpcheck.sources.fileio import open_regular
from fsdpcheck.sources.rawio import (
    Mapped,
    RawChunk,
    aligned_empty,
    damaged,
    locate_chunk,
    map_guarded,
    populate,
    pread_into,
)
from fsdpcheck.sources.remote import RemotePath
from fsdpcheck.sources.tiling import Box, box_text, intersect, uncovered


class DCPSource(Source):
    """Reads boxes of a DCP checkpoint.

    Each rank builds read items for exactly the saved chunks that overlap the boxes it asks for
    and hands them to fsdpcheck's `SafeFileSystemReader` (DCP's filesystem reader, without code
    execution and with storage checks), which loads each of those chunks and copies the overlap
    straight into the destination (on the model's device). No process group is needed.

    Opening reads ``.metadata`` once, as it streams in, into columns (restricted, DCP-free:
    NOTE: [DCP-free metadata] in ``dcp_metadata``, NOTE: [metadata columns] in ``dcp_runs``),
    and checks it (``dcp_index.check``: tiling, one stat per data file); `problems` then lists
    gaps, overlaps, chunks outside the shape and storage entries that cannot be read. A read
    that touches a gap raises `CoverageError`; one that touches an overlap or an unreadable
    entry raises `CheckpointError`; neither ever returns an uninitialised buffer. The safe
    reader works from the same parsed metadata (the file is not unpickled again).

    Opening once per job (NOTE: [trusted metadata] in ``dcp_index``): `metadata_digest` is the
    sha256 of the ``.metadata`` bytes parsed. One process opens and checks; the others pass its
    verdict's digest as ``trusted_digest``: when their bytes hash the same, they skip the
    whole-checkpoint check (`validated` is False and `problems` is empty: the verdict is the
    checking process's), while every read still refuses what it touches that is unsafe (a
    non-regular file, bytes past a file's end, a region no chunk or two chunks cover).

    Fast path (NOTE: [raw DCP chunks] in ``rawio``): a chunk stored as one uncompressed tensor
    record is not loaded as a blob. Through `read_views`, a region inside one such chunk is a
    view of the mapped file (NOTE: [mapped files] in ``rawio``; truncation while mapped:
    NOTE: [mapped-file guard]); other regions, and every `read`, are read by byte range
    straight into the destination (only the rows they need), different files in parallel.
    Chunks that are not (and every non-tensor value) go through the safe reader. Both give the
    same values. Files are opened when read and closed after (at most `MAX_OPEN` at once).

    Args:
        path: The checkpoint directory.
        trusted_digest: The `metadata_digest` of this checkpoint as another process opened
            and checked it.
        trusted_check: What that process's check found (its `storage_problems`): when the
            digest matches, this source reports it as its own, so that every process reaches
            the same verdict (None: nothing found, or not known).
        verdicts: The verdicts of a reference opened once per job (``fsdpcheck.opening``): this
            source takes the next one (unless `trusted_digest` is given) and records itself.
    """

    kind = "dcp"
    is_sharded = True

    def __init__(
        self,
        path: str | os.PathLike[str] | RemotePath,
        *,
        trusted_digest: str | None = None,
        trusted_check: StorageProblems | None = None,
        verdicts: Verdicts | None = None,
    ) -> None:
        self.path: Path | RemotePath = path if isinstance(path, RemotePath) else Path(path)
        self.description = f"DCP checkpoint {self.path}"
        if trusted_digest is None and verdicts is not None:
            trusted_digest, trusted_check = verdicts.next()
        self._index, self._check = open_index(self.path, trusted_digest=trusted_digest)
        #: sha256 (hex) of the ``.metadata`` bytes this source parsed.
        self.metadata_digest = self._index.digest
        #: Whether the whole checkpoint was checked when opening (False: a trusted digest).
        self.validated = self._check is not None
        if not self.validated:
            self._check = trusted_check
        if verdicts is not None:
            verdicts.made.append(self)
        idx = self._index
        self._entries: dict[str, Entry] = {}
        for k, key in enumerate(idx.keys):
            if idx.tensor[k]:
                self._entries[key] = Entry(key, idx.paths[key], idx.shapes[k], idx.dtypes[k])
            else:
                self._entries[key] = Entry(key, idx.paths[key], is_tensor=False)
        # DCP's reader (and DCP's import) only for what is not read by byte range here.
        self._safe_reader: Any = None
        # Raw chunk locations by (key, chunk position) (None: the safe reader) and their files,
        # for the keys read last.
        self._raw: dict[tuple[str, int], tuple[RawChunk | None, str]] = {}
        self._files = self._file_set()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._finalizer = weakref.finalize(self, _release, self._files, [None])
        #: Whether tensor chunks may be read by byte range (False: always the safe reader).
        self.raw_reads = True

    def entries(self) -> dict[str, Entry]:
        """Every key of the checkpoint's metadata."""
        return self._entries

    def _file_set(self) -> Any:
        """How data files are opened and mapped (`_Files`; an object store's own, remotely)."""
        assert isinstance(self.path, Path)
        return _Files(self.path)

    def _reader_type(self) -> Any:
        """The class of DCP storage reader for what is not read by byte range here."""
        from fsdpcheck.sources.dcp.load import SafeFileSystemReader

        return SafeFileSystemReader

    def dcp_reader(self) -> Any:
        """A new `SafeFileSystemReader` for ``dcp.load`` over the metadata parsed here.

        Its ``read_metadata`` hands DCP the parsed metadata (``.metadata`` is not read again)
        and its set-up refuses what the opening check found instead of checking again.
        """
        return self._reader_type().from_index(self._index, self._bad_position)

    @property
    def index(self) -> DcpIndex:
        """The parsed metadata (columns; see ``dcp_index``)."""
        return self._index

    @property
    def storage_problems(self) -> StorageProblems | None:
        """What the check made when opening found (None: opened with a trusted digest)."""
        return self._check

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of each saved chunk of a tensor entry, as ``.metadata`` lists them."""
        if not self._entries[key].is_tensor:
            raise KeyError(f"{key} is not a tensor in {self.description}")
        return self._index.chunks(key)

    def chunks_overlapping(
        self, key: str, offset: Sequence[int], size: Sequence[int]
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The saved chunks meeting a box, by bisection (see `Source.chunks_overlapping`)."""
        if not self._entries[key].is_tensor:
            raise KeyError(f"{key} is not a tensor in {self.description}")
        d = len(self._entries[key].shape)
        return [self._chunk(key, i, d) for i in self._index.overlapping(key, offset, size)]

    def chunk_count(self, key: str) -> int:
        """Number of saved chunks of a tensor entry."""
        return self._index.chunk_count(key)

    def coverage(self, key: str) -> list[str]:
        """Gaps and overlaps of a key's chunks, from the check made when opening."""
        if self._check is None:
            return super().coverage(key)
        return list(self._check.tiling.get(key, []))

    def problems(self) -> list[Problem]:
        """Gaps, overlaps, chunks outside the shape, unreadable storage entries."""
        return list(self._check.problems) if self._check is not None else []

    def _chunk(self, key: str, i: int, ndim: int) -> Box:
        del ndim
        return self._index.chunk(key, i)

    def _coverage(self, region: Region, singles: _Singles) -> list[tuple[int, Box]]:
        """The readable chunks meeting `region` as (position, box), covering it exactly once."""
        key = region.key
        shape = self._entries[key].shape
        box = (tuple(region.offset), tuple(region.size))
        one = singles.get(key)
        if one is not None and one[1] >= 0 and _inside(one[0], shape):
            c = one[0]
            if all(o >= a and o + n <= a + m for o, n, a, m in zip(box[0], box[1], c[0], c[1])):
                return [(0, c)]  # inside the key's one saved chunk
        meeting = []
        for i in self._index.overlapping(key, box[0], box[1]):
            c = self._chunk(key, i, len(shape))
            if self._index.chunk_entry(key, i) < 0 or not _inside(c, shape):
                continue  # not readable: what it would cover is a gap
            meeting.append((i, c))
        if len(meeting) == 1 and meeting[0][1] == box:
            return meeting  # exactly one saved chunk (a reload with the layout it was saved with)
        disjoint = self._check is not None and key not in self._check.overlapping
        boxes = [c for _, c in meeting]
        missing = uncovered(box, boxes, disjoint=disjoint)
        if missing:
            raise CoverageError(
                f"{key}: region {box_text(missing[0])} is not covered by any saved chunk in "
                f"{self.path / '.metadata'} (a gap in the checkpoint); it has no data to read"
            )
        if not disjoint:
            for a, b in itertools.combinations(boxes, 2):
                both = intersect(a, b)
                if both is not None and intersect(both, box) is not None:
                    raise CheckpointError(
                        f"{key}: region {box_text(both)} is saved in two overlapping chunks "
                        f"(at {a[0]} and {b[0]}) in {self.path / '.metadata'}; which copy is "
                        "right is unknown"
                    )
        return meeting

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Reads the regions (only overlapping chunks): by byte range, or the safe reader.

        Raises:
            CoverageError: A region meets a gap (nothing is allocated or read).
            CheckpointError: A region meets overlapping chunks or an unreadable storage entry,
                or a file changed while it was read.
        """
        return self._read(regions, device, out, views=False)

    def read_views(
        self, regions: Sequence[Region], out: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """`read` to the CPU; a region inside one raw chunk is a view of the mapped file."""
        if type(self).read is not DCPSource.read:  # a subclass that reads its own way
            return self.read(regions, torch.device("cpu"), out)
        return self._read(regions, torch.device("cpu"), out, views=True)

    def check_views(self) -> None:
        """Raises CheckpointError naming a file truncated under views handed out."""
        hit = self._files.damaged()
        if hit:
            raise CheckpointError(
                f"{self.description}: {self.path / hit} changed while it was read: it was "
                "truncated, so values read from it are not reported (run again once nothing "
                "writes to it)"
            )

    def _read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None,
        views: bool,
    ) -> list[torch.Tensor]:
        plans: list[list[tuple[int, Box]]] = []
        singles = self._index.singles(r.key for r in regions)
        for region in regions:
            entry = self._entries[region.key]
            if not entry.is_tensor:
                raise KeyError(f"{region.key} is not a tensor in {self.description}")
            chunks = self._coverage(region, singles) if region.numel else []
            bad = self._check.bad_chunks.get(region.key, {}) if self._check else {}
            for i, _ in chunks:  # refused before anything is allocated or opened
                why = bad.get(i)
                if why is not None:
                    raise CheckpointError(f"{self.description}: {region.key}: {why}")
            plans.append(chunks)
        dests = []
        items: list[_SafeItem] = []
        raw: dict[str, list[_RawItem]] = {}
        for i, (region, chunks) in enumerate(zip(regions, plans)):
            box = (tuple(region.offset), tuple(region.size))
            view = self._mapped_view(region, chunks, singles) if views else None
            if view is not None:
                dests.append(view)  # read in place: the kernel reads the mapped pages
                continue
            if out is not None:
                dests.append(out[i])
            else:
                dests.append(
                    torch.empty(region.size, dtype=self._entries[region.key].dtype, device=device)
                )
            for c_pos, (c_off, c_size) in chunks:
                part = intersect(box, (c_off, c_size))
                if part is None:
                    continue  # no overlap (empty chunks included)
                lo, n = part
                dest_off = tuple(a - b for a, b in zip(lo, region.offset))
                src_off = tuple(a - b for a, b in zip(lo, c_off))
                rc, rel = (None, "")
                if self.raw_reads:
                    rc, rel = self._raw_chunk(region.key, c_pos, c_size, singles)
                if rc is not None:
                    target = dests[i]
                    for d, (o, k) in enumerate(zip(dest_off, n)):
                        target = target.narrow(d, o, k)
                    raw.setdefault(rel, []).append(_RawItem(rc, src_off, n, target, region.key))
                    continue
                items.append((i, tuple(region.offset), dest_off, (region.key, c_off), src_off,
                              tuple(n)))  # fmt: skip
        if raw:
            self._read_raw(raw)
        if items:
            self._run(items, _Planner(dests))
        return dests

    def _storage(self, key: str, pos: int, singles: _Singles) -> Storage:
        one = singles.get(key)
        if one is not None and one[2] is not None:
            return one[2]
        return self._index.storage(self._index.chunk_entry(key, pos))

    @property
    def _reader(self) -> Any:
        """The safe DCP reader over the same parsed metadata (imports DCP; made once)."""
        with self._lock:
            if self._safe_reader is None:
                self._safe_reader = self._reader_type().from_index(self._index, self._bad_position)
            return self._safe_reader

    def _bad_position(self, key: str, offsets: tuple[int, ...] | None) -> str | None:
        """Why the storage entry at (key, offsets) must not be read, or None."""
        if self._check is None:
            return None
        if offsets is None:
            return self._check.bad_values.get(key)
        bad = self._check.bad_chunks.get(key)
        if not bad:
            return None
        i = self._index.position_of(key, offsets)
        return None if i is None else bad.get(i)

    def _mapped_view(
        self, region: Region, chunks: list[tuple[int, Box]], singles: _Singles
    ) -> torch.Tensor | None:
        """The region as a view of the mapped data file, when one raw chunk holds all of it.

        NOTE: [mapped files] in ``rawio``: the region is handed over where it lies (pages mapped
        now, see `populate`), at whatever byte offset the chunk has (DCP writes the chunks of a
        file back to back, so about half of them start at an odd offset). None if the file
        shrank since it was checked. Other regions (several chunks, another device) are read
        into the destination.
        """
        if not self.raw_reads or not region.numel or len(chunks) != 1:
            return None
        c_pos, (c_off, c_size) = chunks[0]
        box = (tuple(region.offset), tuple(region.size))
        if intersect(box, (c_off, c_size)) != box:
            return None
        rc, rel = self._raw_chunk(region.key, c_pos, c_size, singles)
        if rc is None:
            return None
        mapped = self._files.mapped(rel)
        if mapped is None:
            return None
        # The elements lie inside the chunk's storage record (a RawChunk guarantees it);
        # the view checks them against the file's size when it was mapped.
        start = rc.data_offset + rc.storage_offset * rc.dtype.itemsize
        t = mapped.view(start, rc.dtype, rc.shape, rc.stride)
        if t is None:
            return None
        for d, (o, s, c) in enumerate(zip(region.offset, region.size, c_off)):
            t = t.narrow(d, o - c, s)
        populate(t)
        return t

    def _raw_chunk(
        self, key: str, pos: int, size: tuple[int, ...], singles: _Singles
    ) -> tuple[RawChunk | None, str]:
        """Where a chunk's elements lie (None: read it through the safe reader), and its file."""
        with self._lock:
            got = self._raw.get((key, pos))
            if got is not None:
                return got
        rel, offset, length, transforms = self._storage(key, pos, singles)
        rc = None
        if not transforms:
            dtype = self._entries[key].dtype
            assert dtype is not None
            with self._files.open(rel) as fd:
                rc = locate_chunk(fd, offset, length, dtype, size)
        with self._lock:
            if len(self._raw) >= _MAX_RAW:
                self._raw.clear()
            self._raw[(key, pos)] = (rc, rel)
        return rc, rel

    def _read_raw(self, per_file: dict[str, list[_RawItem]]) -> None:
        """Byte-range reads, one worker per file (different files in parallel)."""
        jobs = [(rel, sorted(its, key=lambda it: it.chunk.data_offset)) for rel, its in
                per_file.items()]  # fmt: skip
        if len(jobs) == 1:
            self._read_file(*jobs[0])
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="fsdpcheck-dcp")
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _release, self._files, [self._pool])
            pool = self._pool
        for f in [pool.submit(self._read_file, rel, its) for rel, its in jobs]:
            f.result()

    def _read_file(self, rel: str, items: list[_RawItem]) -> None:
        assert isinstance(self.path, Path)  # an object store reads its own way
        with self._files.open(rel) as fd:
            for it in items:
                _copy_raw(fd, it, self.path / rel)

    def close(self) -> None:
        """Closes the data files, drops their mappings and stops the reader threads."""
        self._finalizer()

    def read_object(self, key: str) -> Any:
        """A non-tensor entry (e.g. a param_groups hyperparameter)."""
        return self.read_objects([key])[key]

    def read_objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """Several non-tensor entries, in one pass over the storage (loaded weights_only)."""
        for key in keys:
            if key not in self._entries or self._entries[key].is_tensor:
                raise KeyError(key)
        planner = _Planner([])
        if keys:
            self._run([(key, None, (), (key, None), (), ()) for key in keys], planner)
        return planner.objects

    def _run(self, items: list[_SafeItem], planner: _Planner) -> None:
        """Reads items through the safe reader: tensor regions (dest index an int) or values."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

        reads = [
            ReadItem(
                type=LoadItemType.BYTE_IO if dest_at is None else LoadItemType.TENSOR,
                dest_index=MetadataIndex(str(dest), dest_at),
                dest_offsets=torch.Size(dest_off),
                storage_index=MetadataIndex(pos[0], pos[1]),
                storage_offsets=torch.Size(src_off),
                lengths=torch.Size(n),
            )
            for dest, dest_at, dest_off, pos, src_off, n in items
        ]
        plan = self._reader.prepare_local_plan(LoadPlan(reads))
        plan = self._reader.prepare_global_plan([plan])[0]
        self._reader.read_data(plan, planner).wait()  # type: ignore[arg-type]


class Verdicts:
    """The verdicts DCP sources take in order when a reference is opened once per job.

    The process that checks opens the reference with ``Verdicts()`` and reads back what each
    of its DCP sources found (`taken`); the others open the same reference with
    ``Verdicts(taken)``, in the same order (``open_source(..., trust=)``). A source whose bytes
    hash differently checks itself.
    """

    def __init__(self, given: Sequence[tuple[str, StorageProblems | None]] | None = None) -> None:
        self.given = list(given) if given is not None else None
        self.made: list[DCPSource] = []

    def next(self) -> tuple[str | None, StorageProblems | None]:
        """The verdict of the next source opened (None, None: it checks itself)."""
        if self.given is None or len(self.made) >= len(self.given):
            return None, None
        return self.given[len(self.made)]

    def taken(self) -> list[tuple[str, StorageProblems | None]]:
        """(digest, what its check found) of each source opened, in order."""
        return [(s.metadata_digest, s.storage_problems) for s in self.made]


#: Keys saved as one chunk, for the regions of one read (`DcpIndex.singles`).
_Singles = dict[str, tuple[Box, int, Storage | None]]

#: Data files open at once (a checkpoint of 10,000 files reads within ``ulimit -n`` 1024).
MAX_OPEN = 64
#: Raw chunk locations remembered (each is a few hundred bytes; reads go key by key).
_MAX_RAW = 4096


def _inside(box: Box, shape: tuple[int, ...]) -> bool:
    o, s = box
    return len(o) == len(shape) == len(s) and all(
        a >= 0 and b >= 0 and a + b <= g for a, b, g in zip(o, s, shape)
    )


class _Files:
    """The data files of a checkpoint: descriptors opened when read, mappings through the guard.

    At most `MAX_OPEN` descriptors are open; one in use is closed only once its reader is done.
    Each is opened by what it is (NOTE: [open by what it is] in ``fileio``). Mappings (made by
    `mapped`, at most `MAX_OPEN` kept) hold no descriptor.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.fds: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.users: dict[str, int] = {}
        self.maps: collections.OrderedDict[str, Mapped | None] = collections.OrderedDict()
        self.handed: dict[int, str] = {}  # mapping id -> file, for views handed out

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[int]:
        with self.lock:
            fd = self.fds.get(rel)
            if fd is not None:
                self.fds.move_to_end(rel)
            self.users[rel] = self.users.get(rel, 0) + 1
        try:
            if fd is None:
                fd, _ = open_regular(self.root / rel, "DCP data file")
                with self.lock:
                    if rel in self.fds:  # another thread opened it meanwhile
                        os.close(fd)
                        fd = self.fds[rel]
                    else:
                        self.fds[rel] = fd
                        self._evict()
            yield fd
        finally:
            with self.lock:
                self.users[rel] -= 1
                if not self.users[rel]:
                    del self.users[rel]
                self._evict()

    def _evict(self) -> None:
        for rel in list(self.fds):
            if len(self.fds) <= MAX_OPEN:
                break
            if rel not in self.users:
                os.close(self.fds.pop(rel))

    def mapped(self, rel: str) -> Mapped | None:
        with self.lock:
            if rel in self.maps:
                self.maps.move_to_end(rel)
                m = self.maps[rel]
                if m is not None:
                    self.handed[m.id] = rel
                return m
        with self.open(rel) as fd:
            m = map_guarded(fd, os.fstat(fd).st_size, str(self.root / rel))
        with self.lock:
            self.maps[rel] = m
            while len(self.maps) > MAX_OPEN:
                self.maps.popitem(last=False)
            if m is not None:
                self.handed[m.id] = rel
        return m

    def damaged(self) -> str | None:
        """A file truncated under a mapping handed out since the last call (forgotten then)."""
        with self.lock:
            handed = dict(self.handed)
        hit = damaged(handed)
        with self.lock:
            for i in handed:
                self.handed.pop(i, None)
            for i in hit:
                self.maps.pop(handed[i], None)  # re-mapped (and re-checked) if read again
        return handed[min(hit)] if hit else None

    def close(self) -> None:
        with self.lock:
            for fd in self.fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.fds.clear()
            self.maps.clear()


#: One read through the safe reader: (destination: region number or value key, the region's
#: offset or None for a value, offsets in the destination, storage position, offsets in the
#: chunk, lengths).
_SafeItem = tuple[
    int | str, tuple[int, ...] | None, tuple[int, ...], Position, tuple[int, ...], tuple[int, ...]
]


class _Planner:
    """The part of a LoadPlanner that DCP's storage reader calls: where each item goes."""

    def __init__(self, dests: list[torch.Tensor]) -> None:
        self.dests = dests
        self.objects: dict[str, Any] = {}

    def resolve_tensor(self, item: Any) -> torch.Tensor:
        t = self.dests[int(item.dest_index.fqn)]
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, item: Any, tensor: torch.Tensor) -> None:
        del item, tensor  # copied in place by the reader

    def load_bytes(self, item: Any, value: io.BytesIO) -> None:
        value.seek(0)
        self.objects[item.dest_index.fqn] = torch.load(value, weights_only=True)


class _RawItem:
    """One byte-range read: a part of a raw chunk into a destination view."""

    __slots__ = ("chunk", "key", "lengths", "src_off", "target")

    def __init__(
        self,
        chunk: RawChunk,
        src_off: tuple[int, ...],
        lengths: tuple[int, ...],
        target: torch.Tensor,
        key: str,
    ) -> None:
        self.chunk, self.src_off, self.lengths, self.target, self.key = (
            chunk,
            src_off,
            lengths,
            target,
            key,
        )


def _copy_raw(fd: int, it: _RawItem, path: Path) -> None:
    """Reads a part of a raw chunk into its destination, touching only the rows it needs."""
    start, buf, finish = raw_read(it)
    pread_into(fd, buf, start, f"{path}: {it.key}", path)
    finish()


def raw_read(it: _RawItem) -> tuple[int, torch.Tensor, Callable[[], None]]:
    """How a part of a raw chunk is read: (file offset, CPU tensor to fill, then what to call).

    The tensor is filled with the file's bytes from the offset on; the function then puts them
    into the destination (nothing to do when the tensor is the destination).

    A row-major chunk's rows are one byte range: read straight into the destination when that
    is a contiguous CPU tensor of exactly those rows, else into a page-aligned scratch buffer
    and copied. A chunk saved with other strides (a transposed view) is read whole, then viewed
    with its strides.
    """
    rc, target = it.chunk, it.target
    item = rc.dtype.itemsize
    if rc.row_major:
        row = math.prod(rc.shape[1:]) if rc.shape else 1
        r0 = it.src_off[0] if rc.shape else 0
        rows = it.lengths[0] if rc.shape else 1
        start = rc.data_offset + (rc.storage_offset + r0 * row) * item
        whole_rows = tuple(it.lengths[1:]) == tuple(rc.shape[1:])
        if (
            whole_rows
            and target.device.type == "cpu"
            and target.is_contiguous()
            and target.dtype == rc.dtype
        ):
            return start, target, _nothing
        buf = aligned_empty(rows * row * item)

        def rows_done() -> None:
            src = buf.view(rc.dtype).view((rows, *rc.shape[1:]) if rc.shape else ())
            for d in range(1, len(rc.shape)):
                src = src.narrow(d, it.src_off[d], it.lengths[d])
            target.copy_(src)

        return start, buf, rows_done
    whole = aligned_empty(rc.nbytes - rc.nbytes % item)

    def strided_done() -> None:
        flat = whole.view(rc.dtype)
        # as_strided counts its offset from the start of the storage, not of this view.
        src = flat.as_strided(rc.shape, rc.stride, flat.storage_offset() + rc.storage_offset)
        for d, (o, k) in enumerate(zip(it.src_off, it.lengths)):
            src = src.narrow(d, o, k)
        target.copy_(src)

    return rc.data_offset, whole, strided_done


def _nothing() -> None:
    pass


def _release(files: _Files, pool: list[ThreadPoolExecutor | None]) -> None:
    if pool[0] is not None:
        pool[0].shutdown(wait=True)
    files.close()
