"""The one module that touches private or version-dependent torch APIs.

A torch upgrade that moves something breaks this file only.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
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


# NOTE: [FSDP1 internals] FSDP1 (``FullyShardedDataParallel``) flattens the parameters of each
# wrapped module into one FlatParameter and gives each rank a contiguous run of it; the optimizer
# steps the flat run (``use_orig_params=False``) or each original parameter's part of it, a 1-D
# view (``use_orig_params=True``). Where each original parameter's part lies is recorded on the
# FlatParameter as private fields (torch 2.1-2.13: ``_fqns``, ``_shapes``, ``_shard_param_infos``,
# ``_params``, ``_sharded_size``; the handle's ``_sharding_strategy``; the FSDP module's
# ``_inter_node_pg`` under HYBRID_SHARD). They are read here only.
@dataclass(frozen=True)
class FlatParamInfo:
    """One FSDP1 FlatParameter and where each original parameter's elements lie on this rank.

    Attributes:
        flat: The FlatParameter (registered on the module when ``use_orig_params=False``).
        prefix: The FSDP module's name in the model, with a trailing dot ("" for the root).
        fqns: Each original parameter's name below the FSDP module.
        shapes: Each original parameter's shape.
        shards: Per original parameter, ``(offset in the local flat run, numel, first flattened
            index held)``, or None when this rank holds none of it.
        params: The original Parameters (``use_orig_params=True``), else None.
        local_numel: Elements of this rank's flat run, padding included.
        replicas: How many ranks hold a copy of this rank's run (HYBRID_SHARD: the replica
            groups; NO_SHARD: every rank).
        replica_index: This rank's index among them (0 is the copy a fingerprint counts).
        strategy: The sharding strategy's name, for messages.
    """

    flat: Any
    prefix: str
    fqns: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    shards: tuple[tuple[int, int, int] | None, ...]
    params: tuple[Any, ...] | None
    local_numel: int
    replicas: int
    replica_index: int
    strategy: str


def fsdp1_flat_params(model: torch.nn.Module) -> list[FlatParamInfo]:
    """Every FSDP1 FlatParameter of `model` (empty when it has no FSDP1 module).

    Raises:
        TypeError: When an FSDP1 module lacks the fields read (another torch version), naming it.
    """
    fsdp = _cls("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel")
    if fsdp is None:
        return []
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, fsdp):
            continue
        handle = getattr(module, "_handle", None)
        if handle is None:
            continue  # an FSDP module with no parameters of its own
        flat = handle.flat_param
        try:
            infos = tuple(flat._shard_param_infos)
            fqns, shapes = tuple(flat._fqns), tuple(tuple(s) for s in flat._shapes)
            local_numel = math.prod(flat._sharded_size)
            strategy = handle._sharding_strategy.name
        except AttributeError as exc:
            raise TypeError(
                f"the FSDP1 module {name or '<root>'} lacks {exc.name} (another torch version?): "
                "its optimizer state cannot be mapped to parameters; call without optimizer= "
                "to verify the model"
            ) from None
        shards = tuple(
            (int(i.offset_in_shard), int(i.numel_in_shard), int(i.intra_param_start_idx))
            if i.in_shard
            else None
            for i in infos
        )
        replicas, index = 1, 0
        if strategy == "NO_SHARD":
            group = getattr(module, "process_group", None)
            replicas, index = _group_size_rank(group)
        elif "HYBRID" in strategy:
            replicas, index = _group_size_rank(getattr(module, "_inter_node_pg", None))
        params = getattr(flat, "_params", None)
        out.append(
            FlatParamInfo(
                flat,
                f"{name}." if name else "",
                fqns,
                shapes,
                shards,
                tuple(params) if params is not None else None,
                local_numel,
                replicas,
                index,
                strategy,
            )
        )
    return out


def _group_size_rank(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), max(dist.get_rank(group), 0)


# NOTE: [tensor kinds] fsdpcheck reads a tensor's elements in place, as a strided array of one of
# its dtypes. Tensors that are not one (sparse or mkldnn layouts, nested, quantized, on the meta
# device, or a subclass that keeps its data its own way behind ``__torch_dispatch__``) are named
# by kind here, once per key, before any kernel sees them: handed to a kernel they fail for the
# whole batch, naming no key (or with torch's "Internal error ... Please file an issue" for a
# nested tensor's sizes). A wrapper subclass that declares its parts (``__tensor_flatten__``) and
# holds the values as ONE plain tensor of its own shape and dtype (torchao's
# ``WeightWithDynamicFloat8CastTensor`` around the high-precision weight) is read as that tensor.
def _own_dispatch(t: torch.Tensor) -> bool:
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def is_nested(t: torch.Tensor) -> bool:
    """Whether `t` is a nested tensor (False for a subclass that refuses to say)."""
    try:
        return bool(t.is_nested)
    except Exception:  # a subclass's __torch_function__ may refuse the attribute
        return False


def tensor_kind_problem(t: torch.Tensor, *, quantized: bool = True) -> str | None:
    """Why `t`'s elements cannot be read as a dense strided array, naming its kind; else None.

    Checked without touching the data (nor the subclass's own dispatch, beyond
    ``__tensor_flatten__``). `quantized` False leaves quantized tensors to the dtype checks
    (offline readers report them as an unsupported dtype).
    """
    try:
        return _kind_problem(t, quantized)
    except Exception as exc:  # a subclass's own code refused to describe itself
        return (
            f"a tensor subclass ({type(t).__qualname__}) that refuses to describe its data "
            f"({type(exc).__name__}): compare a plain tensor of its values"
        )


def _kind_problem(t: torch.Tensor, quantized: bool) -> str | None:
    if t.is_nested:
        return (
            "a nested tensor (torch.nested): its components have shapes of their own; compare "
            "them one by one (.unbind())"
        )
    if t.layout != torch.strided:
        return (
            f"a {str(t.layout).removeprefix('torch.')} tensor: compare a dense copy (.to_dense())"
        )
    if t.is_quantized and quantized:
        return (
            f"a quantized tensor ({t.dtype}): its integers are not its values; compare "
            ".dequantize() (or .int_repr() for the stored integers)"
        )
    if t.device.type == "meta":
        return "a tensor on the meta device: it holds no data (never materialised or loaded?)"
    if _own_dispatch(t) and dense_inner(t) is None:
        return (
            f"an opaque tensor subclass ({type(t).__qualname__}) that keeps its data its own way "
            "(__torch_dispatch__): compare a plain tensor of its values"
        )
    return None


def dense_inner(t: torch.Tensor) -> torch.Tensor | None:
    """The one plain tensor a wrapper subclass holds its values in, when it declares one.

    Returns:
        `t` itself when it is no subclass with its own dispatch; the inner tensor of its
        ``__tensor_flatten__`` that is a plain strided tensor of `t`'s shape, dtype and device;
        else None.
    """
    if not _own_dispatch(t):
        return t
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names, _ = flatten()
        inner = [getattr(t, n) for n in names]
    except Exception:  # a subclass's own code: whatever it raises, it is opaque here
        return None
    same = [
        x
        for x in inner
        if type(x) in (torch.Tensor, torch.nn.Parameter)
        and x.layout == torch.strided
        and not x.is_quantized
        and (tuple(x.shape), x.dtype, x.device) == (tuple(t.shape), t.dtype, t.device)
    ]
    return same[0] if len(same) == 1 else None


def fsspec_writer(path: str, **storage_options: Any) -> Any:
    """DCP's storage writer through fsspec (``s3://`` and any URL fsspec knows).

    torch exports it from ``torch.distributed.checkpoint`` in some releases only; 2.13 keeps
    it in the private ``_fsspec_filesystem``. `storage_options` go to fsspec (the default:
    fsspec's configuration and the store library's environment).
    """
    try:
        from torch.distributed.checkpoint import FsspecWriter  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    return FsspecWriter(path, **storage_options)
