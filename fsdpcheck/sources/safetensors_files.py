"""safetensors files, read where the bytes lie.

One file, a ``*.safetensors.index.json`` of shards, or a folder of them.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdpcheck.errors import CheckpointError
from fsdpcheck.sources.base import Entry, Problem, Region, Source, slices
from fsdpcheck.sources.fileio import file_problem, open_regular
from fsdpcheck.sources.full import into, read_each
from fsdpcheck.sources.index_json import read_index
from fsdpcheck.sources.rawio import (
    Mapped,
    Readable,
    aligned_empty,
    damaged,
    map_guarded,
    map_private,
    mapped_view,
    populate,
    pread,
    pread_into,
)
from fsdpcheck.sources.remote import RemotePath
from fsdpcheck.sources.text import one_line

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


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


# safetensors refuses headers larger than this too.
_MAX_HEADER = 100_000_000
# Bits per element of every dtype safetensors knows (those fsdpcheck cannot compare included).
_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "I64": 64,
         "I32": 32, "I16": 16, "I8": 8, "U8": 8, "BOOL": 8, "U16": 16, "U32": 32, "U64": 64,
         "C64": 64, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}  # fmt: skip
_DTYPE_LIST = list(_SAFETENSORS_DTYPES)

# NOTE: [safetensors headers] The header is parsed here, not by the safetensors library: it
# holds a map per tensor (~200 bytes each in Rust, more as Python objects), a million-entry
# file took 2.2 GB to inspect that way, and its open of the path is not the open that was
# checked to be a regular file. The compact form safetensors' own writer emits is matched by
# one regular expression a few MB at a time into columns; any other JSON goes through
# json.loads (one small tuple per entry). Both refuse what safetensors refuses (offsets that do
# not tile the data exactly, sizes that disagree with shape and dtype, duplicate names).
_ENTRY = (
    rb'"([^"\\]*(?:\\.[^"\\]*)*)":\{"dtype":"([A-Z0-9_]+)","shape":\[([0-9,]*)\],'
    rb'"data_offsets":\[([0-9]+),([0-9]+)\]\}'
)
_ENTRIES = re.compile(b"(?:" + _ENTRY + b",)*", re.S)
_FIELDS = re.compile(_ENTRY, re.S)
_STR = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_META = re.compile(rb'"__metadata__":\{(?:' + _STR + b":" + _STR + rb",?)*\},?")


class _Header:
    """A safetensors file's tensors as columns (NOTE: [safetensors headers]).

    Attributes:
        names: Tensor names, in header order.
        at: Name -> position.
        dtypes: Per tensor: index into the dtype names (`_DTYPE_LIST`; -1 unsupported).
        shapes: Per tensor: its shape.
        begin / end: Per tensor: its bytes, relative to `base`.
        base: Where the data starts in the file (8 + header length).
        size: The file's size when the header was read.
    """

    def __init__(self, path: Path | RemotePath, fd: Readable, size: int) -> None:
        what = f"safetensors file {path}"
        head = pread(fd, 8, 0)
        if len(head) != 8:
            raise CheckpointError(f"{what} is unreadable: shorter than its 8-byte header size")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{what} is unreadable: its header of {n} bytes does not fit "
                                  f"in the file of {size} bytes")  # fmt: skip
        raw = pread(fd, n, 8)
        if len(raw) != n:
            raise CheckpointError(f"{what} changed while it was read: it was truncated")
        self.base, self.size = 8 + n, size
        self.names: list[str] = []
        self.dtypes = array("b")
        self.shapes: list[tuple[int, ...]] = []
        self.begin = array("q")
        self.end = array("q")
        self.unsupported: dict[str, str] = {}
        if not self._fast(raw):
            self._slow(raw, what)
        if len(set(self.names)) != len(self.names):
            seen: set[str] = set()
            dup = next(k for k in self.names if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise CheckpointError(f"{what} is unreadable: the tensor {dup!r:.80} is named twice")
        self._validate(what, size)
        self._at: dict[str, int] | None = None

    @property
    def at(self) -> dict[str, int]:
        """Name -> position (made when first needed: ``inspect`` never needs it)."""
        if self._at is None:
            self._at = {k: i for i, k in enumerate(self.names)}
        return self._at

    def drop_columns(self) -> None:
        """Frees the per-tensor columns once the entries hold what reads need."""
        self.names, self.shapes, self.dtypes = [], [], array("b")
        self.begin, self.end, self.unsupported, self._at = array("q"), array("q"), {}, None

    def _fast(self, raw: bytes) -> bool:
        # The padding is stripped by position, not by a copy of the header (~100 bytes a key).
        stop = len(raw)
        while stop:
            lo = max(0, stop - 4096)
            tail = raw[lo:stop].rstrip(b" ")
            stop = lo + len(tail)
            if tail:
                break
        text = raw
        if not (text[:1] == b"{" and text[stop - 1 : stop] == b"}") or stop < 2:
            return False
        pos, end = 1, stop - 1
        m = _META.match(text, pos)
        if m is not None:
            pos = m.end()
        while pos < end:
            stop = min(end, pos + (4 << 20))
            m = _ENTRIES.match(text, pos, stop)
            assert m is not None
            got = m.end()
            if got == pos:  # the last entry (no comma after it) or not the compact form
                last = _FIELDS.match(text, pos, end)
                if last is None or last.end() != end:
                    return False
                got = end
            self._add(_FIELDS.findall(text, pos, got))
            pos = got
            if pos < end and text[pos - 1 : pos] != b",":
                return False
        return True

    def _add(self, found: list[tuple[bytes, ...]]) -> None:
        shapes: dict[bytes, tuple[int, ...]] = {}  # shared: most tensors repeat a few shapes
        for name, dtype, shape, b, e in found:
            key = name.decode("utf-8") if b"\\" not in name else json.loads(b'"' + name + b'"')
            dims = shapes.get(shape)
            if dims is None:
                dims = shapes[shape] = tuple(map(int, shape.split(b","))) if shape else ()
            self._entry(key, dtype.decode(), dims, int(b), int(e))

    def _entry(self, key: str, dtype: str, shape: tuple[int, ...], b: int, e: int) -> None:
        self.names.append(key)
        code = _DTYPE_INDEX.get(dtype, -1)
        if code < 0:
            self.unsupported[key] = dtype
        self.dtypes.append(code)
        self.shapes.append(shape)
        self.begin.append(b)
        self.end.append(e)

    def _slow(self, raw: bytes, what: str) -> None:
        """Any other JSON form: json.loads, one small tuple per entry."""

        def entry(pairs: list[tuple[str, Any]]) -> Any:
            d = dict(pairs)
            if len(d) != len(pairs):
                raise ValueError("a name appears twice")
            if set(d) == {"dtype", "shape", "data_offsets"}:
                return _Info(d["dtype"], d["shape"], d["data_offsets"])
            return d

        try:
            doc = json.loads(raw, object_pairs_hook=entry)
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{what} is unreadable: its header is not JSON: "
                                  f"{one_line(exc)}") from None  # fmt: skip
        if not isinstance(doc, dict):
            raise CheckpointError(f"{what} is unreadable: its header is not a JSON object")
        for key, info in doc.items():
            if key == "__metadata__":
                continue
            if not isinstance(info, _Info):
                raise CheckpointError(f"{what} is unreadable: the header entry {key!r:.80} is not "
                                      "a tensor (dtype, shape, data_offsets)")  # fmt: skip
            ok = (
                isinstance(info.dtype, str)
                and isinstance(info.shape, list)
                and all(type(v) is int and v >= 0 for v in info.shape)
                and isinstance(info.offsets, list)
                and len(info.offsets) == 2
                and all(type(v) is int and v >= 0 for v in info.offsets)
            )
            if not ok:
                raise CheckpointError(f"{what} is unreadable: the header entry {key!r:.80} is "
                                      "malformed")  # fmt: skip
            self._entry(key, info.dtype, tuple(info.shape), *info.offsets)

    def _validate(self, what: str, size: int) -> None:
        """What safetensors checks: the tensors' bytes tile the data exactly, sizes agree."""
        n = len(self.names)
        begin = torch.frombuffer(self.begin, dtype=torch.int64) if n else torch.zeros(0)
        # Headers list their tensors in file order as a rule: then no sorted copy is made.
        ordered = n < 2 or bool((begin[1:] >= begin[:-1]).all())
        order: Sequence[int] = range(n) if ordered else sorted(range(n), key=self.begin.__getitem__)
        start = 0
        for i in order:
            b, e, key = self.begin[i], self.end[i], self.names[i]
            if b != start or e < b:
                raise CheckpointError(f"{what} is unreadable: the bytes of {key!r:.80} "
                                      f"([{b}, {e})) do not follow the tensor before them "
                                      f"(which ends at {start})")  # fmt: skip
            start = e
            bits = math.prod(self.shapes[i]) * _BITS.get(self._dtype_name(i), 8)
            if bits % 8 or e - b != bits // 8:
                raise CheckpointError(f"{what} is unreadable: {key!r:.80} has shape "
                                      f"{self.shapes[i]} but {e - b} bytes")  # fmt: skip
        if self.base + start != size:
            raise CheckpointError(f"{what} is unreadable: its tensors end at byte "
                                  f"{self.base + start} but the file has {size} bytes")  # fmt: skip

    def _dtype_name(self, i: int) -> str:
        code = self.dtypes[i]
        return _DTYPE_LIST[code] if code >= 0 else self.unsupported[self.names[i]]


