"""Test inputs: tensors with special values, planted differences, boxes and strided layouts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

import fsdpcheck
from fsdpcheck.kernels import KERNEL_DTYPES
from tests import reference

# Every compiled dtype, in the order of the C++ table (csrc/fsdpcheck/dtypes.h): a dtype added
# there runs through every test that takes these lists.
FLOAT_DTYPES = [k.dtype for k in KERNEL_DTYPES if k.kind == "float"]
INT_DTYPES = [k.dtype for k in KERNEL_DTYPES if k.kind != "float"]  # bool included
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
# Sizes around the CPU block (512), a warp/block of threads, and the chunk (65536).
EDGE_SIZES = [0, 1, 2, 3, 7, 31, 32, 33, 255, 256, 257, 511, 512, 513, 1023, 1025]
CHUNK = 1 << 16


def dtype_grid(
    variants: list[Any], *, variant_first: bool = False, each_size: bool = True
) -> list[Any]:
    """``pytest.param(dtype, variant)`` for every dtype and variant, a few of them in the fast loop.

    scripts/test.sh --fast runs, with `each_size`, each variant with one dtype of each element
    size (the vector lanes and block strides of the kernels depend on the size), the dtype
    taken in turn within a size and the turn offset by one from size to size, so that each
    variant meets floating and integer dtypes and every dtype is in one pair at least; without
    it, the j-th variant with the j-th floating and the j-th integer dtype (for a test whose
    dtypes the loop covers elsewhere). The other pairs are marked slow: the whole suite runs all
    of them. Ids are ``dtype-variant`` (``variant-dtype``, the variant varying slowest, with
    `variant_first`).
    """
    if each_size:
        by_size: dict[int, list[torch.dtype]] = {}
        for d in ALL_DTYPES:
            by_size.setdefault(d.itemsize, []).append(d)
        fast = {
            (same[(j + c) % len(same)], v)
            for c, same in enumerate(by_size.values())
            for j, v in enumerate(variants)
        }
        for same in by_size.values():
            for k, d in enumerate(same):
                if not any(fd == d for fd, _ in fast):
                    fast.add((d, variants[k % len(variants)]))
    else:
        fast = {
            (kind[j % len(kind)], v)
            for kind in (FLOAT_DTYPES, INT_DTYPES)
            for j, v in enumerate(variants)
        }
    pairs = (
        [(d, v) for v in variants for d in ALL_DTYPES]
        if variant_first
        else [(d, v) for d in ALL_DTYPES for v in variants]
    )
    return [
        pytest.param(
            d,
            v,
            id=f"{v}-{d}" if variant_first else f"{d}-{v}",
            marks=() if (d, v) in fast else pytest.mark.slow,
        )
        for d, v in pairs
    ]


def make_values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values of `dtype` covering its range, with special values sprinkled in."""
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype in INT_DTYPES:
        info = torch.iinfo(dtype)
        # torch.randint's high is exclusive and must fit in int64.
        lo, hi = info.min, info.max
        t = torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64)
        if dtype == torch.int64 and n > 0:
            # Values past 2**53, where float64 cannot tell neighbours apart.
            flat = t.reshape(-1)
            k = max(1, n // 7)
            pos = torch.randint(0, n, (k,), generator=gen)
            flat[pos] = (1 << 62) + torch.randint(0, 4, (k,), generator=gen)
        return t.to(dtype)
    scale = 3.0 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 100.0
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    t = t.to(dtype)
    if n > 0:
        flat = t.reshape(-1)
        k = max(1, n // 11)
        specials = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), _tiny(dtype)]
        for _ in range(k):
            i = int(torch.randint(0, n, (1,), generator=gen))
            v = specials[int(torch.randint(0, len(specials), (1,), generator=gen))]
            flat[i] = v
    return t


