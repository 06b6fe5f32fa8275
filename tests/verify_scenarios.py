"""Scenarios run inside gloo ranks (see dist_harness); each returns what the tests assert on.

Every scenario's reports come back from every rank, so the tests can check both the verdict and
that every rank got the same one.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import fsdpcheck
from fsdpcheck import demo
from fsdpcheck.demo import TinyTransformer, train

# The test model: 7 rows (2,2,2,1 on 4 ranks), 10 rows (3,3,3,1), 3 rows (1,1,1,0).
Net = functools.partial(TinyTransformer, vocab=7, dim=6, hidden=10, out=3)


def build(layout: str, world: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The test model in a layout: fsdp, hsdp (2 x world/2), 2d (FSDP x TP), ddp, plain."""
    return demo.build(layout, world, seed, model_cls=Net)


def save(model: nn.Module, opt: torch.optim.Optimizer, path: Path, edit=None) -> None:
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    if edit is not None:
        edit(sd)
    dcp.save(sd, checkpoint_id=str(path))
    dist.barrier()


def load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def local_of(model: nn.Module, fqn: str) -> torch.Tensor:
    p = dict(model.named_parameters())[fqn]
    return p.to_local() if hasattr(p, "to_local") else p


def full_reference(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model state on every rank (test scaffolding: small model)."""
    out = {}
    for k, v in model.state_dict().items():
        out[k.removeprefix("module.")] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return {k: v.detach().clone() for k, v in out.items()}


def report(r: fsdpcheck.Report) -> dict[str, Any]:
    d = r.to_dict()
    d.pop("seconds")
    d["text"] = str(r).split("\n", 1)[-1]
    return d


def run_all(scenarios: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"__error__": traceback.format_exc()}
        dist.barrier()
    return out


# -------------------------------------------------------------------------------------------
def world4(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    ck = workdir / "fsdp4"
    model, opt = build("fsdp", world)
    train(model, opt)
    save(model, opt, ck)
    full = full_reference(model)
    fresh, fopt = build("fsdp", world, seed=1)
    train(fresh, fopt, steps=1)  # optimizer state exists, values differ until the load
    load(fresh, fopt, ck)

    def clean() -> Any:
        return report(fsdpcheck.verify(fresh, ck, optimizer=fopt))

    def plant(fqn: str, on_rank: int, edit: Callable[[torch.Tensor], None]) -> Any:
        local = local_of(fresh, fqn)
        saved = local.detach().clone()
        if rank == on_rank:
            with torch.no_grad():
                edit(local)
        r = report(fsdpcheck.verify(fresh, ck, optimizer=fopt))
        with torch.no_grad():
            local.copy_(saved)
        return r

    def one_element() -> Any:
        def edit(t: torch.Tensor) -> None:
            t[1, 4] += 0.5

        return plant("blocks.1.w1.weight", 2, edit)  # rank 2 holds rows 6..8: global (7, 4)

    def swapped() -> Any:
        local = local_of(fresh, "emb.weight")  # rows 0-1 on rank 0, 2-3 on rank 1
        saved = demo.swap_shards(local)
        r = report(fsdpcheck.verify(fresh, ck, optimizer=fopt))
        with torch.no_grad():
            local.copy_(saved)
        return r

    def shifted() -> Any:
        def edit(t: torch.Tensor) -> None:
            full_w = full["blocks.0.w1.weight"]  # rank 1 holds rows 3..5; load rows 2..4
            t.copy_(full_w[2:5])

        return plant("blocks.0.w1.weight", 1, edit)

    def zeroed_moment() -> Any:
        p = dict(fresh.named_parameters())["blocks.0.w2.weight"]
        moment = fopt.state[p]["exp_avg_sq"]
        local = moment.to_local()  # 6 rows over 4 ranks: 2, 2, 2, 0
        saved = local.clone()
        if rank == 1:
            local.zero_()
        r = report(fsdpcheck.verify(fresh, ck, optimizer=fopt))
        local.copy_(saved)
        return r

    def step_differs() -> Any:
        p = dict(fresh.named_parameters())["head.bias"]
        step = fopt.state[p]["step"]
        saved = step.clone()
        if rank == 1:
            step += 1
        r = report(fsdpcheck.verify(fresh, ck, optimizer=fopt))
        step.copy_(saved)
        return r

    def edited_checkpoint(name: str, edit: Callable[[dict], None]) -> Any:
        path = workdir / name
        save(model, opt, path, edit)
        return report(fsdpcheck.verify(fresh, path, optimizer=fopt))

    def no_step() -> Any:
        def edit(sd: dict) -> None:
            # A new dict: the state dict shares its inner dicts with the live optimizer.
            state = dict(sd["optim"]["state"])
            state["emb.weight"] = {k: v for k, v in state["emb.weight"].items() if k != "step"}
            sd["optim"] = {**sd["optim"], "state": state}

        return edited_checkpoint("nostep", edit)

    def dtype_change() -> Any:
        def edit(sd: dict) -> None:
            sd["model"] = {**sd["model"], "head.weight": sd["model"]["head.weight"].bfloat16()}

        return edited_checkpoint("dtype", edit)

    def shape_change() -> Any:
        from torch.distributed.tensor import distribute_tensor

        def edit(sd: dict) -> None:
            w = sd["model"]["blocks.0.w2.weight"]
            bigger = distribute_tensor(torch.zeros(6, 11), w.device_mesh, w.placements)
            sd["model"] = {**sd["model"], "blocks.0.w2.weight": bigger}

        return edited_checkpoint("shape", edit)

    def key_missing() -> Any:
        def edit(sd: dict) -> None:
            sd["model"] = {k: v for k, v in sd["model"].items() if k != "blocks.1.norm.bias"}

        return edited_checkpoint("nokey", edit)

    def references() -> Any:
        # The same content in every reference kind, all clean.
        out = {}
        tdir = workdir / "refs"
        if rank == 0:
            tdir.mkdir(exist_ok=True)
            torch.save({"model": full}, tdir / "full.pt")
            from safetensors.torch import save_file

            save_file(full, str(tdir / "model.safetensors"))
            hf = tdir / "hf"
            hf.mkdir(exist_ok=True)
            names = sorted(full)
            half = len(names) // 2
            shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
            for fname, keys in shards.items():
                save_file({k: full[k] for k in keys}, str(hf / fname))
            import json

            weight_map = {k: f for f, ks in shards.items() for k in ks}
            (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        dist.barrier()
        plain = Net()
        plain.load_state_dict(full)
        for name, ref in {
            "dcp": ck,
            "torch.save": tdir / "full.pt",
            "safetensors": tdir / "model.safetensors",
            "hf-index": tdir / "hf" / "model.safetensors.index.json",
            "hf-dir": tdir / "hf",
            "mapping": full,
            "module": plain,
        }.items():
            out[name] = report(fsdpcheck.verify(fresh, ref))
        return out

    def small_budget() -> Any:
        # 64 bytes per batch: every tensor is read in pieces of a few rows.
        return report(fsdpcheck.verify(fresh, ck, optimizer=fopt, memory_budget=64))

    def unreadable_on_one_rank() -> Any:
        path = workdir / "fsdp4" / "__0_0.distcp"
        data = path.read_bytes()
        dist.barrier()
        if rank == 0:
            path.write_bytes(data[:100])  # truncated: every rank reading it fails
        dist.barrier()
        try:
            return report(fsdpcheck.verify(fresh, ck, optimizer=fopt))
        finally:
            dist.barrier()
            if rank == 0:
                path.write_bytes(data)
            dist.barrier()

    def not_a_checkpoint() -> Any:
        return report(fsdpcheck.verify(fresh, workdir / "does-not-exist"))

    def hsdp() -> Any:
        m, o = build("hsdp", world)
        train(m, o)
        path = workdir / "hsdp"
        save(m, o, path)
        clean_r = report(fsdpcheck.verify(m, path, optimizer=o))
        local = local_of(m, "blocks.0.w1.weight")
        if rank == 3:  # replica 1, shard 1 (rows 5..9)
            with torch.no_grad():
                local[0, 0] += 1
        bad = report(fsdpcheck.verify(m, path, optimizer=o))
        placements = str(dict(m.named_parameters())["blocks.0.w1.weight"].placements)
        return {"clean": clean_r, "bad": bad, "placements": placements}

    def two_d() -> Any:
        m, o = build("2d", world)
        train(m, o)
        path = workdir / "2d"
        save(m, o, path)
        full2 = full_reference(m)
        clean_r = report(fsdpcheck.verify(m, path, optimizer=o))
        vs_full = report(fsdpcheck.verify(m, full2))
        w1 = dict(m.named_parameters())["blocks.1.w1.weight"]
        local = w1.to_local()
        offset = fsdpcheck.layout.local_layout(w1).pieces[0].box.offset
        if rank == 2 and local.numel() > 0:
            with torch.no_grad():
                local[0, 1] += 1
        bad = report(fsdpcheck.verify(m, path, optimizer=o))
        placements = {k: str(v.placements) for k, v in m.named_parameters() if "blocks.0" in k}
        # 1D -> 2D: the FSDP2 world-4 checkpoint loaded into the 2D layout.
        m2, o2 = build("2d", world, seed=5)
        train(m2, o2, steps=1)
        load(m2, o2, ck)
        resharded = report(fsdpcheck.verify(m2, ck, optimizer=o2))
        return {
            "clean": clean_r,
            "vs_full": vs_full,
            "bad": bad,
            "planted_offset": list(offset) if rank == 2 else None,
            "placements": placements,
            "resharded": resharded,
        }

    def ddp() -> Any:
        m, o = build("ddp", world)
        train(m, o)
        ref = {k.removeprefix("module."): v.detach().clone() for k, v in m.state_dict().items()}
        clean_r = report(fsdpcheck.verify(m, ref))
        p = dict(m.module.named_parameters())["head.bias"]
        if rank == 3:
            with torch.no_grad():
                p[2] += 1
        bad = report(fsdpcheck.verify(m, ref))
        return {"clean": clean_r, "bad": bad}

    def fsdp1() -> Any:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        torch.manual_seed(0)
        m = FSDP(Net(), device_id=torch.device("cpu"), use_orig_params=True)
        torch.manual_seed(0)
        ref = Net().state_dict()
        with FSDP.state_dict_type(m, StateDictType.SHARDED_STATE_DICT):
            sd = m.state_dict()
        kinds = sorted({type(v).__name__ for v in sd.values()})
        clean_r = report(fsdpcheck.verify(sd, ref))
        st = sd["blocks.0.w1.weight"]
        shards = st.local_shards()
        if rank == 1 and shards:
            shards[0].tensor.view(-1)[0] += 1
        bad = report(fsdpcheck.verify(sd, ref))
        return {"kinds": kinds, "clean": clean_r, "bad": bad}

    def layouts() -> Any:
        from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh1 = init_device_mesh("cpu", (4,))
        mesh2 = init_device_mesh("cpu", (2, 2))
        full_t = torch.arange(80.0).reshape(16, 5)
        sd = {
            "strided_1d": distribute_tensor(full_t, mesh1, [_StridedShard(0, split_factor=2)]),
            "strided_2d": distribute_tensor(
                full_t, mesh2, [Shard(0), _StridedShard(0, split_factor=2)]
            ),
            "partial": DTensor.from_local(full_t / 4, mesh1, [Partial()]),
            "box_2d": distribute_tensor(full_t, mesh2, [Shard(0), Shard(1)]),
        }
        return report(fsdpcheck.verify(sd, dict.fromkeys(sd, full_t)))

    # --- fingerprints, save/load, replicas (fsdpcheck.fingerprint / save / load) ---------------
    def hexes(fps: dict[str, int]) -> dict[str, str]:
        return {k: f"{v:#018x}" for k, v in fps.items()}

    def fp_layouts() -> Any:
        out = {}
        for layout in ("plain", "fsdp", "hsdp", "2d"):
            m, o = build(layout, world, seed=11)
            train(m, o, steps=1)
            r = fsdpcheck.load(m, ck, optimizer=o, verify=None)
            assert r.ok, str(r)
            out[layout] = hexes(fsdpcheck.fingerprint(m, optimizer=o))
        out["offline"] = hexes(fsdpcheck.fingerprint_checkpoint(ck))
        out["live_fresh"] = hexes(fsdpcheck.fingerprint(fresh, optimizer=fopt))
        return out

    def fp_faults() -> Any:
        base = fsdpcheck.fingerprint(fresh)
        out = {}

        def changed() -> list[str]:
            now = fsdpcheck.fingerprint(fresh)
            return sorted(k for k in base if now[k] != base[k])

        emb = local_of(fresh, "emb.weight")
        saved = demo.swap_shards(emb)  # rows 0-1 and 2-3 swapped
        out["swapped"] = changed()
        with torch.no_grad():
            emb.copy_(saved)
        w = local_of(fresh, "blocks.0.w1.weight")
        saved_w = w.detach().clone()
        if rank == 1:
            with torch.no_grad():
                w.copy_(full["blocks.0.w1.weight"][2:5])  # shifted by one row
        out["shifted"] = changed()
        with torch.no_grad():
            w.copy_(saved_w)
        b = local_of(fresh, "blocks.1.norm.bias")
        if rank == 2 and b.numel():
            with torch.no_grad():
                b.view(torch.int32)[0] ^= 1  # one flipped bit
        out["bit"] = changed()
        with torch.no_grad():
            if rank == 2 and b.numel():
                b.view(torch.int32)[0] ^= 1
        out["restored"] = changed()
        return out

    def replicas() -> Any:
        m, o = build("hsdp", world)
        train(m, o)
        clean_r = report(fsdpcheck.check_replicas(m, optimizer=o))
        local = local_of(m, "blocks.1.w2.weight")
        if rank == 2:  # replica 1 of shard 0 diverges
            with torch.no_grad():
                local.view(-1)[0] += 1
        bad = report(fsdpcheck.check_replicas(m, optimizer=o))
        try:
            fsdpcheck.fingerprint(m)
            raised = None
        except fsdpcheck.FingerprintError as exc:
            raised = str(exc)
        return {"clean": clean_r, "bad": bad, "fingerprint_raised": raised}

    def save_load() -> Any:
        path = workdir / "saved"
        manifest = fsdpcheck.save(model, path, optimizer=opt)
        m, o = build("fsdp", world, seed=3)
        train(m, o, steps=1)
        clean_r = report(fsdpcheck.load(m, path, optimizer=o))
        # Corrupt rank 1's data file: flip one byte inside its shard of blocks.0.w1.weight.
        dist.barrier()
        if rank == 1:
            f = path / "__1_0.distcp"
            data = bytearray(f.read_bytes())
            shard = local_of(model, "blocks.0.w1.weight").detach().contiguous()
            at = bytes(data).find(shard.numpy().tobytes())
            assert at > 0, "shard bytes not found in the .distcp file"
            data[at + 6] ^= 0x10
            f.write_bytes(bytes(data))
        dist.barrier()
        m2, o2 = build("fsdp", world, seed=4)
        train(m2, o2, steps=1)
        corrupted = report(fsdpcheck.load(m2, path, optimizer=o2))
        # A full checkpoint where a sharded one is expected: refused before loading, everywhere.
        full_path = workdir / "full.pt"
        if rank == 0:
            torch.save({"model": full}, full_path)
        dist.barrier()
        m3, _ = build("fsdp", world, seed=5)
        before = local_of(m3, "emb.weight").detach().clone()
        try:
            fsdpcheck.load(m3, full_path, expect="sharded")
            refused = None
        except fsdpcheck.CheckpointKindError as exc:
            refused = str(exc)
        untouched = bool(torch.equal(before, local_of(m3, "emb.weight")))
        full_load = report(fsdpcheck.load(m3, full_path, expect="full"))
        same = fsdpcheck.fingerprint(m3) == {
            k: v for k, v in fsdpcheck.fingerprint(model).items() if not k.startswith("optim.")
        }
        return {
            "manifest_world": manifest["world_size"],
            "manifest_meshes": manifest["meshes"],
            "clean": clean_r,
            "corrupted": corrupted,
            "refused": refused,
            "untouched": untouched,
            "full_load": full_load,
            "full_same_fingerprints": same,
        }

    def one_rank_fails() -> Any:
        """A failure on one rank only: every rank gets the same verdict, nobody hangs."""
        import importlib
        from unittest import mock

        # The modules (fsdpcheck.verify is also the name of the function the package exports).
        vmod = importlib.import_module("fsdpcheck.verify")
        ckmod = importlib.import_module("fsdpcheck.checkpoint")

        def unreadable(*_: Any) -> Any:
            raise OSError("Input/output error (simulated on this rank only)")

        with mock.patch.object(vmod, "open_source", unreadable if rank == 2 else vmod.open_source):
            verify_r = report(fsdpcheck.verify(fresh, ck, optimizer=fopt))
        full_path = workdir / "full_for_fail.pt"
        if rank == 0:
            torch.save({"model": full}, full_path)
        dist.barrier()
        fail_on_1 = unreadable if rank == 1 else ckmod._read_full
        with mock.patch.object(ckmod, "_read_full", fail_on_1):
            try:
                fsdpcheck.load(fresh, full_path, verify=None)
                load_error = None
            except RuntimeError as exc:
                load_error = str(exc)
        return {"verify": verify_r, "load_error": load_error}

    return run_all(
        {
            "one_rank_fails": one_rank_fails,
            "fp_layouts": fp_layouts,
            "fp_faults": fp_faults,
            "replicas": replicas,
            "save_load": save_load,
            "layouts": layouts,
            "clean": clean,
            "one_element": one_element,
            "swapped": swapped,
            "shifted": shifted,
            "zeroed_moment": zeroed_moment,
            "step_differs": step_differs,
            "no_step": no_step,
            "dtype_change": dtype_change,
            "shape_change": shape_change,
            "key_missing": key_missing,
            "references": references,
            "small_budget": small_budget,
            "unreadable": unreadable_on_one_rank,
            "not_a_checkpoint": not_a_checkpoint,
            "hsdp": hsdp,
            "two_d": two_d,
            "ddp": ddp,
            "fsdp1": fsdp1,
        }
    )


def resharded(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """Loads the world-4 FSDP2 checkpoint (written by world4) at this world size and verifies."""
    ck = workdir.parent / "w4" / "fsdp4"
    m, o = build("fsdp", world, seed=7)
    train(m, o, steps=1)

    def before_load() -> Any:
        return report(fsdpcheck.verify(m, ck, optimizer=o))

    def after_load() -> Any:
        load(m, o, ck)
        return report(fsdpcheck.verify(m, ck, optimizer=o))

    def planted() -> Any:
        local = local_of(m, "emb.weight")
        if rank == world - 1 and local.shape[0] > 0:
            with torch.no_grad():
                local[-1, -1] += 1
        return report(fsdpcheck.verify(m, ck, optimizer=o))

    def fingerprints() -> Any:
        fps = fsdpcheck.fingerprint(m, optimizer=o)
        return {k: f"{v:#018x}" for k, v in fps.items()}

    return run_all(
        {
            "before_load": before_load,
            "after_load": after_load,
            "fingerprints": fingerprints,
            "planted": planted,
        }
    )
