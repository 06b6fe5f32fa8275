"""DCP ``.metadata`` read, validated and checked without importing torch.distributed.checkpoint.

NOTE: [DCP-free metadata] Importing ``torch.distributed.checkpoint.metadata`` runs DCP's package
``__init__``, which imports torch.distributed.tensor and sympy: about half a second, more than
an ``inspect`` or ``fingerprint`` of a DCP directory spends on everything else. Nothing here
needs DCP's code, only the shape of its metadata, so the restricted unpickler builds the mirror
classes below (same names, same fields, same defaults, same pickled state) and fsdpcheck's own
reads, checks and fingerprints work on them. DCP's classes are built only where the metadata is
handed to DCP itself (``SafeFileSystemReader.read_metadata``, for ``dcp.load``); the checks here
accept either.

The mirrors admit exactly what the unpickler admits (``fsdpcheck._unpickle``): a file that names
any other global is refused before anything of it is built.
"""

from __future__ import annotations

import enum
import math
import os
import reprlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdpcheck._unpickle import ADMITTED
from fsdpcheck.errors import CheckpointError, UnsafePickleError
from fsdpcheck.sources.base import Problem
from fsdpcheck.sources.dcp.stream import ChunkRun
from fsdpcheck.sources.fileio import open_regular
from fsdpcheck.sources.text import show_value as _show

__all__ = [
    "METADATA_FILE",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageCheck",
    "StorageInfo",
    "TensorProperties",
    "TensorStorageMetadata",
    "planner_paths",
    "position",
    "read_dcp_metadata",
    "validate_metadata",
]

METADATA_FILE = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
# Where torch < 2.2 defined TensorProperties (admitted by the unpickler under that name too).
_OLD_TENSOR_PROPERTIES = "torch.distributed._shard.sharded_tensor.metadata"


class _Mirror:
    """What pickle's NEWOBJ + BUILD make of a dataclass: the saved fields as attributes.

    Class attributes hold the dataclass's defaults, so a field the writer left out (DCP's
    ``_StorageInfo`` pickles only the fields that are not None) reads as its default, exactly as
    it does on DCP's class. Unhashable, as DCP's (non-frozen) dataclasses are: a file that uses
    one as a dict key fails here as it fails in DCP.
    """

    _fields: tuple[str, ...] = ()
    __hash__ = None  # type: ignore[assignment]

    @reprlib.recursive_repr()
    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={_show(getattr(self, f, None))}" for f in self._fields)
        return f"{type(self).__name__}({inner})"


class ChunkStorageMetadata(_Mirror):
    """Mirror of DCP's ChunkStorageMetadata: one saved chunk's offsets and sizes."""

    _fields = ("offsets", "sizes")
    offsets: Any = None
    sizes: Any = None

    def __init__(self, offsets: Any = None, sizes: Any = None) -> None:
        self.offsets, self.sizes = offsets, sizes


class _MEM_FORMAT_ENCODING(enum.Enum):  # DCP's name (a mirror, found by name)
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEMORY_FORMATS = {
    _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
    _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}


class TensorProperties(_Mirror):
    """Mirror of DCP's TensorProperties (pickled as a 5-tuple, as DCP's ``__getstate__`` does)."""

    _fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    dtype: Any = None
    layout: Any = torch.strided
    requires_grad: Any = False
    memory_format: Any = torch.contiguous_format
    pin_memory: Any = False

    def __setstate__(self, state: Any) -> None:
        # As DCP's __setstate__: unpack the tuple, decode the memory format (refusing others).
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        if not isinstance(encoding, _MEM_FORMAT_ENCODING):
            raise RuntimeError(f"Invalid torch.memory_format encoding: {encoding!r:.40}")
        self.memory_format = _MEMORY_FORMATS[encoding]


class TensorStorageMetadata(_Mirror):
    """Mirror of DCP's TensorStorageMetadata: a tensor's properties, global size and chunks."""

    _fields = ("properties", "size", "chunks")
    properties: Any = None
    size: Any = None
    chunks: Any = None


