"""fsdpcheck.audit: is a checkpoint on disk whole and consistent? No process group needed."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from fsdpcheck.fingerprints import fingerprint_checkpoint, fingerprints_differ
from fsdpcheck.formats import describe_path, is_dcp_dir
from fsdpcheck.manifest import read_manifest
from fsdpcheck.matching import CheckpointKeys, checkpoint_keys, optim_key
from fsdpcheck.report import Finding, Report, describe_error, normalized
from fsdpcheck.sources import open_path
from fsdpcheck.sources.base import Entry
from fsdpcheck.sources.tiling import Box, tiling_problems

__all__ = ["Box", "audit", "tiling_problems"]


def audit(path: str | os.PathLike[str], *, deep: bool = False) -> Report:
    """Checks a checkpoint's structure without loading it into a model.

    For a DCP directory: every tensor's chunks lie inside its global shape and tile it exactly
    (no gap, no overlap; a sweep over the chunks, not a pairwise test); every chunk has a storage
    entry; every storage entry points into an existing file, within its size; the manifest (when
    there is one) matches the metadata; optimizer state is complete (every parameter with state
    has the same state names, ``step`` included) and parameters whose state is missing while
    others have some are flagged. For torch.save and safetensors files: readable, with every
    tensor's data inside its storage.

    No code from the checkpoint runs: ``.metadata`` is read with a restricted unpickler and
    files are loaded weights-only. Gaps are findings of kind "gap"; anything in the checkpoint
    that is broken or refused (a hostile pickle, a FIFO, a truncated file, an index naming a file
    outside its folder) is a finding, in one line.

    Args:
        path: A DCP directory (or an accelerate save_state directory), a torch.save file, or
            safetensors.
        deep: Also recompute every tensor's fingerprint from the data and compare it with the
            manifest (reads the whole checkpoint once, streaming).

    Returns:
        A Report; ``ok`` when nothing is wrong.

    Raises:
        FileNotFoundError: `path` does not exist (unreadable input, not a finding).
        ValueError: `path` is a directory holding no checkpoint (empty, or nothing of a
            supported kind).
    """
    t0 = time.perf_counter()
    info = describe_path(path)  # unreadable input raises: FileNotFoundError, ValueError
    findings: list[Finding] = []
    notes: list[str] = list(info.notes)
    checked = 0
    for part in info.parts:
        prefix = "" if len(info.parts) == 1 else part.name + "/"
        try:
            if is_dcp_dir(part):
                checked += _audit_dcp(part, findings, notes, deep, prefix)
            else:
                checked += _audit_file(part, findings, prefix, info.layout)
        except Exception as exc:  # a checkpoint too broken to read is a finding about it
            findings.append(Finding(prefix + "*", "error", describe_error(exc)))
    return Report(
        findings=normalized(findings),
        reference=f"the structure of {info.path} ({info.layout})",
        keys_checked=checked,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


def _audit_dcp(p: Path, findings: list[Finding], notes: list[str], deep: bool, prefix: str) -> int:
    # DCP's own modules are never imported (NOTE: [DCP-free metadata] in dcp_metadata), and
    # .metadata is read once, into columns (NOTE: [metadata columns] in dcp_pickle), whose check
    # gives the structural findings and whose source reads the data for --deep.
    from fsdpcheck.sources.dcp import DCPSource

    source = DCPSource(p)
    try:
        index, check = source.index, source.storage_problems
        assert check is not None
        for key, kind, message in check.findings:
            findings.append(Finding(prefix + key, kind, message))
        entries = {
            key: Entry(key, index.paths[key], is_tensor=index.tensor[k])
            for k, key in enumerate(index.keys)
        }
        _audit_optimizer(checkpoint_keys(entries), findings, prefix)
        try:
            _audit_manifest(p, source, findings, notes, deep, prefix)
        except Exception as exc:  # a malformed manifest is a finding about the manifest
            findings.append(
                Finding(prefix + "fsdpcheck_manifest.json", "error", describe_error(exc))
            )
    finally:
        source.close()
    return sum(index.tensor)


def _audit_optimizer(c: CheckpointKeys, findings: list[Finding], prefix: str) -> None:
    """Optimizer state complete: the same state names everywhere, a step, none lazily missing."""
    if not c.state:
        return
    names: dict[str, set[str]] = {}
    for fqn, name in c.state:
        names.setdefault(fqn, set()).add(name)
    everyone = set().union(*names.values())
    for fqn, have in sorted(names.items()):
        lacking = sorted(everyone - have)
        if lacking:
            findings.append(
                Finding(
                    prefix + optim_key(fqn, lacking[0]),
                    "missing",
                    f"optimizer state of {fqn} lacks {lacking} that other parameters have",
                )
            )
    if "step" not in everyone:
        findings.append(
            Finding(prefix + "optim.state", "missing", "no parameter has a 'step' in its state")
        )
    with_state = set(names)
    # By integer ids, state cannot be told apart by name: count instead.
    lazy = [] if c.id_keyed else sorted(fqn for fqn in c.model if fqn not in with_state)
    if c.id_keyed and c.model and len(with_state) < len(c.model):
        lazy = [f"{len(c.model) - len(with_state)} of {len(c.model)} parameters"]
    if lazy and with_state:
        findings.append(
            Finding(
                prefix + "optim.state",
                "missing",
                f"{len(lazy)} parameter(s) have no optimizer state while {len(with_state)} do "
                f"(state created lazily and never saved?): {lazy[:5]}",
            )
        )


def _audit_manifest(
    p: Path, source: Any, findings: list[Finding], notes: list[str], deep: bool, prefix: str
) -> None:
    manifest = read_manifest(p)  # validated: a malformed one raises ManifestError (one line)
    if manifest is None:
        notes.append(f"{prefix or p.name}: no fsdpcheck manifest (saved without fsdpcheck.save)")
        return
    saved = source.entries()
    listed = set()
    for key, e in manifest.entries.items():
        ck = e.checkpoint_key
        listed.add(ck)
        m = saved.get(ck)
        if m is None or not m.is_tensor:
            findings.append(
                Finding(prefix + key, "missing", f"in the manifest but {ck} is not saved")
            )
            continue
        if tuple(m.shape) != tuple(e.shape):
            findings.append(
                Finding(
                    prefix + key,
                    "shape",
                    f"manifest says {tuple(e.shape)}, metadata {tuple(m.shape)}",
                )
            )
        dtype = str(m.dtype).removeprefix("torch.")
        if dtype != e.dtype:
            findings.append(
                Finding(prefix + key, "dtype", f"manifest says {e.dtype}, metadata {dtype}")
            )
    for ck, m in saved.items():
        if m.is_tensor and ck not in listed:
            findings.append(Finding(prefix + ck, "unexpected", "saved but not in the manifest"))
    if deep:
        # The open source (metadata read and checked once) hashes the data.
        actual = fingerprint_checkpoint(source)
        expected = manifest.fingerprints()
        findings.extend(
            fingerprints_differ(expected, {k: actual[k] for k in actual if k in expected})
        )


def _audit_file(p: Path, findings: list[Finding], prefix: str, layout: str) -> int:
    source = open_path(p)
    try:
        for key, kind, message in source.problems():
            findings.append(Finding(prefix + key, kind, message))
        keys = checkpoint_keys(source.entries(), flat=source.kind == "safetensors")
        _audit_optimizer(keys, findings, prefix)
        if layout == "deepspeed":
            for r in keys.model.values():
                if math.prod(r.entry.shape) == 0 and len(r.entry.shape) > 0:
                    findings.append(
                        Finding(
                            prefix + r.name,
                            "skipped",
                            f"an empty placeholder {r.entry.shape}: DeepSpeed ZeRO-3 keeps the "
                            "values in its optimizer partitions (consolidate with "
                            "zero_to_fp32.py and audit the result)",
                        )
                    )
        return sum(e.is_tensor for e in source.entries().values())
    finally:
        source.close()
