"""What a DCP ``.metadata`` may name: no code from a checkpoint ever runs.

`admitted_global` is the allowlist the metadata reader (``fsdpcheck.sources.dcp.vm``, a
restricted pickle machine) resolves every global through: DCP's metadata classes (or
fsdpcheck's mirrors of them, NOTE: [DCP-free metadata] in ``fsdpcheck.sources.dcp.metadata``)
and plain data; every other global is refused.

Why not ``torch.load(weights_only=True)``: ``.metadata`` is a bare pickle (not a torch.save zip)
of DCP's own dataclasses, which torch's weights-only allowlist does not hold. The classes
admitted here are the ones a ``dcp.save`` writes (listed from the GLOBAL opcodes of real
metadata): constructing them runs only dataclass ``__init__``/``__setstate__`` code of torch,
never a callable named by the file.
"""

from __future__ import annotations

import collections
import enum
import io
import os
import pathlib
import pickle
import threading
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from fsdpcheck.errors import UnsafePickleError as UnsafePickleError

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
#: The admitted enum classes and their members' names.
#:
#: NOTE: [enum members by name] CPython 3.11.0-3.11.3 (Debian 12's ``python3`` is 3.11.2)
#: pickles an enum member as ``getattr(EnumClass, "NAME")`` (its ``Enum.__reduce_ex__``); the
#: versions before and after pickle it by value, ``EnumClass(value)``. A metadata file written
#: there names ``builtins.getattr``, which is admitted for exactly this: its first argument must
#: be one of these classes and its second one of that class's members' names; any other call of
#: it is refused. The names are listed here (not read from the class) because the planner's
#: enum is mirrored by an opaque record that has no members (NOTE: [DCP-free metadata]).
ENUM_MEMBERS: dict[tuple[str, str], frozenset[str]] = {
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): frozenset(
        {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"}
    ),
    ("torch.distributed.checkpoint.planner", "WriteItemType"): frozenset(
        {"TENSOR", "SHARD", "BYTE_IO"}
    ),
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


def _torch_value(name: str) -> Any:
    """``torch.<name>`` when it is a dtype, layout or memory format (how torch pickles them)."""
    value = getattr(torch, name, None)
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    return None


def admitted_global(
    module: str, name: str, what: str, resolve: Callable[[str, str], Any] | None = None
) -> Any:
    """The object a pickle's GLOBAL names, if the allowlist admits it.

    Admitted: DCP's metadata classes (or, with `resolve`, what it builds for them: the mirrors
    of ``fsdpcheck.sources.dcp.metadata``), torch dtypes/layouts/memory formats,
    ``torch.Size``, pure paths, DCP's enums and plain containers. The reader of DCP metadata
    (``fsdpcheck.sources.dcp.vm``) asks this for every global a file names.

    Raises:
        UnsafePickleError: Anything else (nothing is imported).
    """
    if module == "__builtin__":
        # Protocols 0-2 name the builtins by their Python 2 module (pickle's fix_imports maps
        # it back when loading): set, frozenset and getattr written by pickle.dump(protocol=2).
        module = "builtins"
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
    elif module == "builtins" and name == "getattr":
        return _EnumMember(what, resolve)
    elif name in ADMITTED.get(module, ()):
        if resolve is not None and module not in ("collections", "builtins"):
            return resolve(module, name)
        return _BUILTINS.get((module, name)) or pickle.Unpickler.find_class(_NO_FILE, module, name)
    raise UnsafePickleError(
        f"{what} names {module}.{name}, which is not one of the classes a checkpoint's "
        "metadata is made of; refusing to load it (nothing from the file was run)"
    )


class _EnumMember:
    """``builtins.getattr`` as a pickle may call it: an admitted enum's member, by name, only.

    See NOTE: [enum members by name]. Called by the pickle's REDUCE with the class (itself an
    admitted global, resolved as every other one) and the name; anything else is refused.
    """

    def __init__(self, what: str, resolve: Callable[[str, str], Any] | None) -> None:
        self.what, self.resolve = what, resolve
        self.classes: dict[int, tuple[str, str]] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.classes is None:  # the admitted enum classes, as this reader resolves them
            self.classes = {
                id(admitted_global(m, n, self.what, self.resolve)): (m, n) for m, n in ENUM_MEMBERS
            }
        cls: Any = args[0] if len(args) == 2 else None
        name: Any = args[1] if len(args) == 2 else None
        which = self.classes.get(id(cls)) if cls is not None else None
        if which is None or type(name) is not str or name not in ENUM_MEMBERS[which]:
            raise UnsafePickleError(
                f"{self.what} calls builtins.getattr on {_named(cls, args)}, which is not a "
                "member of one of the enums a checkpoint's metadata holds; refusing to load it "
                "(nothing from the file was run)"
            )
        if isinstance(cls, enum.EnumMeta):
            return cls[name]  # a member lookup: never an attribute of the class
        return cls(name)  # an opaque mirror of an enum (kept, never interpreted)


def _named(cls: Any, args: tuple[Any, ...]) -> str:
    """What a refused getattr call was given, in a few words (nothing from the file raw)."""
    if len(args) != 2:
        return f"{len(args)} argument(s)"
    what = getattr(cls, "__qualname__", None) if isinstance(cls, type) else None
    name = args[1]
    shown_name = repr(name)[:60] if isinstance(name, str) else type(name).__name__
    return f"({what or type(cls).__name__}, {shown_name})"


_BUILTINS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}
_NO_FILE = pickle.Unpickler(io.BytesIO(b""))


