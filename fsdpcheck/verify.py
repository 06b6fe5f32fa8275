"""fsdpcheck.verify: every rank's shards (model and optimizer) against a reference checkpoint."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpcheck import keys as keymod
from fsdpcheck.box import Box, ravel, unravel
from fsdpcheck.collectives import Comm, KeyStats, combine
from fsdpcheck.kernels import SUPPORTED_DTYPES, TensorDiff, compare
from fsdpcheck.layout import Layout, local_layout
from fsdpcheck.live import describe_error, live_state_dicts, requires_grad_map
from fsdpcheck.report import KINDS, Finding, Report
from fsdpcheck.sources import Entry, Region, Source, open_source
from fsdpcheck.sources.memory import MemorySource

# torch.testing.assert_close's defaults, used when the live and reference dtypes differ and no
# tolerance was given (the float8 rows follow the same rule: a few units in the last place).
DTYPE_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float8_e4m3fn: (0.125, 1e-3),
    torch.float8_e5m2: (0.25, 1e-3),
}
_PRECISION = [torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16, torch.float16,
              torch.float32, torch.float64]  # fmt: skip


def tolerance(
    a: torch.dtype, b: torch.dtype, rtol: float | None, atol: float | None
) -> tuple[float, float]:
    """(rtol, atol) for comparing dtype `a` with `b`.

    As given; else exact for equal dtypes, and torch.testing's defaults for the less precise
    float dtype when they differ.
    """
    if rtol is not None or atol is not None:
        return (rtol or 0.0, atol or 0.0)
    if a == b:
        return (0.0, 0.0)
    floats = [d for d in (a, b) if d in DTYPE_TOLERANCES]
    if not floats:
        return (0.0, 0.0)
    return DTYPE_TOLERANCES[min(floats, key=_PRECISION.index)]


@dataclass
class _Live:
    key: str
    value: Any
    fqn: str
    ckpt_key: str | None = None
    layout: Layout | None = None


@dataclass
class _Work:
    """One piece to compare: a view of live data, its box, and the region of the reference."""

    key_index: int
    actual: torch.Tensor
    box: Box
    region: Region
    rtol: float
    atol: float
    fingerprint: bool
    ref_dtype: torch.dtype = torch.float32


@dataclass
class _State:
    keys: list[str]
    stats: list[KeyStats]
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)
    errors: list[tuple[str, str, str]] = field(default_factory=list)  # key, kind, message
    bytes_read: int = 0


def verify(
    model: torch.nn.Module | Mapping[str, Any],
    reference: Any,
    *,
    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = True,
    check_dtype: bool = True,
    key_map: keymod.KeyMap | None = None,
    memory_budget: int = 1 << 30,
    group: Any = None,
) -> Report:
    """Checks every rank's shards of a model (and optimizer) against a reference checkpoint.

    Collective: every rank of `group` must call it. Each rank reads only the parts of the
    reference that overlap its own shards, in batches of at most `memory_budget` bytes on the
    shards' device, compares them with one fused kernel per batch, and the ranks combine their
    statistics with a constant number of small collectives, so every rank returns the same
    Report. Nothing is gathered and nothing is copied to the CPU.

    Args:
        model: An nn.Module (FSDP2, tensor parallel, 2D, HSDP, DDP or plain) or a state dict of
            DTensors, ShardedTensors or tensors.
        reference: A DCP checkpoint directory, a torch.save file, a .safetensors file / index /
            directory, or an in-memory mapping of full tensors (or a full nn.Module).
        optimizer: The optimizer whose state to verify too (with an nn.Module), or an optimizer
            state dict in ``get_optimizer_state_dict`` form (FQN keys).
        rtol: Relative tolerance; None means exact unless the dtypes differ.
        atol: Absolute tolerance; None means exact unless the dtypes differ.
        equal_nan: Whether NaN matches NaN.
        check_dtype: Whether a dtype difference is a finding (values are compared anyway, with
            torch.testing's default tolerances for the less precise dtype unless given).
        key_map: A callable or dict from live key (model FQN, ``optim.state.<fqn>.<name>``) to
            the checkpoint's key; None (or a missing entry) uses the detected prefix; a key
            mapped to None is not checked.
        memory_budget: Bytes of reference data held at once per rank.
        group: The process group (default: the default group; none needed for one process).

    Returns:
        The Report, identical on every rank.
    """
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget}")
    if (rtol is not None and rtol < 0) or (atol is not None and atol < 0):
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    t0 = time.perf_counter()
    comm = Comm(group)
    v = _Verifier(comm, rtol, atol, equal_nan, check_dtype, key_map, memory_budget)
    return v.run(model, reference, optimizer, t0)


class _Verifier:
    def __init__(
        self,
        comm: Comm,
        rtol: float | None,
        atol: float | None,
        equal_nan: bool,
        check_dtype: bool,
        key_map: keymod.KeyMap | None,
        memory_budget: int,
    ) -> None:
        self.comm = comm
        self.rtol, self.atol = rtol, atol
        self.equal_nan = equal_nan
        self.check_dtype = check_dtype
        self.key_map = key_map
        self.budget = memory_budget
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self.live_requires_grad: dict[str, bool] = {}

    # ---------------------------------------------------------------------------------------
    def run(self, model: Any, reference: Any, optimizer: Any, t0: float) -> Report:
        try:
            source, live, groups, setup_error = self._setup(model, reference, optimizer)
        except Exception as exc:  # whatever happens here, every rank reaches the gather below
            source, live, groups, setup_error = None, [], None, describe_error(exc)
        # Agree before any per-key collective: the same keys and the same checkpoint everywhere.
        fingerprint = _keys_digest(live, source)
        described = source.description if source else str(reference)
        gathered = self.comm.all_gather_object((setup_error, fingerprint, described))
        # Rank 0's description, so that the report is the same everywhere even if some rank
        # could not open the reference.
        report = Report(reference=gathered[0][2], world_size=self.comm.world)
        errors = [(r, e) for r, (e, _, _) in enumerate(gathered) if e]
        if errors:
            ranks = [r for r, _ in errors]
            msg = errors[0][1] + ("" if len(errors) == 1 else f" (and on ranks {ranks[1:]})")
            report.findings = [Finding("*", "error", msg, rank=ranks[0], ranks=ranks)]
            report.seconds = time.perf_counter() - t0
            return report
        if len({fp for _, fp, _ in gathered}) != 1:
            report.findings = [
                Finding(
                    "*",
                    "error",
                    "ranks see different live keys or different checkpoints (is the checkpoint "
                    "on a filesystem every rank shares, and is every rank's model the same?)",
                )
            ]
            report.seconds = time.perf_counter() - t0
            return report
        assert source is not None

        checked = [item for item in live if item.ckpt_key is not None]
        state = _State([item.key for item in checked], [KeyStats() for _ in checked])
        try:
            self._check_values(source, checked, state)
        except Exception as exc:  # a local failure must not leave the other ranks waiting
            state.errors.append(("*", "error", describe_error(exc)))
        if groups is not None:
            try:
                self._check_param_groups(source, groups)
            except Exception as exc:  # local only, but never skip the collectives below
                state.errors.append(("optim.param_groups", "error", describe_error(exc)))
        combined, extras = combine(
            self.comm,
            state.stats,
            (state.errors, state.bytes_read, time.perf_counter() - t0),
        )
        self._value_findings(checked, combined, state)
        for rank, (errs, _, _) in enumerate(extras):
            for key, kind, msg in errs:
                self.findings.append(Finding(key, kind, msg, rank=rank, ranks=[rank]))
        report.findings = _merge_rank_findings(self.findings)
        report.keys_checked = len(checked)
        report.elements_checked = sum(c.counts["numel"] for c in combined)
        report.bytes_read = sum(b for _, b, _ in extras)
        report.seconds = max(s for _, _, s in extras)
        report.notes = self.notes
        source.close()
        return report

    # ---------------------------------------------------------------------------------------
    def _setup(
        self, model: Any, reference: Any, optimizer: Any
    ) -> tuple[Source | None, list[_Live], list[dict] | None, str | None]:
        """Live keys, the source and the key matching; errors become a message, never raise."""
        try:
            msd, osd = live_state_dicts(model, optimizer)
            self.live_requires_grad = requires_grad_map(model)
            source = open_source(reference)
            entries = source.entries()
        except Exception as exc:
            return None, [], None, describe_error(exc)
        classified = keymod.classify(entries)
        live: list[_Live] = []
        model_prefix = keymod.best_prefix(list(msd), list(classified.model))
        matched_model: set[str] = set()
        for fqn in sorted(msd):
            default = keymod.map_with(model_prefix, fqn)
            name = default if default in classified.model else None
            ckpt = classified.model[name].key if name else None
            ckpt = keymod.apply_key_map(self.key_map, fqn, ckpt)
            item = _Live(fqn, msd[fqn], fqn, ckpt)
            live.append(item)
            if ckpt is None:
                if not self._mapped_to_none(fqn):
                    self.findings.append(
                        Finding(
                            fqn,
                            "missing",
                            f"in the model but not in the checkpoint ({len(classified.model)} "
                            "model keys there); pass key_map if the checkpoint names it "
                            "differently",
                        )
                    )
            else:
                matched_model.add(ckpt)
        groups = None
        if osd is not None:
            groups = self._setup_optimizer(osd, classified, live, source)
        elif classified.state:
            self.notes.append(
                f"the checkpoint holds optimizer state for {len({f for f, _ in classified.state})}"
                " parameters; pass optimizer= to verify it too"
            )
        for name, e in sorted(classified.model.items()):
            if e.key not in matched_model and name.startswith(model_prefix[0]):
                self.findings.append(
                    Finding(e.key, "unexpected", "in the checkpoint but not in the model")
                )
        self._check_keys(source, live, entries)
        return source, live, groups, None

    def _mapped_to_none(self, key: str) -> bool:
        """Whether the user's key_map says not to check `key` (maps it to None)."""
        # A default that is not None tells "no entry" (use the detected name) from "None".
        return self.key_map is not None and keymod.apply_key_map(self.key_map, key, "") is None

    def _setup_optimizer(
        self,
        osd: Mapping[str, Any],
        classified: keymod.Classified,
        live: list[_Live],
        source: Source,
    ) -> list[dict]:
        state = osd.get("state", {})
        groups = list(osd.get("param_groups", []))
        live_fqns = [str(f) for f in state] + [str(p) for g in groups for p in g.get("params", [])]
        ckpt_fqns = sorted({f for f, _ in classified.state})
        ckpt_to_live: dict[str, str] = {}
        if (
            ckpt_fqns
            and all(f.isdigit() for f in ckpt_fqns)
            and not all(f.isdigit() for f in live_fqns)
        ):
            # A raw optimizer.state_dict(): integer ids, in param_groups order.
            ids = [
                str(p)
                for g in sorted(classified.groups)
                for p in _read_params(classified.groups[g], source)
            ]
            fqns = [str(p) for g in groups for p in g.get("params", [])]
            ckpt_to_live = dict(zip(ids, fqns))
        else:
            prefix = keymod.best_prefix(sorted(set(live_fqns)), ckpt_fqns)
            inv = {keymod.map_with(prefix, f): f for f in set(live_fqns)}
            ckpt_to_live = {c: inv[c] for c in ckpt_fqns if c in inv}
        live_to_ckpt = {v: k for k, v in ckpt_to_live.items()}
        seen: set[tuple[str, str]] = set()
        for fqn in sorted(state, key=str):
            for name in sorted(state[fqn]):
                value = state[fqn][name]
                key = keymod.optim_key(str(fqn), name)
                ck = live_to_ckpt.get(str(fqn))
                entry = classified.state.get((ck, name)) if ck is not None else None
                ckpt = keymod.apply_key_map(self.key_map, key, entry.key if entry else None)
                if entry is not None:
                    seen.add((ck, name))  # type: ignore[arg-type]
                if not isinstance(value, torch.Tensor):
                    continue  # non-tensor state (rare): nothing to compare element-wise
                live.append(_Live(key, value, str(fqn), ckpt))
                if ckpt is None and not self._mapped_to_none(key):
                    self.findings.append(
                        Finding(
                            key,
                            "missing",
                            f"optimizer state '{name}' of {fqn} is not in the checkpoint",
                        )
                    )
        live_with_state = {str(f) for f in state}
        for ck, name in sorted(classified.state):
            if (ck, name) in seen:
                continue
            fqn = ckpt_to_live.get(ck)
            if fqn is None:
                msg = "optimizer state in the checkpoint for a parameter the model does not have"
            elif fqn not in live_with_state:
                msg = (
                    f"the checkpoint has optimizer state '{name}' for {fqn} but the optimizer "
                    "has no state for it (was the optimizer state loaded?)"
                )
            else:
                msg = (
                    f"optimizer state '{name}' of {fqn} is in the checkpoint, not in the optimizer"
                )
            self.findings.append(Finding(keymod.optim_key(fqn or ck, name), "unexpected", msg))
        self._group_ckpt = classified.groups
        self._group_map = ckpt_to_live
        return groups

    def _check_keys(self, source: Source, live: list[_Live], entries: Mapping[str, Entry]) -> None:
        """Shape, dtype, requires_grad and layout of every matched key (no collectives)."""
        requires_grad = source.requires_grad if isinstance(source, MemorySource) else {}
        for item in live:
            if item.ckpt_key is None:
                continue
            entry = entries.get(item.ckpt_key)
            if entry is None or not entry.is_tensor:
                self.findings.append(
                    Finding(
                        item.key, "missing", f"the checkpoint's {item.ckpt_key!r} is not a tensor"
                    )
                )
                item.ckpt_key = None
                continue
            item.layout = local_layout(item.value, self.comm.world)
            lay = item.layout
            if lay.global_shape != entry.shape:
                self.findings.append(
                    Finding(
                        item.key,
                        "shape",
                        f"global shape {lay.global_shape} in the model but {entry.shape} in the "
                        "checkpoint",
                    )
                )
                item.ckpt_key = None
                continue
            if entry.dtype not in SUPPORTED_DTYPES or lay.dtype not in SUPPORTED_DTYPES:
                self.findings.append(
                    Finding(
                        item.key,
                        "dtype",
                        f"dtype {lay.dtype} (model) / {entry.dtype} (checkpoint) cannot be "
                        "compared element-wise",
                    )
                )
                item.ckpt_key = None
                continue
            if lay.dtype != entry.dtype and self.check_dtype:
                self.findings.append(
                    Finding(
                        item.key,
                        "dtype",
                        f"{lay.dtype} in the model but {entry.dtype} in the checkpoint",
                    )
                )
            rg_name = item.ckpt_key if item.ckpt_key in requires_grad else item.fqn
            live_rg = self.live_requires_grad.get(item.fqn)
            if (
                rg_name in requires_grad
                and live_rg is not None
                and live_rg != requires_grad[rg_name]
                and item.key == item.fqn  # parameters, not optimizer state
            ):
                self.findings.append(
                    Finding(
                        item.key,
                        "requires_grad",
                        f"requires_grad={live_rg} in the model but {requires_grad[rg_name]} in "
                        "the reference",
                    )
                )

    # ---------------------------------------------------------------------------------------
    def _tolerance(self, live: torch.dtype, ref: torch.dtype) -> tuple[float, float]:
        return tolerance(live, ref, self.rtol, self.atol)

    def _check_values(self, source: Source, checked: list[_Live], state: _State) -> None:
        entries = source.entries()
        self._arena = _Arena(self.budget)
        batch: list[_Work] = []
        batch_bytes = 0
        for i, item in enumerate(checked):
            lay = item.layout
            assert lay is not None and item.ckpt_key is not None
            entry = entries[item.ckpt_key]
            tol = self._tolerance(lay.dtype, entry.dtype)  # type: ignore[arg-type]
            state.tolerances[item.key] = tol
            if lay.error is not None:
                state.errors.append((item.key, "layout", lay.error))
                state.stats[i].errors += 1
                continue
            elsize = entry.dtype.itemsize  # type: ignore[union-attr]
            for piece in lay.pieces:
                state.stats[i].holders = 1
                for w in _split(i, piece.tensor, piece.box, item.ckpt_key, elsize, self.budget):
                    w.rtol, w.atol = tol
                    w.ref_dtype = entry.dtype  # type: ignore[assignment]
                    w.fingerprint = lay.replicated
                    nbytes = w.region.numel * elsize
                    if batch and batch_bytes + nbytes > self.budget:
                        self._flush(source, batch, state)
                        batch, batch_bytes = [], 0
                    batch.append(w)
                    batch_bytes += nbytes
        if batch:
            self._flush(source, batch, state)

    def _flush(self, source: Source, batch: list[_Work], state: _State) -> None:
        """Reads one batch of reference regions and compares it, in one fused call per kind."""
        by_device: dict[torch.device, list[_Work]] = {}
        for w in batch:
            by_device.setdefault(w.actual.device, []).append(w)
        for device, works in by_device.items():
            try:
                out = self._arena.carve(device, [(w.region.size, w.ref_dtype) for w in works])
                refs = source.read([w.region for w in works], device, out)
            except Exception as exc:  # unreadable file, out of memory: a finding, not a hang
                msg = f"reading the reference failed: {describe_error(exc)}"
                for key_index in sorted({w.key_index for w in works}):
                    state.stats[key_index].errors += 1
                    state.errors.append((state.keys[key_index], "error", msg))
                continue
            state.bytes_read += sum(r.numel() * r.element_size() for r in refs)
            groups: dict[tuple[float, float, bool], list[int]] = {}
            for j, w in enumerate(works):
                groups.setdefault((w.rtol, w.atol, w.fingerprint), []).append(j)
            for (rtol, atol, fp), idx in groups.items():
                diffs = compare(
                    [works[j].actual for j in idx],
                    [refs[j] for j in idx],
                    rtol=rtol,
                    atol=atol,
                    equal_nan=self.equal_nan,
                    boxes=[works[j].box for j in idx],
                    fingerprints=fp,
                )
                for j, d in zip(idx, diffs):
                    fold(state.stats[works[j].key_index], d, works[j].box)
            del refs

    def _value_findings(self, checked: list[_Live], combined: list, state: _State) -> None:
        for item, c in zip(checked, combined):
            n = c.counts
            lay = item.layout
            assert lay is not None
            if n["mismatched"] > 0:
                rtol, atol = state.tolerances.get(item.key, (0.0, 0.0))
                shape = lay.global_shape
                hints = []
                if n["zeros"] == n["numel"]:
                    hints.append("every live element is zero (zeroed, or never loaded?)")
                if n["nan_a"] != n["nan_e"]:
                    hints.append(f"NaNs: {n['nan_a']} in the model, {n['nan_e']} in the checkpoint")
                self.findings.append(
                    Finding(
                        item.key,
                        "value",
                        "; ".join(hints),
                        mismatched=n["mismatched"],
                        numel=n["numel"],
                        max_abs_diff=c.max_abs if c.max_abs_idx >= 0 else None,
                        max_abs_index=unravel(c.max_abs_idx, shape) if c.max_abs_idx >= 0 else None,
                        rank=c.max_abs_rank if c.max_abs_idx >= 0 else None,
                        max_rel_diff=c.max_rel if c.max_rel_idx >= 0 else None,
                        max_rel_index=unravel(c.max_rel_idx, shape) if c.max_rel_idx >= 0 else None,
                        rel_rank=c.max_rel_rank if c.max_rel_idx >= 0 else None,
                        rtol=rtol,
                        atol=atol,
                    )
                )
            if c.replica_groups:
                majority, *others = c.replica_groups
                self.findings.append(
                    Finding(
                        item.key,
                        "replica",
                        f"copies of the same elements differ across ranks: ranks {majority} "
                        "hold one value, " + "; ".join(f"ranks {g}" for g in others) + " another",
                        rank=others[0][0],
                        ranks=sorted(r for g in c.replica_groups for r in g),
                    )
                )

    def _check_param_groups(self, source: Source, groups: list[dict]) -> None:
        """Hyperparameters of each live param group against the checkpoint's group."""
        ckpt_groups: dict[int, dict[str, Entry]] = getattr(self, "_group_ckpt", {})
        to_live: dict[str, str] = getattr(self, "_group_map", {})
        try:  # every saved hyperparameter in one read
            saved = source.read_objects(
                [e.key for hps in ckpt_groups.values() for e in hps.values()]
            )
        except Exception as exc:
            self.findings.append(
                Finding("optim.param_groups", "error", f"cannot read them: {describe_error(exc)}")
            )
            return
        ckpt_params = {
            cg: {to_live.get(str(p), str(p)) for p in saved.get(hps["params"].key, [])}
            for cg, hps in ckpt_groups.items()
            if "params" in hps
        }
        for gi, g in enumerate(groups):
            live_params = {str(p) for p in g.get("params", [])}
            match = next((cg for cg, ps in ckpt_params.items() if ps == live_params), None)
            if match is None:
                if ckpt_groups:
                    self.findings.append(
                        Finding(
                            keymod.group_key(gi, "params"),
                            "missing",
                            "no param group in the checkpoint has the same parameters",
                        )
                    )
                continue
            for name, value in sorted(g.items()):
                if name == "params":
                    continue
                key = keymod.group_key(gi, name)
                entry = ckpt_groups[match].get(name)
                if entry is None:
                    self.findings.append(
                        Finding(key, "missing", f"'{name}' is not in the checkpoint")
                    )
                elif not _same_hparam(value, saved[entry.key]):
                    self.findings.append(
                        Finding(
                            key,
                            "value",
                            f"{name} is {value!r} in the optimizer but {saved[entry.key]!r} in "
                            "the checkpoint",
                        )
                    )


# -------------------------------------------------------------------------------------------
def _read_params(hps: Mapping[str, Entry], source: Source) -> list:
    entry = hps.get("params")
    return [] if entry is None else list(source.read_objects([entry.key])[entry.key])


def _same_hparam(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        try:
            return bool(torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()))
        except Exception:
            return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_hparam(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _split(
    key_index: int, t: torch.Tensor, box: Box, ckpt_key: str, elsize: int, budget: int
) -> list[_Work]:
    """A piece as works of at most `budget` reference bytes, cut along dim 0."""
    assert box.offset is not None
    size = tuple(t.shape)
    numel = t.numel()
    if t.dim() == 0 or numel * elsize <= budget or size[0] <= 1:
        return [_Work(key_index, t, box, Region(ckpt_key, box.offset, size), 0.0, 0.0, False)]
    row = numel // size[0] * elsize
    rows = max(1, budget // row)
    out = []
    for r0 in range(0, size[0], rows):
        r1 = min(size[0], r0 + rows)
        off = (box.offset[0] + r0, *box.offset[1:])
        sub = Box(box.shape, off)
        out.append(
            _Work(
                key_index, t[r0:r1], sub, Region(ckpt_key, off, (r1 - r0, *size[1:])), 0, 0, False
            )
        )
    return out


class _Arena:
    """One reusable buffer per device that every batch's reference regions are carved from.

    NOTE: [arena] Allocating fresh buffers for every batch costs a page fault per 4 KiB on the
    CPU (more than the comparison itself) and allocator churn on the GPU; one buffer of at most
    the memory budget, reused, costs that once.
    """

    _ALIGN = 64  # bytes: keeps every region 16-byte aligned for vector loads

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def carve(
        self, device: torch.device, specs: list[tuple[tuple[int, ...], torch.dtype]]
    ) -> list[torch.Tensor]:
        sizes = []
        total = 0
        for shape, dtype in specs:
            n = dtype.itemsize * math.prod(shape)
            sizes.append(n)
            total += -(-n // self._ALIGN) * self._ALIGN
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < total:
            self.buffers.pop(device, None)  # free the old one first
            buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
            self.buffers[device] = buf
        out, off = [], 0
        for (shape, dtype), n in zip(specs, sizes):
            out.append(buf[off : off + n].view(dtype).view(shape))
            off += -(-n // self._ALIGN) * self._ALIGN
        return out


def fold(s: KeyStats, d: TensorDiff, box: Box) -> None:
    """Adds one comparison result to a key's statistics (maxima by global linear index)."""
    s.numel += d.numel
    s.mismatched += d.mismatched
    s.nan_a += d.nan_actual
    s.nan_e += d.nan_expected
    s.inf_a += d.inf_actual
    s.inf_e += d.inf_expected
    s.zeros += d.zeros or 0
    for attr, value, index in (
        ("abs", d.max_abs_diff, d.max_abs_index),
        ("rel", d.max_rel_diff, d.max_rel_index),
    ):
        if index is None:
            continue
        lin = ravel(index, box.shape)
        cur, cur_idx = getattr(s, f"max_{attr}"), getattr(s, f"max_{attr}_idx")
        if value > cur or (value == cur and (cur_idx < 0 or lin < cur_idx)):
            setattr(s, f"max_{attr}", value)
            setattr(s, f"max_{attr}_idx", lin)
    if d.fingerprint_actual is not None:
        s.replica_fp = ((s.replica_fp or 0) + d.fingerprint_actual) % (1 << 64)
        if s.replica_box < 0:
            assert box.offset is not None
            s.replica_box = ravel(box.offset, box.shape)


def _keys_digest(live: list[_Live], source: Source | None) -> str:
    h = hashlib.sha256()
    for item in live:
        h.update(f"{item.key}\0{item.ckpt_key}\0".encode())
    if source is not None:
        for key in sorted(source.entries()):
            h.update(key.encode())
    return h.hexdigest()


def _merge_rank_findings(findings: list[Finding]) -> list[Finding]:
    """One finding per (key, kind, message), with every rank it happened on; sorted."""
    merged: dict[tuple[str, str, str], Finding] = {}
    out: list[Finding] = []
    for f in findings:
        if f.kind in ("error", "layout") and f.ranks:
            k = (f.key, f.kind, f.message)
            if k in merged:
                merged[k].ranks = sorted(set(merged[k].ranks) | set(f.ranks))
                continue
            merged[k] = f
        out.append(f)
    order = {k: i for i, k in enumerate(KINDS)}
    out.sort(key=lambda f: (f.key, order.get(f.kind, 99)))
    return out
