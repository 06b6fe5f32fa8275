"""fsdpcheck.audit: is a checkpoint on disk whole and consistent? No process group needed."""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdpcheck import keys as keymod
from fsdpcheck.live import describe_error
from fsdpcheck.report import Finding, Report

# At most this many gaps / overlaps are described per key.
_MAX_PROBLEMS = 4

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def audit(path: str | os.PathLike[str], *, deep: bool = False) -> Report:
    """Checks a checkpoint's structure without loading it into a model.

    For a DCP directory: every tensor's chunks lie inside its global shape and tile it exactly
    (no gap, no overlap; a sweep over the chunks, not a pairwise test); every chunk has a storage
    entry; every storage entry points into an existing file, within its size; the manifest (when
    there is one) matches the metadata; optimizer state is complete (every parameter with state
    has the same state names, ``step`` included) and parameters whose state is missing while
    others have some are flagged. For torch.save and safetensors files: readable, with every
    tensor's data inside its storage.

    Args:
        path: A DCP directory (or an accelerate save_state directory), a torch.save file, or
            safetensors.
        deep: Also recompute every tensor's fingerprint from the data and compare it with the
            manifest (reads the whole checkpoint once, streaming).

    Returns:
        A Report; ``ok`` when nothing is wrong.
    """
    t0 = time.perf_counter()
    p = Path(path)
    findings: list[Finding] = []
    notes: list[str] = []
    checked = 0
    try:
        from fsdpcheck.sources.dcp import is_dcp_dir

        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
        dcp_dirs = [p] if is_dcp_dir(p) else [q for q in sorted(p.glob("*")) if is_dcp_dir(q)]
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
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    md = FileSystemReader(str(p)).read_metadata()
    tensors = 0
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        tensors += 1
        shape = tuple(meta.size)
        boxes: list[Box] = []
        for c in meta.chunks:
            off, size = tuple(c.offsets), tuple(c.sizes)
            if len(off) != len(shape) or len(size) != len(shape):
                findings.append(
                    Finding(prefix + key, "layout", f"chunk at {off} has the wrong number of dims")
                )
                continue
            if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(off, size, shape)):
                findings.append(
                    Finding(
                        prefix + key,
                        "layout",
                        f"chunk at offset {off} of size {size} lies outside the global shape "
                        f"{shape}",
                    )
                )
                continue
            if MetadataIndex(key, c.offsets) not in md.storage_data and math.prod(size) > 0:
                findings.append(
                    Finding(prefix + key, "missing", f"chunk at offset {off} has no storage entry")
                )
            if math.prod(size) > 0 or not shape:
                boxes.append((off, size))
        for problem in tiling_problems(shape, boxes):
            findings.append(Finding(prefix + key, "layout", problem))
    _audit_storage(p, md, findings, prefix)
    _audit_optimizer(md, findings, prefix)
    _audit_manifest(p, md, findings, notes, deep, prefix)
    return tensors


def _audit_storage(p: Path, md: Any, findings: list[Finding], prefix: str) -> None:
    sizes: dict[str, int | None] = {}
    for idx, info in md.storage_data.items():
        rel = info.relative_path
        if rel not in sizes:
            f = p / rel
            sizes[rel] = f.stat().st_size if f.is_file() else None
        size = sizes[rel]
        if size is None:
            findings.append(
                Finding(prefix + idx.fqn, "error", f"its data file {rel} does not exist")
            )
        elif info.offset + info.length > size:
            findings.append(
                Finding(
                    prefix + idx.fqn,
                    "error",
                    f"its data in {rel} ends at byte {info.offset + info.length} but the file has "
                    f"{size} bytes (truncated?)",
                )
            )


