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

With a CUDA device the host arenas are page-locked and each part of a batch is copied to one of
two device arenas on a side stream, queued by the reader thread that read it as soon as it is
read: the copy of batch k+1 runs while the caller's kernels on batch k do (the caller's host waits
once per batch for results, NOTE: [one read-back] in kernels.py, and queues nothing meanwhile).
The caller's stream waits for those copies (events), not the host. A host arena is written again
only after its copy to the device finished.

NOTE: [stream order] The side stream writes device memory that the caller's stream allocated, so
it must be ordered after the caller's work on that memory. Two waits do it, both queued on the
side stream by the caller's thread before the copies into the arena: (1) the kernels that read
the arena's previous batch (an event recorded on the caller's stream when it asked for the next
batch); (2) when the arena is (re)allocated, everything queued on the caller's stream until then.
The caching allocator hands a stream memory freed by that stream's queued kernels at once (safe
for work on that stream alone): after `opt.step()`, a new arena may be memory the optimizer's
kernels still use, and an unordered copy would corrupt the update or the comparison, silently.
"""

from __future__ import annotations

import collections
from collections.abc import Generator, Iterable, Iterator, Sequence
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


#: Regions per batch at most. NOTE: [regions per batch] A batch bounded by bytes alone can hold
#: a million regions of a few bytes each, and every region costs Python and torch objects while
#: its batch is in flight (a Region, a tensor or view per side, a row of results): measured
#: ~1.9 KB per region of a compare, 3.8 GB for the million 4-byte tensors of one safetensors
#: file. Beyond a few thousand regions a batch is no faster (per-batch costs are a thread
#: hand-over and one kernel call), so batches stop at this many regions as well.
MAX_REGIONS = 8192


def batch_bytes(budget: int) -> int:
    """Bytes per batch under a memory budget: two batches are in flight."""
    return max(1, min(budget // 2, STEP))


def batch_ranges(sizes: Sequence[int], items: range, step: int) -> Iterator[range]:
    """Consecutive runs of `items` of at most `step` bytes and `MAX_REGIONS` items each.

    Args:
        sizes: Bytes of every item of the plan (indexed by the items' numbers).
        items: The items to batch, in order.
        step: Bytes per batch (``batch_bytes``); an item larger than that is a batch alone.
    """
    first, held = items.start, 0
    for j in items:
        n = sizes[j]
        if j > first and (held + n > step or j - first >= MAX_REGIONS):
            yield range(first, j)
            first, held = j, 0
        held += n
    if first < items.stop:
        yield range(first, items.stop)


#: One read of a batch: a source and the regions to read from it.
Part = tuple[Source, Sequence[Region]]


class Prefetcher:
    """Runs batches of reads ahead of the caller (see NOTE: [prefetch]).

    Args:
        device: Where the caller's kernel runs; tensors are handed over there.
        workers: Reader threads (a batch's parts are read in parallel).
        cuda: The CUDA module to use (default ``torch.cuda`` for a CUDA device). Tests pass a
            stand-in that records the stream protocol: batches are then staged through it on
            any device.
    """

    def __init__(self, device: torch.device, *, workers: int = 2, cuda: Any = None) -> None:
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self._host = [Arena(pin=on_gpu and cuda is None), Arena(pin=on_gpu and cuda is None)]
        staged = on_gpu or cuda is not None
        self._stage = _DeviceStage(self.device, cuda or torch.cuda) if staged else None
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
                    self._stage.hand_over(s)
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
        specs = [
            (tuple(r.size), _dtype(src, r)) for src, regions in parts for r in regions
        ]  # one carve for the whole batch, split per part
        stage = self._stage
        if stage is not None:
            stage.host_free(slot)
        outs = self._host[slot].carve(torch.device("cpu"), specs)
        dev = stage.prepare(slot, specs) if stage is not None else outs
        futures = []
        k = 0
        for src, regions in parts:
            n = len(regions)
            futures.append(
                pool.submit(_read, src, list(regions), outs[k : k + n], stage, slot, dev[k : k + n])
            )
            k += n
        return tag, slot, futures


def _dtype(source: Source, region: Region) -> torch.dtype:
    dtype = source.entries()[region.key].dtype
    assert dtype is not None
    return dtype


def _read(
    source: Source,
    regions: list[Region],
    out: list[torch.Tensor],
    stage: _DeviceStage | None,
    slot: int,
    dev: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Reads a part of a batch on a reader thread; staged, also queues its copy to the device."""
    got = source.read_views(regions, out)
    if stage is None:
        return got
    # Copies to the GPU go from page-locked memory: a view of a mapped file (the source returned
    # data where it lies) is first copied into this batch's pinned arena.
    got = [o if t.data_ptr() == o.data_ptr() else o.copy_(t) for t, o in zip(got, out)]
    source.check_views()  # the copy read the views
    stage.copy(slot, got, dev)
    return dev


class _DeviceStage:
    """Host arena -> device arena copies on a side stream, ordered by events (two slots).

    The caller's thread calls ``host_free``, ``prepare``, ``hand_over`` and ``release``; reader
    threads call ``copy`` (NOTE: [stream order]).
    """

    def __init__(self, device: torch.device, cuda: Any) -> None:
        self.device, self.cuda = device, cuda
        self.stream = cuda.Stream(device=device)
        self.arenas = [Arena(), Arena()]
        # Per slot, an event per part: its copy has finished. Appended by the reader threads of
        # the slot's batch (list.append is atomic), read by the caller's thread once that
        # batch's reads are done.
        self.copied: list[list[Any]] = [[], []]
        self.consumed: list[Any] = [None, None]  # event: the kernels reading the device arena

    def host_free(self, slot: int) -> None:
        """Blocks until the host arena `slot` may be overwritten (its copies have finished)."""
        for ev in self.copied[slot]:
            ev.synchronize()
        self.copied[slot] = []

    def prepare(
        self, slot: int, specs: list[tuple[tuple[int, ...], torch.dtype]]
    ) -> list[torch.Tensor]:
        """The device tensors of the next batch in `slot`, the side stream ordered before them.

        Called on the caller's thread (its current stream is the caller's stream), before any
        copy into them is queued.
        """
        if self.consumed[slot] is not None:
            self.stream.wait_event(self.consumed[slot])  # the last kernels on it have read it
            self.consumed[slot] = None
        caller = self.cuda.current_stream(self.device)
        return self.arenas[slot].carve(
            self.device, specs, fresh=lambda: self.stream.wait_stream(caller)
        )

    def copy(self, slot: int, host: list[torch.Tensor], dev: list[torch.Tensor]) -> None:
        """Queues the copies of one part of a batch on the side stream (a reader thread)."""
        with self.cuda.stream(self.stream):
            for d, h in zip(dev, host):
                d.copy_(h, non_blocking=True)
            done = self.cuda.Event()
            done.record(self.stream)
        self.copied[slot].append(done)

    def hand_over(self, slot: int) -> None:
        """The caller's stream waits for the copies of the batch in `slot` (not the host)."""
        caller = self.cuda.current_stream(self.device)
        for ev in self.copied[slot]:
            caller.wait_event(ev)

    def release(self, slot: int) -> None:
        """The caller is done with the batch in `slot`: its kernels were queued before now."""
        ev = self.cuda.Event()
        ev.record(self.cuda.current_stream(self.device))
        self.consumed[slot] = ev
