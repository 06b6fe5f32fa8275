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
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch

from fsdpcheck import _collector, matching, offline_dist, ops
from fsdpcheck.checks import coverage, pair_checks, problem_findings
from fsdpcheck.convert import Conversion, Piece, Target, compile_conversion
from fsdpcheck.formats import CheckpointInfo, describe_path
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.reading.plan import Plan, SourceKey
from fsdpcheck.reading.references import open_source
from fsdpcheck.report import Finding, MappingRow, Report, normalized
from fsdpcheck.sources import Source
from fsdpcheck.sources.prefetch import Prefetcher, batch_bytes
from fsdpcheck.stats import KeyStats
from fsdpcheck.tolerances import CheckSettings, tolerance

if TYPE_CHECKING:
    from fsdpcheck.dist.comm import Comm
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
    convert: Any = None,
    session: offline_dist.Session | None = None,
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
        convert: How `actual`'s layout becomes `expected`'s (``fsdpcheck.convert``: a function
            ``F(state_dict) -> state_dict``, an adapter with ``to_hf``/``from_hf``, a spec or
            its JSON file, ``"module:attr"``, a Conversion). Each tensor of `expected` is then
            compared, piece by piece, with what the conversion makes of `actual`'s tensors,
            without running it on any data; findings are in `expected`'s names and indices.
        session: The processes of a torchrun launch to spread the reading over
            (``offline_dist.session``; the command line makes one); None: this process alone.

    Returns:
        A Report: "missing" (in `expected` only), "unexpected" (in `actual` only), "shape",
        "dtype", "gap", "skipped" and "value" findings; its mapping pairs every tensor.
    """
    with _collector.paused():  # NOTE: [collector]
        settings = CheckSettings(rtol, atol, equal_nan, check_dtype, key_map, ignore, memory_budget)
        return _compare_checkpoints(actual, expected, settings, device, progress, convert, session)


def _compare_checkpoints(
    actual: Any,
    expected: Any,
    settings: CheckSettings,
    device: str | torch.device | None,
    progress: Progress | None,
    convert: Any = None,
    session: offline_dist.Session | None = None,
) -> Report:
    t0 = time.perf_counter()
    request = _request(session, actual, expected, settings, device)
    if session is not None:
        dev = session.device(device)
    else:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sa, sb = _open_both(actual, expected)
    try:
        infos = (_describe(actual), _describe(expected))
        world = session.world if session is not None and request is not None else 1
        job = _CompareJob(sa, sb, settings, dev, world, progress, convert)
        if request is not None and job.conv is not None:
            # The other processes compile the same conversion from its data.
            request = offline_dist.Request("compare", (*request.args, job.conv.to_spec()))
        if session is not None and request is not None:
            tally = session.run(request, job)
        else:
            tally = job.measure(range(len(job.sizes())))
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
    settings: CheckSettings,
    device: str | None,
    convert: dict[str, Any] | None = None,
) -> _CompareJob:
    """The job of a comparison another process of the launch asked for (``offline_dist``).

    `convert` is the compiled conversion's data (``Conversion.to_spec``) when there is one.
    """
    sa, sb = _open_both(actual, expected)
    try:
        job = _CompareJob(sa, sb, settings, session.device(device), session.world, None, convert)
    except BaseException:
        sa.close()
        sb.close()
        raise
    job.owns_sources = True
    return job


def _open_both(actual: Any, expected: Any) -> tuple[Source, Source]:
    sa = open_source(actual)
    try:
        sb = open_source(expected)
    except BaseException:
        sa.close()
        raise
    sb.share_names(sa)  # NOTE: [compare memory]
    return sa, sb


def _request(
    session: offline_dist.Session | None,
    actual: Any,
    expected: Any,
    settings: CheckSettings,
    device: str | torch.device | None,
) -> offline_dist.Request | None:
    """What another process rebuilds this comparison from; None to compare alone.

    Only paths can be shared (an in-memory reference exists in this process only), and only
    settings that pickle (a key_map that is a function does not).
    """
    if session is None or not all(isinstance(r, (str, os.PathLike)) for r in (actual, expected)):
        return None
    args = (os.fspath(actual), os.fspath(expected), settings, device and str(device))
    request = offline_dist.Request("compare", args)
    try:
        pickle.dumps(request)
    except Exception:
        return None
    return request


class _Pairs:
    """The compared pairs as columns, one list per field (NOTE: [compare memory]).

    Attributes:
        names: Canonical name of each pair.
        keys_a: Actual's own key.
        keys_b: Expected's own key.
        shapes: The global shape (both sides' shapes are equal, or it is not a pair).
        dtypes_a: Actual's dtype.
        dtypes_b: Expected's dtype.
        tols: (rtol, atol) used (one tuple per dtype pair, shared).
    """

    __slots__ = ("dtypes_a", "dtypes_b", "keys_a", "keys_b", "names", "shapes", "tols")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.keys_a: list[str] = []
        self.keys_b: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes_a: list[torch.dtype] = []
        self.dtypes_b: list[torch.dtype] = []
        self.tols: list[tuple[float, float]] = []

    def __len__(self) -> int:
        return len(self.names)

    def add(
        self,
        name: str,
        key_a: str,
        key_b: str,
        shape: tuple[int, ...],
        da: torch.dtype,
        db: torch.dtype,
        tol: tuple[float, float],
    ) -> None:
        """Appends one pair."""
        self.names.append(name)
        self.keys_a.append(key_a)
        self.keys_b.append(key_b)
        self.shapes.append(shape)
        self.dtypes_a.append(da)
        self.dtypes_b.append(db)
        self.tols.append(tol)


class _CompareJob:
    """A comparison's plan (the pairs, their blocks) and the comparing of a share of it.

    The plan depends on the two checkpoints' metadata, the settings, the conversion and the
    number of processes only, so every process of a launch computes the same one
    (``offline_dist.Job``). Through a conversion (`convert`), side A's model tensors are the
    conversion's targets, each compared piece by piece (``reading.plan.Plan``): findings are in
    `expected`'s names and indices, each maximum with the tensor and index of `actual` it
    comes from.

    NOTE: [compare memory] At a million tensors every object kept per tensor costs ~100 MB, so
    the plan is columns: a list per field of the pairs (strings, shapes and dtypes shared with
    the sources), three int64 arrays for the blocks (pair, elements, bytes) and the offset and
    size of the few blocks that are not a whole tensor; the keys and the pairing are dropped
    once the plan is made, and batches are ranges of block numbers. The expected side holds
    the names both sides have as the actual side's strings (``share_names``).
    """

    def __init__(
        self,
        sa: Source,
        sb: Source,
        s: CheckSettings,
        dev: torch.device,
        world: int = 1,
        progress: Progress | None = None,
        convert: Any = None,
    ) -> None:
        self.sa, self.sb, self.s, self.dev, self.progress = sa, sb, s, dev, progress
        self.owns_sources = False
        ka = checkpoint_keys(sa)
        kb = checkpoint_keys(sb)
        self.conv: Conversion | None = None
        side_a = ka
        notes: list[str] = []
        if convert is not None:
            self.conv = conv = compile_conversion(
                convert, _model_sources(ka), other_names=_names(kb)
            )
            # Side A's model tensors are the conversion's targets (its optimizer state as saved).
            side_a = replace(ka, model=cast(dict[str, Any], dict(conv.targets)))
            notes.append(
                f"actual converted by {conv.description}: {len(conv.targets)} tensor(s) from "
                f"{len(conv.sources)}"
            )
            notes += conv.notes
        m = matching.match_checkpoints(
            side_a, kb, read_a=sa.read_objects, read_b=sb.read_objects, key_map=s.key_map,
            ignore=s.ignore, pair_rows=False,
        )  # fmt: skip
        self.skeleton = Report(
            reference=sb.description, world_size=1, notes=notes + list(m.notes),
            side_a="actual", side_b="expected",
        )  # fmt: skip
        self.skeleton.keys_a, self.skeleton.keys_b = ka.tensor_count(), kb.tensor_count()
        self.rows = m.rows
        findings: list[Finding] = list(m.findings)
        names_a = {r.key: r.name for r in ka.rows}
        names_b = {r.key: r.name for r in kb.rows}
        got_a, bad_a = problem_findings(sa.problems(), lambda k: names_a.get(k, k), "actual: ")
        got_b, bad_b = problem_findings(sb.problems(), lambda k: names_b.get(k, k), "expected: ")
        findings += got_a + got_b
        sources: dict[str, SourceKey] = {}
        gaps: dict[str, str] = {}
        if self.conv is not None:
            conv = self.conv
            self.skeleton.keys_a = len(conv.targets) + sum(
                1 for r in ka.state.values() if r.entry.is_tensor
            )
            more, rows = coverage(conv, "in actual")
            findings += more
            self.rows += rows
            gaps = conv.target_problems()
            own = {name: r.key for name, r in ka.model.items()}
            for name, (shape, dtype) in conv.sources.items():
                sources[name] = SourceKey(own[name], shape, getattr(torch, dtype))
        self.pairs = _Pairs()
        self.targets: dict[int, str] = {}  # pair -> its conversion target
        converted: dict[int, tuple[Piece, ...]] = {}
        self.bytes_read = 0
        widths: dict[tuple[torch.dtype, torch.dtype], tuple[float, float]] = {}
        dtype_notes: dict[tuple[str, str, float, float], int] = {}
        held_a, held_b = ka.placeholders, kb.placeholders
        placeholders = held_a or held_b
        # The pairs are turned into columns one by one, each dropped once used, and the keys'
        # maps before (NOTE: [compare memory]): the columns grow as the rows go.
        pairs = m.pairs
        pairs.reverse()
        del ka, kb, m
        while pairs:
            pair = pairs.pop()
            name, a, b = pair.name, pair.a, pair.b
            eb = b.entry
            if isinstance(a, Target):
                key_a, shape, da = a.name, a.shape, getattr(torch, a.dtype)
                broken = name in gaps or any(sources[p.source].key in bad_a for p in a.pieces)
            else:
                ea = a.entry
                key_a, shape, da = a.key, ea.shape, ea.dtype
                broken = a.key in bad_a
            if broken or b.key in bad_b:
                self.rows.append(MappingRow(name, b.key, "skipped", "storage problem"))
                continue
            held = placeholders and (held_a.get(key_a) or held_b.get(b.key))
            got, skip = pair_checks(
                name, (shape, da), (eb.shape, eb.dtype), matching.FILES,
                check_dtype=s.check_dtype, placeholder=held or None,
            )  # fmt: skip
            findings += got
            if skip is not None:
                self.rows.append(
                    MappingRow(
                        name, b.key, "compared" if skip == "shape" else "skipped", _WHY[skip]
                    )
                )
                continue
            db = eb.dtype
            assert da is not None and db is not None
            tol = widths.get((da, db))
            if tol is None:
                tol = widths[(da, db)] = tolerance(da, db, s.rtol, s.atol)
            if da != db:
                what = (_dtype_name(da), _dtype_name(db), *tol)
                dtype_notes[what] = dtype_notes.get(what, 0) + 1
            numel = math.prod(shape)
            if numel >= 1 << 63:
                raise ValueError(f"{name}: a global shape {shape} of 2**63 elements or more")
            if isinstance(a, Target):
                self.targets[len(self.pairs)] = a.name
                converted[len(self.pairs)] = a.pieces
            self.pairs.add(name, key_a, b.key, shape, da, db, tol)
        self.findings = findings
        for (na, nb, rt, at), n in sorted(dtype_notes.items()):
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
        # Every pair's blocks, then batches of blocks: one kernel call per batch (per
        # tolerance), with the next batch read while this one is compared (NOTE: [prefetch]).
        # Two batches are in flight, so each holds at most half the budget (both sides).
        self.step = batch_bytes(s.budget)
        p = self.pairs
        both = [da.itemsize + db.itemsize for da, db in zip(p.dtypes_a, p.dtypes_b)]
        total = sum(math.prod(shape) * n for shape, n in zip(p.shapes, both))
        self.piece = offline_dist.piece_bytes(total, world, self.step)
        self.plan = plan = Plan(sources)
        for i, (shape, width) in enumerate(zip(p.shapes, both)):
            pieces = converted.get(i)
            if pieces is not None:
                plan.add_pieces(i, pieces, shape, p.dtypes_b[i].itemsize, self.piece)
            else:
                plan.add_tensor(i, shape, width, self.piece)
        self.bytes_read = sum(plan.block_bytes)

    # The plan's columns, as the tests and benchmarks read them.
    @property
    def block_pair(self) -> array:
        """Each block's pair."""
        return self.plan.block_pair

    @property
    def block_bytes(self) -> array:
        """Each block's bytes (both sides)."""
        return self.plan.block_bytes

    @property
    def cut(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offset, size) of the blocks that are a box of their tensor but not all of it."""
        return self.plan.cut

    # -- offline_dist.Job --------------------------------------------------------------------
    def digest(self) -> int:
        """The plan: the conversion, every compared pair and tolerance, the cut."""
        from fsdpcheck.collectives import digest

        p = self.pairs
        return digest(
            (
                self.conv.digest() if self.conv is not None else "",
                self.piece,
                len(self.findings),
                [
                    (n, ka, kb, shape, str(da), str(db), tol)
                    for n, ka, kb, shape, da, db, tol in zip(
                        p.names, p.keys_a, p.keys_b, p.shapes, p.dtypes_a, p.dtypes_b, p.tols
                    )
                ],
                self.plan.digest_items() if self.plan.pieces else len(self.plan),
            )
        )

    def sizes(self) -> Sequence[int]:
        """Bytes of each block (both sides)."""
        return self.plan.block_bytes

    def measure(self, items: range) -> _Tally:
        """Compares the blocks `items` of the plan (reading them, two batches in flight)."""
        tally = _Tally(len(self.pairs))
        plan, p = self.plan, self.pairs
        sizes = plan.block_bytes
        total, done = sum(sizes[items.start : items.stop]), 0
        reads = (
            (
                batch,
                [
                    (self.sa, plan.regions(batch, p.keys_a, p.shapes, "a")),
                    (self.sb, plan.regions(batch, p.keys_b, p.shapes, "b")),
                ],
            )
            for batch in plan.batches(items, self.step)
        )
        for batch, (xa, xb) in Prefetcher(self.dev).run(reads):
            va = plan.views(batch, xa, p.shapes, "a")
            vb = plan.views(batch, xb, p.shapes, "b")
            table = self._compare(batch, va, vb)
            a, b = batch.start, batch.stop
            ids = torch.tensor(plan.block_pair[a:b], dtype=torch.int64)
            numel = torch.tensor(plan.block_numel[a:b], dtype=torch.int64)
            tally.add(ids, numel, table)
            done += sum(sizes[a:b])
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
        self, batch: range, xa: list[torch.Tensor], xb: list[torch.Tensor]
    ) -> torch.Tensor:
        """The operator's rows for a batch (one call per tolerance), on the CPU, in order.

        NOTE: [one read-back] in kernels: every call is queued before any result is read.
        """
        pair, tols = self.plan.block_pair, self.pairs.tols
        groups: dict[tuple[float, float], list[int]] = {}
        for j in batch:
            groups.setdefault(tols[pair[j]], []).append(j - batch.start)
        tables = []
        for (rt, at), idx in groups.items():
            one = len(groups) == 1
            a = xa if one else [xa[j] for j in idx]
            e = xb if one else [xb[j] for j in idx]
            shapes, offsets = self.plan.boxes([batch.start + j for j in idx], self.pairs.shapes)
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
        p = self.pairs
        for i in tally.mismatched():
            rt, at = p.tols[i]
            stats = tally.stats(i)
            f = Finding.value(
                p.names[i], stats, p.shapes[i], rtol=rt, atol=at, with_ranks=False,
                checked="in actual", reference="in expected",
            )  # fmt: skip
            target = self.targets.get(i)
            if target is not None and self.conv is not None:
                f.abs_source = _located(self.conv, target, stats.max_abs_idx)
                f.rel_source = _located(self.conv, target, stats.max_rel_idx)
            findings.append(f)
        report.elements_checked = tally.elements()
        report.bytes_read = self.bytes_read
        report.keys_checked = len(self.pairs)
        # The compared pairs' rows are made now, from the columns (NOTE: [compare memory]).
        rows = self.rows + [MappingRow(n, k, "compared") for n, k in zip(p.names, p.keys_b)]
        rows.sort(key=matching.row_order)
        report.mapping = rows
        report.findings = normalized(findings)
        report.seconds = time.perf_counter() - t0
        return report


#: A mapping row's reason for a pair ``checks.pair_checks`` keeps from the comparison.
_WHY = {"shape": "", "unsupported dtype": "unsupported dtype", "a placeholder": "a placeholder"}


def _model_sources(keys: matching.CheckpointKeys) -> dict[str, tuple[Any, Any]]:
    """A checkpoint's model tensors as a conversion's sources: name -> (shape, dtype)."""
    return {
        name: (r.entry.shape, r.entry.dtype)
        for name, r in keys.model.items()
        if r.entry.is_tensor and r.entry.dtype is not None and r.entry.shape is not None
    }


def _names(keys: matching.CheckpointKeys) -> set[str]:
    """A checkpoint's canonical names and own keys (what a conversion's output may be called)."""
    return set(keys.model) | {r.key for r in keys.rows}


def _located(conv: Conversion, target: str, index: int) -> tuple[str, tuple[int, ...]] | None:
    """The source element a target element is made of (None without an index)."""
    return conv.locate(target, index) if index >= 0 else None


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
