"""DCP ``.metadata`` read as it streams in: a restricted pickle machine with column fast paths.

NOTE: [metadata columns] A ``.metadata`` of 1,000 tensors saved by 1,024 ranks lists 1,024,000
chunks: 151 MB of pickle. Unpickled into objects (DCP's classes or the mirrors) that is ~2.2 KB
per chunk (a chunk object, its state dict, two ``torch.Size`` and their argument tuples, a
``MetadataIndex`` and a ``_StorageInfo`` with theirs), 2.2 GB and 3.5 s here, and the memo of
the unpickler holds every one of them until the end, so no hook that builds something smaller
per object helps. This module reads the file as it streams in (a few MB at a time) with its own
pickle machine, which admits exactly the globals ``fsdpcheck._unpickle.admitted_global`` admits
and builds the same mirror objects for everything but the chunks: where ``pickle.dump`` wrote a
long run of chunk records (``ChunkStorageMetadata`` in a tensor's ``chunks`` list) or of
storage records (``MetadataIndex`` -> ``_StorageInfo`` pairs in ``storage_data``), one regular
expression matches the whole run (records are self-delimiting byte patterns once the memo slots
of the classes and field names are known) and the integers of every record are decoded at once
from fixed windows with tensor ops into columns. Measured on 2 cores: the 151 MB file in 2.5 s
of CPU and ~100 MB above start-up, against 3.5 s and 2.2 GB.

Equivalence with pickle: a run is taken only where the memo is append-only (no slot set ahead
of the next MEMOIZE) and its records are exactly the pattern (anything else is read op by op).
The memo slots a run would have filled are sealed: a later reference to one (``pickle.dump``
never writes one for these records, except to a record's fresh fqn string, which is answered)
makes the file be read again with every record an object (`Fallback`, handled here), as does a
position set twice (``dcp_index``). The machine is also the only reader of ``.metadata``, in
objects-only mode for small files and for DCP's own classes: Python's C unpickler sizes its memo
by an index the file names (one ``LONG_BINPUT`` 2**31 - 1: 16 GiB, then the OOM killer), this
machine keeps its memo in a list while it fills in order and in a dict otherwise, and reads no
length the file names before those bytes are there.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import struct
from array import array
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fsdpcheck._unpickle import UnsafePickleError, admitted_global, on_a_deep_stack

_EMPTY = torch.empty(0, dtype=torch.int64)

#: Files smaller than this are read into objects only (their few records are not worth the
#: column set-up; ``dcp_index.read_parsed``).
SMALL = 32 << 20
#: Bytes read from the file at a time.
WINDOW = 4 << 20


class Fallback(Exception):
    """Column runs cannot answer (a reference into one): read the file again as objects."""


class StreamError(ValueError):
    """The pickle is malformed (the same situations where the unpickler raises)."""


@dataclass(eq=False)
class ChunkRun:
    """Consecutive chunk records of one tensor's ``chunks`` list, as columns.

    Attributes:
        n: Number of chunks.
        coords: int64 [n, 2 * ndim]: each chunk's offsets, then its sizes.
    """

    n: int
    coords: torch.Tensor = _EMPTY

    def __len__(self) -> int:
        return self.n


@dataclass(eq=False)
class StorageRun:
    """Consecutive ``MetadataIndex`` -> ``_StorageInfo`` pairs of ``storage_data``, as columns.

    Attributes:
        fqns: int64 [n]: each entry's key, as an index into `Parsed.names`.
        paths: int64 [n]: each entry's relative path, as an index into `Parsed.names`.
        offsets: int64 [n, ndim]: each entry's chunk offsets.
        where: int64 [n, 2]: byte offset and length in the file.
    """

    fqns: torch.Tensor
    paths: torch.Tensor
    offsets: torch.Tensor = _EMPTY
    where: torch.Tensor = _EMPTY

    def __len__(self) -> int:
        return int(self.fqns.shape[0])


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
    """

    metadata: Any
    storage_runs: dict[int, list[tuple[int, StorageRun]]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    digest: str = ""
    nbytes: int = 0
    chunk_runs: int = 0

    def runs_in(self, d: Any) -> list[tuple[int, StorageRun]]:
        """The storage runs set into dict `d`: (plain items before each run, run)."""
        return self.storage_runs.get(id(d), [])


def _int_pattern() -> bytes:
    longs = b"|".join(b"\\x8a" + re.escape(bytes([n])) + b".{%d}" % n for n in range(1, 9))
    return rb"(?:K.|M..|J....|" + longs + b")"


INT = _int_pattern()
# Bytes taken by an integer op (LONG1: plus its byte count) or NONE, by opcode.
_WIDTH = torch.zeros(256, dtype=torch.int64)
_WIDTH[0x4B], _WIDTH[0x4D], _WIDTH[0x4A], _WIDTH[0x8A], _WIDTH[0x4E] = 2, 3, 5, 2, 1
_MAX_INT = 10  # LONG1 of 8 bytes
_TUPLE_OP = {1: b"\x85", 2: b"\x86", 3: b"\x87"}
_ATOMS = (str, int, float, bytes, bool, type(None))


def _get(i: int) -> bytes:
    """How pickle.dump writes a reference to memo slot `i`."""
    return b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)


