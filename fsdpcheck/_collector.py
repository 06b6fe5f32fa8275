"""Python's cyclic garbage collector held off while an offline command builds its plan.

NOTE: [collector] Opening a checkpoint of 50,000 tensors makes a few million small objects
(metadata, entries, key rows, pairs, regions) that live until the command ends. Each of them
counts towards the collector's thresholds, and every full collection scans them all, plus the
million objects ``import torch`` leaves: measured on 2 cores, a DCP/DCP compare of 50,000 keys
spent 1.2-2 s of its 12-14 s (CPU) in collections that freed nothing; keys and pairing alone
went from 1.2 to 0.4 s without them. Nothing here makes reference cycles, so the collector is
paused for the call (reference counting still frees everything at once) and restored after,
whatever state the caller left it in.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Pauses cyclic garbage collection inside the block (if it was on), then restores it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
