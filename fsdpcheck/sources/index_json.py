"""The ``weight_map`` of a Hugging Face ``*.index.json`` (safetensors and .bin shards alike)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from fsdpcheck.errors import CheckpointError
from fsdpcheck.sources.fileio import open_regular
from fsdpcheck.sources.text import one_line

if TYPE_CHECKING:
    from fsdpcheck.sources.remote import RemotePath

# An index.json larger than this is not an index (real ones are a few MB for huge models).
MAX_INDEX_BYTES = 256 << 20


def read_index(path: Path, what: str = "safetensors index") -> dict[str, str]:
    """The ``weight_map`` of a ``*.safetensors.index.json`` (tensor name -> shard file name).

    Args:
        path: The index file.
        what: What to call it in messages (``*.bin.index.json`` indexes have the same form).

    Raises:
        FileNotFoundError: It does not exist.
        CheckpointError: Not a regular file, too large, not JSON, or no weight_map of strings.
    """
    fd, st = open_regular(path, what)
    try:
        if st.st_size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{what} {path} is larger than {MAX_INDEX_BYTES} bytes")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(MAX_INDEX_BYTES + 1)
    finally:
        os.close(fd)
    return parse_index(data, path, what)


def parse_index(data: bytes, path: Path | RemotePath, what: str) -> dict[str, str]:
    """The ``weight_map`` of an index's bytes (see `read_index`)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{what} {path} is not JSON: {one_line(exc)}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{what} {path} has no 'weight_map' object")
    for k, v in weight_map.items():
        if not isinstance(v, str):
            raise CheckpointError(
                f"{what} {path}: weight_map[{k!r:.80}] is {v!r:.80}, not a file name"
            )
    return weight_map
