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
        zero3 = (_zero3(infos[0]), _zero3(infos[1]))
        report = _compare(
            sa, sb, zero3, rtol, atol, equal_nan, ignore, dev, memory_budget, progress, t0
        )
        for side, info in zip(("actual", "expected"), infos):
            report.notes += [f"{side}: {n}" for n in (info.notes if info else [])]
        return report
    finally:
        sa.close()
        sb.close()


def _compare(
    sa: Source,
    sb: Source,
    zero3: tuple[bool, bool],
    rtol: float | None,
    atol: float | None,
    equal_nan: bool,
    ignore: Sequence[str] | None,
    dev: torch.device,
    budget: int,
    progress: Progress | None,
    t0: float,
) -> Report:
    ka = matching.checkpoint_keys(sa.entries(), flat=sa.kind == "safetensors")
    kb = matching.checkpoint_keys(sb.entries(), flat=sb.kind == "safetensors")
    notes = _resolve_ids(sa, ka, sb, kb)
    for side, keys in (("actual", ka), ("expected", kb)):
        note = matching.non_tensor_note(keys, side)
        if note:
            notes.append(note)
    m = matching.match_checkpoints(ka, kb, ignore)
    report = Report(
        reference=sb.description, world_size=1, notes=notes, side_a="actual", side_b="expected"
    )
    report.keys_a, report.keys_b = len(ka.tensors()), len(kb.tensors())
    findings: list[Finding] = []
    for r in m.only_a:
        findings.append(
            Finding(
                r.name, "unexpected", f"in actual ({r.key}) but not in expected" + _optim_hint(r)
            )
        )
    for r in m.only_b:
        findings.append(
            Finding(r.name, "missing", f"in expected ({r.key}) but not in actual" + _optim_hint(r))
        )
    bad = _problem_keys(sa, ka, "actual", findings) | _problem_keys(sb, kb, "expected", findings)
    rows = m.rows()
    status = {r.a: r for r in rows if r.status == "compared"}
    total = sum(_nbytes(a.entry) + _nbytes(b.entry) for _, a, b in m.pairs)
    # Every pair's row blocks, then batches of blocks: one kernel call per batch (per
    # tolerance), with the next batch read while this one is compared (NOTE: [prefetch]).
    # Two batches are in flight, so each holds at most half the budget (both sides).
    step = batch_bytes(budget)
    compared: list[tuple[str, Entry, Entry, tuple[float, float]]] = []
    blocks: list[_Block] = []
    for name, a, b in m.pairs:
        ea, eb = a.entry, b.entry
        if name in bad:
            _skip(status, name, "storage problem")
            continue
        if _placeholder(zero3[0], a) or _placeholder(zero3[1], b):
            findings.append(
                Finding(
                    name,
                    "skipped",
                    "a DeepSpeed ZeRO-3 placeholder (0 elements; the values live in the ZeRO "
                    "optimizer partitions): consolidate with zero_to_fp32.py and compare that",
                )
            )
            _skip(status, name, "ZeRO-3 placeholder")
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
        if ea.dtype != eb.dtype:
            findings.append(Finding(name, "dtype", f"{ea.dtype} in actual, {eb.dtype} in expected"))
        tol = tolerance(ea.dtype, eb.dtype, rtol, atol)
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
    stats = [KeyStats() for _ in compared]
    done = 0
    plan = (
        (batch, [(sa, [w.ra for w in batch]), (sb, [w.rb for w in batch])])
        for batch in batches(blocks, lambda w: w.nbytes, step)
    )
    for batch, (xa, xb) in Prefetcher(dev).run(plan):
        settings = [(*compared[w.pair][3], False) for w in batch]
        boxes = [w.box for w in batch]
        diffs = compare_each(xa, xb, boxes=boxes, settings=settings, equal_nan=equal_nan)
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


def _zero3(info: CheckpointInfo | None) -> bool:
    """DeepSpeed ZeRO-3: its model-state files hold a (0,) stand-in per partitioned parameter."""
    return (
        info is not None
        and info.layout == "deepspeed"
        and (info.parts[0].name.startswith("zero_pp_rank_"))
    )


def _placeholder(zero3: bool, key: matching.CkptKey) -> bool:
    shape = key.entry.shape
    return zero3 and key.role == "model" and len(shape) > 0 and math.prod(shape) == 0


def _skip(status: dict[str | None, MappingRow], name: str, reason: str) -> None:
    row = status.get(name)
    if row is not None:
        row.status, row.reason = "skipped", reason


def _optim_hint(r: matching.CkptKey) -> str:
    if r.role in ("state", "group"):
        return (
            " (the other side holds no such optimizer state; --ignore 'optim.*' compares the "
            "model alone)"
        )
    return ""


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


def _resolve_ids(
    sa: Source, ka: matching.CheckpointKeys, sb: Source, kb: matching.CheckpointKeys
) -> list[str]:
    """Renames integer-id optimizer state on one side to the other side's FQNs.

    A raw ``optimizer.state_dict()`` keys state by position in param_groups; a
    ``get_optimizer_state_dict`` save keys it by FQN, with the same order in its param_groups.
    """
    notes: list[str] = []
    for (s_id, k_id), (s_fqn, k_fqn) in (((sa, ka), (sb, kb)), ((sb, kb), (sa, ka))):
        if not k_id.id_keyed or k_fqn.id_keyed or not k_fqn.state:
            continue
        ids, fqns = _group_params(s_id, k_id), _group_params(s_fqn, k_fqn)
        if ids is None or fqns is None or len(ids) != len(fqns):
            notes.append(
                f"{s_id.description}: optimizer state keyed by integer ids, which "
                "cannot be paired with the other side's parameter names"
            )
            continue
        mapping = dict(zip(ids, fqns))
        _rename_state(k_id, mapping)
        notes.append(
            f"{s_id.description}: optimizer state keyed by integer ids, mapped to the "
            "other side's parameter names in param_groups order"
        )
    return notes


def _group_params(source: Source, keys: matching.CheckpointKeys) -> list[str] | None:
    if keys.groups_by_fqn:
        return None
    params = {g: hp["params"].key for g, hp in keys.groups.items() if "params" in hp}
    if not params:
        return None
    saved = source.read_objects(list(params.values()))
    canon = matching.canonicalizer(keys.model) if keys.model else (lambda n: n)
    return [
        canon(str(p)) for g in sorted(params, key=lambda g: (len(g), g)) for p in saved[params[g]]
    ]


def _rename_state(keys: matching.CheckpointKeys, mapping: dict[str, str]) -> None:
    renamed = {}
    for (who, item), r in keys.state.items():
        fqn = mapping.get(who, who)
        new = matching.CkptKey(
            r.entry, "state", matching.optim_key(fqn, item), fqn, item, r.optimizer
        )
        renamed[(fqn, item)] = new
        keys.rows[keys.rows.index(r)] = new
    keys.state = renamed
    keys.id_keyed = False


def _nbytes(e: Any) -> int:
    return (e.dtype.itemsize if e.dtype is not None else 0) * math.prod(e.shape)