def _tiny(dtype: torch.dtype) -> float:
    """The smallest positive subnormal of dtype (flush-to-zero modes would lose it)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps  # 2**(emin - mantissa bits)


def perturb(t: torch.Tensor, k: int, gen: torch.Generator, rtol: float) -> torch.Tensor:
    """A copy of t with k elements changed: small relative changes, large ones and specials."""
    out = t.clone()
    n = t.numel()
    if n == 0 or k == 0:
        return out
    flat = out.reshape(-1)
    for _ in range(k):
        i = int(torch.randint(0, n, (1,), generator=gen))
        kind = int(torch.randint(0, 6, (1,), generator=gen))
        if t.dtype == torch.bool:
            flat[i] = not bool(flat[i])
        elif t.dtype in INT_DTYPES:
            info = torch.iinfo(t.dtype)
            v = int(flat[i]) + (1 if kind < 3 else -1)
            flat[i] = min(max(v, info.min), info.max)
        else:
            v = float(flat[i])
            choices = [
                v * (1 + rtol / 2) if math.isfinite(v) else 1.0,
                v * (1 + 4 * rtol + 0.25) if math.isfinite(v) else -1.0,
                v + 1.0 if math.isfinite(v) else 0.0,
                float("nan"),
                float("inf"),
                -v if math.isfinite(v) else 2.0,
            ]
            flat[i] = choices[kind]
    return out


def layout(t: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """The same values as t, laid out as kind: contiguous, transposed, sliced or expanded."""
    if kind == "transposed" and t.dim() >= 2:
        perm = list(reversed(range(t.dim())))
        return t.permute(perm).contiguous().permute(perm)
    if kind == "sliced" and t.dim() >= 1:
        pads = [int(torch.randint(0, 3, (1,), generator=gen)) for _ in range(t.dim())]
        big_shape = [s + p for s, p in zip(t.shape, pads)]
        big = torch.zeros(big_shape, dtype=t.dtype)
        index = tuple(slice(p, p + s) for p, s in zip(pads, t.shape))
        big[index] = t
        return big[index]
    if kind == "strided" and t.dim() >= 1:
        # Every other element of a twice-as-long last dim.
        big = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if kind == "expanded" and t.dim() >= 1 and t.shape[-1] > 0:
        row = t[..., :1]
        return row.expand(t.shape)
    return t


LAYOUTS = ["contiguous", "transposed", "sliced", "strided", "expanded"]


@dataclass
class Case:
    actual: torch.Tensor
    expected: torch.Tensor
    box: fsdpcheck.Box | None
    rtol: float
    atol: float
    equal_nan: bool
    notes: dict = field(default_factory=dict)

    @property
    def gshape(self) -> tuple[int, ...]:
        return tuple(self.actual.shape) if self.box is None else self.box.shape

    @property
    def offset(self) -> tuple[int, ...]:
        return (0,) * self.actual.dim() if self.box is None else self.box.offset

    def reference(self) -> reference.RefDiff:
        return reference.compare(
            self.actual,
            self.expected,
            rtol=self.rtol,
            atol=self.atol,
            equal_nan=self.equal_nan,
            gshape=self.gshape,
            offset=self.offset,
        )


@st.composite
def cases(draw, max_numel: int = 5000) -> Case:
    dtype_a = draw(st.sampled_from(ALL_DTYPES))
    dtype_e = draw(st.sampled_from([dtype_a] * 6 + ALL_DTYPES))
    ndim = draw(st.integers(0, 3))
    shape: list[int] = []
    for _ in range(ndim):
        budget = max_numel // max(1, math.prod(shape))
        sizes = [s for s in EDGE_SIZES if s <= budget] or [0, 1]
        shape.append(draw(st.sampled_from(sizes)))
    shape_t = tuple(shape)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    rtol = draw(st.sampled_from([0.0, 0.0, 1e-3, 0.5]))
    atol = draw(st.sampled_from([0.0, 0.0, 1e-5, 2.0]))
    base = make_values(shape_t, dtype_a, gen)
    k = draw(st.sampled_from([0, 0, 1, 3, 50]))
    expected = perturb(base, k, gen, max(rtol, 1e-3)).to(dtype_e)
    actual = base
    if draw(st.booleans()):
        actual, expected = expected.to(dtype_a), actual.to(dtype_e)
    actual = layout(actual, draw(st.sampled_from(LAYOUTS)), gen)
    expected = layout(expected, draw(st.sampled_from(LAYOUTS)), gen)
    box = None
    if draw(st.booleans()) and ndim > 0:
        extra = [draw(st.sampled_from([0, 0, 1, 5, 1000])) for _ in range(ndim)]
        offset = [draw(st.integers(0, x)) for x in extra]
        box = fsdpcheck.Box(tuple(s + x for s, x in zip(shape_t, extra)), tuple(offset))
    return Case(actual, expected, box, rtol, atol, draw(st.booleans()))


def assert_diff_matches(d: fsdpcheck.TensorDiff, ref: reference.RefDiff, gshape, what: str = ""):
    """Every exact field equal; sums equal to float64 rounding."""
    ctx = f"{what}: {d} vs {ref}"
    assert d.numel == ref.numel, ctx
    assert d.mismatched == ref.mismatched, ctx
    assert (d.nan_actual, d.nan_expected) == (ref.nan_actual, ref.nan_expected), ctx
    assert (d.inf_actual, d.inf_expected) == (ref.inf_actual, ref.inf_expected), ctx
    assert d.max_abs_diff == ref.max_abs_diff, ctx
    assert d.max_rel_diff == ref.max_rel_diff, ctx
    assert reference.linear(d.max_abs_index, gshape) == ref.max_abs_linear, ctx
    assert reference.linear(d.max_rel_index, gshape) == ref.max_rel_linear, ctx
    if d.fingerprint_actual is not None:
        assert d.fingerprint_actual == ref.fingerprint_actual, ctx
        assert d.fingerprint_expected == ref.fingerprint_expected, ctx
    if d.sum is not None:
        assert d.zeros == ref.zeros, ctx
        # Float sums: equal up to rounding, bounded by the sum of the magnitudes of the terms.
        assert_close_float(d.sum, ref.sum, math.sqrt(ref.sumsq * max(ref.numel, 1)), ctx)
        assert_close_float(d.sumsq, ref.sumsq, ref.sumsq, ctx)


def assert_close_float(x: float, y: float, magnitude: float, ctx: str) -> None:
    if math.isnan(y):
        assert math.isnan(x), ctx
        return
    if math.isinf(y):
        assert x == y, ctx
        return
    assert abs(x - y) <= 1e-12 * magnitude + 1e-300, ctx
