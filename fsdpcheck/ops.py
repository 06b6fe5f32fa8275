"""Typed wrappers over ``torch.ops.fsdpcheck.*`` and their fake (meta) implementations.

Everything above this module calls these functions rather than ``torch.ops`` directly, so the
schemas are spelled out in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from fsdpcheck import _ext  # noqa: F401  (registers the operators)
from fsdpcheck.box import Box

#: Words per output row of ``compare`` (the layout of ``fsdpcheck::Partial`` in elementwise.h).
ROW_WORDS = 14
#: Column of each field in a ``compare`` row. Columns in ``FLOAT_COLUMNS`` hold float64 bits.
COLUMNS = {
    "mismatched": 0,
    "nan_actual": 1,
    "nan_expected": 2,
    "inf_actual": 3,
    "inf_expected": 4,
    "zeros": 5,
    "fingerprint_actual": 6,
    "fingerprint_expected": 7,
    "max_abs_diff": 8,
    "max_abs_index": 9,
    "max_rel_diff": 10,
    "max_rel_index": 11,
    "sum": 12,
    "sumsq": 13,
}
FLOAT_COLUMNS = frozenset({8, 10, 12, 13})


def flat_boxes(
    tensors: Sequence[torch.Tensor], boxes: Sequence[Box | None]
) -> tuple[list[int], list[int]]:
    """The ``box_shapes`` and ``box_offsets`` arguments of the operators for these tensors.

    One entry per dim of each tensor, concatenated (a tensor without a box is whole); both lists
    empty when every tensor is whole.
    """
    shapes: list[int] = []
    offsets: list[int] = []
    if all(b is None for b in boxes):
        return shapes, offsets
    for t, b in zip(tensors, boxes):
        if b is None:
            shapes.extend(t.shape)
            offsets.extend([0] * t.dim())
        else:
            assert b.offset is not None
            shapes.extend(b.shape)
            offsets.extend(b.offset)
    return shapes, offsets


def compare_rows(
    actual: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    box_shapes: Sequence[int],
    box_offsets: Sequence[int],
    rtol: float,
    atol: float,
    equal_nan: bool,
    fingerprints: bool,
    stats: bool,
) -> torch.Tensor:
    """Runs ``fsdpcheck::compare``: an int64 ``[len(actual), ROW_WORDS]`` table on their device."""
    return torch.ops.fsdpcheck.compare.default(
        *_compare_args(
            actual, expected, box_shapes, box_offsets, rtol, atol, equal_nan, fingerprints, stats
        )
    )


def _compare_args(
    actual: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    box_shapes: Sequence[int],
    box_offsets: Sequence[int],
    rtol: float,
    atol: float,
    equal_nan: bool,
    fingerprints: bool,
    stats: bool,
) -> tuple[Any, ...]:
    """The arguments of the compare schema, as the dispatcher takes them."""
    return (
        list(actual),
        list(expected),
        list(box_shapes),
        list(box_offsets),
        float(rtol),
        float(atol),
        bool(equal_nan),
        bool(fingerprints),
        bool(stats),
    )


def fingerprint_rows(
    tensors: Sequence[torch.Tensor], box_shapes: Sequence[int], box_offsets: Sequence[int]
) -> torch.Tensor:
    """Runs ``fsdpcheck::fingerprint``: int64 ``[len(tensors)]`` (uint64 bits) on their device."""
    return torch.ops.fsdpcheck.fingerprint.default(
        list(tensors), list(box_shapes), list(box_offsets)
    )


def testing_rows(
    op: Literal["_reference", "_emulated"],
    actual: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    box_shapes: Sequence[int],
    box_offsets: Sequence[int],
    rtol: float,
    atol: float,
    equal_nan: bool,
    *,
    fingerprints: bool = True,
    stats: bool = True,
    single: bool = False,
) -> torch.Tensor:
    """Runs a testing operator on CPU tensors: the rows of ``compare``, computed another way.

    Args:
        op: ``"_reference"``: element by element, through the CUDA kernels' per-element code.
            ``"_emulated"``: the CUDA kernels themselves, run on the CPU by the emulator (slow:
            meant for a few chunks per call).
        actual: As for ``compare_rows``; so are the other arguments up to ``stats``.
        expected: Ignored with ``single``.
        box_shapes: Concatenated box shapes (``flat_boxes``).
        box_offsets: Concatenated box offsets.
        rtol: Relative tolerance.
        atol: Absolute tolerance.
        equal_nan: Whether NaN matches NaN.
        fingerprints: Compute the fingerprints.
        stats: Compute the statistics of ``actual``.
        single: One tensor per row, the path of ``fingerprint``.
    """
    return getattr(torch.ops.fsdpcheck, op).default(
        *_compare_args(
            actual, expected, box_shapes, box_offsets, rtol, atol, equal_nan, fingerprints, stats
        ),
        bool(single),
    )


@torch.library.register_fake("fsdpcheck::compare")
def _compare_fake(
    actual: list[torch.Tensor],
    expected: list[torch.Tensor],
    box_shapes: list[int],
    box_offsets: list[int],
    rtol: float,
    atol: float,
    equal_nan: bool,
    fingerprints: bool,
    stats: bool,
) -> torch.Tensor:
    torch._check(len(actual) > 0, lambda: "fsdpcheck::compare: no tensors given")
    torch._check(len(actual) == len(expected), lambda: "fsdpcheck::compare: list lengths differ")
    return actual[0].new_empty((len(actual), ROW_WORDS), dtype=torch.int64)


@torch.library.register_fake("fsdpcheck::fingerprint")
def _fingerprint_fake(
    tensors: list[torch.Tensor], box_shapes: list[int], box_offsets: list[int]
) -> torch.Tensor:
    torch._check(len(tensors) > 0, lambda: "fsdpcheck::fingerprint: no tensors given")
    return tensors[0].new_empty((len(tensors),), dtype=torch.int64)
