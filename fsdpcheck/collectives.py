"""The combining arithmetic: what the ranks exchange, in collectives that do not grow with W.

Every rank must make the same collectives in the same order, or the job hangs: the functions here
are called unconditionally by every rank, whatever happened locally. The transport (deadlines, a
rank that stops answering) is ``dist.comm``; how a call's steps agree, failures included, is
``dist.runner``.

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
  each rank would receive W x the largest (``dist.comm.Comm`` offers none).

So bytes received per rank are O(K) plus O(W) words, and identical reports come from identical
data on every rank.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fsdpcheck._collector import paused
from fsdpcheck.kernels import MASK64
from fsdpcheck.report import Finding
from fsdpcheck.stats import COUNTS, Combined, KeyStats

if TYPE_CHECKING:
    from fsdpcheck.dist.comm import Comm

__all__ = [
    "MAX_DISTINCT",
    "REPLICA_DETAIL",
    "Group",
    "any_rank",
    "combine",
    "digest",
    "distinct",
    "findings_of",
    "gather_findings",
    "same_everywhere",
]

INT64_MAX = (1 << 63) - 1
_LO = (1 << 32) - 1
#: Distinct payloads broadcast by ``distinct`` at most (the rest are named by rank only).
MAX_DISTINCT = 64
#: Keys whose disagreeing copies are looked up rank by rank (the rest are named without ranks).
REPLICA_DETAIL = 8


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
    comm: Comm,
    payload: Any,
    *,
    word: int | None = None,
    cap: int = MAX_DISTINCT,
    words: list[int] | None = None,
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
        words: Filled with every rank's word, in rank order (for what the words themselves
            carry: ``dist.runner`` keeps a failure bit there, seen even past the cap).

    Returns:
        The groups (at most `cap`), and the ranks whose payloads were past the cap.
    """
    word = digest(payload) if word is None else word
    if same_everywhere(comm, word):
        if words is not None:
            words[:] = [word] * comm.world
        return [Group(list(range(comm.world)), payload)], []
    by: dict[int, list[int]] = {}
    gathered = [w for (w,) in comm.all_gather_words([word])]
    if words is not None:
        words[:] = gathered
    for rank, w in enumerate(gathered):
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
    groups, past = distinct(comm, capped_findings(local))
    return findings_of(groups, past)


def capped_findings(local: Sequence[Finding]) -> list[Finding]:
    """A rank's local findings as they travel: at most ``MAX_LOCAL_FINDINGS``, messages capped."""
    mine = [_capped(f) for f in local[:MAX_LOCAL_FINDINGS]]
    if len(local) > MAX_LOCAL_FINDINGS:
        mine.append(Finding("*", "error", f"{len(local) - MAX_LOCAL_FINDINGS} more findings"))
    return mine


def findings_of(groups: Sequence[Group], past: Sequence[int]) -> list[Finding]:
    """The findings of ``distinct`` groups of capped finding lists, each with its ranks."""
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
                f"{_ranks_text(list(past))}); run on fewer ranks or see each rank's log",
                rank=past[0],
                ranks=list(past),
            )
        )
    return out


def _capped(f: Finding) -> Finding:
    if len(f.message) <= MAX_MESSAGE:
        return f
    return replace(f, message=f.message[: MAX_MESSAGE - 4] + " ...")


def _ranks_text(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"{ranks[:16]} and {len(ranks) - 16} more"


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


@paused()  # NOTE: [collector]: objects per key
def combine(
    comm: Comm,
    stats: Sequence[KeyStats],
    seconds: float = 0.0,
    bytes_read: int = 0,
    *,
    numels: Sequence[int] | None = None,
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
        numels: Each key's global numel, when the elements the counted copies cover must be
            it: for at most ``REPLICA_DETAIL`` keys where they are not, every rank's elements
            are gathered (one word per rank per key, only then) into ``Combined.held_by``.

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
    # Last column (20): the mismatches of the counted copies (each element once).
    once = torch.tensor([[s.mismatched if o else 0] for s, o in zip(stats, owner)], dtype=i64)
    rows = torch.cat([counts, counts[:, 10:11] * halves, halves, once.reshape(k, 1)], dim=1)
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
    columns = (
        summed[:k, :n].tolist(),
        gmax.tolist(),
        found.tolist(),
        holding.tolist(),
        fingerprint,
        summed[:k, n].tolist(),
        disagree,
    )
    counted = summed[:k, 20].tolist()
    for row, (ma, mr), (ia, ir), (wa, wr), fp, covered, bad, m1 in zip(*columns, counted):
        c = Combined(dict(zip(COUNTS, row)), ma, ia, wa, mr, ir, wr)
        c.covered, c.counted_mismatched = covered, m1
        if fp is not None:
            c.fingerprint, c.replicas_disagree = fp, bad
        out.append(c)
    totals = Totals(seconds=-float(g1[k, 0]), bytes_read=int(summed[k, 0]))
    _replica_detail(comm, stats, out)
    if numels is not None:
        _coverage_detail(comm, stats, out, numels)
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


def _coverage_detail(
    comm: Comm, stats: Sequence[KeyStats], out: list[Combined], numels: Sequence[int]
) -> None:
    """Every rank's covered elements for the first keys whose shards do not tile them."""
    flagged = [
        i
        for i, (c, n) in enumerate(zip(out, numels))
        if c.holders and not c.errors and c.covered != n
    ][:REPLICA_DETAIL]
    if not flagged:
        return
    mine = [stats[i].copy_numel if stats[i].holders else 0 for i in flagged]
    per_rank = comm.all_gather_words(mine)
    for j, i in enumerate(flagged):
        out[i].held_by = [w[j] for w in per_rank]


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
