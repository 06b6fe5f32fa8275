"""Where each rank's local data sits in the global tensor.

DTensor, ShardedTensor, a DeepSpeed ZeRO-3 partitioned parameter, a run of a tensor's row-major
elements (``FlatShard``: FSDP1's optimizer state), or a plain tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
        owner: Whether this rank's copy is the one a fingerprint counts, when the layout says
            (a DTensor: the rank at coordinate 0 of its Replicate dims); None: the lowest rank
            holding the key counts (plain tensors, replicated everywhere they are held).
        mesh_ranks: The global ranks of a DTensor's mesh. A mesh smaller than the job (the
            data-parallel sub-mesh of a 2D job, one pipeline stage's) has copies on other
            meshes: only the mesh holding the lowest rank that holds the key counts its boxes.
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    pieces: list[Piece] = field(default_factory=list)
    replicated: bool = False
    description: str = "tensor"
    error: str | None = None
    owner: bool | None = None
    mesh_ranks: frozenset[int] | None = None


@dataclass(frozen=True, eq=False)
class FlatShard:
    """The elements ``[start, start + data.numel())`` of a tensor of ``shape``, row-major.

    What FSDP1 holds of an original parameter's optimizer state (NOTE: [FSDP1 flat state] in
    ``live``): a 1-D run of the flattened tensor, not a box. It is a description of live data,
    not a copy: ``data`` is the optimizer's own tensor (or a view of it).

    Attributes:
        data: This rank's 1-D run (may be empty: the rank holds none of the tensor).
        shape: The global tensor's shape.
        start: The global row-major linear index of ``data[0]``.
        replicated: Whether other ranks hold copies of the same run (HYBRID_SHARD, NO_SHARD).
        owner: Whether this rank's copy is the one a fingerprint counts (None: the lowest rank
            holding the key, as for a plain tensor).
        description: The layout in words, for messages.
        error: Why the run cannot be placed in the tensor (then it is never compared), or None.
    """

    data: torch.Tensor
    shape: tuple[int, ...]
    start: int
    replicated: bool = False
    owner: bool | None = True
    description: str = "FSDP1 flat shard"
    error: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The local data's dtype."""
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        """The local data's device."""
        return self.data.device


@dataclass(frozen=True)
class Meta:
    """What every rank holding a key must agree on: its global shape and dtype."""

    shape: tuple[int, ...]
    dtype: str


