"""Collectives counted per entry point, inside gloo ranks (dist_harness), at world sizes 2 and 4.

Every scenario runs one entry point on an FSDP2 model of ``KEYS`` small tensors with every
torch.distributed collective counted (``fsdpcheck.testing.count_collectives``) and returns the
counts under "rank_local" (they differ between ranks: a broadcast's source receives nothing),
next to what every rank must agree on (the verdict, the keys checked).
tests/dist/scale/test_scale.py compares the counts at the two world sizes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard

import fsdpcheck
from fsdpcheck.testing import plant
from fsdpcheck.testing.collectives import count_collectives
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario
WORLDS = (2, 4)
KEYS = 24  # tensors of the model: 4 rows each, so every rank holds a row at world size 4


class Many(nn.Module):
    """Many small parameters (``p.0`` ... ``p.<KEYS-1>``), like a deep model's many tensors."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.p = nn.ParameterDict({str(i): nn.Parameter(torch.randn(4, 3)) for i in range(KEYS)})


def sharded(seed: int = 0) -> nn.Module:
    model = Many(seed)
    fully_shard(model)
    return model


@dataclass
class Base:
    model: nn.Module  # FSDP2, saved by fsdpcheck.save as "saved"


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, Base]:
    model = sharded()
    path = shared / "saved"
    fsdpcheck.save(model, path)
    return {"saved": path}, Base(model)


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.model,)


def counted(fn: Callable[[], Any]) -> dict[str, Any]:
    """What `fn` returns (a Report, a dict of fingerprints, ...), and its collectives counted."""
    dist.barrier()
    with count_collectives() as counts:
        value = fn()
    out: dict[str, Any] = {"rank_local": {"counts": counts.to_dict()}}
    if isinstance(value, fsdpcheck.Report):
        out["ok"] = value.ok
        out["keys_checked"] = value.keys_checked
        out["findings"] = [(f.key, f.kind, f.rank) for f in value.findings]
    elif isinstance(value, dict):
        out["keys"] = len(value)
    return out


# -------------------------------------------------------------------------------------------
@scenario(*WORLDS)
def verify(w: World) -> Any:
    return counted(lambda: fsdpcheck.verify(w.base.model, w.ckpts["saved"]))


@scenario(*WORLDS)
def verify_planted(w: World) -> Any:
    """One element differs on rank 1: the finding travels in the reduced rows, not a gather."""
    with plant(w.base.model.get_parameter("p.5"), 0, on_rank=1):
        return counted(lambda: fsdpcheck.verify(w.base.model, w.ckpts["saved"]))


@scenario(*WORLDS)
def fingerprint(w: World) -> Any:
    return counted(lambda: fsdpcheck.fingerprint(w.base.model))


@scenario(*WORLDS)
def check_replicas(w: World) -> Any:
    return counted(lambda: fsdpcheck.check_replicas(w.base.model))


@scenario(*WORLDS)
def replica_differs(w: World) -> Any:
    """A plain model on every rank, one element changed on rank 1: a gather of 2 words a rank."""
    model = Many(0)
    with plant(model.get_parameter("p.3"), 0, on_rank=1):
        return counted(lambda: fsdpcheck.check_replicas(model))


@scenario(*WORLDS)
def watch_step(w: World) -> Any:
    watch = fsdpcheck.ReplicaWatch(w.base.model, every=1)
    return counted(watch.step)


@scenario(*WORLDS)
def load_fingerprint(w: World) -> Any:
    model = sharded(seed=1)
    return counted(lambda: fsdpcheck.load(model, w.ckpts["saved"], verify="fingerprint"))


@scenario(*WORLDS)
def load_full(w: World) -> Any:
    model = sharded(seed=1)
    return counted(lambda: fsdpcheck.load(model, w.ckpts["saved"], verify="full", sentinel=True))


@scenario(*WORLDS)
def save(w: World) -> Any:
    out = counted(lambda: fsdpcheck.save(w.base.model, w.workdir / "saved"))
    out["keys"] = len(fsdpcheck.read_manifest(w.workdir / "saved").entries)
    return out


@scenario(*WORLDS)
def checkpoint_manifest(w: World) -> Any:
    from fsdpcheck.saving import write_checkpoint_manifest

    folder = w.workdir / "dcp"
    dcp.save(get_model_state_dict(w.base.model), checkpoint_id=str(folder))
    out = counted(lambda: write_checkpoint_manifest(w.base.model, folder))
    out["keys"] = len(fsdpcheck.read_manifest(folder).entries)
    return out


class Checkpointer:
    """What fsdpcheck's torchtitan integration uses of a ``CheckpointManager``.

    Its ``save`` writes the model's sharded state into ``step-N`` with DCP, as torchtitan does;
    the collectives counted are those of the integration (the bench runs torchtitan's own).
    """

    enable = True

    def __init__(self, model: nn.Module, folder: Path) -> None:
        self.folder = str(folder)
        self.states = {"model": SimpleNamespace(model=[model])}

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        model = self.states["model"].model[0]
        path = Path(self.folder, f"step-{curr_step}")
        dcp.save(get_model_state_dict(model), checkpoint_id=str(path))
        return True


