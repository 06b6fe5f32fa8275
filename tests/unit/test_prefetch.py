"""The GPU read-ahead's stream protocol, on the CPU: a stand-in for torch.cuda records every
wait, event, copy, kernel and read-back, in order (NOTE: [prefetch], [stream order],
[one read-back]); and the pinned host buffers' size."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from fsdpcheck import kernels, ops
from fsdpcheck.sources import prefetch, rawio
from fsdpcheck.sources.base import Region
from fsdpcheck.sources.memory import MemorySource
from fsdpcheck.sources.prefetch import Prefetcher

CPU = torch.device("cpu")


class StandInCuda:
    """Records the stream/event protocol (tensors stay on the CPU). Thread-safe: reader threads
    queue copies. Each entry is (what, detail, thread): the reader thread's name, or "caller"."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any, str]] = []
        self._local = threading.local()
        self._ids = iter(range(1 << 30))
        fake = self

        class Event:
            def __init__(self) -> None:
                self.id = next(fake._ids)

            def record(self, stream: Any) -> None:
                fake.note("record", (self.id, stream.name))

            def synchronize(self) -> None:
                fake.note("sync", self.id)

        class Stream:
            def __init__(self, device: Any = None, name: str = "side") -> None:
                self.name = name

            def wait_event(self, ev: Any) -> None:
                fake.note("wait", (self.name, ev.id))

            def wait_stream(self, other: Any) -> None:
                fake.note("wait_stream", (self.name, other.name))

        self.Event, self.Stream = Event, Stream
        self.main = Stream(name="main")

    def note(self, what: str, detail: Any) -> None:
        name = threading.current_thread().name
        self.log.append((what, detail, name if name.startswith("fsdpcheck-read") else "caller"))

    def stream(self, s: Any) -> Any:
        fake = self

        class Ctx:
            def __enter__(self) -> None:
                fake._local.current = s
                fake.note("enter", s.name)

            def __exit__(self, *a: Any) -> None:
                fake._local.current = fake.main
                fake.note("exit", s.name)

        return Ctx()

    def current_stream(self, device: Any = None) -> Any:
        return getattr(self._local, "current", self.main)

    def where(self, what: str, detail: Any) -> list[int]:
        return [i for i, (w, d, _) in enumerate(self.log) if (w, d) == (what, detail)]


class Filled(MemorySource):
    """Reads fill the arena's tensors (as byte-range reads do), so reuse would show."""

    def read(self, regions: Any, device: Any, out: Any = None) -> list[torch.Tensor]:
        got = super().read(regions, device, None)
        return [o.copy_(g) for o, g in zip(out, got)] if out is not None else got