class BytesStorageMetadata(_Mirror):
    """Mirror of DCP's BytesStorageMetadata: a non-tensor value."""


class StorageMeta(_Mirror):
    """Mirror of DCP's StorageMeta."""

    _fields = ("checkpoint_id", "save_id", "load_id", "modules")
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: Any = ()


class Metadata(_Mirror):
    """Mirror of DCP's Metadata: ``state_dict_metadata``, ``planner_data``, ``storage_data``."""

    _fields = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    state_dict_metadata: Any = None
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class MetadataIndex(_Mirror):
    """Mirror of DCP's MetadataIndex: equal and hashed by (fqn, offset), as DCP's (frozen).

    (A key's hash is taken when the unpickler stores it; `validate_metadata` refuses a key
    changed after that.)
    """

    _fields = ("fqn", "offset", "index")
    fqn: Any = None
    offset: Any = None
    index: Any = None

    def __init__(self, fqn: str, offset: Any = None, index: int | None = None) -> None:
        self.fqn, self.index = fqn, index
        self.offset = None if offset is None else torch.Size(offset)

    def __eq__(self, other: object) -> bool:
        if type(other) is not MetadataIndex:
            return NotImplemented
        return (self.fqn, self.offset) == (other.fqn, other.offset)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash((self.fqn, self.offset))


class StorageInfo(_Mirror):
    """Mirror of DCP's filesystem ``_StorageInfo``: where one entry's bytes lie."""

    _fields = ("relative_path", "offset", "length", "transform_descriptors")
    relative_path: Any = None
    offset: Any = None
    length: Any = None
    transform_descriptors: Any = None


class _Opaque(_Mirror):
    """A planner record megatron-core caches in the metadata: kept, never interpreted."""

    # Some are frozen dataclasses or enums in DCP (hashable).
    __hash__ = object.__hash__  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


_MIRRORS: dict[tuple[str, str], Any] = {
    (_DCP_METADATA, "Metadata"): Metadata,
    (_DCP_METADATA, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP_METADATA, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP_METADATA, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP_METADATA, "TensorProperties"): TensorProperties,
    (_DCP_METADATA, "MetadataIndex"): MetadataIndex,
    (_DCP_METADATA, "StorageMeta"): StorageMeta,
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    (_DCP_FILESYSTEM, "_StorageInfo"): StorageInfo,
    (_OLD_TENSOR_PROPERTIES, "TensorProperties"): TensorProperties,
    **{
        (module, name): type(name, (_Opaque,), {})
        for module in ("torch.distributed.checkpoint.planner", "torch.distributed._shard.metadata")
        for name in ADMITTED.get(module, ())
    },
}


def _mirror(module: str, name: str) -> Any:
    return _MIRRORS[(module, name)]


def _kinds(name: str, *modules: str) -> Any:  # a tuple of classes
    """The mirror class `name` and, where DCP is imported (its objects can exist), DCP's own."""
    mirror = StorageInfo if name == "_StorageInfo" else globals()[name]
    real = [getattr(sys.modules.get(m), name, None) for m in modules or (_DCP_METADATA,)]
    return (mirror, *(r for r in real if r is not None))


