"""A live DeepSpeed ZeRO-3 engine on gloo CPU ranks (see dist_harness), checked for real.

The setup wraps a model whose parameters split unevenly into DeepSpeed's flat partitions (rows
cut in the middle, a 3-D weight, a one-element parameter whose second partition is all
padding) in DeepSpeed's own ZeRO-3 engine, takes one AdamW step, saves the engine with
``save_checkpoint`` and consolidates it with DeepSpeed's ``zero_to_fp32`` into a safetensors
file: the reference every scenario verifies against. Every parameter is partitioned
(``stage3_param_persistence_threshold=0``), so each one's ``.data`` is an empty placeholder.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdpcheck
from fsdpcheck.box import ravel
from fsdpcheck.testing import unchanged
from tests.corpus.ds import _import_deepspeed, make_engine
from tests.dist.verify.verify_scenarios import hexes, report
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario

# Planted elements: (parameter, global index) and the partition (rank) that holds each.
# lin.weight (7, 5): 35 elements, partitions of 18; flat 19 = (3, 4) is rank 1's second
# element, inside the partial row it starts with. conv.weight (5, 3, 3): 45 elements,
# partitions of 23; flat 22 = (2, 1, 1) is rank 0's last element.
PLANTS = {"lin.weight": ((3, 4), 1), "conv.weight": ((2, 1, 1), 0)}


class OddNet(nn.Module):
    """Parameters of 45, 5, 35, 7 and 1 elements: none splits into whole rows on 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(3, 5, 3)
        self.lin = nn.Linear(5, 7)
        self.scale = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.conv(x).mean(-1)) * self.scale


@dataclass
class Base:
    engine: Any  # DeepSpeed's ZeRO-3 engine
    plain: nn.Module  # an OddNet holding the consolidated weights on every rank
    full: Path  # zero_to_fp32's model.safetensors

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def partitions(self) -> dict[str, torch.Tensor]:
        """Every parameter's partition on this rank (what a read-only call must not change)."""
        return {n: p.ds_tensor for n, p in self.module.named_parameters()}


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, Base]:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    from safetensors.torch import load_file

    # What torchrun would set; DeepSpeed reads them (the harness spawns without a launcher).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    batch = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(rank))
    engine = make_engine(OddNet(), 3, batch, stage3_param_persistence_threshold=0)
    engine.save_checkpoint(str(shared / "ds"), tag="step1")
    if rank == 0:
        convert_zero_checkpoint_to_fp32_state_dict(
            str(shared / "ds"), str(shared / "full"), safe_serialization=True
        )
    dist.barrier()
    full = shared / "full" / "model.safetensors"
    plain = OddNet()
    plain.load_state_dict(load_file(str(full)))
    return {"ds": shared / "ds", "full": full}, Base(engine, plain, full)


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.module, b.partitions(), b.engine.optimizer.optimizer, b.plain)
REGISTRY.order = 2  # after accelerate's: DeepSpeed's engine is the last thing a spawn builds


def run_world(rank: int, world: int, workdir: Path, shared: str | None = None, only=None) -> dict:
    """Entry point for dist_harness.run_ranks."""
    return REGISTRY.run(rank, world, workdir, shared, only)


def verify(b: Base, model: Any, ref: Any, **kw: Any) -> dict[str, Any]:
    """fsdpcheck.verify, checked read-only on the partitions and the optimizer too."""
    with unchanged(b.module, b.partitions(), b.engine.optimizer.optimizer):
        out = report(fsdpcheck.verify(model, ref, **kw))
    out["gathered"] = gathered(b)
    return out


def gathered(b: Base) -> list[str]:
    """Parameters whose full value is present on this rank (none, unless gathered)."""
    return [n for n, p in b.module.named_parameters() if p.ds_status.name != "NOT_AVAILABLE"]


def findings(r: dict[str, Any]) -> list[list[Any]]:
    """(key, kind, global index, rank, message) of each finding."""
    return [
        [f["key"], f["kind"], f["max_abs_index"], f["rank"], f["message"]] for f in r["findings"]
    ]


@contextlib.contextmanager
def planted(b: Base, key: str, index: tuple[int, ...], delta: float = 0.5) -> Iterator[int]:
    """Element `index` of parameter `key` is `delta` higher in the partition that holds it.

    Yields the rank of that partition (its rank in the parameter's ds_process_group); the exact
    old bits are restored on exit.
    """
    p = b.module.get_parameter(key)
    part = p.ds_tensor
    flat = ravel(index, tuple(p.ds_shape))
    holder = flat // part.numel()
    mine = dist.get_rank(p.ds_process_group) == holder
    at = flat - holder * part.numel()
    old = part[at].clone()
    if mine:
        with torch.no_grad():
            part[at] += delta
    try:
        yield holder
    finally:
        if mine:
            with torch.no_grad():
                part[at] = old


