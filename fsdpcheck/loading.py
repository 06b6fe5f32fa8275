"""fsdpcheck.load: any supported checkpoint into a (sharded) model, checked before and after.

load recognises the checkpoint's layout, checks its structure on every rank before any byte
reaches the model (refusing, with the model untouched, what fails), loads it through fsdpcheck's
safe DCP reader following the checkpoint's own nesting and names, and checks what it loaded
against the manifest in one pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from fsdpcheck import matching
from fsdpcheck.collectives import Comm, agree
from fsdpcheck.fingerprints import fingerprint_report, fingerprints_differ
from fsdpcheck.formats import CheckpointInfo, describe_path, is_dcp_dir
from fsdpcheck.live import inner_optimizers, model_canonicalizer
from fsdpcheck.manifest import Manifest, read_manifest
from fsdpcheck.report import Report, describe_error, normalized, root_cause
from fsdpcheck.saving import stale_reason
from fsdpcheck.sentinel import fill_sentinel, unwritten
from fsdpcheck.sources import Region, Source, open_path, open_source, refuse_problems
from fsdpcheck.sources.base import CheckpointError
from fsdpcheck.verification import verify as verify_full

__all__ = ["CHECKPOINT_KINDS", "CheckpointKindError", "check_against_manifest", "load"]

CHECKPOINT_KINDS = ("sharded", "full")


class CheckpointKindError(ValueError):
    """The checkpoint is not of the kind the caller insisted on (nothing was loaded)."""


# -------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """What load will do, decided (and checked) before any byte reaches the model."""

    info: CheckpointInfo
    manifest: Manifest | None
    parts: list[tuple[Path, matching.CheckpointKeys]]  # DCP directories (sharded loads)


def load(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    verify: str | None = "fingerprint",
    expect: str | None = None,
    sentinel: bool = False,
    group: Any = None,
) -> Report:
    """Loads any supported checkpoint into a (sharded) model and optimizer, then checks it.

    Collective. What `path` is decides how it is loaded, so hand-written code cannot load a full
    checkpoint as if it were sharded or the reverse: a DCP directory (of any writer: fsdpcheck,
    torchtitan, accelerate, Lightning, plain) is loaded with DCP into the sharded state, following
    the checkpoint's own nesting and names; a full checkpoint (torch.save, safetensors) with
    ``set_state_dict`` and ``full_state_dict=True``, each rank keeping its own shards.

    Before anything is loaded, every rank checks the checkpoint's structure (files present and
    long enough, chunks tiling every tensor, the manifest valid and agreeing with the metadata)
    and the ranks agree on the result: a checkpoint that fails is refused on every rank with one
    line, and the model and optimizer are untouched. DCP data is read by fsdpcheck's own reader
    (restricted unpickling of the metadata, ``weights_only`` values): no code from the checkpoint
    runs.

    Args:
        model: The model to load into (FSDP2, TP, 2D, HSDP, DDP or plain).
        path: Any checkpoint ``fsdpcheck.describe_path`` recognises.
        optimizer: The optimizer to load too (or a wrapper of several).
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

    Raises:
        CheckpointKindError: `expect` does not match (nothing loaded, on every rank).
        RuntimeError: On every rank, when the checkpoint fails the structure check on any rank
            (nothing loaded; the message names the rank, the file and the problem).
    """
    if verify not in ("fingerprint", "full", None):
        raise ValueError(f"verify must be 'fingerprint', 'full' or None, not {verify!r}")
    if expect not in (*CHECKPOINT_KINDS, None):
        raise ValueError(f"expect must be 'sharded', 'full' or None, not {expect!r}")
    comm = Comm(group)
    plan = agree(comm, lambda: _preflight(path), f"checking {path} before loading")
    _same_checkpoint(comm, path, plan)
    info = plan.info
    if expect is not None and expect != info.kind:
        hint = (
            "load it with expect='full' (fsdpcheck loads full checkpoints into sharded models), "
            "or convert it with torch.distributed.checkpoint.format_utils.torch_save_to_dcp"
            if info.kind == "full"
            else "load it with expect='sharded', or write a full one with "
            "torch.distributed.checkpoint.format_utils.dcp_to_torch_save"
        )
        raise CheckpointKindError(
            f"expected a {expect} checkpoint but {path} is {info.description}, a {info.kind} "
            f"checkpoint; nothing was loaded. {hint}"
        )
    marked = agree(comm, lambda: fill_sentinel(model, optimizer) if sentinel else [], "sentinel")
    if info.kind == "sharded":
        for d, keys in plan.parts:  # DCP reports failures collectively
            _load_dcp(model, optimizer, d, keys, group, comm)
    else:
        # Reading is local and may fail on one rank: agree on it before torch's collectives.
        full, osd = agree(comm, lambda: _read_full(model, optimizer, info), f"reading {path}")
        _apply_full(model, optimizer, full, osd)
    notes = [f"loaded {info.description} as a {info.kind} checkpoint", *info.notes]
    findings = unwritten(marked, comm) if sentinel else []
    report: Report
    manifest = plan.manifest
    if verify == "fingerprint" and manifest is None:
        notes.append("no usable manifest: verify='fingerprint' fell back to verify='full'")
        verify = "full"
    if verify == "fingerprint":
        assert manifest is not None
        report = check_against_manifest(model, manifest, path, optimizer=optimizer, group=group)
    elif verify == "full":
        report = verify_full(model, path, optimizer=optimizer, group=group)
    else:
        report = Report(reference=str(path), world_size=comm.world)
        notes.append("not verified (verify=None)")
    report.findings = normalized(findings + report.findings)
    report.notes = notes + report.notes
    return report


def _preflight(path: str | os.PathLike[str]) -> _Plan:
    """Recognises the checkpoint and checks its structure; raises on anything wrong."""
    info = describe_path(path)
    manifest = read_manifest(info.path) if info.layout == "fsdpcheck" else None
    stale = stale_reason(info.path, manifest) if manifest is not None else None
    if stale is not None:  # it describes an earlier save: checked against, it would only mislead
        info.notes.append(f"{stale}; not used")
        manifest = None
    parts: list[tuple[Path, matching.CheckpointKeys]] = []
    for part in info.parts:
        source = open_path(part)
        try:
            refuse_problems(source, part, "load it (nothing was loaded)")
            keys = matching.checkpoint_keys(source.entries(), flat=source.kind == "safetensors")
            if manifest is not None:
                _manifest_agrees(manifest, source, keys, part)
        finally:
            source.close()
        if is_dcp_dir(part):
            parts.append((part, keys))
    return _Plan(info, manifest, parts)


def _same_checkpoint(comm: Comm, path: str | os.PathLike[str], plan: _Plan) -> None:
    """Refuses, on every rank alike, ranks that were given different checkpoints.

    Ranks may load copies of one checkpoint from different paths, but a full checkpoint on one
    rank and a sharded one on another would take different collectives, and wait for each
    other forever: every rank compares what it found before anything else happens.
    """
    m = plan.manifest
    mine = (
        plan.info.kind,
        plan.info.layout,
        [os.path.relpath(p, plan.info.path) for p, _ in plan.parts],
        # Which save the manifest belongs to, in a few words (not its entries: 10**6 keys).
        None if m is None else (m.created, len(m.entries), sorted(m.saves.items())),
    )
    seen = comm.all_gather_object((str(path), plan.info.description, mine))
    if any(s[2] != seen[0][2] for s in seen):
        found = "; ".join(f"rank {r}: {p} ({d})" for r, (p, d, _) in enumerate(seen))
        raise CheckpointError(
            f"the ranks were given different checkpoints to load ({found}); every rank must "
            "load the same checkpoint (nothing was loaded)"
        )


def _manifest_agrees(
    manifest: Manifest, source: Source, keys: matching.CheckpointKeys, where: Path
) -> None:
    entries = source.entries()
    for name, e in manifest.entries.items():
        entry = entries.get(e.checkpoint_key)
        if entry is None:
            raise CheckpointError(
                f"{where}: the manifest lists {name} as {e.checkpoint_key!r}, "
                "which the checkpoint's metadata lacks"
            )
        dtype = str(entry.dtype).removeprefix("torch.")
        if tuple(entry.shape) != e.shape or dtype != e.dtype:
            raise CheckpointError(
                f"{where}: {name}: the manifest says {e.shape} {e.dtype}, the metadata "
                f"{tuple(entry.shape)} {dtype}"
            )
    del keys


def _load_dcp(
    model: Any, optimizer: Any, d: Path, keys: matching.CheckpointKeys, group: Any, comm: Comm
) -> None:
    """DCP loads into the sharded state, nested and named as the checkpoint has it.

    Checkpoints nest the model and optimizer state under names of their writer's choosing
    ({"model": ..., "optim": ...} from fsdpcheck.save, "optimizer" from accelerate, flattened
    ``state.<fqn>.<name>`` from torchtitan, flat) and spell FQNs their way (``_forward_module.``
    from Lightning): the state dict handed to DCP is built from the checkpoint's own keys, and
    DCP copies into the live tensors in place.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fsdpcheck.sources.safe_reader import SafeFileSystemReader, SafeLoadPlanner

    state: dict[str, Any] = {}
    canon = model_canonicalizer(model)
    msd = None
    if keys.model:
        msd = get_model_state_dict(model)
        for k, v in msd.items():
            r = keys.model.get(canon(k))
            if r is not None:
                _put(state, r.entry.path, v)
    osd: Any = None
    opt: Any = None
    options: Any = None
    inverse: dict[str, str] = {}
    if optimizer is not None and keys.state:
        if keys.id_keyed:
            raise CheckpointError(
                f"{d}: optimizer state keyed by integer ids (a raw "
                "optimizer.state_dict()) cannot be loaded into a sharded "
                "optimizer by name"
            )
        optimizers = inner_optimizers(optimizer)
        opt = optimizers[0] if len(optimizers) == 1 else tuple(optimizers)
        flatten = keys.groups_by_fqn or any(len(r.entry.path) <= 2 for r in keys.state.values())
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        osd = get_optimizer_state_dict(model, opt, options=options)
        spelled = {r.fqn: r.raw for r in keys.state.values()}
        spelled.update({r.fqn: r.raw for g in keys.groups.values() for r in g.values()})
        renamed, inverse = _spell(osd, spelled, canon, flatten)
        at = next(iter(keys.state.values())).container
        if at:
            state[at] = renamed
        else:
            state.update(renamed)
    if not state:
        return
    try:
        dcp_load(
            state,
            storage_reader=SafeFileSystemReader(d),
            planner=SafeLoadPlanner(),
            process_group=group,
            no_dist=not comm.enabled,
        )
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        lost = comm.lost_rank(exc, f"load (DCP reading {d})")
        if lost is not None:
            raise lost from None
        raise CheckpointError(f"loading {d} failed: {_first_failure(exc)}") from None
    if msd is not None:
        set_model_state_dict(model, msd)
    if osd is not None:
        at = next(iter(keys.state.values())).container
        loaded = state[at] if at else state
        set_optimizer_state_dict(model, opt, _unspell(loaded, osd, inverse), options=options)


