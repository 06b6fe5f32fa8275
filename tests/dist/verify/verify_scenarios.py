"""fsdpcheck.verify / fingerprint / save / load scenarios, run inside gloo ranks (dist_harness).

Each scenario is a registered function of a ``World`` returning what the tests assert on. Every
call of verify, fingerprint and check_replicas runs under ``unchanged``: the model, optimizer and
reference it is given must be bit-identical afterwards (a checker never changes what it checks).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import fsdpcheck
from fsdpcheck import testing as T
from fsdpcheck.testing import (
    drop_step,
    find_bytes,
    flip_bit,
    flip_byte,
    local_of,
    plant,
    shift_shard,
    snapshot,
    swap_shards,
    train,
    truncate,
    unchanged,
    zero_moment,
)
from tests.dist_harness import Registry, World

# The test model: 7 rows (2,2,2,1 on 4 ranks), 10 rows (3,3,3,1), 3 rows (1,1,1,0).
Net = functools.partial(T.TinyTransformer, vocab=7, dim=6, hidden=10, out=3)

REGISTRY = Registry()
scenario = REGISTRY.scenario


def build(layout: str, world: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The test model in a layout: fsdp, hsdp (2 x world/2), 2d (FSDP x TP), ddp, plain."""
    return T.build(layout, world, seed, model_cls=Net)


def save(model: nn.Module, opt: torch.optim.Optimizer, path: Path, edit=None) -> None:
    """A DCP save of model + optimizer (``edit`` rewrites the state dict first)."""
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    if edit is not None:
        edit(sd)
    dcp.save(sd, checkpoint_id=str(path))
    dist.barrier()


def load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """A plain DCP load (torch's, not fsdpcheck's)."""
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def report(r: fsdpcheck.Report) -> dict[str, Any]:
    d = r.to_dict()
    d.pop("seconds")
    d["text"] = str(r).split("\n", 1)[-1]
    return d


def _watched(*objs: Any) -> list[Any]:
    """The arguments whose state a read-only call must leave alone (modules, optimizers, dicts)."""
    return [o for o in objs if isinstance(o, (nn.Module, torch.optim.Optimizer, dict))]


def verify(model: Any, ref: Any, **kw: Any) -> dict[str, Any]:
    """fsdpcheck.verify, checked read-only, as a JSON-able report."""
    with unchanged(*_watched(model, ref, kw.get("optimizer"))):
        return report(fsdpcheck.verify(model, ref, **kw))


def fingerprint(model: Any, optimizer: Any = None) -> dict[str, int]:
    """fsdpcheck.fingerprint, checked read-only."""
    with unchanged(*_watched(model, optimizer)):
        return fsdpcheck.fingerprint(model, optimizer=optimizer)


def hexes(fps: dict[str, int]) -> dict[str, str]:
    return {k: f"{v:#018x}" for k, v in fps.items()}


# --- the shared state of one world size ----------------------------------------------------------
@dataclass
class Base:
    """Models the setup built (read-only for scenarios; faults restore on exit)."""

    model: nn.Module | None  # trained with FSDP2 at world 4 and saved as "fsdp4"
    opt: torch.optim.Optimizer | None
    full: dict[str, torch.Tensor] | None  # the whole state of `model`, on every rank
    fresh: nn.Module  # another model, loaded from "fsdp4" at this world size
    fopt: torch.optim.Optimizer


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, Base]:
    """World 4 trains, saves "fsdp4" and loads it into a fresh model; other worlds load it."""
    if saved_by is None:
        ck = shared / "fsdp4"
        model, opt = build("fsdp", world)
        train(model, opt)
        save(model, opt, ck)
        full = T.full_state(model)
        fresh, fopt = build("fsdp", world, seed=1)
        train(fresh, fopt, steps=1)  # optimizer state exists, values differ until the load
        load(fresh, fopt, ck)
        return {"fsdp4": ck}, Base(model, opt, full, fresh, fopt)
    ck = Path(saved_by) / "fsdp4"
    fresh, fopt = build("fsdp", world, seed=7)
    train(fresh, fopt, steps=1)
    load(fresh, fopt, ck)
    return {"fsdp4": ck}, Base(None, None, None, fresh, fopt)


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.model, b.opt, b.full, b.fresh, b.fopt)
REGISTRY.saved_by_world = 4


