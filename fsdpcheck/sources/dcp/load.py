"""fsdpcheck's own DCP storage reader and load planner: no code from a checkpoint ever runs.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain pickle, and
``DefaultLoadPlanner.load_bytes`` loads BYTE_IO entries (e.g. optimizer ``param_groups``) with
``weights_only=False``: either runs whatever a hostile file asks for. `SafeFileSystemReader`
reads the metadata with a restricted unpickler, validates its structure, checks every storage
entry (a path inside the checkpoint, a regular file, bytes within the file) before opening
anything, loads every blob ``weights_only`` and hands the planner BYTE_IO values that were
already loaded ``weights_only`` and serialised again, so even torch's default planner is safe
behind it. `SafeLoadPlanner` loads bytes ``weights_only`` too. Use both::

    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from fsdpcheck._unpickle import load_weights_only
from fsdpcheck.errors import CheckpointError, describe_error
from fsdpcheck.sources.dcp.index import DcpIndex, check_storage
from fsdpcheck.sources.dcp.metadata import (
    StorageCheck,
    planner_paths,
    position,
    read_dcp_metadata,
)
from fsdpcheck.sources.fileio import open_regular
from fsdpcheck.sources.rawio import locate_chunk, located
from fsdpcheck.sources.text import one_line

__all__ = [
    "NothingWrittenError",
    "PartlyWrittenError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "StorageCheck",
    "check_storage",
    "planner_paths",
    "read_dcp_metadata",
]


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, o, n)
    return t


def safe_bytes(data: bytes, what: str) -> io.BytesIO:
    """A BYTE_IO value loaded ``weights_only`` and serialised again, ready for any planner.

    The returned stream holds only what the weights-only unpickler admitted (tensors, plain
    containers, numbers, strings), so a planner that loads it with ``weights_only=False`` still
    builds only those.

    Raises:
        CheckpointError: It is not a torch.save blob or names something weights_only refuses.
    """
    try:
        value = load_weights_only(data, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"{what} cannot be loaded weights_only: {one_line(exc)}") from None
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with no code execution and storage checks before any read.

    * ``read_metadata``: the restricted unpickler (`read_dcp_metadata`), then a structure check.
    * ``read_data``: every item of the plan is checked first (its storage entry exists, names a
      regular file inside the checkpoint, its bytes lie within the file); only then is any file
      opened. Tensor blobs load ``weights_only``, must be tensors whose size covers the item,
      and are copied into the planner's destination; BYTE_IO values are loaded ``weights_only``
      and handed over re-serialised (see `safe_bytes`).

    Errors are `CheckpointError` (a ValueError) with one line naming the file and the key.

    Every decompression a storage transform (e.g. ``stream.zstd``) does is bounded by what the
    entry can hold: a chunk's elements plus the torch.save record around them, `MAX_VALUE`
    bytes for a non-tensor value; a stream that inflates past that is refused (one line naming
    the key and the file) before more is read.

    Args:
        path: The DCP checkpoint directory.
        metadata: The bytes of ``.metadata`` when the caller has read them already (so both
            see the same metadata); read from `path` otherwise.
    """

    def __init__(self, path: str | os.PathLike[str], *, metadata: bytes | None = None) -> None:
        super().__init__(path)
        self.root = Path(path)
        self._data = metadata
        self._metadata: Any = None
        self._checked: StorageCheck | None = None
        self._bad: Callable[[str, tuple[int, ...] | None], str | None] | None = None
        self._chunk_bytes: Callable[[str, tuple[int, ...]], int | None] | None = None
        self._index: DcpIndex | None = None
        #: Runs the check made before the first write (NOTE: [check before writing]); raises
        #: on every rank when it failed on any (``collectives.agree``). None: runs it here.
        self.agree: Callable[[Callable[[], None]], None] | None = None
        #: Called once every check has passed, before the first byte is written.
        self.before_writing: Callable[[], None] | None = None
        #: Keys (DCP's flattened names) whose tensors this reader has written into, in order.
        self.written: list[str] = []

    @classmethod
    def from_index(
        cls, index: DcpIndex, bad: Callable[[str, tuple[int, ...] | None], str | None]
    ) -> SafeFileSystemReader:
        """A reader over metadata already parsed into `index` (``.metadata`` is not read again).

        Args:
            index: The parsed metadata (``dcp_index.open_index``).
            bad: Why the storage entry at (key, chunk offsets or None) must not be read, or
                None (what the opener's check found).
        """
        reader = cls(index.root)  # type: ignore[arg-type]  # RemoteSafeReader takes a RemotePath
        storage = _IndexStorage(index)
        reader.storage_data = storage  # type: ignore[assignment]  # a Mapping serves DCP
        reader._bad = bad
        reader._chunk_bytes = storage.chunk_bytes
        reader._index = index
        return reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (DCP's classes), read with the restricted unpickler.

        A reader made `from_index` unpickles nothing: DCP gets the parsed metadata, each
        key's objects made when DCP looks it up (`_IndexMetadata`).
        """
        del args
        rank = kwargs.get("rank")
        if self._index is not None and rank is None:
            md = self._metadata
            if md is None:
                md = Metadata(
                    state_dict_metadata=_IndexMetadata(self._index),  # type: ignore[arg-type]
                    planner_data=self._index.paths,
                    storage_data=self.storage_data,
                )
        else:
            data = self._data if rank is None else None
            md = read_dcp_metadata(self.root, rank, dcp_classes=True, data=data)
        self._metadata = md
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """As torch's, plus the storage check (paths, files, sizes) of every entry.

        A reader made `from_index` refuses what the opener's check found instead (`bad`).
        """
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self._index is None or metadata is not self._metadata:
            self._checked = check_storage(self.root, metadata)

    @property
    def storage_check(self) -> StorageCheck:
        """What the storage check found (after ``set_up_storage_reader``)."""
        if self._checked is None:
            raise RuntimeError("set_up_storage_reader has not been called")
        return self._checked

    def _refuse_bad(self, items: Iterable[ReadItem]) -> None:
        for req in items:
            info = self.storage_data.get(req.storage_index)
            where = f"{req.storage_index.fqn} (offset {tuple(req.storage_index.offset or ())})"
            if info is None:
                raise CheckpointError(
                    f"DCP checkpoint {self.root}: {where} has no storage entry in its .metadata"
                )
            pos = position(req.storage_index)
            if self._bad is not None:
                why = self._bad(*pos)
            else:
                why = self.storage_check.bad_entries.get(pos)
            if why is None:
                continue
            raise CheckpointError(f"DCP checkpoint {self.root}: {where}: {why}")

    def _limit(self, req: ReadItem) -> int:
        """Most bytes the entry of `req` may inflate to (see the class docstring)."""
        if req.type == LoadItemType.BYTE_IO:
            return MAX_VALUE
        fqn, offsets = position(req.storage_index)
        n = None
        if self._chunk_bytes is not None and offsets is not None:
            n = self._chunk_bytes(fqn, offsets)
        elif offsets is not None:
            n = _chunk_bytes_of(self._metadata, fqn, offsets)
        return MAX_VALUE if n is None else n + RECORD_SLACK

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the plan's items after checking all of them (see the class docstring).

        NOTE: [check before writing] A load that fails half way leaves a model that is neither
        the old one nor the checkpoint. So every item is checked before the first byte is
        written: its storage entry (`_refuse_bad`), its region inside its chunk and the size of
        its destination, its storage transform undone (within its bound, the output counted and
        dropped: a decompression bomb is refused here), its blob's records located (or, when
        they cannot be, the blob loaded ``weights_only``), and its non-tensor values loaded.
        `agree` makes that one verdict for every rank of the load, so no rank writes while
        another refuses. What can still fail while writing (a file changed meanwhile) raises
        `PartlyWrittenError`, naming the keys written before it (`written`).
        """
        per_file: dict[str, list[ReadItem]] = {}
        values: dict[int, io.BytesIO] = {}

        def check() -> None:
            self._refuse_bad(plan.items)
            for req in plan.items:
                rel = self.storage_data[req.storage_index].relative_path
                per_file.setdefault(rel, []).append(req)
            for rel, reqs in per_file.items():
                path = self.root / rel
                fd, _ = open_regular(path, "DCP data file")
                with os.fdopen(fd, "rb") as stream:
                    for req in reqs:
                        got = self._check_item(stream, path, req, planner)
                        if got is not None:
                            values[id(req)] = got

        try:
            if self.agree is not None:
                self.agree(check)
            else:
                check()
        except Exception as exc:  # the same on every rank of the load (`agree`)
            raise NothingWrittenError(
                str(exc) if isinstance(exc, CheckpointError) else describe_error(exc)
            ) from None
        if self.before_writing is not None:
            self.before_writing()
        tensors = sum(1 for r in plan.items if r.type != LoadItemType.BYTE_IO)
        try:
            for rel, reqs in per_file.items():
                path = self.root / rel
                fd, _ = open_regular(path, "DCP data file")
                with os.fdopen(fd, "rb") as stream:
                    for req in sorted(
                        reqs, key=lambda r: self.storage_data[r.storage_index].offset
                    ):
                        if req.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(req, values.pop(id(req)))
                        else:
                            self._read_item(stream, path, req, planner)
        except Exception as exc:  # other ranks may have written all of theirs by now
            raise PartlyWrittenError(
                f"{describe_error(exc)}; {_partly(self.written, tensors)}"
            ) from None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _offset(self, req: ReadItem) -> int:
        return int(self.storage_data[req.storage_index].offset)

    def _entry_bytes(self, stream: Any, path: Path, req: ReadItem) -> bytes:
        """The bytes of `req`'s storage entry, its transform undone (bounded)."""
        info = self.storage_data[req.storage_index]
        what = f"{path}: {req.storage_index.fqn}"
        # The declared length, no more than the file holds (a length is not an allocation).
        n = max(0, min(info.length, os.fstat(stream.fileno()).st_size - info.offset))
        try:
            stream.seek(info.offset)
            raw = stream.read(n)
        except OSError as exc:
            raise located(exc, path, info.offset, n) from None
        if len(raw) != info.length:
            raise CheckpointError(
                f"{what}: only {len(raw)} of {info.length} bytes could be read at byte "
                f"{info.offset} ({path} changed while it was read: it was truncated)"
            )
        return self._decoded(raw, what, req)

    def _decoded(self, raw: bytes, what: str, req: ReadItem) -> bytes:
        """`raw` (all of `req`'s storage entry) with its storage transform undone, bounded."""
        info = self.storage_data[req.storage_index]
        if not info.transform_descriptors:
            return raw
        limit = self._limit(req)
        try:
            raw = self.transforms.transform_load_stream(
                req, info.transform_descriptors, io.BytesIO(raw)
            ).read(limit + 1)
        except Exception as exc:
            raise CheckpointError(f"{what}: cannot undo its storage transform: "
                                  f"{one_line(exc)}") from None  # fmt: skip
        if len(raw) > limit:
            raise CheckpointError(
                f"{what}: its storage transform ({', '.join(info.transform_descriptors)}) "
                f"inflates past {limit} bytes, more than the entry can hold; refusing it "
                "(a decompression bomb?)"
            )
        return raw

    def use_bytes(self, raw: bytes, what: str, req: ReadItem, planner: LoadPlanner) -> None:
        """Hands one storage entry's bytes (all `length` of them) to the planner, safely.

        Undoes a storage transform (bounded, see the class docstring), then loads the blob
        ``weights_only`` and copies the region the item asks for into its destination, or
        hands a BYTE_IO value over re-serialised. For readers that fetch entries whole and
        write as they go (``remote_dcp``); the local reader checks every item first (NOTE:
        [check before writing]).
        """
        raw = self._decoded(raw, what, req)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, safe_bytes(raw, what))
            return
        self._place(self._load_blob(raw, what, req), what, req, planner)

    def _check_item(
        self, stream: Any, path: Path, req: ReadItem, planner: LoadPlanner
    ) -> io.BytesIO | None:
        """Everything about one item that can fail, checked without writing.

        See NOTE: [check before writing]. Returns a non-tensor value, loaded (None for a
        tensor's region).
        """
        info = self.storage_data[req.storage_index]
        what = f"{path}: {req.storage_index.fqn}"
        if req.type == LoadItemType.BYTE_IO:
            return safe_bytes(self._entry_bytes(stream, path, req), what)
        target = planner.resolve_tensor(req)
        if tuple(target.size()) != tuple(req.lengths):
            raise CheckpointError(
                f"{what}: destination of size {tuple(target.size())} for a region of size "
                f"{tuple(req.lengths)}"
            )
        chunk = self._chunk_meta(req)
        if chunk is not None and (
            len(chunk[1]) != len(req.lengths)
            or any(o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, chunk[1]))
        ):
            raise CheckpointError(
                f"{what}: the region at {tuple(req.storage_offsets)} of size "
                f"{tuple(req.lengths)} lies outside its chunk of size {tuple(chunk[1])}"
            )
        if not info.transform_descriptors and chunk is not None:
            dtype, sizes = chunk
            if locate_chunk(stream.fileno(), info.offset, info.length, dtype, sizes) is not None:
                return None  # one plain tensor of the chunk's dtype and shape, within its blob
        self._load_blob(self._entry_bytes(stream, path, req), what, req)  # then dropped
        return None

    def _chunk_meta(self, req: ReadItem) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """The dtype and sizes of the saved chunk `req` reads from, by the metadata."""
        fqn, offsets = position(req.storage_index)
        if offsets is None:
            return None
        if self._index is not None:
            idx = self._index
            k = idx.key_id.get(fqn)
            i = idx.position_of(fqn, offsets) if k is not None and idx.tensor[k] else None
            dtype = idx.dtypes[k] if k is not None else None
            if i is None or dtype is None:
                return None
            return dtype, tuple(idx.chunk(fqn, i)[1])
        meta = getattr(self._metadata, "state_dict_metadata", {}).get(fqn)
        for c in getattr(meta, "chunks", None) or ():
            if tuple(c.offsets) == tuple(offsets):
                return meta.properties.dtype, tuple(c.sizes)  # type: ignore[union-attr]
        return None

    def _load_blob(self, raw: bytes, what: str, req: ReadItem) -> torch.Tensor:
        """The saved chunk of `req`, loaded ``weights_only`` and checked to hold its region."""
        try:
            blob = load_weights_only(raw, map_location="cpu")
        except Exception as exc:
            raise CheckpointError(f"{what}: cannot load the saved chunk: {one_line(exc)}") from None
        if not isinstance(blob, torch.Tensor):
            kind = type(blob).__name__
            raise CheckpointError(f"{what}: the saved chunk is a {kind}, not a tensor")
        if blob.dim() != len(req.lengths) or any(
            o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, blob.shape)
        ):
            raise CheckpointError(
                f"{what}: the saved chunk has shape {tuple(blob.shape)}, too small for the "
                f"region at {tuple(req.storage_offsets)} of size {tuple(req.lengths)} that "
                ".metadata places in it"
            )
        return blob

    def _read_item(self, stream: Any, path: Path, req: ReadItem, planner: LoadPlanner) -> None:
        what = f"{path}: {req.storage_index.fqn}"
        self._place(self._load_blob(self._entry_bytes(stream, path, req), what, req), what, req,
                    planner)  # fmt: skip

    def _place(self, blob: torch.Tensor, what: str, req: ReadItem, planner: LoadPlanner) -> None:
        """Copies `req`'s region of the loaded chunk `blob` into its destination."""
        src = _narrow(blob, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise CheckpointError(
                f"{what}: destination of size {tuple(target.size())} for a region of size "
                f"{tuple(src.size())}"
            )
        target.copy_(src)
        planner.commit_tensor(req, target)
        self.written.append(req.dest_index.fqn)


class NothingWrittenError(CheckpointError):
    """A load refused before it wrote anything (on any rank, when the check was agreed)."""


class PartlyWrittenError(CheckpointError):
    """A load failed after it had written into some of the destination tensors (named)."""


def _partly(written: list[str], total: int) -> str:
    """The words for a load that wrote `written` (of `total` items) before it failed."""
    if not written:
        return f"none of the {total} tensor regions this rank loads was written before it"
    keys = list(dict.fromkeys(written))
    shown_keys = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    return (
        f"{len(written)} of the {total} tensor regions this rank loads were written before it "
        f"({shown_keys}), the rest were not"
    )


#: Bytes a non-tensor value may inflate to through a storage transform.
MAX_VALUE = 256 << 20
#: Bytes of torch.save record around a chunk's elements (zip headers, data.pkl, byteorder).
RECORD_SLACK = 1 << 20


def _chunk_bytes_of(md: Any, fqn: str, offsets: tuple[int, ...]) -> int | None:
    """Bytes of the elements of the chunk at (fqn, offsets) by DCP metadata, or None."""
    meta = getattr(md, "state_dict_metadata", {}).get(fqn) if md is not None else None
    chunks = getattr(meta, "chunks", None)
    if not chunks:
        return None
    for c in chunks:
        if tuple(c.offsets) == tuple(offsets):
            props: Any = meta.properties  # type: ignore[union-attr]
            return math.prod(c.sizes) * props.dtype.itemsize
    return None


class _IndexStorage(Mapping[Any, Any]):
    """``storage_data`` for DCP's reader: one `_StorageInfo` made per lookup, from columns."""

    def __init__(self, index: DcpIndex) -> None:
        self.index = index

    def _entry(self, key: Any) -> int:
        fqn, offsets = position(key)
        idx = self.index
        k = idx.key_id.get(fqn)
        if k is None:
            return -1
        if offsets is None:
            return idx.value_entry.get(fqn, -1)
        i = idx.position_of(fqn, offsets) if idx.tensor[k] else None
        return -1 if i is None else idx.chunk_entry(fqn, i)

    def chunk_bytes(self, fqn: str, offsets: tuple[int, ...]) -> int | None:
        idx = self.index
        k = idx.key_id.get(fqn)
        i = idx.position_of(fqn, offsets) if k is not None and idx.tensor[k] else None
        if i is None or k is None:
            return None
        dtype = idx.dtypes[k]
        return math.prod(idx.chunk(fqn, i)[1]) * (dtype.itemsize if dtype else 1)

    def __getitem__(self, key: Any) -> Any:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        e = self._entry(key)
        if e < 0:
            raise KeyError(key)
        rel, offset, length, transforms = self.index.storage(e)
        return _StorageInfo(rel, offset, length, list(transforms) or None)

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("storage entries are looked up, not listed")

    def __len__(self) -> int:
        return int(self.index.entry_where.shape[0])


class _IndexMetadata(Mapping[str, Any]):
    """``state_dict_metadata`` for DCP's planner: a key's objects made when it is looked up.

    DCP's load planner looks up the keys of the state dict it loads (and lists every key);
    only those get DCP's objects, one per chunk, made from the columns (and kept).
    """

    def __init__(self, index: DcpIndex) -> None:
        self.index = index
        self.made: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        made = self.made.get(key)
        if made is not None:
            return made
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        idx = self.index
        k = idx.key_id[key]
        md: Any
        if idx.tensor[k]:
            dtype = idx.dtypes[k]
            assert dtype is not None
            md = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(idx.shapes[k]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n))
                    for o, n in idx.chunks(key)
                ],
            )
        else:
            md = BytesStorageMetadata()
        self.made[key] = md
        return md

    def __contains__(self, key: object) -> bool:
        return key in self.index.key_id

    def __iter__(self) -> Iterator[str]:
        return iter(self.index.keys)

    def __len__(self) -> int:
        return len(self.index.keys)


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's DefaultLoadPlanner, loading BYTE_IO values ``weights_only``.

    Takes DefaultLoadPlanner's arguments. Behind `SafeFileSystemReader` the bytes are already
    safe; this keeps a load safe with any other storage reader too.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Loads one non-tensor value with the weights-only unpickler.

        The value is loaded ``weights_only`` and serialised again (`safe_bytes`) before torch's
        own load_bytes places it, so that placement (nesting included) stays torch's.
        """
        super().load_bytes(read_item, safe_bytes(value.read(), read_item.dest_index.fqn))
