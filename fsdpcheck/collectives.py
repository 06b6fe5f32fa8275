"""Combining per-key statistics across ranks with a constant number of collectives.

Every rank must make the same collectives in the same order, or the job hangs: the functions here
are called unconditionally by every rank, whatever happened locally (a local error is data, not
an exception).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck.box import Box, ravel
from fsdpcheck.kernels import MASK64, TensorDiff
from fsdpcheck.manifest import ManifestError
from fsdpcheck.report import describe_error, shown
from fsdpcheck.sources.base import CheckpointError, CoverageError

INT64_MAX = (1 << 63) - 1
# Columns of the summed counts.
COUNTS = ("numel", "mismatched", "nan_a", "nan_e", "inf_a", "inf_e", "zeros", "errors", "holders")


@dataclass
class KeyStats:
    """This rank's statistics for one key (over all its pieces)."""

    numel: int = 0
    mismatched: int = 0
    nan_a: int = 0
    nan_e: int = 0
    inf_a: int = 0
    inf_e: int = 0
    zeros: int = 0
    errors: int = 0
    holders: int = 0  # 1 when this rank holds data of the key
    max_abs: float = -1.0
    max_abs_idx: int = -1
    max_rel: float = -1.0
    max_rel_idx: int = -1
    # Fingerprint of this rank's copy of a replicated value and the box it covers (its linear
    # offset), to compare the ranks that hold the same elements.
    replica_fp: int | None = None
    replica_box: int = -1

    def add(self, d: TensorDiff, box: Box) -> None:
        """Adds one comparison result (maxima by global linear index, ties to the smallest)."""
        self.numel += d.numel
        self.mismatched += d.mismatched
        self.nan_a += d.nan_actual
        self.nan_e += d.nan_expected
        self.inf_a += d.inf_actual
        self.inf_e += d.inf_expected
        self.zeros += d.zeros or 0
        for attr, value, index in (
            ("abs", d.max_abs_diff, d.max_abs_index),
            ("rel", d.max_rel_diff, d.max_rel_index),
        ):
            if index is None:
                continue
            lin = ravel(index, box.shape)
            cur, cur_idx = getattr(self, f"max_{attr}"), getattr(self, f"max_{attr}_idx")
            if value > cur or (value == cur and (cur_idx < 0 or lin < cur_idx)):
                setattr(self, f"max_{attr}", value)
                setattr(self, f"max_{attr}_idx", lin)
        if d.fingerprint_actual is not None:
            self.replica_fp = ((self.replica_fp or 0) + d.fingerprint_actual) & MASK64
            if self.replica_box < 0:
                assert box.offset is not None
                self.replica_box = ravel(box.offset, box.shape)


@dataclass
class Combined:
    """One key's statistics over all ranks (the counts also as attributes: numel, ...)."""

    counts: dict[str, int]
    max_abs: float
    max_abs_idx: int
    max_abs_rank: int
    max_rel: float
    max_rel_idx: int
    max_rel_rank: int
    # Ranks grouped by the content of their copy, when copies of the same box disagree.
    replica_groups: list[list[int]] | None = None

    def __getattr__(self, name: str) -> int:
        # The summed counts read as attributes too (numel, mismatched, ...), as on KeyStats.
        counts = self.__dict__.get("counts", {})
        if name in counts:
            return counts[name]
        raise AttributeError(name)


class RankStoppedError(RuntimeError):
    """A rank stopped answering in the middle of a collective (it died, or hangs elsewhere).

    Raised on every rank that still answers, with the same message: the rank(s) that did not,
    the step, and the transport's reason ("connection reset by peer", ...).
    """