def run_world(rank: int, world: int, workdir: Path, shared: str | None = None, only=None) -> dict:
    """Entry point for dist_harness.run_ranks: every scenario of this world size."""
    return REGISTRY.run(rank, world, workdir, shared, only)


# --- verify at world 4 --------------------------------------------------------------------------
@scenario(4)
def clean(w: World) -> Any:
    b = w.base
    return verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt)


@scenario(4)
def one_element(w: World) -> Any:
    b = w.base
    # Rank 2 holds rows 6..8 of 10: local (1, 4) is global (7, 4).
    with plant(b.fresh.get_parameter("blocks.1.w1.weight"), (1, 4), delta=0.5, on_rank=2):
        return verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt)


@scenario(4)
def swapped(w: World) -> Any:
    b = w.base
    with swap_shards(b.fresh.get_parameter("emb.weight")):  # rows 0-1 (rank 0), 2-3 (rank 1)
        return verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt)


@scenario(4)
def shifted(w: World) -> Any:
    b = w.base
    # Rank 1 holds rows 3..5; rolled by one row they hold 5, 3, 4.
    with shift_shard(b.fresh.get_parameter("blocks.0.w1.weight"), 1, on_rank=1):
        return verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt)


@scenario(4)
def zeroed_moment(w: World) -> Any:
    b = w.base
    p = b.fresh.get_parameter("blocks.0.w2.weight")  # 6 rows over 4 ranks: 2, 2, 2, 0
    with zero_moment(b.fopt, p, "exp_avg_sq", on_rank=1):
        return verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt)


@scenario(4)
def step_differs(w: World) -> Any:
    b = w.base
    step = b.fopt.state[b.fresh.get_parameter("head.bias")]["step"]
    with plant(step, (), delta=1, on_rank=1):
        return verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt)


def _edited_checkpoint(w: World, edit) -> Any:
    """The trained model saved with `edit` applied to its state dict, verified."""
    b = w.base
    path = w.workdir / "ckpt"
    save(b.model, b.opt, path, edit)
    return verify(b.fresh, path, optimizer=b.fopt)


@scenario(4)
def no_step(w: World) -> Any:
    b = w.base
    path = w.workdir / "ckpt"
    with drop_step(b.opt, b.model.get_parameter("emb.weight")):  # saved without that step
        save(b.model, b.opt, path)
    return verify(b.fresh, path, optimizer=b.fopt)


@scenario(4)
def dtype_change(w: World) -> Any:
    def edit(sd: dict) -> None:
        sd["model"] = {**sd["model"], "head.weight": sd["model"]["head.weight"].bfloat16()}

    return _edited_checkpoint(w, edit)


@scenario(4)
def shape_change(w: World) -> Any:
    from torch.distributed.tensor import distribute_tensor

    def edit(sd: dict) -> None:
        t = sd["model"]["blocks.0.w2.weight"]
        bigger = distribute_tensor(torch.zeros(6, 11), t.device_mesh, t.placements)
        sd["model"] = {**sd["model"], "blocks.0.w2.weight": bigger}

    return _edited_checkpoint(w, edit)


@scenario(4)
def key_missing(w: World) -> Any:
    def edit(sd: dict) -> None:
        sd["model"] = {k: v for k, v in sd["model"].items() if k != "blocks.1.norm.bias"}

    return _edited_checkpoint(w, edit)


@scenario(4)
def references(w: World) -> Any:
    """The same content in every reference kind, all clean."""
    b = w.base
    full = b.full
    if w.rank == 0:
        torch.save({"model": full}, w.workdir / "full.pt")
        from safetensors.torch import save_file

        save_file(full, str(w.workdir / "model.safetensors"))
        hf = w.workdir / "hf"
        hf.mkdir()
        names = sorted(full)
        half = len(names) // 2
        shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
        for fname, keys in shards.items():
            save_file({k: full[k] for k in keys}, str(hf / fname))
        weight_map = {k: f for f, ks in shards.items() for k in ks}
        (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    w.barrier()
    plain = Net()
    plain.load_state_dict(full)
    refs = {
        "dcp": w.ckpts["fsdp4"],
        "torch.save": w.workdir / "full.pt",
        "safetensors": w.workdir / "model.safetensors",
        "hf-index": w.workdir / "hf" / "model.safetensors.index.json",
        "hf-dir": w.workdir / "hf",
        "mapping": full,
        "module": plain,
    }
    return {name: verify(b.fresh, ref) for name, ref in refs.items()}


@scenario(4)
def small_budget(w: World) -> Any:
    # 64 bytes per batch: every tensor is read in pieces of a few rows.
    b = w.base
    return verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt, memory_budget=64)


