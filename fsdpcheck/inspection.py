"""What a checkpoint holds, read from its metadata only: layout, key mapping, tensors, coverage."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

from fsdpcheck.formats import describe_path
from fsdpcheck.keys import checkpoint_keys
from fsdpcheck.manifest import read_manifest
from fsdpcheck.reading.references import open_info

#: Placeholder of ``tensors`` in `inspecting`'s summary (the tensors come one at a time).
TENSORS = "\0tensors\0"


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describes a checkpoint without reading its tensors' data.

    Returns:
        A JSON-serialisable dict: ``layout`` (as ``fsdpcheck.describe_path`` recognises it),
        ``format`` (one line), ``kind`` ("sharded" or "full"), ``tensors`` (per tensor: the
        checkpoint's key, its canonical ``name``, ``role``, shape, dtype, chunks, coverage),
        counts (``model_tensors``, ``optimizer_params``, ``optimizer_tensors``,
        ``param_groups``), ``other`` (training-state entries: lr_scheduler, dataloader, ...),
        ``problems`` (storage problems), ``notes``, ``manifest`` (None without one) and
        ``ok`` (no problem).
    """
    with inspecting(path) as (info, tensors, _):
        info["tensors"] = list(tensors())
    return info


@contextlib.contextmanager
def inspecting(
    path: str | os.PathLike[str],
) -> Iterator[tuple[dict[str, Any], Callable[[], Iterator[dict[str, Any]]], int]]:
    """`inspect_checkpoint`'s dict with its tensors made one at a time, while the block runs.

    NOTE: [inspect memory] A dict per tensor is ~500 bytes: a million of them, and their lines
    of text, were most of what ``inspect`` held. The summary comes whole (``tensors`` is
    `TENSORS`, in its place); the function given makes the tensors' dicts in key order, as they
    are printed, and can be called again.

    Yields:
        (the summary, a function that iterates the tensors' dicts, how many tensors).
    """
    info = describe_path(path)
    source = open_info(info)
    try:
        keys = checkpoint_keys(source)
        rows = sorted((r for r in keys.rows if r.entry.is_tensor), key=lambda r: r.key)
        dtypes: dict[Any, str] = {}

        def dtype_name(dtype: Any) -> str:
            name = dtypes.get(dtype)
            if name is None:
                name = dtypes[dtype] = str(dtype).removeprefix("torch.")
            return name

        def tensors() -> Iterator[dict[str, Any]]:
            for r in rows:
                e = r.entry
                # From what the source found when opening (DCP: its check; no chunk list made).
                gaps = source.coverage(e.key)
                n = math.prod(e.shape)
                yield {
                    "key": e.key,
                    "name": r.name,
                    "role": r.role,
                    "shape": list(e.shape),
                    "dtype": dtype_name(e.dtype),
                    "chunks": source.chunk_count(e.key),
                    "coverage": "complete" if not gaps else "; ".join(gaps),
                    "numel": n,
                    "bytes": n * (e.dtype.itemsize if e.dtype else 0),
                }

        numel = [math.prod(r.entry.shape) for r in rows]
        elements = sum(numel)
        nbytes = sum(
            n * (r.entry.dtype.itemsize if r.entry.dtype else 0) for n, r in zip(numel, rows)
        )
        del numel
        problems = [{"key": k, "kind": kind, "message": msg} for k, kind, msg in source.problems()]
        manifest = read_manifest(info.path) if info.layout == "fsdpcheck" else None
        state_tensors = sum(1 for r in keys.state.values() if r.entry.is_tensor)
        summary = {
            "path": str(info.path),
            "layout": info.layout,
            "format": info.description,
            "kind": info.kind,
            "tensors": TENSORS,
            "elements": elements,
            "bytes": nbytes,
            "model_tensors": len(keys.model),
            "optimizer_params": len({r.fqn for r in keys.state.values()}),
            "optimizer_tensors": state_tensors,
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
            "ok": not problems,  # last: a document stopped half way ends with it (the CLI)
        }
        yield summary, tensors, len(rows)
    finally:
        source.close()
