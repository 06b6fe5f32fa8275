"""Layout-independent fingerprints of a live model and of a checkpoint on disk.

Fingerprint v1 (README) of a tensor is the sum over its elements of a hash of (global index,
raw bits), so the fingerprints of the boxes that tile it add up to the whole tensor's: each rank
hashes the shards it holds in one fused pass, replicated copies are counted once, and the result
is the same whatever the world size, mesh, placements or device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fsdpcheck import matching
from fsdpcheck.box import Box, ravel
from fsdpcheck.kernels import MASK64, SUPPORTED_DTYPES, fingerprint_tensors
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.manifest import read_manifest
from fsdpcheck.readplan import batches, row_blocks
from fsdpcheck.report import Finding, Report, describe_error, normalized
from fsdpcheck.sources import Region, Source, open_source, refuse_problems
from fsdpcheck.sources.prefetch import Prefetcher, batch_bytes

if TYPE_CHECKING:
    from fsdpcheck.layout import Layout

# The live side (collectives, layouts, the model walk, torch.distributed) is imported where it
# is used: fingerprinting a checkpoint on disk needs none of it (~7 ms of a command's start).


class FingerprintError(ValueError):
    """A value cannot be fingerprinted (a Partial placement, a layout that is not a box, ...)."""


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
    """

    fingerprints: dict[str, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    layouts: dict[str, Layout] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)