@scenario(4)
def unreadable(w: World) -> Any:
    b = w.base
    ck = w.copy("fsdp4")
    with truncate(ck / "__0_0.distcp", 100, on_rank=0):  # every rank reading it fails
        return verify(b.fresh, ck, optimizer=b.fopt)


@scenario(4)
def not_a_checkpoint(w: World) -> Any:
    return verify(w.base.fresh, w.workdir / "does-not-exist")


@scenario(4)
def hsdp(w: World) -> Any:
    m, o = build("hsdp", w.size)
    train(m, o)
    path = w.workdir / "hsdp"
    save(m, o, path)
    clean_r = verify(m, path, optimizer=o)
    # Rank 3 is replica 1, shard 1 (rows 5..9): local (0, 0) is global (5, 0).
    with plant(m.get_parameter("blocks.0.w1.weight"), (0, 0), on_rank=3):
        bad = verify(m, path, optimizer=o)
    placements = str(m.get_parameter("blocks.0.w1.weight").placements)
    return {"clean": clean_r, "bad": bad, "placements": placements}


@scenario(4)
def two_d(w: World) -> Any:
    m, o = build("2d", w.size)
    train(m, o)
    path = w.workdir / "2d"
    save(m, o, path)
    full2 = T.full_state(m)
    clean_r = verify(m, path, optimizer=o)
    vs_full = verify(m, full2)
    w1 = m.get_parameter("blocks.1.w1.weight")
    offset = fsdpcheck.layout.local_layout(w1).pieces[0].box.offset
    planted = w.rank == 2 and local_of(w1).numel() > 0
    with plant(w1, (0, 1), on_rank=2 if planted else -1):
        bad = verify(m, path, optimizer=o)
    placements = {k: str(v.placements) for k, v in m.named_parameters() if "blocks.0" in k}
    # 1D -> 2D: the FSDP2 world-4 checkpoint loaded into the 2D layout.
    m2, o2 = build("2d", w.size, seed=5)
    train(m2, o2, steps=1)
    load(m2, o2, w.ckpts["fsdp4"])
    resharded = verify(m2, w.ckpts["fsdp4"], optimizer=o2)
    return {
        "clean": clean_r,
        "vs_full": vs_full,
        "bad": bad,
        "placements": placements,
        "resharded": resharded,
        "rank_local": {"planted_offset": list(offset)},
    }


@scenario(4)
def ddp(w: World) -> Any:
    m, o = build("ddp", w.size)
    train(m, o)
    ref = {k.removeprefix("module."): v.detach().clone() for k, v in m.state_dict().items()}
    clean_r = verify(m, ref)
    with plant(m.module.get_parameter("head.bias"), (2,), on_rank=3):
        bad = verify(m, ref)
    return {"clean": clean_r, "bad": bad}


@scenario(4)
def fsdp1(w: World) -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    torch.manual_seed(0)
    m = FSDP(Net(), device_id=torch.device("cpu"), use_orig_params=True)
    torch.manual_seed(0)
    ref = Net().state_dict()
    with FSDP.state_dict_type(m, StateDictType.SHARDED_STATE_DICT):
        sd = m.state_dict()
    kinds = sorted({type(v).__name__ for v in sd.values()})
    clean_r = verify(sd, ref)
    shards = sd["blocks.0.w1.weight"].local_shards()
    target = shards[0].tensor if shards else torch.zeros(1)
    with plant(target, 0, on_rank=1 if shards else -1):
        bad = verify(sd, ref)
    return {"kinds": kinds, "clean": clean_r, "bad": bad}


@scenario(4)
def layouts(w: World) -> Any:
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
    return verify(sd, dict.fromkeys(sd, full_t))


# --- fingerprints, replicas, save/load at world 4 ----------------------------------------------
@scenario(4)
def fp_layouts(w: World) -> Any:
    out = {}
    for layout in ("plain", "fsdp", "hsdp", "2d"):
        m, o = build(layout, w.size, seed=11)
        train(m, o, steps=1)
        r = fsdpcheck.load(m, w.ckpts["fsdp4"], optimizer=o, verify=None)
        assert r.ok, str(r)
        out[layout] = hexes(fingerprint(m, o))
    out["offline"] = hexes(fsdpcheck.fingerprint_checkpoint(w.ckpts["fsdp4"]))
    out["live_fresh"] = hexes(fingerprint(w.base.fresh, w.base.fopt))
    return out


