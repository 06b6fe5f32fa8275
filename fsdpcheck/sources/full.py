"""Helpers for sources of full tensors (torch.save, safetensors, memory).

A loaded state dict flattened into entries, and regions copied out of whole tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdpcheck.sources.base import Region
from fsdpcheck.sources.text import show_value


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
