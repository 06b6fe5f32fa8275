"""Reference readers: DCP directory, torch.save file, safetensors, in-memory.

A checkpoint path is opened part by part, each by the reader its layout named when it
recognised the path (``formats.base.Part``; the readers, ``formats.readers``). The file readers
are imported when a part of their kind is opened: the DCP reader pulls in
torch.distributed.checkpoint (about a second of start-up), which a safetensors compare or
``fsdpcheck inspect`` of a file never needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fsdpcheck.errors import CheckpointError
from fsdpcheck.sources.base import Entry, Region, Source
from fsdpcheck.sources.memory import MemorySource
from fsdpcheck.sources.merged import MergedSource
from fsdpcheck.sources.remote import RemotePath

if TYPE_CHECKING:
    from fsdpcheck.formats import CheckpointInfo
    from fsdpcheck.sources.dcp.source import DCPSource, Verdicts

__all__ = [
    "Entry",
    "MergedSource",
    "Region",
    "Source",
    "checkpoint_notes",
    "open_dcp",
    "open_info",
    "open_part",
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
    # NOTE: imported here, not at the top: the layouts read their storage kinds' file names from
    # the reader modules below this package (formats/hf_storage.py, formats/ds_universal.py),
    # so the formats are imported after this package, not during it.
    from fsdpcheck.formats import describe_path

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
    """Part `index` of a recognised checkpoint, opened by the reader its layout named.

    The source knows its checkpoint and its role (its key grammar). `trust`: as for
    `open_source` (DCP directories only).
    """
    part = info.parts[index]
    source = part.reader(part.path, trust=trust)
    source.checkpoint, source.role = info, part.role
    return source


def open_dcp(path: Path | RemotePath) -> DCPSource:
    """A DCP directory, local or in an object store."""
    if isinstance(path, RemotePath):
        from fsdpcheck.sources.dcp.remote import RemoteDCPSource

        return RemoteDCPSource(path)
    from fsdpcheck.sources.dcp.source import DCPSource

    return DCPSource(path)


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
