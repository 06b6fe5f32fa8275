"""The public kernel API: fused multi-tensor compare and Fingerprint v1.

These functions check their inputs, group them by device and make one operator call per device;
the operators read every input exactly once.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdpcheck import ops
from fsdpcheck._ext import _C
from fsdpcheck.box import Box, unravel

__all__ = [
    "KERNEL_DTYPES",
    "SUPPORTED_DTYPES",
    "KernelDType",
    "TensorDiff",
    "build_info",
    "compare",
    "fingerprint_tensor",
    "fingerprint_tensors",
]


@dataclass(frozen=True, slots=True)
class KernelDType:
    """One dtype the compiled kernels compare, as the extension's dtype table lists it.

    Attributes:
        name: torch's name for it (``getattr(torch, name)`` is the dtype).
        code: Its code in the kernels' metadata (not stored in any file format).
        size: Bytes per element.
        kind: ``"float"`` (NaN and infinities possible), ``"int"`` or ``"bool"``.
    """

    name: str
    code: int
    size: int
    kind: str

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype."""
        return getattr(torch, self.name)  # type: ignore[no-any-return]


def _parse_dtype(detail: str) -> KernelDType:
    # "float64 code=0 size=8 kind=float" (module.cpp's dtype_lines).
    name, *fields = detail.split()
    kv = {k: v for k, _, v in (f.partition("=") for f in fields)}
    return KernelDType(name, int(kv["code"]), int(kv["size"]), kv["kind"])


# NOTE: [one dtype table] The dtypes come from the extension (csrc/fsdpcheck/dtypes.h, through
# build_info), in the table's order: every per-dtype table in Python (tolerances, sentinels, the
# safetensors names) is tested against this tuple, so a dtype added to the C++ table cannot be
# missing from them unnoticed.
KERNEL_DTYPES: tuple[KernelDType, ...] = tuple(
    _parse_dtype(detail)
    for name, _, detail in (line.partition("\t") for line in _C.build_info().splitlines())
    if name == "dtype"
)
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(k.dtype for k in KERNEL_DTYPES)

#: Fingerprint v1 arithmetic is modulo 2**64.
MASK64 = (1 << 64) - 1
# Columns of an operator row, bound once from ops.COLUMNS (the one definition in Python).
_MISMATCHED, _NAN_A, _NAN_E = (ops.COLUMNS[c] for c in ("mismatched", "nan_actual", "nan_expected"))
_INF_A, _INF_E, _ZEROS = (ops.COLUMNS[c] for c in ("inf_actual", "inf_expected", "zeros"))
_FP_A, _FP_E = ops.COLUMNS["fingerprint_actual"], ops.COLUMNS["fingerprint_expected"]
_ABS_DIFF, _ABS_INDEX = ops.COLUMNS["max_abs_diff"], ops.COLUMNS["max_abs_index"]
_REL_DIFF, _REL_INDEX = ops.COLUMNS["max_rel_diff"], ops.COLUMNS["max_rel_index"]
_SUM, _SUMSQ = ops.COLUMNS["sum"], ops.COLUMNS["sumsq"]


@dataclass(slots=True)
class TensorDiff:
    """What ``compare`` found for one pair of tensors.

    Indices are global multi-indices in the pair's box (the whole tensor when no box was given).
    Differences are taken over the elements where neither side is NaN; when there is no such
    element (an empty or all-NaN tensor) both maxima are 0.0 and their indices are None. Ties go
    to the smallest global index.

    Attributes:
        numel: Number of elements compared.
        mismatched: Elements failing ``|a - e| <= atol + rtol * |e|`` (NaN and infinity rules in
            docs/kernel-api.md).
        nan_actual: NaNs in ``actual``.
        nan_expected: NaNs in ``expected``.
        inf_actual: Infinities in ``actual``.
        inf_expected: Infinities in ``expected``.
        max_abs_diff: Greatest ``|a - e|``.
        max_abs_index: Global index of ``max_abs_diff``.
        max_rel_diff: Greatest ``|a - e| / |e|`` (inf where ``e`` is 0 or infinite and ``a != e``).
        max_rel_index: Global index of ``max_rel_diff``.
        fingerprint_actual: Fingerprint v1 of ``actual`` at its box, or None if not computed.
        fingerprint_expected: Fingerprint v1 of ``expected`` at the same box, or None.
        sum: Sum of ``actual`` in float64, or None if statistics were not computed.
        sumsq: Sum of squares of ``actual`` in float64, or None.
        zeros: Number of elements of ``actual`` equal to zero, or None.
    """

    numel: int
    mismatched: int
    nan_actual: int
    nan_expected: int
    inf_actual: int
    inf_expected: int
    max_abs_diff: float
    max_abs_index: tuple[int, ...] | None
    max_rel_diff: float
    max_rel_index: tuple[int, ...] | None
    fingerprint_actual: int | None
    fingerprint_expected: int | None
    sum: float | None
    sumsq: float | None
    zeros: int | None

    @property
    def ok(self) -> bool:
        """True when no element mismatched."""
        return self.mismatched == 0


