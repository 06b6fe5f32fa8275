"""FSDP1 (``FullyShardedDataParallel``) model AND optimizer state on gloo CPU ranks.

FSDP1 steps the optimizer on flat runs of each wrapped module's FlatParameter. Checkpoints are
written by torch's own code (``FSDP.optim_state_dict`` under SHARDED_STATE_DICT, then
``dcp.save``) and by accelerate's ``save_state`` with its default FSDP1 plugin; each is saved
clean and again with one weight and one Adam moment changed (the planted twin).

Where an element lives is worked out here from torch's own record, independently of fsdpcheck:
``FlatParameter._shard_param_infos`` (which part of each original parameter, flattened, this
rank's run holds, and where in the run).

The torch FSDP1 scenarios run in the shared spawns (``REGISTRY``); accelerate's, which change
process-wide accelerate state, run in a spawn of their own (``run_accelerate``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import fsdpcheck
from fsdpcheck.testing import unchanged
from tests.corpus import Block, toy_model
from tests.corpus.live import adamw, train_steps
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario

MODES = {"orig": True, "flat": False}  # use_orig_params
PLANT_WEIGHT = ("layers.1.proj.weight", None, (0, 5))  # the run of rank 0 ends inside it at W=2
PLANT_MOMENT = ("head.weight", "exp_avg", (9, 7))  # the last element: the last rank's
# A moment element of the one parameter split across ranks 0 and 1 at W=2 (the nested wrap puts
# layers.1 in its own FlatParameter of 72 elements: 36 a rank), held by rank 1.
LIVE_MOMENT = ("layers.1.proj.weight", "exp_avg_sq", (5, 2))


class Narrow(torch.nn.Module):
    """A head of 3 rows: at 4 ranks FSDP1's row-chunked state dict gives rank 3 no rows."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def wrap(module: torch.nn.Module, orig: bool, nested: bool = True) -> Any:
    """FSDP1 around each Block (nested FlatParameters) and the root, on CPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({Block}) if nested else None
    return FSDP(
        module, device_id=torch.device("cpu"), use_orig_params=orig, auto_wrap_policy=policy
    )


def save(model: Any, optimizer: Any, path: Path) -> None:
    """What torch's FSDP1 recipe saves: SHARDED_STATE_DICT model and optim, with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(path))


# ------------------------------------------------------------------------------------------
# Where an element lives: torch's own shard record.
def _clean(name: str) -> str:
    return ".".join(c for c in name.split(".") if c not in ("_fsdp_wrapped_module", "module"))


