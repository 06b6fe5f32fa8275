"""torch.save files, loaded weights-only with mmap and read where the bytes lie."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fsdpcheck._compat import tensor_kind_problem
from fsdpcheck._unpickle import load_weights_only
from fsdpcheck.errors import CheckpointError
from fsdpcheck.layout import strides_problem
from fsdpcheck.sources.base import Entry, Problem, Region, Source, slices
from fsdpcheck.sources.fileio import open_regular
from fsdpcheck.sources.full import nested_entries, read_each
from fsdpcheck.sources.rawio import populate
from fsdpcheck.sources.text import one_line

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _load_error(exc: BaseException) -> str:
    """torch.load's failure in one line: the weights-only unpickler's reason when it gave one."""
    text = _ANSI.sub("", str(exc))
    for line in text.splitlines():
        if line.strip().startswith("WeightsUnpickler error:"):
            return line.strip() + " (not loaded: fsdpcheck loads weights only)"
    return one_line(Exception(text))


def overlap_in_memory(t: torch.Tensor) -> bool:
    """Whether some elements of `t` share memory (an expanded / stride-0 or overlapping view).

    The usual sufficient test for a non-overlapping layout: with dims of size > 1 sorted by
    stride, each stride is at least the extent of the dims before it.
    """
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride < expected:
            return True
        expected = stride * size
    return False


class TorchSaveSource(Source):
    """A torch.save file, loaded with mmap=True and ``weights_only``.

    Only the boxes that are read leave the disk, and no code from the file runs. CPU reads are
    views of the mapped tensors (no copy; the kernels read strided data in place).
    Nested layouts are accepted (``{"model": ..., "optimizer": ...}``, ``{"state_dict": ...}``);
    the nesting becomes the entries' paths. Tensors whose elements overlap in memory (an
    expanded / stride-0 view, e.g. ``torch.zeros(1).expand(2**36)`` stored in 4 bytes) are
    refused: they are listed by `problems` and reading them raises `CheckpointError`, so a tiny
    file can never make a read allocate or hash terabytes. A state dict never holds such views
    (``torch.save`` of a parameter stores its dense data).
    """

    kind = "torch.save"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.description = f"torch.save file {self.path}"
        # torch opens the file by name: it is given the descriptor checked to be a regular file
        # (NOTE: [open by what it is] in ``fileio``), by its /proc name where there is one.
        fd, _ = open_regular(self.path, "torch.save file")
        by_fd = f"/proc/self/fd/{fd}"
        target = by_fd if os.path.exists(by_fd) else self.path
        try:
            try:
                obj = load_weights_only(target, map_location="cpu", mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                # Files written with _use_new_zipfile_serialization=False cannot be mapped.
                obj = load_weights_only(target, map_location="cpu")
        except (FileNotFoundError, MemoryError):
            raise
        except Exception as exc:
            msg = f"{self.description} cannot be loaded: {_load_error(exc)}"
            raise CheckpointError(msg) from None
        finally:
            os.close(fd)
        flat: dict[str, tuple[tuple[str, ...], Any]] = {}
        collisions: set[str] = set()
        try:
            nested_entries(obj, (), flat, collisions)
        except RecursionError:
            raise CheckpointError(f"{self.description} is nested too deeply") from None
        self._values: dict[str, Any] = {}
        self._entries: dict[str, Entry] = {}
        self._refused: dict[str, str] = {}
        for key in sorted(collisions):
            self._refused[key] = (
                f"{self.description}: two entries flatten to the key {key!r} (e.g. 'a.b' and "
                "{'a': {'b': ...}}); which one is meant is unknown"
            )
        for key, (path_t, value) in flat.items():
            self._values[key] = value
            if isinstance(value, torch.Tensor):
                shape = (value.size(0),) if value.is_nested else tuple(value.shape)
                self._entries[key] = Entry(key, path_t, shape, value.dtype)
                kind = tensor_kind_problem(value, quantized=False) or strides_problem(value)
                if kind is not None:
                    self._refused[key] = f"{self.description}: {key} is {kind}"
                elif overlap_in_memory(value):
                    stored = value.untyped_storage().nbytes()
                    self._refused[key] = (
                        f"{self.description}: {key} is an expanded view (strides "
                        f"{tuple(value.stride())}) whose {value.numel()} elements share "
                        f"{stored} stored bytes; refusing to read it (save a dense copy)"
                    )
            else:
                self._entries[key] = Entry(key, path_t, is_tensor=False)

    def entries(self) -> dict[str, Entry]:
        """Every leaf of the saved object."""
        return self._entries

    def problems(self) -> list[Problem]:
        """Expanded / overlapping views, sparse tensors and flattened-key collisions."""
        return [(k, "error", msg) for k, msg in sorted(self._refused.items())]

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Slices of the mapped tensors, copied to `device` (only their pages are read).

        Raises:
            CheckpointError: A region of a tensor that `problems` names.
        """
        for r in regions:
            if r.key in self._refused:
                raise CheckpointError(self._refused[r.key])

        def fetch(r: Region) -> torch.Tensor:
            return self._values[r.key][slices(r)] if r.size else self._values[r.key]

        if device.type == "cpu":
            # The kernels read strided data in place: the mapped pages are handed over as they
            # lie, no copy (a source may return views instead of filling `out`).
            views = [fetch(r) for r in regions]
            for v in views:
                populate(v)
            return views
        return read_each(regions, device, out, fetch)

    def read_object(self, key: str) -> Any:
        """A non-tensor leaf."""
        if key in self._refused:
            raise CheckpointError(self._refused[key])
        return self._values[key]
