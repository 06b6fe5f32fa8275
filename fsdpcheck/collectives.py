"""Combining per-key statistics across ranks with a constant number of collectives.

Every rank must make the same collectives in the same order, or the job hangs: the functions here
are called unconditionally by every rank, whatever happened locally (a local error is data, not
an exception).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck.box import Box, ravel
from fsdpcheck.kernels import MASK64, TensorDiff
from fsdpcheck.manifest import ManifestError
from fsdpcheck.report import describe_error
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


class Comm:
    """The process group fsdpcheck talks over (or a single process without one)."""

    def __init__(self, group: Any = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world = dist.get_world_size(group) if self.enabled else 1
        self.device = torch.device("cpu")
        if self.enabled and dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        """All-reduce of a CPU tensor (moved to the backend's device and back)."""
        if not self.enabled:
            return t
        x = t.to(self.device, copy=True)  # never reduce the caller's tensor in place
        dist.all_reduce(x, op=op, group=self.group)
        return x.cpu()


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
    failed = [(rank, e) for rank, e in enumerate(comm.all_gather_object(error)) if e]
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
