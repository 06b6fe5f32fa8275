"""Pipeline parallel x FSDP2 on 4 gloo ranks: each stage's ranks hold different keys.

The model is split the way torchtitan splits it (each stage keeps its layers under the whole
model's names: stage 0 holds ``emb`` and ``blocks.0``, stage 1 ``blocks.1`` and ``head``), each
stage is sharded with FSDP2 over its data-parallel sub-mesh of a (pp=2, dp=2) mesh, and one
training step runs through torch's own pipelining (``PipelineStage`` + ``ScheduleGPipe``).
Then verify, fingerprint, check_replicas, ReplicaWatch, save and load run on the job, clean and
with one planted element, and every rank must return the same report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fsdpcheck
from fsdpcheck.testing import TinyTransformer, snapshot, unchanged
from tests.corpus import bump, set_element
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario
# Rows that shard unevenly over the 2 data-parallel ranks of a stage (7 -> 4, 3).
SIZES = {"vocab": 7, "dim": 6, "hidden": 10, "out": 3}
PLANT = ("blocks.1.w1.weight", (8, 2))  # stage 1; dp rank 1 of it holds rows 5..9


class Stage(nn.Module):
    """One pipeline stage of TinyTransformer, keeping the whole model's parameter names."""

    def __init__(self, full: TinyTransformer, stage: int) -> None:
        super().__init__()
        self.stage = stage
        if stage == 0:
            self.emb = full.emb
            self.blocks = nn.ModuleDict({"0": full.blocks[0]})
        else:
            self.blocks = nn.ModuleDict({"1": full.blocks[1]})
            self.head = full.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stage == 0:
            return self.blocks["0"](self.emb(x))
        return self.head(self.blocks["1"](x)).clone()


def make_stage(seed: int, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """This rank's stage of a fresh model, FSDP2 over the stage's data-parallel ranks."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    full = TinyTransformer(**SIZES)
    stage = mesh.get_coordinate()[0]
    part = Stage(full, stage)
    fully_shard(part, mesh=mesh["dp"])
    return part, torch.optim.AdamW(part.parameters(), lr=1e-2, weight_decay=0.1), stage


def train_step(part: nn.Module, opt: torch.optim.Optimizer, stage: int, mesh: Any) -> None:
    """One step through torch's pipelining: GPipe over the two stages, 2 microbatches."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pp = mesh["pp"].get_group()
    dp_rank = mesh.get_coordinate()[1]
    ps = PipelineStage(part, stage, 2, torch.device("cpu"), group=pp)
    schedule = ScheduleGPipe(ps, n_microbatches=2, loss_fn=lambda out, y: (out - y).pow(2).mean())
    g = torch.Generator().manual_seed(100 + dp_rank)
    x = torch.randint(0, SIZES["vocab"], (4, 5), generator=g)
    y = torch.randn(4, 5, SIZES["out"], generator=g)
    if stage == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    opt.step()
    opt.zero_grad()


@dataclass
class Base:
    part: nn.Module
    opt: torch.optim.Optimizer
    stage: int
    mesh: Any


def setup(rank: int, world: int, shared: Path, saved_by: Any) -> tuple[dict, Base]:
    del rank, saved_by
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    part, opt, stage = make_stage(0, mesh)
    train_step(part, opt, stage, mesh)
    ckpts = {"pp": shared / "pp"}
    fsdpcheck.save(part, ckpts["pp"], optimizer=opt)
    return ckpts, Base(part, opt, stage, mesh)


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.part, b.opt)


def run_world(rank: int, world: int, workdir: Path, shared: str | None = None, only=None) -> dict:
    """Entry point for dist_harness.run_ranks."""
    return REGISTRY.run(rank, world, workdir, shared, only)


def summary(r: fsdpcheck.Report) -> dict[str, Any]:
    return {
        "ok": r.ok,
        "findings": [
            [f.key, f.kind, list(f.max_abs_index) if f.max_abs_index else None, f.rank]
            for f in r.findings
        ],
        "keys": [r.keys_a, r.keys_b, r.keys_checked],
        "elements": r.elements_checked,
        "notes": r.notes,
        "text": str(r).split("\n", 1)[-1],
    }


def _param(part: nn.Module, key: str) -> torch.Tensor | None:
    return dict(part.named_parameters()).get(key)


# ---------------------------------------------------------------------------------------------
@scenario(4)
def pp_verify(w: World) -> Any:
    """verify against the save: clean, then one element planted on stage 1's second dp rank."""
    b = w.base
    with unchanged(b.part, b.opt):
        clean = fsdpcheck.verify(b.part, w.ckpts["pp"], optimizer=b.opt)
    p = _param(b.part, PLANT[0])
    old = bump(p, PLANT[1]) if p is not None else None
    try:
        planted = fsdpcheck.verify(b.part, w.ckpts["pp"], optimizer=b.opt)
    finally:
        if p is not None:
            set_element(p, PLANT[1], old)
    return {"clean": summary(clean), "planted": summary(planted)}


