"""fsdpcheck.audit: is a checkpoint on disk whole and consistent? No process group needed."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from fsdpcheck.report import Finding, Report, describe_error
from fsdpcheck.sources.tiling import Box, tiling_problems

__all__ = ["Box", "audit", "tiling_problems"]

# What makes a directory look like a checkpoint of some kind (else it is not audited at all).
_CHECKPOINT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "*.pt", "*.pth", "*.bin",
                     "*.ckpt")  # fmt: skip


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
    from fsdpcheck.sources.dcp import is_dcp_dir

    t0 = time.perf_counter()
    p = Path(path)
    findings: list[Finding] = []
    notes: list[str] = []
    checked = 0
    if not os.path.lexists(p):
        raise FileNotFoundError(f"{p} does not exist")
    dcp_dirs = [p] if is_dcp_dir(p) else []
    if p.is_dir() and not dcp_dirs:
        dcp_dirs = [q for q in sorted(p.iterdir()) if is_dcp_dir(q)]
        if not dcp_dirs and not any(next(p.glob(g), None) for g in _CHECKPOINT_GLOBS):
            what = "is empty" if next(p.iterdir(), None) is None else "holds no checkpoint"
            raise ValueError(
                f"{p} {what}: expected a DCP directory (with .metadata), safetensors or a "
                "torch.save file"
            )
    try:
        if dcp_dirs:
            for d in dcp_dirs:
                checked += _audit_dcp(
                    d, findings, notes, deep, prefix="" if d == p else d.name + "/"
                )
        else:
            checked += _audit_file(p, findings)
    except Exception as exc:
        findings.append(Finding("*", "error", describe_error(exc)))
    return Report(
        findings=sorted(findings, key=lambda f: (f.key, f.kind)),
        reference=f"the structure of {p}",
        keys_checked=checked,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


def _audit_dcp(p: Path, findings: list[Finding], notes: list[str], deep: bool, prefix: str) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdpcheck.sources.safe_reader import check_storage, read_dcp_metadata

    md = read_dcp_metadata(p)
    tensors = sum(isinstance(m, TensorStorageMetadata) for m in md.state_dict_metadata.values())
    for key, kind, message in check_storage(p, md).findings:
        findings.append(Finding(prefix + key, kind, message))
    _audit_optimizer(md, findings, prefix)
    try:
        _audit_manifest(p, md, findings, notes, deep, prefix)
    except Exception as exc:  # a malformed manifest is a finding about the manifest
        findings.append(Finding(prefix + "fsdpcheck_manifest.json", "error", describe_error(exc)))
    return tensors


def _audit_optimizer(md: Any, findings: list[Finding], prefix: str) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdpcheck.sources.base import Entry

    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    entries = {}
    for key, meta in md.state_dict_metadata.items():
        raw = planner.get(key)
        path = tuple(str(x) for x in raw) if raw else (key,)
        entries[key] = Entry(key, path, is_tensor=isinstance(meta, TensorStorageMetadata))
    from fsdpcheck.matching import checkpoint_keys, optim_key

    c = checkpoint_keys(entries)
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
    lazy = sorted(fqn for fqn in c.model if fqn not in with_state)
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
    p: Path, md: Any, findings: list[Finding], notes: list[str], deep: bool, prefix: str
) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdpcheck.manifest import read_manifest

    manifest = read_manifest(p)  # validated: a malformed one raises ManifestError (one line)
    if manifest is None:
        notes.append(f"{prefix or p.name}: no fsdpcheck manifest (saved without fsdpcheck.save)")
        return
    meta = md.state_dict_metadata
    listed = set()
    for key, e in manifest.entries.items():
        ck = e.checkpoint_key
        listed.add(ck)
        m = meta.get(ck)
        if not isinstance(m, TensorStorageMetadata):
            findings.append(
                Finding(prefix + key, "missing", f"in the manifest but {ck} is not saved")
            )
            continue
        if tuple(m.size) != tuple(e.shape):
            findings.append(
                Finding(
                    prefix + key,
                    "shape",
                    f"manifest says {tuple(e.shape)}, metadata {tuple(m.size)}",
                )
            )
        dtype = str(m.properties.dtype).removeprefix("torch.")
        if dtype != e.dtype:
            findings.append(
                Finding(prefix + key, "dtype", f"manifest says {e.dtype}, metadata {dtype}")
            )
    for ck, m in meta.items():
        if isinstance(m, TensorStorageMetadata) and ck not in listed:
            findings.append(Finding(prefix + ck, "unexpected", "saved but not in the manifest"))
    if deep:
        from fsdpcheck.fingerprints import fingerprint_checkpoint, fingerprints_differ

        actual = fingerprint_checkpoint(p)
        expected = manifest.fingerprints()
        findings.extend(
            fingerprints_differ(expected, {k: actual[k] for k in actual if k in expected})
        )


def _audit_file(p: Path, findings: list[Finding]) -> int:
    from fsdpcheck.sources import open_source

    source = open_source(p)
    try:
        for key, kind, message in source.problems():
            findings.append(Finding(key, kind, message))
        return sum(e.is_tensor for e in source.entries().values())
    finally:
        source.close()
