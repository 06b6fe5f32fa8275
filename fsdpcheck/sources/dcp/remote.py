"""A DCP checkpoint in an object store, read by byte ranges (NOTE: [object storage] in remote).

`RemoteDCPSource` is `DCPSource` with its files in a store: ``.metadata`` streamed through the
same restricted reader (refused by its listed size before a byte of it is fetched), the same
checks (the sizes come from one listing), the same raw-chunk fast path. What differs is where
bytes come from and how many requests are in flight: the zip headers of every chunk a batch
touches are fetched together (`_locate`), then every byte range of the batch (`_read_raw`),
each straight into the batch's destination.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from fsdpcheck.errors import CheckpointError, describe_error
from fsdpcheck.sources.base import Region
from fsdpcheck.sources.dcp.load import PartlyWrittenError, SafeFileSystemReader, _partly
from fsdpcheck.sources.dcp.source import _MAX_RAW, DCPSource, _RawItem, raw_read
from fsdpcheck.sources.rawio import locate_chunk, scan_spans, writable_view
from fsdpcheck.sources.remote import (
    ObjectFile,
    RemotePath,
    fill_from,
    name_problem,
    open_object,
)

__all__ = ["RemoteDCPSource", "RemoteSafeReader"]

#: Bytes of whole storage entries the safe reader holds at once (read together, then loaded).
_WAVE = 256 << 20
#: Bytes of scratch buffers one batch's reads hold at once (parts that cannot be read straight
#: into their destinations).
_SCRATCH = 64 << 20
#: Non-tensor values of at most this many stored bytes are kept once read (hyperparameters:
#: the pairing and the comparison each ask for them).
_SMALL_VALUE = 64 << 10
#: Bytes fetched at each end of a chunk's blob to find its records: torch.save's data.pkl and
#: record headers lie in the first ~1 KB, its central directory in the last ~600 bytes (more
#: is fetched when they do not).
_SPAN = 4096


class _ObjectFiles:
    """The data objects of a checkpoint, as its listing showed them when it was opened.

    Stands in for ``dcp._Files``: an object is opened by name (checked as a relative name),
    never mapped (so `mapped` and `damaged` have nothing to say).
    """

    def __init__(self, root: RemotePath) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.files: dict[str, ObjectFile] = {}

    def file(self, rel: str) -> ObjectFile:
        with self.lock:
            f = self.files.get(rel)
        if f is None:
            bad = name_problem(rel)
            if bad is not None:
                raise CheckpointError(f"DCP checkpoint {self.root}: a storage entry {bad}")
            f = open_object(self.root / rel, "DCP data file")
            with self.lock:
                self.files[rel] = f
        return f

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[ObjectFile]:
        yield self.file(rel)

    def mapped(self, rel: str) -> None:
        del rel

    def damaged(self) -> None:
        return None

    def close(self) -> None:
        with self.lock:
            self.files.clear()


class RemoteDCPSource(DCPSource):
    """A DCP checkpoint under a prefix of an object store (see the module docstring).

    Args:
        path: The checkpoint's prefix.
        trusted_digest / trusted_check: As `DCPSource`.
    """

    def __init__(self, path: RemotePath, **kwargs: Any) -> None:
        # Sizes and identities are those of now: what an earlier open listed is forgotten. One
        # listing gives every data file's (a process that trusts another's check stats none).
        path.store.refresh(path.key)
        if not path.listing():
            raise FileNotFoundError(f"DCP checkpoint {path} does not exist (no objects there)")
        super().__init__(path, **kwargs)
        self.raw_reads = True
        # Per reading thread (the read-ahead may read two batches at once): the bytes `_locate`
        # fetched for the batch it reads, by object: [(offset, bytes)].
        self._batch = threading.local()
        self._values: dict[str, Any] = {}

    def _file_set(self) -> Any:
        assert isinstance(self.path, RemotePath)
        return _ObjectFiles(self.path)

    def _reader_type(self) -> Any:
        return RemoteSafeReader

    def _read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None,
        views: bool,
    ) -> list[torch.Tensor]:
        del views  # nothing is mapped: every region is read into its destination
        self._batch.held = {}
        try:
            self._locate(regions)
            return super()._read(regions, device, out, views=False)
        finally:
            self._batch.held = {}

    def _locate(self, regions: Sequence[Region]) -> None:
        """Finds where the elements of every chunk the regions meet lie, all requests at once.

        Per chunk not located yet, the two ends of its torch.save blob (`scan_spans`: one range
        when the blob is small) are fetched together with every other chunk's; `locate_chunk`
        then reads its records from those bytes. Chunks the opening check refused, or with a
        storage transform, are left to the reads that refuse or decode them.
        """
        singles = self._index.singles(r.key for r in regions)
        todo: dict[tuple[str, int], tuple[str, int, int]] = {}
        for r in regions:
            e = self._entries.get(r.key)
            if e is None or not e.is_tensor or not r.numel:
                continue
            bad = self._check.bad_chunks.get(r.key, {}) if self._check is not None else {}
            for i in self._index.overlapping(r.key, r.offset, r.size):
                if (r.key, i) in todo or i in bad or self._index.chunk_entry(r.key, i) < 0:
                    continue
                with self._lock:
                    if (r.key, i) in self._raw:
                        continue
                rel, offset, length, transforms = self._storage(r.key, i, singles)
                if not transforms:
                    todo[(r.key, i)] = (rel, offset, length)
        if not todo:
            return
        files: dict[tuple[str, int], ObjectFile] = {}
        jobs = []
        held: list[tuple[ObjectFile, int, bytearray]] = []
        for pos, (rel, offset, length) in todo.items():
            shared = self._files.file(rel)
            f = files[pos] = ObjectFile(shared.path, shared.info)
            for at, n in scan_spans(offset, length, _SPAN):
                n = max(0, min(n, f.size - at))
                buf = bytearray(n)
                held.append((f, at, buf))
                jobs.append((f.path.key, f.info, at, memoryview(buf)))
        self._store.read_many(jobs)
        for f, at, buf in held:
            data = bytes(buf)
            f.hold(at, data)
            # The batch's data reads take what these fetched (a small blob: all of it).
            self._batch.held.setdefault(f.path.key, []).append((at, data))
        for (key, i), (rel, offset, length) in todo.items():
            dtype = self._entries[key].dtype
            assert dtype is not None
            size = self._index.chunk(key, i)[1]
            rc = locate_chunk(files[(key, i)], offset, length, dtype, size, _SPAN)
            with self._lock:
                if len(self._raw) >= _MAX_RAW:
                    self._raw.clear()
                self._raw[(key, i)] = (rc, rel)

    def read_objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """Non-tensor entries, each small one fetched once per source (they are read again)."""
        with self._lock:
            have = {k: copy.deepcopy(self._values[k]) for k in keys if k in self._values}
        rest = [k for k in keys if k not in have]
        if rest:
            got = super().read_objects(rest)
            with self._lock:
                for k, v in got.items():
                    e = self._index.value_entry.get(k)
                    if e is not None and self._index.storage(e)[2] <= _SMALL_VALUE:
                        self._values[k] = copy.deepcopy(v)
            have.update(got)
        return {k: have[k] for k in keys}

    @property
    def _store(self) -> Any:
        assert isinstance(self.path, RemotePath)
        return self.path.store

    def _read_raw(self, per_file: dict[str, list[_RawItem]]) -> None:
        """Every byte range of the batch, `CONCURRENCY` in flight, each into its destination.

        What `_locate` fetched already (the ends of a blob, all of a small one) is taken from
        there: only the bytes no fetch brought yet are fetched. Parts that cannot land in their
        destination directly (some columns of a chunk's rows) go through scratch buffers, at
        most `_SCRATCH` bytes of them at once (then those are read and placed first).
        """
        held = getattr(self._batch, "held", {})
        jobs: list[tuple[str, Any, int, memoryview]] = []
        finish: list[Callable[[], None]] = []
        scratch = 0
        for rel, items in per_file.items():
            f = self._files.file(rel)
            for it in sorted(items, key=lambda it: it.chunk.data_offset):
                start, buf, done = raw_read(it)
                if buf.data_ptr() != it.target.data_ptr():
                    scratch += buf.numel()
                    if scratch > _SCRATCH and jobs:
                        self._store.read_many(jobs)
                        for d in finish:
                            d()
                        jobs, finish, scratch = [], [], buf.numel()
                view = writable_view(buf)
                for lo, hi in fill_from(held.get(f.path.key, ()), start, view):
                    jobs.append((f.path.key, f.info, lo, view[lo - start : hi - start]))
                finish.append(done)
        self._store.read_many(jobs)
        for done in finish:
            done()


class RemoteSafeReader(SafeFileSystemReader):
    """`SafeFileSystemReader` over a checkpoint in an object store (made `from_index`).

    Each storage entry a plan reads is fetched whole (a DCP blob is read whole to be loaded
    ``weights_only``), several at once, in waves of at most `_WAVE` bytes; then checked and
    placed exactly as local ones are (``use_bytes``).
    """

    def __init__(self, path: RemotePath, *, metadata: bytes | None = None) -> None:
        # DCP's reader keeps a local path; every read below goes to the store instead.
        super().__init__(str(path), metadata=metadata)
        self.root = path  # type: ignore[assignment]
        self._objects = _ObjectFiles(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The metadata parsed when the checkpoint was opened (never a rank-local file)."""
        kwargs.pop("rank", None)
        if self._index is None:
            raise CheckpointError(f"DCP checkpoint {self.root}: its metadata was not read")
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetches and loads the plan's items after checking all of them."""
        self._refuse_bad(plan.items)
        items = sorted(
            plan.items,
            key=lambda r: (
                self.storage_data[r.storage_index].relative_path,
                self.storage_data[r.storage_index].offset,
            ),
        )
        wave: list[ReadItem] = []
        held = 0
        try:
            for req in items:
                n = self.storage_data[req.storage_index].length
                if wave and held + n > _WAVE:
                    self._wave(wave, planner)
                    wave, held = [], 0
                wave.append(req)
                held += n
            if wave:
                self._wave(wave, planner)
        except Exception as exc:
            # Entries are fetched and written a wave at a time, not all checked before the
            # first write (NOTE: [check before writing] holds for local files only): a failure
            # after a write names the keys written.
            if not self.written:
                raise
            tensors = sum(1 for r in items if r.type != LoadItemType.BYTE_IO)
            raise PartlyWrittenError(
                f"{describe_error(exc)}; {_partly(self.written, tensors)}"
            ) from None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _wave(self, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        jobs = []
        bufs = []
        files = []
        for req in reqs:
            info = self.storage_data[req.storage_index]
            f = self._objects.file(info.relative_path)
            buf = bytearray(info.length)
            jobs.append((f.path.key, f.info, info.offset, memoryview(buf)))
            bufs.append(buf)
            files.append(f)
        if jobs:
            files[0].path.store.read_many(jobs)
        for req, buf, f in zip(reqs, bufs, files):
            self.use_bytes(bytes(buf), f"{f.path}: {req.storage_index.fqn}", req, planner)
