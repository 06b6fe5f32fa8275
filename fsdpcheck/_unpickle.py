"""A restricted unpickler for DCP ``.metadata``: no code from a checkpoint ever runs.

It builds DCP's metadata classes (or fsdpcheck's mirrors of them, NOTE: [DCP-free metadata] in
``fsdpcheck.sources.dcp_metadata``) and plain data, and refuses every other global.

Why not ``torch.load(weights_only=True)``: ``.metadata`` is a bare pickle (not a torch.save zip)
of DCP's own dataclasses, which torch's weights-only allowlist does not hold. The classes
admitted here are the ones a ``dcp.save`` writes (listed from the GLOBAL opcodes of real
metadata): constructing them runs only dataclass ``__init__``/``__setstate__`` code of torch,
never a callable named by the file.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections.abc import Callable
from typing import Any

import torch

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# module -> names admitted (classes built by NEWOBJ/BUILD or called by REDUCE with plain args).
ADMITTED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # megatron-core's dist_checkpointing caches its save plan in the metadata (plain dataclasses
    # and an Enum of DCP's planner).
    "torch.distributed.checkpoint.planner": frozenset(
        {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}
    ),
    # Checkpoints written by torch < 2.2 name these classes by their old home.
    "torch.distributed._shard.sharded_tensor.metadata": frozenset({"TensorProperties"}),
    "torch.distributed._shard.metadata": frozenset({"ShardMetadata"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}
# pathlib paths (StorageMeta.checkpoint_id) become pure paths: no filesystem access, and a
# WindowsPath written on Windows still loads elsewhere.
_PATHS = {
    "PosixPath": pathlib.PurePosixPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "WindowsPath": pathlib.PureWindowsPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
    "Path": pathlib.PurePath,
    "PurePath": pathlib.PurePath,
}


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """A pickle names a class or function outside the allowlist; nothing of it was run."""

    def __init__(self, message: str) -> None:
        # The names come from the file: escape line breaks and control characters.
        if not message.isprintable():
            message = "".join(
                c if c.isprintable() else c.encode("unicode_escape").decode() for c in message
            )
        super().__init__(message)


def _torch_value(name: str) -> Any:
    """``torch.<name>`` when it is a dtype, layout or memory format (how torch pickles them)."""
    value = getattr(torch, name, None)
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    return None


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, file: io.BufferedIOBase, what: str, resolve: Callable[[str, str], Any] | None
    ) -> None:
        super().__init__(file)
        self._what = what
        self._resolve = resolve

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            if name == "Size":
                return torch.Size
            value = _torch_value(name)
            if value is not None:
                return value
        elif module == "torch.serialization" and name == "_get_layout":
            return _get_layout
        elif module in ("pathlib", "pathlib._local") and name in _PATHS:
            return _PATHS[name]
        elif name in ADMITTED.get(module, ()):
            if self._resolve is not None and module not in ("collections", "builtins"):
                return self._resolve(module, name)
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"{self._what} names {module}.{name}, which is not one of the classes a checkpoint's "
            "metadata is made of; refusing to load it (nothing from the file was run)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._what} holds a persistent reference; refusing to load it")


def _get_layout(name: str) -> torch.layout:
    """Torch's layout lookup by name (``torch.strided``), checked: only a layout comes back."""
    value = _torch_value(str(name).removeprefix("torch."))
    if not isinstance(value, torch.layout):
        raise UnsafePickleError(f"{name!r} is not a torch layout")
    return value


def restricted_loads(
    data: bytes, what: str, resolve: Callable[[str, str], Any] | None = None
) -> Any:
    """Unpickles `data` admitting only DCP metadata and plain data.

    Admitted: DCP's metadata classes, torch dtypes/layouts/memory formats, ``torch.Size``, pure
    paths, DCP's enums and plain containers.

    Args:
        data: The pickle.
        what: The file it came from, for messages (e.g. ``"DCP metadata ckpt/.metadata"``).
        resolve: Builds an admitted DCP class from (module, name) instead of importing it (the
            mirror classes of ``fsdpcheck.sources.dcp_metadata``). Called only for admitted
            names: the allowlist is the same either way.

    Raises:
        UnsafePickleError: It names anything else (one line naming module.class and `what`).
        pickle.UnpicklingError: It is not a valid pickle.
    """
    return _Unpickler(io.BytesIO(data), what, resolve).load()