# --- scenarios ------------------------------------------------------------------------------------
@scenario(2)
def layout(w: World) -> Any:
    """How each partition was cut into boxes of the global tensor."""
    from fsdpcheck.layout import local_layout

    out = {}
    for n, p in w.base.module.named_parameters():
        lay = local_layout(p, w.size)
        out[n] = {
            "data": list(p.data.shape),
            "description": lay.description,
            "boxes": [[list(pc.box.offset or ()), list(pc.tensor.shape)] for pc in lay.pieces],
        }
    return {"rank_local": out}


@scenario(2)
def clean(w: World) -> Any:
    b = w.base
    total = sum(p.numel() for p in b.plain.parameters())
    return {
        "engine": verify(b, b.engine, w.ckpts["full"]),
        "module": verify(b, b.module, w.ckpts["full"]),
        "folder": verify(b, b.engine, w.ckpts["full"].parent),
        "total": total,
    }


@scenario(2)
def fingerprints(w: World) -> Any:
    b = w.base
    with unchanged(b.module, b.partitions()):
        live = fsdpcheck.fingerprint(b.engine)
        replicas = report(fsdpcheck.check_replicas(b.engine))
    return {
        "live": hexes(live),
        "plain": hexes(fsdpcheck.fingerprint(b.plain)),
        "offline": hexes(fsdpcheck.fingerprint_checkpoint(w.ckpts["full"])),
        "replicas": replicas,
        "gathered": gathered(b),
    }


@scenario(2)
def planted_elements(w: World) -> Any:
    b = w.base
    with contextlib.ExitStack() as stack:
        holders = {k: stack.enter_context(planted(b, k, i)) for k, (i, _) in PLANTS.items()}
        r = verify(b, b.engine, w.ckpts["full"])
        fps = hexes(fsdpcheck.fingerprint(b.engine))
    return {"holders": holders, "report": r, "findings": findings(r), "fingerprints": fps}


@scenario(2)
def gathered_parameters(w: World) -> Any:
    """Inside GatheredParameters (every ds_status AVAILABLE, .data full): the partition counts."""
    deepspeed = _import_deepspeed()
    b = w.base
    with deepspeed.zero.GatheredParameters(list(b.module.parameters())):
        inside = gathered(b)
        clean = report(fsdpcheck.verify(b.engine, w.ckpts["full"]))
        # Only the partition changes: the gathered .data keeps the old value.
        with planted(b, "lin.weight", PLANTS["lin.weight"][0]):
            bad = report(fsdpcheck.verify(b.engine, w.ckpts["full"]))
            fp = hexes(fsdpcheck.fingerprint(b.engine))
    return {"inside": inside, "clean": clean, "planted": findings(bad), "fingerprint": fp}


@scenario(2)
def with_optimizer(w: World) -> Any:
    b = w.base
    out: dict[str, Any] = {}
    for name, opt in (("engine", b.engine.optimizer), ("torch", b.engine.optimizer.optimizer)):
        out[name] = findings(verify(b, b.engine, w.ckpts["full"], optimizer=opt))
    try:
        fsdpcheck.fingerprint(b.engine, optimizer=b.engine.optimizer)
        out["fingerprint"] = "no error"
    except fsdpcheck.FingerprintError as exc:
        out["fingerprint"] = str(exc)
    return out


@scenario(2)
def attribute_missing(w: World) -> Any:
    """A DeepSpeed whose parameters lack ``ds_process_group`` (as another version might)."""
    b = w.base
    params = list(b.module.parameters())
    groups = [p.ds_process_group for p in params]
    for p in params:
        del p.ds_process_group
    try:
        r = verify(b, b.engine, w.ckpts["full"])
    finally:
        for p, g in zip(params, groups):
            p.ds_process_group = g
    return {"findings": findings(r), "summary": r["text"].splitlines()[:1]}


@scenario(2)
def group_rank(w: World) -> Any:
    """Partition rank = rank in ds_process_group, not the global rank.

    Parameters of the DeepSpeed kind, each rank its own one-rank group (as a data-parallel group
    of one under model parallelism): global rank 1 holds partition 0 of 1, the whole tensor,
    which is then a replica of rank 0's.
    """
    groups = [dist.new_group([r]) for r in range(w.size)]
    full = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5.0)}
    params = {}
    for k, v in full.items():
        p = nn.Parameter(torch.empty(0))
        p.ds_shape, p.ds_numel = v.shape, v.numel()
        p.ds_tensor = v.flatten().clone()
        p.ds_process_group = groups[w.rank]
        params[k] = p
    from fsdpcheck.layout import local_layout

    lay = local_layout(params["a"], w.size)
    clean = report(fsdpcheck.verify(params, full))
    fps = [hexes(fsdpcheck.fingerprint(params)), hexes(fsdpcheck.fingerprint(full))]
    with torch.no_grad():
        if w.rank == 1:
            params["a"].ds_tensor[6] += 1.0  # (1, 2)
    bad = report(fsdpcheck.verify(params, full))
    return {
        "layout": [
            lay.description,
            lay.replicated,
            [list(pc.box.offset or ()) for pc in lay.pieces],
        ],
        "clean": clean,
        "planted": findings(bad),
        "fingerprints": fps,
        "numel": math.prod(full["a"].shape) + full["b"].numel(),
    }
