"""Helpers for testing checkpoint code: small models, planted faults, read-only checks.

What the embedded demo and fsdpcheck's own tests use, public for tests of your own:

- models: ``TinyTransformer`` (sizes that shard unevenly, with empty shards), ``build`` (FSDP2,
  HSDP, 2D FSDP x TP, DDP, plain), ``train``, ``small_model``, ``local_of``, ``full_state``.
- faults, each a context manager that restores the exact original bits on exit: ``plant`` (one
  element), ``flip_bit``, ``swap_shards`` (two ranks), ``shift_shard``, ``zero_moment`` (an
  optimizer moment), ``drop_state`` / ``drop_step`` (an optimizer entry), ``flip_byte`` and
  ``truncate`` (a file).
- read-only checks: ``unchanged`` (raises if a block changed any parameter, buffer, gradient or
  optimizer state), ``snapshot``, ``changes``.
"""

from __future__ import annotations

from fsdpcheck.testing.faults import (
    drop_state,
    drop_step,
    find_bytes,
    flip_bit,
    flip_byte,
    plant,
    shift_shard,
    swap_shards,
    truncate,
    zero_moment,
)
from fsdpcheck.testing.models import (
    DIM,
    HIDDEN,
    LAYOUTS,
    OUT,
    VOCAB,
    Block,
    TinyTransformer,
    build,
    full_state,
    local_of,
    mesh_2d,
    small_model,
    train,
)
from fsdpcheck.testing.readonly import changes, snapshot, unchanged

__all__ = [
    "DIM",
    "HIDDEN",
    "LAYOUTS",
    "OUT",
    "VOCAB",
    "Block",
    "TinyTransformer",
    "build",
    "changes",
    "drop_state",
    "drop_step",
    "find_bytes",
    "flip_bit",
    "flip_byte",
    "full_state",
    "local_of",
    "mesh_2d",
    "plant",
    "shift_shard",
    "small_model",
    "snapshot",
    "swap_shards",
    "train",
    "truncate",
    "unchanged",
    "zero_moment",
]
