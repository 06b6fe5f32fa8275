"""collectives.combine over several ranks against the same numbers computed from all ranks at once.

The ranks are threads in lockstep (``ThreadComm``: each collective is an exchange through
shared slots between two barriers), each calling ``combine`` with its own rows, as gloo ranks
would; the expectation is computed directly from every rank's rows (``expected``).
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from fsdpcheck import collectives as C
from fsdpcheck.kernels import MASK64
from fsdpcheck.stats import COUNTS, Combined, KeyStats


class ThreadComm:
    """One of `world` threads acting as ranks of one group (what ``combine`` uses of a Comm)."""

    enabled = True
    group = None
    device = torch.device("cpu")

    def __init__(self, world: int, rank: int, shared: dict[str, Any]) -> None:
        self.world, self.rank, self.shared = world, rank, shared

    def _exchange(self, value: Any) -> list[Any]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = value
        barrier.wait()
        got = list(slots)
        barrier.wait()  # nobody writes the next value before everyone has read this one
        return got

    def all_reduce(self, t: torch.Tensor, op: Any, step: str = "") -> torch.Tensor:
        got = torch.stack(self._exchange(t.clone()))
        if op == dist.ReduceOp.SUM:
            return got.sum(0)
        return got.amin(0) if op == dist.ReduceOp.MIN else got.amax(0)

    def all_gather_words(self, words: list[int], step: str = "") -> list[list[int]]:
        return [list(w) for w in self._exchange(list(words))]

    def broadcast_object(self, obj: Any, src: int, step: str = "") -> Any:
        return pickle.loads(pickle.dumps(self._exchange(obj)[src]))


def run_ranks(per_rank: list[list[KeyStats]], seconds: list[float], read: list[int]) -> list:
    world = len(per_rank)
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world, timeout=60)}
    out: list[Any] = [None] * world

    def rank(r: int) -> None:
        comm: Any = ThreadComm(world, r, shared)
        out[r] = C.combine(comm, per_rank[r], seconds[r], read[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def expected(per_rank: list[list[KeyStats]], seconds: list[float], read: list[int]) -> tuple:
    """Every key's Combined and the totals, from all ranks' rows at once."""
    world = len(per_rank)
    out = []
    for i in range(len(per_rank[0])):
        rows = [per_rank[r][i] for r in range(world)]
        c = Combined({n: sum(getattr(s, n) for s in rows) for n in COUNTS}, -1, -1, -1, -1, -1, -1)
        for which in ("abs", "rel"):
            top = max(getattr(s, f"max_{which}") for s in rows)
            at = [
                (getattr(s, f"max_{which}_idx"), r)
                for r, s in enumerate(rows)
                if getattr(s, f"max_{which}_idx") >= 0 and getattr(s, f"max_{which}") == top
            ]
            idx, rank = min(at) if at else (-1, -1)
            setattr(c, f"max_{which}", top)
            setattr(c, f"max_{which}_idx", idx)
            setattr(c, f"max_{which}_rank", rank)
        lowest = min((r for r, s in enumerate(rows) if s.holders), default=-1)
        owner = [
            C._owner(ThreadComm(world, r, {}), s, lowest)  # type: ignore[arg-type]
            for r, s in enumerate(rows)
        ]
        copies = [s.fp for s in rows if s.fp is not None]
        counted = [s.fp for s, o in zip(rows, owner) if o and s.fp is not None]
        # Every element once: the counted copies' elements and mismatches.
        c.covered = sum(s.copy_numel for s, o in zip(rows, owner) if o)
        c.counted_mismatched = sum(s.mismatched for s, o in zip(rows, owner) if o)
        if copies:
            own, g_own = sum(counted) & MASK64, sum(map(C.fmix64, counted)) & MASK64
            every, g_every = sum(copies) & MASK64, sum(map(C.fmix64, copies)) & MASK64
            n = len(copies) // len(counted) if counted else 0
            c.fingerprint = own
            c.replicas_disagree = (
                not counted
                or len(copies) % len(counted) != 0
                or every != (n * own) & MASK64
                or g_every != (n * g_own) & MASK64
            )
        out.append(c)
    flagged = [i for i, c in enumerate(out) if c.replicas_disagree][: C.REPLICA_DETAIL]
    for i in flagged:
        held = [(s[i].box, C._signed(s[i].fp)) if s[i].fp is not None else None for s in per_rank]
        out[i].replica_groups = C._disagreeing(held)
    return out, C.Totals(max(seconds), sum(read))


FPS = [0, 1, 5, (1 << 64) - 1, 0x8000_0000_0000_0000, 0x1234_5678_9ABC_DEF0]


@st.composite
def ranks_rows(draw: Any) -> tuple[list[list[KeyStats]], list[float], list[int]]:
    world = draw(st.integers(1, 5))
    keys = draw(st.integers(0, 10))
    small = st.integers(0, 7)
    value = st.sampled_from([-1.0, 0.0, 0.25, 1.0, 3.5, float("inf")])
    per_rank = []
    for _ in range(world):
        rows = []
        for _ in range(keys):
            held = draw(st.booleans())
            mesh = draw(st.none() | st.frozensets(st.integers(0, world - 1), min_size=1))
            s = KeyStats(
                **{n: draw(small) for n in COUNTS if n != "holders"},
                holders=int(held),
                max_abs=draw(value),
                max_abs_idx=draw(st.integers(-1, 9)),
                max_rel=draw(value),
                max_rel_idx=draw(st.integers(-1, 9)),
                fp=draw(st.none() | st.sampled_from(FPS)) if held else None,
                box=draw(st.integers(0, 2)),
                owner=draw(st.sampled_from([None, True, False])),
                copy_numel=draw(small),
                mesh_ranks=mesh,
            )
            rows.append(s)
        per_rank.append(rows)
    seconds = [draw(st.floats(0, 10)) for _ in range(world)]
    read = [draw(st.integers(0, 1 << 40)) for _ in range(world)]
    return per_rank, seconds, read


@given(ranks_rows())
def test_combine_equals_the_numbers_of_all_ranks_at_once(case: Any) -> None:
    per_rank, seconds, read = case
    want = expected(per_rank, seconds, read)
    for got in run_ranks(per_rank, seconds, read):
        assert got == want


def test_copies_that_agree_and_one_that_does_not() -> None:
    # Three ranks hold copies of one box; the lowest counts; rank 2's copy differs in key 1.
    def row(fp: int) -> KeyStats:
        return KeyStats(numel=4, holders=1, fp=fp, box=0, copy_numel=4)

    per_rank = [[row(7), row(9)], [row(7), row(9)], [row(7), row(10)]]
    for combined, _ in run_ranks(per_rank, [0.0] * 3, [0] * 3):
        assert [c.fingerprint for c in combined] == [7, 9]
        assert [c.replicas_disagree for c in combined] == [False, True]
        assert combined[1].replica_groups == [[0, 1], [2]]
        assert [c.covered for c in combined] == [4, 4]
        assert combined[0].max_abs_idx == -1 and combined[0].max_abs_rank == -1
