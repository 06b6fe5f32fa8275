"""A checkpoint opened by every rank of a job, its ``.metadata`` read and checked by one.

NOTE: [metadata once per job] Opening a DCP checkpoint parses ``.metadata`` and checks it
(chunks tiling every tensor, a stat of every data file): at 50,000 keys ~3.4 s, and on 16,384
ranks 16,384 parses of one file on one shared filesystem. So rank 0 opens and checks; one
broadcast then carries, for each DCP directory it opened, the sha256 of the bytes it parsed and
what its check found (nothing, for a sound checkpoint: ~100 bytes whatever the world size). The
other ranks open the same reference with those verdicts (``open_source(..., trust=)``): a rank
whose ``.metadata`` bytes hash the same skips the check and reports rank 0's findings as its
own; one whose bytes differ checks itself. Every rank thus reaches the same verdict. A failure
on rank 0 travels in the same broadcast: every rank raises it (the same ``RankFailure``, as every
rank's error), and none waits for another. A failure on another rank is that rank's, agreed at
the call's next agreement (``dist.runner``).
"""

from __future__ import annotations

from typing import Any

from fsdpcheck.dist.runner import Call, RankFailure, failed_everywhere
from fsdpcheck.reading.references import open_source
from fsdpcheck.sources import Source

__all__ = ["open_checked"]

#: Bytes of verdict sent with the broadcast's size word: a sound checkpoint's (a digest per
#: DCP directory) fits, so opening costs one broadcast; a longer one (findings) takes a second.
_INLINE = 504


def open_checked(call: Call, reference: Any, step: str = "opening the reference") -> Source | None:
    """Opens `reference` on every rank, its DCP metadata checked by rank 0 alone.

    Collective: every rank calls it (one broadcast, also when nothing is DCP, and also on a
    rank that failed before: the broadcast is part of the call's protocol).

    Returns:
        The source, or None where opening failed on this rank (the call holds the failure for
        its next agreement).

    Raises:
        RankFailure: On every rank, when opening failed on rank 0.
    """
    from fsdpcheck.sources.dcp.source import Verdicts

    comm = call.comm
    if not comm.enabled or comm.world == 1:
        return call.local(step, lambda: open_source(reference))
    opened: list[Source] = []
    said: Any = None
    if comm.rank == 0:
        verdicts = Verdicts()

        def first() -> Any:
            opened.append(open_source(reference, trust=verdicts))
            return ("ok", verdicts.taken())

        said = call.local(step, first)
        if said is None:  # it travels: every rank raises it after the broadcast
            said = ("failed", call.take_failure())
    said = comm.broadcast_object(said, 0, step, inline=_INLINE)
    status, what = said
    if status == "failed":
        for s in opened:
            s.close()
        raise RankFailure(failed_everywhere(tuple(what), comm.world))
    if opened:
        return opened[0]
    return call.local(step, lambda: open_source(reference, trust=Verdicts(what)))
