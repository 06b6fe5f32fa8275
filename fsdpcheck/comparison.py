"""Two checkpoints of any supported layouts, compared tensor by tensor under a memory budget.

What ``fsdpcheck compare A B`` runs: e.g. a DCP directory against the safetensors a conversion
script wrote. Tensors are paired by canonical name (``matching``): every tensor of either side is
compared, or is a finding, or is listed as ignored by the user; nothing is dropped silently.
Both sides are streamed in row blocks, compared on the GPU when there is one, and reported like
``verify`` (global indices; no ranks: files). Under torchrun, each process compares its share of
the blocks (``offline_dist``) and every process gets the report one process would have made.

NOTE: [per-key costs] At 50,000 small tensors the work around each tensor is the cost, not the
data. Most of it was Python's collector scanning the millions of objects a plan of that size
makes (NOTE: [collector]); the rest is kept to plain tuples here: a whole tensor is its own
block, its box implied; each batch is one call of the operator on the tensors the sources
returned (shapes and dtypes are theirs by the Source contract: nothing to check again); its rows
are added to per-pair tensors of sums and maxima (`_Tally`) in a few vector operations; Python
touches a pair again only to word a finding. Measured on 2 cores with the collector off in both,
that part went from a Box, a check, a TensorDiff and a KeyStats update per tensor to about 6 us
less per key (0.3 s of a 50,000-key compare).
"""

from __future__ import annotations

import math
import os
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fsdpcheck import _collector, matching, offline_dist, ops
from fsdpcheck.formats import CheckpointInfo, describe_path
from fsdpcheck.kernels import SUPPORTED_DTYPES
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.readplan import batches, row_blocks
from fsdpcheck.report import Finding, MappingRow, Report, normalized
from fsdpcheck.sources import Region, Source, open_source
from fsdpcheck.sources.prefetch import Prefetcher, batch_bytes
from fsdpcheck.stats import KeyStats
from fsdpcheck.tolerances import tolerance

if TYPE_CHECKING:
    from fsdpcheck.collectives import Comm
    from fsdpcheck.stats import Combined

Progress = Callable[[int, int], None]


def compare_checkpoints(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = True,
    check_dtype: bool = True,
    key_map: matching.KeyMap | None = None,
    ignore: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    memory_budget: int = 1 << 30,
    progress: Progress | None = None,
) -> Report:
    """Compares every tensor of `actual` with the same tensor of `expected`.

    Args:
        actual: A checkpoint of any layout ``fsdpcheck.describe_path`` recognises, or a mapping.
        expected: The reference checkpoint, any layout.
        rtol: Relative tolerance (None: exact, or dtype defaults when the dtypes differ).
        atol: Absolute tolerance (likewise).
        equal_nan: Whether NaN matches NaN.
        check_dtype: Whether a dtype difference is a finding. With False (a conversion to
            another dtype), differing dtypes are a note and the values are compared with the
            tolerances (torch.testing's defaults for the less precise dtype when none is given;
            the report says which were used).
        key_map: Actual's name -> expected's key or name (None: not compared), or prefix rules
            (``matching.prefix_rules(["model.="])``; the CLI's ``--key-map OLD=NEW``).
        ignore: fnmatch patterns of names (or either side's keys) to exclude, e.g. ``optim.*``
            to compare a training checkpoint with a model-only conversion.
        device: Where to compare (default: the GPU when there is one, else the CPU; under
            torchrun, ``cuda`` is the GPU of the process's LOCAL_RANK).
        memory_budget: Bytes of both checkpoints' data held at once (per process).
        progress: Called with (bytes done, bytes in all) as the comparison advances (under
            torchrun: this process's share).

    Returns:
        A Report: "missing" (in `expected` only), "unexpected" (in `actual` only), "shape",
        "dtype", "gap", "skipped" and "value" findings; its mapping pairs every tensor.
    """
    if not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive int, got {memory_budget!r}")
    if (rtol is not None and rtol < 0) or (atol is not None and atol < 0):
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    with _collector.paused():  # NOTE: [collector]
        return _compare_checkpoints(
            actual, expected, _Settings(rtol, atol, equal_nan, check_dtype, key_map, ignore),
            device, memory_budget, progress,
        )  # fmt: skip


