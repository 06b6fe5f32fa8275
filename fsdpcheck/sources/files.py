"""Full-tensor checkpoints: torch.save files (memory-mapped) and safetensors (sliced reads)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.sources.base import Entry, Region, Source, nested_entries, read_each, slices

TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class TorchSaveSource(Source):
    """A torch.save file: loaded with mmap=True, so only the boxes that are read leave the disk.

    Nested layouts are accepted (``{"model": ..., "optimizer": ...}``, ``{"state_dict": ...}``);
    the nesting becomes the entries' paths.
    """

    kind = "torch.save"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.description = f"torch.save file {self.path}"
        try:
            obj = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            # Files written with _use_new_zipfile_serialization=False cannot be mapped.
            obj = torch.load(self.path, map_location="cpu", weights_only=True)
        flat: dict[str, tuple[tuple[str, ...], Any]] = {}
        nested_entries(obj, (), flat)
        self._values: dict[str, Any] = {}
        self._entries: dict[str, Entry] = {}
        for key, (path_t, value) in flat.items():
            self._values[key] = value
            if isinstance(value, torch.Tensor):
                self._entries[key] = Entry(key, path_t, tuple(value.shape), value.dtype)
            else:
                self._entries[key] = Entry(key, path_t, is_tensor=False)

    def entries(self) -> dict[str, Entry]:
        """Every leaf of the saved object."""
        return self._entries

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Slices of the mapped tensors, copied to `device` (only their pages are read)."""

        def fetch(r: Region) -> torch.Tensor:
            return self._values[r.key][slices(r)] if r.size else self._values[r.key]

        return read_each(regions, device, out, fetch)

    def read_object(self, key: str) -> Any:
        """A non-tensor leaf."""
        return self._values[key]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsSource(Source):
    """One or more .safetensors files (a file, a HF ``*.safetensors.index.json``, or a folder).

    Boxes are read with ``get_slice``, which reads just those bytes.
    """

    kind = "safetensors"

    def __init__(self, files: Sequence[Path], description: str) -> None:
        from safetensors import safe_open

        self.description = description
        self._handles = {f: safe_open(str(f), framework="pt", device="cpu") for f in files}
        self._file_of: dict[str, Path] = {}
        self._entries: dict[str, Entry] = {}
        for f, h in self._handles.items():
            for key in h.keys():  # noqa: SIM118 - safe_open handles are not mappings
                sl = h.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                self._file_of[key] = f
                self._entries[key] = Entry(key, tuple(key.split(".")), tuple(sl.get_shape()), dtype)

    @classmethod
    def from_path(cls, path: Path) -> SafetensorsSource:
        """A .safetensors file, an index .json, or a folder of .safetensors files."""
        if path.is_dir():
            index = sorted(path.glob("*.safetensors.index.json"))
            if index:
                return cls.from_path(index[0])
            files = sorted(path.glob("*.safetensors"))
            return cls(files, f"safetensors files in {path}")
        if path.suffix == ".json":
            weight_map = json.loads(path.read_text())["weight_map"]
            files = sorted({path.parent / f for f in weight_map.values()})
            return cls(files, f"safetensors index {path}")
        return cls([path], f"safetensors file {path}")

    def entries(self) -> dict[str, Entry]:
        """Every tensor of every file."""
        return self._entries

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Each region read with get_slice (only its bytes), then moved to `device`."""

        def fetch(r: Region) -> torch.Tensor:
            h = self._handles[self._file_of[r.key]]
            return h.get_slice(r.key)[slices(r)] if r.size else h.get_tensor(r.key)

        return read_each(regions, device, out, fetch)
