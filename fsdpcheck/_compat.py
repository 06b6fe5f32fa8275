"""The one module that touches private or version-dependent torch APIs.

A torch upgrade that moves something breaks this file only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # torch >= 2.5 public location
    from torch.distributed.tensor import DeviceMesh, DTensor
    from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]
    DeviceMesh = None  # type: ignore[assignment,misc]
    Partial = Placement = Replicate = Shard = None  # type: ignore[assignment,misc]

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = None  # type: ignore[assignment,misc]

try:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
except ImportError:  # pragma: no cover
    ShardedTensor = None  # type: ignore[assignment,misc]


def is_dtensor(x: object) -> bool:
    """Whether x is a DTensor."""
    return DTensor is not None and isinstance(x, DTensor)


def is_sharded_tensor(x: object) -> bool:
    """Whether x is a (FSDP1-style) ShardedTensor."""
    return ShardedTensor is not None and isinstance(x, ShardedTensor)


def is_partial(p: object) -> bool:
    """Whether a placement is Partial (a pending reduction: not a slice of the tensor)."""
    return Partial is not None and isinstance(p, Partial)


def is_replicate(p: object) -> bool:
    """Whether a placement is Replicate."""
    return Replicate is not None and isinstance(p, Replicate)


def shard_dim(p: object) -> int | None:
    """The tensor dim a Shard or _StridedShard placement splits, else None."""
    # _StridedShard subclasses Shard in some torch versions and not in others.
    if (Shard is not None and isinstance(p, Shard)) or (
        _StridedShard is not None and isinstance(p, _StridedShard)
    ):
        return p.dim  # type: ignore[attr-defined]
    return None


def split_indices(p: object, indices: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """How placement p splits a 1-D tensor over num_chunks ranks (no padding, no collectives).

    Uses the placement's own ``_split_tensor``, so uneven, empty and strided (``_StridedShard``)
    splits follow exactly what DTensor does when it distributes a tensor.
    """
    chunks, _ = p._split_tensor(indices, num_chunks, with_padding=False, contiguous=False)  # type: ignore[attr-defined]
    return list(chunks)


def mesh_coordinate(mesh: Any) -> list[int] | None:
    """This rank's coordinate in a DeviceMesh, or None when the rank is not in the mesh."""
    coord = mesh.get_coordinate()
    return None if coord is None else list(coord)


def local_shape_and_offset(
    global_shape: Sequence[int], mesh: Any, placements: Sequence[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """DTensor's own answer (right for box layouts only; see layout.py for the check)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tuple(global_shape), mesh, placements)
    return tuple(shape), tuple(offset)
