"""megatron-core ``dist_checkpointing.save`` of a row-sharded state dict (2 ranks, gloo, CPU).

megatron-core writes a DCP directory plus ``metadata.json`` (its own format marker) and
``common.pt`` (everything that is not a ShardedTensor). Its save path calls
``torch.cuda.synchronize()`` and allocates one flag on ``torch.cuda.current_device()``; on CPU
ranks ``cpu_save_patches`` turns the first into a no-op and points the second at the CPU.
Nothing else differs from a GPU run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tests.corpus import TOY_FQNS, Case, Cases, MomentSpot, optim_keys, toy_case, toy_model

PLANT_WEIGHT = ("layers.0.proj.weight", (6, 2))
PLANT_MOMENT = ("layers.1.proj.weight", "exp_avg", (5, 3))


CASES = Cases(
    library="megatron",
    requires="megatron.core",
    layout="megatron",
    names=("megatron",),
    order=6,
)


@contextlib.contextmanager
def cpu_save_patches() -> Iterator[None]:
    """The two CUDA calls in megatron-core's save path, made harmless on CPU ranks."""
    sync, current = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = sync, current  # type: ignore[assignment]


def sharded_state_dict(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """Rows of every tensor split over the ranks, as Megatron's sharded_state_dict() does."""
    from megatron.core.dist_checkpointing import ShardedTensor

    out: dict[str, Any] = {}
    for key, t in full.items():
        rows = t.shape[0] // world
        local = torch.nn.Parameter(t[rank * rows : (rank + 1) * rows].clone())
        out[key] = ShardedTensor.from_rank_offsets(key, local, (0, rank, world))
    out["iteration"] = 2
    out["args"] = {"hidden": 8, "layers": 2}
    return out


def with_optimizer(model_sd: dict[str, Any], moment: MomentSpot | None) -> dict[str, Any]:
    """The model's sharded state plus its AdamW state, named by megatron-core's own helpers.

    ``optim_state_to_sharding_state`` keys each moment ``optimizer.state.<state name>.<param
    key>`` (state name first); ``step`` is excluded, as megatron keeps it with the param groups.
    """
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    params = [v.data for k, v in sorted(model_sd.items()) if hasattr(v, "data")]
    for p in params:
        p.grad = torch.full_like(p, 0.25) * (1 + torch.arange(p.numel()).reshape(p.shape) % 3)
    opt = torch.optim.AdamW(params, lr=1e-2)
    opt.step()
    if moment is not None:
        fqn, name, index = moment
        local = model_sd[fqn]
        rel = (index[0] - local.global_offset[0], *index[1:])
        if 0 <= rel[0] < local.data.shape[0]:
            opt.state[local.data][name][rel] += 0.5
    osd = opt.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
    return {"model": model_sd, "optimizer": osd}


def build(rank: int, world: int, root: Path) -> list[Case]:
    """A clean megatron checkpoint and a planted one (one weight element)."""
    import megatron.core
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    full = {k: v.detach().clone() for k, v in toy_model().state_dict().items()}
    clean, planted = root / "megatron", root / "megatron_planted"
    key, index = PLANT_WEIGHT
    with cpu_save_patches():
        for path, change in ((clean, 0.0), (planted, 0.5)):
            if rank == 0:
                path.mkdir(parents=True)
            dist.barrier()
            state = {k: v.clone() for k, v in full.items()}
            state[key][index] += change
            model_sd = sharded_state_dict(state, rank, world)
            moment = PLANT_MOMENT if change else None
            dist_checkpointing.save(with_optimizer(model_sd, moment), str(path))
    return [
        toy_case(
            "megatron",
            f"megatron-core {megatron.core.__version__}",
            "megatron",
            clean,
            planted,
            PLANT_WEIGHT,
            PLANT_MOMENT,
            optim_tensor_keys=sorted(optim_keys(TOY_FQNS, ("exp_avg", "exp_avg_sq"))),
            # Megatron keeps iteration, args, ... in common.pt, a pickle fsdpcheck does not
            # run: reports name the file.
            non_tensor_keys=["common.pt"],
        )
    ]
