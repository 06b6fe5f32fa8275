"""DCP ``.metadata`` read as it streams in: the restricted machine with column runs handed to it.

`read_metadata_stream` runs the restricted pickle machine (``dcp_vm``, NOTE: [restricted
machine]) over the file a window at a time, with the column runs (``dcp_runs``, NOTE: [metadata
columns]) as its plugin when it builds the mirrors, so long runs of chunk and storage records
become columns. Where columns cannot answer (`Fallback`), the file is read again with every
record an object.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdpcheck._unpickle import on_a_deep_stack
from fsdpcheck.sources.dcp.runs import ChunkRun, ColumnRuns, Fallback, StorageRun
from fsdpcheck.sources.dcp.vm import Input, Machine, Stream, StreamError, TooLarge

#: Files smaller than this are read into objects only (their few records are not worth the
#: column set-up; ``dcp_index.read_parsed``).
SMALL = 32 << 20


@dataclass
class Parsed:
    """What `read_metadata_stream` read.

    Attributes:
        metadata: The root object (a mirror ``Metadata`` for a DCP file): tensors' ``chunks``
            lists may hold `ChunkRun` items standing for consecutive chunks.
        storage_runs: Per dict (by ``id``), the `StorageRun` items that were set into it, in
            order, after its plain items' positions (see `runs_in`).
        names: The strings storage runs refer to (keys and relative paths).
        digest: sha256 of the file's bytes (hex).
        nbytes: The file's size.
        chunk_runs: How many chunk runs were read as columns.
        runs: How many runs (chunk or storage records) were read as columns.
    """

    metadata: Any
    storage_runs: dict[int, list[tuple[int, StorageRun]]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    digest: str = ""
    nbytes: int = 0
    chunk_runs: int = 0
    runs: int = 0

    def runs_in(self, d: Any) -> list[tuple[int, StorageRun]]:
        """The storage runs set into dict `d`: (plain items before each run, run)."""
        return self.storage_runs.get(id(d), [])


def read_metadata_stream(
    fd: int | Stream,
    what: str,
    resolve: Callable[[str, str], Any] | None,
    limit: int,
    *,
    columns: bool = True,
) -> Parsed:
    """Reads an open ``.metadata`` from its start (see the module docstring).

    Args:
        fd: The open file (read from offset 0), or a `Stream` of an object.
        what: The file, for messages.
        resolve: Builds an admitted DCP class (the mirrors); None builds DCP's own classes
            (then no column runs are made).
        limit: Most bytes read.
        columns: Read runs of chunk and storage records as columns (False: objects only).

    Raises:
        StreamError: The pickle is malformed.
        UnsafePickleError: It names a class outside the allowlist.
        ValueError: It is larger than `limit` bytes.
    """
    try:
        return _read(fd, what, resolve, limit, columns)
    except Fallback:
        # Columns could not answer (a reference into a record read as columns, ...): read
        # again, every record an object.
        return _read(fd, what, resolve, limit, False)


def _read(
    fd: int | Stream,
    what: str,
    resolve: Callable[[str, str], Any] | None,
    limit: int,
    columns: bool,
) -> Parsed:
    if isinstance(fd, int):
        os.lseek(fd, 0, os.SEEK_SET)
        size = os.fstat(fd).st_size
    else:
        fd.seek(0)
        size = fd.size
    source = Input(fd, limit)
    # Column runs only into the mirrors (DCP's classes are built for DCP, whole).
    runs = ColumnRuns(resolve) if columns and resolve is not None else None
    machine = Machine(source, what, resolve, runs)
    if runs is not None:
        runs.attach(machine)
    try:
        md = on_a_deep_stack(machine.load, min(limit, size))
    except TooLarge:
        raise ValueError(f"larger than {limit} bytes") from None
    except (struct.error, IndexError, TypeError, AttributeError, KeyError, UnicodeDecodeError,
            RecursionError, OverflowError, MemoryError, RuntimeError) as exc:  # fmt: skip
        raise StreamError(f"{type(exc).__name__}: {exc}") from None
    finally:
        # The machine and its plugin refer to each other: a cycle that would keep the memo and
        # every decoded batch (~100 MB at 1M chunks) until the next full collection, which a
        # command may never run. Broken here, they go when the last reference does.
        machine.plugin = None
        machine.mlist, machine.memo = [], {}
        if runs is not None:
            runs.detach()
    if runs is None:
        return Parsed(md, digest=source.digest(), nbytes=source.read_total)
    return Parsed(md, runs.storage_runs, runs.names, source.digest(), source.read_total,
                  runs.chunk_runs, runs.runs)  # fmt: skip


def digest_bytes(data: bytes) -> str:
    """The digest `read_metadata_stream` gives the same bytes."""
    return hashlib.sha256(data).hexdigest()


__all__ = [
    "SMALL",
    "ChunkRun",
    "Fallback",
    "Parsed",
    "StorageRun",
    "Stream",
    "StreamError",
    "digest_bytes",
    "read_metadata_stream",
]
