"""Full-tensor checkpoints: torch.save files and safetensors, both read where the bytes lie."""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fsdpcheck._unpickle import load_weights_only
from fsdpcheck.sources.base import (
    CheckpointError,
    Entry,
    Problem,
    Region,
    Source,
    check_regular,
    file_problem,
    into,
    nested_entries,
    one_line,
    read_each,
    slices,
)
from fsdpcheck.sources.rawio import map_private, mapped_view, populate

# An index.json larger than this is not an index (real ones are a few MB for huge models).
_MAX_INDEX_BYTES = 256 << 20
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
        self.path = check_regular(path, "torch.save file")
        self.description = f"torch.save file {self.path}"
        try:
            try:
                obj = load_weights_only(self.path, map_location="cpu", mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                # Files written with _use_new_zipfile_serialization=False cannot be mapped.
                obj = load_weights_only(self.path, map_location="cpu")
        except (FileNotFoundError, MemoryError):
            raise
        except Exception as exc:
            msg = f"{self.description} cannot be loaded: {_load_error(exc)}"
            raise CheckpointError(msg) from None
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
                self._entries[key] = Entry(key, path_t, tuple(value.shape), value.dtype)
                if value.layout != torch.strided:
                    self._refused[key] = (
                        f"{self.description}: {key} is a {value.layout} tensor; only dense "
                        "tensors can be checked"
                    )
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


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# A mapped safetensors file: its mapping, where the data starts, and per tensor
# (begin, end, dtype name, shape) relative to that start.
_Layout = tuple[mmap.mmap, int, dict[str, tuple[int, int, str, tuple[int, ...]]]]
# safetensors refuses headers larger than this too.
_MAX_HEADER = 100_000_000


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _safetensors_layout(f: Path) -> _Layout | None:
    """The file mapped (`map_private`), where each tensor's bytes are; None if anything is off."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate keys")
        return dict(pairs)

    try:
        with open(check_regular(f, "safetensors file"), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) != 8:
                return None
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER or 8 + n > size:
                return None
            header = json.loads(fh.read(n), object_pairs_hook=no_duplicates)
            mapped = map_private(fh.fileno())  # holds its own descriptor
            if mapped is None:
                return None
        where: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            b, e = info["data_offsets"]
            shape = tuple(info["shape"])
            if not all(type(v) is int and v >= 0 for v in (b, e, *shape)) or b > e:
                return None
            where[key] = (b, e, str(info["dtype"]), shape)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, RecursionError):
        return None
    return mapped, 8 + n, where


def read_index(path: Path, what: str = "safetensors index") -> dict[str, str]:
    """The ``weight_map`` of a ``*.safetensors.index.json`` (tensor name -> shard file name).

    Args:
        path: The index file.
        what: What to call it in messages (``*.bin.index.json`` indexes have the same form).

    Raises:
        FileNotFoundError: It does not exist.
        CheckpointError: Not a regular file, too large, not JSON, or no weight_map of strings.
    """
    check_regular(path, what)
    if path.stat().st_size > _MAX_INDEX_BYTES:
        raise CheckpointError(f"{what} {path} is larger than {_MAX_INDEX_BYTES} bytes")
    try:
        doc = json.loads(path.read_bytes())
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


class SafetensorsSource(Source):
    """One or more .safetensors files (a file, a HF ``*.safetensors.index.json``, or a folder).

    With an index, the index is the authority: every entry must name a regular file inside the
    index's folder that holds the named tensor, and reads go to that file only. Entries that
    fail are left out of `entries` and listed by `problems`, as are stray copies of a tensor in
    another shard and tensors a shard holds that the index does not list. Without an index, a
    tensor in two files is a problem and reading it raises (there is no authority to choose).
    Dtypes fsdpcheck cannot compare (U16/U32/U64, complex, F8_E8M0, ...) are refused when
    opening, naming the file, the tensor and the dtype. On the CPU, boxes are views of the
    memory-mapped file at whatever byte offset they lie (NOTE: [mapped files] in ``rawio``: the
    kernels read them in place, pages mapped ahead by the reader thread); a tensor whose header
    entry does not agree with what safetensors read, and every read for another device, go
    through ``get_slice``, which reads just those bytes.
    """

    kind = "safetensors"

    def __init__(
        self,
        files: Sequence[Path],
        description: str,
        weight_map: dict[str, str] | None = None,
        root: Path | None = None,
    ) -> None:
        from safetensors import safe_open

        self.description = description
        self._problems: list[Problem] = []
        self._refused: dict[str, str] = {}
        opened: list[Path] = []
        if weight_map is not None:
            assert root is not None
            bad_files: dict[str, str] = {}
            for name in sorted(set(weight_map.values())):
                why = file_problem(root, name, 0, f"index entry {name!r}")
                if why is not None:
                    bad_files[name] = why
                else:
                    opened.append(root / name)
            for key, name in weight_map.items():
                if name in bad_files:
                    self._problems.append((key, "error", f"{description}: {bad_files[name]}"))
        else:
            opened = list(files)
        self._handles: dict[Path, Any] = {}
        self._sizes: dict[Path, int] = {}
        for f in opened:
            check_regular(f, "safetensors file")
            try:
                self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
                self._sizes[f] = f.stat().st_size
            except Exception as exc:
                msg = f"safetensors file {f} is unreadable: {one_line(exc)}"
                raise CheckpointError(msg) from None
        self._file_of: dict[str, Path] = {}
        self._entries: dict[str, Entry] = {}
        self._layout: dict[Path, _Layout | None] = {}
        self._mapped: dict[str, int | None] = {}  # key -> byte offset in its mapped file
        #: Whether CPU reads may return views of the mapped files (False: always get_slice).
        self.mapped_reads = True
        held: dict[str, list[Path]] = {}
        for f, h in self._handles.items():
            for key in h.keys():  # noqa: SIM118 - safe_open handles are not mappings
                held.setdefault(key, []).append(f)
        if weight_map is not None:
            assert root is not None
            for key, name in weight_map.items():
                f = root / name
                if f not in self._handles:
                    continue  # already a problem
                if f not in held.get(key, []):
                    msg = f"{description} names {name} for {key}, but {name} has no such tensor"
                    self._problems.append((key, "error", msg))
                    continue
                self._add(key, f)
            for key, where in held.items():
                named = weight_map.get(key)
                for f in where:
                    if named is None:
                        msg = f"{f.name} holds {key}, which {description} does not list (not read)"
                        self._problems.append((key, "error", msg))
                    elif f != root / named:
                        msg = (
                            f"a stray copy of {key} is in {f.name}; {description} names "
                            f"{named}, which is what is read"
                        )
                        self._problems.append((key, "error", msg))
        else:
            for key, where in held.items():
                self._add(key, where[0])
                if len(where) > 1:
                    self._refused[key] = (
                        f"{key} is in both {where[0]} and {where[1]} and no index says which "
                        "is meant; refusing to read either"
                    )
                    self._problems.append((key, "error", self._refused[key]))

    def _add(self, key: str, f: Path) -> None:
        sl = self._handles[f].get_slice(key)
        name = sl.get_dtype()
        dtype = _SAFETENSORS_DTYPES.get(name)
        if dtype is None:
            raise CheckpointError(
                f"safetensors file {f}: tensor {key} has dtype {name}, which fsdpcheck cannot "
                f"compare (supported: {', '.join(_SAFETENSORS_DTYPES)})"
            )
        self._file_of[key] = f
        self._entries[key] = Entry(key, tuple(key.split(".")), tuple(sl.get_shape()), dtype)

    def _mapped_tensor(self, key: str) -> torch.Tensor | None:
        """The whole tensor as a view of its memory-mapped file, or None (read with get_slice).

        The header is parsed here too and must agree with what safetensors read (dtype, shape)
        and describe exactly the tensor's bytes inside the file (at any byte offset: files not
        written by safetensors' own writer need not pad); anything else (duplicate header keys,
        a file that shrank) falls back to get_slice, which copies.
        """
        f = self._file_of[key]
        entry = self._entries[key]
        if key not in self._mapped:
            if f not in self._layout:
                self._layout[f] = _safetensors_layout(f)
            layout = self._layout[f]
            at = None
            if layout is not None and key in layout[2] and entry.dtype is not None:
                _, base, table = layout
                start, end, dtype_name, shape = table[key]
                if (
                    _SAFETENSORS_DTYPES.get(dtype_name) == entry.dtype
                    and shape == entry.shape
                    and end - start == math.prod(shape) * entry.dtype.itemsize
                ):
                    at = base + start
            self._mapped[key] = at
        at = self._mapped[key]
        layout = self._layout[f]
        if at is None or layout is None or entry.dtype is None:
            return None
        # A fresh view each time: mapped_view checks the file's size now (SIGBUS otherwise).
        strides = _contiguous_strides(entry.shape)
        return mapped_view(layout[0], at, entry.dtype, entry.shape, strides)

    @classmethod
    def from_path(cls, path: Path) -> SafetensorsSource:
        """A .safetensors file, an index .json, or a folder of .safetensors files.

        Raises:
            FileNotFoundError: The path does not exist, or a folder holds no safetensors.
            CheckpointError: A file is unreadable or refused (see the class docstring).
        """
        if path.is_dir():
            index = sorted(path.glob("*.safetensors.index.json"))
            if index:
                return cls.from_path(index[0])
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{path} holds no .safetensors files")
            return cls(files, f"safetensors files in {path}")
        if path.suffix == ".json":
            weight_map = read_index(path)
            return cls([], f"safetensors index {path}", weight_map, path.parent)
        return cls([path], f"safetensors file {path}")

    def entries(self) -> dict[str, Entry]:
        """Every tensor the index lists and its shard holds (every tensor, without an index)."""
        return self._entries

    def problems(self) -> list[Problem]:
        """Index entries that fail, stray or unlisted copies, ambiguous duplicates."""
        return list(self._problems)

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Each region read with get_slice (only its bytes), then moved to `device`.

        Raises:
            CheckpointError: A tensor held by two files with no index to choose, or a file
                that shrank since it was opened.
        """
        for r in regions:
            if r.key in self._refused:
                raise CheckpointError(self._refused[r.key])
        for f in {self._file_of[r.key] for r in regions}:
            # Both safetensors' reader and the mapped views read a mapping of the file: one that
            # shrank since it was opened would kill the process (SIGBUS) instead of raising.
            now = f.stat().st_size
            if now < self._sizes[f]:
                raise CheckpointError(
                    f"safetensors file {f} shrank from {self._sizes[f]} to {now} bytes after it "
                    "was opened; refusing to read it (was it being rewritten?)"
                )

        def fetch(r: Region) -> torch.Tensor:
            h = self._handles[self._file_of[r.key]]
            return h.get_slice(r.key)[slices(r)] if r.size else h.get_tensor(r.key)

        if device.type == "cpu" and self.mapped_reads:
            # Read in place: views of the mapped file (no copy), pages mapped now.
            result = []
            for i, r in enumerate(regions):
                whole = self._mapped_tensor(r.key)
                if whole is None:
                    result.append(into(fetch(r), out[i] if out is not None else None, device))
                    continue
                v = whole[slices(r)] if r.size else whole
                populate(v)
                result.append(v)
            return result
        return read_each(regions, device, out, fetch)