class Comm:
    """The process group fsdpcheck talks over (or a single process without one).

    NOTE: [a rank that stops answering] When a rank dies in the middle of a collective, gloo
    fails the ranks wired to it ("Connection reset by peer") and leaves the others waiting for
    data that never comes, until its timeout (30 minutes by default). So on gloo every
    collective here waits in slices of `_POLL`; between slices it asks the group's store
    whether a rank has reported a failure. A rank whose collective fails reports it in the
    store, and every rank that learns of it (from its own failure or from the store) writes
    its answer there and waits up to `_ANSWER_S` for the others: ranks that never answer are
    the ones named. Everyone raises the same RankStoppedError, worded from the lowest answering
    rank's report. A dead rank thus costs the others about `_ANSWER_S` s, not the timeout.
    """

    def __init__(self, group: Any = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world = dist.get_world_size(group) if self.enabled else 1
        self.device = torch.device("cpu")
        backend = dist.get_backend(group) if self.enabled else ""
        self._polled = backend == "gloo"
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def all_gather_object(self, obj: Any, step: str = "") -> list[Any]:
        """Every rank's obj, in rank order (`step` names what it is for, in errors)."""
        if not self.enabled:
            return [obj]
        try:
            if self._polled:
                return self._gather_objects(obj, step)
            out: list[Any] = [None] * self.world
            dist.all_gather_object(out, obj, group=self.group)
            return out
        except RuntimeError as exc:
            raise self._stopped(exc, "all_gather_object", step) from None

    def all_reduce(self, t: torch.Tensor, op: Any, step: str = "") -> torch.Tensor:
        """All-reduce of a CPU tensor (moved to the backend's device and back)."""
        if not self.enabled:
            return t
        x = t.to(self.device, copy=True)  # never reduce the caller's tensor in place
        try:
            self._wait(dist.all_reduce(x, op=op, group=self.group, async_op=True))
            return x.cpu()
        except RuntimeError as exc:
            raise self._stopped(exc, "all_reduce", step) from None

    def lost_rank(self, exc: BaseException, step: str) -> RankStoppedError | None:
        """The error naming the rank that stopped, when `exc` is a transport failure.

        For collectives made by other libraries on this group (DCP's): call it on every rank
        that caught their failure. None when `exc` is not about the connection.
        """
        if not self.enabled or not isinstance(exc, RuntimeError) or not _transport(exc):
            return None
        err = self._stopped(exc, "collective", step)
        return err if isinstance(err, RankStoppedError) else None

    # -- gloo, polled -----------------------------------------------------------------------
    def _gather_objects(self, obj: Any, step: str) -> list[Any]:
        # dist.all_gather_object's two all-gathers (sizes, then padded pickles), made
        # asynchronously so that `_wait` can poll; and without numpy.
        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._wait(dist.all_gather(sizes, size, group=self.group, async_op=True))
        lengths = [int(n) for n in sizes]
        buf = torch.zeros(max(lengths), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty_like(buf) for _ in range(self.world)]
        self._wait(dist.all_gather(outs, buf, group=self.group, async_op=True))
        return [pickle.loads(ctypes.string_at(o.data_ptr(), n)) for o, n in zip(outs, lengths)]

    def _wait(self, work: Any) -> None:
        if not self._polled:
            work.wait()
            return
        while True:
            try:
                work.wait(timeout=_POLL)
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
            if self._reports() > 0:
                raise _PeerReported()

    # -- who stopped ------------------------------------------------------------------------
    def _store(self) -> Any:
        pg: Any = self.group if self.group is not None else dist.group.WORLD
        return pg.get_group_store()

    def _key(self) -> str:
        return f"fsdpcheck/stopped/{_EPOCH.get(id(self.group), 0)}"

    def _reports(self) -> int:
        try:
            return int(self._store().add(self._key(), 0))
        except Exception:  # the store is gone too: nothing to learn from it
            return 0

    def _stopped(self, exc: BaseException, op: str, step: str) -> RuntimeError:
        """The error every answering rank raises after `exc` (NOTE: [a rank that stops ...])."""
        what = _step_name(op, step)
        cause = _HEARD if isinstance(exc, _PeerReported) else _cause(exc)
        key = self._key()
        _EPOCH[id(self.group)] = _EPOCH.get(id(self.group), 0) + 1
        try:
            store = self._store()
            store.set(f"{key}/{self.rank}", f"{what}\0{cause}")
            store.add(key, 1)
            # One deadline for all, from the first answer (wall clock: ranks on other hosts).
            first = float(bytes(store.compare_set(f"{key}/t", "", repr(time.time()))))
            while int(store.add(key, 0)) < self.world and time.time() < first + _ANSWER_S:
                time.sleep(0.05)
            answered = [r for r in range(self.world) if store.check([f"{key}/{r}"])]
            reports = [
                bytes(store.get(f"{key}/{r}")).decode(errors="replace").partition("\0")
                for r in answered
            ]
        except Exception:  # the store went with the rank that hosts it
            return RankStoppedError(
                f"a rank stopped answering during {what} ({cause}), and the rendezvous store "
                "with it: the rank that hosts the store (rank 0 under a plain "
                "init_process_group) is gone"
            )
        try:
            # Nobody leaves before every answering rank has read the answers: the store may
            # live in one of them (rank 0 under a plain init_process_group). Once read, a
            # store that goes away no longer matters.
            store.add(f"{key}/read", 1)
            deadline = time.time() + _ANSWER_S
            while int(store.add(f"{key}/read", 0)) < len(answered) and time.time() < deadline:
                time.sleep(0.05)
        except Exception:
            pass
        # Worded from the lowest rank whose own collective failed (others only heard).
        what, _, cause = min(reports, key=lambda w: w[2] == _HEARD)
        silent = [r for r in range(self.world) if r not in answered]
        if not silent:  # every rank answered: a failure, but not a rank that went away
            return RuntimeError(f"a collective failed during {what}: {cause}")
        who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {silent}"
        return RankStoppedError(f"{who} stopped answering during {what} ({cause})")


class _PeerReported(RuntimeError):
    """Raised inside a polled wait when another rank reported a failure in the store."""


# Seconds between looks at the store while a gloo collective waits, and how long the ranks
# that still answer wait for each other's answers after a failure.
_POLL = datetime.timedelta(seconds=1)
_ANSWER_S = 5.0
_HEARD = "another rank reported it"
# Failures seen per group in this process (each failure's answers get fresh store keys).
_EPOCH: dict[int, int] = {}
_TRANSPORT_WORDS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "no route to host",
    "timed out",
)


