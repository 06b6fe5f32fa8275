"""torchtitan's trainer parts around any model: its optimizer and LR scheduler containers, a
``CheckpointManager``, and the stand-in for the states a Trainer registers beside them.

torchtitan's own models need triton, so the tests' models go through torchtitan's checkpoint
code (the part that decides the layout). Used by the corpus, the dist scenarios and
bench/bench_scale.py (which puts the repository on ``sys.path``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Stateful:
    """A stand-in for the dataloader and the Trainer's ``train_state``.

    torchtitan saves whatever ``state_dict`` returns.
    """

    def __init__(self, **state: Any) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state = dict(sd)


def optimizers(
    model: Any, *, lr: float = 1e-2, weight_decay: float | None = None, training_steps: int = 10
) -> tuple[Any, Any]:
    """An ``OptimizersContainer`` (AdamW, the for-loop implementation) over `model` and its
    ``LRSchedulersContainer`` (one warmup step)."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    kwargs: dict[str, Any] = {"lr": lr}
    if weight_decay is not None:
        kwargs["weight_decay"] = weight_decay
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=kwargs)
    opts = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(
        model_parts=[model]
    )
    scheds = LRSchedulersContainer.Config(warmup_steps=1).build(
        optimizers=opts, training_steps=training_steps
    )
    return opts, scheds


def checkpoint_manager(
    model: Any,
    opts: Any,
    scheds: Any,
    folder: Path,
    *,
    dataloader: Any = None,
    states: dict[str, Any] | None = None,
    sd_adapter: Any = None,
    **config: Any,
) -> Any:
    """A ``CheckpointManager`` saving every step into ``folder/step-N``, keeping all of them.

    `states` defaults to a ``train_state`` at step 0; `config` adds to ``CheckpointManager.Config``.
    """
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    cfg = CheckpointManager.Config(
        enable=True, folder=folder.name, interval=1, keep_latest_k=0, **config
    )
    return cfg.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=opts,
        lr_schedulers=scheds,
        states={"train_state": Stateful(step=0)} if states is None else states,
        sd_adapter=sd_adapter,
        base_folder=str(folder.parent),
    )