def global_meta(value: Any) -> Meta:
    """The global shape and dtype of a live value, without computing its layout."""
    if _plain(value):
        if value.is_nested:  # no sizes: its component count
            return Meta((value.size(0),), str(value.dtype).removeprefix("torch."))
        return Meta(tuple(value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, FlatShard):
        return Meta(value.shape, str(value.dtype).removeprefix("torch."))
    if is_zero3(value) and getattr(value, "ds_shape", None) is not None:
        shape = tuple(int(s) for s in value.ds_shape)
    elif _compat.is_sharded_tensor(value):
        shape = tuple(value.size())
    elif not _compat.is_dtensor(value) and _compat.is_nested(value):
        shape = (value.size(0),)
    else:
        shape = tuple(value.shape)
    dtype = value.dtype
    if _compat.is_sharded_tensor(value):
        shards = value.local_shards()
        dtype = shards[0].tensor.dtype if shards else dtype
    return Meta(shape, str(dtype).removeprefix("torch."))


def local_layout(value: torch.Tensor | FlatShard, world_size: int = 1) -> Layout:
    """The layout of one live value on this rank.

    Args:
        value: A DTensor, a ShardedTensor, a DeepSpeed ZeRO-3 parameter (one that carries
            ``ds_*`` attributes), a FlatShard or a plain tensor.
        world_size: Ranks in the job (plain tensors are replicas when it is above 1).

    Returns:
        The Layout; ``error`` is set (and ``pieces`` empty) for layouts that cannot be checked.
    """
    plain = _plain(value)
    if isinstance(value, FlatShard):
        return flat_shard_layout(value)
    if not plain and _compat.is_dtensor(value):
        return _dtensor_layout(value)
    if not plain and _compat.is_sharded_tensor(value):
        return _sharded_tensor_layout(value)
    if not plain and is_zero3(value):
        return _zero3_layout(value, world_size)
    if isinstance(value, torch.Tensor):
        if _dense_as_is(value) and value.dim() <= _KERNEL_DIMS:  # the common case, fast
            shape = tuple(value.shape)
            pieces = [Piece(value, _whole(shape))]
            return Layout(shape, value.dtype, value.device, pieces, world_size > 1, "tensor")
        shape = (value.size(0),) if value.is_nested else tuple(value.shape)
        layout = Layout(
            shape, value.dtype, value.device, replicated=world_size > 1, description="tensor"
        )
        data, layout.error = _dense(value, "it is ")
        if data is not None:
            layout.pieces = [Piece(data, _whole(shape))]
            layout.error = _merge_problem(layout.pieces)
        return layout
    raise TypeError(f"not a tensor: {type(value).__name__}")


def _dense(t: torch.Tensor, said: str) -> tuple[torch.Tensor | None, str | None]:
    """The dense strided tensor holding `t`'s values, or why there is none (NOTE: [tensor kinds]).

    `said` begins the reason ("it is ", "its local tensor is ").
    """
    if _dense_as_is(t):
        return t, None
    problem = _compat.tensor_kind_problem(t)
    if problem is not None:
        return None, f"{said}{problem}"
    return _compat.dense_inner(t), None


def _dense_as_is(t: torch.Tensor) -> bool:
    """A plain tensor (or Parameter) of strided data: the common case, decided in ~0.3 us."""
    return (
        type(t) in _PLAIN_TYPES
        and t.layout is torch.strided
        and not (t.is_nested or t.is_quantized or t.is_meta)
    )


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

# The kernels index at most this many dims once contiguous ones merge (kMaxDims in
# csrc/fsdpcheck/elementwise.h; the read reference side is contiguous).
_KERNEL_DIMS = 8


def _merge_problem(pieces: list[Piece]) -> str | None:
    """Why a piece would need more dims than the kernels index (``strides_problem``), or None."""
    for piece in pieces:
        why = strides_problem(piece.tensor, piece.box.shape)
        if why is not None:
            return f"it is {why}"
    return None


def strides_problem(t: torch.Tensor, global_shape: Sequence[int] | None = None) -> str | None:
    """Why `t` would need more than the kernels' dims after merging, naming it; else None.

    The kernels' rule (``plan.cpp``): size-1 dims go, then a dim merges into the one outside
    it when the pair is one linear dim for `t`'s strides, for the contiguous reference read for
    it, and for the global tensor (`global_shape`, default `t`'s own: a whole tensor).

    Args:
        t: A strided tensor (a local piece, or a whole tensor of a reference).
        global_shape: The shape of the tensor `t` is a box of.
    """
    if t.dim() <= _KERNEL_DIMS or t.numel() == 0:
        return None
    shape = tuple(t.shape) if global_shape is None else tuple(global_shape)
    gstr, estr, ga, ea = [0] * t.dim(), [0] * t.dim(), 1, 1
    for d in range(t.dim() - 1, -1, -1):
        gstr[d], estr[d], ga, ea = ga, ea, ga * shape[d], ea * t.shape[d]
    merged: list[tuple[int, int, int]] = []  # (global, local, reference) stride of each
    for d in range(t.dim()):
        s = t.shape[d]
        if s == 1:
            continue
        here = (gstr[d], t.stride(d), estr[d])
        if merged and merged[-1] == (s * here[0], s * here[1], s * here[2]):
            merged[-1] = here
            continue
        merged.append(here)
    if len(merged) <= _KERNEL_DIMS:
        return None
    return (
        f"a {t.dim()}-d tensor (shape {tuple(t.shape)}, strides {t.stride()}) whose dims merge "
        f"into {len(merged)}, more than the {_KERNEL_DIMS} the kernels index: compare a "
        "contiguous copy, or one reshaped to at most 8 dims"
    )


def _plain(value: Any) -> bool:
    """Whether `value` is a torch.Tensor itself (no subclass) with no attribute of its own.

    Then it is no DTensor, ShardedTensor or ZeRO-3 parameter: decided without the attribute
    probes of those layouts (~1 us a key in a state dict of plain tensors).
    """
    return type(value) is torch.Tensor and not value.__dict__


@functools.lru_cache(maxsize=1 << 12)
def _whole(shape: tuple[int, ...]) -> Box:
    """The Box of a whole tensor of `shape`: one per shape (Boxes are immutable; ~5 us each)."""
    return Box(shape)


@dataclass(frozen=True)
class _Placed:
    """What a (mesh, placements, global shape) gives this rank: computed once, then reused."""

    description: str
    replicated: bool
    owner: bool
    mesh_ranks: frozenset[int]
    error: str | None
    offset: tuple[int, ...] | None  # None: this rank is not in the mesh
    size: tuple[int, ...] | None
    box: Box | None = None  # of the local data in the global tensor (with `offset`)


# NOTE: [layout cache] Working out a DTensor's box costs ~80 us (placements, mesh coordinate,
# DTensor's offset helper); a model has many tensors of the same shape on the same mesh and
# placements (every layer's), so each (mesh, placements, shape) is worked out once per process.
# Bounded: a long-lived process that sees many meshes drops the oldest entries.
_PLACED: dict[tuple[Any, ...], _Placed] = {}
_PLACED_MAX = 1 << 14


def _placed(mesh: Any, placements: tuple, shape: tuple[int, ...]) -> _Placed:
    try:
        key: tuple[Any, ...] | None = (mesh, placements, shape)
        hit = _PLACED.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable mesh or placement: no cache
        key, hit = None, None
    if hit is not None:
        return hit
    placed = _work_out(mesh, placements, shape)
    if key is not None:
        if len(_PLACED) >= _PLACED_MAX:
            _PLACED.pop(next(iter(_PLACED)))
        _PLACED[key] = placed
    return placed


def _work_out(mesh: Any, placements: tuple, shape: tuple[int, ...]) -> _Placed:
    desc = f"DTensor {placements} on mesh {tuple(mesh.shape)}"
    replicate = [m for m, p in enumerate(placements) if _compat.is_replicate(p)]
    replicated = any(mesh.size(m) > 1 for m in replicate)
    ranks = frozenset(int(r) for r in mesh.mesh.flatten().tolist())
    if any(_compat.is_partial(p) for p in placements):
        error = (
            f"{desc} has a Partial placement: its local data is a pending reduction, not a "
            "slice of the tensor; call .redistribute() to Replicate/Shard (or .full_tensor()) "
            "before checking"
        )
        return _Placed(desc, replicated, False, ranks, error, None, None)
    coord = _compat.mesh_coordinate(mesh)
    if coord is None:
        return _Placed(desc, replicated, False, ranks, None, None, None)  # holds nothing
    owner = all(coord[m] == 0 for m in replicate)
    try:
        offset, size = _box_of(shape, mesh, placements, coord)
    except _NotABox as exc:
        error = f"{desc}: {exc}; fsdpcheck checks only layouts whose local data is a box"
        return _Placed(desc, replicated, owner, ranks, error, None, None)
    return _Placed(desc, replicated, owner, ranks, None, offset, size, Box(shape, offset))


def _dtensor_layout(value: torch.Tensor) -> Layout:
    mesh = value.device_mesh  # type: ignore[attr-defined]
    placements = tuple(value.placements)  # type: ignore[attr-defined]
    shape = tuple(value.shape)
    with torch.no_grad():  # the local data itself: not through autograd (~3 us a key)
        local = value.to_local()  # type: ignore[attr-defined]
    placed = _placed(mesh, placements, shape)
    desc = placed.description
    layout = Layout(shape, local.dtype, local.device, description=desc)
    layout.replicated, layout.owner, layout.error = placed.replicated, placed.owner, placed.error
    layout.mesh_ranks = placed.mesh_ranks
    if placed.error is not None or placed.offset is None or placed.size is None:
        return layout
    data, why = _dense(local, "its local tensor is ")
    if data is None:
        layout.error = f"{desc}: {why}"
        return layout
    local = data
    offset, size = placed.offset, placed.size
    if tuple(local.shape) != size:
        layout.error = (
            f"{desc}: local tensor of shape {tuple(local.shape)} but the placements give "
            f"{size} at offset {offset}"
        )
        return layout
    assert placed.box is not None
    layout.pieces = [Piece(local, placed.box)]
    why = _merge_problem(layout.pieces)
    if why is not None:
        layout.pieces, layout.error = [], f"{desc}: {why}"
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
    layout = Layout(shape, dtype, device, description="ShardedTensor", owner=True)
    for shard in shards:
        data, why = _dense(shard.tensor, "its local shard is ")
        if data is None:
            layout.error = f"ShardedTensor: {why}"
            return layout
        layout.pieces.append(Piece(data, Box(shape, tuple(shard.metadata.shard_offsets))))
    why = _merge_problem(layout.pieces)
    if why is not None:
        layout.pieces, layout.error = [], f"ShardedTensor: {why}"
    return layout


# -------------------------------------------------------------------------------------------
# NOTE: [ZeRO-3 partitions] DeepSpeed ZeRO-3 flattens each parameter and splits the flat
# tensor, padded to a multiple of the data-parallel world W, into W equal partitions: the rank
# of rank k in the parameter's ``ds_process_group`` holds ``param.ds_tensor``, the flat elements
# [k * p, (k + 1) * p) with p = ``ds_tensor.numel()``, those past ``ds_numel`` being padding
# (DeepSpeed 0.19.8, ``Init._partition_param``). ``param.data`` is an empty placeholder unless
# the parameter happens to be gathered (``ds_status``), so the partition is read, never gathered.
# A flat range of the row-major index is what the kernels index by, so it is cut into boxes of
# the global tensor (``flat_range_boxes``), one Piece each. Nothing here imports deepspeed: the
# group is a torch process group, asked through torch.distributed as DeepSpeed itself does.
_ZERO3_ATTRS = ("ds_tensor", "ds_numel", "ds_shape", "ds_process_group")
_ZERO3_INSTEAD = (
    "verify the consolidated weights instead (zero_to_fp32.py output, or a state dict of the "
    "parameters gathered with deepspeed.zero.GatheredParameters)"
)


def is_zero3(value: object) -> bool:
    """Whether a value is a DeepSpeed ZeRO-3 parameter (it carries ``ds_*`` attributes)."""
    return any(hasattr(value, a) for a in _ZERO3_ATTRS)


def flat_range_boxes(
    shape: Sequence[int], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes of a tensor of ``shape`` whose elements are the row-major range [start, stop).

    A partial first row, whole rows, a partial last row, recursively by dim: at most
    ``2 * (ndim - 1) + 1`` boxes, none empty, in order; each box's own row-major order is a
    contiguous run of the range.

    Args:
        shape: The global shape.
        start: The first global linear index of the range.
        stop: One past the last.

    Returns:
        (offset, size) of each box, in increasing linear index.

    Raises:
        ValueError: When the range is not inside the tensor.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of shape {shape}")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    rest = shape[1:]
    inner = numel // shape[0]  # > 0: the range is not empty

    def within(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(rest, a, b)]

    first, last = start // inner, (stop - 1) // inner
    if first == last:
        return within(first, start - first * inner, stop - first * inner)
    out = []
    lo, hi = first, last + 1  # the whole rows
    if start % inner:
        out += within(first, start % inner, inner)
        lo += 1
    if stop % inner:
        hi -= 1
    if hi > lo:
        out.append(((lo,) + (0,) * len(rest), (hi - lo, *rest)))
    if stop % inner:
        out += within(last, 0, stop % inner)
    return out


def partition_layout(
    shape: tuple[int, ...],
    partition: torch.Tensor,
    index: int,
    world: int,
    world_size: int = 1,
    description: str = "flat partition",
) -> Layout:
    """The layout of partition `index` of `world` equal flat partitions of a tensor of `shape`.

    Args:
        shape: The global shape.
        partition: This rank's 1-D partition (its tail past the tensor's end is padding).
        index: The partition's index (the rank in the group the tensor is partitioned over).
        world: The number of partitions.
        world_size: Ranks in the job: above `world`, each partition has copies elsewhere.
        description: The layout in words, for messages.
    """
    numel = math.prod(shape)
    replicated = world_size > world
    size = partition.numel()
    if partition.dim() != 1 or not 0 <= index < world or size * world < numel:
        layout = Layout(shape, partition.dtype, partition.device, description=description)
        layout.error = (
            f"{description}: a partition of shape {tuple(partition.shape)} as number {index} of "
            f"{world} does not tile the {numel} elements of a tensor of shape {shape}"
        )
        return layout
    start = min(index * size, numel)
    data = partition.narrow(0, 0, min(start + size, numel) - start)  # the padding left out
    owner = None if replicated else True
    return flat_shard_layout(FlatShard(data, shape, start, replicated, owner, description))


def flat_shard_layout(value: FlatShard) -> Layout:
    """The boxes of a FlatShard (``flat_range_boxes``), each a view of its data.

    Returns:
        The Layout; ``error`` set when the run is not 1-D or does not lie inside the tensor.
    """
    shape, data = tuple(value.shape), value.data
    layout = Layout(shape, data.dtype, data.device, description=value.description)
    layout.replicated, layout.owner = value.replicated, value.owner
    if value.error is not None:
        layout.error = value.error
        return layout
    numel = math.prod(shape)
    stop = value.start + data.numel()
    if data.dim() != 1 or not 0 <= value.start <= stop <= numel:
        layout.error = (
            f"{value.description}: {data.numel()} elements from linear index {value.start} do "
            f"not lie inside a tensor of shape {shape} ({numel} elements)"
        )
        return layout
    at = 0
    for offset, box_size in flat_range_boxes(shape, value.start, stop):
        n = math.prod(box_size)
        layout.pieces.append(Piece(data.narrow(0, at, n).view(box_size), Box(shape, offset)))
        at += n
    return layout


def _zero3_layout(value: Any, world_size: int) -> Layout:
    error = zero3_problem(value)
    if error is not None:
        shape = tuple(int(s) for s in getattr(value, "ds_shape", None) or value.shape)
        desc = "DeepSpeed ZeRO-3 partition"
        return Layout(shape, value.dtype, value.device, description=desc, error=error)
    group = value.ds_process_group
    index, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    return partition_layout(
        tuple(int(s) for s in value.ds_shape),
        value.ds_tensor,
        index,
        world,
        world_size,
        f"DeepSpeed ZeRO-3 partition {index} of {world}",
    )


def zero3_problem(value: Any) -> str | None:
    """Why a ZeRO-3 parameter's partition cannot be read (NOTE: [ZeRO-3 partitions]), or None.

    Args:
        value: A parameter for which ``is_zero3`` holds.

    Returns:
        One line naming what is missing and what to verify instead, or None when it can be read.
    """
    what = "a DeepSpeed ZeRO-3 parameter"
    missing = [a for a in _ZERO3_ATTRS if not hasattr(value, a)]
    if missing:
        return (
            f"{what} without {', '.join(missing)} (another DeepSpeed version?): its partition "
            f"cannot be located; {_ZERO3_INSTEAD}"
        )
    part = value.ds_tensor
    if not isinstance(part, torch.Tensor):
        return f"{what} that is not partitioned (ds_tensor is None); {_ZERO3_INSTEAD}"
    if hasattr(part, "ds_quant_scale"):
        return f"{what} whose partition is quantized (ds_quant_scale); {_ZERO3_INSTEAD}"
    status = getattr(getattr(part, "status", None), "name", "AVAILABLE")
    if status != "AVAILABLE":
        return f"{what} whose partition is not in memory ({status}: NVMe?); {_ZERO3_INSTEAD}"
    shape = tuple(int(s) for s in value.ds_shape)
    if math.prod(shape) != int(value.ds_numel):
        return f"{what} with ds_shape {shape} but ds_numel {value.ds_numel}; {_ZERO3_INSTEAD}"
    said = int(getattr(part, "ds_numel", part.numel()))
    if said != part.numel():
        return (
            f"{what} whose partition holds {part.numel()} elements but says ds_numel {said}; "
            + _ZERO3_INSTEAD
        )
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return f"{what} but torch.distributed is not initialized; {_ZERO3_INSTEAD}"
    try:
        index = torch.distributed.get_rank(value.ds_process_group)
    except Exception as exc:  # a group object torch does not know (another comm backend)
        first = str(exc).strip().splitlines()[:1]
        return (
            f"{what} whose ds_process_group torch.distributed cannot read "
            f"({type(exc).__name__}: {''.join(first)}); {_ZERO3_INSTEAD}"
        )
    if index < 0:
        return f"{what} partitioned over a process group this rank is not in; {_ZERO3_INSTEAD}"
    return None
