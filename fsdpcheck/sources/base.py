"""What every reference reader provides: entries with structural paths, and box reads."""

from __future__ import annotations

import math
import os
import reprlib
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch

# CheckpointError and CoverageError live in fsdpcheck.errors; readers import them from here too.
from fsdpcheck.errors import CheckpointError as CheckpointError
from fsdpcheck.errors import CoverageError as CoverageError
from fsdpcheck.errors import shown

if TYPE_CHECKING:
    from fsdpcheck.formats.base import CheckpointInfo

#: A storage problem found when opening a source: (key, kind, message); kind is "gap" (a region
#: of a tensor that no saved chunk covers) or "error" (anything else that makes data unreadable
#: or ambiguous). The key is "*" when the problem is not about one key.
Problem = tuple[str, str, str]


def printable(text: str) -> str:
    """`text` with line breaks and other control characters made visible (``errors.shown``)."""
    return shown(text)


def check_regular(path: str | os.PathLike[str], what: str = "file") -> Path:
    """`path`, after checking that it is a regular file (symlinks to regular files are fine).

    Called before every open of a checkpoint file: opening a FIFO blocks forever and a device
    (``/dev/zero``) never ends, so both are refused by their type, without opening them.

    Raises:
        FileNotFoundError: It does not exist.
        CheckpointError: It is a directory, FIFO, socket or device.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {p} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a directory" if stat.S_ISDIR(st.st_mode)
            else "a FIFO" if stat.S_ISFIFO(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "not a regular file"
        )  # fmt: skip
        raise CheckpointError(f"{what} {p} is {kind}, not a regular file; refusing to read it")
    return p


def relative_path_problem(root: Path, rel: str) -> str | None:
    """Why a path a checkpoint names may not be opened (outside the checkpoint), or None."""
    pure = PurePosixPath(rel)
    if not pure.parts or rel in (".", "./"):
        return f"names {rel!r}, which is not a file"
    if pure.is_absolute() or rel.startswith("\\") or ":" in pure.parts[0]:
        return f"names the absolute path {rel!r}"
    if ".." in pure.parts or "\\" in rel:
        return f"names {rel!r}, outside the checkpoint directory"
    real_root = root.resolve()
    target = (root / rel).resolve()
    if target != real_root and real_root not in target.parents:
        return f"names {rel!r}, a link that leads outside the checkpoint directory"
    return None


def file_problem(root: Path, rel: str, end: int, what: str) -> str | None:
    """Why bytes ``[.., end)`` of `rel` under `root` cannot be read (one line), or None."""
    bad = relative_path_problem(root, rel)
    if bad is not None:
        return f"{what} {bad}"
    try:
        size = check_regular(root / rel, "data file").stat().st_size
    except (FileNotFoundError, CheckpointError) as exc:
        return f"{what}: {exc}"
    if end > size:
        return f"{what} ends at byte {end} of {rel} but the file has {size} bytes (truncated?)"
    return None


def one_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (libraries' messages can span many)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text[:300] + (" ..." if len(lines) > 1 or len(text) > 300 else "")


@dataclass(frozen=True)
class Entry:
    """One entry of a reference checkpoint.

    Attributes:
        key: The checkpoint's own key (what its files call it).
        path: The key as a structural path, e.g. ``("model", "layers.0.w")`` or
            ``("optim", "state", "layers.0.w", "exp_avg")``; used to tell model, optimizer state
            and param_groups entries apart without guessing at dots inside FQNs.
        shape: Global shape (tensors only).
        dtype: Dtype (tensors only).
        is_tensor: False for non-tensor objects (hyperparameters, lists).
    """

    key: str
    path: tuple[str, ...]
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    is_tensor: bool = True


@dataclass(frozen=True)
class Region:
    """A box of a reference tensor to read: per-dim offset and size."""

    key: str
    offset: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the region."""
        return math.prod(self.size)