def flat_element(
    model: Any, optimizer: Any, fqn: str, name: str | None, index: tuple[int, ...]
) -> tuple[torch.Tensor, int] | None:
    """(the 1-D tensor holding it, position) of one element on this rank, or None.

    `name` None: the parameter's own element (in the FlatParameter's local run); else the
    optimizer state `name` of the parameter.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for mod_name, mod in model.named_modules():
        if not isinstance(mod, FSDP) or mod._handle is None:
            continue
        flat = mod._handle.flat_param
        prefix = _clean(mod_name)
        for i, local in enumerate(flat._fqns):
            if (f"{prefix}.{local}" if prefix else local) != fqn:
                continue
            shape = tuple(flat._shapes[i])
            lin = 0
            for k, s in zip(index, shape):
                lin = lin * s + k
            info = flat._shard_param_infos[i]
            if not info.in_shard or not (
                info.intra_param_start_idx <= lin <= info.intra_param_end_idx
            ):
                return None
            rel = lin - info.intra_param_start_idx
            if name is None:
                return flat.data, info.offset_in_shard + rel
            if flat._params is not None:  # use_orig_params=True: the original parameter's
                return optimizer.state[flat._params[i]][name], rel
            return optimizer.state[flat][name], info.offset_in_shard + rel
    raise KeyError(f"{fqn} is in no FSDP1 FlatParameter")


@contextlib.contextmanager
def bumped(
    model: Any, optimizer: Any, *spots: tuple[str, str | None, tuple[int, ...]]
) -> Iterator[list[bool]]:
    """Each element +0.5 where this rank holds it (restored exactly on exit); yields held-here."""
    held = [flat_element(model, optimizer, *spot) for spot in spots]
    olds = []
    with torch.no_grad():
        for h in held:
            if h is not None:
                t, pos = h
                olds.append(t[pos].clone())
                t[pos] += 0.5
    try:
        yield [h is not None for h in held]
    finally:
        with torch.no_grad():
            for h, old in zip([h for h in held if h is not None], olds):
                h[0][h[1]] = old


def summary(r: fsdpcheck.Report) -> dict[str, Any]:
    return {
        "ok": r.ok,
        "findings": [[f.key, f.kind, list(f.max_abs_index or []), f.rank] for f in r.findings],
        "counts": [r.keys_a, r.keys_b, r.keys_checked],
        "notes": list(r.notes),
        "text": str(r),
    }


def hexes(fps: dict[str, int]) -> dict[str, str]:
    return {k: f"{v:016x}" for k, v in sorted(fps.items())}


# ------------------------------------------------------------------------------------------
def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, dict]:
    """Per mode: FSDP1 toy model + AdamW after two steps, saved clean and planted."""
    ckpts, base = {}, {}
    for mode, orig in MODES.items():
        model = wrap(toy_model(), orig)
        opt = adamw(model.parameters())
        train_steps(model, opt, rank)
        clean, planted = shared / mode, shared / f"{mode}_planted"
        save(model, opt, clean)
        with bumped(model, opt, PLANT_WEIGHT, PLANT_MOMENT):
            save(model, opt, planted)
        ckpts[mode], ckpts[f"{mode}_planted"] = clean, planted
        base[mode] = (model, opt)
    return ckpts, base


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: tuple(x for pair in b.values() for x in pair)


@scenario(2, 4)
def clean(w: World) -> Any:
    out = {}
    for mode in MODES:
        model, opt = w.base[mode]
        with unchanged(model, opt):
            r = fsdpcheck.verify(model, w.ckpts[mode], optimizer=opt)
            live = hexes(fsdpcheck.fingerprint(model, optimizer=opt))
        offline = hexes(fsdpcheck.fingerprint_checkpoint(w.ckpts[mode]))
        out[mode] = {"verify": summary(r), "live_fp": live, "offline_fp": offline}
    return out


@scenario(2, 4)
def planted(w: World) -> Any:
    out = {}
    for mode in MODES:
        model, opt = w.base[mode]
        with unchanged(model, opt):
            out[mode] = summary(fsdpcheck.verify(model, w.ckpts[f"{mode}_planted"], optimizer=opt))
    return out


@scenario(2, 4)
def live_moment(w: World) -> Any:
    out, held = {}, {}
    for mode in MODES:
        model, opt = w.base[mode]
        with bumped(model, opt, LIVE_MOMENT) as here:
            out[mode] = summary(fsdpcheck.verify(model, w.ckpts[mode], optimizer=opt))
        held[mode] = here[0]
    return {**out, "rank_local": {"held": held}}


@scenario(2)
def not_stepped(w: World) -> Any:
    out = {}
    for mode in MODES:
        model, _ = w.base[mode]
        fresh = adamw(model.parameters())
        with unchanged(model, fresh):
            out[mode] = summary(fsdpcheck.verify(model, w.ckpts[mode], optimizer=fresh))
    return out


@scenario(4)
def zero_rows(w: World) -> Any:
    """A 3-row parameter at 4 ranks: rank 3 holds none of its rows in the saved chunks."""
    out: dict[str, Any] = {}
    for mode, orig in MODES.items():
        torch.manual_seed(0)
        model = wrap(Narrow(), orig, nested=False)
        opt = adamw(model.parameters())
        for step in range(2):
            g = torch.Generator().manual_seed(100 * w.rank + step)
            model(torch.randn(2, 8, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        path = w.workdir / mode
        save(model, opt, path)
        with unchanged(model, opt):
            r = summary(fsdpcheck.verify(model, path, optimizer=opt))
        try:
            loaded = summary(fsdpcheck.load(model, path, optimizer=opt, verify="full"))
            refused = None
        except Exception as exc:  # torch's DCP load of FSDP1 ShardedTensors: see the checks
            loaded, refused = None, f"{type(exc).__name__}: {exc}".splitlines()[0]
        out[mode] = {
            "verify": r,
            "load": loaded,
            "load_error": refused,
            "torch_load_error": torch_load(model, opt, path),
        }
    return out


def torch_load(model: Any, optimizer: Any, path: Path) -> str | None:
    """torch's FSDP1 resume recipe (``dcp.load``, ``FSDP.optim_state_dict_to_load``); its error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    try:
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=str(path))
            model.load_state_dict(state["model"])
            osd = FSDP.optim_state_dict_to_load(model, optimizer, state["optim"])
            optimizer.load_state_dict(osd)
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if isinstance(exc, KeyboardInterrupt):
            raise
        lines = [ln for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
        return lines[-1]  # the failing rank's own error, last in torch's CheckpointException
    return None


# ------------------------------------------------------------------------------------------
# accelerate: its default FSDP1 plugin, in a spawn of its own (run_ranks(2, ACCELERATE, ...)).
ACCELERATE = "tests.dist.fsdp1.fsdp1_scenarios:run_accelerate"


def accelerator(**plugin_args: Any) -> Any:
    """An Accelerator with an FSDP1 plugin (its defaults unless given) honoured on CPU ranks.

    accelerate takes its FSDP path only on GPUs. As for FSDP2
    (tests/dist/accelerate/accelerate_scenarios.py) its state is switched to FSDP after
    construction; FSDP1 also needs the device to be plain ``cpu`` (accelerate says ``cpu:0``, which
    FSDP1 refuses as "Inconsistent compute device and `device_id`").

    NOTE: [FSDP1 offload on CPU] accelerate's FULL_STATE_DICT save forces ``offload_to_cpu``
    with several processes; on a CPU device torch's ``FlatParamHandle.to_cpu`` "moves" the
    unsharded run to where it already is and then frees it ("setStorage: ... out of bounds for
    storage of size 0"). ``_cpu_to_cpu`` makes that move the no-op it is; the bytes saved are
    the ones a GPU job saves.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    assert plugin.fsdp_version == 1
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["device"] = torch.device("cpu")
    acc.state.device = torch.device("cpu")
    acc.state.fsdp_plugin = plugin
    return acc


def use_state_dict_type(plugin: Any, kind: str) -> None:
    """The plugin's ``set_state_dict_type(kind)`` with fresh configs (it keeps the old ones)."""
    plugin.state_dict_config = plugin.optim_state_dict_config = None
    plugin.set_state_dict_type(kind)


@contextlib.contextmanager
def _cpu_to_cpu() -> Iterator[None]:
    """FSDP1's "offload to CPU" as the no-op it is on a CPU device (NOTE in ``accelerator``)."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    original = FlatParamHandle.to_cpu

    def to_cpu(self: Any) -> Any:
        if self.flat_param.device.type == "cpu":
            return contextlib.nullcontext()
        return original(self)

    FlatParamHandle.to_cpu = to_cpu  # type: ignore[method-assign]
    try:
        yield
    finally:
        FlatParamHandle.to_cpu = original  # type: ignore[method-assign]


def run_accelerate(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """accelerate's default FSDP1 plugin (FULL_STATE_DICT, use_orig_params=False), then SHARDED.

    The model is prepared first and the optimizer built over the wrapped parameters, as
    accelerate's FSDP1 guide (and the HF Trainer) do: FSDP1 replaces the parameters.
    """
    import os

    from fsdpcheck.integrations.accelerate import verify_state

    # What a launcher (torchrun, accelerate launch) sets: without it accelerate calls every
    # process 0, and each writes the rank-0-only full optimizer state (empty off rank 0).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    out: dict[str, Any] = {}
    acc = accelerator()
    raw = toy_model()
    model = acc.prepare(raw)
    opt = acc.prepare(adamw(model.parameters()))
    train_steps(model, opt, rank, backward=acc.backward)
    inner = opt.optimizer
    for sdt in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        if sdt != "FULL_STATE_DICT":  # the default comes first, as constructed
            use_state_dict_type(acc.state.fsdp_plugin, sdt)
        clean_dir, planted_dir = workdir / sdt, workdir / f"{sdt}_planted"
        with _cpu_to_cpu():
            acc.save_state(str(clean_dir))
            with bumped(model, inner, PLANT_WEIGHT, PLANT_MOMENT):
                acc.save_state(str(planted_dir))
        torch.distributed.barrier()  # every rank's files are written
        with unchanged(model, inner):
            out[sdt] = {
                "files": sorted(p.name for p in clean_dir.iterdir()),
                "clean": summary(verify_state(acc, clean_dir)),
                "planted": summary(verify_state(acc, planted_dir)),
                "direct": summary(fsdpcheck.verify(model, clean_dir, optimizer=opt)),
            }
    out["use_orig_params"] = acc.state.fsdp_plugin.use_orig_params
    return out
