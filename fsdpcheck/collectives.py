"""Agreeing across ranks with collectives whose size does not grow with the world.

Every rank must make the same collectives in the same order, or the job hangs: the functions here
are called unconditionally by every rank, whatever happened locally (a local error is data, not
an exception).

NOTE: [bytes per rank] fsdpcheck is built for jobs of 16,384 ranks and 10**5 tensors. Anything
gathered from every rank to every rank costs W x K per rank (6 GB at W = 4096, K = 20,000 with
77 bytes a row), so nothing per key is ever gathered:

- keys: a rank's key list is digested; when the digests agree (one all-reduce of 4 words), row i
  means key i everywhere and no names travel. When they differ (pipeline stages hold different
  keys), each DISTINCT list travels once, broadcast by the lowest rank holding it (one word per
  rank to find them, then the lists: O(keys of the job)).
- statistics: one row per key, combined by all-reduce (SUM, MIN; maxima as MIN of negations).
- fingerprints: summed by all-reduce as two 32-bit halves (exact mod 2**64), each box counted
  once (its owner: the rank at coordinate 0 of the Replicate dims, or the lowest rank holding a
  plain tensor).
- replicas: the sum of every copy must be (copies per box) x the sum of the counted copies, for
  the fingerprints and for a second hash of them; only keys where that fails are looked at rank
  by rank (a gather of 2 words per rank for each of at most ``REPLICA_DETAIL`` keys).
- findings found locally: each distinct list once (``distinct``), capped at ``MAX_DISTINCT``.
- and no gather of objects: ``all_gather_object`` pads every rank's pickle to the largest, so
  each rank would receive W x the largest (``Comm`` offers none).

So bytes received per rank are O(K) plus O(W) words, and identical reports come from identical
data on every rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import hashlib
import math
import os
import pickle
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdpcheck.errors import REGISTRY, RankStoppedError, describe_error, shown, type_name
from fsdpcheck.kernels import MASK64
from fsdpcheck.report import Finding
from fsdpcheck.stats import COUNTS, Combined, KeyStats

__all__ = [
    "MAX_DISTINCT",
    "REPLICA_DETAIL",
    "Comm",
    "Group",
    "RankStoppedError",
    "agree",
    "combine",
    "cyclic_gc_paused",
    "digest",
    "distinct",
    "gather_findings",
    "same_everywhere",
]

T = TypeVar("T")
INT64_MAX = (1 << 63) - 1
_LO = (1 << 32) - 1
#: Distinct payloads broadcast by ``distinct`` at most (the rest are named by rank only).
MAX_DISTINCT = 64
#: Keys whose disagreeing copies are looked up rank by rank (the rest are named without ranks).
REPLICA_DETAIL = 8


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

    def all_gather_words(self, words: Sequence[int], step: str = "") -> list[list[int]]:
        """Every rank's few int64 words, in rank order: the one thing that grows with W."""
        if not self.enabled:
            return [list(words)]
        mine = torch.tensor(list(words), dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))
        except RuntimeError as exc:
            raise self._stopped(exc, "all_gather", step) from None
        return [t.cpu().tolist() for t in out]

    def broadcast_object(self, obj: Any, src: int, step: str = "", inline: int = 0) -> Any:
        """`obj` of rank `src` (a rank of this group) on every rank: its pickle, once.

        The ranks are one job running one program: what one rank pickles, the others load.
        Two broadcasts (the size, then the pickle); one when the pickle fits in `inline`
        bytes, which then travel with the size whatever the pickle's length.
        """
        if not self.enabled:
            return obj
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        data = pickle.dumps(obj, protocol=4) if self.rank == src else b""
        head = bytearray(8 + inline)
        head[:8] = len(data).to_bytes(8, "little")
        if len(data) <= inline:
            head[8 : 8 + len(data)] = data
        first = torch.frombuffer(head, dtype=torch.uint8).to(self.device)
        try:
            self._wait(dist.broadcast(first, src=root, group=self.group, async_op=True))
            got = bytes(first.cpu().numpy())
            size = int.from_bytes(got[:8], "little")
            if size <= inline:
                payload = got[8 : 8 + size]
            else:
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                if self.rank == src and data:
                    buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                self._wait(dist.broadcast(buf, src=root, group=self.group, async_op=True))
                host = buf.cpu()
                payload = ctypes.string_at(host.data_ptr(), host.numel())
        except RuntimeError as exc:
            raise self._stopped(exc, "broadcast", step) from None
        if self.rank == src:
            return obj
        return pickle.loads(payload)

    # -- gloo, polled -----------------------------------------------------------------------
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