def _compare_checkpoints(
    actual: Any,
    expected: Any,
    settings: _Settings,
    device: str | torch.device | None,
    memory_budget: int,
    progress: Progress | None,
) -> Report:
    t0 = time.perf_counter()
    session = offline_dist.current()
    request = _request(session, actual, expected, settings, device, memory_budget)
    if session is not None:
        dev = session.device(device)
    else:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sa, sb = _open_both(actual, expected)
    try:
        infos = (_describe(actual), _describe(expected))
        world = session.world if session is not None and request is not None else 1
        job = _CompareJob(sa, sb, settings, dev, memory_budget, world, progress)
        if session is not None and request is not None:
            tally = session.run(request, job)
        else:
            tally = job.measure(range(len(job.blocks)))
        report = job.report(tally, t0)
        for side, info in zip(("actual", "expected"), infos):
            report.notes += [f"{side}: {n}" for n in (info.notes if info else [])]
        return report
    finally:
        sa.close()
        sb.close()


def serve_compare(
    session: offline_dist.Session,
    actual: str,
    expected: str,
    settings: _Settings,
    device: str | None,
    memory_budget: int,
) -> _CompareJob:
    """The job of a comparison another process of the launch asked for (``offline_dist``)."""
    sa, sb = _open_both(actual, expected)
    try:
        job = _CompareJob(sa, sb, settings, session.device(device), memory_budget, session.world)
    except BaseException:
        sa.close()
        sb.close()
        raise
    job.owns_sources = True
    return job


def _open_both(actual: Any, expected: Any) -> tuple[Source, Source]:
    sa = open_source(actual)
    try:
        return sa, open_source(expected)
    except BaseException:
        sa.close()
        raise


def _request(
    session: offline_dist.Session | None,
    actual: Any,
    expected: Any,
    settings: _Settings,
    device: str | torch.device | None,
    budget: int,
) -> offline_dist.Request | None:
    """What another process rebuilds this comparison from; None to compare alone.

    Only paths can be shared (an in-memory reference exists in this process only), and only
    settings that pickle (a key_map that is a function does not).
    """
    if session is None or not all(isinstance(r, (str, os.PathLike)) for r in (actual, expected)):
        return None
    args = (os.fspath(actual), os.fspath(expected), settings, device and str(device), budget)
    request = offline_dist.Request("compare", args)
    try:
        pickle.dumps(request)
    except Exception:
        return None
    return request


@dataclass(frozen=True)
class _Settings:
    rtol: float | None
    atol: float | None
    equal_nan: bool
    check_dtype: bool
    key_map: matching.KeyMap | None
    ignore: Sequence[str] | None


@dataclass(frozen=True)
class _Pair:
    """A pair that is compared: its name, each side's key and dtype, the shape, tolerances."""

    name: str
    key_a: str
    key_b: str
    shape: tuple[int, ...]
    dtype_a: torch.dtype
    dtype_b: torch.dtype
    tol: tuple[float, float]


#: A row block of a compared pair: (pair, offset, size, elements, bytes of both sides, whether
#: it is the whole tensor, so that its box is implied).
_Block = tuple[int, tuple[int, ...], tuple[int, ...], int, int, bool]


