"""The one module that touches private or version-dependent torch APIs.

A torch upgrade that moves something breaks this file only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch


# NOTE: [lazy distributed] Importing torch.distributed.tensor costs about half a second (it pulls
# in sympy), which an offline command on a safetensors file never needs. Nothing here imports it:
# a DTensor, ShardedTensor or placement can only exist once its module has been imported by
# whoever made it, so the checks look the classes up in sys.modules.
def _cls(module: str, name: str) -> Any:
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def is_dtensor(x: object) -> bool:
    """Whether x is a DTensor."""
    cls = _cls("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(x, cls)


def is_sharded_tensor(x: object) -> bool:
    """Whether x is a (FSDP1-style) ShardedTensor."""
    cls = _cls("torch.distributed._shard.sharded_tensor", "ShardedTensor")
    return cls is not None and isinstance(x, cls)


def _placement(name: str) -> Any:
    return _cls("torch.distributed.tensor.placement_types", name)


def is_partial(p: object) -> bool:
    """Whether a placement is Partial (a pending reduction: not a slice of the tensor)."""
    cls = _placement("Partial")
    return cls is not None and isinstance(p, cls)


def is_replicate(p: object) -> bool:
    """Whether a placement is Replicate."""
    cls = _placement("Replicate")
    return cls is not None and isinstance(p, cls)


def strided_shard_type() -> Any:
    """The _StridedShard placement class (2D FSDP + TP), or None in a torch without it."""
    return _placement("_StridedShard")


def shard_dim(p: object) -> int | None:
    """The tensor dim a Shard or _StridedShard placement splits, else None."""
    # _StridedShard subclasses Shard in some torch versions and not in others.
    shard, strided = _placement("Shard"), strided_shard_type()
    if (shard is not None and isinstance(p, shard)) or (
        strided is not None and isinstance(p, strided)
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