def compare(
    actual: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    equal_nan: bool = True,
    boxes: Sequence[Box | None] | None = None,
    fingerprints: bool = True,
    stats: bool = True,
) -> list[TensorDiff]:
    """Compares many pairs of tensors in one pass over each input.

    An element mismatches unless ``|a - e| <= atol + rtol * |e|`` in float64. Equal infinities
    match, an infinity matches nothing else, NaN matches NaN only when ``equal_nan``, and integer
    pairs are compared exactly. The defaults (``rtol = atol = 0``) ask for exact equality: a
    checkpoint load is a copy.

    Args:
        actual: Tensors to check (e.g. the local shards after a load).
        expected: Reference tensors, pairwise of the same shape and device as ``actual``; dtypes
            may differ. Non-contiguous views (a slice of a full reference) are read in place.
        rtol: Relative tolerance (>= 0).
        atol: Absolute tolerance (>= 0).
        equal_nan: Whether NaN in both tensors at the same place counts as a match.
        boxes: Per pair, where the tensors sit in their global tensor (``None`` entries, or
            ``boxes=None``, mean the tensor is the whole tensor). Indices in the result and the
            fingerprints are global.
        fingerprints: Compute Fingerprint v1 of both sides. ``False`` is the fastest mode.
        stats: Compute ``sum``, ``sumsq`` and ``zeros`` of ``actual``.

    Returns:
        One ``TensorDiff`` per pair, in order.

    Raises:
        TypeError: A non-tensor input, an unsupported dtype (complex, ...) or a DTensor.
        ValueError: Lists of different lengths, a pair with different shapes or devices, a box
            that does not contain its tensor, a negative tolerance.
    """
    actual, expected = list(actual), list(expected)
    _check_tolerance(rtol, atol)
    resolved, devices = _check_pairs(actual, expected, boxes)
    whole = len(devices) == 1  # one device: the lists as given, no copies
    launched = [
        _Launch(
            idx,
            _launch_compare(
                actual,
                expected,
                None if whole else idx,
                resolved,
                rtol,
                atol,
                equal_nan,
                fingerprints,
                stats,
            ),
            fingerprints,
            stats,
        )
        for idx in devices.values()
    ]
    return _collect(actual, resolved, launched)


def fingerprint_tensors(
    tensors: Sequence[torch.Tensor], *, boxes: Sequence[Box | None] | None = None
) -> list[int]:
    """Fingerprint v1 of many tensors in one pass.

    Args:
        tensors: Local tensors, any supported dtype, any device, any strides.
        boxes: Per tensor, where it sits in its global tensor (``None``: the whole tensor).
            Fingerprints of disjoint boxes that tile a tensor add up, mod 2**64, to the whole
            tensor's fingerprint.

    Returns:
        One int in ``[0, 2**64)`` per tensor.

    Raises:
        TypeError: A non-tensor or unsupported dtype.
        ValueError: A box that does not contain its tensor.
    """
    tensors = list(tensors)
    box_list = _check_boxes(boxes, len(tensors), "fingerprint_tensors")
    for i, t in enumerate(tensors):
        _check_tensor(t, "tensors", i, "fingerprint_tensors")
        if t.device.type == "cuda":
            _check_aligned(t, "tensors", i, "fingerprint_tensors")
    resolved = [
        _resolve_box(t, b, i, "fingerprint_tensors")
        for i, (t, b) in enumerate(zip(tensors, box_list))
    ]
    out = [0] * len(tensors)
    groups = list(_group_by_device(tensors).values())
    tables = []
    for idx in groups:
        group = [tensors[i] for i in idx]
        with torch.no_grad():
            tables.append(
                ops.fingerprint_rows(group, *ops.flat_boxes(group, [resolved[i] for i in idx]))
            )
    for idx, values in zip(groups, _to_host(tables)):
        for i, v in zip(idx, values.tolist()):
            out[i] = v & MASK64
    return out


