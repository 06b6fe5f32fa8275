"""Trainer integrations on 4 gloo CPU ranks (see dist_harness): torchtitan, Lightning, HF, watch.

Each scenario builds its own model, optimizer and trainer objects, in its own directory, and
returns a JSON summary that tests/dist/integrations/test_integrations.py checks. Planted faults
restore on exit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import fsdpcheck
from fsdpcheck.testing import (
    TinyTransformer,
    build,
    find_bytes,
    flip_byte,
    local_of,
    plant,
    train,
    unchanged,
)
from fsdpcheck.watch import ReplicaWatch
from tests import torchtitan_parts
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario


def summary(r: fsdpcheck.Report | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "ok": r.ok,
        "findings": [(f.key, f.kind, f.ranks, f.max_abs_index, f.rank) for f in r.findings],
        "notes": r.notes,
        # The findings and notes in words; the summary line carries rank-local timings.
        "text": "\n".join([f.describe() for f in r.findings] + r.notes),
        "rank_local": r.summary(),
    }


def launched_env() -> None:
    """What torchrun sets: Lightning and HF read it and join the harness's process group.

    (Lightning's teardown removes some of these, so each trainer scenario sets them again.)
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world),
        TOKENIZERS_PARALLELISM="false",
    )


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, None]:
    launched_env()
    return {}, None


REGISTRY.setup = setup


def run_world(rank: int, world: int, workdir: Path, shared: str | None = None, only=None) -> dict:
    """Entry point for dist_harness.run_ranks."""
    return REGISTRY.run(rank, world, workdir, shared, only)


# -------------------------------------------------------------------------------------------
# ReplicaWatch on HSDP 2x2 (replicate x shard) and DDP.
def _watched_run(layout: str, world: World, fault: Any = None, steps: int = 6) -> list[Any]:
    """Trains `steps` steps with a watch every 2; `fault(model, opt)` entered after step 3."""
    import contextlib

    model, opt = build(layout, world.size)
    watch = ReplicaWatch(model, opt, every=2)
    out = []
    with contextlib.ExitStack() as stack:
        for step in range(1, steps + 1):
            train(model, opt, steps=1)
            if step == 3 and fault is not None:
                stack.enter_context(fault(model, opt))
            with unchanged(model, opt):
                report = watch.step()
            out.append(summary(report))
    return out


@scenario(4)
def watch_hsdp_clean(world: World) -> Any:
    return _watched_run("hsdp", world)


@scenario(4)
def watch_hsdp_replica_perturbed(world: World) -> Any:
    # One element of rank 1's shard of blocks.0.w1.weight; rank 3 holds the same shard.
    def fault(model: Any, opt: Any) -> Any:
        return plant(model.blocks[0].w1.weight, (2, 3), delta=1e-3, on_rank=1)

    return _watched_run("hsdp", world, fault)


@scenario(4)
def watch_optimizer_step_differs(world: World) -> Any:
    # A rank that resumed from another step: its AdamW step counter of head.weight is ahead.
    def fault(model: Any, opt: Any) -> Any:
        return plant(opt.state[model.head.weight]["step"], (), delta=1.0, on_rank=2)

    return _watched_run("hsdp", world, fault)


@scenario(4)
def watch_ddp_perturbed(world: World) -> Any:
    def fault(model: Any, opt: Any) -> Any:
        return plant(model.module.emb.weight, (5, 1), delta=1.0, on_rank=3)

    return _watched_run("ddp", world, fault, steps=4)


# -------------------------------------------------------------------------------------------
# torchtitan: CheckpointManager + OptimizersContainer on the FSDP2 tiny transformer.
def _titan(folder: Path, *, seed: int = 0) -> tuple[Any, Any, Any]:
    """A FSDP2 model, its OptimizersContainer and a CheckpointManager saving into `folder`."""
    model, _ = build("fsdp", 4, seed=seed)
    opts, scheds = torchtitan_parts.optimizers(model, lr=1e-2, training_steps=10)
    return model, opts, torchtitan_parts.checkpoint_manager(model, opts, scheds, folder)


@scenario(4)
def torchtitan_resume(world: World) -> Any:
    from fsdpcheck.integrations.torchtitan import save_manifests, verify_after_load

    folder = world.workdir / "ckpt"
    model, opts, manager = _titan(folder)
    save_manifests(manager)
    train(model, opts, steps=2)
    manager.save(curr_step=2)
    manager.close()
    out: dict[str, Any] = {"files": sorted(p.name for p in (folder / "step-2").iterdir())}
    # A fresh run resumes from step-2 (different initial weights, so nothing passes by luck).
    model2, opts2, manager2 = _titan(folder, seed=1)
    out["fresh"] = summary(verify_after_load(manager2))  # before load: step-2 exists, not loaded
    manager2.load(step=-1)
    with unchanged(model2, opts2.optimizers[0]):
        out["clean"] = summary(verify_after_load(manager2))
    # The same step folder with one byte of rank 1's shard of blocks.1.w1.weight flipped on disk.
    shard_file = folder / "step-2" / f"__{world.rank}_0.distcp"
    at = find_bytes(shard_file, model.blocks[1].w1.weight)
    _, _, manager3 = _titan(folder, seed=2)
    with flip_byte(shard_file, at + 4 * 7, on_rank=1):
        manager3.load(step=-1)
    out["planted"] = summary(verify_after_load(manager3))
    # Without a manifest: verify against the step folder's files.
    (folder / "step-2" / "fsdpcheck_manifest.json").unlink() if world.rank == 0 else None
    world.barrier()
    out["no_manifest"] = summary(verify_after_load(manager2))
    # The manifest next to step-2 is what fsdpcheck.load and audit check too.
    for m in (manager2, manager3):
        m.close()
    return out