def read_dcp_metadata(
    path: str | os.PathLike[str],
    rank: int | None = None,
    *,
    dcp_classes: bool = False,
    data: bytes | None = None,
) -> Any:
    """A DCP directory's metadata, read without running code and checked for structure.

    Args:
        path: The DCP checkpoint directory.
        rank: Read the rank-local ``__<rank>.metadata`` instead of ``.metadata``.
        dcp_classes: Build DCP's own classes (imports torch.distributed.checkpoint; for handing
            the metadata to DCP) instead of the mirrors of this module.
        data: The file's bytes, already read (so two readers see the same metadata).

    Returns:
        A `Metadata` (or DCP's Metadata with `dcp_classes`).

    Raises:
        FileNotFoundError: There is no metadata file.
        UnsafePickleError: It names a class outside DCP's metadata (nothing was run).
        CheckpointError: It is not a regular file, not a pickle, or not shaped like DCP metadata.
    """
    from fsdpcheck.sources.dcp.stream import StreamError, read_metadata_stream

    name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
    f = Path(path) / name
    what = f"DCP metadata {f}"
    resolve = None if dcp_classes else _mirror
    try:
        if data is None:
            fd, _ = open_regular(f, "DCP metadata")
            try:
                md = read_metadata_stream(fd, what, resolve, MAX_METADATA, columns=False).metadata
            finally:
                os.close(fd)
        else:
            md = read_bytes(data, what, resolve)
    except (UnsafePickleError, CheckpointError, FileNotFoundError, PermissionError):
        raise
    except (StreamError, ValueError) as exc:
        raise CheckpointError(f"{what} is unreadable: {exc}") from None
    try:
        validate_metadata(md, what)
    except RecursionError:
        raise CheckpointError(f"{what} is nested too deeply to be DCP metadata") from None
    return md


#: ``.metadata`` larger than this is refused (a 1,024,000-chunk file is 151 MB).
MAX_METADATA = 4 << 30


def read_bytes(data: bytes, what: str, resolve: Any) -> Any:
    """Metadata from bytes already read (through the same restricted machine, objects only)."""
    import tempfile

    from fsdpcheck.sources.dcp.stream import read_metadata_stream

    with tempfile.TemporaryFile() as fh:
        fh.write(data)
        fh.flush()
        return read_metadata_stream(
            fh.fileno(), what, resolve, MAX_METADATA, columns=False
        ).metadata


def _ints(value: Any, what: str, field: str, *, allow_negative: bool = False) -> tuple[int, ...]:
    if not isinstance(value, (torch.Size, tuple, list)) or not all(type(v) is int for v in value):
        raise CheckpointError(f"{what}: {field} is {_show(value)}, not a sequence of ints")
    if not allow_negative and any(v < 0 for v in value):
        raise CheckpointError(f"{what}: {field} {tuple(value)} has a negative entry")
    if any(v >= _INT64 or v < -_INT64 for v in value):
        raise CheckpointError(f"{what}: {field} {tuple(value)} has an entry {_PAST_INT64}")
    return tuple(value)


# Sizes, offsets and lengths are 64-bit signed everywhere (torch, DCP, file offsets): a claim
# past that is no checkpoint's (NOTE: [claimed sizes] in ``dcp_index``).
_INT64 = 1 << 63
_PAST_INT64 = (
    "past 2**63 - 1, which no tensor or file can hold; the metadata is corrupt "
    "(restore it from a copy, or save the checkpoint again)"
)