def _get_layout(name: str) -> torch.layout:
    """Torch's layout lookup by name (``torch.strided``), checked: only a layout comes back."""
    value = _torch_value(str(name).removeprefix("torch."))
    if not isinstance(value, torch.layout):
        raise UnsafePickleError(f"{name!r} is not a torch layout")
    return value


# C stack per byte of pickle. Each TUPLE1 opcode (one byte) nests a tuple one level deeper, and
# hashing a nested tuple (a dict key) recurses in C without Python's recursion check: measured,
# 100k levels fit in the 8 MiB main-thread stack and 200k do not (40-80 bytes a level), so a
# 2 MB hostile file would crash the process. 256 bytes per byte leaves a 3-6x margin.
# torch's weights-only unpickler (pure Python) builds tuples the same way and crashes alike.
_STACK_PER_BYTE = 256
_MIN_STACK, _MAX_STACK = 8 << 20, 16 << 30
# Pickles that cannot nest deeper than this much stack run on the caller's thread (any thread
# has at least 8 MiB on Linux): a DCP chunk's data.pkl is a few hundred bytes.
_INLINE_STACK = 2 << 20


def on_a_deep_stack(fn: Callable[[], Any], nbytes: int) -> Any:
    """fn() (unpickling `nbytes` of pickle) with a stack that holds any nesting they can build.

    Small pickles run here. Larger ones run on a thread whose stack is sized for them: address
    space reserved, not memory used (only the pages a deep structure touches are). Where such a
    thread cannot be started (a strict overcommit policy), fn runs here too.
    """
    if _STACK_PER_BYTE * nbytes <= _INLINE_STACK:
        return fn()
    size = min(max(_MIN_STACK, _STACK_PER_BYTE * nbytes), _MAX_STACK)
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # re-raised in the caller's thread
            out.append((False, exc))

    with _STACK_LOCK:  # the stack size is process-wide state: set it for this one thread only
        old = threading.stack_size()
        try:
            threading.stack_size(size)
            worker = threading.Thread(target=run, name="fsdpcheck-unpickle", daemon=True)
            worker.start()
        except (RuntimeError, ValueError, MemoryError):
            worker = None
        finally:
            threading.stack_size(old)
    if worker is None:
        return fn()
    worker.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


_STACK_LOCK = threading.Lock()


def pickle_bytes(f: str | os.PathLike[str] | bytes) -> int:
    """Bytes of pickle in a torch.save file or blob: its ``data.pkl`` records, or all of it.

    Read from the zip's central directory (the sizes torch's reader goes by); a file that is not
    a zip (the legacy format) is all pickle.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(f) if isinstance(f, bytes) else f) as z:
            return sum(i.file_size for i in z.infolist() if i.filename.endswith("data.pkl"))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError):
        return len(f) if isinstance(f, bytes) else os.stat(f).st_size


def load_weights_only(f: str | os.PathLike[str] | bytes, **kwargs: Any) -> Any:
    """``torch.load(f, weights_only=True, **kwargs)`` with a stack that fits its pickle's nesting.

    `f` is a path or the bytes of a torch.save blob. Raises what torch.load raises.
    """
    src = io.BytesIO(f) if isinstance(f, bytes) else f
    return on_a_deep_stack(lambda: torch.load(src, weights_only=True, **kwargs), pickle_bytes(f))
