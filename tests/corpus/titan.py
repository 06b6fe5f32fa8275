"""torchtitan: ``CheckpointManager`` + ``OptimizersContainer`` on the FSDP2 toy model.

torchtitan's own Llama needs triton, so the toy model goes through torchtitan's checkpoint code
(the part that decides the layout). Step folders ``step-N/`` hold flat model keys,
``optimizer`` -> ``state.<fqn>.<name>``, ``lr_scheduler``, ``dataloader`` and ``train_state``.
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
from tests.corpus.live import Live, train_steps

PLANT_WEIGHT = ("head.weight", (8, 2))
PLANT_MOMENT = ("embed.weight", "exp_avg_sq", (1, 6))


class _Loader:
    """A stateful dataloader stand-in: torchtitan saves whatever ``state_dict`` returns."""

    def __init__(self) -> None:
        self.position = 7

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = sd["position"]


class _TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 2, 40

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def train(rank: int, world: int) -> Live:
    """The toy model under FSDP2, torchtitan's optimizer and LR scheduler containers, 2 steps."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    model = shard_toy(toy_model())
    cfg = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
            )
        ],
        implementation="for-loop",
    )
    opts = cfg.build(model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=opts, training_steps=10)
    for step in range(2):
        train_steps(model, opts, rank, steps=1) if step == 0 else _step(model, opts, rank, step)
        scheds.step()
    return Live(model=model, optimizer=opts, inner=model, keep={"lr_schedulers": scheds})


def _step(model: torch.nn.Module, opts: Any, rank: int, step: int) -> None:
    from tests.corpus import toy_batch

    model(toy_batch(rank, step)).float().pow(2).mean().backward()
    opts.step()
    opts.zero_grad()


def save(live: Live, folder: Path, step: int) -> Path:
    """``CheckpointManager.save`` of step `step` into `folder`; the step folder written."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    cfg = CheckpointManager.Config(enable=True, folder=folder.name, interval=1, keep_latest_k=0)
    manager = cfg.build(
        dataloader=_Loader(),
        model_parts=[live.model],
        optimizers=live.optimizer,
        lr_schedulers=live.keep["lr_schedulers"],
        states={"train_state": _TrainState()},
        sd_adapter=None,
        base_folder=str(folder.parent),
    )
    manager.save(curr_step=step)
    manager.close()
    return folder / f"step-{step}"


def build(rank: int, world: int, root: Path) -> list[Case]:
    """A clean step folder and a planted one (one weight, one Adam moment changed)."""
    import torchtitan

    live = train(rank, world)
    clean = save(live, root / "titan", 2)
    w_key, w_idx = PLANT_WEIGHT
    m_fqn, m_name, m_idx = PLANT_MOMENT
    opt = live.optimizer.optimizers[0]
    weight = live.inner.get_parameter(w_key)
    moment = opt.state[live.inner.get_parameter(m_fqn)][m_name]
    old_w, old_m = bump(weight, w_idx), bump(moment, m_idx)
    try:
        planted = save(live, root / "titan_planted", 2)
    finally:
        set_element(weight, w_idx, old_w)
        set_element(moment, m_idx, old_m)
    return [
        Case(
            name="torchtitan",
            library=f"torchtitan {getattr(torchtitan, '__version__', '0.3.0')}",
            path=str(clean),
            expected_layout="torchtitan",
            model_keys=sorted(TOY_FQNS),
            optim_tensor_keys=sorted(optim_keys(TOY_FQNS)),
            non_tensor_keys=["lr_scheduler", "dataloader", "train_state"],
            planted_path=str(planted),
            planted=[
                Planted(w_key, w_idx, "weight"),
                Planted(f"optim.state.{m_fqn}.{m_name}", m_idx, "moment"),
            ],
            make_live="tests.corpus.titan:train",
        )
    ]
