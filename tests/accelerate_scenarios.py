"""accelerate's real save_state / load_state with FSDP2 on gloo CPU ranks (see dist_harness).

accelerate only takes its FSDP path on GPUs; on CPU it silently falls back to DDP. The test
flips its state to FSDP after building the Accelerator (the three assignments in
`accelerator()`), after which prepare() shards with fully_shard and save_state writes the
sharded pytorch_model_fsdp_0/ and optimizer_0/ DCP directories, as on GPUs.
"""

from __future__ import annotations

import shutil
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdpcheck
from fsdpcheck.demo import VOCAB, TinyTransformer
from fsdpcheck.integrations.accelerate import verify_state


def accelerator() -> Any:
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


def summary(r: fsdpcheck.Report) -> dict[str, Any]:
    return {
        "ok": r.ok,
        "findings": [(f.key, f.kind, f.message) for f in r.findings],
        "keys": r.keys_checked,
        "text": str(r),
    }


def main(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    acc = accelerator()
    torch.manual_seed(0)
    raw = TinyTransformer()
    model, opt = acc.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
    x = torch.randint(0, VOCAB, (4, 5))
    for _ in range(2):
        acc.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
    good = workdir / "good"
    acc.save_state(str(good))
    out: dict[str, Any] = {"saved": sorted(p.name for p in good.iterdir())}

    def perturb() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2)

    def scenario(name: str, fn) -> None:
        dist.barrier()
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"__error__": traceback.format_exc()}

    def clean() -> Any:
        perturb()
        before = summary(verify_state(acc, good))
        acc.load_state(str(good))
        return {"before": before, "after": summary(verify_state(acc, good))}

    def edited(name: str, edit) -> Path:
        """A copy of the good state whose optimizer directory is rewritten with `edit`."""
        d = workdir / name
        if rank == 0:
            shutil.copytree(good / "pytorch_model_fsdp_0", d / "pytorch_model_fsdp_0")
        osd = get_optimizer_state_dict(model, opt.optimizer)
        state = {k: dict(v) for k, v in osd["state"].items()}
        edit(state)
        dcp_save({"optimizer": {**osd, "state": state}}, checkpoint_id=str(d / "optimizer_0"))
        dist.barrier()
        return d

    def missing_step() -> Any:
        # accelerate's own load_state of this directory fails with "RuntimeError: Missing key in
        # checkpoint state_dict: optimizer.state.blocks.0.w1.weight.step." (and, with gloo, can
        # take the process down), so it is not called here.
        d = edited("nostep", lambda s: s["blocks.0.w1.weight"].pop("step"))
        return summary(verify_state(acc, d))

    def dropped_moment() -> Any:
        d = edited("nomoment", lambda s: s["head.weight"].pop("exp_avg"))
        return summary(verify_state(acc, d))

    def full_then_sharded() -> Any:
        full = workdir / "full"
        acc.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        try:
            acc.save_state(str(full))
        finally:
            acc.state.fsdp_plugin.set_state_dict_type("SHARDED_STATE_DICT")
        # accelerate may still be writing the full-state files on another rank when save_state
        # returns here (every rank writes optimizer.bin): wait for all of them.
        dist.barrier()
        files = sorted(p.name for p in full.iterdir())
        perturb()  # the sharded model did not get the full state
        report = summary(verify_state(acc, full))
        try:
            fsdpcheck.load(model, full, optimizer=opt.optimizer, expect="sharded")
            refused = None
        except fsdpcheck.CheckpointKindError as exc:
            refused = str(exc)
        # fsdpcheck.load takes it the full way and checks it.
        loaded = summary(fsdpcheck.load(model, full, expect="full", verify="full"))
        return {
            "files": files,
            "report": report,
            "refused": refused,
            "loaded": loaded,
        }

    def through_load_and_inspect() -> Any:
        perturb()
        r = fsdpcheck.load(model, good, optimizer=opt.optimizer, expect="sharded")
        from fsdpcheck.cli import inspect_checkpoint

        info = inspect_checkpoint(str(good))
        return {"load": summary(r), "kind": info["kind"], "format": info["format"],
                "tensors": len(info["tensors"])}  # fmt: skip

    scenario("clean", clean)
    scenario("missing_step", missing_step)
    scenario("dropped_moment", dropped_moment)
    scenario("load_and_inspect", through_load_and_inspect)
    scenario("full_then_sharded", full_then_sharded)
    return out
