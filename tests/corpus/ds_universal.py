"""DeepSpeed ZeRO-2 ``save_checkpoint`` converted by ``ds_to_universal`` (what Megatron-DeepSpeed
reshards from), clean and planted.

The planted twin changes, through DeepSpeed's own accessors, one element of a parameter's fp32
master weight (its module weight left as it was: a master that drifted from the weights) and one
element of an Adam moment; both are saved with ``save_checkpoint`` and converted with
``ds_to_universal``, whose ``zero/<fqn>/{fp32,exp_avg,exp_avg_sq,step}.pt`` must hold them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path
from typing import Any

import torch

from tests.corpus import Case, Cases, Planted, optim_keys
from tests.corpus.ds import DS_FQNS, train

UNIVERSAL_STATES = ("exp_avg", "exp_avg_sq", "fp32", "step")
PLANT_MASTER = ("2.weight", "fp32", (3, 1))
PLANT_MOMENT = ("0.weight", "exp_avg", (5, 7))


CASES = Cases(
    library="deepspeed_universal",
    requires="deepspeed",
    layout="deepspeed_universal",
    names=("deepspeed_universal",),
    order=5,
)


def _bump(engine: Any, fqn: str, name: str, index: tuple[int, ...], delta: float) -> None:
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    p = engine.module.get_parameter(fqn)
    if name == "fp32":
        value = safe_get_full_fp32_param(p)
        value[index] += delta
        safe_set_full_fp32_param(p, value)
    else:
        value = safe_get_full_optimizer_state(p, name)
        value[index] += delta
        safe_set_full_optimizer_state(p, value, name)


def convert(rank: int, folder: Path, out: Path) -> None:
    """``ds_to_universal`` of one tag folder, on rank 0 (it is an offline tool), then a barrier."""
    if rank == 0:
        from deepspeed.checkpoint.ds_to_universal import main

        args = argparse.Namespace(
            input_folder=str(folder),
            output_folder=str(out),
            num_extract_workers=1,  # in this process: no process pool
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            # A plain DeepSpeed model records no universal_checkpoint_info (Megatron-DeepSpeed
            # does); the converter's own flag adds the default.
            inject_missing_state=True,
        )
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(args)
    torch.distributed.barrier()


def build(rank: int, world: int, root: Path) -> list[Case]:
    """One universal checkpoint of a ZeRO-2 AdamW engine and its planted twin."""
    import deepspeed

    engine = train(2, rank)
    tag = "global_step1"
    clean, planted = root / "clean", root / "planted"
    engine.save_checkpoint(str(clean), tag=tag)
    for spot in (PLANT_MASTER, PLANT_MOMENT):
        _bump(engine, *spot, 0.5)
    engine.save_checkpoint(str(planted), tag=tag)
    for spot in (PLANT_MASTER, PLANT_MOMENT):
        _bump(engine, *spot, -0.5)
    engine.destroy()
    for folder in (clean, planted):
        convert(rank, folder / tag, folder / f"{tag}_universal")
    return [
        Case(
            name="deepspeed_universal",
            library=f"deepspeed {deepspeed.__version__} ds_to_universal",
            path=str(clean / f"{tag}_universal"),
            expected_layout="deepspeed_universal",
            model_keys=sorted(DS_FQNS),
            optim_tensor_keys=sorted(optim_keys(DS_FQNS, UNIVERSAL_STATES)),
            planted_path=str(planted / f"{tag}_universal"),
            planted=[
                Planted(f"optim.state.{f}.{n}", i, w)
                for (f, n, i), w in ((PLANT_MASTER, "master"), (PLANT_MOMENT, "moment"))
            ],
            extra={"root": str(clean), "tag": tag},
        )
    ]
