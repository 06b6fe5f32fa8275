"""Conversions that models declare themselves (their own state-dict hooks or mappings).

``declared_conversion(model)`` is asked by ``verify``, ``fingerprint`` and ``load`` when no
``convert=`` is given: a model whose live layout differs from what it saves returns what
``convert=`` accepts; None means the live layout is the saved one.
"""

from __future__ import annotations

from typing import Any


def declared_conversion(model: Any) -> Any:
    """The conversion `model` declares between its live layout and its saved one, or None."""
    return None


__all__ = ["declared_conversion"]