class _CompareJob:
    """A comparison's plan (the pairs, their row blocks) and the comparing of a share of it.

    The plan depends on the two checkpoints' metadata, the settings and the number of processes
    only, so every process of a launch computes the same one (``offline_dist.Job``).
    """

    def __init__(
        self,
        sa: Source,
        sb: Source,
        s: _Settings,
        dev: torch.device,
        budget: int,
        world: int = 1,
        progress: Progress | None = None,
    ) -> None:
        self.sa, self.sb, self.s, self.dev, self.progress = sa, sb, s, dev, progress
        self.owns_sources = False
        ka = checkpoint_keys(sa)
        kb = checkpoint_keys(sb)
        m = matching.match_checkpoints(
            ka, kb, read_a=sa.read_objects, read_b=sb.read_objects, key_map=s.key_map,
            ignore=s.ignore,
        )  # fmt: skip
        self.skeleton = Report(
            reference=sb.description, world_size=1, notes=list(m.notes), side_a="actual",
            side_b="expected",
        )  # fmt: skip
        self.skeleton.keys_a, self.skeleton.keys_b = len(ka.tensors()), len(kb.tensors())
        self.rows = m.rows
        findings: list[Finding] = list(m.findings)
        bad = _problem_keys(sa, ka, "actual", findings) | _problem_keys(
            sb, kb, "expected", findings
        )
        status = {r.a: r for r in self.rows if r.status == "compared"}
        self.pairs: list[_Pair] = []
        self.bytes_read = 0
        converted: dict[tuple[str, str, float, float], int] = {}
        tolerances: dict[tuple[torch.dtype, torch.dtype], tuple[float, float]] = {}
        for name, a, b in m.pairs:
            ea, eb = a.entry, b.entry
            if name in bad:
                _skip(status, name, "storage problem")
                continue
            held = ka.placeholders.get(a.key) or kb.placeholders.get(b.key)
            if held is not None:
                findings.append(Finding(name, "skipped", held))
                _skip(status, name, "a placeholder")
                continue
            if ea.shape != eb.shape:
                findings.append(
                    Finding(name, "shape", f"{ea.shape} in actual, {eb.shape} in expected")
                )
                continue
            da, db = ea.dtype, eb.dtype
            if da not in SUPPORTED_DTYPES or db not in SUPPORTED_DTYPES:
                findings.append(
                    Finding(name, "skipped", f"{da} / {db} cannot be compared element-wise")
                )
                _skip(status, name, "unsupported dtype")
                continue
            assert da is not None and db is not None
            tol = tolerances.get((da, db))
            if tol is None:
                tol = tolerances[(da, db)] = tolerance(da, db, s.rtol, s.atol)
            if da != db:
                if s.check_dtype:
                    findings.append(Finding(name, "dtype", f"{da} in actual, {db} in expected"))
                what = (_dtype_name(da), _dtype_name(db), *tol)
                converted[what] = converted.get(what, 0) + 1
            shape = tuple(ea.shape)
            if math.prod(shape) >= 1 << 63:
                raise ValueError(f"{name}: a global shape {shape} of 2**63 elements or more")
            self.pairs.append(_Pair(name, a.key, b.key, shape, da, db, tol))
            self.bytes_read += _nbytes(ea) + _nbytes(eb)
        self.findings = findings
        for (na, nb, rt, at), n in sorted(converted.items()):
            given = s.rtol is not None or s.atol is not None
            how = (
                "the tolerances given" if given else "torch.testing's defaults for the less precise"
            )
            self.skeleton.notes.append(
                f"{n} tensor(s) {na} in actual, {nb} in expected: values compared with rtol={rt}, "
                f"atol={at} ({how})"
                + (
                    ""
                    if s.check_dtype
                    else "; the dtype difference is not a finding (check_dtype=False)"
                )
            )
        # Every pair's row blocks, then batches of blocks: one kernel call per batch (per
        # tolerance), with the next batch read while this one is compared (NOTE: [prefetch]).
        # Two batches are in flight, so each holds at most half the budget (both sides).
        self.step = batch_bytes(budget)
        total = sum(
            math.prod(p.shape) * (p.dtype_a.itemsize + p.dtype_b.itemsize) for p in self.pairs
        )
        self.piece = offline_dist.piece_bytes(total, world, self.step)
        self.blocks: list[_Block] = []
        for i, p in enumerate(self.pairs):
            both = p.dtype_a.itemsize + p.dtype_b.itemsize
            numel = math.prod(p.shape)
            if numel * both <= self.piece or not p.shape or p.shape[0] <= 1:
                self.blocks.append((i, (0,) * len(p.shape), p.shape, numel, numel * both, True))
                continue
            for off, size in row_blocks((0,) * len(p.shape), p.shape, both, self.piece):
                n = math.prod(size)
                self.blocks.append((i, off, size, n, n * both, False))

    # -- offline_dist.Job --------------------------------------------------------------------
    def digest(self) -> int:
        """The plan: every compared pair (names, keys, shapes, dtypes, tolerances), the cut."""
        from fsdpcheck.collectives import digest

        return digest(
            (
                self.piece,
                len(self.findings),
                [
                    (p.name, p.key_a, p.key_b, p.shape, str(p.dtype_a), str(p.dtype_b), p.tol)
                    for p in self.pairs
                ],
            )
        )

    def sizes(self) -> list[int]:
        """Bytes of each block (both sides)."""
        return [b[4] for b in self.blocks]

    def measure(self, items: range) -> _Tally:
        """Compares the blocks `items` of the plan (reading them, two batches in flight)."""
        tally = _Tally(len(self.pairs))
        blocks = self.blocks[items.start : items.stop]
        total, done = sum(b[4] for b in blocks), 0
        pairs = self.pairs
        plan = (
            (
                batch,
                [
                    (self.sa, [Region(pairs[b[0]].key_a, b[1], b[2]) for b in batch]),
                    (self.sb, [Region(pairs[b[0]].key_b, b[1], b[2]) for b in batch]),
                ],
            )
            for batch in batches(blocks, _block_bytes, self.step)
        )
        for batch, (xa, xb) in Prefetcher(self.dev).run(plan):
            table = self._compare(batch, xa, xb)
            ids = torch.tensor([b[0] for b in batch], dtype=torch.int64)
            numel = torch.tensor([b[3] for b in batch], dtype=torch.int64)
            tally.add(ids, numel, table)
            done += sum(b[4] for b in batch)
            if self.progress is not None:
                self.progress(done, total)
        return tally

    def combine(self, comm: Comm, tally: _Tally) -> _Tally:
        """Every process's tally summed (``collectives.combine``: one row per pair)."""
        from fsdpcheck.collectives import combine

        combined, _ = combine(comm, tally.keystats())
        return _Tally.from_combined(combined)

    def close(self) -> None:
        """Closes the checkpoints when this job opened them (a pass another process asked for)."""
        if self.owns_sources:
            self.sa.close()
            self.sb.close()

    # -- the comparison -----------------------------------------------------------------------
    def _compare(
        self, batch: list[_Block], xa: list[torch.Tensor], xb: list[torch.Tensor]
    ) -> torch.Tensor:
        """The operator's rows for a batch (one call per tolerance), on the CPU, in order.

        NOTE: [one read-back] in kernels: every call is queued before any result is read.
        """
        groups: dict[tuple[float, float], list[int]] = {}
        for j, b in enumerate(batch):
            groups.setdefault(self.pairs[b[0]].tol, []).append(j)
        tables = []
        for (rt, at), idx in groups.items():
            one = len(groups) == 1
            a = xa if one else [xa[j] for j in idx]
            e = xb if one else [xb[j] for j in idx]
            shapes: list[int] = []
            offsets: list[int] = []
            if not all(b[5] for b in batch) and not all(batch[j][5] for j in idx):
                for j in idx:
                    shapes.extend(self.pairs[batch[j][0]].shape)
                    offsets.extend(batch[j][1])
            with torch.no_grad():
                tables.append(
                    ops.compare_rows(a, e, shapes, offsets, rt, at, self.s.equal_nan, False, True)
                )
        host = (torch.cat(tables) if len(tables) > 1 else tables[0]).cpu()
        if len(groups) == 1:
            return host
        out = torch.empty_like(host)
        out[torch.tensor([j for idx in groups.values() for j in idx])] = host
        return out

    def report(self, tally: _Tally, t0: float) -> Report:
        """The report from the (combined) tally: value findings for the pairs that differ."""
        report = self.skeleton
        findings = list(self.findings)
        for i in tally.mismatched():
            p = self.pairs[i]
            rt, at = p.tol
            f = Finding.value(p.name, tally.stats(i), p.shape, rtol=rt, atol=at, with_ranks=False)
            f.message = f.message.replace("on the checked side", "in actual")
            f.message = f.message.replace("in the reference", "in expected")
            findings.append(f)
        report.elements_checked = tally.elements()
        report.bytes_read = self.bytes_read
        report.keys_checked = len(self.pairs)
        report.mapping = self.rows
        report.findings = normalized(findings)
        report.seconds = time.perf_counter() - t0
        return report