def _tuple_parts(ndim: int) -> tuple[bytes, bytes, int]:
    """(before the ints, after them up to the reduce's MEMOIZE, memo slots used) of a Size."""
    if ndim == 0:
        return b"", b")\x85\x94R\x94", 2
    if ndim <= 3:
        return b"", _TUPLE_OP[ndim] + b"\x94\x85\x94R\x94", 3
    return b"(", b"t\x94\x85\x94R\x94", 3


class _Program:
    """How to decode the variable fields of a record from a fixed window, all records at once.

    Steps: ("skip", n) a fixed run of bytes; ("int",) an integer op; ("int?",) an integer op or
    NONE; ("get",) a memo reference (BINGET / LONG_BINGET), decoded as its slot number.
    """

    def __init__(self, steps: list[tuple[Any, ...]], width: int) -> None:
        self.steps, self.width = steps, width

    def run(self, w: torch.Tensor) -> list[torch.Tensor]:
        """The integer fields of every record: `w` is uint8 [records, width], one per row."""
        n = w.shape[0]
        pos = torch.zeros(n, dtype=torch.int64)
        out = []
        five = torch.arange(5, dtype=torch.int64).unsqueeze(0)
        for step in self.steps:
            kind = step[0]
            if kind == "skip":
                pos += step[1]
                continue
            b = w.gather(1, pos.unsqueeze(1) + five).to(torch.int64)  # the op and 4 bytes
            op = b[:, 0]
            if kind == "get":  # only its width: the caller captured the reference itself
                pos += torch.where(op == _BINGET, 2, 5)
                continue
            v = b[:, 1] | (b[:, 2] << 8) | (b[:, 3] << 16) | (b[:, 4] << 24)
            v = torch.where(
                op == _BININT1,
                v & 0xFF,
                torch.where(op == _BININT2, v & 0xFFFF, v - ((v >> 31) << 32)),
            )
            width = _WIDTH[op]
            longs = (op == _LONG1).nonzero().flatten()
            if longs.numel():
                lb = w.gather(1, pos[longs].unsqueeze(1) + torch.arange(10).unsqueeze(0)).to(
                    torch.int64
                )
                nb = lb[:, 1]
                shifts = torch.arange(0, 64, 8, dtype=torch.int64).unsqueeze(0)
                keep = torch.arange(8).unsqueeze(0) < nb.unsqueeze(1)
                raw = ((lb[:, 2:10] * keep) << shifts).sum(1)  # wraps to int64 at 8 bytes
                top = torch.ones_like(nb) << (nb * 8 - 1).clamp(max=62)
                raw = torch.where((nb < 8) & (raw >= top), raw - (top << 1), raw)
                v[longs] = raw
                width[longs] = 2 + nb
            if kind == "int?":
                none = op == _NONE
                v = torch.where(none, 0, v)
                width = torch.where(none, 1, width)
            else:
                out.append(v)
            pos += width
        return out


class _Template:
    """A record pattern (for one set of memo slots) and the decoder of its fields."""

    def __init__(self, kind: str, head: bytes, body: bytes, program: _Program, memo: int,
                 ndim: int) -> None:  # fmt: skip
        self.kind, self.memo, self.ndim, self.program = kind, memo, ndim, program
        self.record = re.compile(head + body, re.S)
        self.run = re.compile(b"(?:" + head + body + b")+", re.S)
        # findall: the fqn op (storage records) and a window at the first variable field.
        self.fields = re.compile(head + b"(?=(.{%d}))" % program.width + body, re.S)


def _chunk_template(slots: dict[str, int], ndim: int) -> _Template:
    pre, post, used = _tuple_parts(ndim)
    size = _get(slots["Size"])
    head = re.escape(_get(slots["ChunkStorageMetadata"]) + b")\x81\x94}\x94(" + _get(
        slots["offsets"]) + size + pre)  # fmt: skip
    mid = re.escape(post + _get(slots["sizes"]) + size + pre)
    body = INT * ndim + mid + INT * ndim + re.escape(post + b"ub")
    steps: list[tuple[Any, ...]] = [("int",)] * ndim + [("skip", len(post) + len(_get(
        slots["sizes"])) + len(size) + len(pre))] + [("int",)] * ndim  # fmt: skip
    prog = _Program(steps, 2 * ndim * _MAX_INT + len(mid) + 8)
    return _Template("chunk", head, body, prog, 2 + 2 * used, ndim)


def _storage_template(slots: dict[str, int], ndim: int, lengths: list[int]) -> _Template:
    pre, post, used = _tuple_parts(ndim)
    fresh = b"|".join(re.escape(bytes([n])) + b".{%d}" % n for n in lengths)
    fqn = rb"(h.|j...." + (rb"|\x8c(?:" + fresh + rb")\x94" if lengths else b"") + b")"
    head = re.escape(_get(slots["MetadataIndex"]) + b")\x81\x94}\x94(" + _get(slots["fqn"]))
    head += fqn
    k_index, k_offset = _get(slots["index"]), _get(slots["offset"])
    a = re.escape(k_index)
    b = re.escape(k_offset + _get(slots["Size"]) + pre)
    c = re.escape(post + b"ub" + _get(slots["_StorageInfo"]) + b")\x81\x94}\x94(" + _get(
        slots["relative_path"]))  # fmt: skip
    d = re.escape(k_offset)
    e = re.escape(_get(slots["length"]))
    body = a + b"(?:N|" + INT + b")" + b + INT * ndim + c + rb"(h.|j....)" + d + INT + e
    body += INT + b"ub"
    steps: list[tuple[Any, ...]] = [
        ("skip", len(k_index)),
        ("int?",),
        ("skip", len(k_offset) + len(_get(slots["Size"])) + len(pre)),
    ]
    steps += [("int",)] * ndim
    steps += [("skip", len(post) + 2 + len(_get(slots["_StorageInfo"])) + 6
               + len(_get(slots["relative_path"]))), ("get",), ("skip", len(k_offset)),
              ("int",), ("skip", len(_get(slots["length"]))), ("int",)]  # fmt: skip
    width = 128 + ndim * _MAX_INT
    # Memo: the index (object, dict, tuple, tuple1, reduce), the info (object, dict).
    return _Template("storage", head, body, _Program(steps, width), 2 + used + 2, ndim)


