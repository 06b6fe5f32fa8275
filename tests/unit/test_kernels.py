"""fsdpcheck.compare / fingerprint_tensor(s) on the CPU against the float64 reference."""

from __future__ import annotations

import decimal
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpcheck
from tests import backends, reference
from tests.cases import (
    ALL_DTYPES,
    CHUNK,
    FLOAT_DTYPES,
    Case,
    assert_diff_matches,
    cases,
    dtype_grid,
    make_values,
    perturb,
)

# ---------------------------------------------------------------------------------------------
# Golden values: Fingerprint v1 is a stable format (docs/fingerprint-v1.md); never change them.
# ---------------------------------------------------------------------------------------------
GOLDEN = [
    (torch.arange(10, dtype=torch.float32), None, 0xA11F359A2856EBC0),
    (torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), None, 0xB6E0868D27E464EF),
    (
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)[0:1],
        ((2, 3), (0, 0)),
        0xAB9E39950099536F,
    ),
    (
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)[1:2],
        ((2, 3), (1, 0)),
        0x0B424CF8274B1180,
    ),
    (torch.tensor([1, -2, 3], dtype=torch.int64), None, 0x8C218965461D6A6C),
    (torch.tensor([True, False]), None, 0xAD2F00E97D0F1E4A),
]


@pytest.mark.parametrize("t,box,value", GOLDEN)
def test_golden_fingerprints(t, box, value):
    b = None if box is None else fsdpcheck.Box(*box)
    assert fsdpcheck.fingerprint_tensor(t, box=b) == value
    # The pure-numpy definition agrees (it is what the golden values were computed from).
    assert reference.fingerprint(t, *(box or (None, None))) == value
    # compare reports the same fingerprint for both sides, and so does every backend.
    for backend in backends.ON_CPU:
        (d,) = backends.compare(backend, [t], [t.clone()], [b])
        assert d.fingerprint_actual == d.fingerprint_expected == value, backend
        assert backends.fingerprints(backend, [t], [b]) == [value], backend


def test_golden_rows_add_up():
    whole = 0xB6E0868D27E464EF
    assert whole == (0xAB9E39950099536F + 0x0B424CF8274B1180) % 2**64


def test_empty_fingerprint_is_zero():
    assert fsdpcheck.fingerprint_tensor(torch.empty(0, 3)) == 0
    assert fsdpcheck.fingerprint_tensors([]) == []


# ---------------------------------------------------------------------------------------------
# Property tests: every backend on the CPU (the fused op, the per-element path of the CUDA
# kernels, the CUDA kernels on the emulator) against the reference and each other.
# ---------------------------------------------------------------------------------------------
def on_every_backend(c: Case, **kw) -> None:
    """Each CPU-side backend matches the float64 reference, and they agree bit for bit."""
    ref = c.reference()
    got = {
        b: backends.compare(
            b,
            [c.actual],
            [c.expected],
            [c.box],
            rtol=c.rtol,
            atol=c.atol,
            equal_nan=c.equal_nan,
            **kw,
        )
        for b in backends.ON_CPU
    }
    for b, (d,) in got.items():
        assert_diff_matches(d, ref, c.gshape, b)
    backends.assert_agree(got)


@given(cases())
def test_compare_matches_reference(c: Case):
    on_every_backend(c)


@given(st.lists(cases(max_numel=600), min_size=1, max_size=12))
def test_many_pairs_in_one_call_equal_one_call_each(cs: list[Case]):
    together = fsdpcheck.compare(
        [c.actual for c in cs],
        [c.expected for c in cs],
        boxes=[c.box for c in cs],
        rtol=0.25,
        atol=0.0,
    )
    for c, d in zip(cs, together):
        (alone,) = fsdpcheck.compare([c.actual], [c.expected], boxes=[c.box], rtol=0.25)
        assert backends.exact(d) == backends.exact(alone)
        assert d.sum == alone.sum or (math.isnan(d.sum) and math.isnan(alone.sum))