def _transport(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, _PeerReported) or any(w in text for w in _TRANSPORT_WORDS)


def _cause(exc: BaseException) -> str:
    """The transport's reason in a few words (gloo's message carries a file:line and advice)."""
    text = str(exc).lower()
    for words in _TRANSPORT_WORDS:
        if words in text:
            return words
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]
    return shown(first[:200])


def _step_name(op: str, step: str) -> str:
    """What was going on: the fsdpcheck call the user made, and the step or the caller."""
    package = os.path.dirname(os.path.abspath(__file__))
    here = os.path.abspath(__file__)
    entry, caller = "", ""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name.startswith(package + os.sep) and name != here:
            entry = frame.f_code.co_name
            caller = caller or entry
        frame = frame.f_back  # type: ignore[assignment]
    detail = step or (f"in {caller}'s {op}" if caller != entry else f"in {op}")
    return f"{entry}, {detail}" if entry else detail


def agree(comm: Comm, fn: Callable[[], Any], what: str) -> Any:
    """Runs `fn` on this rank; if it failed on any rank, raises the same error on every rank.

    For local steps between collectives: an exception on one rank alone would leave the others
    waiting in the next collective forever. Costs one small all-gather. The error raised
    everywhere has the failing rank's exception type where that type is one of a known set
    (FileNotFoundError, ValueError, fsdpcheck's own errors, ...), else RuntimeError, and a
    message naming `what`, the rank and the failure.
    """
    result, error = None, None
    try:
        result = fn()
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # The failing rank's `what` travels too: it may name a path only that rank was given,
        # and every rank must raise the same text.
        error = (_error_type(exc), describe_error(exc), what)
    failed = [(rank, e) for rank, e in enumerate(comm.all_gather_object(error, what)) if e]
    if failed:
        rank, (kind, message, first_what) = failed[0]
        others = f" (and on ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        where = f" on rank {rank}{others}" if comm.world > 1 else ""
        raise _ERROR_TYPES.get(kind, RuntimeError)(f"{first_what} failed{where}: {message}")
    return result


# Exception types agree() raises as themselves on every rank (others become RuntimeError).
_ERROR_TYPES: dict[str, type[Exception]] = {
    t.__name__: t
    for t in (
        FileNotFoundError,
        FileExistsError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
        ValueError,
        TypeError,
        CheckpointError,
        CoverageError,
        ManifestError,
    )
}


def _error_type(exc: BaseException) -> str:
    for t in type(exc).__mro__:
        if t.__name__ in _ERROR_TYPES and _ERROR_TYPES[t.__name__] is t:
            return t.__name__
    return "RuntimeError"