#: Memo slots a template needs: class objects and field names.
_CHUNK_SLOTS = ("ChunkStorageMetadata", "offsets", "sizes", "Size")
_STORAGE_SLOTS = ("MetadataIndex", "fqn", "index", "offset", "Size", "_StorageInfo",
                  "relative_path", "length")  # fmt: skip
_FIELD_NAMES = frozenset({"offsets", "sizes", "fqn", "index", "offset", "relative_path", "length"})


# Opcodes (pickle's names).
_MARK, _STOP, _POP, _POP_MARK, _DUP = 0x28, 0x2E, 0x30, 0x31, 0x32
_BININT, _BININT1, _BININT2, _LONG1, _LONG4 = 0x4A, 0x4B, 0x4D, 0x8A, 0x8B
_NONE, _NEWTRUE, _NEWFALSE, _BINFLOAT = 0x4E, 0x88, 0x89, 0x47
_SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8 = 0x8C, 0x58, 0x8D
_SHORT_BINBYTES, _BINBYTES, _BINBYTES8 = 0x43, 0x42, 0x8E
_EMPTY_TUPLE, _TUPLE, _TUPLE1, _TUPLE2, _TUPLE3 = 0x29, 0x74, 0x85, 0x86, 0x87
_EMPTY_LIST, _APPEND, _APPENDS, _LIST = 0x5D, 0x61, 0x65, 0x6C
_EMPTY_DICT, _DICT, _SETITEM, _SETITEMS = 0x7D, 0x64, 0x73, 0x75
_EMPTY_SET, _ADDITEMS, _FROZENSET = 0x8F, 0x90, 0x91
_GLOBAL, _STACK_GLOBAL, _REDUCE, _BUILD, _NEWOBJ, _NEWOBJ_EX = 0x63, 0x93, 0x52, 0x62, 0x81, 0x92
_BINGET, _LONG_BINGET, _BINPUT, _LONG_BINPUT, _MEMOIZE = 0x68, 0x6A, 0x71, 0x72, 0x94
_PROTO, _FRAME, _PERSID, _BINPERSID = 0x80, 0x95, 0x50, 0x51
_INT, _LONG, _FLOAT, _STRING, _UNICODE = 0x49, 0x4C, 0x46, 0x53, 0x56
_BINSTRING, _SHORT_BINSTRING, _BYTEARRAY8 = 0x54, 0x55, 0x96
_GET, _PUT, _INST, _OBJ, _EXT1, _EXT2, _EXT4 = 0x67, 0x70, 0x69, 0x6F, 0x82, 0x83, 0x84