@scenario(4)
def pp_fingerprint_and_replicas(w: World) -> Any:
    """The job's fingerprint (every stage's keys on every rank) equals the checkpoint's."""
    b = w.base
    with unchanged(b.part, b.opt):
        fps = fsdpcheck.fingerprint(b.part, optimizer=b.opt)
        replicas = fsdpcheck.check_replicas(b.part, optimizer=b.opt)
        watch = fsdpcheck.ReplicaWatch(b.part, b.opt, every=1)
        watched = watch.step()
    offline = fsdpcheck.fingerprint_checkpoint(w.ckpts["pp"])
    assert watched is not None
    return {
        "keys": sorted(fps),
        "equal_offline": {k: v for k, v in offline.items() if not k.startswith("optim.")}
        == {k: v for k, v in fps.items() if not k.startswith("optim.")},
        "equal_with_optimizer": offline == fps,
        "replicas": summary(replicas),
        "watch": summary(watched),
    }


@scenario(4)
def pp_load(w: World) -> Any:
    """A fresh model's stages load the checkpoint (each rank its own keys) and check clean."""
    b = w.base
    part, opt, stage = make_stage(7, b.mesh)
    train_step(part, opt, stage, b.mesh)  # optimizer state exists, different values
    before = fsdpcheck.verify(part, w.ckpts["pp"], optimizer=opt)
    report = fsdpcheck.load(part, w.ckpts["pp"], optimizer=opt)
    after = fsdpcheck.verify(part, w.ckpts["pp"], optimizer=opt)
    same = snapshot(part, opt) == snapshot(b.part, b.opt)
    return {
        "before_ok": before.ok,
        "load": summary(report),
        "after": summary(after),
        "rank_local": {"same_as_saved": same},
    }


@scenario(2)
def extra_parameter_on_one_rank(w: World) -> Any:
    """A parameter only rank 1 has: the same Report on both ranks, naming it and the rank."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ref = {k: v.detach().clone() for k, v in m.state_dict().items()}
    if w.rank == 1:
        m.add_module("extra", nn.Linear(2, 2))
    return summary(fsdpcheck.verify(m, ref))


class Optimizers:
    """Several optimizers, one per model part (as torchtitan's OptimizersContainer holds them)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers


def interleaved_parts(seed: int, rank: int) -> tuple[list[nn.Module], Optimizers]:
    """Two model parts per rank (a 4-stage split run interleaved on 2 ranks), stepped once."""
    torch.manual_seed(seed)
    full = TinyTransformer(**SIZES)
    chunks = [
        nn.ModuleDict({"emb": full.emb}),
        nn.ModuleDict({"blocks": nn.ModuleDict({"0": full.blocks[0]})}),
        nn.ModuleDict({"blocks": nn.ModuleDict({"1": full.blocks[1]})}),
        nn.ModuleDict({"head": full.head}),
    ]
    parts = [chunks[rank], chunks[rank + 2]]
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
    for part, opt in zip(parts, opts):
        for p in part.parameters():
            p.grad = torch.full_like(p, 0.1)
        opt.step()
        opt.zero_grad()
    return parts, Optimizers(opts)


@scenario(2)
def several_model_parts_per_rank(w: World) -> Any:
    """Each rank runs two parts: save, fingerprint, verify and load take the list."""
    parts, opts = interleaved_parts(0, w.rank)
    path = w.workdir / "ck"
    fsdpcheck.save(parts, path, optimizer=opts)
    fps = fsdpcheck.fingerprint(parts, optimizer=opts)
    clean = fsdpcheck.verify(parts, path, optimizer=opts)
    fresh, fresh_opts = interleaved_parts(5, w.rank)
    loaded = fsdpcheck.load(fresh, path, optimizer=fresh_opts)
    after = fsdpcheck.verify(fresh, path, optimizer=fresh_opts)
    head = dict(fresh[1].named_parameters()).get("head.weight")  # rank 1's second part
    old = bump(head, (2, 4)) if head is not None else None
    try:
        planted = fsdpcheck.verify(fresh, path, optimizer=fresh_opts)
    finally:
        if head is not None:
            set_element(head, (2, 4), old)
    return {
        "keys": len(fps),
        "offline_equal": fsdpcheck.fingerprint_checkpoint(path) == fps,
        "clean": summary(clean),
        "load": summary(loaded),
        "after": summary(after),
        "planted": summary(planted)["findings"],
    }
