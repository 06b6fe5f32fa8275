"""fsdpcheck.audit: is a checkpoint on disk whole and consistent? No process group needed."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpcheck.errors import describe_error
from fsdpcheck.fingerprints import fingerprint_checkpoint, fingerprints_differ
from fsdpcheck.formats import CheckpointInfo, KeyGrammar, describe_path, grammar_of, is_dcp_dir
from fsdpcheck.keys import CheckpointKeys, checkpoint_keys, keys_from_entries, merge_into
from fsdpcheck.manifest import MANIFEST_NAME, read_manifest
from fsdpcheck.names import optim_key
from fsdpcheck.reading.references import open_part
from fsdpcheck.report import Finding, Report, normalized
from fsdpcheck.saving import stale_reason
from fsdpcheck.sources import open_dcp
from fsdpcheck.sources.base import Entry
from fsdpcheck.sources.remote import RemotePath
from fsdpcheck.sources.tiling import Box, tiling_problems

if TYPE_CHECKING:
    from fsdpcheck.offline_dist import Session

__all__ = ["Box", "audit", "tiling_problems"]


def audit(
    path: str | os.PathLike[str], *, deep: bool = False, session: Session | None = None
) -> Report:
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
        session: The processes of a torchrun launch to spread --deep's reading over
            (``offline_dist.session``); None: this process alone.

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
    whole = CheckpointKeys()
    values = [0, 0]  # --deep: tensors whose values were checked against a fingerprint, and not
    for index, part in enumerate(info.paths):
        prefix = "" if len(info.parts) == 1 else part.name + "/"
        try:
            if is_dcp_dir(part):
                n, keys = _audit_dcp(
                    part, findings, notes, deep, prefix, grammar_of(info.layout), info.roles[index],
                    values, session,
                )  # fmt: skip
            else:
                n, keys = _audit_file(info, index, findings, prefix)
                values[1] += n
            checked += n
            merge_into(whole, keys)
        except Exception as exc:  # a checkpoint too broken to read is a finding about it
            findings.append(Finding(prefix + "*", "error", describe_error(exc)))
    _audit_optimizer(whole, findings, notes, grammar_of(info.layout).step_per_parameter)
    return Report(
        findings=normalized(findings),
        reference=f"the structure of {info.path} ({info.layout}){_deep_words(deep, *values)}",
        keys_checked=checked,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


def _deep_words(deep: bool, checked: int, unchecked: int) -> str:
    """What --deep checked, in words for the verdict line.

    An OK never reads as "values verified" when no value was checked (a checkpoint without a
    manifest, or whose manifest holds no fingerprints).
    """
    if not deep:
        return ""
    if not checked:
        return (
            " only: --deep checked no value (no fsdpcheck manifest holds fingerprints to check "
            "them against; fsdpcheck.save writes one)"
        )
    if unchecked:
        return (
            f" and the values of {checked} tensor(s) against the manifest's fingerprints "
            f"({unchecked} without one: not checked)"
        )
    return f" and the values of all {checked} tensor(s) against the manifest's fingerprints"


def _audit_dcp(
    p: Path | RemotePath,
    findings: list[Finding],
    notes: list[str],
    deep: bool,
    prefix: str,
    grammar: KeyGrammar,
    role: str,
    values: list[int],
    session: Session | None = None,
) -> tuple[int, CheckpointKeys]:
    # DCP's own modules are never imported (NOTE: [DCP-free metadata] in dcp_metadata), and
    # .metadata is read once, into columns (NOTE: [metadata columns] in dcp_runs), whose check
    # gives the structural findings and whose source reads the data for --deep.
    source = open_dcp(p)
    try:
        index, check = source.index, source.storage_problems
        assert check is not None
        for key, kind, message in check.findings:
            findings.append(Finding(prefix + key, kind, message))
        entries = {
            key: Entry(key, index.paths[key], is_tensor=index.tensor[k])
            for k, key in enumerate(index.keys)
        }
        keys = keys_from_entries(entries, grammar=grammar, role=role)
        fingerprinted = 0
        try:
            fingerprinted = _audit_manifest(p, source, findings, notes, deep, prefix, session)
        except Exception as exc:  # a malformed manifest is a finding about the manifest
            findings.append(
                Finding(prefix + "fsdpcheck_manifest.json", "error", describe_error(exc))
            )
    finally:
        source.close()
    tensors = sum(index.tensor)
    values[0] += fingerprinted
    values[1] += max(0, tensors - fingerprinted)
    return tensors, keys


def _audit_optimizer(
    c: CheckpointKeys, findings: list[Finding], notes: list[str], step_per_parameter: bool
) -> None:
    """Optimizer state that cannot be legitimate is a finding; state that may be, a note.

    A parameter with no state at all is what frozen parameters, and parameters the loss never
    reached, look like after a step: named in a note. What no optimizer writes is a finding:
    a parameter with some of its optimizer's state names and not others, Adam moments without
    a ``step``, and state for a parameter the checkpoint's model does not have.
    """
    if not c.state:
        return
    names: dict[tuple[int, str], set[str]] = {}
    for (fqn, name), r in c.state.items():
        names.setdefault((r.optimizer, fqn), set()).add(name)
    per_optimizer: dict[int, set[str]] = {}
    for (index, _), have in names.items():
        per_optimizer.setdefault(index, set()).update(have)
    for (index, fqn), have in sorted(names.items()):
        lacking = sorted(per_optimizer[index] - have)
        if lacking:
            findings.append(
                Finding(
                    optim_key(fqn, lacking[0]),
                    "missing",
                    f"optimizer state of {fqn} has {sorted(have)} but lacks {lacking}, which "
                    "other parameters of the same optimizer have",
                )
            )
        elif step_per_parameter and "step" not in have and have & {"exp_avg", "exp_avg_sq"}:
            findings.append(
                Finding(
                    optim_key(fqn, "step"),
                    "missing",
                    f"Adam moments {sorted(have & {'exp_avg', 'exp_avg_sq'})} of {fqn} without "
                    "a 'step' (bias correction cannot resume)",
                )
            )
    if c.id_keyed or not c.model:
        return
    with_state = {fqn for _, fqn in names}
    for fqn in sorted(with_state - set(c.model)):
        findings.append(
            Finding(
                optim_key(fqn, sorted(names[next(k for k in names if k[1] == fqn)])[0]),
                "unexpected",
                f"optimizer state for {fqn}, which the checkpoint's model does not have",
            )
        )
    stateless = sorted(fqn for fqn in c.model if fqn not in with_state)
    if stateless:
        shown = ", ".join(stateless[:5]) + (", ..." if len(stateless) > 5 else "")
        notes.append(
            f"{len(stateless)} model tensor(s) have no optimizer state (frozen or unused "
            f"parameters, or buffers): {shown}"
        )


def _audit_manifest(
    p: Path | RemotePath,
    source: Any,
    findings: list[Finding],
    notes: list[str],
    deep: bool,
    prefix: str,
    session: Session | None = None,
) -> int:
    """Checks the manifest against the metadata (and, `deep`, the data).

    Returns:
        How many tensors' values were checked against a fingerprint.
    """
    manifest = read_manifest(p)  # validated: a malformed one raises ManifestError (one line)
    if manifest is None:
        unchecked = " (--deep: no fingerprint to check the data against)" if deep else ""
        notes.append(
            f"{prefix or p.name}: no fsdpcheck manifest (saved without fsdpcheck.save){unchecked}"
        )
        return 0
    stale = stale_reason(p, manifest, {p: source.metadata_digest})
    if stale is not None:  # its entries describe another save: comparing them only misleads
        findings.append(Finding(prefix + MANIFEST_NAME, "error", stale))
        return 0
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
        expected = manifest.fingerprints()
        if not expected:  # nothing to recompute against: say so, never a silent "OK"
            findings.append(
                Finding(
                    prefix + MANIFEST_NAME,
                    "skipped",
                    "the manifest holds no fingerprints: --deep checked no value (only the "
                    "structure was checked); save the checkpoint with fsdpcheck.save to have them",
                )
            )
            return 0
        if len(expected) < len(manifest.entries):
            notes.append(
                f"{prefix or p.name}: {len(manifest.entries) - len(expected)} manifest "
                "entries have no fingerprint: --deep did not check their values"
            )
        # The open source (metadata read and checked once) hashes the data.
        actual = fingerprint_checkpoint(source, session=session)
        findings.extend(
            fingerprints_differ(expected, {k: actual[k] for k in actual if k in expected})
        )
        return len(expected)
    return 0


def _audit_file(
    info: CheckpointInfo, index: int, findings: list[Finding], prefix: str
) -> tuple[int, CheckpointKeys]:
    source = open_part(info, index)
    try:
        for key, kind, message in source.problems():
            findings.append(Finding(prefix + key, kind, message))
        keys = checkpoint_keys(source)
        for r in keys.model.values():
            held = keys.placeholders.get(r.key)
            if held is not None:
                findings.append(Finding(prefix + r.name, "skipped", held))
        return sum(e.is_tensor for e in source.entries().values()), keys
    finally:
        source.close()