def fingerprint(
    model_or_state_dict: torch.nn.Module | Mapping[str, Any],
    *,
    optimizer: Any = None,
    group: Any = None,
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

    Returns:
        Key -> fingerprint, sorted; optimizer entries are keyed ``optim.state.<fqn>.<name>``.

    Raises:
        FingerprintError: On every rank, when a value cannot be fingerprinted.
    """
    result = fingerprint_report(model_or_state_dict, optimizer=optimizer, group=group)
    bad = [f for f in result.findings if f.kind in ("layout", "error", "missing")]
    if bad:
        raise FingerprintError("; ".join(f"{f.key}: {f.message}" for f in bad))
    return result.fingerprints


def check_replicas(
    model_or_state_dict: torch.nn.Module | Mapping[str, Any],
    *,
    optimizer: Any = None,
    group: Any = None,
) -> Report:
    """Whether every replicated copy (HSDP, TP Replicate, DDP, the optimizer step) agrees.

    Collective. Returns a Report whose "replica" findings name the ranks that disagree.
    """
    from fsdpcheck.collectives import Comm

    result = fingerprint_report(model_or_state_dict, optimizer=optimizer, group=group)
    comm = Comm(group)
    return Report(
        findings=result.findings,
        reference="the other replicas",
        world_size=comm.world,
        keys_checked=len(result.fingerprints),
    )


def fingerprint_report(
    model_or_state_dict: torch.nn.Module | Mapping[str, Any],
    *,
    optimizer: Any = None,
    group: Any = None,
) -> FingerprintResult:
    """Fingerprints and replica findings in one pass (see ``fingerprint``)."""
    from fsdpcheck.collectives import Comm
    from fsdpcheck.layout import local_layout
    from fsdpcheck.live import live_state

    comm = Comm(group)
    rows: list[tuple[str, int, int, int]] = []  # key, box id, numel, fingerprint
    errors: list[tuple[str, str, str]] = []
    numels: dict[str, int] = {}
    layouts: dict[str, Layout] = {}
    tied: dict[str, str] = {}
    try:
        state = live_state(model_or_state_dict, optimizer)
        tied = state.tied
        errors += state.problems
        live = state.tensors(dedupe_tied=True)
        tensors, boxes, owners = [], [], []
        for key in sorted(live):
            lay = layouts[key] = local_layout(live[key], comm.world)
            numels[key] = math.prod(lay.global_shape)
            if lay.error is not None:
                errors.append((key, "layout", lay.error))
                continue
            if lay.dtype not in SUPPORTED_DTYPES:
                errors.append((key, "layout", f"dtype {lay.dtype} cannot be fingerprinted"))
                continue
            for piece in lay.pieces:
                tensors.append(piece.tensor)
                boxes.append(piece.box)
                owners.append(key)
        fps = fingerprint_tensors(tensors, boxes=boxes) if tensors else []
        for key, box, fp, t in zip(owners, boxes, fps, tensors):
            assert box.offset is not None
            rows.append((key, ravel(box.offset, box.shape), t.numel(), fp))
    except Exception as exc:  # never leave the other ranks waiting in the gather below
        errors.append(("*", "error", describe_error(exc)))
    gathered = comm.all_gather_object((rows, errors, numels))
    result = _assemble(gathered)
    result.layouts = layouts
    result.tied = tied
    return result


def _assemble(gathered: list[Any]) -> FingerprintResult:
    result = FingerprintResult()
    world = len(gathered)
    # key -> box -> fingerprint -> ranks holding that content
    copies: dict[str, dict[int, dict[int, list[int]]]] = {}
    box_numel: dict[tuple[str, int], int] = {}
    numels: dict[str, int] = {}
    holders: dict[str, list[int]] = {}
    findings: list[Finding] = []
    for rank, (rows, errors, nums) in enumerate(gathered):
        for key, n in nums.items():
            numels[key] = n
            holders.setdefault(key, []).append(rank)
        for key, box, numel, fp in rows:
            copies.setdefault(key, {}).setdefault(box, {}).setdefault(fp, []).append(rank)
            box_numel[(key, box)] = numel
        for key, kind, msg in errors:
            findings.append(Finding(key, kind, msg, rank=rank, ranks=[rank]))
    partial = {k for k, r in holders.items() if len(r) != world}
    for key in sorted(partial):
        absent = [r for r in range(world) if r not in holders[key]]
        findings.append(
            Finding(
                key,
                "error",
                f"only ranks {holders[key]} have this key (ranks {absent} do not): every rank "
                "must hold the same keys, so it cannot be fingerprinted",
                ranks=holders[key],
            )
        )
    for key in sorted(copies):
        if key in partial:
            continue
        total, covered = 0, 0
        for box in sorted(copies[key]):
            versions = copies[key][box]
            # Counted once: the content the lowest rank holds.
            first = min(versions, key=lambda fp: min(versions[fp]))
            total = (total + first) & MASK64
            covered += box_numel[(key, box)]
            if len(versions) > 1:
                groups = sorted(versions.values(), key=lambda r: (-len(r), r))
                findings.append(Finding.replica(key, groups))
        if covered != numels.get(key, covered):
            findings.append(
                Finding(
                    key,
                    "layout",
                    f"the ranks' boxes cover {covered} of {numels[key]} elements (overlapping "
                    "or missing shards); its fingerprint would be wrong",
                )
            )
            continue
        result.fingerprints[key] = total
    for key, n in numels.items():
        if n == 0 and key not in result.fingerprints and key not in copies and key not in partial:
            result.fingerprints[key] = 0  # an empty tensor
    result.fingerprints = dict(sorted(result.fingerprints.items()))
    result.findings = normalized(findings)
    return result


# -------------------------------------------------------------------------------------------
def fingerprint_checkpoint(
    path: Any, *, ignore: Sequence[str] | None = None, memory_budget: int = 1 << 30
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

    Returns:
        Canonical name -> fingerprint, sorted by name.
    """
    return checkpoint_fingerprints(path, ignore=ignore, memory_budget=memory_budget)[0]


def checkpoint_fingerprints(
    path: Any, *, ignore: Sequence[str] | None = None, memory_budget: int = 1 << 30
) -> tuple[dict[str, int], list[str]]:
    """``fingerprint_checkpoint`` and notes naming every tensor it did not fingerprint."""
    if not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive int, got {memory_budget!r}")
    source = open_source(path)
    try:
        refuse_problems(source, source.description, "fingerprint it")
        keys = checkpoint_keys(source)
        names: dict[str, str] = {}
        notes: list[str] = []
        other = []
        for r in keys.tensors():
            if r.role == "other":
                other.append(r.key)
            elif matching.is_ignored(ignore, r.name, r.key):
                notes.append(f"{r.key}: excluded by the user")
            else:
                names[r.key] = r.name
        if other:
            notes.append(
                f"{len(other)} training-state tensor(s) not fingerprinted: "
                + ", ".join(other[:8])
                + (", ..." if len(other) > 8 else "")
            )
        out = _hash_checkpoint(source, names, memory_budget)
        tied = _manifest_ties(path)
        for dup, first in tied.items():
            if dup in out and first in out and out[dup] == out[first]:
                del out[dup]  # listed once, as ``fingerprint`` lists a tied parameter
                notes.append(f"{dup} is tied to {first}: listed once")
    finally:
        source.close()
    return dict(sorted(out.items())), notes


def _manifest_ties(path: Any) -> dict[str, str]:
    if not isinstance(path, (str, os.PathLike)):
        return {}
    p = Path(path)
    manifest = read_manifest(p) if p.is_dir() else None
    return manifest.tied if manifest is not None else {}


def _hash_checkpoint(source: Source, names: dict[str, str], budget: int) -> dict[str, int]:
    """Hashes every chunk at its global offset, reading the next batch while this one is hashed.

    Two batches are in flight (NOTE: [prefetch]), so each holds at most half the budget.
    """
    entries = source.entries()
    out: dict[str, int] = {}
    step = batch_bytes(budget)
    work: list[tuple[str, Region]] = []
    for ckpt_key, name in names.items():
        entry = entries[ckpt_key]
        if entry.dtype not in SUPPORTED_DTYPES:
            raise FingerprintError(f"{ckpt_key}: dtype {entry.dtype} cannot be fingerprinted")
        out[name] = 0
        itemsize = entry.dtype.itemsize  # type: ignore[union-attr]
        for offset, size in source.chunks(ckpt_key):
            if math.prod(size) == 0 and len(size) > 0:
                continue
            for off, sz in row_blocks(offset, size, itemsize, step):
                work.append((ckpt_key, Region(ckpt_key, off, sz)))

    def nbytes(w: tuple[str, Region]) -> int:
        return w[1].numel * entries[w[0]].dtype.itemsize  # type: ignore[union-attr]

    plan = ((b, [(source, [r for _, r in b])]) for b in batches(work, nbytes, step))
    for batch, (tensors,) in Prefetcher(torch.device("cpu")).run(plan):
        _hash_batch(source, batch, tensors, names, out)
    return out


def checkpoint_key_names(source: Source) -> dict[str, str]:
    """Checkpoint key -> the canonical name ``fingerprint`` gives the same tensor."""
    keys = checkpoint_keys(source)
    return {r.key: r.name for r in keys.tensors() if r.role != "other"}


def _hash_batch(
    source: Source,
    batch: list[tuple[str, Region]],
    tensors: list[torch.Tensor],
    names: dict[str, str],
    out: dict[str, int],
) -> None:
    """Adds the fingerprints of one batch of regions (already read) to their keys' sums."""
    entries = source.entries()
    boxes = [Box(entries[k].shape, r.offset) for k, r in batch]
    for (key, _), fp in zip(batch, fingerprint_tensors(tensors, boxes=boxes)):
        out[names[key]] = (out[names[key]] + fp) & MASK64


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
