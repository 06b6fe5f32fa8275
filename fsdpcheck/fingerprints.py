"""Layout-independent fingerprints of a live model and of a checkpoint on disk.

Fingerprint v1 (docs/fingerprint-v1.md) of a tensor is the sum over its elements of a hash of
(global index, raw bits), so the fingerprints of the boxes that tile it add up to the whole
tensor's: each rank hashes the shards it holds in one fused pass, replicated copies are counted
once, and the result is the same whatever the world size, mesh, placements or device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fsdpcheck import _collector, matching, offline_dist, ops
from fsdpcheck.errors import FingerprintError
from fsdpcheck.kernels import MASK64, SUPPORTED_DTYPES, fingerprint_tensors
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.manifest import read_manifest
from fsdpcheck.reading.references import open_source
from fsdpcheck.report import Finding, Report, normalized, uncovered
from fsdpcheck.sources import Source, refuse_problems
from fsdpcheck.sources.prefetch import Prefetcher, batch_bytes
from fsdpcheck.sources.remote import RemotePath, location
from fsdpcheck.tolerances import checked_budget, checked_patterns

if TYPE_CHECKING:
    from fsdpcheck.convert import Conversion
    from fsdpcheck.dist.runner import Failure
    from fsdpcheck.layout import Layout, Meta

# The live side (collectives, layouts, the model walk, torch.distributed) is imported where it
# is used: fingerprinting a checkpoint on disk needs none of it (~7 ms of a command's start).


@dataclass
class FingerprintResult:
    """Fingerprints of every key, and what is wrong with the copies that should agree.

    Attributes:
        fingerprints: Key -> Fingerprint v1 (an int in [0, 2**64)), identical on every rank.
        findings: "replica" findings (copies of the same box that differ, with their ranks),
            "layout" findings (values that could not be fingerprinted) and "error" findings.
        layouts: This rank's Layout of every key (global shape, dtype, placements), as the
            pass computed them, for callers that describe the keys too (the save manifest).
        tied: Tied duplicate name -> the name it is listed under (tied parameters count once).
        order: The optimizer's parameters in param_groups order (maps the integer ids of a raw
            ``optimizer.state_dict()`` a checkpoint holds), empty without one.
        metas: Global shape and dtype of every key of the job (pipeline stages: also the keys
            other ranks hold), for callers that describe the keys (the save manifest).
        failure: The failure that ended the pass on every rank (``dist.runner``; its one
            finding is in `findings`), or None.
    """

    fingerprints: dict[str, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    layouts: dict[str, Layout] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    metas: dict[str, Meta] = field(default_factory=dict)
    failure: Failure | None = None


def fingerprint(
    model_or_state_dict: torch.nn.Module | Sequence[torch.nn.Module] | Mapping[str, Any],
    *,
    optimizer: Any = None,
    group: Any = None,
    convert: Any = None,
    timeout: float | None = None,
) -> dict[str, int]:
    """Fingerprint v1 of every model (and optimizer) entry, identical on every rank.

    Collective: every rank of `group` calls it. The same model content gives the same dict on 1
    rank, on N ranks under FSDP2, on a 2D FSDP+TP mesh, and on CUDA. Replicated copies count
    once (the lowest rank's); use ``check_replicas`` to see whether they agree. Keys are
    canonical names (wrapper prefixes removed), and a tied parameter is listed once, under its
    first name in ``named_parameters()`` order, as Hugging Face's ``save_pretrained`` keeps it.
    Nothing live is changed (an optimizer's state is read as it is, never initialised).

    Args:
        model_or_state_dict: An nn.Module or a state dict of DTensors / ShardedTensors / tensors.
        optimizer: An optimizer (with a module) or an FQN-keyed optimizer state dict.
        group: The process group (default: the default group, or none).
        convert: A conversion of the model's layout (``fsdpcheck.convert``): the fingerprints
            are then those of the converted layout (each rank hashes the parts of the converted
            tensors its shards hold at their converted global indices; no data moves), equal to
            ``fingerprint_checkpoint`` of a converted file. None: the model's own declared
            conversion, if any.
        timeout: Seconds a rank waits in one collective for the others before it names the
            ranks that did not answer (default: the process group's timeout).

    Whether an optimizer is given and `convert` must be the same on every rank (compared in
    the first collective).

    Returns:
        Key -> fingerprint, sorted; optimizer entries are keyed ``optim.state.<fqn>.<name>``.

    Raises:
        FingerprintError: On every rank, when a value cannot be fingerprinted, or any rank
            failed (the message names it).
        RankStoppedError: A rank stopped answering, on every rank that still answers.
    """
    result = fingerprint_report(
        model_or_state_dict, optimizer=optimizer, group=group, convert=convert, timeout=timeout
    )
    if result.failure is not None:  # agreed on by every rank: its one line
        raise FingerprintError(result.failure.text)
    bad = [f for f in result.findings if f.kind in ("layout", "error", "missing", "gap")]
    if bad:
        raise FingerprintError("; ".join(f"{f.key}: {f.message}" for f in bad))
    return result.fingerprints


def check_replicas(
    model_or_state_dict: torch.nn.Module | Sequence[torch.nn.Module] | Mapping[str, Any],
    *,
    optimizer: Any = None,
    group: Any = None,
    timeout: float | None = None,
) -> Report:
    """Whether every replicated copy (HSDP, TP Replicate, DDP, the optimizer step) agrees.

    Collective. Returns a Report whose "replica" findings name the ranks that disagree.
    """
    from fsdpcheck.dist.runner import call

    with call("check_replicas", group, timeout) as c:
        result = fingerprint_report(model_or_state_dict, optimizer=optimizer, group=group)
        return Report(
            findings=result.findings,
            reference="the other replicas",
            world_size=c.comm.world,
            keys_checked=len(result.fingerprints),
        )


def fingerprint_report(
    model_or_state_dict: torch.nn.Module | Sequence[torch.nn.Module] | Mapping[str, Any],
    *,
    optimizer: Any = None,
    group: Any = None,
    convert: Any = None,
    timeout: float | None = None,
) -> FingerprintResult:
    """Fingerprints and replica findings in one pass (see ``fingerprint``).

    Collective, with O(keys) bytes per rank at any world size (NOTE: [bytes per rank] in
    ``collectives``): the ranks agree on the job's keys (pipeline stages may hold different
    ones) and on the arguments, each rank fingerprints the boxes it holds in one fused pass,
    the local findings travel with a digest of the keys each rank will combine (the result of a
    conversion), and one row per key is all-reduced: the fingerprint is the sum of the counted
    copies (each box once), the replica check compares every copy with them, and the counted
    copies must cover each key exactly. A failure on any rank is the result's one "error"
    finding on every rank (``dist.runner``).
    """
    from fsdpcheck.dist.runner import RankFailure, call

    with _collector.paused(), call("fingerprint", group, timeout) as c:  # NOTE: [collector]
        try:
            return _fingerprint_report(c, model_or_state_dict, optimizer, convert)
        except RankFailure as f:
            if f.failure.usage:  # arguments: raised, as any call raises a usage error
                raise f.failure.error() from None
            return FingerprintResult(findings=[f.failure.finding()], failure=f.failure)


def _fingerprint_report(
    c: Any,
    model_or_state_dict: torch.nn.Module | Sequence[torch.nn.Module] | Mapping[str, Any],
    optimizer: Any,
    convert: Any = None,
) -> FingerprintResult:
    from fsdpcheck.keyset import agree_keys
    from fsdpcheck.layout import local_layout
    from fsdpcheck.live import live_state
    from fsdpcheck.stats import KeyStats

    comm = c.comm

    from fsdpcheck.dist.arguments import given
    from fsdpcheck.dist.runner import ARGUMENTS

    def setup() -> Any:
        from fsdpcheck.convert.declared import stated_or_declared

        c.arguments(optimizer=given(optimizer), convert=convert)
        return stated_or_declared(model_or_state_dict, convert)

    convert = c.local(ARGUMENTS, setup)
    live = c.local("reading the live state", lambda: live_state(model_or_state_dict, optimizer))
    ks = agree_keys(c, live)
    assert live is not None
    result = FingerprintResult()
    if convert is not None:
        converted = _converted_fingerprints(c, ks, live, convert, result)
        if converted is not None:
            return converted
    result.tied = dict(ks.live.tied)
    result.order = [fqn for g in ks.live.param_groups or [] for fqn in g["params"]]
    job = ks.live.tensors(dedupe_tied=True)
    keys = sorted(job)
    result.metas = {k: job[k] for k in keys}
    stats = [KeyStats() for _ in keys]
    local: list[Finding] = []

    def hash_shards() -> None:
        local.extend(Finding(k, kind, msg) for k, kind, msg in live.problems)
        mine = live.tensors(dedupe_tied=True)
        tensors, boxes, owners = [], [], []
        for i, key in enumerate(keys):
            value = mine.get(key)
            if value is None:
                continue  # another stage's key
            lay = result.layouts[key] = local_layout(value, comm.world)
            if lay.error is not None:
                local.append(Finding(key, "layout", lay.error))
                stats[i].errors = 1
                continue
            if lay.dtype not in SUPPORTED_DTYPES:
                local.append(Finding(key, "layout", f"dtype {lay.dtype} cannot be fingerprinted"))
                stats[i].errors = 1
                continue
            stats[i].holders, stats[i].owner = 1, lay.owner
            stats[i].mesh_ranks = lay.mesh_ranks
            if lay.pieces:
                stats[i].fp = 0  # a copy, even of an empty box (its fingerprint is 0)
            for piece in lay.pieces:
                tensors.append(piece.tensor)
                boxes.append(piece.box)
                owners.append(i)
        fps = fingerprint_tensors(tensors, boxes=boxes) if tensors else []
        for i, box, fp, t in zip(owners, boxes, fps, tensors):
            stats[i].add_copy(fp, box, t.numel())

    # A failure here is kept for the next agreement (the findings), where it ends the call.
    c.local("fingerprinting the shards", hash_shards)
    numels = [math.prod(job[k].shape) for k in keys]
    return _combined(c, ks, keys, numels, stats, local, "", result)


def _combined(
    c: Any,
    ks: Any,
    keys: list[str],
    numels: list[int],
    stats: list[Any],
    local: list[Finding],
    conv: str,
    result: FingerprintResult,
) -> FingerprintResult:
    """The findings gathered (with what each rank combines), the rows combined, the verdicts.

    The local findings travel first, with a digest of the keys this rank combines (and of the
    conversion that made them): ranks that would combine rows of different keys end there,
    before the rows (whose size is the number of keys) travel.
    """
    from fsdpcheck.collectives import Group as _Group
    from fsdpcheck.collectives import capped_findings, combine, digest, findings_of

    plan = digest((conv, keys))
    groups, past = c.gather(
        "gathering the findings",
        capped_findings(local),
        same=plan,
        same_what="the keys they fingerprint (the result of convert=)",
    )
    found = findings_of([_Group(g.ranks, g.payload) for g in groups], past)
    combined, _ = combine(c.comm, stats, numels=numels)
    findings = list(ks.findings) + found
    for key, n, cb in zip(keys, numels, combined):
        if cb.errors or cb.fingerprint is None:
            continue
        if cb.replicas_disagree:
            findings.append(Finding.replica(key, cb.replica_groups))
        if cb.covered != n:
            findings.append(uncovered(key, cb.covered, cb.held_by, n, "parts"))
            continue
        result.fingerprints[key] = cb.fingerprint
    result.findings = normalized(findings)
    return result


def _converted_fingerprints(
    c: Any, ks: Any, live: Any, convert: Any, result: FingerprintResult
) -> FingerprintResult | None:
    """``fingerprint`` through a conversion: the parts of the targets each rank holds, hashed.

    Every rank compiles the conversion from the job's names and global shapes (the same
    everywhere, or a failure agreed on at the next agreement), hashes the parts of each target
    its shards hold at the target's global indices, and the sums are combined as for any key: a
    target's fingerprint is that of the converted tensor. None: the model's declared layout is
    the live one (nothing to convert).
    """
    from fsdpcheck.layout import Meta
    from fsdpcheck.reading.live import (
        buffer_names,
        compile_for_live,
        local_parts,
        source_layouts,
        tied_targets,
    )
    from fsdpcheck.reading.plan import cast_as, kernel_box
    from fsdpcheck.stats import KeyStats

    comm = c.comm
    conv = c.local(
        "compiling the conversion",
        lambda: compile_for_live(convert, ks.live, buffers=buffer_names(live)),
    )
    if c.failed:  # failed here: the agreement below ends the call on every rank
        c.check("compiling the conversion")
    if conv is None:  # compiled from agreed names: None on every rank alike
        return None
    local: list[Finding] = []
    broken = conv.target_problems()  # compiled from the job's names: the same on every rank
    state = {k: v for k, v in ks.live.tensors().items() if k.startswith("optim.state.")}
    # A tied duplicate is listed once, under its first name (as without a conversion).
    tied = tied_targets(conv, ks.live.tied)
    keys = sorted((set(conv.targets) - set(tied)) | set(state))
    result.metas = {k: state[k] for k in state}
    result.metas.update(
        {k: Meta(t.shape, t.dtype) for k, t in conv.targets.items() if k not in tied}
    )
    stats = [KeyStats() for _ in keys]
    shapes = {k: v[0] for k, v in conv.sources.items()}
    cache: dict[str, Any] = {}

    def hash_targets() -> None:
        local.extend(Finding(k, kind, msg) for k, kind, msg in live.problems)
        local.extend(Finding(name, "gap", why) for name, why in broken.items())
        values = live.tensors()
        tensors: list[torch.Tensor] = []
        boxes: list[Any] = []
        owners: list[int] = []
        casts: list[tuple[int, torch.Tensor, Any]] = []
        for i, key in enumerate(keys):
            t = conv.targets.get(key)
            if t is None:  # optimizer state: hashed as it is
                value = values.get(key)
                if value is None:
                    continue
                lay = result.layouts[key] = local_layout_of(value, comm.world)
                if lay.error is not None or lay.dtype not in SUPPORTED_DTYPES:
                    local.append(Finding(key, "layout", lay.error or f"dtype {lay.dtype}"))
                    stats[i].errors = 1
                    continue
                stats[i].holders, stats[i].owner, stats[i].mesh_ranks = 1, lay.owner, lay.mesh_ranks
                if lay.pieces:
                    stats[i].fp = 0
                for piece in lay.pieces:
                    tensors.append(piece.tensor)
                    boxes.append(piece.box)
                    owners.append(i)
                continue
            if key in broken:
                stats[i].errors = 1
                continue
            layouts, err = source_layouts(t, values, comm.world, cache)
            if err is not None:
                local.append(Finding(key, "layout", err))
                stats[i].errors = 1
                continue
            if not layouts:
                continue  # another stage's
            if getattr(torch, t.dtype) not in SUPPORTED_DTYPES:
                local.append(Finding(key, "layout", f"dtype {t.dtype} cannot be fingerprinted"))
                stats[i].errors = 1
                continue
            first = next(iter(layouts.values()))
            stats[i].holders, stats[i].owner = 1, first.owner
            stats[i].mesh_ranks = first.mesh_ranks
            stats[i].fp = 0
            for view, q in local_parts(t, layouts, shapes, _CAST_BLOCK, for_reading=False):
                if q.cast:
                    casts.append((i, view, q))
                    continue
                tensors.append(view)
                boxes.append(kernel_box(q))
                owners.append(i)
        fps = fingerprint_tensors(tensors, boxes=boxes) if tensors else []
        for i, box, fp, tensor in zip(owners, boxes, fps, tensors):
            stats[i].add_copy(fp, box, tensor.numel())
        # Parts that are cast: hashed a batch of copies at a time, never all at once.
        for batch in _by_bytes(casts, _CAST_BLOCK):
            views = [cast_as(v, q) for _, v, q in batch]
            got = fingerprint_tensors(views, boxes=[kernel_box(q) for _, _, q in batch])
            for (i, _, q), fp in zip(batch, got):
                stats[i].add_copy(fp, kernel_box(q), q.numel)

    # A failure here is kept for the next agreement (the findings), where it ends the call.
    c.local("fingerprinting the converted shards", hash_targets)
    numels = [
        math.prod(conv.targets[k].shape if k in conv.targets else state[k].shape) for k in keys
    ]
    return _combined(c, ks, keys, numels, stats, local, conv.digest(), result)


#: Elements of copies a cast part of a live fingerprint makes at once, at most.
_CAST_BLOCK = 1 << 25


def _by_bytes(items: list[tuple[int, torch.Tensor, Any]], most: int) -> list[list[Any]]:
    """Consecutive runs of (pair, view, piece) of at most `most` elements each."""
    out: list[list[Any]] = []
    held = 0
    for it in items:
        n = it[2].numel
        if not out or held + n > most:
            out.append([])
            held = 0
        out[-1].append(it)
        held += n
    return out


def local_layout_of(value: Any, world: int) -> Layout:
    """``layout.local_layout`` (imported where used: offline fingerprints need none of it)."""
    from fsdpcheck.layout import local_layout

    return local_layout(value, world)


# -------------------------------------------------------------------------------------------
def fingerprint_checkpoint(
    path: Any,
    *,
    ignore: Sequence[str] | None = None,
    memory_budget: int = 1 << 30,
    convert: Any = None,
    session: offline_dist.Session | None = None,
) -> dict[str, int]:
    """The fingerprints of a checkpoint's model and optimizer tensors, offline (no process group).

    Streams the checkpoint under `memory_budget` bytes: a DCP directory chunk by chunk (each
    chunk hashed at its global offset), a torch.save file or safetensors in row blocks. Keys are
    the canonical names ``fingerprint`` gives the same tensors (model FQNs with the checkpoint's
    containers and wrapper prefixes removed, ``optim.state.<fqn>.<name>``), so the same content
    gives the same dict. Training state (lr_scheduler, dataloader, train_state) is not included;
    ``checkpoint_fingerprints`` also says what was left out.

    Args:
        path: Any checkpoint ``fsdpcheck.describe_path`` recognises, or an in-memory mapping.
        ignore: fnmatch patterns of names or checkpoint keys to leave out.
        memory_budget: Bytes of checkpoint data held at once.
        convert: A conversion of the checkpoint's model tensors (``fsdpcheck.convert``): the
            fingerprints are then those of the converted layout, each piece hashed at its
            converted global indices (equal to ``fingerprint_checkpoint`` of the converted
            file); its optimizer state is hashed as it is.
        session: The processes of a torchrun launch to spread the reading over
            (``offline_dist.session``); None: this process alone.

    Returns:
        Canonical name -> fingerprint, sorted by name.
    """
    return checkpoint_fingerprints(
        path, ignore=ignore, memory_budget=memory_budget, convert=convert, session=session
    )[0]


def checkpoint_fingerprints(
    path: Any,
    *,
    ignore: Sequence[str] | None = None,
    memory_budget: int = 1 << 30,
    convert: Any = None,
    session: offline_dist.Session | None = None,
) -> tuple[dict[str, int], list[str]]:
    """``fingerprint_checkpoint`` and notes naming every tensor it did not fingerprint.

    With a `session` (the processes of a torchrun launch: ``offline_dist``) each process hashes
    its share of the chunks and the sums are added up across processes: every process returns
    the same dict.
    """
    memory_budget = checked_budget(memory_budget)
    with _collector.paused():  # NOTE: [collector]
        return _checkpoint_fingerprints(
            path, checked_patterns(ignore), memory_budget, convert, session
        )


def _checkpoint_fingerprints(
    path: Any,
    ignore: Sequence[str] | None,
    memory_budget: int,
    convert: Any = None,
    session: offline_dist.Session | None = None,
) -> tuple[dict[str, int], list[str]]:
    from fsdpcheck.sources.dcp.source import DCPSource

    request = None
    # An open DCP source (audit's, whose metadata is read and checked already) is hashed as it
    # is here; the other processes of a launch open its path.
    where = path.path if isinstance(path, DCPSource) else path
    if session is not None and isinstance(where, (str, os.PathLike, RemotePath)):
        at = str(where) if isinstance(where, RemotePath) else os.fspath(where)
        args = (at, tuple(ignore) if ignore else None, memory_budget)
        request = offline_dist.Request("fingerprint", args)
    source = open_source(path)
    try:
        world = session.world if session is not None and request is not None else 1
        job = _HashJob(source, ignore, memory_budget, world, convert)
        if request is not None and job.conv is not None:
            # The other processes compile the same conversion from its data.
            request = offline_dist.Request("fingerprint", (*request.args, job.conv.to_spec()))
        if session is not None and request is not None:
            sums = session.run(request, job)
        else:
            sums = job.measure(range(len(job.sizes())))
        out = job.fingerprints(sums)
        notes = job.notes
        tied = _manifest_ties(where)
        for dup, first in tied.items():
            if dup in out and first in out and out[dup] == out[first]:
                del out[dup]  # listed once, as ``fingerprint`` lists a tied parameter
                notes.append(f"{dup} is tied to {first}: listed once")
    finally:
        if source is not path:  # a source the caller opened is the caller's to close
            source.close()
    return dict(sorted(out.items())), notes


def serve_fingerprints(
    session: offline_dist.Session,
    path: str,
    ignore: Sequence[str] | None,
    memory_budget: int,
    convert: dict[str, Any] | None = None,
) -> _HashJob:
    """The job of fingerprints another process of the launch asked for (``offline_dist``)."""
    source = open_source(path)
    try:
        job = _HashJob(source, ignore, memory_budget, session.world, convert)
    except BaseException:
        source.close()
        raise
    job.owns_source = True
    return job


def _manifest_ties(path: Any) -> dict[str, str]:
    if not isinstance(path, (str, os.PathLike, RemotePath)):
        return {}
    p = location(path)  # a URL: its prefix in the object store
    p = p if isinstance(p, RemotePath) else Path(p)
    manifest = read_manifest(p) if p.is_dir() else None
    return manifest.tied if manifest is not None else {}


@dataclass
class _Sums:
    """Per name: the sum of its regions' fingerprints (int64 bits) and their elements."""

    fp: torch.Tensor
    numel: torch.Tensor


class _HashJob:
    """Every chunk of a checkpoint hashed at its global offset, in row blocks (a plan).

    The plan (``reading.plan.Plan``) is each tensor's saved chunks (empty ones skipped) cut into
    row blocks, the same on every process of a launch (``offline_dist.Job``); `measure` hashes
    a share of it, reading the next batch while this one is hashed. Two batches are in flight
    (NOTE: [prefetch]), so each holds at most half the budget. Per block the plan holds three
    integers; each batch is one operator call and one ``index_add`` (NOTE: [per-key costs] in
    ``comparison``).

    Through a conversion (`convert`), the model tensors are the conversion's targets: each
    target's pieces are read from the checkpoint, cast as the conversion says, and hashed at
    the target's global indices, so the sum is the target's Fingerprint v1, as the converted
    file's would be. Optimizer state is hashed as it is saved.
    """

    def __init__(
        self,
        source: Source,
        ignore: Sequence[str] | None,
        budget: int,
        world: int,
        convert: Any = None,
    ) -> None:
        from fsdpcheck.reading.plan import Plan, SourceKey

        self.source = source
        self.owns_source = False
        refuse_problems(source, source.description, "fingerprint it")
        keys = checkpoint_keys(source)
        self.notes: list[str] = []
        self.conv: Conversion | None = None
        converted: set[str] = set()
        sources: dict[str, SourceKey] = {}
        if convert is not None:
            self.conv = conv = _compile_offline(convert, keys)
            self.notes += [
                f"converted by {conv.description}: {len(conv.targets)} tensor(s) from "
                f"{len(conv.sources)}",
                *conv.notes,
            ]
            broken = conv.target_problems()
            if broken:
                name, why = next(iter(broken.items()))
                raise FingerprintError(f"{name}: {why}; its fingerprint would be wrong")
            for name, (n, _) in sorted(conv.source_unused().items()):
                self.notes.append(f"{name}: {n} element(s) are in no tensor the conversion writes")
            converted = {r.key for name, r in keys.model.items() if name in conv.sources}
            for name, (shape, dtype) in conv.sources.items():
                sources[name] = SourceKey(keys.model[name].key, shape, getattr(torch, dtype))
        by_key: dict[str, str] = {}
        other = []
        for r in keys.tensors():
            if r.key in converted:
                continue
            if r.role == "other":
                other.append(r.key)
            elif matching.is_ignored(ignore, r.name, r.key):
                self.notes.append(f"{r.key}: excluded by the user")
            else:
                by_key[r.key] = r.name
        if other:
            self.notes.append(
                f"{len(other)} training-state tensor(s) not fingerprinted: "
                + ", ".join(other[:8])
                + (", ..." if len(other) > 8 else "")
            )
        entries = source.entries()
        self.names: list[str] = []
        index: dict[str, int] = {}
        # Per pair of the plan (a checkpoint key, or a conversion's target): its own key, its
        # global shape, and the name its fingerprint adds to.
        self.keys: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.name_of: list[int] = []
        chunks: list[tuple[int, tuple[int, ...], tuple[int, ...], int]] = []
        pieces: list[tuple[int, Any, int]] = []
        for t in self.conv.targets.values() if self.conv is not None else ():
            if matching.is_ignored(ignore, t.name):
                self.notes.append(f"{t.name}: excluded by the user")
                continue
            dtype = getattr(torch, t.dtype)
            if dtype not in SUPPORTED_DTYPES:
                raise FingerprintError(f"{t.name}: dtype {t.dtype} cannot be fingerprinted")
            index[t.name] = len(self.names)
            self.names.append(t.name)
            pieces.append((self._pair(t.name, t.shape, index[t.name]), t, dtype.itemsize))
        for ckpt_key, name in by_key.items():
            entry = entries[ckpt_key]
            if entry.dtype not in SUPPORTED_DTYPES:
                raise FingerprintError(f"{ckpt_key}: dtype {entry.dtype} cannot be fingerprinted")
            i = index.get(name)
            if i is None:  # two keys of one name add up, as one tensor's chunks do
                i = index[name] = len(self.names)
                self.names.append(name)
            pair = self._pair(ckpt_key, tuple(entry.shape), i)
            itemsize = entry.dtype.itemsize  # type: ignore[union-attr]
            for offset, size in source.chunks(ckpt_key):
                if math.prod(size) == 0 and len(size) > 0:
                    continue
                chunks.append((pair, tuple(offset), tuple(size), itemsize))
        self.step = batch_bytes(budget)
        total = sum(math.prod(size) * item for _, _, size, item in chunks)
        total += sum(math.prod(t.shape) * item for _, t, item in pieces)
        self.piece = offline_dist.piece_bytes(total, world, self.step)
        self.plan = plan = Plan(sources)
        for pair, t, _ in pieces:
            plan.add_pieces(pair, t.pieces, t.shape, None, self.piece)
        for pair, offset, size, itemsize in chunks:
            plan.add_chunk(pair, offset, size, self.shapes[pair], itemsize, self.piece)

    def _pair(self, key: str, shape: tuple[int, ...], name: int) -> int:
        self.keys.append(key)
        self.shapes.append(shape)
        self.name_of.append(name)
        return len(self.keys) - 1

    # -- offline_dist.Job --------------------------------------------------------------------
    def digest(self) -> int:
        """The plan: the conversion, the names and every block (key, offset, size), the cut."""
        from fsdpcheck.collectives import digest

        return digest(
            (
                self.conv.digest() if self.conv is not None else "",
                self.piece,
                self.names,
                self.keys,
                self.plan.digest_items(),
            )
        )

    def sizes(self) -> Sequence[int]:
        """Bytes of each block."""
        return self.plan.block_bytes

    def measure(self, items: range) -> _Sums:
        """Hashes the blocks `items` of the plan (pieces at their converted global indices)."""
        n = len(self.names)
        sums = _Sums(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
        plan, keys, shapes = self.plan, self.keys, self.shapes
        source = self.source
        name_of = torch.tensor(self.name_of, dtype=torch.int64)
        reads = (
            (b, [(source, plan.regions(b, keys, shapes, "a"))])
            for b in plan.batches(items, self.step)
        )
        for batch, (tensors,) in Prefetcher(torch.device("cpu")).run(reads):
            views = plan.views(batch, tensors, shapes, "a")
            box_shapes, offsets = plan.boxes(batch, shapes)
            with torch.no_grad():
                fps = ops.fingerprint_rows(views, box_shapes, offsets).cpu()
            a, b = batch.start, batch.stop
            ids = name_of[torch.tensor(plan.block_pair[a:b], dtype=torch.int64)]
            sums.fp.index_add_(0, ids, fps)  # int64 adds wrap: the sum mod 2**64
            sums.numel.index_add_(0, ids, torch.tensor(plan.block_numel[a:b], dtype=torch.int64))
        return sums

    def combine(self, comm: Any, sums: _Sums) -> _Sums:
        """Every process's sums added up (``collectives.combine``: one row per name)."""
        return _combine_sums(comm, sums)

    def close(self) -> None:
        """Closes the checkpoint when this job opened it (a pass another process asked for)."""
        if self.owns_source:
            self.source.close()

    def fingerprints(self, sums: _Sums) -> dict[str, int]:
        """Name -> Fingerprint v1 (the sums as unsigned 64-bit ints)."""
        return {name: fp & MASK64 for name, fp in zip(self.names, sums.fp.tolist())}


def _compile_offline(convert: Any, keys: Any) -> Conversion:
    """A conversion of a checkpoint's model tensors."""
    from fsdpcheck.convert import compile_conversion

    sources = {
        name: (r.entry.shape, r.entry.dtype)
        for name, r in keys.model.items()
        if r.entry.is_tensor and r.entry.dtype is not None and r.entry.shape is not None
    }
    return compile_conversion(convert, sources)


def _combine_sums(comm: Any, sums: _Sums) -> _Sums:
    """Every process's sums added up (``collectives.combine``: one row per name)."""
    from fsdpcheck.collectives import combine
    from fsdpcheck.stats import KeyStats

    stats = []
    for fp, numel in zip(sums.fp.tolist(), sums.numel.tolist()):
        s = KeyStats()
        if numel:  # this process hashed part of it: its part counts (no replicas here)
            s.holders, s.owner, s.box = 1, True, 0
            s.fp, s.copy_numel = fp & MASK64, numel
        stats.append(s)
    combined, _ = combine(comm, stats)
    return _Sums(
        torch.tensor([_signed(c.fingerprint or 0) for c in combined], dtype=torch.int64),
        torch.tensor([c.covered for c in combined], dtype=torch.int64),
    )


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def checkpoint_key_names(source: Source) -> dict[str, str]:
    """Checkpoint key -> the canonical name ``fingerprint`` gives the same tensor."""
    keys = checkpoint_keys(source)
    return {r.key: r.name for r in keys.tensors() if r.role != "other"}


def fingerprints_differ(expected: Mapping[str, int], actual: Mapping[str, int]) -> list[Finding]:
    """Findings for keys whose fingerprints differ, or that one side lacks."""
    findings = []
    for key in sorted(set(expected) | set(actual)):
        if key not in actual:
            findings.append(Finding(key, "missing", "in the manifest but not in the model"))
        elif key not in expected:
            findings.append(Finding(key, "unexpected", "in the model but not in the manifest"))
        elif expected[key] != actual[key]:
            findings.append(
                Finding(
                    key,
                    "value",
                    f"fingerprint {actual[key]:#018x} after the load, {expected[key]:#018x} in "
                    "the manifest: some element differs (run verify='full' to find it)",
                )
            )
    return findings


__all__ = [
    "FingerprintError",
    "FingerprintResult",
    "check_replicas",
    "checkpoint_fingerprints",
    "fingerprint",
    "fingerprint_checkpoint",
    "fingerprint_report",
    "fingerprints_differ",
]