@scenario(*WORLDS)
def torchtitan(w: World) -> Any:
    from fsdpcheck.integrations.torchtitan import save_manifests, verify_after_load

    manager = save_manifests(Checkpointer(w.base.model, w.workdir / "ckpt"))
    saved = counted(lambda: manager.save(curr_step=3))
    checked = counted(lambda: verify_after_load(manager))
    return {"save": saved, "verify_after_load": checked}


@scenario(*WORLDS)
def against_manifest(w: World) -> Any:
    from fsdpcheck.loading import check_against_manifest

    manifest = fsdpcheck.read_manifest(w.ckpts["saved"])
    return counted(lambda: check_against_manifest(w.base.model, manifest, w.ckpts["saved"]))


def _accelerate_folder(w: World, name: str) -> Path:
    """What accelerate's ``save_state`` (FSDP, sharded state dict) writes for model 0: the
    model's state under "model" in ``pytorch_model_fsdp_0/`` by DCP."""
    folder = w.workdir / name
    dcp.save({"model": get_model_state_dict(w.base.model)},
             checkpoint_id=str(folder / "pytorch_model_fsdp_0"))  # fmt: skip
    return folder


@scenario(*WORLDS)
def resumed(w: World) -> Any:
    """verify_resumed: by fingerprint where a manifest is, against the files where none is."""
    from fsdpcheck.watch import verify_resumed

    plain = _accelerate_folder(w, "resumed") / "pytorch_model_fsdp_0"
    return {
        "manifest": counted(lambda: verify_resumed(w.base.model, w.ckpts["saved"])),
        "files": counted(lambda: verify_resumed(w.base.model, plain)),
    }


def _called(fn: Callable[[], Any], report: Callable[[], Any]) -> dict[str, Any]:
    """`counted` for a callback: the Report it keeps, not what it returns."""
    out = counted(fn)
    out.update({k: v for k, v in counted(report).items() if k != "rank_local"})
    return out


def _library(name: str) -> bool:
    """Whether a trainer library is installed (the CUDA build's venv has none of them)."""
    return importlib.util.find_spec(name) is not None


@scenario(*WORLDS)
def integrations(w: World) -> Any:
    """The trainer integrations' resume checks, through their own code: accelerate's
    verify_state on a save_state folder, Lightning's and transformers' VerifyOnResume on a
    resumed run (the trainers reduced to what the callbacks read of them). A library that is
    not installed is said so (every rank has the same venv), and its test skips."""
    out: dict[str, Any] = {}
    folder = _accelerate_folder(w, "accelerate")
    if _library("accelerate"):
        from fsdpcheck.integrations.accelerate import verify_state

        accelerator = SimpleNamespace(_models=[w.base.model], _optimizers=[])
        out["accelerate"] = counted(lambda: verify_state(accelerator, folder))
    else:
        out["accelerate"] = {"absent": "accelerate"}
    if _library("lightning") or _library("pytorch_lightning"):
        from fsdpcheck.integrations.lightning import VerifyOnResume as LightningResume

        lightning = LightningResume(check_optimizer=False)
        trainer = SimpleNamespace(
            ckpt_path=str(w.ckpts["saved"]), optimizers=[], is_global_zero=w.rank == 0
        )
        out["lightning"] = _called(lambda: lightning.on_train_start(trainer, w.base.model),
                                   lambda: lightning.report)  # fmt: skip
    else:
        out["lightning"] = {"absent": "lightning"}
    if _library("transformers"):
        from transformers import TrainerControl, TrainerState

        from fsdpcheck.integrations.transformers import VerifyOnResume

        hf = VerifyOnResume(checkpoint=str(folder), check_optimizer=False)
        args = SimpleNamespace(resume_from_checkpoint=None, output_dir=str(w.workdir))
        state = TrainerState(global_step=3, is_world_process_zero=w.rank == 0)
        out["transformers"] = _called(
            lambda: hf.on_train_begin(args, state, TrainerControl(), model=w.base.model),
            lambda: hf.report,
        )
    else:
        out["transformers"] = {"absent": "transformers"}
    return out


@scenario(*WORLDS)
def counter(w: World) -> Any:
    """The counter itself, on collectives whose sizes are known."""
    with count_collectives() as counts:
        dist.all_reduce(torch.zeros(10, dtype=torch.int64))
        dist.all_gather([torch.zeros(3) for _ in range(w.size)], torch.zeros(3))
        dist.broadcast(torch.zeros(5, dtype=torch.float32), src=0)
        dist.all_gather_object([None] * w.size, "x" * 100)
    return {"rank_local": {"counts": counts.to_dict()}}
