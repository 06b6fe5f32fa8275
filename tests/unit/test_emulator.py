"""The CUDA kernels run on the CPU by the emulator (fsdpcheck::_emulated), against the other
backends and the float64 reference: each path of the chunk kernel, special values where the
paths and chunks meet, several tensors per launch, and fingerprints."""

from __future__ import annotations

import itertools

import pytest
import torch

import fsdpcheck
from tests import backends, reference
from tests.cases import (
    ALL_DTYPES,
    CHUNK,
    FLOAT_DTYPES,
    Case,
    assert_diff_matches,
    dtype_grid,
    make_values,
)

# Two chunks: the vectorised path's whole vectors, its tail (9 is not a whole vector of any
# dtype) and the second chunk's first element.
N = CHUNK + 9
# Where the specials go: the first and last lanes of the first vectors (16 bytes hold 2 to 16
# elements), the end of the first chunk, the start of the second, the tail.
PLACES = [0, 1, 7, 8, 15, 16, 31, CHUNK - 1, CHUNK, CHUNK + 1, N - 2, N - 1]
LAYOUTS = ["vectorised", "element-aligned", "strided", "2-d"]


def planted(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair of N elements, equal but at PLACES: NaN on one side, on both, Inf, a difference."""
    gen = torch.Generator().manual_seed(seed)
    a = make_values((N,), dtype, gen)
    e = a.clone()
    for k, p in enumerate(PLACES):
        if dtype == torch.bool:
            e[p] = not bool(a[p])
        elif dtype not in FLOAT_DTYPES:
            info = torch.iinfo(dtype)
            e[p] = int(a[p]) + 1 if int(a[p]) < info.max else int(a[p]) - 1
        elif k % 4 == 0:
            e[p] = float("nan")
        elif k % 4 == 1:
            a[p] = float("inf") if dtype != torch.float8_e4m3fn else float("nan")
        elif k % 4 == 2:
            a[p] = e[p] = float("nan")
        else:
            e[p] = 1.5 if float(a[p]) != 1.5 else 2.0
    return a, e


def laid_out(t: torch.Tensor, how: str) -> torch.Tensor:
    """t's values in a fresh tensor read by one path of the chunk kernel."""
    if how == "vectorised":  # contiguous, 64-byte aligned: 16-byte vector loads
        return t.clone()
    if how == "element-aligned":  # contiguous, one element past 64 bytes: element by element
        buf = torch.zeros(N + 1, dtype=t.dtype)
        buf[1:] = t
        return buf[1:]
    if how == "strided":  # every other element: the strided 1-D loop
        buf = torch.zeros(2 * N, dtype=t.dtype)
        buf[::2] = t
        return buf[::2]
    # A column block of a wider 2-D tensor: two dims after merging, chunk-relative indexing.
    buf = torch.zeros(N // 5, 6, dtype=t.dtype)  # N = 13109 * 5
    buf[:, 1:] = t.reshape(N // 5, 5)
    return buf[:, 1:]


# ~0.3 s each (two chunks on the emulator, twice): a few in the fast loop (dtype_grid).
@pytest.mark.parametrize(("dtype", "how"), dtype_grid(LAYOUTS))
def test_every_path_with_specials_at_vector_and_chunk_edges(dtype, how):
    a, e = planted(dtype, ALL_DTYPES.index(dtype))
    la, le = laid_out(a, how), laid_out(e, how)
    box = fsdpcheck.Box((3, *la.shape), (1, *(0,) * la.dim())) if how == "2-d" else None
    if box is not None:  # a slab of a 3-D global tensor: global indices past the first slab
        la, le = la.unsqueeze(0), le.unsqueeze(0)
    rtol = 1e-3 if dtype in FLOAT_DTYPES else 0.0  # integers: every planted +-1 mismatches
    for equal_nan in (True, False):
        c = Case(la, le, box, rtol, 0.0, equal_nan)
        ref = c.reference()
        got = {
            b: backends.compare(b, [la], [le], [box], rtol=rtol, equal_nan=equal_nan)
            for b in backends.ON_CPU
        }
        for b, (d,) in got.items():
            assert_diff_matches(d, ref, c.gshape, f"{b}, {how}")
        backends.assert_agree(got)
        assert got["emulated"][0].mismatched > 0


def test_several_tensors_with_empty_ones_in_one_launch():
    gen = torch.Generator().manual_seed(5)
    shapes = [(0,), (3, 0), (), (1,), (257,), (0, 5), (40, 33), (CHUNK + 1,)]
    dtypes = itertools.cycle([torch.float32, torch.bfloat16, torch.int64, torch.float16])
    actual, expected = [], []
    for shape, dtype in zip(shapes, dtypes):
        a = make_values(shape, dtype, gen)
        e = a.clone()
        if a.numel():
            e.reshape(-1)[-1] = 7
        actual.append(a)
        expected.append(e)
    expected[4] = expected[4].double()  # one pair of mixed dtypes
    boxes: list[fsdpcheck.Box | None] = [None] * len(shapes)
    boxes[6] = fsdpcheck.Box((80, 33), (40, 0))
    got = {b: backends.compare(b, actual, expected, boxes, atol=0.5) for b in backends.ON_CPU}
    backends.assert_agree(got)
    for a, e, box, d in zip(actual, expected, boxes, got["emulated"]):
        c = Case(a, e, box, 0.0, 0.5, True)
        assert_diff_matches(d, c.reference(), c.gshape, "emulated")
    empty = got["emulated"][0]
    assert (empty.numel, empty.mismatched, empty.fingerprint_actual, empty.max_abs_index) == (
        0,
        0,
        0,
        None,
    )


def test_fingerprints_of_boxes_add_up_on_the_emulator():
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float64, torch.bool):
        full = make_values((33, 70), dtype, gen)
        tiles = [full[:10], full[10:, :35], full[10:, 35:]]
        boxes = [fsdpcheck.Box((33, 70), o) for o in ((0, 0), (10, 0), (10, 35))]
        parts = backends.fingerprints("emulated", tiles, boxes)
        assert parts == backends.fingerprints("cpu", tiles, boxes)
        assert sum(parts) % 2**64 == reference.fingerprint(full)


def test_emulated_kernel_errors_are_typed():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="rtol and atol"):
        backends.compare("emulated", [x], [x], rtol=-1.0)
    with pytest.raises(
        TypeError, match=r"_emulated: actual\[0\] has dtype ComplexFloat, which is not supported"
    ):
        backends.compare("emulated", [torch.zeros(2, dtype=torch.complex64)], [x[:2]])
