"""fsdpcheck.verify: every rank's shards (model and optimizer) against a reference checkpoint.

The protocol, identical on every rank whatever happens locally (so no rank waits forever), with
O(keys) bytes received per rank at any world size (NOTE: [bytes per rank] in ``collectives``), run
by ``dist.runner`` (NOTE: [one step runner]): a local step that fails is kept for the next
agreement, where it ends the call on every rank with the same one-finding report.
1. setup (local): check the arguments, read the live state.
2. agree (``keyset.agree_keys``: one all-reduce when every rank holds the same keys): the job's
   keys, every rank's setup failure, and the arguments (by digest: tolerances, check_dtype,
   key_map, ignore, convert, the reference's kind, whether an optimizer was given).
3. open (``opening.open_checked``: one broadcast): rank 0 checks the reference's metadata.
4. prepare (local): pair the job's names (``matching``), check layouts, shapes and dtypes; one
   all-reduce checks that every rank opened the same checkpoint and paired the same (the
   results of key_map and convert included).
5. compare (local): read the reference under the memory budget, one fused kernel per batch.
6. combine (``collectives.combine``: all-reduces of one row per key: the elements each key's
   shards cover, counted once, must be its global numel) and the findings found locally (each
   distinct list once), so every rank builds the same report.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpcheck import matching
from fsdpcheck._collector import paused
from fsdpcheck.box import Box
from fsdpcheck.checks import coverage, pair_checks, problem_findings
from fsdpcheck.collectives import capped_findings, combine, digest, findings_of
from fsdpcheck.convert import Conversion, Piece, Target
from fsdpcheck.convert.declared import stated_or_declared
from fsdpcheck.convert.pieces import target_box
from fsdpcheck.dist.arguments import given
from fsdpcheck.dist.runner import ARGUMENTS, Call, Failure, RankFailure, call
from fsdpcheck.errors import describe_error
from fsdpcheck.kernels import compare_each
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.keyset import KeySet, agree_keys
from fsdpcheck.layout import Layout, local_layout
from fsdpcheck.live import LiveState, live_state
from fsdpcheck.opening import open_checked
from fsdpcheck.reading.live import (
    buffer_names,
    compile_for_live,
    converted_state,
    local_parts,
    source_layouts,
)
from fsdpcheck.reading.plan import (
    DeviceBatches,
    along_chunks,
    box_blocks,
    cast_as,
    kernel_box,
    target_view,
)
from fsdpcheck.readplan import Arena
from fsdpcheck.report import Finding, MappingRow, Report, normalized, uncovered
from fsdpcheck.sources import Region, Source, checkpoint_notes, prefetch
from fsdpcheck.sources.prefetch import Prefetcher, batch_bytes
from fsdpcheck.stats import KeyStats
from fsdpcheck.tolerances import CheckSettings, tolerance


@dataclass
class _Work:
    """One piece to compare: a view of live data, its box, and the region of the reference."""

    key_index: int
    actual: torch.Tensor
    box: Box
    region: Region
    ref_dtype: torch.dtype
    tol: tuple[float, float]
    fingerprint: bool
    piece: Piece | None = None  # through a conversion: the part of the target compared
    target_shape: tuple[int, ...] = ()


@dataclass
class _Prepared:
    source: Source
    keys: matching.CheckpointKeys
    match: matching.LiveMatch
    values: list[Any]  # this rank's value of each pair (None: not held here)
    layouts: list[Layout | None] = field(default_factory=list)  # None: not compared here
    blocked: set[int] = field(default_factory=set)  # held here, but a finding says why not
    findings: list[Finding] = field(default_factory=list)
    conv: Conversion | None = None
    # Through a conversion: pair -> this rank's layouts of the sources its target reads.
    converted: dict[int, dict[str, Layout]] = field(default_factory=dict)


def verify(
    model: torch.nn.Module | Mapping[str, Any],
    reference: Any,
    *,
    optimizer: Any = None,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = True,
    check_dtype: bool = True,
    key_map: matching.KeyMap | None = None,
    ignore: Sequence[str] | None = None,
    memory_budget: int = 1 << 30,
    group: Any = None,
    convert: Any = None,
    timeout: float | None = None,
) -> Report:
    """Checks every rank's shards of a model (and optimizer) against a reference checkpoint.

    Collective: every rank of `group` must call it. Each rank reads only the parts of the
    reference that overlap its own shards, in batches of at most `memory_budget` bytes on the
    shards' device, compares them with one fused kernel per batch, and the ranks combine their
    statistics with a constant number of small collectives, so every rank returns the same
    Report. Nothing is gathered, nothing is copied to the CPU, and nothing live is changed
    (an optimizer without state is a finding, never initialised).

    Args:
        model: An nn.Module (FSDP2, tensor parallel, 2D, HSDP, DDP, plain, or wrapped by
            Lightning/accelerate/torch.compile) or a state dict of DTensors, ShardedTensors or
            tensors.
        reference: A checkpoint path of any layout ``fsdpcheck.describe_path`` recognises, an
            in-memory mapping of full tensors, a full nn.Module, or a list of these read as one;
            or a Source every rank opened already (``fsdpcheck.opening``; left open).
        optimizer: The optimizer whose state to verify too: a torch optimizer or a wrapper
            (torchtitan OptimizersContainer, Lightning/Fabric, accelerate), or an FQN-keyed
            optimizer state dict.
        rtol: Relative tolerance; None means exact unless the dtypes differ.
        atol: Absolute tolerance; None means exact unless the dtypes differ.
        equal_nan: Whether NaN matches NaN.
        check_dtype: Whether a dtype difference is a finding (values are compared anyway, with
            torch.testing's default tolerances for the less precise dtype unless given).
        key_map: A callable or dict from live key (canonical model FQN,
            ``optim.state.<fqn>.<name>``) to the checkpoint's own key; None (or a missing entry)
            uses the matched key; a key mapped to None is not checked (listed as ignored).
        ignore: fnmatch patterns of keys (live names or checkpoint keys) to exclude; excluded
            keys are listed in ``Report.mapping`` as "ignored".
        memory_budget: Bytes of reference data held at once per rank.
        group: The process group (default: the default group; none needed for one process).
        convert: How the live layout (what ``model.state_dict()`` returns) becomes the
            reference's (``fsdpcheck.convert``: a function ``F(state_dict) -> state_dict``
            such as a torchtitan ``StateDictAdapter(...).to_hf``, an adapter, a spec, a
            Conversion). Every rank compiles it from the job's names and global shapes, once,
            without running it on data, and compares the parts of the converted tensors its
            shards hold; findings are in the reference's names and indices, with the live
            key, index and rank of each maximum. A model whose modules have state-dict hooks
            of their own (torchtitan's ``FusedQKVLinear``) is read as it is held and its
            hooks come first, traced on meta copies. None: the layout the model declares
            (``fsdpcheck.convert.declared``: its state dict's, or a layout its library saves,
            whichever names the reference holds), if any.
        timeout: Seconds a rank waits in one collective for the others before it names the
            ranks that did not answer (``RankStoppedError`` on every rank that still answers);
            default: the process group's timeout, which is this for the call's length.

    Every argument but `model`, `memory_budget`, `group` and `timeout` must be the same on every
    rank (a reference path may differ, if it holds the same checkpoint): they are compared by
    digest in the first collective, and ranks that passed different ones get a report whose one
    finding names the argument and the ranks. Any failure on one rank (an argument check, a
    read, a callable of yours) is a report with that one finding on every rank.

    Returns:
        The Report, identical on every rank.

    Raises:
        RankStoppedError: A rank stopped answering (died, stopped, or did not reach the same
            collective within `timeout`): on every rank that still answers, naming it.
    """
    t0 = time.perf_counter()
    with paused(), call("verify", group, timeout) as c:
        report = Report(reference=_named(reference), world_size=c.comm.world)
        source: Source | None = None
        try:

            def setup() -> tuple[CheckSettings, Any]:
                settings = CheckSettings(
                    rtol, atol, equal_nan, check_dtype, key_map, ignore, memory_budget
                )
                c.arguments(
                    reference=_kind_of(reference),
                    optimizer=given(optimizer),
                    rtol=settings.rtol,
                    atol=settings.atol,
                    equal_nan=settings.equal_nan,
                    check_dtype=settings.check_dtype,
                    key_map=key_map,
                    ignore=settings.ignore,
                    convert=convert,
                )
                return settings, stated_or_declared(model, convert)

            settings, conv = c.local(ARGUMENTS, setup, (None, None))
            live = c.local("reading the live state", lambda: live_state(model, optimizer))
            ks = agree_keys(c, live)
            # Every rank takes part (one broadcast): rank 0 checks the metadata, the others
            # trust its verdict (NOTE: [metadata once per job] in ``opening``).
            source = open_checked(c, reference)
            assert live is not None
            return _verify(c, t0, ks, live, source, settings, conv, report)
        except RankFailure as f:
            if f.failure.usage:  # arguments: raised, as any call raises a usage error
                raise f.failure.error() from None
            return _failed(report, f.failure, t0)
        finally:
            if source is not None and source is not reference:  # a source given stays open
                source.close()


def _verify(
    c: Call,
    t0: float,
    ks: KeySet,
    live: LiveState,
    source: Source | None,
    s: CheckSettings,
    convert: Any,
    report: Report,
) -> Report:
    """The protocol of the module docstring, once every rank agreed on the keys and opened."""
    world = c.comm.world
    ckpt = c.local("reading the reference's keys", lambda: checkpoint_keys(_opened(source)))
    # Pairing the job's names: the same on every rank. Then this rank's own values and checks.
    prepared = c.local(
        "pairing the keys", lambda: _prepare(ks, live, _opened(source), ckpt, s, world, convert)
    )
    said = c.local("pairing the keys", lambda: _pairing(source, ckpt, prepared), ("", "", "", 0))
    groups = c.exchange("agreeing on the checkpoint and the pairing", said, word=digest(said))
    differ = _differently(groups, world) if len(groups) > 1 else None
    if differ is not None:
        raise RankFailure(differ)
    assert source is not None and ckpt is not None and prepared is not None
    report.reference = groups[0].payload[0]
    m = prepared.match
    stats = [KeyStats() for _ in m.items]
    local = list(prepared.findings)
    bytes_read = 0
    # A read that fails is a finding for its keys (``_read_failed``); anything else that fails
    # here is kept for the gathering of the findings, where it ends the call on every rank.
    bytes_read = c.local(
        "comparing the values", lambda: _compare_values(prepared, stats, local, s), 0
    )
    try:
        c.point("comparing the param groups")
        groups_live, group_findings = matching.match_groups(live, ckpt, source.read_objects)
        local += group_findings + _check_param_groups(source, groups_live)
    except Exception as exc:
        local.append(Finding("optim.param_groups", "error", describe_error(exc)))
    entries = source.entries()
    numels = [_numel(item, entries) for item in m.items]
    combined, totals = combine(c.comm, stats, time.perf_counter() - t0, bytes_read, numels=numels)
    # Ranks holding one key differently: the per-key checks name it where it is paired.
    paired = {item.key for item in m.items}
    findings = [_held_by(f, ks.partial) for f in m.findings]
    findings += [f for f in ks.findings if f.key not in paired]
    findings += findings_of(*c.gather("gathering the findings", capped_findings(local)))
    checked = 0
    for item, c_, n in zip(m.items, combined, numels):
        entry = entries[item.ckpt_key]
        if c_.holders and not c_.errors:
            checked += 1
            if c_.covered != n:
                findings.append(uncovered(item.key, c_.covered, c_.held_by, n, "shards"))
        if c_.mismatched > 0:
            dtype = getattr(torch, item.value.dtype) if item.value is not None else entry.dtype
            rtol_, atol_ = tolerance(dtype, entry.dtype, s.rtol, s.atol)
            once = _Once(c_, n)
            f = Finding.value(item.key, once, entry.shape, rtol=rtol_, atol=atol_)
            if once.others:
                hint = f"{once.others} more mismatched element(s) in the copies on other ranks"
                f.message = f"{f.message}; {hint}" if f.message else hint
            if isinstance(item.value, Target) and prepared.conv is not None:
                f.abs_source = _located(prepared.conv, item.key, c_.max_abs_idx)
                f.rel_source = _located(prepared.conv, item.key, c_.max_rel_idx)
            findings.append(f)
        if c_.replicas_disagree:
            findings.append(Finding.replica(item.key, c_.replica_groups))
    report.findings = _everywhere(normalized(findings), world)
    report.keys_checked = checked
    report.keys_a, report.keys_b = m.keys_a, m.keys_b
    report.mapping = m.rows
    report.elements_checked = sum(min(c_.covered, n) for c_, n in zip(combined, numels))
    report.bytes_read = totals.bytes_read
    report.seconds = totals.seconds
    report.notes = list(m.notes) + checkpoint_notes(source)
    if prepared.conv is not None:
        conv = prepared.conv
        report.notes.insert(
            0,
            f"the live model converted by {conv.description}: {len(conv.targets)} tensor(s) "
            f"from {len(conv.sources)}",
        )
        report.notes += conv.notes
    if ks.stages > 1:
        report.notes.append(
            f"the ranks hold {ks.stages} different sets of keys (pipeline stages): each key was "
            "checked on the ranks that hold it"
        )
    return report


def _opened(source: Source | None) -> Source:
    """The source of a local step that runs only when opening succeeded (else it is skipped)."""
    assert source is not None
    return source


class _Once:
    """A key's combined statistics with every element counted once (replicas aside).

    ``numel`` is the key's global numel; ``mismatched`` the mismatches of the counted copy (each
    element once), or, when that copy matches, those of the other copies (replicas), at most
    numel; the rest of `Combined` as it is.
    """

    def __init__(self, c: Any, numel: int) -> None:
        self._c = c
        self.numel = numel
        others = c.mismatched - c.counted_mismatched
        self.mismatched = c.counted_mismatched or min(numel, others)
        self.others = others if c.counted_mismatched else 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)


def _numel(item: Any, entries: Mapping[str, Any]) -> int:
    shape = item.value.shape if item.value is not None else entries[item.ckpt_key].shape
    return math.prod(shape)


def _named(reference: Any) -> str:
    description = getattr(reference, "description", None)
    if isinstance(description, str):
        return description
    if isinstance(reference, (str, os.PathLike)):
        return os.fspath(reference)
    return f"a {type(reference).__name__}"


def _kind_of(reference: Any) -> Any:
    """What identifies the reference before it is opened (paths may differ: copies)."""
    if isinstance(reference, (str, os.PathLike)):
        return "a path"
    if isinstance(reference, Source):
        return f"an open {reference.kind} source"
    if isinstance(reference, (list, tuple)):
        return [_kind_of(r) for r in reference]
    return reference


def _pairing(source: Source | None, ckpt: Any, prepared: _Prepared | None) -> tuple[Any, ...]:
    """What every rank must have found: checkpoint, conversion and pairing.

    The checkpoint's description and identity, and the results of convert and key_map.
    """
    if prepared is None or source is None:
        return ("", "", "", 0)
    conv = prepared.conv.digest() if prepared.conv is not None else ""
    pairs = digest([(i.key, i.ckpt_key) for i in prepared.match.items])
    return (source.description, _identity(ckpt), conv, pairs)


def _differently(groups: list[Any], world: int) -> Failure | None:
    """Ranks that opened different checkpoints or paired differently, in one line.

    None: they opened copies of one checkpoint at different paths, which is allowed.
    """
    found = [g.payload for g in groups]

    def where(what: Callable[[Any], str]) -> str:
        return "; ".join(
            f"ranks {g.ranks[:8]}{' ...' if len(g.ranks) > 8 else ''} {what(g.payload)}"
            for g in groups[:4]
        )

    if len({p[1] for p in found}) > 1:
        text = (
            "ranks see different checkpoints (is the checkpoint on a filesystem every rank "
            f"shares, and did every rank pass the same path?): {where(lambda p: f'see {p[0]}')}"
        )
    elif len({p[2] for p in found}) > 1:
        conv = where(lambda p: f"convert to {p[2][:12] or 'nothing'}")
        text = (
            "the conversion (convert=, or the model's declared one) gives different results on "
            f"different ranks: {conv}; every rank must convert alike"
        )
    elif len({p[3] for p in found}) > 1:
        pairs = where(lambda p: f"pair the keys as {p[3]:#x}")
        text = (
            "the ranks paired the model's keys with the checkpoint's differently (a key_map "
            f"that answers differently on some ranks?): {pairs}; every rank must pair alike"
        )
    else:
        return None
    return Failure("RanksDisagreeError", text, text, None, tuple(range(world)))


def _held_by(f: Finding, partial: Mapping[str, int]) -> Finding:
    """A pairing finding about a key only some ranks hold names the lowest of them."""
    rank = partial.get(f.key)
    if rank is not None and f.rank is None:
        f.rank, f.ranks = rank, [rank]
    return f


def _failed(report: Report, failure: Failure, t0: float) -> Report:
    report.findings = [failure.finding()]
    report.seconds = time.perf_counter() - t0
    return report


def _everywhere(findings: list[Finding], world: int) -> list[Finding]:
    """Findings that every rank reported are about the job, not a rank: no rank named."""
    for f in findings:
        everywhere = world > 1 and len(f.ranks) == world and f.kind not in ("value", "replica")
        if everywhere or (world == 1 and f.kind not in ("value", "replica")):
            f.rank, f.ranks = None, []
    return findings


def _identity(ckpt: matching.CheckpointKeys | None) -> str:
    """What makes two ranks' checkpoints the same one: every entry's key, shape and dtype."""
    h = hashlib.blake2b(digest_size=16)
    for r in ckpt.rows if ckpt is not None else []:
        e = r.entry
        h.update(f"{e.key}\0{e.shape}\0{e.dtype}\0".encode())
    return h.hexdigest()


def _located(conv: Conversion, target: str, index: int) -> tuple[str, tuple[int, ...]] | None:
    return conv.locate(target, index) if index >= 0 else None


# -------------------------------------------------------------------------------------------
def _prepare(
    ks: KeySet,
    live: LiveState,
    source: Source,
    ckpt: matching.CheckpointKeys,
    s: CheckSettings,
    world: int,
    convert: Any = None,
) -> _Prepared:
    """The pairing of the job's names, this rank's values, and its per-key checks (local)."""
    job, conv = ks.live, None
    extra: list[Finding] = []
    rows: list[MappingRow] = []
    if convert is not None:
        # The same on every rank: compiled from the job's names and global shapes.
        other = set(ckpt.model) | {r.key for r in ckpt.rows}
        conv = compile_for_live(convert, ks.live, other, buffer_names(live))
    if conv is not None:
        job = converted_state(ks.live, conv)
        extra, rows = coverage(conv)
    m = matching.match_live(
        job, ckpt, read_objects=source.read_objects, key_map=s.key_map, ignore=s.ignore
    )
    values = live.tensors()
    values.update(live.buffers)
    held = [
        item.value if isinstance(item.value, Target) else values.get(item.key) for item in m.items
    ]
    prepared = _Prepared(source, ckpt, m, held, conv=conv)
    if conv is not None:
        m.rows += rows
        prepared.findings += extra
    prepared.findings += [Finding(key, kind, message) for key, kind, message in live.problems]
    _check_keys(prepared, live.requires_grad, s.check_dtype, world, values)
    return prepared


def _check_keys(
    p: _Prepared,
    live_requires_grad: Mapping[str, bool],
    check_dtype: bool,
    world: int,
    values: Mapping[str, Any] | None = None,
) -> None:
    """Storage problems, layout, shape, dtype and requires_grad of each matched item.

    Fills ``p.layouts``: the layout to compare, or None where a finding says why not.
    """
    entries = p.source.entries()
    # Coverage before data: a key the storage cannot deliver whole (a gap, a bad entry) is a
    # finding of its own kind, and never read.
    live_name = {item.ckpt_key: item.key for item in p.match.items}
    found, problems = problem_findings(p.source.problems(), lambda k: live_name.get(k, k))
    p.findings += found
    gaps = set(p.conv.target_problems()) if p.conv is not None else set()
    cache: dict[str, Layout] = {}
    for i, item in enumerate(p.match.items):
        entry = entries[item.ckpt_key]
        p.layouts.append(None)
        value = p.values[i]
        if value is None:
            continue  # another rank's key (a pipeline stage this rank is not in)
        if isinstance(value, Target):
            bad = item.ckpt_key in problems or value.name in gaps
            _check_target(p, i, value, entry, check_dtype, world, values or {}, cache, bad)
            continue
        p.blocked.add(i)  # until the checks below pass
        lay = local_layout(value, world)
        if item.ckpt_key in problems:
            continue
        if lay.error is not None:
            p.findings.append(Finding(item.key, "layout", lay.error))
            continue
        held = p.keys.placeholders.get(item.ckpt_key)
        got, skip = pair_checks(
            item.key, (lay.global_shape, lay.dtype), (tuple(entry.shape), entry.dtype),
            matching.LIVE, check_dtype=check_dtype,
            placeholder=held if held is not None and math.prod(lay.global_shape) > 0 else None,
        )  # fmt: skip
        p.findings += got
        if skip is not None:
            continue
        p.layouts[-1] = lay
        p.blocked.discard(i)
        if item.is_param_state:
            continue
        saved_rg = p.source.requires_grad(item.ckpt_key)
        live_rg = live_requires_grad.get(item.fqn)
        if saved_rg is not None and live_rg is not None and saved_rg != live_rg:
            p.findings.append(
                Finding(
                    item.key,
                    "requires_grad",
                    f"requires_grad={live_rg} live but {saved_rg} in the reference",
                )
            )


def _check_target(
    p: _Prepared,
    i: int,
    t: Target,
    entry: Any,
    check_dtype: bool,
    world: int,
    values: Mapping[str, Any],
    cache: dict[str, Layout],
    bad: bool,
) -> None:
    """The checks of a converted target, and this rank's layouts of the sources it reads."""
    layouts, error = source_layouts(t, values, world, cache)
    if not layouts and error is None:
        return  # no source held here (another pipeline stage's)
    p.blocked.add(i)
    if error is not None:
        p.findings.append(Finding(t.name, "layout", error))
        return
    if bad:  # a gap in its pieces, or a storage problem of its entry: a finding says so
        return
    held = p.keys.placeholders.get(entry.key)
    got, skip = pair_checks(
        t.name, (t.shape, getattr(torch, t.dtype)), (tuple(entry.shape), entry.dtype),
        matching.LIVE, check_dtype=check_dtype, placeholder=held,
    )  # fmt: skip
    p.findings += got
    if skip is None:
        p.converted[i] = layouts
        p.blocked.discard(i)