@scenario(4)
def fp_faults(w: World) -> Any:
    fresh = w.base.fresh
    base = fingerprint(fresh)

    def changed() -> list[str]:
        now = fingerprint(fresh)
        return sorted(k for k in base if now[k] != base[k])

    out = {}
    with swap_shards(fresh.get_parameter("emb.weight")):  # rows 0-1 and 2-3 swapped
        out["swapped"] = changed()
    with shift_shard(fresh.get_parameter("blocks.0.w1.weight"), 1, on_rank=1):
        out["shifted"] = changed()
    with flip_bit(fresh.get_parameter("blocks.1.norm.bias"), 0, 0, on_rank=2):  # one bit
        out["bit"] = changed()
    out["restored"] = changed()
    return out


@scenario(4)
def replicas(w: World) -> Any:
    m, o = build("hsdp", w.size)
    train(m, o)
    with unchanged(m, o):
        clean_r = report(fsdpcheck.check_replicas(m, optimizer=o))
    # Rank 2 holds replica 1 of shard 0: it diverges.
    with plant(m.get_parameter("blocks.1.w2.weight"), 0, on_rank=2):
        with unchanged(m, o):
            bad = report(fsdpcheck.check_replicas(m, optimizer=o))
        try:
            fingerprint(m)
            raised = None
        except fsdpcheck.FingerprintError as exc:
            raised = str(exc)
    return {"clean": clean_r, "bad": bad, "fingerprint_raised": raised}


@scenario(4)
def save_load(w: World) -> Any:
    b = w.base
    path = w.workdir / "saved"
    manifest = fsdpcheck.save(b.model, path, optimizer=b.opt)
    m, o = build("fsdp", w.size, seed=3)
    train(m, o, steps=1)
    clean_r = report(fsdpcheck.load(m, path, optimizer=o))
    # Rank 1's data file with one byte flipped inside its shard of blocks.0.w1.weight.
    data_file = path / "__1_0.distcp"
    at = find_bytes(data_file, b.model.get_parameter("blocks.0.w1.weight")) if w.rank == 1 else 0
    m2, o2 = build("fsdp", w.size, seed=4)
    train(m2, o2, steps=1)
    with flip_byte(data_file, at + 6, 0x10, on_rank=1):
        corrupted = report(fsdpcheck.load(m2, path, optimizer=o2))
    # A full checkpoint where a sharded one is expected: refused before loading, everywhere.
    full_path = w.workdir / "full.pt"
    if w.rank == 0:
        torch.save({"model": b.full}, full_path)
    w.barrier()
    m3, _ = build("fsdp", w.size, seed=5)
    before = snapshot(m3)
    try:
        fsdpcheck.load(m3, full_path, expect="sharded")
        refused = None
    except fsdpcheck.CheckpointKindError as exc:
        refused = str(exc)
    untouched = before == snapshot(m3)
    full_load = report(fsdpcheck.load(m3, full_path, expect="full"))
    trained = {k: v for k, v in fingerprint(b.model).items() if not k.startswith("optim.")}
    return {
        "manifest_world": manifest.world_size,
        "manifest_meshes": manifest.meshes,
        "clean": clean_r,
        "corrupted": corrupted,
        "refused": refused,
        "untouched": untouched,
        "full_load": full_load,
        "full_same_fingerprints": fingerprint(m3) == trained,
    }


@scenario(4)
def one_rank_fails(w: World) -> Any:
    """A failure on one rank only: every rank gets the same verdict, nobody hangs."""
    import importlib
    from unittest import mock

    b = w.base
    vmod = importlib.import_module("fsdpcheck.opening")  # where verify opens the reference
    ckmod = importlib.import_module("fsdpcheck.loading")

    def unreadable(*_: Any, **__: Any) -> Any:
        raise OSError("Input/output error (simulated on this rank only)")

    with mock.patch.object(vmod, "open_source", unreadable if w.rank == 2 else vmod.open_source):
        verify_r = verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt)
    full_path = w.workdir / "full.pt"
    if w.rank == 0:
        torch.save({"model": b.full}, full_path)
    w.barrier()
    m, _ = build("fsdp", w.size, seed=1)
    fail_on_1 = unreadable if w.rank == 1 else ckmod._read_full
    with mock.patch.object(ckmod, "_read_full", fail_on_1):
        try:
            fsdpcheck.load(m, full_path, verify=None)
            load_error = None
        except RuntimeError as exc:
            load_error = str(exc)
    return {"verify": verify_r, "load_error": load_error}