@dataclass(frozen=True, slots=True)
class _Located(Entry):
    """An entry of a safetensors file with its position in the file's header.

    NOTE: [safetensors entries] A flat name is its own path, so `path` is empty rather than a
    tuple per entry, and reads find a tensor's bytes by `start` rather than by a second map of
    names; the header's columns are dropped once the entries are made. At a million tensors
    that is ~200 bytes a key less.
    """

    start: int = -1  # where its bytes start in its file


_DTYPE_INDEX = {name: i for i, name in enumerate(_DTYPE_LIST)}
_TORCH = [_SAFETENSORS_DTYPES[n] for n in _DTYPE_LIST]


class _Info:
    __slots__ = ("dtype", "offsets", "shape")

    def __init__(self, dtype: Any, shape: Any, offsets: Any) -> None:
        self.dtype, self.shape, self.offsets = dtype, shape, offsets


class SafetensorsSource(Source):
    """One or more .safetensors files (a file, a HF ``*.safetensors.index.json``, or a folder).

    With an index, the index is the authority: every entry must name a regular file inside the
    index's folder that holds the named tensor, and reads go to that file only. Entries that
    fail are left out of `entries` and listed by `problems`, as are tensors a shard holds that
    the index does not list; a stray copy of a listed tensor in another shard is listed under
    ``<shard>/<name>`` (the listed copy is still read). Without an index, a tensor in two files
    is a problem and reading it raises (there is no authority to choose). Dtypes fsdpcheck
    cannot compare (U16/U32/U64, complex, F8_E8M0, ...) are refused when opening, naming the
    file, the tensor and the dtype. Headers are parsed here (NOTE: [safetensors headers]).

    Reads: `read_views` returns views of the file mapped through the guard (NOTE: [mapped
    files] and [mapped-file guard] in ``rawio``); `read` to the CPU returns views of a plain
    mapping (kept by callers such as a full load: a truncation then ends the process, as any
    mapping does), refusing a file that shrank since it was opened; reads for another device
    are byte-range reads of the rows a region needs. Files are opened when read and closed
    after.
    """

    kind = "safetensors"
    flat_names = True

    def __init__(
        self,
        files: Sequence[Path],
        description: str,
        weight_map: dict[str, str] | None = None,
        root: Path | None = None,
    ) -> None:
        self.description = description
        self._problems: list[Problem] = []
        self._refused: dict[str, str] = {}
        opened: list[Path] = []
        if weight_map is not None:
            assert root is not None
            bad_files: dict[str, str] = {}
            for name in sorted(set(weight_map.values())):
                why = self._file_problem(root, name, f"index entry {name!r}")
                if why is not None:
                    bad_files[name] = why
                else:
                    opened.append(root / name)
            for key, name in weight_map.items():
                if name in bad_files:
                    self._problems.append((key, "error", f"{description}: {bad_files[name]}"))
        else:
            opened = list(files)
        self._headers: dict[Path, _Header] = {}
        for f in opened:
            self._headers[f] = self._header(f)
        self._file_of: dict[str, Path] = {}
        self._entries: dict[str, Entry] = {}
        self._plain: dict[Path, mmap.mmap | None] = {}
        self._guarded: dict[Path, Mapped | None] = {}
        self._handed: dict[int, Path] = {}
        self._lock = threading.Lock()
        #: Whether CPU reads may return views of the mapped files (False: byte-range reads).
        self.mapped_reads = True
        if weight_map is not None:
            assert root is not None
            for key, name in weight_map.items():
                f = root / name
                h = self._headers.get(f)
                if h is None:
                    continue  # already a problem
                i = h.at.get(key)
                if i is None:
                    msg = f"{description} names {name} for {key}, but {name} has no such tensor"
                    self._problems.append((key, "error", msg))
                    continue
                self._add(key, f, i)
            for f, h in self._headers.items():
                for key in h.names:
                    named = weight_map.get(key)
                    if named is None:
                        msg = f"{f.name} holds {key}, which {description} does not list (not read)"
                        self._problems.append((key, "error", msg))
                    elif f != root / named:
                        # Under its own name: the copy the index names is still read.
                        msg = (
                            f"a stray copy of {key} is in {f.name}; {description} names "
                            f"{named}, which is what is read"
                        )
                        self._problems.append((f"{f.name}/{key}", "error", msg))
        else:
            seen: dict[str, Path] = {}
            one = len(self._headers) == 1
            for f, h in self._headers.items():
                if h.unsupported:
                    bad = next(k for k in h.names if k in h.unsupported)
                    self._add(bad, f, h.at[bad])  # raises, naming it
                for i, key in enumerate(h.names):
                    first = None if one else seen.get(key)
                    if first is None:
                        if not one:
                            seen[key] = f
                            self._file_of[key] = f
                        self._entries[key] = _Located(
                            key, (), h.shapes[i], _TORCH[h.dtypes[i]], True, h.base + h.begin[i]
                        )
                    elif key not in self._refused:
                        self._refused[key] = (
                            f"{key} is in both {first} and {f} and no index says which is "
                            "meant; refusing to read either"
                        )
                        self._problems.append((key, "error", self._refused[key]))
        for h in self._headers.values():
            h.drop_columns()  # NOTE: [safetensors entries]

    def _header(self, f: Path) -> _Header:
        """The parsed header of one file (opened by what it is, closed after)."""
        fd, st = open_regular(f, "safetensors file")
        try:
            return _Header(f, fd, st.st_size)
        finally:
            os.close(fd)

    def _file_problem(self, root: Path, name: str, what: str) -> str | None:
        """Why the file an index names cannot be read at all (one line), or None."""
        return file_problem(root, name, 0, what)

    def _add(self, key: str, f: Path, i: int) -> None:
        h = self._headers[f]
        if h.dtypes[i] < 0:
            raise CheckpointError(
                f"safetensors file {f}: tensor {key} has dtype {h.unsupported[key]}, which "
                f"fsdpcheck cannot compare (supported: {', '.join(_SAFETENSORS_DTYPES)})"
            )
        if len(self._headers) > 1:
            self._file_of[key] = f
        self._entries[key] = _Located(
            key, (), h.shapes[i], _TORCH[h.dtypes[i]], True, h.base + h.begin[i]
        )

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

    def share_names(self, other: Source) -> None:
        """Holds the names `other` holds too as `other`'s strings (~80 bytes a name less)."""
        theirs = other.entries()
        shared: dict[str, Entry] = {}
        for key, e in self._entries.items():
            t = theirs.get(key)
            if t is not None and t.key is not key and isinstance(e, _Located):
                key = t.key
                e = _Located(key, (), e.shape, e.dtype, True, e.start)
            shared[key] = e
        self._entries = shared
        if self._file_of:
            self._file_of = {shared[k].key: f for k, f in self._file_of.items()}

    def problems(self) -> list[Problem]:
        """Index entries that fail, stray or unlisted copies, ambiguous duplicates."""
        return list(self._problems)

    def _file(self, key: str) -> Path:
        """The file that holds `key` (the one file, or the one the index names)."""
        if len(self._headers) == 1:
            return next(iter(self._headers))
        return self._file_of[key]

    def _where(self, key: str) -> tuple[Path, int, torch.dtype, tuple[int, ...]]:
        f = self._file(key)
        e = self._entries[key]
        assert isinstance(e, _Located) and e.dtype is not None
        return f, e.start, e.dtype, e.shape

    def _mapped_tensor(self, key: str) -> torch.Tensor | None:
        """The whole tensor as a view of its file mapped through the guard, or None."""
        f, start, dtype, shape = self._where(key)
        with self._lock:
            if f not in self._guarded:
                fd, st = open_regular(f, "safetensors file")
                try:
                    size = min(st.st_size, self._headers[f].size)
                    self._guarded[f] = map_guarded(fd, size, str(f))
                finally:
                    os.close(fd)
            m = self._guarded[f]
            if m is None:
                return None
            self._handed[m.id] = f
        return m.view(start, dtype, shape, _contiguous_strides(shape))

    def _plain_tensor(self, key: str) -> torch.Tensor | None:
        """The whole tensor as a view of a plain mapping of its file, or None."""
        f, start, dtype, shape = self._where(key)
        with self._lock:
            if f not in self._plain:
                fd, _ = open_regular(f, "safetensors file")
                try:
                    self._plain[f] = map_private(fd)
                finally:
                    os.close(fd)
            mapped = self._plain[f]
        if mapped is None:
            return None
        return mapped_view(mapped, start, dtype, shape, _contiguous_strides(shape))

    def _copy(self, r: Region, out: torch.Tensor | None = None) -> torch.Tensor:
        """The region read by byte range: the rows it spans, then the columns it needs.

        Straight into `out` when the region is whole rows and `out` is contiguous.
        """
        f, offset, buf, finish = self._copy_plan(r, out)
        fd, _ = open_regular(f, "safetensors file")
        try:
            pread_into(fd, buf, offset, f"safetensors file {f}: {r.key}", f)
        finally:
            os.close(fd)
        return finish()

    def _copy_plan(
        self, r: Region, out: torch.Tensor | None
    ) -> tuple[Path, int, torch.Tensor, Callable[[], torch.Tensor]]:
        """How `_copy` reads a region: (file, offset, CPU tensor to fill, then what to call).

        The tensor is filled with the file's bytes from the offset on; the function then gives
        the region (a view of those bytes, or `out` itself when they were read into it).
        """
        f, start, dtype, shape = self._where(r.key)
        row = math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize
        r0, rows = (r.offset[0], r.size[0]) if shape else (0, 1)
        whole = (
            out is not None
            and out.device.type == "cpu"
            and out.is_contiguous()
            and tuple(r.size[1:]) == tuple(shape[1:])
        )
        buf = out.view(-1).view(torch.uint8) if whole and out is not None else aligned_empty(
            rows * row)  # fmt: skip

        def finish() -> torch.Tensor:
            if whole and out is not None:
                return out
            t = buf.view(dtype).view((rows, *shape[1:]) if shape else ())
            for d in range(1, len(shape)):
                t = t.narrow(d, r.offset[d], r.size[d])
            return t

        return f, start + r0 * row, buf, finish

    def _refuse(self, regions: Sequence[Region]) -> None:
        for r in regions:
            if r.key in self._refused:
                raise CheckpointError(self._refused[r.key])

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Each region: a view of the mapped file on the CPU, else read by byte range.

        Raises:
            CheckpointError: A tensor held by two files with no index to choose, or a file
                that shrank since it was opened.
        """
        self._refuse(regions)
        if device.type == "cpu" and self.mapped_reads:
            for f in {self._file(r.key) for r in regions}:
                # A plain mapping of a file that shrank since it was opened would kill the
                # process (SIGBUS) instead of raising: checked before every read.
                now = f.stat().st_size
                if now < self._headers[f].size:
                    raise CheckpointError(
                        f"safetensors file {f} shrank from {self._headers[f].size} to {now} "
                        "bytes after it was opened; refusing to read it (was it being "
                        "rewritten?)"
                    )
            result = []
            for i, r in enumerate(regions):
                whole = self._plain_tensor(r.key)
                if whole is None:
                    result.append(into(self._copy(r), out[i] if out is not None else None,
                                       device))  # fmt: skip
                    continue
                v = whole[slices(r)] if r.size else whole
                populate(v)
                result.append(v)
            return result
        return read_each(regions, device, out, self._copy)

    def read_views(
        self, regions: Sequence[Region], out: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Views of the files mapped through the guard (checked by `check_views`)."""
        if type(self).read is not SafetensorsSource.read:  # a subclass that reads its own way
            return self.read(regions, torch.device("cpu"), out)
        self._refuse(regions)
        result = []
        for i, r in enumerate(regions):
            whole = self._mapped_tensor(r.key) if self.mapped_reads else None
            if whole is None:
                got = self._copy(r, out[i])
                result.append(got if got is out[i] else out[i].copy_(got))
                continue
            v = whole[slices(r)] if r.size else whole
            populate(v)
            result.append(v)
        return result

    def check_views(self) -> None:
        """Raises CheckpointError naming a file truncated under views handed out."""
        with self._lock:
            handed = dict(self._handed)
            self._handed.clear()
        hit = damaged(handed)
        if hit:
            f = handed[min(hit)]
            with self._lock:
                for i in hit:
                    self._guarded.pop(handed[i], None)
            raise CheckpointError(
                f"safetensors file {f} changed while it was read: it was truncated, so values "
                "read from it are not reported (run again once nothing writes to it)"
            )