# -------------------------------------------------------------------------------------------
def _compare_values(
    p: _Prepared, stats: list[KeyStats], findings: list[Finding], s: CheckSettings
) -> int:
    """Reads and compares every local piece in batches under the budget; returns bytes read.

    Batches are at most ``batch_bytes(budget)`` (``prefetch.STEP`` at most) and
    ``prefetch.MAX_REGIONS`` pieces: the arena stays small and warm instead of a budget's worth
    of freshly faulted pages. A batch holds pieces on one device only (shards offloaded to the
    CPU beside shards on a GPU are batched apart).
    """
    step = batch_bytes(s.budget)
    # Batches are capped in pieces too (NOTE: [regions per batch] in prefetch).
    todo: DeviceBatches[_Work] = DeviceBatches(step, prefetch.MAX_REGIONS)
    entries = p.source.entries()
    for i, (item, lay) in enumerate(zip(p.match.items, p.layouts)):
        if i in p.converted:
            _converted_works(p, i, stats[i], s, step, todo)
            continue
        if lay is None:
            if i in p.blocked:
                stats[i].errors += 1
            continue
        stats[i].owner, stats[i].mesh_ranks = lay.owner, lay.mesh_ranks
        entry = entries[item.ckpt_key]
        assert entry.dtype is not None
        tol = tolerance(lay.dtype, entry.dtype, s.rtol, s.atol)
        elsize = entry.dtype.itemsize
        for piece in lay.pieces:
            stats[i].holders = 1
            assert piece.box.offset is not None
            p_off = tuple(piece.box.offset)
            dev = piece.tensor.device
            p_size = tuple(piece.tensor.shape)
            saved = p.source.chunks_overlapping(item.ckpt_key, p_off, p_size)
            for part_off, part_size in _along_chunks(p_off, p_size, saved):
                for off, size in box_blocks(part_off, part_size, elsize, step):
                    actual, box = piece.tensor, piece.box
                    if size != p_size:  # a part of the piece: its view, and its own box
                        for d, (o, n) in enumerate(zip(off, size)):
                            if n != actual.shape[d]:
                                actual = actual.narrow(d, o - p_off[d], n)
                        box = Box(piece.box.shape, off)
                    w = _Work(
                        i,
                        actual,
                        box,
                        Region(item.ckpt_key, off, size),
                        entry.dtype,
                        tol,
                        lay.replicated,
                    )
                    todo.add(dev, w, math.prod(size) * elsize)
    done = 0

    def failed(works: list[_Work], exc: BaseException) -> None:
        _read_failed(works, exc, stats, findings, p.match)

    for device, batches in todo.batches.items():
        # The read-ahead stages through host memory (pinned for a GPU): for a reference already
        # in memory, or shards on another kind of device, each batch is read straight there.
        ahead = not p.source.in_memory and device.type in ("cpu", "cuda")
        run = _prefetched if ahead else _direct
        for works, refs in run(p.source, device, batches, failed):
            done += sum(r.numel() * r.element_size() for r in refs)
            refs = [
                r if w.piece is None else target_view(r, w.piece, w.target_shape)
                for w, r in zip(works, refs)
            ]
            diffs = compare_each(
                [w.actual if w.piece is None else cast_as(w.actual, w.piece) for w in works],
                refs,
                boxes=[w.box for w in works],
                settings=[(*w.tol, w.fingerprint) for w in works],
                equal_nan=s.equal_nan,
            )
            for w, diff in zip(works, diffs):
                stats[w.key_index].add(diff, w.box)
                if diff.fingerprint_actual is None:  # counted for the coverage check
                    stats[w.key_index].cover(diff.numel, w.box)
            del refs
    return done


