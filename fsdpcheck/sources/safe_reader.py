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
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from fsdpcheck._unpickle import UnsafePickleError, restricted_loads
from fsdpcheck.sources.base import CheckpointError, Problem, check_regular, file_problem, one_line
from fsdpcheck.sources.tiling import tiling_problems

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "StorageCheck",
    "check_storage",
    "read_dcp_metadata",
]

METADATA_FILE = ".metadata"


def read_dcp_metadata(path: str | os.PathLike[str], rank: int | None = None) -> Metadata:
    """A DCP directory's metadata, read without running code and checked for structure.

    Args:
        path: The DCP checkpoint directory.
        rank: Read the rank-local ``__<rank>.metadata`` instead of ``.metadata``.

    Raises:
        FileNotFoundError: There is no metadata file.
        UnsafePickleError: It names a class outside DCP's metadata (nothing was run).
        CheckpointError: It is not a regular file, not a pickle, or not shaped like DCP metadata.
    """
    name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
    f = check_regular(Path(path) / name, "DCP metadata")
    what = f"DCP metadata {f}"
    try:
        md = restricted_loads(f.read_bytes(), what)
    except UnsafePickleError:
        raise
    except RecursionError:
        raise CheckpointError(f"{what} is nested too deeply to be DCP metadata") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, AttributeError,
            IndexError, MemoryError, OverflowError, RuntimeError, ImportError) as exc:  # fmt: skip
        # Building an admitted class with wrong arguments raises TypeError/ValueError/...
        msg = f"{what} is unreadable: {type(exc).__name__}: {one_line(exc)}"
        raise CheckpointError(msg) from None
    validate_metadata(md, what)
    return md


def _ints(value: Any, what: str, field: str, *, allow_negative: bool = False) -> tuple[int, ...]:
    if not isinstance(value, (torch.Size, tuple, list)) or not all(type(v) is int for v in value):
        raise CheckpointError(f"{what}: {field} is {value!r:.80}, not a sequence of ints")
    if not allow_negative and any(v < 0 for v in value):
        raise CheckpointError(f"{what}: {field} {tuple(value)} has a negative entry")
    return tuple(value)


def validate_metadata(md: Any, what: str) -> None:
    """Checks that an unpickled object is DCP metadata with fields of the right types.

    Values that are well typed but inconsistent (gaps, chunks outside the shape, entries past
    the end of a file) are not errors here: `check_storage` reports them as problems.

    Raises:
        CheckpointError: One line naming the field.
    """
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{what} holds a {type(md).__name__}, not DCP Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise CheckpointError(f"{what}: state_dict_metadata is not a dict")
    for key, meta in sdm.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{what}: key {key!r:.80} is not a string")
        if isinstance(meta, TensorStorageMetadata):
            props = getattr(meta, "properties", None)
            if not isinstance(props, TensorProperties) or not isinstance(
                getattr(props, "dtype", None), torch.dtype
            ):
                raise CheckpointError(f"{what}: {key}: tensor properties carry no torch dtype")
            _ints(getattr(meta, "size", None), what, f"{key}: size")
            chunks = getattr(meta, "chunks", None)
            if not isinstance(chunks, list):
                raise CheckpointError(f"{what}: {key}: chunks is not a list")
            for c in chunks:
                if not isinstance(c, ChunkStorageMetadata):
                    raise CheckpointError(f"{what}: {key}: a chunk is a {type(c).__name__}")
                _ints(getattr(c, "offsets", None), what, f"{key}: chunk offsets",
                      allow_negative=True)  # fmt: skip
                _ints(getattr(c, "sizes", None), what, f"{key}: chunk sizes", allow_negative=True)
        elif not isinstance(meta, BytesStorageMetadata):
            raise CheckpointError(
                f"{what}: {key} is described by a {type(meta).__name__}, not tensor or bytes "
                "storage metadata"
            )
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        raise CheckpointError(f"{what}: planner_data is not a dict")
    for key, path in (md.planner_data or {}).items():
        # DCP's default planner records each flattened key's path in the state dict; the key
        # is those components joined by dots. A path that does not spell its key would make
        # fsdpcheck and torch name the tensor differently.
        spelled = ".".join(str(p) for p in path) if isinstance(path, (list, tuple)) else key
        if key in sdm and path and spelled != key:
            raise CheckpointError(
                f"{what}: planner_data gives {key!r:.80} the path {tuple(path)!r:.80}, which "
                "does not spell it"
            )
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{what}: storage_data is not a dict")
    for idx, info in storage.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(idx.fqn, str):
            raise CheckpointError(f"{what}: a storage_data key is not a MetadataIndex")
        if idx.offset is not None:
            _ints(idx.offset, what, f"{idx.fqn}: storage index offset", allow_negative=True)
        # _StorageInfo is private to torch: the unpickler admits it by name, checked by shape.
        if type(info).__name__ != "_StorageInfo":
            raise CheckpointError(f"{what}: {idx.fqn}: storage entry is a {type(info).__name__}")
        if not isinstance(getattr(info, "relative_path", None), str):
            raise CheckpointError(f"{what}: {idx.fqn}: storage path is not a string")
        for name in ("offset", "length"):
            v = getattr(info, name, None)
            if type(v) is not int or v < 0:
                raise CheckpointError(f"{what}: {idx.fqn}: storage {name} is {v!r:.40}")
        td = getattr(info, "transform_descriptors", None)
        if td is not None and (
            not isinstance(td, (list, tuple)) or not all(isinstance(t, str) for t in td)
        ):
            raise CheckpointError(f"{what}: {idx.fqn}: transform_descriptors are not strings")
    sm = getattr(md, "storage_meta", None)
    if sm is not None and not isinstance(sm, StorageMeta):
        raise CheckpointError(f"{what}: storage_meta is a {type(sm).__name__}")


