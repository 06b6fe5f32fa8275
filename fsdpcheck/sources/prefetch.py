"""Reading the next batch while the kernel runs on this one (double buffering, CPU and GPU).

NOTE: [prefetch] Offline commands alternate two steps: read a batch of reference regions, run
one fused kernel over it. Done in turn, the machine either reads or computes. `Prefetcher` keeps
two batches in flight: while the caller's kernel runs on batch k, worker threads read batch k+1
(byte-range reads into the other of two page-aligned host arenas, page faults of mapped files
taken there instead of in the kernel; the parts of one batch, e.g. the two checkpoints of a
compare, are read in parallel). Batch k+2 reuses batch k's arena, so it is only started once
the caller has asked for the next batch: a batch's tensors are valid until then (when reads
fall behind, batches k+1 and k+2 are read at once). Batch 1 is started once batch 0 is in, so
that the first read, which nothing overlaps, has the readers to itself. Each batch should hold
at most half the memory budget.

With a CUDA device the host arenas are page-locked and each batch is copied to one of two
device arenas on a side stream; the caller's stream waits for that copy (an event), not the
host, so the copy of batch k+1 overlaps the kernel on batch k. A device arena is written again
only after the kernel that read it (an event recorded on the caller's stream when it asked for
the next batch), and a host arena only after its copy to the device finished.
"""

from __future__ import annotations

import collections
from collections.abc import Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from fsdpcheck.readplan import Arena
from fsdpcheck.sources.base import Region, Source

#: Bytes per batch when the budget allows more. Each batch costs a hand-over between threads,
#: a parallel region and Python bookkeeping: measured on 2 cores (1.3 GB DCP fingerprint, warm)
#: 32 MiB batches took 0.27 s, 128 MiB 0.24 s, 256 MiB 0.24 s. The first batch is read before
#: any kernel runs, yet a smaller first batch (8 MiB, doubling) measured no faster cold and
#: slower warm. Two batches in flight hold 256 MiB of arena at most (only regions that are
#: copied use it; mapped ones are views).
STEP = 128 << 20