class Source(ABC):
    """A reference checkpoint, read box by box.

    The whole protocol lives here, with defaults for sources of full tensors, so callers never
    probe a source with ``getattr``: `entries`, `read`, `read_object(s)`, `chunks`, `problems`,
    `is_sharded`, `requires_grad` and `close`.

    Contract for broken input: `entries` lists every key the checkpoint declares (with the shape
    and dtype it declares, where those are known); `problems` lists what was found wrong with
    the storage when opening; a `read` that touches a region named by a problem raises
    `CheckpointError` (`CoverageError` for a gap) and never returns uninitialised or ambiguous
    data.
    """

    #: "dcp", "torch.save", "safetensors" or "memory".
    kind: str = ""
    #: Where it came from, for messages.
    description: str = ""
    #: Whether tensors are stored as chunks (DCP): then `chunks` lists them.
    is_sharded: bool = False
    #: Whether the tensors are already in memory (on any device): reads are views or device
    #: copies, with nothing to read ahead, and staging them through host buffers would only
    #: add copies.
    in_memory: bool = False
    #: The recognised checkpoint this source reads (or a part of it), set by ``open_source``:
    #: its layout decides the key grammar. None for in-memory references.
    checkpoint: CheckpointInfo | None = None
    #: What this part holds: "model", "optimizer", "adapter" or "any" (read by its structure).
    role: str = "any"

    def parts(self) -> list[Source]:
        """The sources this one reads as one (itself, unless it merges several)."""
        return [self]

    @abstractmethod
    def entries(self) -> dict[str, Entry]:
        """Every entry, by the checkpoint's key."""

    @abstractmethod
    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The regions' values on `device`, each of shape ``region.size``, in the entry's dtype.

        Implementations read only what overlaps the regions (as far as the format allows). With
        `out` (one preallocated tensor per region, of that shape and dtype), they fill and return
        those; a source may instead return views of data already on `device`.
        """

    def read_object(self, key: str) -> Any:
        """A non-tensor entry's value."""
        raise KeyError(key)

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of each saved chunk of a tensor entry, as declared by the storage.

        Sources of full tensors store one chunk: the whole tensor. DCP lists its saved chunks
        (empty ones included; they may leave gaps or overlap, which `problems` reports).
        """
        shape = self.entries()[key].shape
        return [((0,) * len(shape), tuple(shape))]

    def problems(self) -> list[Problem]:
        """Storage problems found when opening: ``(key, kind, message)``, kind "gap" or "error".

        Gaps, overlaps and chunks outside the shape, storage entries pointing past the end of a
        file, missing or non-regular files, index entries naming files outside the folder or
        tensors their file lacks, duplicated tensors, unsupported dtypes. Empty when the
        storage is whole. Reads of what a problem names raise instead of returning data.
        """
        return []

    def requires_grad(self, key: str) -> bool | None:
        """Whether the entry is a parameter that requires grad, or None when not recorded.

        Only an in-memory nn.Module records it reliably (DCP stores a flag, but state_dict()
        detaches tensors, so it is False whatever the model had).
        """
        del key
        return None

    def read_objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """Several non-tensor entries (sources that can batch the reads override this)."""
        return {k: self.read_object(k) for k in keys}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases files (optional)."""


def into(value: torch.Tensor, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """`value` copied into `out` when given, else to `device` (a copy only if needed)."""
    if out is not None:
        return out.copy_(value)
    return value.to(device, copy=value.device.type == "cpu" and device.type == "cpu")


def read_each(
    regions: Sequence[Region],
    device: torch.device,
    out: Sequence[torch.Tensor] | None,
    fetch: Callable[[Region], torch.Tensor],
) -> list[torch.Tensor]:
    """Source.read for sources that fetch one region at a time (on the CPU)."""
    return [
        into(fetch(r), out[i] if out is not None else None, device) for i, r in enumerate(regions)
    ]


def slices(region: Region) -> tuple[slice, ...]:
    """Index expression of a region."""
    return tuple(slice(o, o + s) for o, s in zip(region.offset, region.size))


# Values read from a file appear in messages and key names only through `show_value`: a
# bounded depth and length, so a self-referencing, million-deep or exponentially shared
# structure cannot make a message huge, recurse or never finish.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def show_value(value: Any) -> str:
    """A short repr of a value read from a file (see `_REPR`)."""
    try:
        return _REPR.repr(value)
    except Exception:  # a repr that fails (or recurses) still gets named
        return f"<{type(value).__name__}>"


def _key_text(k: Any) -> str:
    """A dict key as a path component: names and numbers as written, anything else bounded."""
    if k is None or isinstance(k, (str, int, float)):
        return str(k)
    return show_value(k)


def nested_entries(
    obj: Any,
    path: tuple[str, ...],
    out: dict[str, tuple[tuple[str, ...], Any]],
    collisions: set[str] | None = None,
) -> None:
    """Flattens nested dicts/lists of a loaded state dict into ``{dotted key: (path, value)}``.

    Lists of non-tensors (e.g. ``params`` in param_groups) stay one value; lists holding tensors
    are walked. Two leaves whose dotted keys are the same (``{"a.b": x}`` and
    ``{"a": {"b": y}}``) are never merged silently: the key goes into `collisions` (the first
    leaf stays in `out`), or, without `collisions`, a ValueError names it.
    """
    if isinstance(obj, dict):
        for k, v in obj.items():
            nested_entries(v, (*path, _key_text(k)), out, collisions)
    elif isinstance(obj, (list, tuple)) and any(
        isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj
    ):
        for i, v in enumerate(obj):
            nested_entries(v, (*path, str(i)), out, collisions)
    else:
        key = ".".join(path)
        if key in out:
            if collisions is None:
                raise ValueError(f"two entries flatten to the same key {key!r}")
            collisions.add(key)
            return
        out[key] = (path, obj)