# -------------------------------------------------------------------------------------------
def digest(obj: Any) -> int:
    """A 63-bit digest of a picklable object (equal objects, equal digests, on every rank)."""
    data = pickle.dumps(obj, protocol=4)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def same_everywhere(comm: Comm, word: int) -> bool:
    """Whether every rank passed the same 63-bit word: one all-reduce of 4 words."""
    if not comm.enabled:
        return True
    lo, hi = word & _LO, word >> 32
    t = torch.tensor([lo, hi, -lo, -hi], dtype=torch.int64)
    m = comm.all_reduce(t, dist.ReduceOp.MIN).tolist()
    return m[0] == -m[2] and m[1] == -m[3]


def any_rank(comm: Comm, flag: bool) -> bool:
    """Whether `flag` is set on any rank: one all-reduce of 1 word."""
    if not comm.enabled:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    return bool(comm.all_reduce(t, dist.ReduceOp.MAX).item())


@dataclass
class Group:
    """Ranks that hold the same payload, and that payload (the lowest rank's)."""

    ranks: list[int]
    payload: Any


def distinct(
    comm: Comm, payload: Any, *, word: int | None = None, cap: int = MAX_DISTINCT
) -> tuple[list[Group], list[int]]:
    """The distinct payloads of the ranks, each once, with the ranks holding it.

    When every rank's payload digests the same (one all-reduce), that is the answer and
    nothing else travels. Otherwise every rank's digest is gathered (one word per rank) and each
    distinct payload is broadcast once, by the lowest rank holding it, in order of that rank.

    Args:
        comm: The group.
        payload: This rank's payload (picklable; built before the call).
        word: Its digest, when the caller has one; default ``digest(payload)``.
        cap: Distinct payloads broadcast at most.

    Returns:
        The groups (at most `cap`), and the ranks whose payloads were past the cap.
    """
    word = digest(payload) if word is None else word
    if same_everywhere(comm, word):
        return [Group(list(range(comm.world)), payload)], []
    by: dict[int, list[int]] = {}
    for rank, (w,) in enumerate(comm.all_gather_words([word])):
        by.setdefault(w, []).append(rank)
    groups = sorted(by.values(), key=lambda ranks: ranks[0])
    out = [Group(ranks, comm.broadcast_object(payload, ranks[0])) for ranks in groups[:cap]]
    return out, sorted(r for ranks in groups[cap:] for r in ranks)


#: Findings one rank sends at most, and characters of each message.
MAX_LOCAL_FINDINGS, MAX_MESSAGE = 256, 600


def gather_findings(comm: Comm, local: Sequence[Finding]) -> list[Finding]:
    """Every rank's local findings, each distinct list once, with the ranks that found it.

    A rank's list is capped at ``MAX_LOCAL_FINDINGS`` (the rest summed up in one line) and each
    message at ``MAX_MESSAGE`` characters, so what travels is bounded whatever a rank found;
    ranks whose lists were past ``MAX_DISTINCT`` are named in one finding.
    """
    mine = [_capped(f) for f in local[:MAX_LOCAL_FINDINGS]]
    if len(local) > MAX_LOCAL_FINDINGS:
        mine.append(Finding("*", "error", f"{len(local) - MAX_LOCAL_FINDINGS} more findings"))
    groups, past = distinct(comm, mine)
    out: list[Finding] = []
    for g in groups:
        for f in g.payload:
            out.append(replace(f, rank=g.ranks[0] if f.rank is None else f.rank, ranks=g.ranks))
    if past:
        out.append(
            Finding(
                "*",
                "error",
                f"{len(past)} more rank(s) found other things, not shown here (ranks "
                f"{_ranks_text(past)}); run on fewer ranks or see each rank's log",
                rank=past[0],
                ranks=past,
            )
        )
    return out


def _capped(f: Finding) -> Finding:
    if len(f.message) <= MAX_MESSAGE:
        return f
    return replace(f, message=f.message[: MAX_MESSAGE - 4] + " ...")


def agree(comm: Comm, fn: Callable[[], T], what: str) -> T:
    """Runs `fn` on this rank; if it failed on any rank, raises the same error on every rank.

    For local steps between collectives: an exception on one rank alone would leave the others
    waiting in the next collective forever. Costs one all-reduce of one word when nothing
    failed. The error raised everywhere has the failing rank's exception type where that type
    is one of a known set (FileNotFoundError, ValueError, fsdpcheck's own errors, ...), else
    RuntimeError, and a message naming `what`, the rank and the failure.
    """
    result: Any = None
    error: tuple[str, str, str] | None = None
    try:
        result = fn()
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # The failing rank's `what` travels too: it may name a path only that rank was given,
        # and every rank must raise the same text.
        error = (type_name(exc), describe_error(exc), what)
    if not any_rank(comm, error is not None):
        return result
    groups, past = distinct(comm, error)
    failed = [g for g in groups if g.payload is not None]
    ranks = sorted(r for g in failed for r in g.ranks)
    if not failed:  # every failing rank's error was past the cap
        raise RuntimeError(f"{what} failed on ranks {past[:16]}")
    kind, message, first_what = failed[0].payload
    rank = failed[0].ranks[0]
    more = [r for r in ranks if r != rank] + past
    others = f" (and on ranks {_ranks_text(more)})" if more else ""
    where = f" on rank {rank}{others}" if comm.world > 1 else ""
    raise REGISTRY.get(kind, RuntimeError)(f"{first_what} failed{where}: {message}")


