"""Reference readers: DCP directory, torch.save file, safetensors, in-memory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.sources.base import Entry, Region, Source
from fsdpcheck.sources.dcp import DCPSource, is_dcp_dir
from fsdpcheck.sources.files import TORCH_SAVE_SUFFIXES, SafetensorsSource, TorchSaveSource
from fsdpcheck.sources.memory import MemorySource
from fsdpcheck.sources.merged import MergedSource

__all__ = [
    "Entry",
    "MergedSource",
    "Region",
    "Source",
    "accelerate_dirs",
    "accelerate_parts",
    "open_source",
]


# What accelerate's save_state writes for model / optimizer i: sharded (a DCP directory) or full
# (a file). {s} is "" for i == 0, else "_i".
_ACCELERATE_MODEL = ("pytorch_model_fsdp_{i}", "pytorch_model_fsdp{s}.bin",
                     "model{s}.safetensors", "pytorch_model{s}.bin")  # fmt: skip
_ACCELERATE_OPTIM = ("optimizer_{i}", "optimizer_{i}.bin", "optimizer{s}.bin")


def accelerate_parts(path: Path, index: int = 0) -> tuple[Path | None, Path | None]:
    """(model, optimizer) checkpoint of model/optimizer `index` in a save_state directory."""
    suffix = "" if index == 0 else f"_{index}"

    def first(patterns: tuple[str, ...]) -> Path | None:
        for pat in patterns:
            p = path / pat.format(i=index, s=suffix)
            if is_dcp_dir(p) or p.is_file():
                return p
        return None

    return first(_ACCELERATE_MODEL), first(_ACCELERATE_OPTIM)


def accelerate_dirs(path: Path, index: int = 0) -> list[Path]:
    """The sharded (DCP) model and optimizer directories of an accelerate save_state dir."""
    return [p for p in accelerate_parts(path, index) if p is not None and is_dcp_dir(p)]


def open_source(reference: Any) -> Source:
    """Opens a reference of any supported kind.

    Args:
        reference: A DCP checkpoint directory; an accelerate save_state directory (its sharded
            model and optimizer directories, read as one); a torch.save file (.pt/.pth/.bin); a
            .safetensors file, a ``*.safetensors.index.json`` or a directory of them; a directory
            holding exactly one torch.save file; a mapping of full tensors; a full nn.Module;
            or a list/tuple of any of these, read as one (their keys must not collide).

    Returns:
        The Source.

    Raises:
        FileNotFoundError: The path does not exist.
        ValueError: The path is of no recognised kind.
    """
    if isinstance(reference, Source):
        return reference
    if isinstance(reference, (Mapping, torch.nn.Module)):
        return MemorySource(reference)
    if isinstance(reference, (list, tuple)):
        parts = [open_source(r) for r in reference]
        return parts[0] if len(parts) == 1 else MergedSource(parts)
    if not isinstance(reference, (str, Path)):
        raise TypeError(
            f"reference must be a path, a mapping of tensors or an nn.Module, not "
            f"{type(reference).__name__}"
        )
    path = Path(reference)
    if not path.exists():
        raise FileNotFoundError(f"reference checkpoint {path} does not exist")
    if is_dcp_dir(path):
        return DCPSource(path)
    model, optim = accelerate_parts(path) if path.is_dir() else (None, None)
    if model is not None:
        parts = [open_source(p) for p in (model, optim) if p is not None]
        return MergedSource(parts, f"accelerate save_state directory {path}")
    if path.is_dir():
        if list(path.glob("*.safetensors")) or list(path.glob("*.safetensors.index.json")):
            return SafetensorsSource.from_path(path)
        saved = [p for p in sorted(path.iterdir()) if p.suffix in TORCH_SAVE_SUFFIXES]
        if len(saved) == 1:
            return TorchSaveSource(saved[0])
        raise ValueError(
            f"{path} is a directory but not a DCP checkpoint (no .metadata), holds no "
            f"safetensors, and holds {len(saved)} torch.save files; pass one file or a DCP dir"
        )
    if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        return SafetensorsSource.from_path(path)
    return TorchSaveSource(path)
