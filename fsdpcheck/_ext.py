"""Loads the compiled extension (the fsdpcheck::* operators) with a helpful error."""

from __future__ import annotations

import importlib
from typing import Any

import torch  # noqa: F401  (libtorch must be loaded before the extension that links to it)

try:
    _C: Any = importlib.import_module("fsdpcheck._C")
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        f"fsdpcheck's compiled extension could not be loaded ({exc}). Build it against the torch "
        "you run with, from the fsdpcheck checkout: `pip install --no-build-isolation .` (or "
        "`bash scripts/setup.sh`, which also makes the .venv). A build made for another torch or "
        "Python version must be rebuilt the same way."
    ) from exc

__all__ = ["_C"]
