"""Lightning Fabric ``ModelParallelStrategy`` (FSDP2) on CPU ranks with gloo.

``fabric.save(path, {"model": model, "optimizer": optimizer})`` writes a DCP directory. The
Fabric-wrapped model (what users hold and pass) names its parameters ``_forward_module.<fqn>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.corpus import (
    TOY_FQNS,
    Case,
    Planted,
    bump,
    optim_keys,
    set_element,
    shard_toy,
    toy_model,
)
from tests.corpus.live import Live, adamw

PLANT_WEIGHT = ("layers.0.proj.bias", (3,))
PLANT_MOMENT = ("norm.weight", "exp_avg", (4,))


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
    for step in range(2):
        from tests.corpus import toy_batch

        fabric.backward(model(toy_batch(rank, step)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
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
    w_key, w_idx = PLANT_WEIGHT
    m_fqn, m_name, m_idx = PLANT_MOMENT
    weight = live.inner.get_parameter(w_key)
    moment = live.optimizer.optimizer.state[live.inner.get_parameter(m_fqn)][m_name]
    old_w, old_m = bump(weight, w_idx), bump(moment, m_idx)
    try:
        save(live, planted)
    finally:
        set_element(weight, w_idx, old_w)
        set_element(moment, m_idx, old_m)
    return [
        Case(
            name="lightning",
            library=f"lightning {lightning.__version__}",
            path=str(clean),
            expected_layout="lightning",
            model_keys=sorted(TOY_FQNS),
            optim_tensor_keys=sorted(optim_keys(TOY_FQNS)),
            planted_path=str(planted),
            planted=[
                Planted(w_key, w_idx, "weight"),
                Planted(f"optim.state.{m_fqn}.{m_name}", m_idx, "moment"),
            ],
            make_live="tests.corpus.fabric:train",
        )
    ]
