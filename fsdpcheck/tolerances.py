"""Tolerances: exact by default (a load is a copy), torch.testing's table when dtypes differ."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fsdpcheck.matching import KeyMap

# torch.testing.assert_close's defaults, used when the two dtypes differ and no tolerance was
# given (the float8 rows follow the same rule: a few units in the last place).
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
    a: torch.dtype | None, b: torch.dtype | None, rtol: float | None, atol: float | None
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
    return DTYPE_TOLERANCES[min(floats, key=_PRECISION.index)]  # type: ignore[arg-type]


@dataclass(frozen=True)
class CheckSettings:
    """What a value check was asked for, as verify and compare_checkpoints take it.

    Attributes:
        rtol: Relative tolerance given (None: `tolerance` decides per dtype pair).
        atol: Absolute tolerance given.
        equal_nan: Whether NaN matches NaN.
        check_dtype: Whether a dtype difference is a finding (else a note).
        key_map: Prefix rules applied to names before pairing.
        ignore: Glob patterns of keys left out.
        budget: Bytes of reads in flight.
    """

    rtol: float | None
    atol: float | None
    equal_nan: bool
    check_dtype: bool
    key_map: KeyMap | None
    ignore: Sequence[str] | None
    budget: int