def compare_each(
    actual: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    *,
    boxes: Sequence[Box | None],
    settings: Sequence[tuple[float, float, bool]],
    equal_nan: bool = True,
) -> list[TensorDiff]:
    """``compare`` with a (rtol, atol, fingerprints) setting per pair, results in input order.

    One fused call per distinct setting and device (a batch of reads usually has one or two), all
    launched before any result is read back (NOTE: [one read-back]).
    """
    actual, expected, settings = list(actual), list(expected), list(settings)
    if len(settings) != len(actual):
        raise ValueError(
            f"fsdpcheck.compare: got {len(actual)} actual tensors but {len(settings)} settings"
        )
    resolved, _ = _check_pairs(actual, expected, boxes)
    groups: dict[tuple[tuple[float, float, bool], torch.device], list[int]] = {}
    for j, setting in enumerate(settings):
        groups.setdefault((setting, actual[j].device), []).append(j)
    launched = []
    for ((rtol, atol, fp), _), idx in groups.items():
        _check_tolerance(rtol, atol)
        table = _launch_compare(actual, expected, idx, resolved, rtol, atol, equal_nan, fp, True)
        launched.append(_Launch(idx, table, fp, True))
    return _collect(actual, resolved, launched)


def fingerprint_tensor(t: torch.Tensor, *, box: Box | None = None) -> int:
    """Fingerprint v1 of one tensor at its box (see ``fingerprint_tensors``)."""
    return fingerprint_tensors([t], boxes=[box])[0]


def build_info() -> dict[str, object]:
    """Which backends were compiled, and for which torch.

    Returns:
        A dict with ``backends`` (backend name -> details, e.g. ``{"cpu": "simd=x86-64-v3"}``),
        ``torch_built_against``, ``row_layout`` (field -> word of a compare row, read from the
        C++ struct), ``dtypes`` (name -> its ``code``, ``size`` in bytes and ``kind``, for every
        compiled dtype, from the C++ dtype table), ``torch`` (the running version) and
        ``cuda_available``.
    """
    backends: dict[str, str] = {}
    built_against = ""
    row: dict[str, int] = {}
    dtypes: dict[str, dict[str, object]] = {}
    for line in _C.build_info().splitlines():
        name, _, detail = line.partition("\t")
        if name == "torch":
            built_against = detail
        elif name == "row":
            row = {f: int(w) for f, _, w in (item.partition("=") for item in detail.split())}
        elif name == "dtype":
            k = _parse_dtype(detail)
            dtypes[k.name] = {"code": k.code, "size": k.size, "kind": k.kind}
        else:
            backends[name] = detail
    return {
        "backends": backends,
        "torch_built_against": built_against,
        "row_layout": row,
        "dtypes": dtypes,
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }


def _check_tensor(t: object, side: str, i: int, fn: str) -> None:
    # The common case, checked without the slower generic tests below (the operator checks the
    # layout again, so a sparse tensor still gets its clear error).
    if (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.dtype in SUPPORTED_DTYPES  # type: ignore[attr-defined]
        and not t.is_meta  # type: ignore[attr-defined]
        and t.is_sparse is False  # type: ignore[attr-defined]
    ):
        return
    where = f"{side}[{i}]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fsdpcheck.{fn}: {where} is a {type(t).__name__}, not a torch.Tensor")
    if _is_dtensor(t):
        raise TypeError(
            f"fsdpcheck.{fn}: {where} is a DTensor; pass its local tensor (t.to_local()) with its "
            "Box, or use fsdpcheck.verify, which works out the boxes from the placements"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"fsdpcheck.{fn}: {where} has dtype {t.dtype}, which is not supported (supported: "
            + ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
            + ")"
        )
    if t.layout != torch.strided:
        raise TypeError(f"fsdpcheck.{fn}: {where} has layout {t.layout}; only strided tensors")
    if t.device.type == "meta":
        raise ValueError(f"fsdpcheck.{fn}: {where} is on the meta device and holds no data")


