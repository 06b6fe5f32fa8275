"""DeepSpeed ZeRO-2 and ZeRO-3 ``save_checkpoint`` on CPU ranks (gloo).

Layout: ``<dir>/latest`` names the tag; ``<dir>/<tag>/`` holds ``mp_rank_00_model_states.pt``
(ZeRO-2: ``module`` = the full fp32 state dict) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
(ZeRO-3: ``module`` = EMPTY placeholders, the values live in the optimizer files), and
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` with each rank's flat fp32 partition and flat
Adam moments.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch

from tests.corpus import Case, Cases, Planted

# A plain MLP: DeepSpeed shards the flat buffer itself, no FSDP.
DS_FQNS = ["0.bias", "0.weight", "2.bias", "2.weight"]
PLANT_WEIGHT = ("2.weight", (3, 1))


CASES = Cases(
    library="deepspeed",
    requires="deepspeed",
    layout="deepspeed",
    names=("deepspeed_zero2", "deepspeed_zero3"),
    order=4,
)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))


def _import_deepspeed() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # DeepSpeed JIT-compiles a shared-memory allreduce op for CPU ranks on first use (about a
    # minute on two cores, C++ toolchain needed); gloo's allreduce is all these tests need.
    # The module from sys.modules: `import deepspeed.comm.torch as m` binds deepspeed.comm's
    # attribute `torch`, which is torch itself.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return deepspeed


def train(stage: int, rank: int) -> Any:
    """A DeepSpeed engine at ZeRO `stage` after one AdamW step (torch's AdamW, no custom op)."""
    g = torch.Generator().manual_seed(rank)
    return make_engine(_mlp(), stage, torch.randn(2, 8, generator=g))


def make_engine(model: torch.nn.Module, stage: int, batch: torch.Tensor, **zero: Any) -> Any:
    """`model` in a DeepSpeed engine at ZeRO `stage`, after one AdamW step on `batch`.

    Args:
        model: The module to wrap.
        stage: The ZeRO stage.
        batch: This rank's input of the one step (2 samples).
        **zero: More ``zero_optimization`` settings (``stage3_param_persistence_threshold=0``
            partitions every ZeRO-3 parameter, however small).
    """
    deepspeed = _import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_batch_size": 2 * torch.distributed.get_world_size(),
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage, **zero},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True},
        },
    }
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    eng.backward(eng(batch).pow(2).mean())
    eng.step()
    return eng


def _full_params(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    deepspeed = _import_deepspeed()
    out = {}
    for name, p in engine.module.named_parameters():
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().clone()
        else:
            out[name] = p.detach().clone()
    return out


def _plant(engine: Any, stage: int, key: str, index: tuple[int, ...], delta: float) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    p = engine.module.get_parameter(key)
    # The fp32 master copy (the optimizer's flat partitions, which is all ZeRO-3 saves) through
    # DeepSpeed's own accessor; ZeRO-2 also saves the module's copy, changed alike.
    master = safe_get_full_fp32_param(p)
    master[index] += delta
    safe_set_full_fp32_param(p, master)
    if stage == 2:
        with torch.no_grad():
            p[index] += delta


def build(rank: int, world: int, root: Path) -> list[Case]:
    """ZeRO-2 and ZeRO-3 checkpoints, each with a planted twin (one weight element)."""
    import deepspeed

    from fsdpcheck import fingerprint_tensor

    cases = []
    for stage in (2, 3):
        engine = train(stage, rank)
        full = _full_params(engine, stage)
        clean, planted = root / f"zero{stage}", root / f"zero{stage}_planted"
        engine.save_checkpoint(str(clean), tag="global_step1")
        key, index = PLANT_WEIGHT
        _plant(engine, stage, key, index, 0.5)
        engine.save_checkpoint(str(planted), tag="global_step1")
        _plant(engine, stage, key, index, -0.5)
        cases.append(
            Case(
                name=f"deepspeed_zero{stage}",
                library=f"deepspeed {deepspeed.__version__}",
                path=str(clean),
                expected_layout="deepspeed",
                model_keys=sorted(DS_FQNS),
                planted_path=str(planted),
                planted=[Planted(key, index, "weight")],
                extra={
                    "stage": stage,
                    "tag": "global_step1",
                    "model_fingerprints": {k: fingerprint_tensor(v) for k, v in full.items()},
                    "model_numel": {k: v.numel() for k, v in full.items()},
                },
            )
        )
        engine.destroy()
    return cases
