"""The `Source` contract: what every reference reader provides.

Entries with structural paths, and box reads, in the `Entry` and `Region` it speaks in. How files
are opened safely is ``sources.fileio``; messages, ``sources.text``; helpers for sources of full
tensors, ``sources.full``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fsdpcheck.formats.base import CheckpointInfo

#: A storage problem found when opening a source: (key, kind, message); kind is "gap" (a region
#: of a tensor that no saved chunk covers) or "error" (anything else that makes data unreadable
#: or ambiguous). The key is "*" when the problem is not about one key.
Problem = tuple[str, str, str]


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


def slices(region: Region) -> tuple[slice, ...]:
    """Index expression of a region."""
    return tuple(slice(o, o + s) for o, s in zip(region.offset, region.size))
