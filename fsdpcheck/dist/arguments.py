"""Arguments as digests that mean the same on every rank, for the first agreement of a call.

Every rank of a job runs one program, so what must agree is compared by value where a value
can be compared (numbers, strings, patterns, mappings, paths' kinds, the names, shapes and
dtypes of an in-memory reference), and by what identifies it where it cannot (a function by its
module, qualified name and line; an object by its type). Nothing here is ever a memory address
or an ``id``: those differ between processes holding the same thing. What depends on the data
(the result of a ``key_map`` function or of a conversion) is agreed later, by the steps that
compute it.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["Argument", "argument", "described", "given"]

#: An argument as it travels: (name, 63-bit digest, how it is shown in a message).
Argument = tuple[str, int, str]

_SHOWN = 80


class _Given:
    """An argument that must be given on every rank or on none (its value is each rank's own)."""


_GIVEN = _Given()


def given(value: Any) -> Any:
    """`value` reduced to whether it was given (an optimizer, a model's files)."""
    return None if value is None else _GIVEN


def argument(name: str, value: Any) -> Argument:
    """`value` of the argument `name`, digested (see the module docstring)."""
    text = described(value)
    word = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    shown = text if len(text) <= _SHOWN else text[: _SHOWN - 4] + " ..."
    return name, word >> 1, shown


def described(value: Any, depth: int = 0) -> str:
    """A text that is equal on two ranks exactly when their values must be taken as equal."""
    if depth > 6:
        return "..."
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, _Given):
        return "<given>"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, os.PathLike):
        return f"path {os.fspath(value)!r}"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, torch.nn.Module):
        return "module " + _state(value.state_dict())
    if isinstance(value, Mapping):
        if value and all(isinstance(v, torch.Tensor) for v in value.values()):
            return "tensors " + _state(value)
        items = sorted((described(k, depth + 1), described(v, depth + 1)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (list, tuple, set, frozenset)):
        parts = [described(v, depth + 1) for v in value]
        if isinstance(value, (set, frozenset)):
            parts.sort()
        return "[" + ", ".join(parts) + "]"
    digest = getattr(value, "digest", None)
    if callable(digest) and type(value).__name__ == "Conversion":
        return f"conversion {digest()}"
    rules = getattr(value, "rules", None)
    if rules is not None and not callable(rules):
        return f"{type(value).__qualname__}({described(rules, depth + 1)})"
    code = getattr(value, "__code__", None)
    if code is not None:
        where = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
        return f"function {where} (line {code.co_firstlineno})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def _state(state: Mapping[str, Any]) -> str:
    """Names, shapes and dtypes of a mapping of tensors, digested (its values stay local)."""
    h = hashlib.blake2b(digest_size=8)
    n = 0
    for k, v in sorted(state.items(), key=lambda kv: str(kv[0])):
        try:
            shape: Any = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            dtype: Any = v.dtype if isinstance(v, torch.Tensor) else ""
        except Exception:  # a tensor kind without sizes (nested, ...): named by its type
            shape, dtype = type(v).__name__, ""
        h.update(f"{k}\0{shape}\0{dtype}\0".encode())
        n += 1
    return f"of {n} entries {h.hexdigest()}"
