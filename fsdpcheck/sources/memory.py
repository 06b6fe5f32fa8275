"""An in-memory reference: a mapping of full tensors (possibly nested) or a full nn.Module."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdpcheck._compat import tensor_kind_problem
from fsdpcheck.layout import strides_problem
from fsdpcheck.sources.base import Entry, Problem, Region, Source, slices
from fsdpcheck.sources.full import nested_entries


class MemorySource(Source):
    """Full tensors on any device; boxes are views, copied only when on another device."""

    kind = "memory"
    in_memory = True

    def __init__(self, obj: Mapping[str, Any] | torch.nn.Module) -> None:
        self._requires_grad: dict[str, bool] = {}
        if isinstance(obj, torch.nn.Module):
            self.description = f"in-memory {type(obj).__name__}"
            self._requires_grad = {n: p.requires_grad for n, p in obj.named_parameters()}
            obj = obj.state_dict(keep_vars=True)
        else:
            self.description = "in-memory state dict"
        flat: dict[str, tuple[tuple[str, ...], Any]] = {}
        nested_entries(dict(obj), (), flat)
        self._values: dict[str, Any] = {}
        self._entries: dict[str, Entry] = {}
        self._problems: list[Problem] = []
        for key, (path, value) in flat.items():
            if isinstance(value, torch.Tensor):
                kind = tensor_kind_problem(value, quantized=False) or strides_problem(value)
                if kind is not None:
                    self._problems.append((key, "error", f"{self.description}: {key} is {kind}"))
                    shape = (value.size(0),) if value.is_nested else tuple(value.shape)
                    self._entries[key] = Entry(key, path, shape, value.dtype)
                    self._values[key] = value
                    continue
                value = value.detach()
                self._entries[key] = Entry(key, path, tuple(value.shape), value.dtype)
            else:
                self._entries[key] = Entry(key, path, is_tensor=False)
            self._values[key] = value

    def entries(self) -> dict[str, Entry]:
        """Every leaf of the mapping."""
        return self._entries

    def problems(self) -> list[Problem]:
        """Tensors whose elements cannot be read as a dense array (sparse, nested, meta ...)."""
        return self._problems

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Views of the reference; a copy of just the box when it lives on another device."""
        result = []
        for i, r in enumerate(regions):
            t = self._values[r.key]
            if r.size:
                t = t[slices(r)]
            if t.device == device:
                result.append(t)  # read in place: no copy at all
            else:
                result.append(out[i].copy_(t) if out is not None else t.to(device))
        return result

    def read_object(self, key: str) -> Any:
        """A non-tensor leaf."""
        return self._values[key]

    def requires_grad(self, key: str) -> bool | None:
        """requires_grad of a parameter of the nn.Module this was built from (else None)."""
        return self._requires_grad.get(key)