def _converted_works(
    p: _Prepared,
    i: int,
    stats: KeyStats,
    s: CheckSettings,
    step: int,
    todo: DeviceBatches[_Work],
) -> None:
    """The parts of a converted target this rank's shards hold, added to the batches."""
    assert p.conv is not None
    item = p.match.items[i]
    t = item.value
    entry = p.source.entries()[item.ckpt_key]
    assert isinstance(t, Target) and entry.dtype is not None
    layouts = p.converted[i]
    first = next(iter(layouts.values()))
    stats.owner, stats.mesh_ranks = first.owner, first.mesh_ranks
    tol = tolerance(getattr(torch, t.dtype), entry.dtype, s.rtol, s.atol)
    elsize = entry.dtype.itemsize
    shapes = {src: p.conv.sources[src][0] for src in layouts}
    most = max(1, step // max(1, elsize))
    stats.holders = 1
    for view, q in local_parts(t, layouts, shapes, most, for_reading=True):
        off, size, _ = target_box(q, t.shape)
        w = _Work(
            i, view, kernel_box(q), Region(item.ckpt_key, off, size), entry.dtype, tol, False,
            q, t.shape,
        )  # fmt: skip
        todo.add(view.device, w, math.prod(size) * elsize)


#: Batches of pieces with the reference regions read for them.
_Reads = Iterator[tuple[list[_Work], list[torch.Tensor]]]
#: Told of a batch whose read failed (it becomes findings); the reads go on with the next.
_Failed = Callable[[list[_Work], BaseException], None]


def _direct(
    source: Source, device: torch.device, batches: list[list[_Work]], failed: _Failed
) -> _Reads:
    """Reads of a reference in memory: views where it lies, else copies into one arena."""
    arena = Arena()
    for works in batches:
        try:
            out = arena.carve(device, [(w.region.size, w.ref_dtype) for w in works])
            refs = source.read([w.region for w in works], device, out)
        except Exception as exc:  # unreadable file, out of memory: a finding, not a hang
            failed(works, exc)
            continue
        yield works, refs


def _prefetched(
    source: Source, device: torch.device, batches: list[list[_Work]], failed: _Failed
) -> _Reads:
    """Reads of a reference on disk: the next batch is read while this one is compared.

    Read ahead on worker threads, and on a GPU through pinned buffers and a side stream
    (NOTE: [prefetch]). A batch whose read fails becomes findings for its keys, and the reads
    go on with the next batch.
    """
    start = 0
    while start < len(batches):
        plan = ((k, [(source, [w.region for w in batches[k]])]) for k in range(start, len(batches)))
        reads = Prefetcher(device).run(plan)
        at = start  # the batch the next result belongs to
        try:
            # Only reading raises here: the caller's work on a batch happens outside this
            # generator (and closing it is GeneratorExit, not an Exception).
            for k, (refs,) in reads:
                yield batches[k], refs
                at = k + 1
            return
        except Exception as exc:  # unreadable file, out of memory: a finding, not a hang
            failed(batches[at], exc)
        finally:
            reads.close()  # the reads in flight stop before the arenas go
        start = at + 1


def _read_failed(
    works: list[_Work],
    exc: BaseException,
    stats: list[KeyStats],
    findings: list[Finding],
    m: matching.LiveMatch,
) -> None:
    msg = f"reading the reference failed: {describe_error(exc)}"
    for key_index in sorted({w.key_index for w in works}):
        stats[key_index].errors += 1
        findings.append(Finding(m.items[key_index].key, "error", msg))


#: How a rank's shard is cut along the reference's saved chunks (``reading.plan``); a module
#: name of its own, so a test can count the cuts.
_along_chunks = along_chunks


def _check_param_groups(source: Source, groups: list[matching.GroupPair]) -> list[Finding]:
    """Hyperparameters of each live param group against the checkpoint's."""
    keys = [e.key for g in groups if g.ckpt for name, e in g.ckpt.items() if name != "params"]
    saved = source.read_objects(keys) if keys else {}
    out = []
    for g in groups:
        if g.ckpt is None:
            continue
        for name, value in sorted(g.hparams.items()):
            key = matching.group_key(g.index, name)
            entry = g.ckpt.get(name)
            if entry is None:
                out.append(Finding(key, "missing", f"'{name}' is not in the checkpoint"))
            elif not _same_hparam(value, saved[entry.key]):
                out.append(
                    Finding(
                        key,
                        "value",
                        f"{name} is {value!r} in the optimizer but {saved[entry.key]!r} in the "
                        "checkpoint",
                    )
                )
    return out


def _same_hparam(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ta, tb = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
        return ta.shape == tb.shape and bool(torch.equal(ta.to(tb.dtype), tb))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_hparam(x, y) for x, y in zip(a, b))
    return bool(a == b) or (a != a and b != b)


__all__ = ["verify"]