class _Machine:
    """The restricted pickle machine (see NOTE: [metadata columns])."""

    def __init__(
        self,
        fd: int | Stream,
        what: str,
        resolve: Callable[[str, str], Any] | None,
        limit: int,
        columns: bool,
    ) -> None:
        self.fd, self.what, self.resolve, self.limit = fd, what, resolve, limit
        # Column fast paths only into the mirrors (DCP's classes are built for DCP, whole).
        self.columns = columns and resolve is not None
        self.buf = b""
        self.pos = 0
        self.read_total = 0
        self.eof = False
        self.hash = hashlib.sha256()
        # The memo: a list while it fills in order (8 bytes a slot: an objects-only read of
        # 100k keys memoizes ~1.5M objects), a dict for slots set far ahead or around runs.
        self.memo: dict[int, Any] = {}
        self.mlist: list[Any] = []
        self.memo_len = 0
        self.max_slot = -1
        # Each run's memo slots: (first, end, slots per record, the fqn ids when some records
        # memoized a fresh fqn string (their flags in `fresh_flags`)).
        self.sealed: list[tuple[int, int, int, torch.Tensor | None]] = []
        self.fresh_flags: dict[int, torch.Tensor] = {}
        self.fresh_slots: dict[int, tuple[list[int], list[int]]] = {}
        self.sealed_starts: list[int] = []
        # Slots of the names templates refer to (the latest slot holding each).
        self.slots: dict[str, int] = {}
        self.slot_name: dict[int, str] = {}
        self.templates: dict[tuple[Any, ...], _Template | None] = {}
        self.key_lengths: set[int] = set()
        self.fresh: dict[bytes, str] = {}
        # Strings storage runs refer to, by the raw op that names them (fresh or a memo slot).
        self.names: list[str] = []
        self.name_ids: dict[str, int] = {}
        self.fresh_refs: dict[bytes, int] = {}
        self.get_refs: dict[int, int] = {}
        self.pending: dict[_Program, list[tuple[Any, bytes, int]]] = {}
        self.pending_bytes = 0
        self.last_ndim: dict[str, int] = {}
        # Templates in use, valid while `version` (bumped when a tracked slot or the set of
        # key lengths changes) is the same.
        self.current: dict[tuple[str, int], tuple[int, _Template | None]] = {}
        self.version = 0
        self.raw_ids: dict[bytes, int] = {}
        self.storage_runs: dict[int, list[tuple[int, StorageRun]]] = {}
        self.keep: list[Any] = []  # dicts with runs (their ids must stay theirs)
        self.chunk_runs = 0
        self.mirror_names = (
            {resolve(m, n): n for m, n in _TRACKED} if resolve is not None and self.columns else {}
        )
        # Memo slots whose reference may start a run (the classes of chunk and index records).
        self.triggers: set[int] = set()

    # -- input ------------------------------------------------------------------------------
    def read_window(self) -> bytes:
        """The next window of the file (a local descriptor, or a stream from an object store)."""
        if isinstance(self.fd, int):
            return os.read(self.fd, WINDOW)
        return self.fd.read(WINDOW)

    def need(self, n: int, soft: bool = False) -> None:
        """At least `n` bytes from `pos` in the buffer (reads on; StreamError at the end)."""
        if self.pos + n <= len(self.buf):
            return
        if n > self.limit:  # a length no file within the limit can hold: read nothing
            if soft:
                n = self.limit
            else:
                raise StreamError("pickle data was truncated")
        parts = [self.buf[self.pos :]]
        have = len(parts[0])
        while have < n and not self.eof:
            # Never ask for more than a window at once: a length read from the file sizes no
            # allocation before those bytes exist.
            data = self.read_window()
            if not data:
                self.eof = True
                break
            self.read_total += len(data)
            if self.read_total > self.limit:
                raise _TooLarge()
            self.hash.update(data)
            parts.append(data)
            have += len(data)
        self.buf = b"".join(parts)
        self.pos = 0
        if have < n and not soft:
            raise StreamError("pickle data was truncated")

    def take(self, n: int) -> bytes:
        self.need(n)
        p = self.pos
        self.pos = p + n
        return self.buf[p : p + n]

    # -- memo ---------------------------------------------------------------------------------
    def is_sealed(self, i: int) -> bool:
        k = bisect_right(self.sealed_starts, i) - 1
        return k >= 0 and i < self.sealed[k][1]

    def fresh_slot(self, k: int, i: int) -> str | None:
        """The fresh fqn string storage run `k` memoized in slot `i`, if it did."""
        start, _, per, ids = self.sealed[k]
        if ids is None:
            return None
        if k not in self.fresh_slots:
            flags = self.fresh_flags[k].to(torch.int64)
            # Each record: `per` slots, one more with a fresh string (after the index object
            # and its dict, so at +2).
            before = torch.cumsum(flags, 0) - flags
            at = start + 2 + torch.arange(flags.shape[0]) * per + before
            sel = flags.bool()
            self.fresh_slots[k] = (at[sel].tolist(), ids[sel].tolist())
        slots, values = self.fresh_slots[k]
        j = bisect_right(slots, i) - 1
        return self.names[values[j]] if j >= 0 and slots[j] == i else None

    def put(self, i: int, value: Any) -> None:
        if not self.columns:
            mlist = self.mlist
            n = len(mlist)
            if i == n:
                mlist.append(value)
                self.memo_len += 1
            elif i < n:
                if mlist[i] is _HOLE:
                    self.memo_len += 1
                mlist[i] = value
            elif i < n + (1 << 16):
                mlist.extend([_HOLE] * (i - n))
                mlist.append(value)
                self.memo_len += 1
            else:  # far ahead: a dict entry, not gigabytes of holes
                if i not in self.memo:
                    self.memo_len += 1
                self.memo[i] = value
            if i > self.max_slot:
                self.max_slot = i
            return
        memo = self.memo
        if i in memo:
            self.get_refs.pop(i, None)
            self.raw_ids.clear()
        elif not self.sealed or not self.is_sealed(i):
            self.memo_len += 1
        memo[i] = value
        if i > self.max_slot:
            self.max_slot = i
        if self.slot_name:
            old = self.slot_name.pop(i, None)
            if old is not None and self.slots.get(old) == i:
                del self.slots[old]
                self.triggers.discard(i)
                self.version += 1
        name = None
        t = type(value)
        if t is str:
            if value in _FIELD_NAMES:
                name = value
            if len(self.key_lengths) < 64:
                n = len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
                if 0 < n < 256 and n not in self.key_lengths:
                    self.key_lengths.add(n)
                    self.version += 1
        elif value is torch.Size:
            name = "Size"
        elif t is type:
            name = self.mirror_names.get(value)
        if name is not None:
            if self.slots.get(name) != i:
                self.version += 1
            self.slots[name] = i
            self.slot_name[i] = name
            if name in ("ChunkStorageMetadata", "MetadataIndex"):
                self.triggers.add(i)

    def get(self, i: int) -> Any:
        if i < len(self.mlist) and self.mlist[i] is not _HOLE:
            return self.mlist[i]
        try:
            return self.memo[i]
        except KeyError:
            k = bisect_right(self.sealed_starts, i) - 1
            if k >= 0 and i < self.sealed[k][1]:
                found = self.fresh_slot(k, i)
                if found is not None:
                    return found  # a fresh fqn string a storage record memoized
                raise Fallback("a reference into a record read as columns") from None
            raise StreamError(f"Memo value not found at index {i}") from None

    # -- the machine --------------------------------------------------------------------------
    def load(self) -> Any:
        stack: list[Any] = []
        marks: list[int] = []
        memo_get = self.get
        put = self.put
        take = self.take

        def pop_mark() -> list[Any]:
            if not marks:
                raise StreamError("could not find MARK")
            k = marks.pop()
            items = stack[k:]
            del stack[k:]
            return items

        triggers = self.triggers
        memo = self.memo
        mlist = self.mlist
        in_order = not self.columns  # MEMOIZE appends to `mlist` (see `put`)
        buf, buflen = self.buf, len(self.buf)
        while True:
            # Hot opcodes read their fixed-size argument from the buffer directly: at least 9
            # bytes (an opcode and 8) are in it, or the file ends.
            pos = self.pos
            if buf is not self.buf:
                buf, buflen = self.buf, len(self.buf)
            if pos + 9 > buflen:
                self.need(min(9, self.limit), soft=True)
                pos, buf, buflen = self.pos, self.buf, len(self.buf)
                if pos >= buflen:
                    raise StreamError("pickle data was truncated")
            op = buf[pos]
            if op == _MEMOIZE:
                if not stack:
                    raise StreamError("stack is empty")
                self.pos = pos + 1
                n = self.memo_len
                if in_order and n == len(mlist):
                    mlist.append(stack[-1])
                    self.memo_len = n + 1
                    if n > self.max_slot:
                        self.max_slot = n
                else:
                    put(n, stack[-1])
                continue
            if op == _BINGET:
                slot = buf[pos + 1] if pos + 1 < buflen else -1
                if slot in triggers:
                    if self.try_run(stack):
                        continue
                    pos = self.pos  # the attempt may have refilled the buffer
                self.pos = pos + 2
                if slot < 0:
                    raise StreamError("pickle data was truncated")
                got = mlist[slot] if slot < len(mlist) else memo.get(slot, _HOLE)
                stack.append(got if got is not _HOLE else memo_get(slot))
                continue
            if op == _LONG_BINGET:
                if triggers:
                    if self.try_run(stack):
                        continue
                    pos = self.pos  # the attempt may have refilled the buffer
                if pos + 5 <= len(self.buf):
                    self.pos = pos + 5
                    stack.append(memo_get(struct.unpack_from("<I", self.buf, pos + 1)[0]))
                    continue
                self.pos = pos + 1
                stack.append(memo_get(struct.unpack("<I", take(4))[0]))
                continue
            if op == _BININT1 and pos + 2 <= buflen:
                stack.append(buf[pos + 1])
                self.pos = pos + 2
                continue
            if op == _MARK:
                marks.append(len(stack))
                self.pos = pos + 1
                continue
            self.pos = pos + 1
            if op == _EMPTY_TUPLE:
                stack.append(())
            elif op == _NEWOBJ:
                args = stack.pop()
                cls = stack[-1]
                if not isinstance(cls, type) or not isinstance(args, tuple):
                    raise StreamError("NEWOBJ class argument isn't a type object")
                stack[-1] = cls.__new__(cls, *args)
            elif op == _TUPLE1:
                stack[-1] = (stack[-1],)
            elif op == _BUILD:
                state = stack.pop()
                _build(stack[-1], state)
            elif op == _SETITEMS:
                items = pop_mark()
                self.setitems(stack[-1], items)
            elif op == _EMPTY_DICT:
                stack.append({})
            elif op == _REDUCE:
                args = stack.pop()
                func = stack[-1]
                if not isinstance(args, tuple):
                    raise StreamError("REDUCE argument must be a tuple")
                stack[-1] = func(*args)
            elif op == _TUPLE2:
                if len(stack) < 2:
                    raise StreamError("stack is empty")
                stack[-2:] = [(stack[-2], stack[-1])]
            elif op == _NEWFALSE:
                stack.append(False)
            elif op == _SHORT_BINUNICODE:
                n = take(1)[0]
                stack.append(take(n).decode("utf-8", "surrogatepass"))
            elif op == _BININT2:
                stack.append(struct.unpack("<H", take(2))[0])
            elif op == _BININT:
                stack.append(struct.unpack("<i", take(4))[0])
            elif op == _BININT1:
                stack.append(take(1)[0])
            elif op == _NONE:
                stack.append(None)
            elif op == _NEWTRUE:
                stack.append(True)
            elif op == _EMPTY_LIST:
                stack.append([])
            elif op == _APPENDS:
                items = pop_mark()
                self.appends(stack[-1], items)
            elif op == _APPEND:
                v = stack.pop()
                self.appends(stack[-1], [v])
            elif op == _SETITEM:
                v = stack.pop()
                k = stack.pop()
                self.setitems(stack[-1], [k, v])
            elif op == _TUPLE3:
                if len(stack) < 3:
                    raise StreamError("stack is empty")
                stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
            elif op == _TUPLE:
                stack.append(tuple(pop_mark()))
            elif op == _STACK_GLOBAL:
                name = stack.pop()
                module = stack.pop()
                if type(name) is not str or type(module) is not str:
                    raise StreamError("STACK_GLOBAL requires str")
                stack.append(admitted_global(module, name, self.what, self.resolve))
            elif op == _GLOBAL:
                module = self.line().decode("utf-8")
                name = self.line().decode("utf-8")
                stack.append(admitted_global(module, name, self.what, self.resolve))
            elif op == _BINPUT:
                if not stack:
                    raise StreamError("stack is empty")
                put(take(1)[0], stack[-1])
            elif op == _LONG_BINPUT:
                if not stack:
                    raise StreamError("stack is empty")
                put(struct.unpack("<I", take(4))[0], stack[-1])
            elif op == _LONG1:
                n = take(1)[0]
                stack.append(int.from_bytes(take(n), "little", signed=True))
            elif op == _LONG4:
                (n,) = struct.unpack("<i", take(4))
                if n < 0:
                    raise StreamError("LONG pickle has negative byte count")
                stack.append(int.from_bytes(take(n), "little", signed=True))
            elif op == _BINFLOAT:
                stack.append(struct.unpack(">d", take(8))[0])
            elif op == _BINUNICODE:
                (n,) = struct.unpack("<I", take(4))
                stack.append(take(n).decode("utf-8", "surrogatepass"))
            elif op == _BINUNICODE8:
                (n,) = struct.unpack("<Q", take(8))
                stack.append(take(n).decode("utf-8", "surrogatepass"))
            elif op == _SHORT_BINBYTES:
                stack.append(take(take(1)[0]))
            elif op == _BINBYTES:
                stack.append(take(struct.unpack("<I", take(4))[0]))
            elif op == _BINBYTES8:
                stack.append(take(struct.unpack("<Q", take(8))[0]))
            elif op == _LIST:
                stack.append(pop_mark())
            elif op == _DICT:
                items = pop_mark()
                d: dict[Any, Any] = {}
                self.setitems(d, items)
                stack.append(d)
            elif op == _EMPTY_SET:
                stack.append(set())
            elif op == _ADDITEMS:
                items = pop_mark()
                target = stack[-1]
                if isinstance(target, set):
                    target.update(items)
                else:
                    for it in items:
                        target.add(it)
            elif op == _FROZENSET:
                stack.append(frozenset(pop_mark()))
            elif op == _NEWOBJ_EX:
                kwargs = stack.pop()
                args = stack.pop()
                cls = stack[-1]
                if (
                    not isinstance(cls, type)
                    or not isinstance(args, tuple)
                    or not isinstance(kwargs, dict)
                ):
                    raise StreamError("NEWOBJ_EX class argument must be a type")
                stack[-1] = cls.__new__(cls, *args, **kwargs)
            elif op == _POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                elif stack:
                    stack.pop()
                else:
                    raise StreamError("stack is empty")
            elif op == _POP_MARK:
                pop_mark()
            elif op == _DUP:
                stack.append(stack[-1])
            elif op == _PROTO:
                if take(1)[0] > 5:
                    raise StreamError("unsupported pickle protocol")
            elif op == _FRAME:
                (n,) = struct.unpack("<Q", take(8))
                if n > self.limit:
                    raise StreamError("frame size > sys.maxsize")
            elif op == _STOP:
                if len(stack) != 1 or marks:
                    raise StreamError("unpickling stack underflow" if not stack else
                                      "unexpected MARK found")  # fmt: skip
                self.finish()
                self.flush()
                return stack[0]
            elif op in (_PERSID, _BINPERSID):
                raise UnsafePickleError(
                    f"{self.what} holds a persistent reference; refusing to load it"
                )
            else:
                self.text_op(op, stack, pop_mark)

    def text_op(self, op: int, stack: list[Any], pop_mark: Callable[[], list[Any]]) -> None:
        """The opcodes of protocols 0 and 1 (pickle.dump writes none for DCP metadata)."""
        if op == _INT:
            text = self.line()
            value: Any = {b"00": False, b"01": True}.get(text)
            stack.append(int(text, 0) if value is None else value)
        elif op == _LONG:
            stack.append(int(self.line().rstrip(b"L"), 0))
        elif op == _FLOAT:
            stack.append(float(self.line()))
        elif op == _STRING:
            text = self.line()
            if len(text) < 2 or text[0] != text[-1] or text[:1] not in (b"'", b'"'):
                raise StreamError("the STRING opcode argument must be quoted")
            stack.append(codecs.escape_decode(text[1:-1])[0].decode("ascii"))
        elif op == _UNICODE:
            stack.append(self.line().decode("raw-unicode-escape"))
        elif op == _BINSTRING:
            (n,) = struct.unpack("<i", self.take(4))
            if n < 0:
                raise StreamError("BINSTRING pickle has negative byte count")
            stack.append(self.take(n).decode("ascii"))
        elif op == _SHORT_BINSTRING:
            stack.append(self.take(self.take(1)[0]).decode("ascii"))
        elif op == _BYTEARRAY8:
            stack.append(bytearray(self.take(struct.unpack("<Q", self.take(8))[0])))
        elif op == _GET:
            stack.append(self.get(int(self.line())))
        elif op == _PUT:
            i = int(self.line())
            if i < 0:
                raise StreamError("negative PUT argument")
            if not stack:
                raise StreamError("stack is empty")
            self.put(i, stack[-1])
        elif op in (_INST, _OBJ):
            if op == _INST:
                module = self.line().decode("utf-8")
                name = self.line().decode("utf-8")
                cls = admitted_global(module, name, self.what, self.resolve)
                args = pop_mark()
            else:
                args = pop_mark()
                if not args:
                    raise StreamError("OBJ without a class")
                cls, args = args[0], args[1:]
            if not isinstance(cls, type):
                raise StreamError("INST/OBJ class argument isn't a type object")
            stack.append(cls(*args))
        elif op in (_EXT1, _EXT2, _EXT4):
            raise UnsafePickleError(
                f"{self.what} names a class by an extension code; refusing to load it"
            )
        else:  # NEXT_BUFFER, READONLY_BUFFER, or no opcode at all
            raise StreamError(f"invalid load key, {chr(op)!r}.")

    def line(self) -> bytes:
        out = bytearray()
        while True:
            c = self.take(1)
            if c == b"\n":
                return bytes(out)
            out += c
            if len(out) > 4096:
                raise StreamError("pickle data was truncated")

    def finish(self) -> None:
        """Reads the rest of the file (for the digest; bytes after STOP are ignored)."""
        while not self.eof:
            data = self.read_window()
            if not data:
                break
            self.read_total += len(data)
            if self.read_total > self.limit:
                raise _TooLarge()
            self.hash.update(data)

    def setitems(self, target: Any, items: list[Any]) -> None:
        if self.columns and any(type(it) is StorageRun for it in items):
            if type(target) is not dict:
                raise Fallback("storage records outside a dict")
            lst = self.storage_runs.setdefault(id(target), [])
            if not lst:
                self.keep.append(target)
            plain: list[Any] = []
            for it in items:
                if type(it) is StorageRun:
                    _setitems(target, plain)
                    plain = []
                    lst.append((len(target), it))
                else:
                    plain.append(it)
            _setitems(target, plain)
            return
        _setitems(target, items)

    def appends(self, target: Any, items: list[Any]) -> None:
        if type(target) is list:
            target.extend(items)
            return
        if any(type(it) is ChunkRun for it in items):
            raise Fallback("chunk records outside a list")
        extend = getattr(target, "extend", None)
        if extend is not None:
            extend(items)
            return
        for it in items:
            target.append(it)

    # -- runs ---------------------------------------------------------------------------------
    def try_run(self, stack: list[Any]) -> bool:
        """Reads a run of chunk or storage records at `pos` as columns, if one starts there."""
        if not self.columns or self.max_slot >= self.memo_len:
            return False  # a slot was set ahead: MEMOIZE would not append
        buf, pos = self.buf, self.pos
        op = buf[pos]
        need = 2 if op == _BINGET else 5
        if pos + need > len(buf):
            return False
        slot = buf[pos + 1] if op == _BINGET else struct.unpack_from("<I", buf, pos + 1)[0]
        name = self.slot_name.get(slot)
        if name == "ChunkStorageMetadata":
            if not all(n in self.slots for n in _CHUNK_SLOTS):
                return False
            return self.run_of("chunk", stack)
        if name == "MetadataIndex":
            if not all(n in self.slots for n in _STORAGE_SLOTS):
                return False
            return self.run_of("storage", stack)
        return False

    def template(self, kind: str, ndim: int) -> _Template | None:
        got = self.current.get((kind, ndim))
        if got is not None and got[0] == self.version:
            return got[1]
        names = _CHUNK_SLOTS if kind == "chunk" else _STORAGE_SLOTS
        lengths = sorted(self.key_lengths) if kind == "storage" else []
        key = (kind, ndim, tuple(self.slots[n] for n in names), tuple(lengths))
        if key not in self.templates:
            slots = {n: self.slots[n] for n in names}
            if kind == "chunk":
                self.templates[key] = _chunk_template(slots, ndim)
            else:
                self.templates[key] = _storage_template(slots, ndim, lengths)
        self.current[(kind, ndim)] = (self.version, self.templates[key])
        return self.templates[key]

    def run_of(self, kind: str, stack: list[Any]) -> bool:
        # Keep a window's worth in the buffer so a run is matched in one piece.
        if len(self.buf) - self.pos < WINDOW // 2 and not self.eof:
            self.need(WINDOW, soft=True)
        last = self.last_ndim.get(kind, 2)
        tries: tuple[int, ...] = (last,)
        if _FRAME not in self.buf[self.pos : self.pos + 512]:
            # Not a record split by a frame header (read op by op, then the run goes on).
            tries += tuple(d for d in range(9) if d != last)
        for ndim in tries:
            t = self.template(kind, ndim)
            assert t is not None
            m = t.run.match(self.buf, self.pos)
            if m is None:
                continue
            end = m.end()
            seg = self.buf[self.pos : end] + b"\0" * (t.program.width + 8)
            start = self.memo_len
            fresh = 0
            fresh_ids: torch.Tensor | None = None
            if kind == "chunk":
                windows = t.fields.findall(seg)
                n = len(windows)
                run: Any = ChunkRun(n)
                if ndim:
                    self.defer(t.program, run, b"".join(windows), n)
                else:
                    run.coords = torch.empty(n, 0, dtype=torch.int64)
                self.chunk_runs += 1
            else:
                found = t.fields.findall(seg)
                n = len(found)
                fqn_raw = [f for f, _, _ in found]
                path_raw = [p for _, _, p in found]
                ids = self.raw_ids
                for r in set(fqn_raw).union(path_raw):
                    if r not in ids:
                        # A fresh string (memoized by its record: one more slot) as -1 - id.
                        i = self.ref(r)
                        ids[r] = -1 - i if r[0] == _SHORT_BINUNICODE else i
                fqns = torch.frombuffer(array("q", map(ids.__getitem__, fqn_raw)),
                                        dtype=torch.int64).clone()  # fmt: skip
                paths = torch.frombuffer(array("q", map(ids.__getitem__, path_raw)),
                                         dtype=torch.int64).clone()  # fmt: skip
                if len(ids) > 1 << 16:
                    ids.clear()
                is_fresh = fqns < 0
                fresh = int(is_fresh.sum())
                if fresh:
                    fqns = torch.where(is_fresh, -1 - fqns, fqns)
                    fresh_ids = fqns  # with the flags: which slots hold which string
                    self.fresh_flags[len(self.sealed)] = is_fresh
                run = StorageRun(fqns, paths)
                self.defer(t.program, run, b"".join([w for _, w, _ in found]), n)
            self.last_ndim[kind] = ndim
            stack.append(run)
            self.memo_len = start + n * t.memo + fresh
            self.sealed.append((start, self.memo_len, t.memo, fresh_ids))
            self.sealed_starts.append(start)
            self.max_slot = max(self.max_slot, self.memo_len - 1)
            self.pos = end
            return True
        return False

    def defer(self, program: _Program, run: Any, windows: bytes, n: int) -> None:
        """Queues a run's windows: decoded together with others (tensor ops cost per call)."""
        self.pending.setdefault(program, []).append((run, windows, n))
        self.pending_bytes += len(windows)
        if self.pending_bytes > 8 << 20:
            self.flush()

    def flush(self) -> None:
        """Decodes every queued run's integers into its columns."""
        for program, runs in self.pending.items():
            total = sum(n for _, _, n in runs)
            raw = torch.frombuffer(bytearray().join(w for _, w, _ in runs), dtype=torch.uint8)
            table = torch.stack(program.run(raw.view(total, program.width)), 1)
            ndim = table.shape[1] - 2  # storage records: their offsets, then offset and length
            k = 0
            for run, _, n in runs:
                if type(run) is ChunkRun:
                    run.coords = table[k : k + n]
                else:
                    run.offsets = table[k : k + n, :ndim]
                    run.where = table[k : k + n, ndim:]
                k += n
        self.pending.clear()
        self.pending_bytes = 0

    def name_id(self, value: str) -> int:
        i = self.name_ids.get(value)
        if i is None:
            i = self.name_ids[value] = len(self.names)
            self.names.append(value)
        return i

    def ref(self, raw: bytes) -> int:
        """The fqn a storage record names (a fresh string or a memo slot), as a name id."""
        if raw[0] == _SHORT_BINUNICODE:
            got = self.fresh_refs.get(raw)
            if got is None:
                got = self.name_id(raw[2:-1].decode("utf-8", "surrogatepass"))
                if len(self.fresh_refs) < 1 << 16:
                    self.fresh_refs[raw] = got
            return got
        return self.path_ref(raw)

    def path_ref(self, raw: bytes) -> int:
        """The string a memo reference names, as a name id (Fallback if it is not a string)."""
        slot = raw[1] if raw[0] == _BINGET else struct.unpack_from("<I", raw, 1)[0]
        got = self.get_refs.get(slot)
        if got is None:
            value = self.get(slot)
            if type(value) is not str:
                raise Fallback("a storage record whose key or path is not a string")
            got = self.get_refs[slot] = self.name_id(value)
        return got


