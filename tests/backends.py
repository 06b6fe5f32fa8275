"""The kernels' backends side by side, on the same inputs.

- ``cpu``: the CPU operator (``fsdpcheck.compare``, its vectorised blocks).
- ``reference``: ``fsdpcheck::_reference``, element by element through the CUDA kernels'
  per-element code.
- ``emulated``: ``fsdpcheck::_emulated``, the CUDA kernels themselves (chunk and finishing
  kernels, block_reduce, the vectorised and strided paths) run on the CPU by the emulator. Slow
  (~20 ms per block of 256 threads, one block per 65536-element chunk plus one per tensor): keep
  inputs to a few chunks.
- ``cuda``: the CUDA operator, where a GPU is present (the same strided views, copied there).
"""

from __future__ import annotations

import torch

import fsdpcheck
from fsdpcheck import kernels, ops

ON_CPU = ("cpu", "reference", "emulated")
ALL = (*ON_CPU, "cuda") if torch.cuda.is_available() else ON_CPU
_TESTING_OPS = {"reference": "_reference", "emulated": "_emulated"}


def compare(
    backend: str,
    actual: list[torch.Tensor],
    expected: list[torch.Tensor],
    boxes: list[fsdpcheck.Box | None] | None = None,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    equal_nan: bool = True,
    fingerprints: bool = True,
    stats: bool = True,
) -> list[fsdpcheck.TensorDiff]:
    """``fsdpcheck.compare`` of the pairs as the backend computes it."""
    boxes = [None] * len(actual) if boxes is None else boxes
    kw = dict(rtol=rtol, atol=atol, equal_nan=equal_nan, fingerprints=fingerprints, stats=stats)
    if backend == "cpu":
        return fsdpcheck.compare(actual, expected, boxes=boxes, **kw)
    if backend == "cuda":
        return fsdpcheck.compare(
            [to_cuda_view(t) for t in actual],
            [to_cuda_view(t) for t in expected],
            boxes=boxes,
            **kw,
        )
    table = ops.testing_rows(
        _TESTING_OPS[backend],
        actual,
        expected,
        *ops.flat_boxes(actual, boxes),
        rtol,
        atol,
        equal_nan,
        fingerprints=fingerprints,
        stats=stats,
    )
    return kernels.diffs_from_rows(actual, boxes, table, fingerprints=fingerprints, stats=stats)


def fingerprints(
    backend: str, tensors: list[torch.Tensor], boxes: list[fsdpcheck.Box | None] | None = None
) -> list[int]:
    """``fsdpcheck.fingerprint_tensors`` as the backend computes it (single-tensor mode)."""
    boxes = [None] * len(tensors) if boxes is None else boxes
    if backend == "cpu":
        return fsdpcheck.fingerprint_tensors(tensors, boxes=boxes)
    if backend == "cuda":
        return fsdpcheck.fingerprint_tensors([to_cuda_view(t) for t in tensors], boxes=boxes)
    table = ops.testing_rows(
        _TESTING_OPS[backend],
        tensors,
        tensors,
        *ops.flat_boxes(tensors, boxes),
        0.0,
        0.0,
        True,
        stats=False,
        single=True,
    )
    diffs = kernels.diffs_from_rows(tensors, boxes, table, stats=False)
    return [d.fingerprint_actual for d in diffs]  # type: ignore[misc]


def exact(d: fsdpcheck.TensorDiff) -> tuple:
    """Every field that is the same bit for bit on every backend (all but the float sums)."""
    return (
        d.numel,
        d.mismatched,
        d.nan_actual,
        d.nan_expected,
        d.inf_actual,
        d.inf_expected,
        d.max_abs_diff,
        d.max_abs_index,
        d.max_rel_diff,
        d.max_rel_index,
        d.fingerprint_actual,
        d.fingerprint_expected,
        d.zeros,
    )


def assert_agree(results: dict[str, list[fsdpcheck.TensorDiff]]) -> None:
    """Every backend's exact fields equal the first backend's, pair by pair."""
    (first, want), *others = results.items()
    for name, got in others:
        assert len(got) == len(want)
        for k, (x, y) in enumerate(zip(want, got)):
            assert exact(x) == exact(y), f"pair {k}: {first} {x} vs {name} {y}"


def to_cuda_view(t: torch.Tensor) -> torch.Tensor:
    """The same strided view, on the GPU (copies the underlying storage, keeps the strides)."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    whole = torch.as_strided(t, (numel,), (1,), 0).cuda()
    return whole.as_strided(t.shape, t.stride(), t.storage_offset())