def _block_bytes(b: _Block) -> int:
    return b[4]


# Columns of an operator row summed per pair (after the elements, which the plan knows), and
# the (value, global index) columns of the two maxima.
_COUNTED = ("mismatched", "nan_actual", "nan_expected", "inf_actual", "inf_expected", "zeros")
_COUNT_COLUMNS = [ops.COLUMNS[c] for c in _COUNTED]
_FIELDS = ("numel", "mismatched", "nan_a", "nan_e", "inf_a", "inf_e", "zeros")
_MAXIMA = (
    (ops.COLUMNS["max_abs_diff"], ops.COLUMNS["max_abs_index"]),
    (ops.COLUMNS["max_rel_diff"], ops.COLUMNS["max_rel_index"]),
)
_NONE = (1 << 63) - 1


class _Tally:
    """Per pair: the summed counts of its blocks and its two maxima, as tensors.

    The same numbers as a ``KeyStats`` per pair fed every block (NOTE: [per-key costs]): maxima
    by value, ties to the smallest global index; a block without a maximum (no element) counts
    for nothing.
    """

    def __init__(self, n: int) -> None:
        self.counts = torch.zeros((n, len(_FIELDS)), dtype=torch.int64)
        self.maxima = [
            (torch.full((n,), -1.0, dtype=torch.float64), torch.full((n,), -1, dtype=torch.int64))
            for _ in _MAXIMA
        ]

    def add(self, pairs: torch.Tensor, numel: torch.Tensor, table: torch.Tensor) -> None:
        """Adds a batch's rows (block j of pair ``pairs[j]``, ``numel[j]`` elements)."""
        self.counts.index_add_(0, pairs, torch.cat([numel[:, None], table[:, _COUNT_COLUMNS]], 1))
        floats = table.view(torch.float64)
        for (best, where), (vc, ic) in zip(self.maxima, _MAXIMA):
            _keep_greatest(best, where, pairs, floats[:, vc], table[:, ic])

    def mismatched(self) -> list[int]:
        """The pairs with a mismatched element, in order."""
        return torch.nonzero(self.counts[:, 1]).flatten().tolist()

    def elements(self) -> int:
        """Elements compared in all."""
        return int(self.counts[:, 0].sum())

    def stats(self, i: int) -> KeyStats:
        """Pair i's numbers as a KeyStats."""
        (ab, ai), (rb, ri) = self.maxima
        return KeyStats(
            **dict(zip(_FIELDS, self.counts[i].tolist())),
            max_abs=float(ab[i]), max_abs_idx=int(ai[i]), max_rel=float(rb[i]),
            max_rel_idx=int(ri[i]),
        )  # fmt: skip

    def keystats(self) -> list[KeyStats]:
        """Every pair's numbers as KeyStats (what ``collectives.combine`` sums)."""
        (ab, ai), (rb, ri) = (tuple(t.tolist() for t in m) for m in self.maxima)
        return [
            KeyStats(
                **dict(zip(_FIELDS, c)),
                max_abs=ab[i],
                max_abs_idx=ai[i],
                max_rel=rb[i],
                max_rel_idx=ri[i],
            )
            for i, c in enumerate(self.counts.tolist())
        ]

    @classmethod
    def from_combined(cls, rows: Sequence[Combined]) -> _Tally:
        """A tally holding ``collectives.combine``'s sums and maxima."""
        t = cls(len(rows))
        if rows:
            t.counts = torch.tensor([[c.counts[f] for f in _FIELDS] for c in rows])
            t.maxima = [
                (
                    torch.tensor([c.max_abs for c in rows], dtype=torch.float64),
                    torch.tensor([c.max_abs_idx for c in rows], dtype=torch.int64),
                ),
                (
                    torch.tensor([c.max_rel for c in rows], dtype=torch.float64),
                    torch.tensor([c.max_rel_idx for c in rows], dtype=torch.int64),
                ),
            ]
        return t