@dataclass
class StorageCheck:
    """What `check_storage` found.

    Attributes:
        findings: ``(key, kind, message)`` in metadata order, kind "gap", "layout" (a chunk
            outside the shape, of the wrong rank, or overlapping another), "missing" (a chunk
            or value without a storage entry) or "error" (storage that cannot be read).
        bad_entries: Storage entries that must not be read, with the reason (one line).
        overlapping: Keys whose chunks overlap (reads of them cannot assume disjoint chunks).
        gaps: Keys with a region no chunk covers.
    """

    findings: list[Problem]
    bad_entries: dict[MetadataIndex, str]
    overlapping: set[str]
    gaps: set[str]

    @property
    def problems(self) -> list[Problem]:
        """The findings with kind "gap" or "error" (the Source.problems vocabulary)."""
        return [(k, "gap" if kind == "gap" else "error", m) for k, kind, m in self.findings]


def planner_paths(md: Metadata) -> dict[str, tuple[str, ...]]:
    """Each key's structural path from DCP's planner data (the key itself where there is none).

    The path tells containers from dots inside FQNs: ``("model", "layers.0.w")``.
    """
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    out = {}
    for key in md.state_dict_metadata:
        raw = planner.get(key)
        out[key] = tuple(str(p) for p in raw) if isinstance(raw, (list, tuple)) and raw else (key,)
    return out