# The emulator runs a block per chunk and per tensor (~20 ms each): fewer, smaller lists.
@pytest.mark.slow
@settings(max_examples=12)
@given(st.lists(cases(max_numel=600), min_size=1, max_size=8))
def test_many_pairs_in_one_launch_on_every_backend(cs: list[Case]):
    args = ([c.actual for c in cs], [c.expected for c in cs], [c.box for c in cs])
    got = {b: backends.compare(b, *args, rtol=0.25, atol=1e-5) for b in backends.ON_CPU}
    backends.assert_agree(got)
    for c, d in zip(cs, got["emulated"]):
        ref = Case(c.actual, c.expected, c.box, 0.25, 1e-5, True).reference()
        assert_diff_matches(d, ref, c.gshape, "emulated")


# One to three chunks on the emulator each. The fast loop runs each size with a floating and an
# integer dtype: the kernels' paths with every element size over two chunks are
# test_emulator's, every dtype on every backend test_every_dtype_with_box_and_strides'.
@pytest.mark.parametrize(
    ("dtype", "n"),
    dtype_grid([CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 513], variant_first=True, each_size=False),
)
def test_chunk_boundaries(dtype, n):
    gen = torch.Generator().manual_seed(n)
    a = make_values((n,), dtype, gen)
    e = perturb(a, 5, gen, 1e-3)
    # Plant the largest difference in the last element of the first chunk and its twin in the
    # first element of the next one: the tie must go to the smaller index.
    if dtype not in (torch.bool,) and n > CHUNK:
        a[CHUNK - 1] = 0
        e[CHUNK - 1] = 100 if dtype in FLOAT_DTYPES[:4] or dtype == torch.int64 else 7
        a[CHUNK] = 0
        e[CHUNK] = e[CHUNK - 1]
    on_every_backend(Case(a, e, None, 0.0, 0.0, True))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_with_box_and_strides(dtype):
    gen = torch.Generator().manual_seed(3)
    full_a = make_values((37, 1030), dtype, gen)
    full_e = perturb(full_a, 20, gen, 1e-3)
    # A Shard(1)-like column block of the full tensor, read in place (non-contiguous).
    box = fsdpcheck.Box((37, 1030), (0, 515))
    a, e = full_a[:, 515:].contiguous(), full_e[:, 515:]
    on_every_backend(Case(a, e, box, 0.0, 0.0, True))


