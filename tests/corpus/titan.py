"""torchtitan: ``CheckpointManager`` + ``OptimizersContainer`` on the FSDP2 toy model.

torchtitan's own Llama needs triton, so the toy model goes through torchtitan's checkpoint code
(the part that decides the layout). Step folders ``step-N/`` hold flat model keys,
``optimizer`` -> ``state.<fqn>.<name>``, ``lr_scheduler``, ``dataloader`` and ``train_state``.
"""

from __future__ import annotations

from pathlib import Path

from tests.corpus import Case, Cases, plant, shard_toy, toy_case, toy_model
from tests.corpus.live import Live, train_steps
from tests.torchtitan_parts import Stateful, checkpoint_manager, optimizers

PLANT_WEIGHT = ("head.weight", (8, 2))
PLANT_MOMENT = ("embed.weight", "exp_avg_sq", (1, 6))


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
    model = shard_toy(toy_model())
    opts, scheds = optimizers(model, lr=1e-2, weight_decay=0.1, training_steps=10)
    for step in range(2):
        train_steps(model, opts, rank, steps=1, first=step)
        scheds.step()
    return Live(model=model, optimizer=opts, inner=model, keep={"lr_schedulers": scheds})


def save(live: Live, folder: Path, step: int) -> Path:
    """``CheckpointManager.save`` of step `step` into `folder`; the step folder written."""
    manager = checkpoint_manager(
        live.model,
        live.optimizer,
        live.keep["lr_schedulers"],
        folder,
        dataloader=Stateful(position=7),
        states={"train_state": Stateful(step=2, ntokens_seen=40)},
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