def check_storage(root: str | os.PathLike[str], md: Metadata) -> StorageCheck:
    """Every structural problem of a DCP checkpoint that can be found without reading data.

    Per tensor: chunks with the wrong number of dims or outside the global shape, chunks that
    leave gaps ("gap") or overlap, chunks without a storage entry, and chunks whose stored bytes
    are fewer than their elements need. Per storage entry: a path outside the directory, a
    missing or non-regular file, bytes past the end of the file. One stat per data file.
    """
    root = Path(root)
    problems: list[Problem] = []
    bad: dict[MetadataIndex, str] = {}
    overlapping: set[str] = set()
    gaps: set[str] = set()
    ends: dict[str, list[tuple[MetadataIndex, int]]] = {}
    for idx, info in md.storage_data.items():
        ends.setdefault(info.relative_path, []).append((idx, info.offset + info.length))
    for rel, items in ends.items():
        last = max(e for _, e in items)
        why = file_problem(root, rel, last, "storage entry")
        if why is None:
            continue
        for idx, end in items:
            why_here = file_problem(root, rel, end, "its data") if "ends at byte" in why else why
            if why_here is not None:
                bad[idx] = why_here
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            idx = MetadataIndex(key)
            if idx not in md.storage_data:
                problems.append((key, "missing", "no storage entry holds this value"))
            continue
        shape = tuple(meta.size)
        boxes = []
        itemsize = meta.properties.dtype.itemsize
        for c in meta.chunks:
            off, size = tuple(c.offsets), tuple(c.sizes)
            if len(off) != len(shape) or len(size) != len(shape):
                problems.append((key, "layout", f"chunk at offset {off} has the wrong number of "
                                 f"dims for the shape {shape}"))  # fmt: skip
                continue
            if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(off, size, shape)):
                problems.append((key, "layout", f"chunk at offset {off} of size {size} lies "
                                 f"outside the global shape {shape}"))  # fmt: skip
                continue
            n = math.prod(size)
            if n > 0 or not shape:
                boxes.append((off, size))
            info = md.storage_data.get(MetadataIndex(key, torch.Size(off)))
            if info is None:
                if n > 0 or not shape:
                    problems.append((key, "missing", f"chunk at offset {off} has no storage entry"))
                continue
            if n * itemsize > info.length:
                problems.append((key, "error", f"chunk at offset {off} declares {n} elements "
                                 f"({n * itemsize} bytes) but its stored data has "
                                 f"{info.length} bytes"))  # fmt: skip
                bad.setdefault(MetadataIndex(key, torch.Size(off)), problems[-1][2])
        for p in tiling_problems(shape, boxes):
            if p.startswith("gap"):
                gaps.add(key)
                problems.append((key, "gap", f"{p}: no saved chunk holds this region"))
            else:
                overlapping.add(key)
                problems.append((key, "layout", p))
    seen = set()
    for idx, why in bad.items():
        if (idx.fqn, why) not in seen:
            seen.add((idx.fqn, why))
            problems.append((idx.fqn, "error", why))
    return StorageCheck(problems, bad, overlapping, gaps)


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
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
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

    Args:
        path: The DCP checkpoint directory.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.root = Path(path)
        self._checked: StorageCheck | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, read with the restricted unpickler."""
        del args
        md = read_dcp_metadata(self.root, kwargs.get("rank"))
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """As torch's, plus the storage check (paths, files, sizes) of every entry."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
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
            why = self.storage_check.bad_entries.get(req.storage_index)
            if why is None and req.storage_index not in self.storage_check.bad_entries:
                continue
            raise CheckpointError(f"DCP checkpoint {self.root}: {where}: {why}")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the plan's items after checking all of them (see the class docstring)."""
        self._refuse_bad(plan.items)
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            path = check_regular(self.root / rel, "DCP data file")
            with open(path, "rb") as stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._read_item(stream, path, req, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, stream: Any, path: Path, req: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[req.storage_index]
        what = f"{path}: {req.storage_index.fqn}"
        stream.seek(info.offset)
        raw = stream.read(info.length)
        if len(raw) != info.length:
            raise CheckpointError(f"{what}: only {len(raw)} of {info.length} bytes could be read")
        if info.transform_descriptors:
            try:
                raw = self.transforms.transform_load_stream(
                    req, info.transform_descriptors, io.BytesIO(raw)
                ).read(-1)
            except Exception as exc:
                raise CheckpointError(f"{what}: cannot undo its storage transform: "
                                      f"{one_line(exc)}") from None  # fmt: skip
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, safe_bytes(raw, what))
            return
        try:
            blob = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
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
        src = _narrow(blob, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise CheckpointError(
                f"{what}: destination of size {tuple(target.size())} for a region of size "
                f"{tuple(src.size())}"
            )
        target.copy_(src)
        planner.commit_tensor(req, target)


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