def _first_failure(exc: BaseException) -> str:
    """One line: the first failing rank's error inside torch's CheckpointException."""
    rank, cause = root_cause(exc)
    return (f"on rank {rank}: " if rank is not None else "") + describe_error(cause)


def _put(state: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    d = state
    for part in path[:-1]:
        d = d.setdefault(part, {})
    d[path[-1]] = value


def _spell(
    osd: Any, spelled: dict[str, str], canon: Any, flatten: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """The live optimizer state dict with FQNs spelled as the checkpoint spells them.

    Also returns the inverse renaming (checkpoint spelling -> live key).
    """
    inverse: dict[str, str] = {}

    def name(fqn: str) -> str:
        out = spelled.get(canon(fqn), fqn)
        inverse[out] = fqn
        return out

    if flatten:
        out = {}
        for k, v in osd.items():
            kind, _, rest = k.partition(".")
            fqn, _, item = rest.rpartition(".")
            new = f"{kind}.{name(fqn)}.{item}"
            inverse[new] = k
            out[new] = v
        return out, inverse
    renamed = {
        "state": {name(f): s for f, s in osd["state"].items()},
        "param_groups": [
            {**g, "params": [name(p) for p in g["params"]]} for g in osd["param_groups"]
        ],
    }
    return renamed, inverse


def _unspell(loaded: Any, osd: Any, inverse: dict[str, str]) -> Any:
    """The loaded optimizer state dict back in the live names torch expects."""
    if "state" not in loaded or "param_groups" not in loaded:  # flattened
        return {inverse.get(k, k): v for k, v in loaded.items()}
    return {
        "state": {inverse.get(f, f): s for f, s in loaded["state"].items()},
        # Hyperparameters as loaded; params as the live groups list them (same order).
        "param_groups": [
            {**g, "params": list(live["params"])}
            for g, live in zip(loaded["param_groups"], osd["param_groups"])
        ],
    }


def _read_full(model: Any, optimizer: Any, info: CheckpointInfo) -> tuple[dict, dict | None]:
    """The full model (and optimizer) state from a full checkpoint, on the CPU; local I/O only."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    source = open_source(info.path)
    try:
        keys = matching.checkpoint_keys(source.entries(), flat=source.kind == "safetensors")
        canon = model_canonicalizer(model)
        full: dict[str, torch.Tensor] = {}
        for fqn in get_model_state_dict(model):
            r = keys.model.get(canon(fqn))
            if r is not None and r.entry.is_tensor:
                (full[fqn],) = source.read([_whole(r.entry)], torch.device("cpu"))
        osd = None
        if optimizer is not None and keys.state:
            osd = _full_optimizer_state(source, keys, optimizer, model, canon)
    finally:
        source.close()
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
        optimizers = inner_optimizers(optimizer)
        opt: Any = optimizers[0] if len(optimizers) == 1 else tuple(optimizers)
        set_optimizer_state_dict(model, opt, osd, options=options)


def _whole(entry: Any) -> Region:
    return Region(entry.key, (0,) * len(entry.shape), tuple(entry.shape))


def _full_optimizer_state(
    source: Source, keys: matching.CheckpointKeys, optimizer: Any, model: Any, canon: Any
) -> dict:
    """The checkpoint's optimizer state keyed by the live FQNs (torch's full-state form)."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    groups = []
    for opt in inner_optimizers(optimizer):
        for g in opt.param_groups:
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [first[id(p)] for p in g["params"]],
                }
            )
    live_order = [p for g in groups for p in g["params"]]
    to_live: dict[str, str] = {}
    if keys.id_keyed:
        params = {g: hp["params"].key for g, hp in keys.groups.items() if "params" in hp}
        saved = source.read_objects(list(params.values()))
        ids = [str(p) for g in sorted(params, key=lambda g: (len(g), g)) for p in saved[params[g]]]
        to_live = dict(zip(ids, live_order))
    else:
        to_live = {canon(f): f for f in live_order}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for (who, item), r in keys.state.items():
        fqn = to_live.get(who)
        if fqn is not None and r.entry.is_tensor:
            (state.setdefault(fqn, {})[item],) = source.read([_whole(r.entry)], torch.device("cpu"))
    return {"state": state, "param_groups": groups}


def check_against_manifest(
    model: torch.nn.Module,
    manifest: Manifest,
    where: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    group: Any = None,
) -> Report:
    """The live state against a manifest: one fingerprint pass and one gather, no file read.

    Collective. Optimizer entries are checked only when `optimizer` is given.
    """
    comm = Comm(group)
    result = fingerprint_report(model, optimizer=optimizer, group=group)
    expected = {
        k: fp
        for k, fp in manifest.fingerprints().items()
        if optimizer is not None or not k.startswith("optim.")
    }
    return Report(
        findings=fingerprints_differ(expected, result.fingerprints) + result.findings,
        reference=f"the manifest of {where}",
        world_size=comm.world,
        keys_checked=len(expected),
        keys_a=len(result.fingerprints),
        keys_b=len(expected),
        side_b="manifest",
    )
