"""A float64/numpy reference for the kernels, written from docs/kernel-api.md (its semantics)
and docs/fingerprint-v1.md, not from the C++ code."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

M32 = np.uint64(0xFFFFFFFF)
KEY_ADD = np.uint64(0x9E3779B97F4A7C15)
KEY_MUL = np.uint64(0xD6E8FEB86659FD93)
INTEGER_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool}
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fmix32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) & M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & M32
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & M32
    x ^= x >> np.uint64(16)
    return x


def raw_bits(t: torch.Tensor) -> np.ndarray:
    """Raw bits of each element (local row-major order), zero-extended into uint64."""
    size = t.element_size()
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_BITS_VIEW[size]).numpy()
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    return bits.view(unsigned).astype(np.uint64)


def global_indices(local_shape: tuple[int, ...], gshape: tuple[int, ...], offset: tuple[int, ...]):
    """Global row-major linear index of each local element, in local row-major order."""
    if len(local_shape) == 0:
        return np.zeros(1, dtype=np.uint64)
    strides = []
    acc = 1
    for g in reversed(gshape):
        strides.append(acc)
        acc *= g
    strides = list(reversed(strides))
    lin = np.zeros(local_shape, dtype=np.uint64)
    for d, (s, o) in enumerate(zip(local_shape, offset)):
        shape = [1] * len(local_shape)
        shape[d] = s
        coords = (np.arange(s, dtype=np.uint64) + np.uint64(o)) * np.uint64(strides[d])
        lin = lin + coords.reshape(shape)
    return lin.reshape(-1)


def fingerprint(t: torch.Tensor, gshape=None, offset=None) -> int:
    """Fingerprint v1 exactly as docs/fingerprint-v1.md defines it."""
    gshape = tuple(t.shape) if gshape is None else tuple(gshape)
    offset = (0,) * t.dim() if offset is None else tuple(offset)
    if t.numel() == 0:
        return 0
    v = raw_bits(t)
    i = global_indices(tuple(t.shape), gshape, offset)
    with np.errstate(over="ignore"):
        key = (i + KEY_ADD) * KEY_MUL
    kl, kh = key & M32, key >> np.uint64(32)
    if t.element_size() < 8:
        h = (fmix32(kh ^ v) << np.uint64(32)) | fmix32(kl ^ v)
    else:
        lo, hi = v & M32, v >> np.uint64(32)
        h = (fmix32(fmix32(kh ^ hi) ^ lo) << np.uint64(32)) | fmix32(fmix32(kl ^ lo) ^ hi)
    with np.errstate(over="ignore"):
        return int(np.sum(h, dtype=np.uint64))


@dataclass
class RefDiff:
    numel: int
    mismatched: int
    nan_actual: int
    nan_expected: int
    inf_actual: int
    inf_expected: int
    max_abs_diff: float
    max_abs_linear: int | None
    max_rel_diff: float
    max_rel_linear: int | None
    fingerprint_actual: int
    fingerprint_expected: int
    sum: float
    sumsq: float
    zeros: int


def _values(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).contiguous().reshape(-1).numpy()


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.detach().cpu().to(torch.int64).reshape(-1).tolist()]


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    equal_nan: bool = True,
    gshape=None,
    offset=None,
) -> RefDiff:
    """The kernel contract, element by element, in float64 (exact integers for int pairs)."""
    gshape = tuple(actual.shape) if gshape is None else tuple(gshape)
    offset = (0,) * actual.dim() if offset is None else tuple(offset)
    a, e = _values(actual), _values(expected)
    gidx = global_indices(tuple(actual.shape), gshape, offset).astype(np.int64)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    inf_a, inf_e = np.isinf(a), np.isinf(e)
    any_nan = nan_a | nan_e
    if actual.dtype in INTEGER_DTYPES and expected.dtype in INTEGER_DTYPES:
        ia, ie = _ints(actual), _ints(expected)
        equal = np.array([x == y for x, y in zip(ia, ie)], dtype=bool)
        diff = np.array([float(abs(x - y)) for x, y in zip(ia, ie)], dtype=np.float64)
    else:
        with np.errstate(invalid="ignore"):
            equal = a == e
            diff = np.abs(a - e)
    inf_any = inf_a | inf_e
    mag = np.abs(e)
    with np.errstate(invalid="ignore", divide="ignore"):
        abs_d = np.where(equal, 0.0, np.where(inf_any, np.inf, diff))
        rel_d = np.where(
            equal, 0.0, np.where((mag == 0) | inf_e, np.inf, abs_d / np.where(mag == 0, 1, mag))
        )
        within = abs_d <= atol + rtol * mag
    mismatch = np.where(any_nan, ~(nan_a & nan_e & equal_nan), ~equal & (inf_any | ~within))
    valid = ~any_nan

    def best(d: np.ndarray) -> tuple[float, int | None]:
        if not valid.any():
            return 0.0, None
        dv = d[valid]
        m = dv.max()
        return float(m), int(gidx[valid][dv == m].min())

    with np.errstate(invalid="ignore", over="ignore"):
        total, total_sq = float(a.sum()), float((a * a).sum())
    max_abs, abs_idx = best(abs_d)
    max_rel, rel_idx = best(rel_d)
    return RefDiff(
        numel=actual.numel(),
        mismatched=int(mismatch.sum()),
        nan_actual=int(nan_a.sum()),
        nan_expected=int(nan_e.sum()),
        inf_actual=int(inf_a.sum()),
        inf_expected=int(inf_e.sum()),
        max_abs_diff=max_abs,
        max_abs_linear=abs_idx,
        max_rel_diff=max_rel,
        max_rel_linear=rel_idx,
        fingerprint_actual=fingerprint(actual, gshape, offset),
        fingerprint_expected=fingerprint(expected, gshape, offset),
        sum=total,
        sumsq=total_sq,
        zeros=int((a == 0).sum()),
    )


def linear(index: tuple[int, ...] | None, gshape: tuple[int, ...]) -> int | None:
    """Row-major linear index of a multi-index (None stays None)."""
    if index is None:
        return None
    out = 0
    for i, g in zip(index, gshape):
        out = out * g + i
    return out