@scenario(4)
def one_rank_differs(w: World) -> Any:
    """Inputs that differ on one rank only: the same verdict or the same error everywhere."""
    import importlib
    from unittest import mock

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    b = w.base
    out: dict[str, Any] = {}

    def error_of(fn: Any) -> str | None:
        try:
            fn()
        except (RuntimeError, ValueError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    # load: the path does not exist on rank 1 only (before: rank 1 raised, the others hung).
    m, o = build("fsdp", w.size, seed=2)
    train(m, o, steps=1)
    before = snapshot(m, o)
    path = w.ckpts["fsdp4"] if w.rank != 1 else w.workdir / "nowhere"
    out["load_missing_on_1"] = error_of(lambda: fsdpcheck.load(m, path, optimizer=o))
    out["load_untouched"] = before == snapshot(m, o)
    # save: a different directory on each rank.
    out["save_paths_differ"] = error_of(
        lambda: fsdpcheck.save(b.fresh, w.workdir / f"ck{w.rank}", optimizer=b.fopt)
    )
    out["save_wrote_nothing"] = not any(w.workdir.glob("ck*"))
    # verify: one tensor in another dtype on rank 3 only (a local cast of its shard).
    sd = dict(get_model_state_dict(b.fresh))
    if w.rank == 3:
        sd["head.bias"] = sd["head.bias"].to(torch.float64)
    out["dtype_on_3"] = verify(sd, w.ckpts["fsdp4"])
    # fingerprint / check_replicas: a key that only rank 2 has.
    sd = dict(get_model_state_dict(b.fresh))
    if w.rank == 2:
        sd["extra.weight"] = torch.ones(3)
    # A key only one rank holds is that rank's (as a pipeline stage's keys are): fingerprinted
    # from it, and verify names it as missing from the checkpoint, on rank 2, everywhere.
    out["fingerprint_extra_on_2"] = {
        k: f"{v:#x}" for k, v in fingerprint(sd).items() if k == "extra.weight"
    }
    out["replicas_extra_on_2"] = report(fsdpcheck.check_replicas(sd))
    out["verify_extra_on_2"] = verify(sd, w.ckpts["fsdp4"])
    # verify: reading param_groups fails on rank 1 only.
    vmod = importlib.import_module("fsdpcheck.verification")
    real = vmod._check_param_groups

    def fails_on_1(source: Any, groups: Any) -> Any:
        if w.rank == 1:
            raise OSError("Input/output error reading param_groups (simulated on rank 1)")
        return real(source, groups)

    with mock.patch.object(vmod, "_check_param_groups", fails_on_1):
        out["param_groups_fail_on_1"] = verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt)
    return out


# --- the world-4 checkpoint at other world sizes -----------------------------------------------
@scenario(2, 3)
def reshard_before_load(w: World) -> Any:
    m, o = build("fsdp", w.size, seed=7)
    train(m, o, steps=1)
    return verify(m, w.ckpts["fsdp4"], optimizer=o)


@scenario(2, 3)
def reshard_after_load(w: World) -> Any:
    return verify(w.base.fresh, w.ckpts["fsdp4"], optimizer=w.base.fopt)


@scenario(2, 3)
def reshard_planted(w: World) -> Any:
    b = w.base
    # The last row and column of emb.weight live on the last rank.
    with plant(b.fresh.get_parameter("emb.weight"), (-1, -1), on_rank=w.size - 1):
        return verify(b.fresh, w.ckpts["fsdp4"], optimizer=b.fopt)


@scenario(2, 3)
def reshard_fingerprints(w: World) -> Any:
    return hexes(fingerprint(w.base.fresh, w.base.fopt))


# --- the embedded demo's rows (its command line: tests/process/test_demo.py) ---------------
@scenario(2, 3, 4)
def demo_outcomes(w: World) -> Any:
    """The demo's rows at 2 ranks (shards of 52 and 51 rows swapped), 3 (a 3x1 2D mesh), 4."""
    from fsdpcheck import demo

    rows = demo.run_rank(w.workdir)
    return [{"scenario": o.scenario, "found": o.found, "ok": o.ok} for o in rows]