def _audit_optimizer(md: Any, findings: list[Finding], prefix: str) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fsdpcheck.sources.base import Entry

    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    entries = {}
    for key, meta in md.state_dict_metadata.items():
        raw = planner.get(key)
        path = tuple(str(x) for x in raw) if raw else (key,)
        entries[key] = Entry(key, path, is_tensor=isinstance(meta, TensorStorageMetadata))
    c = keymod.classify(entries)
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
                    prefix + keymod.optim_key(fqn, lacking[0]),
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

    from fsdpcheck.checkpoint import read_manifest

    manifest = read_manifest(p)
    if manifest is None:
        notes.append(f"{prefix or p.name}: no fsdpcheck manifest (saved without fsdpcheck.save)")
        return
    meta = md.state_dict_metadata
    listed = set()
    for key, e in manifest["entries"].items():
        ck = e["checkpoint_key"]
        listed.add(ck)
        m = meta.get(ck)
        if not isinstance(m, TensorStorageMetadata):
            findings.append(
                Finding(prefix + key, "missing", f"in the manifest but {ck} is not saved")
            )
            continue
        if list(m.size) != e["shape"]:
            findings.append(
                Finding(
                    prefix + key,
                    "shape",
                    f"manifest says {tuple(e['shape'])}, metadata {tuple(m.size)}",
                )
            )
        dtype = str(m.properties.dtype).removeprefix("torch.")
        if dtype != e["dtype"]:
            findings.append(
                Finding(prefix + key, "dtype", f"manifest says {e['dtype']}, metadata {dtype}")
            )
    for ck, m in meta.items():
        if isinstance(m, TensorStorageMetadata) and ck not in listed:
            findings.append(Finding(prefix + ck, "unexpected", "saved but not in the manifest"))
    if deep:
        from fsdpcheck.fingerprint import fingerprint_checkpoint, fingerprints_differ

        actual = fingerprint_checkpoint(p)
        expected = {
            k: int(e["fingerprint"], 16) for k, e in manifest["entries"].items() if e["fingerprint"]
        }
        findings.extend(
            fingerprints_differ(expected, {k: actual[k] for k in actual if k in expected})
        )


def _audit_file(p: Path, findings: list[Finding]) -> int:
    from fsdpcheck.sources import open_source

    source = open_source(p)
    n = 0
    for key, e in source.entries().items():
        if not e.is_tensor:
            continue
        n += 1
        values = getattr(source, "_values", None)
        if values is None:
            continue  # safetensors: safe_open already validated every tensor's byte range
        t = values[key]
        need = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s)
        if t.numel() and (need + 1) * t.element_size() > t.untyped_storage().nbytes():
            findings.append(Finding(key, "error", "its data runs past the end of its storage"))
    return n


def tiling_problems(shape: Sequence[int], boxes: Sequence[Box]) -> list[str]:
    """What keeps `boxes` from tiling `shape` exactly (gaps and overlaps), or [].

    A sweep along dim 0: between consecutive chunk boundaries the set of chunks that cross the
    slab must tile the remaining dims, checked the same way, and each distinct set is checked
    once. Chunkings made by sharding (grids, uneven and strided ones included) cost
    O(chunks log chunks).
    """
    problems: list[str] = []
    if len(shape) == 0:
        if len(boxes) != 1:
            problems.append(f"the scalar is saved {len(boxes)} times")
        return problems
    _tile(tuple(shape), [(tuple(o), tuple(s)) for o, s in boxes], (), problems)
    return problems[:_MAX_PROBLEMS]


def _tile(
    shape: tuple[int, ...], boxes: list[Box], where: tuple[str, ...], problems: list[str]
) -> None:
    if len(problems) >= _MAX_PROBLEMS:
        return
    d = len(where)
    if len(shape) == 1:
        pos = 0
        for lo, hi in sorted((o[0], o[0] + s[0]) for o, s in boxes):
            if lo > pos:
                problems.append(f"gap at {_at(where, d, pos, lo)}")
            elif lo < pos:
                problems.append(f"overlap at {_at(where, d, lo, min(pos, hi))}")
            pos = max(pos, hi)
        if pos < shape[0]:
            problems.append(f"gap at {_at(where, d, pos, shape[0])}")
        return
    cuts = sorted({0, shape[0]} | {o[0] for o, _ in boxes} | {o[0] + s[0] for o, s in boxes})
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    active: set[int] = set()
    seen: set[frozenset[int]] = set()
    nxt = 0
    for lo, hi in itertools.pairwise(cuts):
        while nxt < len(order) and boxes[order[nxt]][0][0] <= lo:
            active.add(order[nxt])
            nxt += 1
        active = {i for i in active if boxes[i][0][0] + boxes[i][1][0] > lo}
        key = frozenset(active)
        if key in seen:
            continue  # the same chunks cross this slab as an earlier one: already checked
        seen.add(key)
        sub = [(boxes[i][0][1:], boxes[i][1][1:]) for i in sorted(active)]
        if not sub:
            problems.append(f"gap at {_at(where, d, lo, hi)} (no chunk covers these rows)")
            continue
        _tile(shape[1:], sub, (*where, f"{lo}:{hi}"), problems)


def _at(where: tuple[str, ...], d: int, lo: int, hi: int) -> str:
    """A region in index notation, e.g. [0:4, 6:8] (d: the dim of lo:hi, after `where`)."""
    del d
    return "[" + ", ".join((*where, f"{lo}:{hi}")) + "]"