class _TooLarge(Exception):
    pass


_HOLE = object()  # a memo slot not set


#: The mirror classes templates are keyed to, by (module, name).
_TRACKED = (
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)


def _setitems(target: Any, items: list[Any]) -> None:
    if len(items) % 2:
        raise StreamError("odd number of items for SETITEMS")
    if type(target) is dict:
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]
        return
    for i in range(0, len(items), 2):
        target[items[i]] = items[i + 1]


def _build(inst: Any, state: Any) -> None:
    """Pickle's BUILD: ``__setstate__``, else the instance dict and slot state."""
    setstate = getattr(inst, "__setstate__", None)
    if setstate is not None:
        setstate(state)
        return
    slotstate = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slotstate = state
    if state:
        if not isinstance(state, dict):
            raise StreamError("state is not a dictionary")
        d = inst.__dict__
        for k, v in state.items():
            d[k] = v
    if slotstate:
        if not isinstance(slotstate, dict):
            raise StreamError("slot state is not a dictionary")
        for k, v in slotstate.items():
            setattr(inst, k, v)


class Stream(Protocol):
    """A file read from its start that is not a local descriptor (an object in a store)."""

    size: int

    def read(self, n: int) -> bytes:
        """Up to `n` more bytes (b"" at the end)."""
        ...

    def seek(self, pos: int) -> int:
        """Moves to `pos`."""
        ...


def read_metadata_stream(
    fd: int | Stream,
    what: str,
    resolve: Callable[[str, str], Any] | None,
    limit: int,
    *,
    columns: bool = True,
) -> Parsed:
    """Reads an open ``.metadata`` from its start (see NOTE: [metadata columns]).

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
        # A reference into records read as columns (pickle.dump never writes one): read again,
        # every record an object.
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
    m = _Machine(fd, what, resolve, limit, columns)
    try:
        md = on_a_deep_stack(m.load, min(limit, size))
    except _TooLarge:
        raise ValueError(f"larger than {limit} bytes") from None
    except (struct.error, IndexError, TypeError, AttributeError, KeyError, UnicodeDecodeError,
            RecursionError, OverflowError, MemoryError, RuntimeError) as exc:  # fmt: skip
        raise StreamError(f"{type(exc).__name__}: {exc}") from None
    return Parsed(md, m.storage_runs, m.names, m.hash.hexdigest(), m.read_total, m.chunk_runs)


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
