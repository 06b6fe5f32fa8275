"""Two checkpoints of any supported layouts, compared tensor by tensor under a memory budget.

What ``fsdpcheck compare A B`` runs: e.g. a DCP directory against the safetensors a conversion
script wrote. Tensors are paired by canonical name (``matching``): every tensor of either side is
compared, or is a finding, or is listed as ignored by the user; nothing is dropped silently.
Both sides are streamed in row blocks, compared on the GPU when there is one, and reported like
``verify`` (global indices; no ranks: files).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdpcheck import matching
from fsdpcheck.box import Box
from fsdpcheck.collectives import KeyStats
from fsdpcheck.formats import CheckpointInfo, describe_path
from fsdpcheck.kernels import SUPPORTED_DTYPES, compare_each
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.readplan import batches, row_blocks
from fsdpcheck.report import Finding, MappingRow, Report, normalized
from fsdpcheck.sources import Entry, Region, Source, open_source
from fsdpcheck.sources.prefetch import Prefetcher, batch_bytes
from fsdpcheck.tolerances import tolerance

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
        device: Where to compare (default: the GPU when there is one, else the CPU).
        memory_budget: Bytes of both checkpoints' data held at once.
        progress: Called with (bytes done, bytes in all) as the comparison advances.

    Returns:
        A Report: "missing" (in `expected` only), "unexpected" (in `actual` only), "shape",
        "dtype", "gap", "skipped" and "value" findings; its mapping pairs every tensor.
    """
    if not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive int, got {memory_budget!r}")
    if (rtol is not None and rtol < 0) or (atol is not None and atol < 0):
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    t0 = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sa = open_source(actual)
    try:
        sb = open_source(expected)
    except BaseException:
        sa.close()
        raise
    try:
        infos = (_describe(actual), _describe(expected))
        settings = _Settings(rtol, atol, equal_nan, check_dtype, key_map, ignore)
        report = _compare(sa, sb, settings, dev, memory_budget, progress, t0)
        for side, info in zip(("actual", "expected"), infos):
            report.notes += [f"{side}: {n}" for n in (info.notes if info else [])]
        return report
    finally:
        sa.close()
        sb.close()


@dataclass(frozen=True)
class _Settings:
    rtol: float | None
    atol: float | None
    equal_nan: bool
    check_dtype: bool
    key_map: matching.KeyMap | None
    ignore: Sequence[str] | None


def _compare(
    sa: Source,
    sb: Source,
    s: _Settings,
    dev: torch.device,
    budget: int,
    progress: Progress | None,
    t0: float,
) -> Report:
    ka = checkpoint_keys(sa)
    kb = checkpoint_keys(sb)
    m = matching.match_checkpoints(
        ka, kb, read_a=sa.read_objects, read_b=sb.read_objects, key_map=s.key_map, ignore=s.ignore
    )
    report = Report(
        reference=sb.description, world_size=1, notes=list(m.notes), side_a="actual",
        side_b="expected",
    )  # fmt: skip
    report.keys_a, report.keys_b = len(ka.tensors()), len(kb.tensors())
    findings: list[Finding] = list(m.findings)
    bad = _problem_keys(sa, ka, "actual", findings) | _problem_keys(sb, kb, "expected", findings)
    rows = m.rows
    status = {r.a: r for r in rows if r.status == "compared"}
    # Every pair's row blocks, then batches of blocks: one kernel call per batch (per
    # tolerance), with the next batch read while this one is compared (NOTE: [prefetch]).
    # Two batches are in flight, so each holds at most half the budget (both sides).
    step = batch_bytes(budget)
    compared: list[tuple[str, Entry, Entry, tuple[float, float]]] = []
    blocks: list[_Block] = []
    converted: dict[tuple[str, str, float, float], int] = {}
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
            findings.append(Finding(name, "shape", f"{ea.shape} in actual, {eb.shape} in expected"))
            continue
        if ea.dtype not in SUPPORTED_DTYPES or eb.dtype not in SUPPORTED_DTYPES:
            findings.append(
                Finding(name, "skipped", f"{ea.dtype} / {eb.dtype} cannot be compared element-wise")
            )
            _skip(status, name, "unsupported dtype")
            continue
        assert ea.dtype is not None and eb.dtype is not None
        tol = tolerance(ea.dtype, eb.dtype, s.rtol, s.atol)
        if ea.dtype != eb.dtype:
            if s.check_dtype:
                findings.append(
                    Finding(name, "dtype", f"{ea.dtype} in actual, {eb.dtype} in expected")
                )
            what = (_dtype_name(ea.dtype), _dtype_name(eb.dtype), *tol)
            converted[what] = converted.get(what, 0) + 1
        i = len(compared)
        compared.append((name, ea, eb, tol))
        both = ea.dtype.itemsize + eb.dtype.itemsize
        for off, size in row_blocks((0,) * len(ea.shape), ea.shape, both, step):
            blocks.append(
                _Block(
                    i,
                    Region(a.key, off, size),
                    Region(b.key, off, size),
                    Box(ea.shape, off),
                    math.prod(size) * both,
                )
            )
    for (da, db, rt, at), n in sorted(converted.items()):
        given = s.rtol is not None or s.atol is not None
        how = "the tolerances given" if given else "torch.testing's defaults for the less precise"
        report.notes.append(
            f"{n} tensor(s) {da} in actual, {db} in expected: values compared with rtol={rt}, "
            f"atol={at} ({how})"
            + (
                ""
                if s.check_dtype
                else "; the dtype difference is not a finding (check_dtype=False)"
            )
        )
    total = sum(w.nbytes for w in blocks)
    stats = [KeyStats() for _ in compared]
    done = 0
    plan = (
        (batch, [(sa, [w.ra for w in batch]), (sb, [w.rb for w in batch])])
        for batch in batches(blocks, lambda w: w.nbytes, step)
    )
    for batch, (xa, xb) in Prefetcher(dev).run(plan):
        settings = [(*compared[w.pair][3], False) for w in batch]
        boxes = [w.box for w in batch]
        diffs = compare_each(xa, xb, boxes=boxes, settings=settings, equal_nan=s.equal_nan)
        for w, d in zip(batch, diffs):
            stats[w.pair].add(d, w.box)
        done += sum(w.nbytes for w in batch)
        if progress is not None:
            progress(done, total)
    for (name, ea, eb, (rt, at)), st in zip(compared, stats):
        report.elements_checked += st.numel
        report.bytes_read += _nbytes(ea) + _nbytes(eb)
        report.keys_checked += 1
        if st.mismatched:
            f = Finding.value(name, st, ea.shape, rtol=rt, atol=at, with_ranks=False)
            f.message = f.message.replace("on the checked side", "in actual")
            f.message = f.message.replace("in the reference", "in expected")
            findings.append(f)
    report.mapping = rows
    report.findings = normalized(findings)
    report.seconds = time.perf_counter() - t0
    return report


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class _Block:
    """A row block of one compared pair: its region on each side and its global box."""

    pair: int
    ra: Region
    rb: Region
    box: Box
    nbytes: int


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