def _check_aligned(t: torch.Tensor, side: str, i: int, fn: str) -> None:
    # The CUDA kernels read whole elements: one that straddles its alignment faults and takes
    # the CUDA context down. torch never allocates such memory, but a view of a byte buffer
    # (DLPack, frombuffer) can start anywhere. The operator checks again, by group index.
    if t.numel() and t.data_ptr() % t.element_size():
        raise ValueError(
            f"fsdpcheck.{fn}: {side}[{i}] on {t.device} starts at byte address {t.data_ptr():#x}, "
            f"not a multiple of its element size ({t.element_size()} bytes), which the CUDA "
            "kernels cannot read; pass a copy (tensor.clone())"
        )


def _is_dtensor(t: torch.Tensor) -> bool:
    # A DTensor exists only once torch.distributed.tensor is imported; importing it (through
    # _compat) just to say "no" would add ~0.6 s to the start-up of callers that never use one.
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from fsdpcheck import _compat

    return _compat.is_dtensor(t)


def _check_tolerance(rtol: float, atol: float) -> None:
    if not (rtol >= 0.0 and atol >= 0.0):
        raise ValueError(f"fsdpcheck.compare: rtol and atol must be >= 0, got {rtol}, {atol}")


def _check_pairs(
    actual: list[torch.Tensor], expected: list[torch.Tensor], boxes: Sequence[Box | None] | None
) -> tuple[list[Box | None], dict[torch.device, list[int]]]:
    """The checked boxes of the pairs, and the pairs grouped by device (input order kept)."""
    if len(actual) != len(expected):
        raise ValueError(
            f"fsdpcheck.compare: got {len(actual)} actual tensors but {len(expected)} expected"
        )
    box_list = _check_boxes(boxes, len(actual), "compare")
    # One pass: check each pair and group by device. Messages are formatted only on error:
    # this loop runs for every tensor, often thousands of times.
    groups: dict[torch.device, list[int]] = {}
    for i, (a, e) in enumerate(zip(actual, expected)):
        _check_tensor(a, "actual", i, "compare")
        _check_tensor(e, "expected", i, "compare")
        if a.shape != e.shape:
            raise ValueError(
                f"fsdpcheck.compare: pair {i} has shapes {tuple(a.shape)} (actual) and "
                f"{tuple(e.shape)} (expected)"
            )
        dev = a.device
        if e.device != dev:
            raise ValueError(
                f"fsdpcheck.compare: pair {i} is on {a.device} (actual) and {e.device} "
                "(expected); move both to one device"
            )
        if dev.type == "cuda":
            _check_aligned(a, "actual", i, "compare")
            _check_aligned(e, "expected", i, "compare")
        groups.setdefault(dev, []).append(i)
    resolved = [_resolve_box(a, b, i, "compare") for i, (a, b) in enumerate(zip(actual, box_list))]
    return resolved, groups


@dataclass(slots=True)
class _Launch:
    """One operator call of a compare: its pairs (positions in the caller's lists), its table."""

    idx: list[int]
    table: torch.Tensor
    fingerprints: bool
    stats: bool


def _launch_compare(
    actual: list[torch.Tensor],
    expected: list[torch.Tensor],
    idx: list[int] | None,
    resolved: list[Box | None],
    rtol: float,
    atol: float,
    equal_nan: bool,
    fingerprints: bool,
    stats: bool,
) -> torch.Tensor:
    """Queues fsdpcheck::compare on the pairs `idx` (None: all); the table is not read back."""
    a = actual if idx is None else [actual[i] for i in idx]
    e = expected if idx is None else [expected[i] for i in idx]
    boxes = resolved if idx is None else [resolved[i] for i in idx]
    with torch.no_grad():
        return ops.compare_rows(
            a, e, *ops.flat_boxes(a, boxes), rtol, atol, equal_nan, fingerprints, stats
        )


def _collect(
    actual: list[torch.Tensor], resolved: list[Box | None], launched: list[_Launch]
) -> list[TensorDiff]:
    """The TensorDiffs of every launch, in input order, after one read-back per device."""
    out: list[TensorDiff | None] = [None] * len(actual)
    for launch, table in zip(launched, _to_host([x.table for x in launched])):
        for i, words, floats in zip(launch.idx, table.tolist(), table.view(torch.float64).tolist()):
            out[i] = _to_diff(
                actual[i], resolved[i], words, floats, launch.fingerprints, launch.stats
            )
    return out  # type: ignore[return-value]  # every pair is in exactly one launch


