"""A torch.distributed.checkpoint (DCP) directory, read chunk by chunk without a process group."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from fsdpcheck.sources.base import Entry, Region, Source


def is_dcp_dir(path: Path) -> bool:
    """Whether `path` is a DCP checkpoint directory."""
    return path.is_dir() and (path / ".metadata").is_file()


class DCPSource(Source):
    """Reads boxes of a DCP checkpoint.

    Each rank builds read items for exactly the saved chunks that overlap the boxes it asks for
    and hands them to DCP's own storage reader, which loads each of those chunks and copies the
    overlap straight into the destination (on the model's device). No process group is needed.
    """

    kind = "dcp"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.description = f"DCP checkpoint {self.path}"
        self._reader = FileSystemReader(str(self.path))
        self._md = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self._md, is_coordinator=True)
        planner_data = self._md.planner_data if isinstance(self._md.planner_data, dict) else {}
        self._entries: dict[str, Entry] = {}
        # Per tensor key: chunk offsets -> sizes, for the common case of a region that is
        # exactly one saved chunk (a reload with the layout it was saved with).
        self._chunk_at: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
        for key, meta in self._md.state_dict_metadata.items():
            raw = planner_data.get(key)
            path_t = tuple(str(p) for p in raw) if raw else (key,)
            if isinstance(meta, TensorStorageMetadata):
                self._entries[key] = Entry(
                    key, path_t, tuple(meta.size), meta.properties.dtype, is_tensor=True
                )
                self._chunk_at[key] = {tuple(c.offsets): tuple(c.sizes) for c in meta.chunks}
            elif isinstance(meta, BytesStorageMetadata):
                self._entries[key] = Entry(key, path_t, is_tensor=False)

    def entries(self) -> dict[str, Entry]:
        """Every key of the checkpoint's metadata."""
        return self._entries

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of each saved chunk of a tensor entry."""
        meta = self._md.state_dict_metadata[key]
        assert isinstance(meta, TensorStorageMetadata)
        return [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Reads the regions through DCP's storage reader (only overlapping chunks)."""
        dests = []
        items: list[ReadItem] = []
        for i, region in enumerate(regions):
            entry = self._entries[region.key]
            if out is not None:
                dests.append(out[i])
            else:
                dests.append(torch.empty(region.size, dtype=entry.dtype, device=device))
            if region.numel == 0:
                continue
            if self._chunk_at[region.key].get(region.offset) == region.size:
                chunks = [(region.offset, region.size)]  # exactly one saved chunk
            else:
                chunks = self.chunks(region.key)
            for c_off, c_size in chunks:
                lo = [max(a, b) for a, b in zip(region.offset, c_off)]
                hi = [
                    min(a + s, b + t)
                    for a, s, b, t in zip(region.offset, region.size, c_off, c_size)
                ]
                if any(h <= low for low, h in zip(lo, hi)):
                    continue  # no overlap (empty chunks included)
                items.append(
                    ReadItem(
                        type=LoadItemType.TENSOR,
                        dest_index=MetadataIndex(str(i), torch.Size(region.offset)),
                        dest_offsets=torch.Size(a - b for a, b in zip(lo, region.offset)),
                        storage_index=MetadataIndex(region.key, torch.Size(c_off)),
                        storage_offsets=torch.Size(a - b for a, b in zip(lo, c_off)),
                        lengths=torch.Size(h - low for low, h in zip(lo, hi)),
                    )
                )
        if items:
            self._run(items, _Planner(dests))
        return dests

    def read_object(self, key: str) -> Any:
        """A non-tensor entry (e.g. a param_groups hyperparameter)."""
        return self.read_objects([key])[key]

    def read_objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """Several non-tensor entries, in one pass over the storage."""
        for key in keys:
            if key not in self._entries or self._entries[key].is_tensor:
                raise KeyError(key)
        planner = _Planner([])
        items = [
            ReadItem(
                type=LoadItemType.BYTE_IO,
                dest_index=MetadataIndex(key),
                dest_offsets=torch.Size(()),
                storage_index=MetadataIndex(key),
                storage_offsets=torch.Size(()),
                lengths=torch.Size(()),
            )
            for key in keys
        ]
        if items:
            self._run(items, planner)
        return planner.objects

    def _run(self, items: list[ReadItem], planner: _Planner) -> None:
        plan = self._reader.prepare_local_plan(LoadPlan(items))
        plan = self._reader.prepare_global_plan([plan])[0]
        self._reader.read_data(plan, planner).wait()  # type: ignore[arg-type]


class _Planner:
    """The part of a LoadPlanner that DCP's storage reader calls: where each item goes."""

    def __init__(self, dests: list[torch.Tensor]) -> None:
        self.dests = dests
        self.objects: dict[str, Any] = {}

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        t = self.dests[int(item.dest_index.fqn)]
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        del item, tensor  # copied in place by the reader

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        value.seek(0)
        self.objects[item.dest_index.fqn] = torch.load(value, weights_only=True)
