"""torchtitan: ``CheckpointManager`` + ``OptimizersContainer`` on the FSDP2 toy model.

torchtitan's own Llama needs triton, so the toy model goes through torchtitan's checkpoint code
(the part that decides the layout). Step folders ``step-N/`` hold flat model keys,
``optimizer`` -> ``state.<fqn>.<name>``, ``lr_scheduler``, ``dataloader`` and ``train_state``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.corpus import Case, Cases, plant, shard_toy, toy_case, toy_model
from tests.corpus.live import Live, train_steps

PLANT_WEIGHT = ("head.weight", (8, 2))
PLANT_MOMENT = ("embed.weight", "exp_avg_sq", (1, 6))


class _Stateful:
    """A stand-in for the dataloader and the Trainer's ``train_state``.

    torchtitan saves whatever ``state_dict`` returns.
    """

    def __init__(self, **state: Any) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state = dict(sd)


CASES = Cases(
    library="torchtitan",
    requires="torchtitan",
    layout="torchtitan",
    names=("torchtitan",),
    live=("torchtitan",),
    order=1,
)


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
        train_steps(model, opts, rank, steps=1, first=step)
        scheds.step()
    return Live(model=model, optimizer=opts, inner=model, keep={"lr_schedulers": scheds})


def save(live: Live, folder: Path, step: int) -> Path:
    """``CheckpointManager.save`` of step `step` into `folder`; the step folder written."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    cfg = CheckpointManager.Config(enable=True, folder=folder.name, interval=1, keep_latest_k=0)
    manager = cfg.build(
        dataloader=_Stateful(position=7),
        model_parts=[live.model],
        optimizers=live.optimizer,
        lr_schedulers=live.keep["lr_schedulers"],
        states={"train_state": _Stateful(step=2, ntokens_seen=40)},
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
    with plant(live.inner, PLANT_WEIGHT, live.optimizer, PLANT_MOMENT):
        planted = save(live, root / "titan_planted", 2)
    return [
        toy_case(
            "torchtitan",
            f"torchtitan {getattr(torchtitan, '__version__', '0.3.0')}",
            "torchtitan",
            clean,
            planted,
            PLANT_WEIGHT,
            PLANT_MOMENT,
            non_tensor_keys=["lr_scheduler", "dataloader", "train_state"],
            make_live="tests.corpus.titan:train",
        )
    ]
