"""A torch.distributed.checkpoint (DCP) directory, read chunk by chunk without a process group."""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.sources.base import (
    CheckpointError,
    CoverageError,
    Entry,
    Problem,
    Region,
    Source,
    check_regular,
)
from fsdpcheck.sources.dcp_metadata import (
    METADATA_FILE,
    Position,
    check_storage,
    is_tensor_meta,
    planner_paths,
    read_dcp_metadata,
)
from fsdpcheck.sources.rawio import (
    RawChunk,
    aligned_empty,
    locate_chunk,
    map_private,
    mapped_view,
    populate,
    pread_into,
)
from fsdpcheck.sources.tiling import Box, box_text, intersect, uncovered


class DCPSource(Source):
    """Reads boxes of a DCP checkpoint.

    Each rank builds read items for exactly the saved chunks that overlap the boxes it asks for
    and hands them to fsdpcheck's `SafeFileSystemReader` (DCP's filesystem reader, without code
    execution and with storage checks), which loads each of those chunks and copies the overlap
    straight into the destination (on the model's device). No process group is needed.

    Opening reads only ``.metadata`` (restricted unpickler, DCP-free: NOTE: [DCP-free metadata]
    in ``dcp_metadata``) and stats the data files; `problems`
    then lists gaps, overlaps, chunks outside the shape and storage entries that cannot be read.
    A read that touches a gap raises `CoverageError`; one that touches an overlap or an
    unreadable entry raises `CheckpointError`; neither ever returns an uninitialised buffer.

    Fast path (NOTE: [raw DCP chunks] in ``rawio``): a chunk stored as one uncompressed tensor
    record is not loaded as a blob. A region inside one such chunk is returned as a view of the
    mapped file (NOTE: [mapped files] in ``rawio``); other regions are read by byte range
    straight into the destination (only the rows they need), different files in parallel.
    Chunks that are not (and every non-tensor value) go through the safe reader. Both give the
    same values.
    """

    kind = "dcp"
    is_sharded = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.description = f"DCP checkpoint {self.path}"
        f = check_regular(self.path / METADATA_FILE, "DCP metadata")
        self._metadata_bytes = f.read_bytes()
        self._md = read_dcp_metadata(self.path, data=self._metadata_bytes)
        self._check = check_storage(self.path, self._md)
        self._storage = self._check.storage
        # DCP's reader (and DCP's import) only for what is not read by byte range here.
        self._safe_reader: Any = None
        paths = planner_paths(self._md)
        self._entries: dict[str, Entry] = {}
        # Per tensor key: the chunks that can be read (inside the shape, with a storage entry),
        # and offsets -> sizes for the common case of a region that is exactly one saved chunk.
        self._readable: dict[str, list[Box]] = {}
        self._chunk_at: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
        for key, meta in self._md.state_dict_metadata.items():
            path_t = paths[key]
            if is_tensor_meta(meta):
                shape = tuple(meta.size)
                self._entries[key] = Entry(key, path_t, shape, meta.properties.dtype)
                readable = []
                for c in meta.chunks:
                    off, size = tuple(c.offsets), tuple(c.sizes)
                    if (
                        len(off) == len(shape) == len(size)
                        and all(
                            o >= 0 and s >= 0 and o + s <= g for o, s, g in zip(off, size, shape)
                        )
                        and (key, off) in self._storage
                    ):
                        readable.append((off, size))
                self._readable[key] = readable
                self._chunk_at[key] = dict(readable)
            else:  # BytesStorageMetadata (validated)
                self._entries[key] = Entry(key, path_t, is_tensor=False)
        # Raw chunk locations (None: read through the safe reader), open files, worker threads.
        self._raw: dict[Position, RawChunk | None] = {}
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap | None] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._finalizer = weakref.finalize(self, _release, self._fds, [None])
        #: Whether tensor chunks may be read by byte range (False: always the safe reader).
        self.raw_reads = True

    def entries(self) -> dict[str, Entry]:
        """Every key of the checkpoint's metadata."""
        return self._entries

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of each saved chunk of a tensor entry, as ``.metadata`` lists them."""
        meta = self._md.state_dict_metadata[key]
        if not is_tensor_meta(meta):
            raise KeyError(f"{key} is not a tensor in {self.description}")
        return [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]

    def problems(self) -> list[Problem]:
        """Gaps, overlaps, chunks outside the shape, unreadable storage entries."""
        return list(self._check.problems)

    def _coverage(self, region: Region) -> list[Box]:
        """The readable chunks meeting `region`, after checking it is covered exactly once."""
        key = region.key
        box = (tuple(region.offset), tuple(region.size))
        chunks = self._readable[key]
        exact = self._chunk_at[key].get(box[0])
        if exact == box[1] and key not in self._check.overlapping:
            return [box]  # exactly one saved chunk (a reload with the layout it was saved with)
        meeting = [c for c in chunks if intersect(box, c) is not None]
        missing = uncovered(box, meeting, disjoint=key not in self._check.overlapping)
        if missing:
            raise CoverageError(
                f"{key}: region {box_text(missing[0])} is not covered by any saved chunk in "
                f"{self.path / '.metadata'} (a gap in the checkpoint); it has no data to read"
            )
        if key in self._check.overlapping:
            for a, b in itertools.combinations(meeting, 2):
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
        """Reads the regions through the safe storage reader (only overlapping chunks).

        Raises:
            CoverageError: A region meets a gap (nothing is allocated or read).
            CheckpointError: A region meets overlapping chunks or an unreadable storage entry.
        """
        plans: list[list[Box]] = []
        for region in regions:
            entry = self._entries[region.key]
            if not entry.is_tensor:
                raise KeyError(f"{region.key} is not a tensor in {self.description}")
            chunks = self._coverage(region) if region.numel else []
            for c_off, _ in chunks:  # refused before anything is allocated or opened
                why = self._check.bad_entries.get((region.key, c_off))
                if why is not None:
                    raise CheckpointError(f"{self.description}: {region.key}: {why}")
            plans.append(chunks)
        dests = []
        items: list[_SafeItem] = []
        raw: dict[str, list[_RawItem]] = {}
        for i, (region, chunks) in enumerate(zip(regions, plans)):
            box = (tuple(region.offset), tuple(region.size))
            view = self._mapped_view(region, chunks) if device.type == "cpu" else None
            if view is not None:
                dests.append(view)  # read in place: the kernel reads the mapped pages
                continue
            if out is not None:
                dests.append(out[i])
            else:
                dests.append(
                    torch.empty(region.size, dtype=self._entries[region.key].dtype, device=device)
                )
            for c_off, c_size in chunks:
                part = intersect(box, (c_off, c_size))
                if part is None:
                    continue  # no overlap (empty chunks included)
                lo, n = part
                pos = (region.key, c_off)
                dest_off = tuple(a - b for a, b in zip(lo, region.offset))
                src_off = tuple(a - b for a, b in zip(lo, c_off))
                rc = self._raw_chunk(pos, c_size) if self.raw_reads else None
                if rc is not None:
                    rel = self._storage[pos].relative_path
                    target = dests[i]
                    for d, (o, k) in enumerate(zip(dest_off, n)):
                        target = target.narrow(d, o, k)
                    raw.setdefault(rel, []).append(_RawItem(rc, src_off, n, target, region.key))
                    continue
                items.append((i, tuple(region.offset), dest_off, pos, src_off, tuple(n)))
        if raw:
            self._read_raw(raw)
        if items:
            self._run(items, _Planner(dests))
        return dests

    @property
    def _reader(self) -> Any:
        """The safe DCP reader over the same metadata bytes (imports DCP; made once)."""
        with self._lock:
            if self._safe_reader is None:
                from fsdpcheck.sources.safe_reader import SafeFileSystemReader

                reader = SafeFileSystemReader(self.path, metadata=self._metadata_bytes)
                reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
                self._safe_reader = reader
            return self._safe_reader

    def _fd(self, rel: str) -> int:
        """An open descriptor of a data file (checked to be a regular file before opening)."""
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                path = check_regular(self.path / rel, "DCP data file")
                fd = self._fds[rel] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return fd

    def _mapped_view(self, region: Region, chunks: list[Box]) -> torch.Tensor | None:
        """The region as a view of the mapped data file, when one raw chunk holds all of it.

        NOTE: [mapped files] in ``rawio``: the region is handed over where it lies (pages mapped
        now, see `populate`), at whatever byte offset the chunk has (DCP writes the chunks of a
        file back to back, so about half of them start at an odd offset). None if the file
        shrank since it was checked. Other regions (several chunks, another device) are read
        into the destination.
        """
        if not self.raw_reads or not region.numel or len(chunks) != 1:
            return None
        c_off, c_size = chunks[0]
        box = (tuple(region.offset), tuple(region.size))
        if intersect(box, (c_off, c_size)) != box:
            return None
        pos = (region.key, c_off)
        rc = self._raw_chunk(pos, c_size)
        if rc is None:
            return None
        rel = self._storage[pos].relative_path
        mapped = self._map(rel)
        if mapped is None:
            return None
        # The elements lie inside the chunk's storage record (a RawChunk guarantees it);
        # mapped_view checks them against the file's size now.
        start = rc.data_offset + rc.storage_offset * rc.dtype.itemsize
        t = mapped_view(mapped, start, rc.dtype, rc.shape, rc.stride)
        if t is None:
            return None
        for d, (o, s, c) in enumerate(zip(region.offset, region.size, c_off)):
            t = t.narrow(d, o - c, s)
        populate(t)
        return t

    def _map(self, rel: str) -> mmap.mmap | None:
        """The data file mapped (`map_private`; cached, None if it cannot be mapped)."""
        with self._lock:
            if rel in self._maps:
                return self._maps[rel]
        mapped = map_private(self._fd(rel))
        with self._lock:
            self._maps[rel] = mapped
        return mapped

    def _raw_chunk(self, pos: Position, size: tuple[int, ...]) -> RawChunk | None:
        """Where a chunk's elements lie (cached), or None to read it through the safe reader."""
        with self._lock:
            if pos in self._raw:
                return self._raw[pos]
        info = self._storage[pos]
        rc = None
        if not info.transform_descriptors and pos not in self._check.bad_entries:
            dtype = self._entries[pos[0]].dtype
            assert dtype is not None
            rc = locate_chunk(self._fd(info.relative_path), info.offset, info.length, dtype, size)
        with self._lock:
            self._raw[pos] = rc
        return rc

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
                self._finalizer = weakref.finalize(self, _release, self._fds, [self._pool])
            pool = self._pool
        for f in [pool.submit(self._read_file, rel, its) for rel, its in jobs]:
            f.result()

    def _read_file(self, rel: str, items: list[_RawItem]) -> None:
        fd = self._fd(rel)
        for it in items:
            _copy_raw(fd, it, f"{self.path / rel}: {it.key}")

    def close(self) -> None:
        """Closes the data files, drops their mappings and stops the reader threads."""
        self._maps.clear()
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


def _copy_raw(fd: int, it: _RawItem, what: str) -> None:
    """Reads a part of a raw chunk into its destination, touching only the rows it needs.

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
            pread_into(fd, target, start, what)
            return
        buf = aligned_empty(rows * row * item)
        pread_into(fd, buf, start, what)
        src = buf.view(rc.dtype).view((rows, *rc.shape[1:]) if rc.shape else ())
        for d in range(1, len(rc.shape)):
            src = src.narrow(d, it.src_off[d], it.lengths[d])
    else:
        buf = aligned_empty(rc.nbytes - rc.nbytes % item)
        pread_into(fd, buf, rc.data_offset, what)
        flat = buf.view(rc.dtype)
        # as_strided counts its offset from the start of the storage, not of this view.
        src = flat.as_strided(rc.shape, rc.stride, flat.storage_offset() + rc.storage_offset)
        for d, (o, k) in enumerate(zip(it.src_off, it.lengths)):
            src = src.narrow(d, o, k)
    target.copy_(src)


def _release(fds: dict[str, int], pool: list[ThreadPoolExecutor | None]) -> None:
    if pool[0] is not None:
        pool[0].shutdown(wait=True)
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
