"""accelerate ``save_state`` with FSDP2 on CPU ranks: the sharded and the full-state variant.

accelerate takes its FSDP path only on GPUs; on CPU it silently falls back to DDP. The three
assignments in ``accelerator()`` flip its state to FSDP after construction, after which
``prepare()`` shards with ``fully_shard`` and ``save_state`` writes what it writes on GPUs:
``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (DCP), or with FULL_STATE_DICT
``pytorch_model_fsdp.bin`` and ``optimizer.bin``.
"""

from __future__ import annotations

from pathlib import Path

from tests.corpus import Case, Cases, plant, toy_case, toy_model
from tests.corpus.live import Live, adamw, train_steps
from tests.dist.accelerate.accelerate_scenarios import accelerator

PLANT_WEIGHT = ("embed.weight", (9, 0))
PLANT_MOMENT = ("head.weight", "exp_avg", (0, 7))


CASES = Cases(
    library="accelerate",
    requires="accelerate",
    layout="accelerate",
    names=("accelerate", "accelerate_full"),
    live=("accelerate", "accelerate_full"),
    order=3,
)


def train(rank: int, world: int) -> Live:
    """accelerate-prepared FSDP2 toy model and AcceleratedOptimizer after two steps."""
    acc = accelerator()
    raw = toy_model()
    model, opt = acc.prepare(raw, adamw(raw.parameters()))
    train_steps(model, opt, rank, backward=acc.backward)
    return Live(model=model, optimizer=opt, inner=acc.unwrap_model(model), keep={"acc": acc})


def save(live: Live, path: Path, full: bool) -> None:
    """``save_state`` with the plugin's SHARDED_STATE_DICT or FULL_STATE_DICT."""
    acc = live.keep["acc"]
    acc.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT" if full else "SHARDED_STATE_DICT")
    acc.save_state(str(path))


def build(rank: int, world: int, root: Path) -> list[Case]:
    """Sharded and full-state save_state folders, each with a planted twin."""
    import accelerate

    live = train(rank, world)
    cases = []
    for full in (False, True):
        name = "accelerate_full" if full else "accelerate"
        clean, planted = root / name, root / f"{name}_planted"
        save(live, clean, full)
        with plant(live.inner, PLANT_WEIGHT, live.optimizer, PLANT_MOMENT):
            save(live, planted, full)
        cases.append(
            toy_case(
                name,
                f"accelerate {accelerate.__version__}",
                "accelerate",
                clean,
                planted,
                PLANT_WEIGHT,
                PLANT_MOMENT,
                make_live="tests.corpus.accel:train",
                extra={"full": full},
            )
        )
    return cases