def _misaligned_copy(t: torch.Tensor, shift: int) -> torch.Tensor:
    """t's values in a tensor whose data starts `shift` bytes past an element boundary."""
    raw = (
        t.contiguous().view(torch.uint8).reshape(-1)
        if t.numel()
        else torch.empty(0, dtype=torch.uint8)
    )
    buf = bytearray(raw.numel() + 64)
    base = torch.frombuffer(buf, dtype=torch.uint8)
    start = (-base.data_ptr()) % 64 + shift  # shift bytes past a 64-byte boundary
    base[start : start + raw.numel()] = raw
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=start).reshape(t.shape)
    assert out.data_ptr() % t.element_size() == shift % t.element_size()
    return out


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d.itemsize > 1], ids=str)
@pytest.mark.parametrize("n", [1, 511, 512, 513, CHUNK + 3])
def test_misaligned_inputs(dtype, n):
    # A CPU tensor may start anywhere (torch.frombuffer; a DCP chunk mapped at an odd file offset
    # is handed over where it lies): same rows as an aligned copy, and as the reference.
    gen = torch.Generator().manual_seed(n)
    a = make_values((n,), dtype, gen)
    e = perturb(a, 3, gen, 1e-3)
    want = fsdpcheck.compare([a], [e], rtol=1e-3)
    ref = Case(a, e, None, 1e-3, 0.0, True).reference()  # the same for every shift
    for shift in range(1, dtype.itemsize):
        ma, me = _misaligned_copy(a, shift), _misaligned_copy(e, dtype.itemsize - shift)
        assert torch.equal(ma.view(torch.uint8), a.view(torch.uint8))
        assert [repr(x) for x in fsdpcheck.compare([ma], [me], rtol=1e-3)] == [
            repr(x) for x in want
        ]
        # only one side misaligned, and a strided (column) view of a misaligned 2-D tensor
        assert [repr(x) for x in fsdpcheck.compare([ma], [e], rtol=1e-3)] == [repr(x) for x in want]
        assert fsdpcheck.fingerprint_tensors([ma]) == fsdpcheck.fingerprint_tensors([a])
        other = torch.float64 if dtype != torch.float64 else torch.float32
        assert repr(fsdpcheck.compare([ma], [e.to(other)])[0]) == repr(
            fsdpcheck.compare([a], [e.to(other)])[0]
        )  # mixed dtypes: the per-element path
        if n % 2 == 0:
            box = fsdpcheck.Box((n // 2, 2), (0, 1))
            col_a, col_ma = a.reshape(n // 2, 2)[:, 1:], ma.reshape(n // 2, 2)[:, 1:]
            assert fsdpcheck.fingerprint_tensors([col_ma], boxes=[box]) == [
                reference.fingerprint(col_a.contiguous(), (n // 2, 2), (0, 1))
            ]
        (d,) = backends.compare("reference", [ma], [me], rtol=1e-3)
        assert_diff_matches(d, ref, (n,))
        # The CUDA kernels read whole elements: their path refuses the input before launch.
        with pytest.raises(ValueError, match=r"_emulated: actual\[0\] starts at address 0x"):
            backends.compare("emulated", [ma], [e])


# ---------------------------------------------------------------------------------------------
# Planted faults: caught at their exact global location; clean data passes.
# ---------------------------------------------------------------------------------------------
def test_single_changed_element_found_at_global_index():
    full = torch.randn(64, 48)
    shard = full[16:32].clone()  # rank 1 of 4, Shard(0)
    shard[5, 7] += 0.5
    box = fsdpcheck.Box((64, 48), (16, 0))
    (d,) = fsdpcheck.compare([shard], [full[16:32]], boxes=[box])
    assert d.mismatched == 1
    assert d.max_abs_index == (21, 7)
    assert d.max_rel_index == (21, 7)
    assert d.fingerprint_actual != d.fingerprint_expected


def test_clean_copy_passes_with_zero_findings():
    ts = [torch.randn(100, 3), torch.randint(0, 9, (7,)), torch.randn(0, 5), torch.tensor(2.5)]
    for d in fsdpcheck.compare(ts, [t.clone() for t in ts]):
        assert d.ok and d.mismatched == 0
        assert d.max_abs_diff == 0.0
        assert d.fingerprint_actual == d.fingerprint_expected


def test_swapped_shards_change_fingerprint_but_not_sum():
    full = torch.randn(8, 16)
    swapped = torch.cat([full[4:], full[:4]])
    fa, fs = fsdpcheck.fingerprint_tensors([full, swapped])
    assert fa != fs
    (d,) = fsdpcheck.compare([swapped], [full])
    assert d.mismatched > 0
    assert d.sum == pytest.approx(float(full.double().sum()))


def test_shifted_rows_detected_first_at_row_zero():
    full = torch.arange(40.0).reshape(10, 4)
    shifted = torch.roll(full, 1, dims=0)
    (d,) = fsdpcheck.compare([shifted], [full])
    assert d.mismatched == 40
    assert d.max_abs_index == (0, 0)  # |36 - 0| = 36 is the largest, at row 0


def test_zeroed_moment_counted():
    exp_avg_sq = torch.rand(1000) + 0.1
    zeroed = torch.zeros_like(exp_avg_sq)
    (d,) = fsdpcheck.compare([zeroed], [exp_avg_sq])
    assert d.mismatched == 1000 and d.zeros == 1000 and d.sum == 0.0
    assert d.max_rel_diff == 1.0


# ---------------------------------------------------------------------------------------------
# Semantics of special values.
# ---------------------------------------------------------------------------------------------
def test_nan_rules():
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([nan, nan, 1.0, inf, -inf, inf, 0.0, -0.0])
    e = torch.tensor([nan, 1.0, nan, inf, -inf, -inf, -0.0, 0.0])
    (d,) = fsdpcheck.compare([a], [e])
    assert d.mismatched == 3  # NaN vs 1, 1 vs NaN, inf vs -inf
    (d2,) = fsdpcheck.compare([a], [e], equal_nan=False)
    assert d2.mismatched == 4
    assert d.max_abs_diff == inf and d.max_abs_index == (5,)
    assert (d.nan_actual, d.nan_expected, d.inf_actual, d.inf_expected) == (2, 2, 3, 3)
    # Bit-exact fingerprints see -0.0 vs 0.0; value comparison does not.
    z = fsdpcheck.compare([torch.tensor([0.0])], [torch.tensor([-0.0])])[0]
    assert z.mismatched == 0 and z.fingerprint_actual != z.fingerprint_expected


def test_infinity_never_within_tolerance():
    (d,) = fsdpcheck.compare(
        [torch.tensor([1e308], dtype=torch.float64)],
        [torch.tensor([float("inf")], dtype=torch.float64)],
        rtol=1.0,
    )
    assert d.mismatched == 1


def test_nan_payloads_change_fingerprint_only():
    a = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    e = torch.tensor([0x7FC00000, 0x7FC00000], dtype=torch.int32).view(torch.float32)
    (d,) = fsdpcheck.compare([a], [e])
    assert d.mismatched == 0 and d.fingerprint_actual != d.fingerprint_expected


def test_int64_past_2_53_compared_exactly():
    a = torch.tensor([2**60, -(2**62)], dtype=torch.int64)
    e = torch.tensor([2**60 + 1, -(2**62)], dtype=torch.int64)
    (d,) = fsdpcheck.compare([a], [e])
    assert d.mismatched == 1 and d.max_abs_diff == 1.0 and d.max_abs_index == (0,)
    extreme = fsdpcheck.compare(
        [torch.tensor([torch.iinfo(torch.int64).max])],
        [torch.tensor([torch.iinfo(torch.int64).min])],
    )[0]
    assert extreme.max_abs_diff == float(2**64 - 1)


def test_subnormals_distinct_even_with_flush_denormal():
    a = torch.tensor([1e-45, 5e-324], dtype=torch.float64)
    e = torch.tensor([0.0, 0.0], dtype=torch.float64)
    a32, e32 = a.float(), e.float()  # before the mode is on, or torch flushes them itself
    assert a32[0] != 0
    # set_flush_denormal returns False where the CPU has no such mode; the test holds either way.
    torch.set_flush_denormal(True)
    try:
        (d,) = fsdpcheck.compare([a], [e])
        (f,) = fsdpcheck.compare([a32], [e32])
    finally:
        torch.set_flush_denormal(False)
    assert d.mismatched == 2 and f.mismatched == 1


def test_tolerance_boundary_is_inclusive():
    e = torch.tensor([1.0, 1.0], dtype=torch.float64)
    a = torch.tensor([1.5, 1.5000001], dtype=torch.float64)
    (d,) = fsdpcheck.compare([a], [e], rtol=0.25, atol=0.25)
    assert d.mismatched == 1


@pytest.mark.parametrize("backend", backends.ALL)
def test_tolerance_rounds_twice_on_every_backend(backend):
    # |4 - 3| = 1 against 0.1 + 0.3 * 3: 0.9999999999999999 when the product and the sum are
    # rounded apart (a mismatch), 1.0 when fused into one multiply-add (a match). Every backend
    # must round twice, as Python does.
    assert not (abs(4.0 - 3.0) <= 0.1 + 0.3 * 3.0)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.int64):
        a, e = torch.tensor([4, 4], dtype=dtype), torch.tensor([3, 4], dtype=dtype)
        (d,) = backends.compare(backend, [a], [e], rtol=0.3, atol=0.1)
        assert (d.mismatched, d.max_abs_index, d.max_abs_diff) == (1, (0,), 1.0), dtype


def _fused_bound(atol: float, rtol: float, mag: float) -> float:
    """atol + rtol * mag rounded once, as a fused multiply-add computes it."""
    with decimal.localcontext(prec=1000):
        return float(decimal.Decimal(atol) + decimal.Decimal(rtol) * decimal.Decimal(mag))


@st.composite
def on_the_tolerance_boundary(draw) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Integer-valued pairs and tolerances that put pair 0 (|a - e| = d) on the boundary.

    ``midpoint``: atol + fl(rtol * |e|) is exactly the midpoint between d and the float64 below
    it, so the twice-rounded bound ties (to even) while the fused one falls to the side of the
    product's rounding error: where they differ, only non-fused arithmetic gives the answer
    Python gives. ``exact``: atol = fl(d - fl(rtol * |e|)); ``below``/``above``: one step off.
    """
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]))
    top = {torch.float16: 2**11, torch.bfloat16: 2**8}.get(dtype, 2**24)  # exact integers
    pairs = draw(
        st.lists(st.tuples(st.integers(1, top // 2), st.integers(-64, 64)), min_size=1, max_size=8)
    )
    sign = draw(st.sampled_from([1, -1]))
    e = torch.tensor([sign * x for x, _ in pairs], dtype=dtype)
    a = torch.tensor([sign * x + k for x, k in pairs], dtype=dtype)
    d, mag = abs(float(a[0]) - float(e[0])), abs(float(e[0]))
    # A product below d, so that atol >= 0.
    rtol = draw(st.floats(0.05, 0.999)) * d / mag if d > 0 else draw(st.floats(0.0, 1.0))
    product = rtol * mag
    how = draw(st.sampled_from(["midpoint", "midpoint", "exact", "below", "above"]))
    if how == "midpoint" and d > 0:
        with decimal.localcontext(prec=1000):
            below = decimal.Decimal(math.nextafter(d, 0.0))
            mid = (decimal.Decimal(d) + below) / 2
            atol = float(mid - decimal.Decimal(product))  # exact: mid and product are close
    else:
        atol = d - product
        if how != "exact":
            atol = math.nextafter(atol, -math.inf if how == "below" else math.inf)
    return a, e, rtol, max(atol, 0.0)


@given(on_the_tolerance_boundary())
def test_tolerance_boundaries_decided_alike_on_every_backend(case):
    a, e, rtol, atol = case
    # Python's float arithmetic rounds after each operation: the decision every backend owes.
    want = sum(
        not (abs(x - y) <= atol + rtol * abs(y))
        for x, y in zip(a.double().tolist(), e.double().tolist())
    )
    got = {b: backends.compare(b, [a], [e], rtol=rtol, atol=atol) for b in backends.ALL}
    for b, (d,) in got.items():
        assert d.mismatched == want, b
    backends.assert_agree(got)


def test_mixed_dtypes_compare_values():
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    e = torch.tensor([1.0, 2.0, 3.001], dtype=torch.float32)
    (d,) = fsdpcheck.compare([a], [e])
    assert d.mismatched == 1 and d.max_abs_index == (2,)
    (i,) = fsdpcheck.compare([torch.tensor([3], dtype=torch.int32)], [torch.tensor([3.0])])
    assert i.mismatched == 0


# ---------------------------------------------------------------------------------------------
# Boxes, global indices and additivity.
# ---------------------------------------------------------------------------------------------
@given(
    rows=st.integers(0, 40),
    cols=st.integers(1, 40),
    cuts_r=st.lists(st.integers(0, 40), max_size=3),
    cuts_c=st.lists(st.integers(0, 40), max_size=3),
    dtype=st.sampled_from(ALL_DTYPES),
)
def test_fingerprints_of_a_tiling_add_up(rows, cols, cuts_r, cuts_c, dtype):
    gen = torch.Generator().manual_seed(rows * 41 + cols)
    full = make_values((rows, cols), dtype, gen)
    rb = sorted({0, rows, *[min(c, rows) for c in cuts_r]})
    cb = sorted({0, cols, *[min(c, cols) for c in cuts_c]})
    tiles, boxes = [], []
    for r0, r1 in itertools.pairwise(rb):
        for c0, c1 in itertools.pairwise(cb):
            tiles.append(full[r0:r1, c0:c1])
            boxes.append(fsdpcheck.Box((rows, cols), (r0, c0)))
    total = sum(fsdpcheck.fingerprint_tensors(tiles, boxes=boxes)) % 2**64
    assert total == fsdpcheck.fingerprint_tensor(full) == reference.fingerprint(full)


def test_huge_global_indices_without_huge_tensors():
    # A 1-D shard whose offset is past 2**31 and 2**32 elements, and a 2-D one past 2**31 rows.
    t = torch.arange(10, dtype=torch.float32)
    box = fsdpcheck.Box((2**40,), (2**40 - 10,))
    assert fsdpcheck.fingerprint_tensor(t, box=box) == reference.fingerprint(
        t, box.shape, box.offset
    )
    e = t.clone()
    e[3] = 99
    (d,) = fsdpcheck.compare([t], [e], boxes=[box])
    assert d.max_abs_index == (2**40 - 7,)
    t2 = torch.randn(3, 4)
    box2 = fsdpcheck.Box((2**33, 4), (2**31 + 7, 0))
    e2 = t2.clone()
    e2[2, 1] += 1
    (d2,) = fsdpcheck.compare([t2], [e2], boxes=[box2])
    assert d2.max_abs_index == (2**31 + 9, 1)
    assert d2.fingerprint_actual == reference.fingerprint(t2, box2.shape, box2.offset)
    ref = reference.compare(t2, e2, gshape=box2.shape, offset=box2.offset)
    assert reference.linear(d2.max_abs_index, box2.shape) == ref.max_abs_linear


def test_index_of_zero_dim_and_size_one_dims():
    (d,) = fsdpcheck.compare([torch.tensor(1.0)], [torch.tensor(2.0)])
    assert d.max_abs_index == () and d.mismatched == 1
    a = torch.zeros(1, 5, 1)
    e = a.clone()
    e[0, 3, 0] = 1
    box = fsdpcheck.Box((4, 5, 3), (2, 0, 1))
    (d,) = fsdpcheck.compare([a], [e], boxes=[box])
    assert d.max_abs_index == (2, 3, 1)


def test_many_dims_that_cannot_merge_are_refused_clearly():
    base = torch.zeros([3] * 10)
    t = base[(slice(0, 2),) * 10]  # every dim sliced: nothing merges
    with pytest.raises(ValueError, match="contiguous"):
        fsdpcheck.compare([t], [t])
    (d,) = fsdpcheck.compare([t.contiguous()], [t.contiguous()])
    assert d.ok


# ---------------------------------------------------------------------------------------------
# Determinism and threads.
# ---------------------------------------------------------------------------------------------
def test_results_do_not_depend_on_thread_count():
    gen = torch.Generator().manual_seed(1)
    a = [make_values((3 * CHUNK + 17,), torch.float32, gen) for _ in range(6)]
    e = [perturb(x, 40, gen, 1e-3) for x in a]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fsdpcheck.compare(a * 3, e * 3, rtol=1e-3)
        torch.set_num_threads(max(2, before))
        many = fsdpcheck.compare(a * 3, e * 3, rtol=1e-3)
        again = fsdpcheck.compare(a * 3, e * 3, rtol=1e-3)
    finally:
        torch.set_num_threads(before)
    assert [repr(x) for x in one] == [repr(x) for x in many] == [repr(x) for x in again]


# ---------------------------------------------------------------------------------------------
# Errors: clear, typed, raised before any work.
# ---------------------------------------------------------------------------------------------
def test_errors():
    x = torch.zeros(3)
    with pytest.raises(TypeError, match=r"actual\[0\].*complex64"):
        fsdpcheck.compare([torch.zeros(3, dtype=torch.complex64)], [x])
    with pytest.raises(ValueError, match="pair 1 has shapes"):
        fsdpcheck.compare([x, x], [x, torch.zeros(4)])
    with pytest.raises(ValueError, match="2 actual tensors but 1 expected"):
        fsdpcheck.compare([x, x], [x])
    with pytest.raises(ValueError, match="does not contain"):
        fsdpcheck.compare([x], [x], boxes=[fsdpcheck.Box((4,), (2,))])
    with pytest.raises(ValueError, match="does not contain"):
        fsdpcheck.compare([x], [x], boxes=[fsdpcheck.Box((3, 1), (0, 0))])
    with pytest.raises(ValueError, match="rtol and atol"):
        fsdpcheck.compare([x], [x], rtol=-1)
    with pytest.raises(ValueError, match="rtol and atol"):
        fsdpcheck.compare([x], [x], atol=float("nan"))
    with pytest.raises(TypeError, match=r"not a torch\.Tensor"):
        fsdpcheck.compare([x], [[1, 2, 3]])
    with pytest.raises(ValueError, match="meta"):
        fsdpcheck.compare([torch.zeros(3, device="meta")], [torch.zeros(3, device="meta")])
    with pytest.raises(ValueError, match="2 boxes"):
        fsdpcheck.compare([x], [x], boxes=[None, None])
    with pytest.raises(TypeError, match="not a Box"):
        fsdpcheck.compare([x], [x], boxes=[((3,), (0,))])
    with pytest.raises(ValueError, match="offset"):
        fsdpcheck.Box((3,), (4,))
    with pytest.raises(ValueError, match="2 dims"):
        fsdpcheck.Box((3, 3), (0,))
    with pytest.raises(TypeError, match=r"uint16.*not supported"):
        fsdpcheck.fingerprint_tensor(torch.zeros(3, dtype=torch.uint16))
    assert fsdpcheck.compare([], []) == []


def test_op_level_errors_are_typed():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="box"):
        torch.ops.fsdpcheck.compare.default([x], [x], [3], [1], 0.0, 0.0, True, True, True)
    with pytest.raises(TypeError, match="not supported"):
        torch.ops.fsdpcheck.fingerprint.default([torch.zeros(2, dtype=torch.complex64)], [], [])
    with pytest.raises(ValueError, match="2\\*\\*63"):
        torch.ops.fsdpcheck.fingerprint.default([torch.zeros(1, 1)], [2**62, 4], [0, 0])


def test_requires_grad_inputs_are_fine():
    p = torch.nn.Parameter(torch.randn(5))
    (d,) = fsdpcheck.compare([p], [p.detach().clone()])
    assert d.ok


# ---------------------------------------------------------------------------------------------
# torch.library conformance.
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_opcheck():
    a = [torch.randn(5, 3), torch.randint(0, 5, (4,), dtype=torch.int32), torch.empty(0)]
    e = [x.clone() for x in a]
    torch.library.opcheck(
        torch.ops.fsdpcheck.compare.default, (a, e, [], [], 0.0, 0.0, True, True, True)
    )
    torch.library.opcheck(
        torch.ops.fsdpcheck.compare.default,
        ([a[0]], [e[0] + 1], [10, 3], [2, 0], 0.1, 0.0, False, False, False),
    )
    torch.library.opcheck(torch.ops.fsdpcheck.fingerprint.default, (a, [], []))


def test_build_info():
    info = fsdpcheck.build_info()
    assert "cpu" in info["backends"]
    assert info["backends"]["cpu"].startswith("simd=")
    assert info["torch_built_against"] == torch.__version__


def test_python_row_columns_are_the_cpp_struct_layout():
    # ops.COLUMNS (what kernels decode) against offsetof(Partial, field) read from the extension.
    from fsdpcheck import ops

    layout = fsdpcheck.build_info()["row_layout"]
    assert layout == ops.COLUMNS
    assert len(layout) == ops.ROW_WORDS
