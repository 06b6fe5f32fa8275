"""Two checkpoints of any supported formats, compared tensor by tensor under a memory budget.

What ``fsdpcheck compare A B`` runs: e.g. a DCP directory against the safetensors a conversion
script wrote. Both sides are streamed in row blocks (DCP: in its saved chunks), compared on the
GPU when there is one, and reported like ``verify`` (global indices; no ranks: files).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from fsdpcheck import keys as keymod
from fsdpcheck.box import Box, unravel
from fsdpcheck.collectives import KeyStats
from fsdpcheck.fingerprint import checkpoint_key_names
from fsdpcheck.kernels import SUPPORTED_DTYPES, compare
from fsdpcheck.report import Finding, Report
from fsdpcheck.sources import Region, Source, open_source
from fsdpcheck.verify import fold, tolerance

Progress = Callable[[int, int], None]


def compare_checkpoints(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = True,
    device: str | torch.device | None = None,
    memory_budget: int = 1 << 30,
    progress: Progress | None = None,
) -> Report:
    """Compares every tensor of `actual` with the same tensor of `expected`.

    Args:
        actual: A checkpoint (DCP directory, torch.save file, safetensors, mapping).
        expected: The reference checkpoint, any supported format.
        rtol: Relative tolerance (None: exact, or dtype defaults when the dtypes differ).
        atol: Absolute tolerance (likewise).
        equal_nan: Whether NaN matches NaN.
        device: Where to compare (default: the GPU when there is one, else the CPU).
        memory_budget: Bytes of both checkpoints' data held at once.
        progress: Called with (bytes done, bytes in all) as the comparison advances.

    Returns:
        A Report: "missing" (in `expected` only), "unexpected" (in `actual` only), "shape",
        "dtype" and "value" findings.
    """
    t0 = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sa, sb = open_source(actual), open_source(expected)
    pairs, findings, notes = _match(sa, sb)
    report = Report(reference=sb.description, world_size=1, notes=notes)
    total = sum(_nbytes(sa, ka) + _nbytes(sb, kb) for _, ka, kb in pairs)
    done = 0
    ea, eb = sa.entries(), sb.entries()
    for name, ka, kb in pairs:
        a, b = ea[ka], eb[kb]
        if a.shape != b.shape:
            msg = f"{a.shape} in {sa.description}, {b.shape} in {sb.description}"
            findings.append(Finding(name, "shape", msg))
            continue
        if a.dtype not in SUPPORTED_DTYPES or b.dtype not in SUPPORTED_DTYPES:
            findings.append(Finding(name, "dtype", f"{a.dtype} / {b.dtype} cannot be compared"))
            continue
        if a.dtype != b.dtype:
            findings.append(Finding(name, "dtype", f"{a.dtype} in actual, {b.dtype} in expected"))
        rt, at = tolerance(a.dtype, b.dtype, rtol, atol)  # type: ignore[arg-type]
        stats = KeyStats()
        itemsize = max(a.dtype.itemsize, b.dtype.itemsize)  # type: ignore[union-attr]
        for region in _blocks(a.shape, itemsize, memory_budget // 2):
            (xa,) = sa.read([Region(ka, region.offset, region.size)], dev)
            (xb,) = sb.read([Region(kb, region.offset, region.size)], dev)
            (d,) = compare([xa], [xb], rtol=rt, atol=at, equal_nan=equal_nan,
                           boxes=[Box(a.shape, region.offset)], fingerprints=False)  # fmt: skip
            fold(stats, d, Box(a.shape, region.offset))
            done += region.numel * (a.dtype.itemsize + b.dtype.itemsize)  # type: ignore[union-attr]
            if progress is not None:
                progress(done, total)
        report.elements_checked += stats.numel
        report.bytes_read += _nbytes(sa, ka) + _nbytes(sb, kb)
        report.keys_checked += 1
        if stats.mismatched:
            findings.append(
                Finding(
                    name,
                    "value",
                    "every element of actual is zero" if stats.zeros == stats.numel else "",
                    mismatched=stats.mismatched,
                    numel=stats.numel,
                    max_abs_diff=stats.max_abs if stats.max_abs_idx >= 0 else None,
                    max_abs_index=unravel(stats.max_abs_idx, a.shape)
                    if stats.max_abs_idx >= 0
                    else None,
                    max_rel_diff=stats.max_rel if stats.max_rel_idx >= 0 else None,
                    max_rel_index=unravel(stats.max_rel_idx, a.shape)
                    if stats.max_rel_idx >= 0
                    else None,
                    rtol=rt,
                    atol=at,
                )
            )
    report.findings = sorted(findings, key=lambda f: (f.key, f.kind))
    report.seconds = time.perf_counter() - t0
    return report


def _match(sa: Source, sb: Source) -> tuple[list[tuple[str, str, str]], list[Finding], list[str]]:
    """(name, key in a, key in b) for every tensor both have; findings for the others."""
    na, nb = checkpoint_key_names(sa), checkpoint_key_names(sb)
    a_by_name = {n: k for k, n in na.items()}
    b_by_name = {n: k for k, n in nb.items()}
    notes = []
    for side, mine, other in (("actual", a_by_name, b_by_name), ("expected", b_by_name, a_by_name)):
        if any(n.startswith("optim.") for n in mine) and not any(
            n.startswith("optim.") for n in other
        ):
            # A model-only file (a conversion's output) against a training checkpoint.
            dropped = [n for n in mine if n.startswith("optim.")]
            for n in dropped:
                del mine[n]
            notes.append(f"{side} also holds {len(dropped)} optimizer tensors; not compared")
    # Model names may carry different prefixes ("model.", "module.") on the two sides.
    a_model = [n for n in a_by_name if not n.startswith("optim.")]
    b_model = [n for n in b_by_name if not n.startswith("optim.")]
    prefix = keymod.best_prefix(a_model, b_model)
    pairs, findings, used_b = [], [], set()
    for name, ka in sorted(a_by_name.items()):
        target = name if name.startswith("optim.") else keymod.map_with(prefix, name)
        kb = b_by_name.get(target)
        if kb is None:
            findings.append(Finding(name, "unexpected", "in actual but not in expected"))
            continue
        used_b.add(target)
        pairs.append((name, ka, kb))
    for name in sorted(set(b_by_name) - used_b):
        findings.append(Finding(name, "missing", "in expected but not in actual"))
    return pairs, findings, notes


def _nbytes(source: Source, key: str) -> int:
    e = source.entries()[key]
    return e.dtype.itemsize * math.prod(e.shape)  # type: ignore[union-attr]


def _blocks(shape: tuple[int, ...], itemsize: int, budget: int) -> list[Region]:
    """Row blocks of a tensor of at most `budget` bytes (at least one row)."""
    if not shape:
        return [Region("", (), ())]
    row = itemsize * math.prod(shape[1:])
    rows = max(1, budget // max(row, 1))
    out = []
    for r0 in range(0, max(shape[0], 1), rows):
        r1 = min(shape[0], r0 + rows)
        out.append(Region("", (r0, *([0] * (len(shape) - 1))), (r1 - r0, *shape[1:])))
    return out
