"""Where each rank's local data sits in the global tensor: DTensor, ShardedTensor, plain tensor."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fsdpcheck import _compat
from fsdpcheck.box import Box

# Simulating a _StridedShard split costs one int64 per element of the split dim.
_MAX_SIMULATED_DIM = 1 << 27


@dataclass
class Piece:
    """A local tensor (or a view of one) and its box in the global tensor."""

    tensor: torch.Tensor
    box: Box


@dataclass
class Layout:
    """What this rank holds of one global tensor.

    Attributes:
        global_shape: The global tensor's shape.
        dtype: The local data's dtype.
        device: The local data's device.
        pieces: The boxes this rank holds (empty when it holds nothing).
        replicated: Whether other ranks hold copies of the same elements (Replicate placements,
            plain tensors in a multi-rank job).
        description: The layout in words, for messages.
        error: Why this value cannot be checked element-wise (a Partial placement, a layout
            that is not a box), or None.
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    pieces: list[Piece] = field(default_factory=list)
    replicated: bool = False
    description: str = "tensor"
    error: str | None = None


def local_layout(value: torch.Tensor, world_size: int = 1) -> Layout:
    """The layout of one live value on this rank.

    Args:
        value: A DTensor, a ShardedTensor or a plain tensor.
        world_size: Ranks in the job (plain tensors are replicas when it is above 1).

    Returns:
        The Layout; ``error`` is set (and ``pieces`` empty) for layouts that cannot be checked.
    """
    if _compat.is_dtensor(value):
        return _dtensor_layout(value)
    if _compat.is_sharded_tensor(value):
        return _sharded_tensor_layout(value)
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        return Layout(
            shape,
            value.dtype,
            value.device,
            [Piece(value, Box(shape))],
            replicated=world_size > 1,
            description="tensor",
        )
    raise TypeError(f"not a tensor: {type(value).__name__}")


def _dtensor_layout(value: torch.Tensor) -> Layout:
    mesh = value.device_mesh  # type: ignore[attr-defined]
    placements = tuple(value.placements)  # type: ignore[attr-defined]
    shape = tuple(value.shape)
    local = value.to_local()  # type: ignore[attr-defined]
    desc = f"DTensor {placements} on mesh {tuple(mesh.shape)}"
    layout = Layout(shape, local.dtype, local.device, description=desc)
    layout.replicated = any(
        _compat.is_replicate(p) and mesh.size(m) > 1 for m, p in enumerate(placements)
    )
    if any(_compat.is_partial(p) for p in placements):
        layout.error = (
            f"{desc} has a Partial placement: its local data is a pending reduction, not a "
            "slice of the tensor; call .redistribute() to Replicate/Shard (or .full_tensor()) "
            "before checking"
        )
        return layout
    coord = _compat.mesh_coordinate(mesh)
    if coord is None:
        return layout  # this rank is not in the mesh and holds nothing
    try:
        offset, size = _box_of(shape, mesh, placements, coord)
    except _NotABox as exc:
        layout.error = f"{desc}: {exc}; fsdpcheck checks only layouts whose local data is a box"
        return layout
    if tuple(local.shape) != size:
        layout.error = (
            f"{desc}: local tensor of shape {tuple(local.shape)} but the placements give "
            f"{size} at offset {offset}"
        )
        return layout
    layout.pieces = [Piece(local, Box(shape, offset))]
    return layout


class _NotABox(Exception):
    pass


def _box_of(
    shape: tuple[int, ...], mesh: object, placements: tuple, coord: list[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offset and size of this rank's block, checking that it is a box.

    Shard and Replicate placements always give a box, which DTensor's own helper computes.
    _StridedShard (2D FSDP+TP) gives a box only in some combinations, and DTensor's helper then
    returns a wrong offset for the others, so those dims are split the way DTensor splits them
    and the result is checked to be one contiguous range per dim.
    """
    strided = _compat.strided_shard_type()
    if strided is None or not any(isinstance(p, strided) for p in placements):
        local_shape, box_offset = _compat.local_shape_and_offset(shape, mesh, placements)
        return tuple(box_offset), tuple(local_shape)
    offset: list[int] = [0] * len(shape)
    size: list[int] = list(shape)
    for d in range(len(shape)):
        if not any(_compat.shard_dim(p) == d for p in placements):
            continue
        if shape[d] > _MAX_SIMULATED_DIM:
            raise _NotABox(f"dim {d} of size {shape[d]} is too large to analyse its split")
        idx = torch.arange(shape[d], dtype=torch.int64)
        for m, p in enumerate(placements):
            if _compat.shard_dim(p) == d:
                idx = _compat.split_indices(p, idx, mesh.size(m))[coord[m]]  # type: ignore[attr-defined]
        n = idx.numel()
        if n == 0:
            offset[d], size[d] = 0, 0
            continue
        start = int(idx[0])
        if not torch.equal(idx, torch.arange(start, start + n, dtype=torch.int64)):
            raise _NotABox(
                f"the local data is not a box: along dim {d} this rank holds {n} rows that are "
                "not contiguous in the global tensor"
            )
        offset[d], size[d] = start, n
    return tuple(offset), tuple(size)


def _sharded_tensor_layout(value: torch.Tensor) -> Layout:
    shape = tuple(value.size())
    shards = value.local_shards()  # type: ignore[attr-defined]
    dtype = shards[0].tensor.dtype if shards else value.dtype
    device = shards[0].tensor.device if shards else torch.device("cpu")
    pieces = [Piece(s.tensor, Box(shape, tuple(s.metadata.shard_offsets))) for s in shards]
    return Layout(shape, dtype, device, pieces, description="ShardedTensor")
