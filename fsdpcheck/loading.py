"""fsdpcheck.load: any supported checkpoint into a (sharded) model, checked before and after.

load recognises the checkpoint's layout, checks its structure on every rank before any byte
reaches the model (refusing, with the model untouched, what fails), loads it through fsdpcheck's
safe DCP reader following the checkpoint's own nesting and names, and checks what it loaded
against the manifest in one pass.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch

from fsdpcheck import matching
from fsdpcheck._collector import paused
from fsdpcheck.collectives import digest
from fsdpcheck.convert import Conversion, Target
from fsdpcheck.convert.declared import stated_or_declared
from fsdpcheck.dist.arguments import given
from fsdpcheck.dist.runner import ARGUMENTS, Call, RankFailure, call
from fsdpcheck.errors import (
    CheckpointError,
    CheckpointKindError,
    RankStoppedError,
    describe_error,
    root_cause,
)
from fsdpcheck.fingerprints import fingerprint_report, fingerprints_differ
from fsdpcheck.formats import CheckpointInfo, describe_path, is_dcp_dir
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.live import inner_optimizers, live_state, model_canonicalizer, model_parts
from fsdpcheck.manifest import Manifest, read_manifest
from fsdpcheck.opening import open_checked
from fsdpcheck.reading.live import (
    buffer_names,
    compile_for_live,
    converted_reads,
    converted_state,
    write_in_place,
)
from fsdpcheck.report import Finding, MappingRow, Report, normalized
from fsdpcheck.saving import stale_reason
from fsdpcheck.sentinel import fill_sentinel, unwritten
from fsdpcheck.sources import Region, Source, refuse_problems
from fsdpcheck.sources.remote import RemotePath
from fsdpcheck.tolerances import checked_key_map
from fsdpcheck.verification import verify as verify_full

__all__ = ["CHECKPOINT_KINDS", "CheckpointKindError", "check_against_manifest", "load"]

CHECKPOINT_KINDS = ("sharded", "full")


# -------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """What load will do, decided (and checked) before any byte reaches the model."""

    info: CheckpointInfo
    manifest: Manifest | None


def load(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    verify: str | None = "fingerprint",
    expect: str | None = None,
    sentinel: bool = False,
    key_map: matching.KeyMap | None = None,
    group: Any = None,
    convert: Any = None,
    timeout: float | None = None,
) -> Report:
    """Loads any supported checkpoint into a (sharded) model and optimizer, then checks it.

    Collective. What `path` is decides how it is loaded, so hand-written code cannot load a full
    checkpoint as if it were sharded or the reverse: a DCP directory (of any writer: fsdpcheck,
    torchtitan, accelerate, Lightning, plain) is loaded with DCP into the sharded state; a full
    checkpoint (torch.save, safetensors) with ``set_state_dict`` and ``full_state_dict=True``,
    each rank keeping its own shards. Either way every live tensor is paired with its
    checkpoint entry by the same pairing ``verify`` uses (``fsdpcheck.matching``): the pair
    verify accepts is the pair load loads, and what cannot be paired is a finding in the
    returned report, never silently left as it was.

    Before anything is loaded, every rank checks the checkpoint's structure (files present and
    long enough, chunks tiling every tensor, the manifest valid and agreeing with the metadata)
    and the ranks agree on the result: a checkpoint that fails is refused on every rank with one
    line, and the model and optimizer are untouched. DCP data is read by fsdpcheck's own reader
    (restricted unpickling of the metadata, ``weights_only`` values): no code from the checkpoint
    runs.

    Args:
        model: The model to load into (FSDP2, TP, 2D, HSDP, DDP or plain).
        path: Any checkpoint ``fsdpcheck.describe_path`` recognises.
        optimizer: The optimizer to load too (or a wrapper of several). An optimizer without
            state gets it created first (torch's ``get_optimizer_state_dict``, at lr 0, so no
            weight changes), then overwritten by the load.
        verify: "fingerprint" (the loaded shards against the manifest: one pass, a few
            all-reduces, no second read of the checkpoint; falls back to "full" without a
            manifest and says so),
            "full" (``fsdpcheck.verify`` against the files) or None.
        expect: "sharded" or "full" to refuse a checkpoint of the other kind before anything is
            loaded (raises CheckpointKindError on every rank).
        sentinel: Fill every destination with a sentinel (a NaN payload, or the integer minimum)
            before loading, and report elements the load never wrote.
        key_map: Live key -> checkpoint key or name, or prefix rules, as for ``verify``.
        group: The process group.
        convert: How the live layout becomes the checkpoint's (``fsdpcheck.convert``, as for
            ``verify``; None: the model's declared one, if any). The model tensors are then
            loaded through it, with nothing gathered: each rank reads the reference regions
            its own shards' pieces name and writes them into its shards (the optimizer state
            keeps the parameters' names and is loaded as usual); the check after the load
            goes through it too.
        timeout: Seconds a rank waits in one collective (DCP's included) for the others before
            it names the ranks that did not answer (default: the process group's timeout,
            which is this for the call's length).

    `verify`, `expect`, `sentinel`, `key_map`, `convert` and whether an optimizer is given must
    be the same on every rank: they are compared by digest in the first collective (ranks
    that differ raise ``RanksDisagreeError`` on every rank, naming the argument and the ranks,
    before anything is read). Any failure on one rank raises the same error on every rank.

    Returns:
        The Report of the check (its notes say what was loaded and how it was checked).

    Raises:
        CheckpointKindError: `expect` does not match (nothing loaded, on every rank).
        RuntimeError: On every rank, when the checkpoint fails the structure check on any rank
            (nothing loaded; the message names the rank, the file and the problem).
        RanksDisagreeError: The ranks passed different arguments (nothing loaded).
        RankStoppedError: A rank stopped answering, on every rank that still answers.
    """
    with paused(), call("fsdpcheck.load", group, timeout) as c:  # NOTE: [collector]
        try:
            return _load(c, model, path, optimizer, verify, expect, sentinel, key_map, group,
                         convert)  # fmt: skip
        except RankFailure as f:
            raise f.failure.error() from None


def _load(
    c: Call,
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    optimizer: Any,
    verify: str | None,
    expect: str | None,
    sentinel: bool,
    key_map: matching.KeyMap | None,
    group: Any,
    convert: Any = None,
) -> Report:
    def arguments() -> Any:
        if verify not in ("fingerprint", "full", None):
            raise ValueError(f"verify must be 'fingerprint', 'full' or None, not {verify!r}")
        if expect not in (*CHECKPOINT_KINDS, None):
            raise ValueError(f"expect must be 'sharded', 'full' or None, not {expect!r}")
        c.arguments(
            verify=verify,
            expect=expect,
            sentinel=bool(sentinel),
            key_map=key_map,
            optimizer=given(optimizer),
            convert=convert,
        )
        return checked_key_map(key_map)

    key_map = c.local(ARGUMENTS, arguments)
    c.check("agreeing on the arguments")
    # One parse of the metadata per rank, checked on rank 0 alone (NOTE: [metadata once per
    # job] in ``opening``), reused by the pairing, DCP's load and the check after.
    checking = f"checking {path} before loading"
    source = open_checked(c, path, checking)
    try:
        plan = c.local(checking, lambda: _preflight(path, _opened(source)))
        _same_checkpoint(c, path, plan)
        assert source is not None and plan is not None
        return _loaded(c, model, path, source, plan, optimizer, verify, expect, sentinel,
                       key_map, group, convert)  # fmt: skip
    finally:
        if source is not None:
            source.close()


def _opened(source: Source | None) -> Source:
    """The source of a local step that runs only when opening succeeded (else it is skipped)."""
    assert source is not None
    return source


def _loaded(
    c: Call,
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    source: Source,
    plan: _Plan,
    optimizer: Any,
    verify: str | None,
    expect: str | None,
    sentinel: bool,
    key_map: matching.KeyMap | None,
    group: Any,
    convert: Any = None,
) -> Report:
    comm = c.comm
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
    work = c.step(
        f"pairing {path} with the model",
        lambda: _pair(model, optimizer, info, source, key_map, convert),
    )
    writes: list[Any] = []
    conv = work.conv
    if conv is not None:
        # Model tensors through the conversion: each rank reads the regions its own pieces
        # name, and every rank agrees the reads succeeded; they are written with the rest.
        items = work.match.items
        writes = c.step(
            f"reading {path}",
            lambda: converted_reads(work.source, items, conv, work.values, comm.world),
        )
    # Sentinels go in once everything that can fail before the first write has passed
    # (NOTE: [check before writing] in sources/safe_reader): a refused load leaves the model
    # as it was, not full of sentinels. The converted pieces are written then too, after them.
    marked: list[Any] = []
    wrote: list[bool] = []

    def fill() -> None:
        if wrote:
            return
        wrote.append(True)
        if sentinel:
            marked.extend(fill_sentinel(model, optimizer))
        write_in_place(writes)

    first_write = fill if sentinel or writes else None
    if info.kind == "sharded":
        _load_dcp(work, group, c, first_write)
        if conv is not None:  # DCP may have had nothing to read (every model tensor converted)
            c.step("writing the converted tensors", fill)  # a no-op where it wrote
    else:
        # Reading is local and may fail on one rank: agree on it before torch's collectives.
        full, osd = c.step(f"reading {path}", lambda: _read_full(work))
        if first_write is not None:
            c.step("sentinel", first_write)
        with comm.foreign(f"setting the model's shards from {path}"):
            _apply_full(work, full, osd)
    notes = [f"loaded {info.description} as a {info.kind} checkpoint", *info.notes]
    paired_notes, paired_findings, rows = _pairing_everywhere(c, work.match)
    notes += paired_notes
    findings = unwritten(marked, c) if sentinel else []
    findings += paired_findings
    report: Report
    manifest = plan.manifest
    if verify == "fingerprint" and manifest is None:
        notes.append("no usable manifest: verify='fingerprint' fell back to verify='full'")
        verify = "full"
    if verify == "fingerprint":
        assert manifest is not None
        report = check_against_manifest(
            model, manifest, path, optimizer=optimizer, group=group, convert=convert
        )
    elif verify == "full":
        report = verify_full(
            model, source, optimizer=optimizer, key_map=key_map, group=group, convert=convert
        )
        report.reference = str(path)
    else:
        report = Report(reference=str(path), world_size=comm.world)
        notes.append("not verified (verify=None)")
    report.findings = normalized(findings + report.findings)
    report.notes = notes + [n for n in report.notes if n not in notes]
    if not report.mapping:
        report.mapping = rows
    return report


def _pairing_everywhere(
    c: Call, m: matching.LiveMatch
) -> tuple[list[str], list[Finding], list[MappingRow]]:
    """What load's pairing found, the same on every rank.

    Every rank paired its own keys. When the ranks hold the same keys that is the job's pairing;
    under pipeline stages each stage's differs, and a checkpoint key another stage holds is
    not "unexpected": only what a rank lacks (missing) is kept, with the rank, and the mapping is
    left to the check that follows (which pairs the job's keys).
    """
    groups, past = c.gather("agreeing on what the pairing found", (m.notes, m.findings, m.rows))
    if len(groups) == 1 and not past:
        return list(m.notes), list(m.findings), list(m.rows)
    notes: list[str] = []
    findings: list[Finding] = []
    for g in groups:
        notes += [n for n in g.payload[0] if n not in notes]
        for f in g.payload[1]:
            if f.kind != "unexpected":
                findings.append(replace(f, rank=g.ranks[0], ranks=list(g.ranks)))
    return notes, findings, []


def _preflight(path: str | os.PathLike[str], source: Source) -> _Plan:
    """Recognises the checkpoint and checks its structure; raises on anything wrong."""
    from fsdpcheck.sources.dcp.source import DCPSource

    info = source.parts()[0].checkpoint or describe_path(path)
    manifest = read_manifest(info.path) if info.layout == "fsdpcheck" else None
    stale = None
    if manifest is not None:  # the digests of the .metadata files this source read already
        read = {p.path: p.metadata_digest for p in source.parts() if isinstance(p, DCPSource)}
        stale = stale_reason(info.path, manifest, read)
    if stale is not None:  # it describes an earlier save: checked against, it would only mislead
        info.notes.append(f"{stale}; not used")
        manifest = None
    if info.kind == "sharded" and not all(is_dcp_dir(p) for p in info.paths):
        raise CheckpointError(
            f"{info.path}: a sharded checkpoint whose parts are not all DCP directories "
            f"({', '.join(p.name for p in info.paths)}); fsdpcheck cannot load it as one"
        )
    refuse_problems(source, info.path, "load it: nothing was loaded")
    if manifest is not None:
        _manifest_agrees(manifest, source, info.path)
    return _Plan(info, manifest)


def _same_checkpoint(c: Call, path: str | os.PathLike[str], plan: _Plan | None) -> None:
    """Refuses, on every rank alike, ranks that were given different checkpoints.

    Ranks may load copies of one checkpoint from different paths, but a full checkpoint on one
    rank and a sharded one on another would take different collectives, and wait for each
    other forever: every rank compares what it found before anything else happens (one
    all-reduce when they agree; each different answer travels once when they do not), and a
    failure on any rank (opening, the structure check) ends the call here on every rank.
    """
    m = plan.manifest if plan is not None else None
    mine = (
        (
            plan.info.kind,
            plan.info.layout,
            [_relative(p, plan.info.path) for p in plan.info.paths],
            # Which save the manifest belongs to, in a few words (not its entries: 10**6 keys).
            None if m is None else (m.created, len(m.entries), sorted(m.saves.items())),
        )
        if plan is not None
        else None
    )
    described = plan.info.description if plan is not None else ""
    groups = c.exchange(
        f"checking {path} before loading", (str(path), described, mine), word=digest(mine)
    )
    if len(groups) > 1:
        found = "; ".join(f"{_few(g.ranks)}: {g.payload[0]} ({g.payload[1]})" for g in groups)
        raise CheckpointError(
            f"the ranks were given different checkpoints to load ({found}); every rank must "
            "load the same checkpoint (nothing was loaded)"
        )


def _relative(part: Any, root: Any) -> str:
    """Where a part lies in its checkpoint (local, or in an object store)."""
    if isinstance(part, RemotePath):
        return part.relative(root) if isinstance(root, RemotePath) else str(part)
    return os.path.relpath(part, root)


def _few(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {ranks}" if len(ranks) <= 8 else f"ranks {ranks[:8]} and {len(ranks) - 8} more"


def _manifest_agrees(manifest: Manifest, source: Source, where: object) -> None:
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


@dataclass
class _Work:
    """The live state dicts to load into, paired with the checkpoint (local, per rank).

    One entry per model part in `parts`, `optimizers`, `msds` and `osds` (one part for a plain
    model; several for the pipeline stages a rank runs). The merged `osd` holds the same tensors
    and group dicts as the parts' ``osds``.
    """

    info: CheckpointInfo
    parts: list[Any]
    optimizers: list[Any]
    source: Source
    match: matching.LiveMatch
    msds: list[dict[str, Any]]
    osds: list[Any]
    osd: Any  # torch's optimizer state dict (FQN-keyed) of every part, or None
    raw: dict[str, str]  # canonical model name -> the model state dict's own key
    raw_param: dict[str, str]  # canonical parameter -> the optimizer state dict's own key
    hparams: dict[str, Any]  # the paired param groups' saved hyperparameters, by key
    conv: Conversion | None = None  # the model tensors are loaded through it (when given)
    values: dict[str, Any] = field(default_factory=dict)  # live tensors of its sources


def _pair(
    model: Any,
    optimizer: Any,
    info: CheckpointInfo,
    source: Source,
    key_map: Any,
    convert: Any = None,
) -> _Work:
    """The live state (optimizer state created if it has none) paired with the checkpoint.

    Through a conversion, the model's names are the conversion's targets (compiled from this
    rank's names and global shapes), and the model tensors are not handed to torch's loaders.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    parts = model_parts(model)
    if parts is None:
        raise TypeError(f"model must be an nn.Module or a list of them, not {type(model).__name__}")
    keys = checkpoint_keys(source)
    conv = None
    convert = stated_or_declared(model, convert)
    if convert is not None:
        names = live_state(parts)
        other = set(keys.model) | {r.key for r in keys.rows}
        conv = compile_for_live(convert, names.names_only(), other, buffer_names(names))
    # Through a conversion the live layout is read as it is held (``live_state``).
    msds = [get_model_state_dict(p) for p in parts] if conv is None else None
    opts: list[Any] = []
    osds: list[Any] = []
    osd = None
    if optimizer is not None and keys.state:
        optimizers = inner_optimizers(optimizer)
        if len(parts) == 1:
            opts = [optimizers[0] if len(optimizers) == 1 else tuple(optimizers)]
        elif len(optimizers) == len(parts):
            opts = list(optimizers)
        else:
            raise ValueError(
                f"{len(parts)} model parts but {len(optimizers)} optimizers: pass one "
                "optimizer per part, in the same order (torchtitan's OptimizersContainer does)"
            )
        # Creates the state of an optimizer that has none (a step at lr 0: no weight
        # changes); the load then overwrites it.
        osds = [get_optimizer_state_dict(p, o) for p, o in zip(parts, opts)]
        osd = {
            "state": {k: v for o in osds for k, v in o["state"].items()},
            "param_groups": [g for o in osds for g in o["param_groups"]],
        }
    live = live_state(parts, osd, model_state=msds)
    job = live if conv is None else converted_state(live, conv)
    m = matching.match_live(job, keys, read_objects=source.read_objects, key_map=key_map)
    raw: dict[str, str] = {}
    for part, msd in zip(parts, msds or []):
        canon = model_canonicalizer(part)
        raw.update({canon(k): k for k in msd})
    canon = model_canonicalizer(parts[0]) if len(parts) == 1 else (lambda n: n)
    raw_param = {canon(str(k)): str(k) for k in (osd or {}).get("state", {})}
    # Read here, where a failure is agreed on by every rank, not between DCP's collectives.
    wanted = [e.key for g in m.groups if g.ckpt for n, e in g.ckpt.items() if n != "params"]
    hparams = source.read_objects(wanted) if wanted and osd is not None else {}
    values = {**live.model, **live.buffers} if conv is not None else {}
    return _Work(info, parts, opts, source, m, msds or [], osds, osd, raw, raw_param, hparams,
                 conv, values)  # fmt: skip


def _load_dcp(
    w: _Work, group: Any, c: Call, before_writing: Callable[[], None] | None = None
) -> None:
    """DCP loads into the live tensors in place, each into its paired checkpoint entry.

    The state dict handed to DCP is built from the pairs: each live tensor (a model tensor from
    ``get_model_state_dict``, an optimizer state tensor from ``get_optimizer_state_dict``) at
    its checkpoint entry's own path, so the checkpoint's nesting and spelling (``model.``,
    ``optimizer.state.<fqn>.<name>``, ``_forward_module.``, integer ids) never matter.

    Every rank checks everything it will read before any rank writes a byte (NOTE: [check
    before writing] in ``sources/safe_reader``): a load refused there leaves the model as it
    was. A checkpoint of several parts is checked part by part, so a later part refused leaves
    the earlier ones loaded, and the error names them; a failure while writing names the keys
    that were written.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fsdpcheck.sources.dcp.load import SafeFileSystemReader, SafeLoadPlanner
    from fsdpcheck.sources.dcp.source import DCPSource

    def plan() -> tuple[list[Any], list[dict[str, Any]]]:
        parts = w.source.parts()
        owner = {key: i for i, part in enumerate(parts) for key in part.entries()}
        entries = w.source.entries()
        states: list[dict[str, Any]] = [{} for _ in parts]
        tied = {row.a for row in w.match.rows if row.status == "tied"}
        for item in w.match.items:
            if item.key in tied or isinstance(item.value, Target):
                continue  # the same tensor as the parameter it is tied to; loaded converted
            _put(states[owner[item.ckpt_key]], entries[item.ckpt_key].path, item.value)
        return parts, states

    def agreed(step: str, fn: Callable[[], None]) -> None:
        # Inside DCP's load, between its collectives: the same verdict on every rank.
        try:
            c.step(step, fn)
        except RankFailure as f:
            raise f.failure.error() from None

    parts, states = c.step("preparing DCP's load", plan)
    loaded: list[str] = []  # the parts loaded whole, and their keys
    for i, (where, state) in enumerate(zip(w.info.paths, states)):
        # Every rank makes the same DCP calls in the same order (a rank with nothing to load
        # from a part still takes part in its collectives).
        part = parts[i]
        # The metadata parsed when opening (not read again), checked as it was then.
        reader = (
            part.dcp_reader()
            if isinstance(part, DCPSource)
            else SafeFileSystemReader(cast(Path, where))
        )
        reader.agree = lambda check: agreed("the check before writing into the model", check)
        if i == 0 and before_writing is not None:
            reader.before_writing = functools.partial(agreed, "sentinel", before_writing)
        try:
            with c.comm.foreign(f"DCP reading {where}"):
                dcp_load(
                    state,
                    storage_reader=reader,
                    planner=SafeLoadPlanner(),
                    process_group=group,
                    no_dist=not c.comm.enabled,
                )
        except BaseException as exc:  # torch's CheckpointException derives from BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit, RankStoppedError)):
                raise
            left = _what_was_written(exc, loaded, c.comm.world)
            raise CheckpointError(
                f"loading {where} failed: {_first_failure(exc)}; {left}"
            ) from None
        keys = sorted(_flat_keys(state))
        loaded.append(f"{where.name} ({len(keys)} keys: {_few_keys(keys)})")

    def apply() -> None:
        for part, msd in zip(w.parts, w.msds):
            set_model_state_dict(part, msd)
        if w.osd is not None:
            _set_hparams(w)
            for part, opt, osd in zip(w.parts, w.optimizers, w.osds):
                set_optimizer_state_dict(part, opt, osd)

    # A failure here is this rank's, kept for the next agreement (what the pairing found).
    c.local("setting the loaded state", apply)


def _set_hparams(w: _Work) -> None:
    """Hyperparameters of each live param group from the checkpoint group paired with it."""
    saved = w.hparams
    groups = w.osd["param_groups"]
    for g in w.match.groups:
        if g.ckpt is None or g.index >= len(groups):
            continue
        for name, entry in g.ckpt.items():
            if name not in ("params", "param_names") and name in groups[g.index]:
                groups[g.index][name] = saved[entry.key]


def _what_was_written(exc: BaseException, loaded: list[str], world: int) -> str:
    """What a failed DCP load left in the model, in words the same on every rank."""
    from fsdpcheck.sources.dcp.load import PartlyWrittenError

    _, cause = root_cause(exc)
    if isinstance(cause, PartlyWrittenError):  # its message names what that rank wrote
        said = "the model is partly overwritten"
        if world > 1:
            said = f"the ranks that did not fail wrote all of theirs: {said}"
    elif not loaded:
        return "nothing was written into the model (it is as it was)"
    else:
        said = "nothing of it was written into the model"
    if loaded:
        said += f"; loaded before it (so the model is partly overwritten): {'; '.join(loaded)}"
    return said + "; load again once the checkpoint is repaired"


def _flat_keys(state: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in state.items():
        if isinstance(v, dict):
            out += _flat_keys(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def _few_keys(keys: list[str]) -> str:
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _first_failure(exc: BaseException) -> str:
    """One line: the first failing rank's error inside torch's CheckpointException."""
    from fsdpcheck.sources.dcp.load import NothingWrittenError

    rank, cause = root_cause(exc)
    if isinstance(cause, NothingWrittenError):  # agreed by every rank: it names the rank
        return describe_error(cause)
    return (f"on rank {rank}: " if rank is not None else "") + describe_error(cause)


def _put(state: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    d = state
    for part in path[:-1]:
        d = d.setdefault(part, {})
    d[path[-1]] = value


def _read_full(w: _Work) -> tuple[dict, dict | None]:
    """The paired entries of a full checkpoint, whole, on the CPU; local I/O only."""
    entries = w.source.entries()
    cpu = torch.device("cpu")
    full: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for item in w.match.items:
        if isinstance(item.value, Target):
            continue  # loaded through the conversion
        e = entries[item.ckpt_key]
        (value,) = w.source.read([_whole(e)], cpu)
        if item.is_param_state:
            name = item.key.rsplit(".", 1)[1]
            state.setdefault(w.raw_param.get(item.fqn, item.fqn), {})[name] = value
        else:
            full[w.raw.get(item.key, item.key)] = value
    osd = None
    if w.osd is not None:
        _set_hparams(w)
        osd = {"state": state, "param_groups": w.osd["param_groups"]}
    return full, osd


def _apply_full(w: _Work, full: dict, osd: dict | None) -> None:
    """Each rank keeps its shards of the full state (collective inside torch)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)
    for part, msd in zip(w.parts, w.msds):  # none through a conversion
        mine = {k: v for k, v in full.items() if k in msd}
        set_model_state_dict(part, cast(Any, mine), options=options)
    if osd is not None:
        for part, opt, own in zip(w.parts, w.optimizers, w.osds):
            mine = {
                "state": {k: v for k, v in osd["state"].items() if k in own["state"]},
                "param_groups": own["param_groups"],
            }
            set_optimizer_state_dict(part, opt, mine, options=options)


def _whole(entry: Any) -> Region:
    return Region(entry.key, (0,) * len(entry.shape), tuple(entry.shape))


def check_against_manifest(
    model: Any,
    manifest: Manifest,
    where: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    group: Any = None,
    convert: Any = None,
    timeout: float | None = None,
) -> Report:
    """The live state against a manifest: one fingerprint pass, a few all-reduces, no file read.

    Collective. Optimizer entries are checked only when `optimizer` is given; through
    `convert`, the live model's fingerprints are those of the converted layout. Whether an
    optimizer is given and which manifest (its save) must be the same on every rank.
    """
    with call("check_against_manifest", group, timeout) as c:
        c.arguments(
            optimizer=given(optimizer),
            manifest=(manifest.created, len(manifest.entries), sorted(manifest.saves.items())),
        )
        result = fingerprint_report(model, optimizer=optimizer, group=group, convert=convert)
        if result.failure is not None:  # the pass ended on every rank: its one finding
            return Report(
                findings=result.findings,
                reference=f"the manifest of {where}",
                world_size=c.comm.world,
                side_b="manifest",
            )
        expected = {
            k: fp
            for k, fp in manifest.fingerprints().items()
            if optimizer is not None or not k.startswith("optim.")
        }
        return Report(
            findings=fingerprints_differ(expected, result.fingerprints) + result.findings,
            reference=f"the manifest of {where}",
            world_size=c.comm.world,
            keys_checked=len(expected),
            keys_a=len(result.fingerprints),
            keys_b=len(expected),
            side_b="manifest",
        )
