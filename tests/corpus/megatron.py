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

from tests.corpus import Case, toy_case, toy_model

PLANT_WEIGHT = ("layers.0.proj.weight", (6, 2))


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
        local = t[rank * rows : (rank + 1) * rows].clone()
        out[key] = ShardedTensor.from_rank_offsets(key, local, (0, rank, world))
    out["iteration"] = 2
    out["args"] = {"hidden": 8, "layers": 2}
    return out


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
            dist_checkpointing.save(sharded_state_dict(state, rank, world), str(path))
    return [
        toy_case(
            "megatron",
            f"megatron-core {megatron.core.__version__}",
            "megatron",
            clean,
            planted,
            PLANT_WEIGHT,
            # Megatron keeps iteration, args, ... in common.pt, a pickle fsdpcheck does not
            # run: reports name the file.
            non_tensor_keys=["common.pt"],
        )
    ]