def _keep_greatest(
    best: torch.Tensor,
    where: torch.Tensor,
    pairs: torch.Tensor,
    value: torch.Tensor,
    index: torch.Tensor,
) -> None:
    """Updates each pair's greatest value and its smallest global index with a batch's rows."""
    ok = (index >= 0) & ~torch.isnan(value)
    if not bool(ok.all()):
        pairs, value, index = pairs[ok], value[ok], index[ok]
    if not len(pairs):
        return
    # A batch's blocks are consecutive in the plan: its pairs are sorted (and torch.unique
    # sorts, at ~2 us a row).
    keys, inv = torch.unique_consecutive(pairs, return_inverse=True)
    old, old_at = best[keys], where[keys]
    new = old.scatter_reduce(0, inv, value, "amax")
    # Among the holders of the new greatest value (the old holder, this batch's rows): the
    # smallest global index.
    at = torch.where((old == new) & (old_at >= 0), old_at, _NONE)
    top = value == new[inv]
    at = at.scatter_reduce(0, inv[top], index[top], "amin")
    best[keys] = new
    where[keys] = torch.where(at == _NONE, old_at, at)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(reference: Any) -> CheckpointInfo | None:
    return describe_path(reference) if isinstance(reference, (str, os.PathLike)) else None


def _skip(status: dict[str | None, MappingRow], name: str, reason: str) -> None:
    row = status.get(name)
    if row is not None:
        row.status, row.reason = "skipped", reason


def _problem_keys(
    source: Source, keys: matching.CheckpointKeys, side: str, findings: list[Finding]
) -> set[str]:
    """Storage problems as findings (named by canonical name); the names they make unreadable."""
    names = {r.key: r.name for r in keys.rows}
    bad = set()
    for key, kind, message in source.problems():
        name = names.get(key, key)
        findings.append(Finding(name, kind if kind == "gap" else "error", f"{side}: {message}"))
        bad.add(name)
    return bad


def _nbytes(e: Any) -> int:
    return (e.dtype.itemsize if e.dtype is not None else 0) * math.prod(e.shape)
