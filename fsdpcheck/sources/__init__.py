"""Reference readers: DCP directory, torch.save file, safetensors, in-memory.

The file readers are imported when a path of their kind is opened: the DCP reader pulls in
torch.distributed.checkpoint (about a second of start-up), which a safetensors compare or
``fsdpcheck inspect`` of a file never needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fsdpcheck.errors import CheckpointError
from fsdpcheck.formats import CheckpointInfo, describe_path
from fsdpcheck.formats.ds_universal import is_universal_zero
from fsdpcheck.sources.base import Entry, Region, Source
from fsdpcheck.sources.memory import MemorySource
from fsdpcheck.sources.merged import MergedSource
from fsdpcheck.sources.remote import RemotePath

if TYPE_CHECKING:
    from fsdpcheck.sources.dcp import DCPSource, Verdicts

__all__ = [
    "Entry",
    "MergedSource",
    "Region",
    "Source",
    "checkpoint_notes",
    "open_dcp",
    "open_info",
    "open_part",
    "open_path",
    "open_source",
    "refuse_problems",
]


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


def checkpoint_notes(source: Source) -> list[str]:
    """The notes of the recognised checkpoint(s) a source reads (what is not read, ...)."""
    out: list[str] = []
    for part in source.parts():
        for note in part.checkpoint.notes if part.checkpoint is not None else []:
            if note not in out:
                out.append(note)
    return out


def open_part(info: CheckpointInfo, index: int, *, trust: Verdicts | None = None) -> Source:
    """Part `index` of a recognised checkpoint, knowing its layout and role (its key grammar)."""
    source = open_path(info.parts[index], trust=trust)
    source.checkpoint, source.role = info, info.roles[index]
    return source


def open_path(path: Path | RemotePath, *, trust: Verdicts | None = None) -> Source:
    """One part of a checkpoint: a DCP directory, a safetensors file or index, a torch.save file.

    Also a ``*.bin.index.json``, and torch's HuggingFaceStorageWriter shards (a folder or a file).
    In an object store (a `RemotePath`): a DCP directory or safetensors. `trust`: as for
    `open_source` (DCP directories only).
    """
    if isinstance(path, RemotePath):
        return open_remote(path, trust=trust)
    from fsdpcheck.sources import bin_index, hf_storage

    if hf_storage.holds_shards(path):
        return hf_storage.HFStorageSource(path)
    if bin_index.is_bin_index(path):
        return bin_index.BinIndexSource(path)
    if is_universal_zero(path):
        from fsdpcheck.sources.ds_universal import UniversalZeroSource

        return UniversalZeroSource(path)
    if path.is_dir():
        from fsdpcheck.sources.dcp import DCPSource

        return DCPSource(path, verdicts=trust)
    from fsdpcheck.sources.files import SafetensorsSource, TorchSaveSource

    if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        return SafetensorsSource.from_path(path)
    return TorchSaveSource(path)


def open_dcp(path: Path | RemotePath) -> DCPSource:
    """A DCP directory, local or in an object store."""
    if isinstance(path, RemotePath):
        from fsdpcheck.sources.remote_dcp import RemoteDCPSource

        return RemoteDCPSource(path)
    from fsdpcheck.sources.dcp import DCPSource

    return DCPSource(path)


def open_remote(path: RemotePath, *, trust: Verdicts | None = None) -> Source:
    """A DCP directory or safetensors in an object store (NOTE: [object storage] in remote)."""
    if path.name.endswith((".safetensors", ".json")) or ".metadata" not in path.listing():
        from fsdpcheck.sources.remote_files import RemoteSafetensorsSource

        return RemoteSafetensorsSource.from_remote(path)
    from fsdpcheck.sources.remote_dcp import RemoteDCPSource

    return RemoteDCPSource(path, verdicts=trust)


def refuse_problems(source: Source, where: object, action: str) -> None:
    """Raises CheckpointError (one line) when the source's storage has problems.

    For the commands that need every tensor whole (fingerprint, load); the others report each
    problem as a finding instead.

    Args:
        source: The opened checkpoint.
        where: What to name in the message (a path, or the source's description).
        action: What is refused, e.g. "load it: nothing was loaded".
    """
    problems = list(dict.fromkeys(source.problems()))  # a problem may be listed twice
    if problems:
        key, kind, message = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(
            f"{where}: {kind} in {key}: {message}{more}; refusing to {action} (fsdpcheck audit "
            "lists every problem)"
        )
