"""What a checkpoint holds, read from its metadata only: layout, key mapping, tensors, coverage."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from fsdpcheck.formats import describe_path
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.manifest import read_manifest
from fsdpcheck.sources import open_source


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describes a checkpoint without reading its tensors' data.

    Returns:
        A JSON-serialisable dict: ``layout`` (as ``fsdpcheck.describe_path`` recognises it),
        ``format`` (one line), ``kind`` ("sharded" or "full"), ``tensors`` (per tensor: the
        checkpoint's key, its canonical ``name``, ``role``, shape, dtype, chunks, coverage),
        counts (``model_tensors``, ``optimizer_params``, ``optimizer_tensors``,
        ``param_groups``), ``other`` (training-state entries: lr_scheduler, dataloader, ...),
        ``problems`` (storage problems), ``notes`` and ``manifest`` (None without one).
    """
    info = describe_path(path)
    source = open_source(Path(path))
    try:
        keys = checkpoint_keys(source)
        tensors = []
        dtypes: dict[Any, str] = {}
        for r in sorted(keys.tensors(), key=lambda r: r.key):
            e = r.entry
            # From what the source found when opening (DCP: its check; no chunk list made).
            gaps = source.coverage(e.key)
            n = math.prod(e.shape)
            dtype = dtypes.get(e.dtype)
            if dtype is None:
                dtype = dtypes[e.dtype] = str(e.dtype).removeprefix("torch.")
            tensors.append(
                {
                    "key": e.key,
                    "name": r.name,
                    "role": r.role,
                    "shape": list(e.shape),
                    "dtype": dtype,
                    "chunks": source.chunk_count(e.key),
                    "coverage": "complete" if not gaps else "; ".join(gaps),
                    "numel": n,
                    "bytes": n * (e.dtype.itemsize if e.dtype else 0),
                }
            )
        problems = [{"key": k, "kind": kind, "message": msg} for k, kind, msg in source.problems()]
    finally:
        source.close()
    manifest = read_manifest(info.path) if info.layout == "fsdpcheck" else None
    state_tensors = [r for r in keys.state.values() if r.entry.is_tensor]
    return {
        "path": str(info.path),
        "layout": info.layout,
        "format": info.description,
        "kind": info.kind,
        "tensors": tensors,
        "elements": sum(t["numel"] for t in tensors),
        "bytes": sum(t["bytes"] for t in tensors),
        "model_tensors": len(keys.model),
        "optimizer_params": len({r.fqn for r in keys.state.values()}),
        "optimizer_tensors": len(state_tensors),
        "optimizer_ids": keys.id_keyed,
        "param_groups": len(keys.groups),
        "other": [r.key for r in keys.other],
        "problems": problems,
        "notes": info.notes,
        "manifest": None
        if manifest is None
        else {
            "format_version": manifest.format_version,
            "world_size": manifest.world_size,
            "torch": manifest.torch,
            "fsdpcheck": manifest.fsdpcheck,
            "entries": len(manifest.entries),
        },
    }
