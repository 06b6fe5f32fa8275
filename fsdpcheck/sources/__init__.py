"""Reference readers: DCP directory, torch.save file, safetensors, in-memory.

A checkpoint path is opened part by part (``reading.references.open_source``), each by the
reader its layout named when it recognised the path (``formats.base.Part``; the readers,
``formats.readers``). The file readers are imported when a part of their kind is opened: the DCP
reader pulls in torch.distributed.checkpoint (about a second of start-up), which a safetensors
compare or ``fsdpcheck inspect`` of a file never needs. Nothing here imports ``formats/``,
which imports the reader modules below this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fsdpcheck.errors import CheckpointError
from fsdpcheck.sources.base import Entry, Region, Source
from fsdpcheck.sources.merged import MergedSource
from fsdpcheck.sources.remote import RemotePath

if TYPE_CHECKING:
    from fsdpcheck.sources.dcp.source import DCPSource

__all__ = [
    "Entry",
    "MergedSource",
    "Region",
    "Source",
    "checkpoint_notes",
    "open_dcp",
    "refuse_problems",
]


def checkpoint_notes(source: Source) -> list[str]:
    """The notes of the recognised checkpoint(s) a source reads (what is not read, ...)."""
    out: list[str] = []
    for part in source.parts():
        for note in part.checkpoint.notes if part.checkpoint is not None else []:
            if note not in out:
                out.append(note)
    return out


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
