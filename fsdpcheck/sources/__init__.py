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

__all__ = ["Entry", "Region", "Source", "open_source"]


def open_source(reference: Any) -> Source:
    """Opens a reference of any supported kind.

    Args:
        reference: A DCP checkpoint directory; a torch.save file (.pt/.pth/.bin/.ckpt); a
            .safetensors file, a ``*.safetensors.index.json`` or a directory of them; a directory
            holding exactly one torch.save file; a mapping of full tensors; or a full nn.Module.

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