def _to_host(tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tables on the CPU, read back with one wait per device.

    NOTE: [one read-back] The host waits for a GPU's results once per call, after every group of
    the call (each tolerance setting is one launch) has been queued: the GPU runs the launches
    back to back, and the read-ahead's copy of the next batch, queued from a reader thread, runs
    beside them (NOTE: [prefetch]). A wait per group would idle the GPU between groups.
    """
    out = list(tables)
    by_device: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tables):
        if t.device.type != "cpu":
            by_device.setdefault(t.device, []).append(k)
    for ks in by_device.values():
        host = torch.cat([tables[k] for k in ks]).cpu() if len(ks) > 1 else tables[ks[0]].cpu()
        for k, part in zip(ks, host.split([tables[k].shape[0] for k in ks])):
            out[k] = part
    return out


def diffs_from_rows(
    tensors: Sequence[torch.Tensor],
    boxes: Sequence[Box | None],
    table: torch.Tensor,
    *,
    fingerprints: bool = True,
    stats: bool = True,
) -> list[TensorDiff]:
    """The TensorDiffs of a table of ``compare`` rows (``ops.COLUMNS``), one per tensor.

    For the rows of the testing operators (``ops.testing_rows``); ``compare`` decodes its own.
    """
    (host,) = _to_host([table])
    return [
        _to_diff(t, b, words, floats, fingerprints, stats)
        for t, b, words, floats in zip(
            tensors, boxes, host.tolist(), host.view(torch.float64).tolist()
        )
    ]


def _check_boxes(boxes: Sequence[Box | None] | None, n: int, fn: str) -> list[Box | None]:
    if boxes is None:
        return [None] * n
    box_list = list(boxes)
    if len(box_list) != n:
        raise ValueError(f"fsdpcheck.{fn}: got {n} tensors but {len(box_list)} boxes")
    for i, b in enumerate(box_list):
        if b is not None and not isinstance(b, Box):
            raise TypeError(f"fsdpcheck.{fn}: boxes[{i}] is a {type(b).__name__}, not a Box")
    return box_list


def _resolve_box(t: torch.Tensor, box: Box | None, i: int, fn: str) -> Box | None:
    """The checked box of tensor i; None (the whole tensor) stays None."""
    if box is None:
        return None
    if not box.contains(tuple(t.shape)):
        raise ValueError(
            f"fsdpcheck.{fn}: boxes[{i}] (global shape {box.shape}, offset {box.offset}) does not "
            f"contain a local tensor of shape {tuple(t.shape)}"
        )
    if math.prod(box.shape) >= 1 << 63:
        raise ValueError(f"fsdpcheck.{fn}: boxes[{i}] has a global shape of 2**63 elements or more")
    return box


def _group_by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups


def _to_diff(
    t: torch.Tensor,
    box: Box | None,
    words: list[int],
    floats: list[float],
    fingerprints: bool,
    stats: bool,
) -> TensorDiff:
    """One output row of the operator (columns: ops.COLUMNS) as a TensorDiff."""
    # Positional, with the column numbers bound once at import: this runs once per tensor,
    # often thousands of times.
    shape = t.shape if box is None else box.shape
    abs_i, rel_i = words[_ABS_INDEX], words[_REL_INDEX]
    return TensorDiff(
        t.numel(),
        words[_MISMATCHED],
        words[_NAN_A],
        words[_NAN_E],
        words[_INF_A],
        words[_INF_E],
        floats[_ABS_DIFF] if abs_i >= 0 else 0.0,
        unravel(abs_i, shape) if abs_i >= 0 else None,
        floats[_REL_DIFF] if rel_i >= 0 else 0.0,
        unravel(rel_i, shape) if rel_i >= 0 else None,
        words[_FP_A] & MASK64 if fingerprints else None,
        words[_FP_E] & MASK64 if fingerprints else None,
        floats[_SUM] if stats else None,
        floats[_SUMSQ] if stats else None,
        words[_ZEROS] if stats else None,
    )
