"""accelerate's real save_state / load_state with FSDP2 on gloo CPU ranks (see dist_harness).

accelerate only takes its FSDP path on GPUs; on CPU it silently falls back to DDP. The setup
flips its state to FSDP after building the Accelerator (the three assignments in
`accelerator()`), after which prepare() shards with fully_shard and save_state writes the
sharded pytorch_model_fsdp_0/ and optimizer_0/ DCP directories, as on GPUs.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fsdpcheck
from fsdpcheck.integrations.accelerate import verify_state
from fsdpcheck.testing import VOCAB, TinyTransformer, drop_state, unchanged
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario


def accelerator() -> Any:
    """An Accelerator whose FSDP2 plugin is honoured on CPU (shared with tests/corpus/accel.py)."""
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


@dataclass
class Base:
    acc: Any
    model: Any  # prepared by accelerate (FSDP2)
    opt: Any  # accelerate's AcceleratedOptimizer
    good: Path  # save_state after two steps


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, Base]:
    acc = accelerator()
    torch.manual_seed(0)
    raw = TinyTransformer()
    model, opt = acc.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
    x = torch.randint(0, VOCAB, (4, 5))
    for _ in range(2):
        acc.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
    good = shared / "good"
    acc.save_state(str(good))
    return {"good": good}, Base(acc, model, opt, good)


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.model, b.opt.optimizer)
REGISTRY.order = 1  # last in a shared spawn: accelerate changes process-wide state


def run_world(rank: int, world: int, workdir: Path, shared: str | None = None, only=None) -> dict:
    """Entry point for dist_harness.run_ranks."""
    return REGISTRY.run(rank, world, workdir, shared, only)


def checked_verify_state(b: Base, path: Path) -> dict[str, Any]:
    """verify_state, checked read-only."""
    with unchanged(b.model, b.opt.optimizer):
        return summary(verify_state(b.acc, path))


@contextlib.contextmanager
def perturbed(model: Any) -> Iterator[None]:
    """Every parameter doubled (a model that did not get the checkpoint); restored on exit."""
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)


@scenario(2)
def saved(w: World) -> Any:
    return sorted(p.name for p in w.ckpts["good"].iterdir())


@scenario(2)
def clean(w: World) -> Any:
    b = w.base
    with perturbed(b.model):
        before = checked_verify_state(b, w.ckpts["good"])
        b.acc.load_state(str(w.ckpts["good"]))
        after = checked_verify_state(b, w.ckpts["good"])
    return {"before": before, "after": after}


def _without(w: World, fqn: str, name: str) -> Path:
    """A copy of the good state whose optimizer directory lacks `name` for parameter `fqn`."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    b = w.base
    d = w.workdir / "state"
    if w.rank == 0:
        shutil.copytree(w.ckpts["good"] / "pytorch_model_fsdp_0", d / "pytorch_model_fsdp_0")
    with drop_state(b.opt.optimizer, b.model.get_parameter(fqn), name):
        osd = get_optimizer_state_dict(b.model, b.opt.optimizer)
        dcp_save({"optimizer": osd}, checkpoint_id=str(d / "optimizer_0"))
    w.barrier()
    return d


@scenario(2)
def missing_step(w: World) -> Any:
    # accelerate's own load_state of this directory fails with "RuntimeError: Missing key in
    # checkpoint state_dict: optimizer.state.blocks.0.w1.weight.step." (and, with gloo, can
    # take the process down), so it is not called here.
    return checked_verify_state(w.base, _without(w, "blocks.0.w1.weight", "step"))


@scenario(2)
def dropped_moment(w: World) -> Any:
    return checked_verify_state(w.base, _without(w, "head.weight", "exp_avg"))


@scenario(2)
def load_and_inspect(w: World) -> Any:
    from fsdpcheck.inspection import inspect_checkpoint

    b = w.base
    with perturbed(b.model):
        r = fsdpcheck.load(b.model, w.ckpts["good"], optimizer=b.opt.optimizer, expect="sharded")
    info = inspect_checkpoint(str(w.ckpts["good"]))
    return {"load": summary(r), "kind": info["kind"], "format": info["format"],
            "tensors": len(info["tensors"])}  # fmt: skip


@scenario(2)
def full_then_sharded(w: World) -> Any:
    b = w.base
    full = w.workdir / "full"
    b.acc.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        b.acc.save_state(str(full))
    finally:
        b.acc.state.fsdp_plugin.set_state_dict_type("SHARDED_STATE_DICT")
    # accelerate may still be writing the full-state files on another rank when save_state
    # returns here (every rank writes optimizer.bin): wait for all of them.
    w.barrier()
    files = sorted(p.name for p in full.iterdir())
    with perturbed(b.model):  # the sharded model did not get the full state
        report = checked_verify_state(b, full)
        try:
            fsdpcheck.load(b.model, full, optimizer=b.opt.optimizer, expect="sharded")
            refused = None
        except fsdpcheck.CheckpointKindError as exc:
            refused = str(exc)
        # fsdpcheck.load takes it the full way and checks it.
        loaded = summary(fsdpcheck.load(b.model, full, expect="full", verify="full"))
    return {"files": files, "report": report, "refused": refused, "loaded": loaded}