def combine(comm: Comm, stats: list[KeyStats], extra: Any) -> tuple[list[Combined], list[Any]]:
    """Combines each key's statistics over all ranks: 4 all-reduces and 1 all-gather in all.

    The all-gather carries two words per replicated key per rank (replica fingerprints) and the
    small `extra` objects; everything else is reduced.

    Args:
        comm: The group.
        stats: This rank's statistics, one per key, in the order every rank agreed on.
        extra: A small picklable object of this rank's (its errors, bytes read, time).

    Returns:
        One Combined per key, identical on every rank (maxima tie to the smallest global index,
        then the smallest rank), and every rank's `extra` in rank order.
    """
    k = len(stats)
    counts = torch.tensor([[getattr(s, c) for c in COUNTS] for s in stats], dtype=torch.int64)
    counts = counts.reshape(k, len(COUNTS))
    maxima = torch.tensor([[s.max_abs, s.max_rel] for s in stats], dtype=torch.float64)
    maxima = maxima.reshape(k, 2)
    counts = comm.all_reduce(counts, dist.ReduceOp.SUM)
    gmax = comm.all_reduce(maxima.clone(), dist.ReduceOp.MAX)

    # Smallest global index among the ranks holding the maximum. (Python lists in the loops:
    # indexing tensors element by element costs microseconds each, and there may be 10**4 keys.)
    gmax_l = gmax.tolist()
    cand = [
        [
            s.max_abs_idx if s.max_abs_idx >= 0 and s.max_abs == m[0] else INT64_MAX,
            s.max_rel_idx if s.max_rel_idx >= 0 and s.max_rel == m[1] else INT64_MAX,
        ]
        for s, m in zip(stats, gmax_l)
    ]
    gmin_l = _as_rows(comm.all_reduce(_int_tensor(cand, k), dist.ReduceOp.MIN))

    # The smallest rank holding that element.
    who = [
        [comm.rank if c != INT64_MAX and c == g else INT64_MAX for c, g in zip(cs, gs)]
        for cs, gs in zip(cand, gmin_l)
    ]
    gwho_l = _as_rows(comm.all_reduce(_int_tensor(who, k), dist.ReduceOp.MIN))
    # Replicas: every rank's (box, fingerprint) per key, compared among ranks with the same box.
    # One all-gather of two words per key per rank, together with the small extras.
    replicas = [
        (s.replica_box, _signed(s.replica_fp)) if s.replica_fp is not None else None for s in stats
    ]
    gathered = comm.all_gather_object((replicas, extra))
    extras = [e for _, e in gathered]

    out = []
    counts_l = counts.tolist()
    for i in range(k):
        out.append(
            Combined(
                counts=dict(zip(COUNTS, counts_l[i])),
                max_abs=gmax_l[i][0],
                max_abs_idx=gmin_l[i][0] if gmin_l[i][0] != INT64_MAX else -1,
                max_abs_rank=gwho_l[i][0] if gwho_l[i][0] != INT64_MAX else -1,
                max_rel=gmax_l[i][1],
                max_rel_idx=gmin_l[i][1] if gmin_l[i][1] != INT64_MAX else -1,
                max_rel_rank=gwho_l[i][1] if gwho_l[i][1] != INT64_MAX else -1,
                replica_groups=_disagreeing([g[0][i] for g in gathered]),
            )
        )
    return out, extras


def _int_tensor(rows: list[list[int]], k: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(k, 2)


def _as_rows(t: torch.Tensor) -> list[list[int]]:
    return t.tolist()


def _disagreeing(copies: list[tuple[int, int] | None]) -> list[list[int]] | None:
    """Ranks grouped by content for the first box whose copies differ, else None."""
    by_box: dict[int, dict[int, list[int]]] = {}
    for rank, c in enumerate(copies):
        if c is not None:
            by_box.setdefault(c[0], {}).setdefault(c[1], []).append(rank)
    for box in sorted(by_box):
        if len(by_box[box]) > 1:
            return sorted(by_box[box].values(), key=lambda ranks: (-len(ranks), ranks))
    return None


def _signed(u: int) -> int:
    """A uint64 as the int64 with the same bits."""
    u &= MASK64
    return u - (1 << 64) if u >= 1 << 63 else u