def validate_metadata(md: Any, what: str) -> None:
    """Checks that an unpickled object is DCP metadata with fields of the right types.

    Accepts the mirror classes of this module and DCP's own. Values that are well typed but
    inconsistent (gaps, chunks outside the shape, entries past the end of a file) are not
    errors here: ``dcp_index.check`` reports them as problems.

    Raises:
        CheckpointError: One line naming the field.
    """
    if not isinstance(md, _kinds("Metadata")):
        raise CheckpointError(f"{what} holds a {type(md).__name__}, not DCP Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise CheckpointError(f"{what}: state_dict_metadata is not a dict")
    tensor_meta, bytes_meta = _kinds("TensorStorageMetadata"), _kinds("BytesStorageMetadata")
    props_kinds = _kinds("TensorProperties", _DCP_METADATA, _OLD_TENSOR_PROPERTIES)
    chunk_kinds = _kinds("ChunkStorageMetadata")
    for key, meta in sdm.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{what}: key {_show(key)} is not a string")
        if isinstance(meta, tensor_meta):
            props = getattr(meta, "properties", None)
            if not isinstance(props, props_kinds) or not isinstance(
                getattr(props, "dtype", None), torch.dtype
            ):
                raise CheckpointError(f"{what}: {key}: tensor properties carry no torch dtype")
            _ints(getattr(meta, "size", None), what, f"{key}: size")
            chunks = getattr(meta, "chunks", None)
            if not isinstance(chunks, list):
                raise CheckpointError(f"{what}: {key}: chunks is not a list")
            for c in chunks:
                if type(c) is ChunkRun:
                    continue  # chunks read as columns (dcp_runs): integers by construction
                if not isinstance(c, chunk_kinds):
                    raise CheckpointError(f"{what}: {key}: a chunk is a {type(c).__name__}")
                _ints(getattr(c, "offsets", None), what, f"{key}: chunk offsets",
                      allow_negative=True)  # fmt: skip
                _ints(getattr(c, "sizes", None), what, f"{key}: chunk sizes", allow_negative=True)
        elif not isinstance(meta, bytes_meta):
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
        if not isinstance(key, str) or key not in sdm or not isinstance(path, (list, tuple)):
            continue  # not a path fsdpcheck reads (planner_paths uses the key itself)
        if not all(type(p) in (str, int) for p in path):
            raise CheckpointError(
                f"{what}: planner_data gives {_show(key)} the path {_show(path)}, which is not "
                "made of names and indices"
            )
        if path and ".".join(str(p) for p in path) != key:
            raise CheckpointError(
                f"{what}: planner_data gives {_show(key)} the path {_show(path)}, which does "
                "not spell it"
            )
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{what}: storage_data is not a dict")
    index_kinds, info_kinds = _kinds("MetadataIndex"), _kinds("_StorageInfo", _DCP_FILESYSTEM)
    seen: set[Position] = set()
    for idx, info in storage.items():
        if not isinstance(idx, index_kinds) or not isinstance(idx.fqn, str):
            raise CheckpointError(f"{what}: a storage_data key is not a MetadataIndex")
        if idx.offset is not None:
            _ints(idx.offset, what, f"{idx.fqn}: storage index offset", allow_negative=True)
        # A key changed after the unpickler stored it (a later BUILD of the same object) sits
        # under a stale hash: DCP's lookups would find another entry than the one checked.
        pos = position(idx)
        if pos in seen or storage.get(idx) is not info:
            raise CheckpointError(
                f"{what}: {idx.fqn}: two storage entries claim the chunk at {pos[1]}"
            )
        seen.add(pos)
        if not isinstance(info, info_kinds):
            raise CheckpointError(f"{what}: {idx.fqn}: storage entry is a {type(info).__name__}")
        if not isinstance(getattr(info, "relative_path", None), str):
            raise CheckpointError(f"{what}: {idx.fqn}: storage path is not a string")
        for name in ("offset", "length"):
            v = getattr(info, name, None)
            if type(v) is not int or v < 0:
                raise CheckpointError(f"{what}: {idx.fqn}: storage {name} is {_show(v)}")
            if v >= _INT64:
                raise CheckpointError(f"{what}: {idx.fqn}: storage {name} {v} is {_PAST_INT64}")
        td = getattr(info, "transform_descriptors", None)
        if td is not None and (
            not isinstance(td, (list, tuple)) or not all(isinstance(t, str) for t in td)
        ):
            raise CheckpointError(f"{what}: {idx.fqn}: transform_descriptors are not strings")
    sm = getattr(md, "storage_meta", None)
    if sm is not None and not isinstance(sm, _kinds("StorageMeta")):
        raise CheckpointError(f"{what}: storage_meta is a {type(sm).__name__}")


#: A storage entry's position: (key, chunk offsets), offsets None for a non-tensor value. The
#: same for a mirror MetadataIndex and DCP's, so one StorageCheck serves both.
Position = tuple[str, tuple[int, ...] | None]


def position(index: Any) -> Position:
    """The `Position` of a MetadataIndex (mirror or DCP's)."""
    return (index.fqn, None if index.offset is None else tuple(index.offset))


def is_tensor_meta(meta: Any) -> bool:
    """Whether a state_dict_metadata value describes a tensor (mirror or DCP's class)."""
    return isinstance(meta, _kinds("TensorStorageMetadata"))


@dataclass
class StorageCheck:
    """What ``dcp_index.check_storage`` found.

    Attributes:
        findings: ``(key, kind, message)`` in metadata order, kind "gap", "layout" (a chunk
            outside the shape, of the wrong rank, or overlapping another), "missing" (a chunk
            or value without a storage entry) or "error" (storage that cannot be read).
        bad_entries: Storage entries that must not be read (by `position`), with the reason.
        overlapping: Keys whose chunks overlap (reads of them cannot assume disjoint chunks).
        gaps: Keys with a region no chunk covers.
        storage: ``md.storage_data`` by `position` (`storage_by_position`).
    """

    findings: list[Problem]
    bad_entries: dict[Position, str]
    overlapping: set[str]
    gaps: set[str]
    # Not compared: the records are DCP's classes or the mirrors, by who read the metadata.
    storage: dict[Position, Any] = field(compare=False, repr=False)

    @property
    def problems(self) -> list[Problem]:
        """The findings with kind "gap" or "error" (the Source.problems vocabulary)."""
        return [(k, "gap" if kind == "gap" else "error", m) for k, kind, m in self.findings]


def outside_shape(off: Any, size: Any, shape: tuple[int, ...]) -> str:
    """The finding for a chunk that lies outside its tensor's shape."""
    return f"chunk at offset {off} of size {size} lies outside the global shape {shape}"


def wrong_dims(off: Any, shape: tuple[int, ...]) -> str:
    """The finding for a chunk with a number of dims other than its tensor's."""
    return f"chunk at offset {off} has the wrong number of dims for the shape {shape}"


def no_entry(off: Any) -> str:
    """The finding for a chunk that no storage entry holds."""
    return f"chunk at offset {off} has no storage entry"


def short_data(off: Any, n: int, itemsize: int, length: int) -> str:
    """The finding for a chunk whose stored bytes are fewer than its elements need."""
    return (
        f"chunk at offset {off} declares {n} elements ({n * itemsize} bytes) but its stored "
        f"data has {length} bytes"
    )


def chunk_finding(
    off: tuple[int, ...],
    size: tuple[int, ...],
    shape: tuple[int, ...],
    itemsize: int,
    stored: int | None,
    transformed: bool = False,
) -> tuple[tuple[str, str] | None, bool]:
    """What is wrong with one saved chunk ((kind, message) or None) and whether it tiles.

    Args:
        off: The chunk's offsets.
        size: The chunk's sizes.
        shape: Its tensor's global shape.
        itemsize: Bytes per element.
        stored: Bytes of its storage entry (None: it has none).
        transformed: Its entry has a storage transform: the stored bytes are encoded (e.g.
            compressed), so their count says nothing of the elements (NOTE: [transformed
            entries] in ``dcp_index``).

    Returns:
        The finding (kind "layout", "missing" or "error"), and whether the chunk takes part in
        the tiling check (inside the shape, non-empty or 0-d).
    """
    if len(off) != len(shape) or len(size) != len(shape):
        return ("layout", wrong_dims(off, shape)), False
    if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(off, size, shape)):
        return ("layout", outside_shape(off, size, shape)), False
    n = math.prod(size)
    live = n > 0 or not shape
    if stored is None:
        return (("missing", no_entry(off)) if live else None), live
    if not transformed and n * itemsize > stored:
        return ("error", short_data(off, n, itemsize, stored)), live
    return None, live


def planner_paths(md: Any) -> dict[str, tuple[str, ...]]:
    """Each key's structural path from DCP's planner data (the key itself where there is none).

    The path tells containers from dots inside FQNs: ``("model", "layers.0.w")``.
    """
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    out = {}
    for key in md.state_dict_metadata:
        raw = planner.get(key)
        out[key] = tuple(str(p) for p in raw) if isinstance(raw, (list, tuple)) and raw else (key,)
    return out


def storage_by_position(md: Any) -> dict[Position, Any]:
    """``md.storage_data`` keyed by `position` (one lookup per chunk, no index objects built)."""
    return {position(idx): info for idx, info in md.storage_data.items()}
