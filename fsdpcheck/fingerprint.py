"""Layout-independent fingerprints of a live model and of a checkpoint on disk.

Fingerprint v1 (README) of a tensor is the sum over its elements of a hash of (global index,
raw bits), so the fingerprints of the boxes that tile it add up to the whole tensor's: each rank
hashes the shards it holds in one fused pass, replicated copies are counted once, and the result
is the same whatever the world size, mesh, placements or device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpcheck import keys as keymod
from fsdpcheck.box import Box, ravel
from fsdpcheck.collectives import Comm
from fsdpcheck.kernels import SUPPORTED_DTYPES, fingerprint_tensors
from fsdpcheck.layout import Layout, local_layout
from fsdpcheck.live import describe_error, flat_live
from fsdpcheck.report import Finding, Report
from fsdpcheck.sources import Region, Source, open_source

MASK64 = (1 << 64) - 1


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
    """

    fingerprints: dict[str, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    layouts: dict[str, Layout] = field(default_factory=dict)


def fingerprint(
    model_or_state_dict: torch.nn.Module | Mapping[str, Any],
    *,
    optimizer: Any = None,
    group: Any = None,
) -> dict[str, int]:
    """Fingerprint v1 of every model (and optimizer) entry, identical on every rank.

    Collective: every rank of `group` calls it. The same model content gives the same dict on 1
    rank, on N ranks under FSDP2, on a 2D FSDP+TP mesh, and on CUDA. Replicated copies count
    once (the lowest rank's); use ``check_replicas`` to see whether they agree.

    Args:
        model_or_state_dict: An nn.Module or a state dict of DTensors / ShardedTensors / tensors.
        optimizer: An optimizer (with a module) or an FQN-keyed optimizer state dict.
        group: The process group (default: the default group, or none).

    Returns:
        Key -> fingerprint; optimizer entries are keyed ``optim.state.<fqn>.<name>``.

    Raises:
        FingerprintError: On every rank, when a value cannot be fingerprinted.
    """
    result = fingerprint_report(model_or_state_dict, optimizer=optimizer, group=group)
    bad = [f for f in result.findings if f.kind in ("layout", "error")]
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
    comm = Comm(group)
    rows: list[tuple[str, int, int, int]] = []  # key, box id, numel, fingerprint
    errors: list[tuple[str, str, str]] = []
    numels: dict[str, int] = {}
    layouts: dict[str, Layout] = {}
    try:
        live = flat_live(model_or_state_dict, optimizer)
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
    return result


def _assemble(gathered: list[Any]) -> FingerprintResult:
    result = FingerprintResult()
    # key -> box -> fingerprint -> ranks holding that content
    copies: dict[str, dict[int, dict[int, list[int]]]] = {}
    box_numel: dict[tuple[str, int], int] = {}
    numels: dict[str, int] = {}
    for rank, (rows, errors, nums) in enumerate(gathered):
        numels.update(nums)
        for key, box, numel, fp in rows:
            copies.setdefault(key, {}).setdefault(box, {}).setdefault(fp, []).append(rank)
            box_numel[(key, box)] = numel
        for key, kind, msg in errors:
            result.findings.append(Finding(key, kind, msg, rank=rank, ranks=[rank]))
    for key in sorted(copies):
        total, covered = 0, 0
        for box in sorted(copies[key]):
            versions = copies[key][box]
            # Counted once: the content the lowest rank holds.
            first = min(versions, key=lambda fp: min(versions[fp]))
            total = (total + first) & MASK64
            covered += box_numel[(key, box)]
            if len(versions) > 1:
                groups = sorted(versions.values(), key=lambda r: (-len(r), r))
                result.findings.append(
                    Finding(
                        key,
                        "replica",
                        f"copies of the same elements differ across ranks: ranks {groups[0]} "
                        "hold one value, "
                        + "; ".join(f"ranks {g}" for g in groups[1:])
                        + " another",
                        rank=groups[1][0],
                        ranks=sorted(r for g in groups for r in g),
                    )
                )
        if covered != numels.get(key, covered):
            result.findings.append(
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
        if n == 0 and key not in result.fingerprints and key not in copies:
            result.fingerprints[key] = 0  # an empty tensor
    result.findings = _dedupe(result.findings)
    return result


def _dedupe(findings: list[Finding]) -> list[Finding]:
    out: dict[tuple[str, str, str], Finding] = {}
    for f in findings:
        k = (f.key, f.kind, f.message)
        if k in out:
            out[k].ranks = sorted(set(out[k].ranks) | set(f.ranks))
        else:
            out[k] = f
    return sorted(out.values(), key=lambda f: (f.key, f.kind))


# -------------------------------------------------------------------------------------------
def fingerprint_checkpoint(path: Any, *, memory_budget: int = 1 << 30) -> dict[str, int]:
    """The fingerprints of a checkpoint's tensors, computed offline (no process group).

    Streams the checkpoint under `memory_budget` bytes: a DCP directory chunk by chunk (each
    chunk hashed at its global offset), a torch.save file or safetensors in row blocks. Keys are
    named as ``fingerprint`` names them (model FQNs with the checkpoint's container removed,
    ``optim.state.<fqn>.<name>``), so the same content gives the same numbers.

    Args:
        path: A DCP directory, a torch.save file, safetensors (file, index or folder), or an
            in-memory mapping.
        memory_budget: Bytes of checkpoint data held at once.

    Returns:
        Key -> fingerprint.
    """
    source = open_source(path)
    names = checkpoint_key_names(source)
    out: dict[str, int] = {}
    batch: list[tuple[str, Region]] = []
    held = 0
    for ckpt_key, name in names.items():
        entry = source.entries()[ckpt_key]
        out[name] = 0
        itemsize = entry.dtype.itemsize  # type: ignore[union-attr]
        for region in _regions(source, ckpt_key, entry.shape, itemsize, memory_budget):
            nbytes = region.numel * itemsize
            if batch and held + nbytes > memory_budget:
                _hash_batch(source, batch, names, out)
                batch, held = [], 0
            batch.append((ckpt_key, region))
            held += nbytes
    if batch:
        _hash_batch(source, batch, names, out)
    return out


def checkpoint_key_names(source: Source) -> dict[str, str]:
    """Checkpoint key -> the name ``fingerprint`` gives the same entry (tensors only)."""
    classified = keymod.classify(source.entries())
    names = {e.key: name for name, e in classified.model.items()}
    for (fqn, state_name), e in classified.state.items():
        if e.is_tensor:
            names[e.key] = keymod.optim_key(fqn, state_name)
    return dict(sorted(names.items(), key=lambda kv: kv[1]))


def _regions(
    source: Source, key: str, shape: tuple[int, ...], itemsize: int, budget: int
) -> list[Region]:
    # DCP: the saved chunks themselves (each is one blob on disk); else the whole tensor.
    chunks = getattr(source, "chunks", None)
    boxes = chunks(key) if chunks is not None else [((0,) * len(shape), tuple(shape))]
    out = []
    for offset, size in boxes:
        if math.prod(size) == 0 and len(size) > 0:
            continue
        row = math.prod(size[1:]) * itemsize if len(size) > 1 else itemsize
        rows = max(1, budget // max(row, 1))
        if len(size) == 0 or size[0] <= rows:
            out.append(Region(key, tuple(offset), tuple(size)))
            continue
        for r0 in range(0, size[0], rows):
            r1 = min(size[0], r0 + rows)
            out.append(Region(key, (offset[0] + r0, *offset[1:]), (r1 - r0, *size[1:])))
    return out


def _hash_batch(
    source: Source, batch: list[tuple[str, Region]], names: dict[str, str], out: dict[str, int]
) -> None:
    regions = [r for _, r in batch]
    tensors = source.read(regions, torch.device("cpu"))
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
    "fingerprint",
    "fingerprint_checkpoint",
    "fingerprint_report",
]
