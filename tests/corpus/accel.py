"""accelerate ``save_state`` with FSDP2 on CPU ranks: the sharded and the full-state variant.

accelerate takes its FSDP path only on GPUs; on CPU it silently falls back to DDP. The three
assignments in ``accelerator()`` flip its state to FSDP after construction, after which
``prepare()`` shards with ``fully_shard`` and ``save_state`` writes what it writes on GPUs:
``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (DCP), or with FULL_STATE_DICT
``pytorch_model_fsdp.bin`` and ``optimizer.bin``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.corpus import (
    TOY_FQNS,
    Case,
    Planted,
    bump,
    optim_keys,
    set_element,
    toy_batch,
    toy_model,
)
from tests.corpus.live import Live, adamw

PLANT_WEIGHT = ("embed.weight", (9, 0))
PLANT_MOMENT = ("head.weight", "exp_avg", (0, 7))


def accelerator() -> Any:
    """An Accelerator whose FSDP2 plugin is honoured on CPU."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False
    )
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    return acc


def train(rank: int, world: int) -> Live:
    """accelerate-prepared FSDP2 toy model and AcceleratedOptimizer after two steps."""
    acc = accelerator()
    raw = toy_model()
    model, opt = acc.prepare(raw, adamw(raw.parameters()))
    for step in range(2):
        acc.backward(model(toy_batch(rank, step)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
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
    w_key, w_idx = PLANT_WEIGHT
    m_fqn, m_name, m_idx = PLANT_MOMENT
    inner_opt = live.optimizer.optimizer
    cases = []
    for full in (False, True):
        name = "accelerate_full" if full else "accelerate"
        clean, planted = root / name, root / f"{name}_planted"
        save(live, clean, full)
        weight = live.inner.get_parameter(w_key)
        moment = inner_opt.state[live.inner.get_parameter(m_fqn)][m_name]
        old_w, old_m = bump(weight, w_idx), bump(moment, m_idx)
        try:
            save(live, planted, full)
        finally:
            set_element(weight, w_idx, old_w)
            set_element(moment, m_idx, old_m)
        cases.append(
            Case(
                name=name,
                library=f"accelerate {accelerate.__version__}",
                path=str(clean),
                expected_layout="accelerate",
                model_keys=sorted(TOY_FQNS),
                optim_tensor_keys=sorted(optim_keys(TOY_FQNS)),
                planted_path=str(planted),
                planted=[
                    Planted(w_key, w_idx, "weight"),
                    Planted(f"optim.state.{m_fqn}.{m_name}", m_idx, "moment"),
                ],
                make_live="tests.corpus.accel:train",
                extra={"full": full},
            )
        )
    return cases
