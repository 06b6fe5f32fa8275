"""fsdpcheck.save and fsdpcheck.load: a checkpoint with a manifest, and a load that checks.

save writes a DCP checkpoint plus a fingerprint manifest; load detects the checkpoint's kind,
refuses the wrong kind before touching anything, and checks what it loaded against the manifest
in one pass.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, cast

import torch

from fsdpcheck import keys as keymod
from fsdpcheck.collectives import Comm, agree
from fsdpcheck.fingerprint import fingerprint_report, fingerprints_differ
from fsdpcheck.layout import local_layout
from fsdpcheck.live import flat_live
from fsdpcheck.report import Finding, Report
from fsdpcheck.sources.dcp import is_dcp_dir
from fsdpcheck.sources.files import TORCH_SAVE_SUFFIXES

MANIFEST_NAME = "fsdpcheck_manifest.json"
MANIFEST_FORMAT = "fsdpcheck-manifest"
MANIFEST_VERSION = 1
KINDS = ("sharded", "full")


class CheckpointKindError(ValueError):
    """The checkpoint is not of the kind the caller insisted on (nothing was loaded)."""


def save(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """Saves the sharded state with DCP and writes a fingerprint manifest next to it.

    Collective. The state dict comes from ``get_state_dict`` (FQN keys, saved as
    ``model.<fqn>`` and ``optim.state.<fqn>.<name>``). The manifest (``fsdpcheck_manifest.json``
    in the checkpoint directory) holds per key its Fingerprint v1, global shape and dtype, and for
    the checkpoint its kind, world size, meshes, torch and fsdpcheck versions and format version.
    Computing it reads each local shard once, on its device.

    Args:
        model: The (sharded) model.
        path: The checkpoint directory.
        optimizer: Its optimizer, saved too when given.
        group: The process group.

    Returns:
        The manifest (identical on every rank).
    """
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    from fsdpcheck import __version__

    comm = Comm(group)
    path = Path(path)
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp_save(state, checkpoint_id=str(path), process_group=group, no_dist=not comm.enabled)
    fps = fingerprint_report(model, optimizer=optimizer, group=group)
    entries: dict[str, Any] = {}
    meshes: set[str] = set()
    for key, lay in sorted(fps.layouts.items()):  # the layouts the fingerprint pass computed
        if "DTensor" in lay.description:
            meshes.add(lay.description.split(" on mesh ")[-1])
        entries[key] = {
            "checkpoint_key": key if key.startswith("optim.") else f"model.{key}",
            "shape": list(lay.global_shape),
            "dtype": str(lay.dtype).removeprefix("torch."),
            "fingerprint": f"{fps.fingerprints[key]:#018x}" if key in fps.fingerprints else None,
        }
    manifest = {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "kind": "sharded",
        "storage": "dcp",
        "world_size": comm.world,
        "meshes": sorted(meshes),
        "torch": torch.__version__,
        "fsdpcheck": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "entries": entries,
        "findings_at_save": [f.describe() for f in fps.findings],
    }

    def write() -> None:
        if comm.rank == 0:
            tmp = path / (MANIFEST_NAME + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            tmp.replace(path / MANIFEST_NAME)  # atomic: readers never see half a manifest

    agree(comm, write, "writing the manifest")  # also the barrier: it is on disk for everyone
    return manifest


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, or None when it has none."""
    f = Path(path) / MANIFEST_NAME
    if not f.is_file():
        return None
    manifest = json.loads(f.read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{f} is not an fsdpcheck manifest")
    if manifest.get("format_version", 0) > MANIFEST_VERSION:
        raise ValueError(
            f"{f} has format version {manifest['format_version']}; this fsdpcheck reads up to "
            f"{MANIFEST_VERSION}: upgrade fsdpcheck"
        )
    return manifest


def detect_kind(path: str | os.PathLike[str]) -> tuple[str, str]:
    """("sharded" | "full", a description) of a checkpoint path, reading only metadata."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if is_dcp_dir(p):
        return "sharded", f"a DCP checkpoint directory ({p})"
    if p.is_dir():
        fsdp = sorted(p.glob("pytorch_model_fsdp_*"))
        if fsdp and is_dcp_dir(fsdp[0]):
            return "sharded", f"an accelerate save_state directory with sharded {fsdp[0].name}/"
        full = sorted(q for q in p.iterdir() if q.suffix in (*TORCH_SAVE_SUFFIXES, ".safetensors"))
        if full:
            return (
                "full",
                f"a directory of full-state files ({', '.join(q.name for q in full[:3])})",
            )
        raise ValueError(f"{p} holds no checkpoint fsdpcheck recognises")
    if p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json"):
        return "full", f"a safetensors file of full tensors ({p.name})"
    return "full", f"a torch.save file of full tensors ({p.name})"


def load(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    verify: str | None = "fingerprint",
    expect: str | None = None,
    sentinel: bool = False,
    group: Any = None,
) -> Report:
    """Loads any supported checkpoint into a (sharded) model and optimizer, then checks it.

    Collective. What `path` is decides how it is loaded, so hand-written code cannot load a full
    checkpoint as if it were sharded or the reverse: a DCP directory is loaded with DCP into the
    sharded state; a full checkpoint (torch.save file, safetensors) with ``set_state_dict`` and
    ``full_state_dict=True``, each rank keeping its own shards.

    Args:
        model: The model to load into (FSDP2, TP, 2D, HSDP, DDP or plain).
        path: A DCP directory (ideally written by ``fsdpcheck.save``), a torch.save file, or
            safetensors.
        optimizer: The optimizer to load too.
        verify: "fingerprint" (the loaded shards against the manifest: one pass, one gather, no
            second read of the checkpoint; falls back to "full" without a manifest and says so),
            "full" (``fsdpcheck.verify`` against the files) or None.
        expect: "sharded" or "full" to refuse a checkpoint of the other kind before anything is
            loaded (raises CheckpointKindError on every rank).
        sentinel: Fill every destination with a sentinel (a NaN payload, or the integer minimum)
            before loading, and report elements the load never wrote.
        group: The process group.

    Returns:
        The Report of the check (its notes say what was loaded and how it was checked).
    """
    from fsdpcheck.verify import verify as verify_full

    if verify not in ("fingerprint", "full", None):
        raise ValueError(f"verify must be 'fingerprint', 'full' or None, not {verify!r}")
    if expect not in (*KINDS, None):
        raise ValueError(f"expect must be 'sharded', 'full' or None, not {expect!r}")
    kind, what = detect_kind(path)
    if expect is not None and expect != kind:
        hint = (
            "load it with expect='full' (fsdpcheck loads full checkpoints into sharded models), "
            "or convert it with torch.distributed.checkpoint.format_utils.torch_save_to_dcp"
            if kind == "full"
            else "load it with expect='sharded', or write a full one with "
            "torch.distributed.checkpoint.format_utils.dcp_to_torch_save"
        )
        raise CheckpointKindError(
            f"expected a {expect} checkpoint but {path} is {what}, a {kind} checkpoint; "
            f"nothing was loaded. {hint}"
        )
    comm = Comm(group)
    path = Path(path)
    marked = agree(comm, lambda: _fill_sentinel(model, optimizer) if sentinel else [], "sentinel")
    if kind == "sharded":
        _load_sharded(model, optimizer, path, group, comm)  # DCP reports failures collectively
    else:
        # Reading is local and may fail on one rank: agree on it before torch's collectives.
        full, osd = agree(comm, lambda: _read_full(model, optimizer, path), f"reading {path}")
        _apply_full(model, optimizer, full, osd)
    notes = [f"loaded {what} as a {kind} checkpoint"]
    findings = _unwritten(marked, comm) if sentinel else []
    report: Report
    manifest = read_manifest(path) if kind == "sharded" and path.is_dir() else None
    if verify == "fingerprint" and manifest is None:
        notes.append("no fsdpcheck manifest: verify='fingerprint' fell back to verify='full'")
        verify = "full"
    if verify == "fingerprint":
        assert manifest is not None
        result = fingerprint_report(model, optimizer=optimizer, group=group)
        expected = {
            k: int(v["fingerprint"], 16)
            for k, v in manifest["entries"].items()
            if v.get("fingerprint") and (optimizer is not None or not k.startswith("optim."))
        }
        report = Report(
            findings=fingerprints_differ(expected, result.fingerprints) + result.findings,
            reference=f"the manifest of {path}",
            world_size=comm.world,
            keys_checked=len(expected),
        )
    elif verify == "full":
        report = verify_full(model, path, optimizer=optimizer, group=group)
    else:
        report = Report(reference=str(path), world_size=comm.world)
        notes.append("not verified (verify=None)")
    report.findings = sorted(findings + report.findings, key=lambda f: (f.key, f.kind))
    report.notes = notes + report.notes
    return report


def _load_sharded(model: Any, optimizer: Any, path: Path, group: Any, comm: Comm) -> None:
    """DCP loads into the sharded state, following the checkpoint's own nesting.

    Checkpoints nest the model and optimizer state under names of their writer's choosing
    ({"model": ..., "optim": ...} from fsdpcheck.save and torchtitan-style code, "optimizer" from
    accelerate, or flat): each DCP directory's metadata says which, and the state dict handed to
    DCP is nested the same way.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fsdpcheck.sources import accelerate_dirs
    from fsdpcheck.sources.dcp import DCPSource

    dirs = [path] if is_dcp_dir(path) else accelerate_dirs(path)
    for d in dirs:
        model_at, optim_at = _containers(DCPSource(d))
        if optimizer is None:
            optim_at = None
        state: dict[str, Any] = {}
        msd = get_model_state_dict(model) if model_at is not None else None
        osd = get_optimizer_state_dict(model, optimizer) if optim_at is not None else None
        for at, sd in ((model_at, msd), (optim_at, osd)):
            if at is not None and sd is not None:
                if at:
                    state[at] = sd
                else:
                    state.update(sd)
        if not state:
            continue
        dcp_load(state, checkpoint_id=str(d), process_group=group, no_dist=not comm.enabled)
        if msd is not None:
            set_model_state_dict(model, state[model_at] if model_at else msd)
        if osd is not None:
            set_optimizer_state_dict(model, optimizer, state[optim_at] if optim_at else osd)


def _containers(source: Any) -> tuple[str | None, str | None]:
    """Where a DCP checkpoint nests model and optimizer state ("" flat, None absent)."""
    c = keymod.classify(source.entries())
    model_at = None
    for e in c.model.values():
        nested = len(e.path) > 1 and e.path[0] in keymod.MODEL_CONTAINERS
        model_at = e.path[0] if nested else ""
        break
    optim_at = None
    for e in c.state.values():
        optim_at = e.path[0] if len(e.path) == 4 else ""
        break
    return model_at, optim_at


def _read_full(model: Any, optimizer: Any, path: Path) -> tuple[dict, dict | None]:
    """The full model (and optimizer) state from a full checkpoint, on the CPU; local I/O only."""
    from fsdpcheck.live import live_state_dicts
    from fsdpcheck.sources import open_source

    source = open_source(path)
    classified = keymod.classify(source.entries())
    live_model, _ = live_state_dicts(model, None)
    prefix = keymod.best_prefix(list(live_model), list(classified.model))
    by_name = {name: e.key for name, e in classified.model.items()}
    full: dict[str, torch.Tensor] = {}
    for fqn in live_model:
        ckpt = by_name.get(keymod.map_with(prefix, fqn))
        if ckpt is not None:
            (full[fqn],) = source.read([_whole(source, ckpt)], torch.device("cpu"))
    osd = None
    if optimizer is not None and classified.state:
        osd = _full_optimizer_state(source, classified, optimizer, model)
    return full, osd


def _apply_full(model: Any, optimizer: Any, full: dict, osd: dict | None) -> None:
    """Each rank keeps its shards of the full state (collective inside torch)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, cast(Any, full), options=options)
    if osd is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=options)


def _whole(source: Any, key: str) -> Any:
    from fsdpcheck.sources import Region

    shape = source.entries()[key].shape
    return Region(key, (0,) * len(shape), tuple(shape))


def _full_optimizer_state(source: Any, classified: Any, optimizer: Any, model: Any) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    live: Any = get_optimizer_state_dict(model, optimizer)  # a nested dict of torch's ValueType
    live_fqns = [str(p) for g in live["param_groups"] for p in g["params"]]
    ckpt_fqns = sorted({f for f, _ in classified.state})
    if ckpt_fqns and all(f.isdigit() for f in ckpt_fqns):  # a raw optimizer.state_dict()
        ids = [str(p) for g in sorted(classified.groups) for p in _params(source, classified, g)]
        to_live = dict(zip(ids, live_fqns))
    else:
        prefix = keymod.best_prefix(live_fqns, ckpt_fqns)
        to_live = {keymod.map_with(prefix, f): f for f in live_fqns}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for (ck, name), e in classified.state.items():
        fqn = to_live.get(ck)
        if fqn is not None and e.is_tensor:
            (state.setdefault(fqn, {})[name],) = source.read(
                [_whole(source, e.key)], torch.device("cpu")
            )
    groups = []
    for g in live["param_groups"]:
        groups.append(dict(g))  # hyperparameters as the live optimizer has them
    return {"state": state, "param_groups": groups}


def _params(source: Any, classified: Any, group: int) -> list:
    entry = classified.groups[group].get("params")
    return [] if entry is None else list(source.read_object(entry.key))


# -------------------------------------------------------------------------------------------
# Sentinels: elements a load never wrote.
_SENTINEL_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FF80000BAD1BAD1),
    torch.float32: (torch.int32, 0x7FC0BAD1),
    torch.bfloat16: (torch.int16, 0x7FBA),
    torch.float16: (torch.int16, 0x7EBA),
    torch.float8_e4m3fn: (torch.uint8, 0x7F),
    torch.float8_e5m2: (torch.uint8, 0x7E),
    torch.int64: (torch.int64, -(2**63)),
    torch.int32: (torch.int32, -(2**31)),
    torch.int16: (torch.int16, -(2**15)),
    torch.int8: (torch.int8, -(2**7)),
    torch.uint8: (torch.uint8, 0xFF),
}


def _fill_sentinel(model: Any, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """Fills every local destination with its dtype's sentinel; the filled tensors by key."""
    marked = []
    for key, value in sorted(flat_live(model, optimizer).items()):
        for piece in local_layout(value).pieces:
            t = piece.tensor
            if t.dtype in _SENTINEL_BITS and t.numel() > 0:
                view_dtype, bits = _SENTINEL_BITS[t.dtype]
                with torch.no_grad():
                    t.view(view_dtype).fill_(bits)
                marked.append((key, t))
    return marked


def _unwritten(marked: list[tuple[str, torch.Tensor]], comm: Comm) -> list[Finding]:
    """Findings for keys with elements that still hold the sentinel (summed over ranks)."""
    local: dict[str, int] = {}
    for key, t in marked:
        view_dtype, bits = _SENTINEL_BITS[t.dtype]
        n = int((t.view(view_dtype) == torch.tensor(bits, dtype=view_dtype)).sum())
        if n:
            local[key] = local.get(key, 0) + n
    counts: dict[str, int] = {}
    for rank_counts in comm.all_gather_object(local):
        for key, n in rank_counts.items():
            counts[key] = counts.get(key, 0) + n
    return [
        Finding(
            key,
            "missing",
            f"{n} element(s) were never written by the load (they still hold the sentinel)",
            mismatched=n,
        )
        for key, n in sorted(counts.items())
    ]
