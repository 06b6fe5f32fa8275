"""A checkpoint opened by every rank of a job, its ``.metadata`` read and checked by one.

NOTE: [metadata once per job] Opening a DCP checkpoint parses ``.metadata`` and checks it
(chunks tiling every tensor, a stat of every data file): at 50,000 keys ~3.4 s, and on 16,384
ranks 16,384 parses of one file on one shared filesystem. So rank 0 opens and checks; one
broadcast then carries, for each DCP directory it opened, the sha256 of the bytes it parsed and
what its check found (nothing, for a sound checkpoint: ~100 bytes whatever the world size). The
other ranks open the same reference with those verdicts (``dcp.trusting``): a rank whose
``.metadata`` bytes hash the same skips the check and reports rank 0's findings as its own;
one whose bytes differ checks itself. Every rank thus reaches the same verdict. A failure on
rank 0 travels in the same broadcast: every rank raises the same one-line error, and none
waits for another.
"""

from __future__ import annotations

from typing import Any

from fsdpcheck.collectives import Comm
from fsdpcheck.errors import REGISTRY, describe_error, type_name
from fsdpcheck.sources import Source, open_source

__all__ = ["open_checked"]

#: Bytes of verdict sent with the broadcast's size word: a sound checkpoint's (a digest per
#: DCP directory) fits, so opening costs one broadcast; a longer one (findings) takes a second.
_INLINE = 504


def open_checked(comm: Comm, reference: Any) -> Source:
    """Opens `reference` on every rank, its DCP metadata checked by rank 0 alone.

    Collective: every rank calls it (one broadcast, also when nothing is DCP), and the
    broadcast is made before anything raises, so a failure anywhere never leaves a rank
    waiting in it.

    Raises:
        What opening raised on rank 0 (the same type and one line on every rank), or on this
        rank.
    """
    if not comm.enabled or comm.world == 1:
        return open_source(reference)
    from fsdpcheck.sources.dcp import trusting

    source: Source | None = None
    said: Any = None
    if comm.rank == 0:
        try:
            with trusting() as verdicts:
                source = open_source(reference)
            said = ("ok", verdicts.taken())
        except Exception as exc:  # it travels: every rank raises it after the broadcast
            said = ("failed", (type_name(exc), describe_error(exc)))
    said = comm.broadcast_object(said, 0, "opening the checkpoint", inline=_INLINE)
    status, what = said
    if status == "failed":
        if source is not None:
            source.close()
        kind, message = what
        raise REGISTRY.get(kind, RuntimeError)(message)
    if source is not None:
        return source
    with trusting(what):
        return open_source(reference)
