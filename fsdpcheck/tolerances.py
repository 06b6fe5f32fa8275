"""Tolerances: exact by default (a load is a copy), torch.testing's table when dtypes differ."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fsdpcheck.matching import KeyMap

# torch.testing.assert_close's defaults, used when the two dtypes differ and no tolerance was
# given (the float8 rows follow the same rule: a few units in the last place). One row per float
# dtype of the kernels: tests/unit/test_dtype_table.py holds the keys to the compiled dtype table.
DTYPE_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float8_e4m3fn: (0.125, 1e-3),
    torch.float8_e5m2: (0.25, 1e-3),
}


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
    floats = [DTYPE_TOLERANCES[d] for d in (a, b) if d in DTYPE_TOLERANCES]
    if not floats:
        return (0.0, 0.0)
    # NOTE: [precision order] The less precise dtype is the one with the looser tolerance (the
    # table's rtol grows as precision falls), so no separate precision list is kept.
    return max(floats)


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

    def __post_init__(self) -> None:
        """Checks every argument, each error one line naming it (TypeError / ValueError).

        Normalises as it checks: tolerances become floats, ``ignore`` a tuple of patterns (a
        string is one pattern), a callable ``key_map`` one whose exceptions name the key.
        """
        set_ = object.__setattr__  # frozen
        set_(self, "rtol", _tolerance("rtol", self.rtol))
        set_(self, "atol", _tolerance("atol", self.atol))
        _flag("equal_nan", self.equal_nan)
        _flag("check_dtype", self.check_dtype)
        set_(self, "ignore", checked_patterns(self.ignore))
        set_(self, "key_map", checked_key_map(self.key_map))
        set_(self, "budget", checked_budget(self.budget))


def _tolerance(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (or None), not {_shown(value)}")
    out = float(value)
    if not math.isfinite(out) or out < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return out


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {_shown(value)}")


def checked_budget(value: Any, name: str = "memory_budget") -> int:
    """A memory budget: a positive int (TypeError / ValueError naming `name` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int (bytes), not {_shown(value)}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int (bytes), got {value!r}")
    return int(value)


def checked_patterns(value: Any, name: str = "ignore") -> tuple[str, ...] | None:
    """The fnmatch patterns as a tuple: one string is one pattern, never its characters.

    Raises:
        TypeError: For anything but None, a string or a sequence of strings, naming `name`.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, (Sequence, set, frozenset)):
        raise TypeError(
            f"{name} must be a pattern (str) or a list of patterns, not {_shown(value)}"
        )
    out = tuple(value)
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"{name} must hold patterns (str), not {_shown(p)}")
    return out


def checked_key_map(value: Any) -> Any:
    """A key_map as given, checked: a mapping of str to str / None, or a callable.

    A callable (other than ``matching.PrefixRules``) comes back wrapped so that an exception it
    raises, or a value that is not a str or None, names the key it was called with.

    Raises:
        TypeError: For anything else, naming ``key_map``.
    """
    if value is None or type(value).__name__ == "PrefixRules" or isinstance(value, _NamedKeyMap):
        return value
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, str)):
                raise TypeError(
                    f"key_map must map names (str) to checkpoint keys (str) or None, but maps "
                    f"{k!r} to {_shown(v)}"
                )
        return value
    if callable(value):
        return _NamedKeyMap(value)
    raise TypeError(f"key_map must be a mapping or a callable, not {_shown(value)}")


class KeyMapError(ValueError):
    """A user key_map raised, or returned something that is not a key, for one name."""


class _NamedKeyMap:
    """A user's key_map callable whose failures name the key it was called with."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, key: str) -> str | None:
        try:
            out = self.fn(key)
        except Exception as exc:
            said = str(exc).strip().splitlines()[:1]
            raise KeyMapError(
                f"key_map({key!r}) raised {type(exc).__name__}"
                + (f": {said[0]}" if said and said[0] not in ("''", '""') else "")
                + ": make it return the checkpoint's key for every name, or None to leave the "
                "name out"
            ) from exc
        if out is not None and not isinstance(out, str):
            raise KeyMapError(
                f"key_map({key!r}) returned {_shown(out)}: return the checkpoint's key (str), "
                "or None to leave the name out"
            )
        return out

    def __repr__(self) -> str:
        return repr(self.fn)


def _shown(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"
