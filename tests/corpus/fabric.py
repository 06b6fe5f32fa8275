"""Lightning Fabric ``ModelParallelStrategy`` (FSDP2) on CPU ranks with gloo.

``fabric.save(path, {"model": model, "optimizer": optimizer})`` writes a DCP directory. The
Fabric-wrapped model (what users hold and pass) names its parameters ``_forward_module.<fqn>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.corpus import Case, Cases, plant, shard_toy, toy_case, toy_model
from tests.corpus.live import Live, adamw, train_steps

PLANT_WEIGHT = ("layers.0.proj.bias", (3,))
PLANT_MOMENT = ("norm.weight", "exp_avg", (4,))


CASES = Cases(
    library="lightning",
    requires="lightning",
    layout="lightning",
    names=("lightning",),
    live=("lightning",),
    order=2,
)


def _parallelize(model: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    return shard_toy(model, mesh=device_mesh["data_parallel"])


def train(rank: int, world: int) -> Live:
    """Fabric-wrapped FSDP2 toy model and optimizer after two steps."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=_parallelize, data_parallel_size=world, tensor_parallel_size=1
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(toy_model())
    opt = fabric.setup_optimizers(adamw(model.parameters()))
    train_steps(model, opt, rank, backward=fabric.backward)
    return Live(model=model, optimizer=opt, inner=model.module, keep={"fabric": fabric})


def save(live: Live, path: Path) -> None:
    """``fabric.save`` of the model and optimizer, as Lightning's docs show."""
    live.keep["fabric"].save(str(path), {"model": live.model, "optimizer": live.optimizer})


def build(rank: int, world: int, root: Path) -> list[Case]:
    """A clean Fabric checkpoint and a planted one (one weight, one Adam moment changed)."""
    import lightning

    live = train(rank, world)
    clean, planted = root / "fabric", root / "fabric_planted"
    save(live, clean)
    with plant(live.inner, PLANT_WEIGHT, live.optimizer, PLANT_MOMENT):
        save(live, planted)
    return [
        toy_case(
            "lightning",
            f"lightning {lightning.__version__}",
            "lightning",
            clean,
            planted,
            PLANT_WEIGHT,
            PLANT_MOMENT,
            make_live="tests.corpus.fabric:train",
        )
    ]
