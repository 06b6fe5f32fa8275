"""Safetensors in an object store, read by byte ranges (NOTE: [object storage] in remote).

`RemoteSafetensorsSource` is `SafetensorsSource` with its files in a store: the same header
parser and checks (the file sizes come from the listing; a header that claims more than the
limit or the object holds is refused from its first 8 bytes, before it is fetched), the same
authority of the index. Reads are the rows each region spans, every region of a batch in
flight at once, each straight into its destination.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fsdpcheck.sources.base import Region
from fsdpcheck.sources.full import into
from fsdpcheck.sources.index_json import MAX_INDEX_BYTES, parse_index
from fsdpcheck.sources.rawio import writable_view
from fsdpcheck.sources.remote import (
    ObjectFile,
    RemotePath,
    object_size,
    open_object,
    read_small,
)
from fsdpcheck.sources.safetensors_files import SafetensorsSource, _Header

__all__ = ["RemoteSafetensorsSource"]

#: Bytes fetched with a file's 8-byte header size: most headers fit, so one request reads both.
_HEAD = 64 << 10


class RemoteSafetensorsSource(SafetensorsSource):
    """Safetensors files under a prefix of an object store (see the module docstring)."""

    def __init__(
        self,
        files: Sequence[Any],
        description: str,
        weight_map: dict[str, str] | None = None,
        root: Any = None,
    ) -> None:
        self._objects: dict[RemotePath, ObjectFile] = {}
        super().__init__(files, description, weight_map, root)
        self.mapped_reads = False  # nothing to map

    @classmethod
    def from_remote(cls, path: RemotePath) -> RemoteSafetensorsSource:
        """A .safetensors object, an index .json, or a prefix holding them.

        Raises:
            FileNotFoundError: Nothing is there, or a prefix holds no safetensors.
            CheckpointError: A file is unreadable or refused (see `SafetensorsSource`).
        """
        path.store.refresh(path.key)
        path.store.refresh(path.parent.key)
        info = path.info()
        if info is None:
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        if info.is_dir:
            names = path.listing()
            index = sorted(n for n in names if n.endswith(".safetensors.index.json"))
            if index:
                return cls.from_remote(path / index[0])
            files = sorted(
                path / n for n, i in names.items() if n.endswith(".safetensors") and not i.is_dir
            )
            if not files:
                raise FileNotFoundError(f"{path} holds no .safetensors files")
            return cls(files, f"safetensors files in {path}")
        if path.name.endswith(".json"):
            data = read_small(path, MAX_INDEX_BYTES, "safetensors index")
            weight_map = parse_index(data, path, "safetensors index")
            return cls([], f"safetensors index {path}", weight_map, path.parent)
        return cls([path], f"safetensors file {path}")

    def _object(self, f: Any) -> ObjectFile:
        got = self._objects.get(f)
        if got is None:
            got = self._objects[f] = open_object(f, "safetensors file")
        return got

    def _header(self, f: Any) -> _Header:
        obj = self._object(f)
        head = ObjectFile(obj.path, obj.info)  # holds the first bytes for the parse only
        head.hold(0, obj.pread(min(obj.size, _HEAD), 0))
        return _Header(f, head, obj.size)

    def _file_problem(self, root: Any, name: str, what: str) -> str | None:
        return object_size(root, name, what)[0]

    def _fetch(
        self, regions: Sequence[Region], outs: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        plans = [self._copy_plan(r, o) for r, o in zip(regions, outs)]
        jobs = []
        for f, offset, buf, _ in plans:
            obj = self._object(f)
            jobs.append((obj.path.key, obj.info, offset, writable_view(buf)))
        if jobs:
            self._object(plans[0][0]).path.store.read_many(jobs)
        return [finish() for _, _, _, finish in plans]

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Each region by byte range (every region of the call at once)."""
        self._refuse(regions)
        cpu = device.type == "cpu"
        outs = [out[i] if out is not None and cpu else None for i in range(len(regions))]
        got = self._fetch(regions, outs)
        return [
            t
            if out is not None and t is out[i]
            else into(t, out[i] if out is not None else None, device)
            for i, t in enumerate(got)
        ]

    def read_views(
        self, regions: Sequence[Region], out: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """`read` into the batch's buffers (nothing is mapped)."""
        self._refuse(regions)
        got = self._fetch(regions, list(out))
        return [t if t is o else o.copy_(t) for t, o in zip(got, out)]
