"""Small models shared by the single-process tests (they live in fsdpcheck.testing)."""

from __future__ import annotations

from fsdpcheck.testing import small_model

__all__ = ["small_model"]