def batch_bytes(budget: int) -> int:
    """Bytes per batch under a memory budget: two batches are in flight."""
    return max(1, min(budget // 2, STEP))


#: One read of a batch: a source and the regions to read from it.
Part = tuple[Source, Sequence[Region]]


class Prefetcher:
    """Runs batches of reads ahead of the caller (see NOTE: [prefetch]).

    Args:
        device: Where the caller's kernel runs; tensors are handed over there.
        workers: Reader threads (a batch's parts are read in parallel).
        cuda: The CUDA module to use (tests pass a stand-in; default ``torch.cuda``).
    """

    def __init__(self, device: torch.device, *, workers: int = 2, cuda: Any = None) -> None:
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self._host = [Arena(pin=on_gpu and cuda is None), Arena(pin=on_gpu and cuda is None)]
        self._stage = _DeviceStage(self.device, cuda or torch.cuda) if on_gpu else None
        self._workers = workers
        self._parts: dict[int, list[Part]] = {}

    def run(
        self, batches: Iterable[tuple[Any, Sequence[Part]]]
    ) -> Generator[tuple[Any, list[list[torch.Tensor]]], None, None]:
        """Yields ``(tag, tensors per part)`` for each ``(tag, parts)``, in order.

        The tensors of a batch are valid until the next one is asked for. An error while
        reading is raised here, at the batch it belongs to, after the other reads in flight
        have stopped writing.
        """
        pool = ThreadPoolExecutor(self._workers, thread_name_prefix="fsdpcheck-read")
        pending: collections.deque[tuple[Any, int, list[Future[list[torch.Tensor]]]]] = (
            collections.deque()
        )
        it = iter(batches)
        try:
            nxt = next(it, None)
            if nxt is not None:
                pending.append(self._submit(pool, nxt, 0))
            second = True
            while pending:
                tag, s, futures = pending.popleft()
                parts = [f.result() for f in futures]
                if second:
                    # The second batch starts once the first is in, not with it: the first has
                    # the readers (and, on few cores, the CPU) to itself, and the caller's
                    # first kernel then overlaps the second read.
                    second = False
                    nxt = next(it, None)
                    if nxt is not None:
                        pending.append(self._submit(pool, nxt, 1))
                if self._stage is not None:
                    parts = self._stage.to_device(parts, s)
                yield tag, parts
                if self._stage is not None:
                    self._stage.release(s)
                # The caller has used the batch: a view of a file truncated meanwhile read
                # zeros (NOTE: [mapped-file guard]); its source names the file here.
                for src in {id(p[0]): p[0] for p in self._parts.pop(s, [])}.values():
                    src.check_views()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(self._submit(pool, nxt, s))
        finally:
            # Nothing may still be writing into an arena once the caller moves on.
            for _, _, futures in pending:
                for f in futures:
                    f.cancel()
            pool.shutdown(wait=True)

    def _submit(
        self, pool: ThreadPoolExecutor, batch: tuple[Any, Sequence[Part]], slot: int
    ) -> tuple[Any, int, list[Future[list[torch.Tensor]]]]:
        tag, parts = batch
        self._parts[slot] = list(parts)
        if self._stage is not None:
            self._stage.host_free(slot)
        specs = [
            (tuple(r.size), _dtype(src, r)) for src, regions in parts for r in regions
        ]  # one carve for the whole batch, split per part
        outs = self._host[slot].carve(torch.device("cpu"), specs)
        futures = []
        k = 0
        for src, regions in parts:
            mine = outs[k : k + len(regions)]
            k += len(regions)
            futures.append(pool.submit(_read, src, list(regions), mine, self._stage is not None))
        return tag, slot, futures


def _dtype(source: Source, region: Region) -> torch.dtype:
    dtype = source.entries()[region.key].dtype
    assert dtype is not None
    return dtype


def _read(
    source: Source, regions: list[Region], out: list[torch.Tensor], staged: bool
) -> list[torch.Tensor]:
    got = source.read_views(regions, out)
    if staged:
        # Copies to the GPU go from page-locked memory: a view of a mapped file (the source
        # returned data where it lies) is first copied into this batch's pinned arena.
        got = [o if t.data_ptr() == o.data_ptr() else o.copy_(t) for t, o in zip(got, out)]
        source.check_views()  # the copy read the views
    return got


class _DeviceStage:
    """Host arena -> device arena copies on a side stream, ordered by events (two slots)."""

    def __init__(self, device: torch.device, cuda: Any) -> None:
        self.device, self.cuda = device, cuda
        self.stream = cuda.Stream(device=device)
        self.arenas = [Arena(), Arena()]
        self.copied: list[Any] = [None, None]  # event: the host arena's copy has finished
        self.consumed: list[Any] = [None, None]  # event: the kernel reading the device arena

    def host_free(self, slot: int) -> None:
        """Blocks until the host arena `slot` may be overwritten (its copy has finished)."""
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()
            self.copied[slot] = None

    def to_device(self, parts: list[list[torch.Tensor]], slot: int) -> list[list[torch.Tensor]]:
        flat = [t for p in parts for t in p]
        dev = self.arenas[slot].carve(self.device, [(tuple(t.shape), t.dtype) for t in flat])
        if self.consumed[slot] is not None:
            self.stream.wait_event(self.consumed[slot])  # the last kernel on it has read it
        with self.cuda.stream(self.stream):
            for d, h in zip(dev, flat):
                d.copy_(h, non_blocking=True)
            done = self.cuda.Event()
            done.record(self.stream)
        self.cuda.current_stream(self.device).wait_event(done)
        self.copied[slot] = done
        out, k = [], 0
        for p in parts:
            out.append(dev[k : k + len(p)])
            k += len(p)
        return out

    def release(self, slot: int) -> None:
        """The caller is done with the batch in `slot`: its kernels were queued before now."""
        ev = self.cuda.Event()
        ev.record(self.cuda.current_stream(self.device))
        self.consumed[slot] = ev
