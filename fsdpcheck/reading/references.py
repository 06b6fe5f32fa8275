"""A reference opened as one `Source`: a checkpoint path through its layout, part by part.

A path is recognised (``formats.describe_path``) and each of its parts opened by the reader its
layout named (``formats.base.Part``); a mapping of tensors or a module is read in memory; a list
of references is read as one. This sits above both ``formats/`` and ``sources/``: the layouts
import the reader modules, and opening a path needs the layouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fsdpcheck.formats import describe_path
from fsdpcheck.sources.base import Source
from fsdpcheck.sources.memory import MemorySource
from fsdpcheck.sources.merged import MergedSource
from fsdpcheck.sources.remote import RemotePath

if TYPE_CHECKING:
    from fsdpcheck.formats import CheckpointInfo
    from fsdpcheck.sources.dcp.source import Verdicts

__all__ = ["open_info", "open_part", "open_source"]


def open_source(reference: Any, *, trust: Verdicts | None = None) -> Source:
    """Opens a reference of any supported kind.

    Args:
        reference: A checkpoint path or URL of any layout ``fsdpcheck.describe_path`` recognises
            (DCP directory, fsdpcheck.save, torchtitan step folder, accelerate save_state directory,
            Lightning, Hugging Face folder or index, DeepSpeed, megatron-core, torch.save file,
            safetensors); a mapping of full tensors; a full nn.Module; or a list/tuple of any of
            these, read as one (their keys must not collide).
        trust: The verdicts of another process's check, which the DCP directories opened take
            in order, or an empty ``Verdicts`` that records this process's
            (``fsdpcheck.opening``: the metadata checked once per job).

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
        parts: list[Source] = []
        try:
            for r in reference:
                parts.append(open_source(r, trust=trust))
        except BaseException:
            for s in parts:
                s.close()
            raise
        return parts[0] if len(parts) == 1 else MergedSource(parts)
    if not isinstance(reference, (str, Path, RemotePath)):
        raise TypeError(
            f"reference must be a path, a mapping of tensors or an nn.Module, not "
            f"{type(reference).__name__}"
        )
    return open_info(describe_path(reference), trust=trust)


def open_info(info: CheckpointInfo, *, trust: Verdicts | None = None) -> Source:
    """Opens every part of a recognised checkpoint, as one source."""
    sources: list[Source] = []
    try:
        for i in range(len(info.parts)):
            sources.append(open_part(info, i, trust=trust))
    except BaseException:
        for s in sources:
            s.close()
        raise
    if len(sources) == 1:
        return sources[0]
    return MergedSource(sources, info.description)


def open_part(info: CheckpointInfo, index: int, *, trust: Verdicts | None = None) -> Source:
    """Part `index` of a recognised checkpoint, opened by the reader its layout named.

    The source knows its checkpoint and its role (its key grammar). `trust`: as for
    `open_source` (DCP directories only).
    """
    part = info.parts[index]
    source = part.reader(part.path, trust=trust)
    source.checkpoint, source.role = info, part.role
    return source