def test_copy_of_the_next_batch_is_queued_before_the_caller_waits_for_this_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two sources read in parallel (a compare of two checkpoints), five batches; batch 2 is
    larger, so slot 0's device arena is allocated again."""
    fake = StandInCuda()
    sizes = [16, 16, 64, 16, 16]
    values = {f"k{i}": torch.full((n,), float(i)) for i, n in enumerate(sizes)}
    src_a, src_b = Filled(values), Filled(values)

    real_copy = prefetch._DeviceStage.copy
    real_rows = ops.compare_rows
    real_to_host = kernels._to_host

    def copy(self: Any, slot: int, host: list[torch.Tensor], dev: list[torch.Tensor]) -> None:
        fake.note("copy", int(host[0][0]))
        real_copy(self, slot, host, dev)

    def compare_rows(actual: Any, *args: Any) -> torch.Tensor:
        fake.note("kernel", int(actual[0][0]))
        return real_rows(actual, *args)

    def to_host(tables: list[torch.Tensor]) -> list[torch.Tensor]:
        k = max(d for w, d, _ in fake.log if w == "kernel")
        # The host is about to wait for kernel k: the copy of batch k+1 must come without it.
        deadline = time.monotonic() + 60
        while k + 1 < len(sizes) and not fake.where("copy", k + 1):
            assert time.monotonic() < deadline, f"batch {k + 1} was not copied during kernel {k}"
            time.sleep(0.001)
        fake.note("readback", k)
        return real_to_host(tables)

    monkeypatch.setattr(prefetch._DeviceStage, "copy", copy)
    monkeypatch.setattr(ops, "compare_rows", compare_rows)
    monkeypatch.setattr(kernels, "_to_host", to_host)

    plan = (
        (i, [(src, [Region(f"k{i}", (0,), (n,))]) for src in (src_a, src_b)])
        for i, n in enumerate(sizes)
    )
    for tag, ((a,), (b,)) in Prefetcher(CPU, cuda=fake).run(plan):
        assert torch.equal(a, values[f"k{tag}"]) and torch.equal(b, a)
        # Two tolerance groups: two kernels, one read-back.
        diffs = kernels.compare_each(
            [a, a], [b, b], boxes=[None, None], settings=[(0.0, 0.0, True), (0.1, 0.0, False)]
        )
        assert [d.ok for d in diffs] == [True, True]

    log = fake.log
    records = {d[0]: (i, d[1]) for i, (w, d, _) in enumerate(log) if w == "record"}
    for k in range(len(sizes)):
        copies = fake.where("copy", k)
        kernels_k = fake.where("kernel", k)
        (readback,) = fake.where("readback", k)
        # Each part is copied by the reader thread that read it, inside the side stream, and its
        # event is recorded there.
        assert len(copies) == 2
        done = []
        for c in copies:
            reader = log[c][2]
            assert reader.startswith("fsdpcheck-read")
            mine = [(i, w, d) for i, (w, d, who) in enumerate(log) if who == reader and i > c]
            assert [(w, d if w != "record" else d[1]) for _, w, d in mine[:3]] == [
                ("enter", "side"),
                ("record", "side"),
                ("exit", "side"),
            ]
            done.append(mine[1][2][0])
        # The caller's stream (not the host) waits for both copies, then the kernels run, then
        # one read-back; the copy of the next batch was queued before that read-back.
        waits = [fake.where("wait", ("main", ev))[0] for ev in done]
        assert max(copies) < min(waits) and max(waits) < min(kernels_k)
        assert len(kernels_k) == 2 and max(kernels_k) < readback
        if k + 1 < len(sizes):
            assert min(fake.where("copy", k + 1)) < readback
        # After the caller is done with batch k (it asked for the next one), an event on its
        # stream; the copies of batch k + 2 into the same arena wait for it on the side stream,
        # and the host waits for batch k's copies before reading batch k + 2 into its arena.
        consumed = [ev for ev, (i, s) in records.items() if s == "main" and i > readback]
        if k + 2 < len(sizes):
            first = consumed[0]
            (wait,) = fake.where("wait", ("side", first))
            assert records[first][0] < wait < min(fake.where("copy", k + 2))
            for ev in done:
                assert fake.where("sync", ev)[0] < min(fake.where("copy", k + 2))
    # A device arena's first carve (batches 0 and 1) and its growth (batch 2, in slot 0): the
    # side stream waits for everything queued on the caller's stream until then, before any
    # copy into it. Batches 3 and 4 fit: no wait.
    grown = [i for i, (w, d, who) in enumerate(log) if w == "wait_stream"]
    assert [log[i][1:] for i in grown] == [(("side", "main"), "caller")] * 3
    for i, k in zip(grown, (0, 1, 2)):
        assert i < min(fake.where("copy", k))
    assert grown[2] > fake.where("readback", 0)[0]


def test_compare_each_launches_every_group_before_one_read_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    real_rows, real_to_host = ops.compare_rows, kernels._to_host
    monkeypatch.setattr(ops, "compare_rows", lambda *a: (events.append("kernel"), real_rows(*a))[1])
    monkeypatch.setattr(
        kernels, "_to_host", lambda t: (events.append(f"read back {len(t)}"), real_to_host(t))[1]
    )
    a = [torch.arange(4.0) + i for i in range(6)]
    e = [x.clone() for x in a]
    e[4][1] += 1
    settings = [(0.0, 0.0, True), (1e-3, 0.0, True), (0.0, 0.0, False)] * 2
    diffs = kernels.compare_each(a, e, boxes=[None] * 6, settings=settings)
    assert events == ["kernel", "kernel", "kernel", "read back 3"]
    assert [d.mismatched for d in diffs] == [0, 0, 0, 0, 1, 0]
    assert [d.fingerprint_actual is None for d in diffs] == [False, False, True] * 2
    events.clear()
    kernels.compare(a, e, rtol=0.5)
    assert events == ["kernel", "read back 1"]


@pytest.mark.parametrize("page_aligned", [True, False])
def test_pinned_host_buffers_are_requested_at_their_exact_size(
    monkeypatch: pytest.MonkeyPatch, page_aligned: bool
) -> None:
    """torch's host allocator rounds pinned requests up to a power of two: nbytes + a page would
    double a power-of-two arena. (No GPU here: the stand-in allocates plain memory.)"""
    calls: list[tuple[int, bool]] = []
    real_empty = torch.empty

    def empty(n: int, *, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
        calls.append((n, pin_memory))
        big = real_empty(n + 2 * rawio.PAGE, dtype=dtype)
        skip = (-big.data_ptr()) % rawio.PAGE + (0 if page_aligned or not pin_memory else 64)
        return big[skip : skip + n]

    monkeypatch.setattr(torch, "empty", empty)
    buf = rawio.aligned_empty(1 << 20, pin=True)
    want = [(1 << 20, True)] if page_aligned else [(1 << 20, True), ((1 << 20) + rawio.PAGE, True)]
    assert calls == want
    assert buf.numel() == 1 << 20 and buf.data_ptr() % rawio.PAGE == 0