@scenario(4)
def torchtitan_no_checkpoint(world: World) -> Any:
    from fsdpcheck.integrations.torchtitan import verify_after_load

    _, _, manager = _titan(world.workdir / "empty")
    loaded = manager.load(step=-1)
    report = verify_after_load(manager)
    manager.close()
    return {"loaded": loaded, "report": summary(report)}


# -------------------------------------------------------------------------------------------
# Lightning: Trainer and Fabric with ModelParallelStrategy (FSDP2 over 4 ranks).
def _batches(n: int = 8) -> Any:
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randint(0, 7, (n, 5), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=1)


def _lit_module(seed: int, plant_after_load: bool = False) -> Any:
    import lightning as L
    from torch.distributed.fsdp import fully_shard

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = TinyTransformer()

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for b in self.net.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_load_checkpoint(self, checkpoint: Any) -> None:
            # A model hook that changes a weight after the load (re-initialising a layer, a
            # fix-up gone wrong): rank 1's element (1, 2) of its shard of net.head.weight.
            if plant_after_load and self.global_rank == 1:
                with torch.no_grad():
                    local_of(self.net.head.weight)[1, 2] += 0.5

    return Lit()


def _lit_trainer(steps: int, callbacks: list[Any] | None = None) -> Any:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    launched_env()
    return L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1),
        max_steps=steps,
        callbacks=callbacks or [],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


@scenario(4)
def lightning_trainer_resume(world: World) -> Any:
    from fsdpcheck.integrations.lightning import VerifyOnResume

    ckpt = world.workdir / "lit.ckpt"
    trainer = _lit_trainer(1)
    trainer.fit(_lit_module(0), _batches())
    trainer.save_checkpoint(ckpt)
    out: dict[str, Any] = {"is_dir": ckpt.is_dir()}
    clean = VerifyOnResume(watch_every=1)
    _lit_trainer(2, [clean]).fit(_lit_module(1), _batches(), ckpt_path=ckpt)
    out["clean"] = summary(clean.report)
    out["watch"] = summary(clean.watch_report)
    planted = VerifyOnResume()
    try:
        _lit_trainer(2, [planted]).fit(
            _lit_module(2, plant_after_load=True), _batches(), ckpt_path=ckpt
        )
        out["raised"] = None
    except AssertionError as exc:  # VerificationError, raised on every rank
        out["raised"] = type(exc).__name__
    out["planted"] = summary(planted.report)
    return out


def _fabric(seed: int) -> tuple[Any, Any, Any]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        for b in model.blocks:
            fully_shard(b, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize, data_parallel_size=4, tensor_parallel_size=1
    )
    launched_env()
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    torch.manual_seed(seed)
    model = fabric.setup_module(TinyTransformer())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, opt


@scenario(4)
def lightning_fabric_resume(world: World) -> Any:
    from fsdpcheck.integrations.lightning import verify_after_load

    fabric, model, opt = _fabric(0)
    for (x,) in list(_batches(2)):
        fabric.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
    path = world.workdir / "fabric"
    fabric.save(path, {"model": model, "optimizer": opt})
    fabric2, model2, opt2 = _fabric(1)
    state = {"model": model2, "optimizer": opt2}
    fabric2.load(path, state)
    out: dict[str, Any] = {}
    with unchanged(model2, opt2.optimizer):
        out["clean"] = summary(verify_after_load(fabric2, path, state))
    # A wrong shard after the load: one element of rank 2's shard of blocks.0.w2.weight.
    with plant(model2.blocks[0].w2.weight, (3, 4), delta=0.25, on_rank=2):
        out["planted"] = summary(verify_after_load(fabric2, path, state))
    return out


# -------------------------------------------------------------------------------------------
# Hugging Face Trainer (DDP over 4 gloo ranks) with a tiny random Llama.
def _hf_trainer(out: Path, steps: int, callbacks: list[Any], seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    launched_env()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 61, (16, 8), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        save_steps=2,
        save_strategy="steps",
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        seed=seed,
        ddp_backend="gloo",
        dataloader_num_workers=0,
    )
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


@scenario(4)
def transformers_resume(world: World) -> Any:
    from safetensors.torch import load_file, save_file

    from fsdpcheck.integrations.transformers import VerifyOnResume

    out_dir = world.workdir / "run"
    _hf_trainer(out_dir, 2, [VerifyOnResume()], seed=0).train()
    ckpt = out_dir / "checkpoint-2"
    out: dict[str, Any] = {"files": sorted(p.name for p in ckpt.iterdir())}
    clean = VerifyOnResume(watch_every=1)
    _hf_trainer(out_dir, 3, [clean], seed=1).train(resume_from_checkpoint=True)
    out["clean"] = summary(clean.report)
    out["watch"] = summary(clean.watch_report)
    # One value of the saved weights changed on disk (rank 0 rewrites the file).
    weights = ckpt / "model.safetensors"
    original = weights.read_bytes()
    if world.rank == 0:
        tensors = load_file(weights)
        tensors["model.layers.0.mlp.up_proj.weight"][5, 3] += 0.125
        save_file(tensors, weights, metadata={"format": "pt"})
    world.barrier()
    planted = VerifyOnResume(checkpoint=ckpt)
    try:
        _hf_trainer(world.workdir / "run2", 3, [planted], seed=2).train(
            resume_from_checkpoint=str(ckpt)
        )
        out["raised"] = None
    except AssertionError as exc:  # VerificationError, on every rank, before any step
        out["raised"] = type(exc).__name__
    finally:
        world.barrier()
        if world.rank == 0:
            weights.write_bytes(original)
        world.barrier()
    out["planted"] = summary(planted.report)
    return out