def _ranks_text(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"{ranks[:16]} and {len(ranks) - 16} more"


# -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pauses CPython's cyclic garbage collector for a check's duration (restored after).

    NOTE: [cyclic GC] A check allocates a few objects per key (entries, pairs, layouts, rows,
    statistics) that live until it returns. The cyclic collector runs every 700 allocations and
    its full collections traverse the whole heap, which these objects keep growing: at 50,000
    keys, 5,600 young and 10 full collections were ~45% of verify's time (10 s -> 5.5 s on a
    2-core CPU). Reference counting frees everything a check drops; only cycles wait, and the
    collector, restored when the check returns, finds them at its next run. A collector that
    the caller had disabled stays disabled.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# -------------------------------------------------------------------------------------------
def fmix64(x: int) -> int:
    """murmur3's 64-bit finalizer: the second hash of a fingerprint for the replica check."""
    x &= MASK64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    x ^= x >> 33
    return x


@dataclass
class Totals:
    """Per-call numbers combined together with the keys' rows."""

    seconds: float = 0.0  # the slowest rank's
    bytes_read: int = 0  # summed


@cyclic_gc_paused()  # NOTE: [cyclic GC]: objects per key
def combine(
    comm: Comm, stats: Sequence[KeyStats], seconds: float = 0.0, bytes_read: int = 0
) -> tuple[list[Combined], Totals]:
    """Combines each key's statistics over all ranks: 2-4 all-reduces of O(keys), no gather.

    Row i is key i on every rank (the callers agreed on the key list first). Maxima tie to the
    smallest global index, then the smallest rank (two more all-reduces, made only when some
    rank holds a maximum at an index). Fingerprints are the sums of the counted copies; copies
    that disagree are found by the rule in NOTE: [bytes per rank], and for at most
    ``REPLICA_DETAIL`` such keys the ranks are grouped by content (one more gather of 2 words
    per rank per key, only when some copies disagree).

    NOTE: [combine in columns] The rows are built and read column by column with torch (one
    Python list per field, no list per key): at 50,000 keys a row per key cost ~0.8 s of
    Python and garbage collection, the columns ~0.1 s.

    Args:
        comm: The group.
        stats: This rank's statistics, one per key, in the order every rank agreed on.
        seconds: This rank's time (the maximum is returned).
        bytes_read: This rank's bytes read (the sum is returned).

    Returns:
        One Combined per key, identical on every rank, and the totals.
    """
    k = len(stats)
    f64, i64 = torch.float64, torch.int64
    # Round 1 (MIN of float64): maxima as negations, the lowest holder of keys whose owner is
    # not given by their layout; last row: the slowest rank's time, and whether any rank holds a
    # maximum at an index at all (else rounds 2 and 3 have nothing to find).
    rank, inf = float(comm.rank), math.inf
    r1 = torch.tensor(
        [
            [-s.max_abs for s in stats],
            [-s.max_rel for s in stats],
            [rank if s.holders else inf for s in stats],
        ],
        dtype=f64,
    )
    idx = torch.tensor(
        [[s.max_abs_idx for s in stats], [s.max_rel_idx for s in stats]], dtype=i64
    ).T
    indexed = any(s.max_abs_idx >= 0 or s.max_rel_idx >= 0 for s in stats)
    last = torch.tensor([[-seconds, -1.0 if indexed else 0.0, 0.0]], dtype=f64)
    g1 = comm.all_reduce(torch.cat([r1.T, last]), dist.ReduceOp.MIN)
    gmax = -g1[:k, :2]
    lowest = [int(c) if c != inf else -1 for c in g1[:k, 2].tolist()]
    found = holding = torch.full((k, 2), -1, dtype=i64)
    if g1[k, 1] < 0:
        # Round 2 (MIN): the smallest global index holding each maximum.
        mine = (idx >= 0) & (gmax == -r1[:2].T)
        cand = torch.where(mine, idx, INT64_MAX)
        gmin = comm.all_reduce(cand, dist.ReduceOp.MIN)
        # Round 3 (MIN): the lowest rank holding that element.
        held = (cand != INT64_MAX) & (cand == gmin)
        gwho = comm.all_reduce(torch.where(held, comm.rank, INT64_MAX), dist.ReduceOp.MIN)
        found = torch.where(gmin != INT64_MAX, gmin, -1)
        holding = torch.where(gwho != INT64_MAX, gwho, -1)
    # Round 4 (SUM): the counts, and the copies as 32-bit halves of the fingerprint and of its
    # second hash: the counted copies' (columns 12-15) and all copies' (16-19).
    owner = [_owner(comm, s, low) for s, low in zip(stats, lowest)]
    fps = [s.fp for s in stats]
    ints = [[getattr(s, c) for s in stats] for c in COUNTS]
    ints.append([s.copy_numel if o else 0 for s, o in zip(stats, owner)])  # 9
    ints.append([1 if o and fp is not None else 0 for o, fp in zip(owner, fps)])  # 10: counted
    ints.append([0 if fp is None else 1 for fp in fps])  # 11: copies
    hashes = torch.tensor(
        [
            [_signed(fp) if fp is not None else 0 for fp in fps],
            [_signed(fmix64(fp)) if fp is not None else 0 for fp in fps],
        ],
        dtype=i64,
    ).T
    halves = torch.cat([hashes & _LO, (hashes >> 32) & _LO], dim=1)  # fp, g lows; fp, g highs
    counts = torch.tensor(ints, dtype=i64).T
    rows = torch.cat([counts, counts[:, 10:11] * halves, halves], dim=1)
    total = torch.zeros((1, rows.shape[1]), dtype=i64)
    total[0, 0] = bytes_read
    summed = comm.all_reduce(torch.cat([rows, total]), dist.ReduceOp.SUM)
    n = len(COUNTS)
    owners, copies = summed[:k, n + 1], summed[:k, n + 2]
    fingerprint: list[int | None] = [None] * k
    disagree = [False] * k
    if bool(copies.any()):
        own, every = _mod64(summed[:k, 12:16]), _mod64(summed[:k, 16:20])
        per_box = torch.where(owners > 0, copies // owners.clamp(min=1), 0)
        bad = (copies > 0) & (
            (owners == 0)
            | (copies % owners.clamp(min=1) != 0)
            | (every != _mod64(per_box[:, None] * own)).any(dim=1)
        )
        fingerprint = [
            (hi << 32) | lo if c else None
            for lo, hi, c in zip(own[:, 0].tolist(), own[:, 2].tolist(), copies.tolist())
        ]
        disagree = bad.tolist()
    out = []
    columns = zip(
        summed[:k, :n].tolist(),
        gmax.tolist(),
        found.tolist(),
        holding.tolist(),
        fingerprint,
        summed[:k, n].tolist(),
        disagree,
    )
    for row, (ma, mr), (ia, ir), (wa, wr), fp, covered, bad in columns:
        c = Combined(dict(zip(COUNTS, row)), ma, ia, wa, mr, ir, wr)
        if fp is not None:
            c.fingerprint, c.covered, c.replicas_disagree = fp, covered, bad
        out.append(c)
    totals = Totals(seconds=-float(g1[k, 0]), bytes_read=int(summed[k, 0]))
    _replica_detail(comm, stats, out)
    return out, totals


def _mod64(halves: torch.Tensor) -> torch.Tensor:
    """Sums of 32-bit halves (columns: fp low, g low, fp high, g high) made exact mod 2**64.

    Each value ``low + high * 2**32`` is returned as its 32-bit halves in the same columns.
    Sums over W ranks (or a half times the copies per box) stay far below 2**63 for any W up
    to 2**30, so int64 holds them exactly.
    """
    lo, hi = halves[:, :2], halves[:, 2:]
    return torch.cat([lo & _LO, (hi + (lo >> 32)) & _LO], dim=1)


def _owner(comm: Comm, s: KeyStats, lowest: int) -> bool:
    """Whether this rank's copy is counted (see ``KeyStats``): each box exactly once."""
    if not s.holders:
        return False
    if s.owner is None:
        return lowest == comm.rank
    if s.mesh_ranks is not None and len(s.mesh_ranks) < comm.world:
        root = lowest if comm.group is None else dist.get_global_rank(comm.group, lowest)
        return s.owner and root in s.mesh_ranks
    return s.owner


def _replica_detail(comm: Comm, stats: Sequence[KeyStats], out: list[Combined]) -> None:
    """Ranks grouped by content for the first keys whose copies disagree (only then: a gather)."""
    flagged = [i for i, c in enumerate(out) if c.replicas_disagree][:REPLICA_DETAIL]
    if not flagged:
        return
    words: list[int] = []
    for i in flagged:
        s = stats[i]
        words += [s.box, _signed(s.fp)] if s.fp is not None else [-1, 0]
    per_rank = comm.all_gather_words(words)
    for j, i in enumerate(flagged):
        copies = [(w[2 * j], w[2 * j + 1]) if w[2 * j] >= 0 else None for w in per_rank]
        out[i].replica_groups = _disagreeing(copies)


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
