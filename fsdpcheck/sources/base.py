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


def _kind(mode: int) -> str:
    return (
        "a directory" if stat.S_ISDIR(mode)
        else "a FIFO" if stat.S_ISFIFO(mode)
        else "a socket" if stat.S_ISSOCK(mode)
        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )  # fmt: skip


def _refused(p: Path, what: str, mode: int) -> CheckpointError:
    return CheckpointError(f"{what} {p} is {_kind(mode)}, not a regular file; refusing to read it")


def check_regular(path: str | os.PathLike[str], what: str = "file") -> Path:
    """`path`, after checking that it is a regular file (symlinks to regular files are fine).

    A check by path, for messages and for what is not opened here; reads open with
    `open_regular`, which checks what it opened.

    Raises:
        FileNotFoundError: It does not exist.
        PermissionError: A folder on the way may not be searched.
        CheckpointError: It is a directory, FIFO, socket or device.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {p} does not exist") from None
    except PermissionError:
        raise PermissionError(f"{what} {p}: permission denied") from None
    except (ValueError, OSError) as exc:  # a NUL byte, a name too long, ...
        raise CheckpointError(f"{what} {p!r:.200} cannot be opened: {one_line(exc)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refused(p, what, st.st_mode)
    return p


#: How every checkpoint file is opened: a FIFO opens at once instead of waiting for a writer,
#: a terminal never becomes the controlling one, and the descriptor is not inherited.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


def open_regular(path: str | os.PathLike[str], what: str = "file") -> tuple[int, os.stat_result]:
    """An open descriptor of `path` and its ``fstat``, refused unless it is a regular file.

    NOTE: [open by what it is] A check of the path and then an open of it is a race: the file
    can be replaced by a FIFO (the open blocks forever) or a link to ``/dev/zero`` (never ends)
    in between. So the file is opened non-blocking and what was opened is checked
    (``fstat`` on the descriptor); only a regular file is kept. Obvious cases are refused by
    path first, so that a device is not even opened.

    Raises:
        FileNotFoundError: It does not exist.
        PermissionError: It may not be read ("permission denied", naming it).
        CheckpointError: It is a directory, FIFO, socket or device.
    """
    p = Path(path)
    check_regular(p, what)
    try:
        fd = os.open(p, _OPEN_FLAGS)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {p} does not exist") from None
    except PermissionError:
        raise PermissionError(f"{what} {p}: permission denied") from None
    except OSError as exc:  # a socket (ENXIO), a file that became something else
        try:
            mode = os.stat(p).st_mode
        except OSError:
            mode = 0
        if mode and not stat.S_ISREG(mode):
            raise _refused(p, what, mode) from None
        raise CheckpointError(f"{what} {p} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refused(p, what, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def relative_path_problem(root: Path, rel: str, real_root: Path | None = None) -> str | None:
    """Why a path a checkpoint names may not be opened (outside the checkpoint), or None.

    `real_root` is ``root.resolve()`` when the caller has it (checks of many files).
    """
    if "\x00" in rel:
        return f"names {rel!r}, which holds a NUL byte (no file can)"
    pure = PurePosixPath(rel)
    if not pure.parts or rel in (".", "./"):
        return f"names {rel!r}, which is not a file"
    if pure.is_absolute() or rel.startswith("\\") or ":" in pure.parts[0]:
        return f"names the absolute path {rel!r}"
    if ".." in pure.parts or "\\" in rel:
        return f"names {rel!r}, outside the checkpoint directory"
    if len(pure.parts) == 1 and not os.path.islink(root / rel):
        return None  # a plain name in the folder (the common case: no resolving needed)
    real_root = real_root or root.resolve()
    target = (root / rel).resolve()
    if target != real_root and real_root not in target.parents:
        return f"names {rel!r}, a link that leads outside the checkpoint directory"
    return None


def file_size(
    root: Path, rel: str, what: str, real_root: Path | None = None
) -> tuple[str | None, int]:
    """(why `rel` under `root` cannot be read at all, or None; its size in bytes)."""
    bad = relative_path_problem(root, rel, real_root)
    if bad is not None:
        return f"{what} {bad}", 0
    try:
        fd, st = open_regular(root / rel, "data file")
    except (FileNotFoundError, PermissionError, CheckpointError) as exc:
        return f"{what}: {exc}", 0
    os.close(fd)
    return None, st.st_size


def past_the_end(what: str, end: int, rel: str, size: int) -> str:
    """The one line for bytes that end past the end of their file."""
    return f"{what} ends at byte {end} of {rel} but the file has {size} bytes (truncated?)"


def file_problem(root: Path, rel: str, end: int, what: str) -> str | None:
    """Why bytes ``[.., end)`` of `rel` under `root` cannot be read (one line), or None."""
    why, size = file_size(root, rel, what)
    if why is None and end > size:
        why = past_the_end(what, end, rel, size)
    return why


def one_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (libraries' messages can span many)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text[:300] + (" ..." if len(lines) > 1 or len(text) > 300 else "")


@dataclass(frozen=True, slots=True)  # slots: a million keys, ~80 bytes each
class Entry:
    """One entry of a reference checkpoint.

    Attributes:
        key: The checkpoint's own key (what its files call it).
        path: The key as a structural path, e.g. ``("model", "layers.0.w")`` or
            ``("optim", "state", "layers.0.w", "exp_avg")``; used to tell model, optimizer state
            and param_groups entries apart without guessing at dots inside FQNs. Empty for a
            format with no nesting (safetensors), whose key is its one component.
        shape: Global shape (tensors only).
        dtype: Dtype (tensors only).
        is_tensor: False for non-tensor objects (hyperparameters, lists).
    """

    key: str
    path: tuple[str, ...]
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    is_tensor: bool = True


@dataclass(frozen=True, slots=True)  # slots: a batch holds thousands
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
    #: Whether its keys are single names with dots inside (safetensors), which the key model
    #: reads as they are, never as nested paths.
    flat_names: bool = False
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

    def chunks_overlapping(
        self, key: str, offset: Sequence[int], size: Sequence[int]
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The saved chunks of `key` that share an element with the box (`offset`, `size`).

        In the order `chunks` lists them; empty chunks never overlap. Sources of full tensors
        have one chunk. DCP answers in O(log n + hits) where the chunks form a grid (stacked
        along one dim, 2-d grids: what sharded saves write), so a caller that cuts its local
        pieces along the saved chunks does not intersect every piece with every chunk.
        """
        box = (tuple(offset), tuple(size))
        return [c for c in self.chunks(key) if boxes_meet(c, box)]

    def chunk_count(self, key: str) -> int:
        """How many chunks `chunks(key)` lists (without listing them)."""
        return len(self.chunks(key))

    def coverage(self, key: str) -> list[str]:
        """What keeps the saved chunks of `key` from tiling its shape exactly ([]: nothing).

        Each item starts with "gap at" or "overlap at" (see ``tiling.tiling_problems``).
        """
        from fsdpcheck.sources.tiling import tiling_problems

        shape = self.entries()[key].shape
        if not math.prod(shape):
            return []
        live = [b for b in self.chunks(key) if all(s > 0 for s in b[1]) or not shape]
        return tiling_problems(shape, live)

    def read_views(
        self, regions: Sequence[Region], out: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """`read` to the CPU, where the source may hand over views of mapped files.

        For a caller that calls `check_views` after it has used each batch (the read-ahead
        does, after the kernel): until then a view may read zeros where its file was
        truncated (NOTE: [mapped-file guard]). `read` itself never returns such views.
        """
        return self.read(regions, torch.device("cpu"), out)

    def check_views(self) -> None:  # noqa: B027 - optional hook
        """Raises CheckpointError if a file changed under views `read_views` handed out.

        Names the file ("changed while it was read"); the values read from it must not be
        used.
        """

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

    def share_names(self, other: Source) -> None:  # noqa: B027 - optional hook
        """Holds the keys `other` holds too as `other`'s string objects (optional).

        For a caller that keeps two sources of the same model open (compare): their names are
        then kept once, not once per side.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases files (optional)."""


def boxes_meet(
    a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]
) -> bool:
    """Whether two boxes (offsets, sizes) of the same rank share an element (0-d: always)."""
    return len(a[0]) == len(b[0]) and all(
        s > 0 and t > 0 and max(x, y) < min(x + s, y + t)
        for x, s, y, t in zip(a[0], a[1], b[0], b[1])
    )


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
