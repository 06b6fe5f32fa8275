"""Several checkpoints read as one (e.g. accelerate's model and optimizer directories)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fsdpcheck.sources.base import Entry, Problem, Region, Source


class MergedSource(Source):
    """The union of several sources' entries; each read goes to the source that holds the key."""

    def __init__(self, sources: Sequence[Source], description: str | None = None) -> None:
        self.sources = list(sources)
        self.kind = "+".join(s.kind for s in self.sources)
        self.description = description or " + ".join(s.description for s in self.sources)
        self.is_sharded = any(s.is_sharded for s in self.sources)
        self.in_memory = any(s.in_memory for s in self.sources)
        self._owner: dict[str, Source] = {}
        self._entries: dict[str, Entry] = {}
        for s in self.sources:
            for key, e in s.entries().items():
                if key in self._entries:
                    raise ValueError(f"{key!r} is in both {self._owner[key].description} and "
                                     f"{s.description}")  # fmt: skip
                self._owner[key] = s
                self._entries[key] = e

    def parts(self) -> list[Source]:
        """Every source read as one (merged sources inside are flattened)."""
        return [p for s in self.sources for p in s.parts()]

    def entries(self) -> dict[str, Entry]:
        """Every entry of every source."""
        return self._entries

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Each source reads its own regions (one call per source)."""
        result: list[torch.Tensor | None] = [None] * len(regions)
        for s in self.sources:
            idx = [i for i, r in enumerate(regions) if self._owner[r.key] is s]
            if not idx:
                continue
            got = s.read([regions[i] for i in idx], device,
                         [out[i] for i in idx] if out is not None else None)  # fmt: skip
            for i, t in zip(idx, got):
                result[i] = t
        return [t for t in result if t is not None]

    def read_objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """Each source reads its own objects."""
        out: dict[str, Any] = {}
        for s in self.sources:
            mine = [k for k in keys if self._owner[k] is s]
            if mine:
                out.update(s.read_objects(mine))
        return out

    def read_object(self, key: str) -> Any:
        """One non-tensor entry."""
        return self._owner[key].read_object(key)

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Saved chunks of a key, from the source that holds it."""
        return self._owner[key].chunks(key)

    def problems(self) -> list[Problem]:
        """Every source's problems."""
        return [p for s in self.sources for p in s.problems()]

    def requires_grad(self, key: str) -> bool | None:
        """From the source that holds the key."""
        owner = self._owner.get(key)
        return owner.requires_grad(key) if owner is not None else None

    def close(self) -> None:
        """Closes every source."""
        for s in self.sources:
            s.close()
