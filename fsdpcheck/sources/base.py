"""What every reference reader provides: entries with structural paths, and box reads."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


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
    """A reference checkpoint, read box by box."""

    #: "dcp", "torch.save", "safetensors" or "memory".
    kind: str = ""
    #: Where it came from, for messages.
    description: str = ""

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


def nested_entries(obj: Any, path: tuple[str, ...], out: dict[str, tuple[tuple[str, ...], Any]]):
    """Flattens nested dicts/lists of a loaded state dict into ``{dotted key: (path, value)}``.

    Lists of non-tensors (e.g. ``params`` in param_groups) stay one value; lists holding tensors
    are walked.
    """
    if isinstance(obj, dict):
        for k, v in obj.items():
            nested_entries(v, (*path, str(k)), out)
    elif isinstance(obj, (list, tuple)) and any(
        isinstance(v, (torch.Tensor, dict, list, tuple)) for v in obj
    ):
        for i, v in enumerate(obj):
            nested_entries(v, (*path, str(i)), out)
    else:
        out[".".join(path)] = (path, obj)
