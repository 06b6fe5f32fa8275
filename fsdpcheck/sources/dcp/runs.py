"""Long runs of chunk and storage records read as columns: a plugin of the restricted machine.

NOTE: [metadata columns] A ``.metadata`` of 1,000 tensors saved by 1,024 ranks lists 1,024,000
chunks: 151 MB of pickle. Unpickled into objects (DCP's classes or the mirrors) that is ~2.2 KB
per chunk (a chunk object, its state dict, two ``torch.Size`` and their argument tuples, a
``MetadataIndex`` and a ``_StorageInfo`` with theirs), 2.2 GB, and the memo of the unpickler
holds every one of them until the end, so no hook that builds something smaller per object
helps. `ColumnRuns` is handed to the restricted machine (``dcp_vm``) and reads those records
itself: where ``pickle.dump`` wrote a long run of chunk records (``ChunkStorageMetadata`` in a
tensor's ``chunks`` list) or of storage records (``MetadataIndex`` -> ``_StorageInfo`` pairs in
``storage_data``), one regular expression matches the whole run (records are self-delimiting
byte patterns once the memo slots of the classes and field names are known), and the integers
of every record are decoded at once, with tensor ops, into columns (`ChunkRun`, `StorageRun`).

NOTE: [any pickling] The same objects pickle to different bytes by how they are shared and by
the protocol, and every way is read as columns:

* a string (a key, a data file's path) is written in full where the pickler first meets that
  string object and as a memo reference after: ``dcp.save`` writes a fresh key string in every
  storage record and one path string per rank; a writer that builds the path per entry writes
  it in full every time;
* a ``torch.Size`` (a chunk's offsets or sizes, a storage entry's offset) is written in full or
  as a reference to one written before (chunks sharing one sizes object, a ``MetadataIndex``
  holding its chunk's own offsets object);
* protocols 4 and 5 memoize with ``MEMOIZE``, protocols 2 and 3 with ``BINPUT``/``LONG_BINPUT``
  naming the slot, and write strings with ``BINUNICODE``;
* the order of records (storage entries rank by rank or tensor by tensor) changes only which
  occurrence of a string is the fresh one;
* protocols 4 and 5 are written in frames of 64 KB, a ``FRAME`` op between any two ops (one
  record in a few hundred is split by one): such a record is matched without it
  (`_Template.framed`) and stays in its run.

So each field of a record pattern is an alternation (a fresh value or a reference), and a
record's memo slots are counted from which alternative it took: a run is segments of records
that took the same ones (`_Sealed`; a rank's first storage record writes its path fresh, the
rest refer to it), found by C loops, never a step per record in Python. References are resolved in
columns: to a string by the slot's value (a fresh string of a record read as columns included),
to a ``torch.Size`` through a table of every fresh size's memo slot (`ColumnRuns.finish`).

Equivalence with the machine reading every record as objects (the reference: the column path
gives exactly that result, or raises `Fallback` and the file is read again as objects):

* a run is taken only where the memo is append-only (no slot set ahead of the next MEMOIZE)
  and its records are exactly the pattern (anything else is read op by op);
* every record is walked again by the decoder, which must end where the pattern ended, count
  the memo slots the pattern's alternatives counted, find every ``BINPUT`` naming the slot it
  sets (protocols 2, 3) and every reference naming a slot set before it, or `Fallback`;
* the memo slots a run filled are held by the plugin (sealed): a later reference to one is
  answered (a string, a size, a size's tuple) or refused with `Fallback` (a record object,
  which ``pickle.dump`` never refers to again); a slot set twice once runs exist refuses too,
  as does a position set twice (``dcp_index``).

Measured on 2 cores: the 151 MB file in ~1.8 s of CPU and ~100 MB above start-up, against
3.5 s and 2.2 GB as objects (``bench/bench_scale_offline.py`` times every way above): the
patterns' matches ~0.6 s, the decoder's tensor ops ~0.5 s, the keys' and paths' ids ~0.15 s.
"""

from __future__ import annotations

import re
import struct
import sys
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

from fsdpcheck.sources.dcp.vm import (
    BINGET,
    BINPUT,
    LONG1,
    LONG_BINGET,
    NONE,
    SHORT_BINUNICODE,
    WINDOW,
    Machine,
    TooLarge,
)

_EMPTY = torch.empty(0, dtype=torch.int64)


class Fallback(Exception):
    """Column runs cannot answer (a reference into one, ...): read the file again as objects."""


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
        fqns: Each entry's key, as an index into `ColumnRuns.names` (an int64 array).
        paths: Each entry's relative path, as an index into `ColumnRuns.names` (the same).
        offsets: int64 [n, w]: each entry's chunk offsets (its first `ndims` columns).
        ndims: int8 [n]: each entry's number of offsets (entries of tensors of any rank).
        where: int64 [n, 2]: byte offset and length in the file.
    """

    fqns: array[int]
    paths: array[int]
    offsets: torch.Tensor = _EMPTY
    ndims: torch.Tensor = _EMPTY
    where: torch.Tensor = _EMPTY

    def __len__(self) -> int:
        return len(self.fqns)


# -- record patterns ----------------------------------------------------------------------------
def _int_pattern() -> bytes:
    longs = b"|".join(b"\\x8a" + re.escape(bytes([n])) + b".{%d}" % n for n in range(1, 9))
    return rb"(?:K.|M..|J....|" + longs + b")"


INT = _int_pattern()
_REF = rb"(?:h.|j....)"
_E = re.escape
_TUPLE_OP = {1: b"\x85", 2: b"\x86", 3: b"\x87"}
#: Most templates (`ColumnRuns.template`) one read makes: a file needs a few.
_TEMPLATES = 256
#: Most dims of a storage entry's offsets read in runs (more: that record is read op by op).
MAX_DIMS = 8


def _get(i: int) -> bytes:
    """How pickle.dump writes a reference to memo slot `i`."""
    return b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)


class _Template:
    """The byte pattern of one kind of record and what its decoder needs to know.

    One template per set of memo slots, way of memoizing and (chunks) number of dims.

    ``records`` captures, per record: the whole record, then per field that may be fresh or a
    reference (a group that did not take part is empty, all of them in the match that ends the
    run): chunks (offsets ref, sizes ref); storage (key fresh, key ref, the offset's empty
    tuple (a fresh empty size), offset ref, path fresh, path ref). A fresh string is captured
    without its memo op.
    """

    def __init__(self, kind: str, ndim: int, slots: dict[str, int], lengths: tuple[int, ...],
                 proto: int) -> None:  # fmt: skip
        self.kind, self.ndim, self.slots = kind, ndim, slots
        self.put = proto < 4  # memo slots named by BINPUT/LONG_BINPUT (not MEMOIZE)
        self.sz = 3 if ndim else 2  # memo slots of a fresh size: its tuple, args, itself
        self.ref_len = {name: len(_get(s)) for name, s in slots.items()}
        self.per: dict[int, int] = {}  # `_per`
        memo = rb"(?:q.|r....)" if self.put else rb"\x94"
        # A fresh string of a length seen before: a regular expression cannot take a length
        # from the bytes it reads.
        short = [_E(bytes([n])) + b".{%d}" % n for n in lengths if n < 256 and proto >= 4]
        long = [_E(struct.pack("<I", n)) + b".{%d}" % n for n in lengths
                if not (n < 256 and proto >= 4)]  # fmt: skip
        fresh = ([rb"\x8c(?:" + b"|".join(short) + b")"] if short else []) + (
            [b"X(?:" + b"|".join(long) + b")"] if long else [])  # fmt: skip
        fresh_str = b"(?:" + b"|".join(fresh) + b")" if fresh else b"(?!)"
        self._fresh_str, self._memo = fresh_str, memo
        pattern = self._pattern(True, lambda: b"")
        # findall from a run's start gives its records, then one match of no record that takes
        # the rest of the buffer at once (sre skips ``.+`` under DOTALL to the end in one
        # step, capturing nothing): one pass, ending where the first non-record begins.
        self.records = re.compile(b"(" + pattern + b")|.+", re.S)
        self._framed: re.Pattern[bytes] | None = None

    @property
    def has_framed(self) -> bool:
        """Whether `framed` is compiled already."""
        return self._framed is not None

    @property
    def framed(self) -> re.Pattern[bytes]:
        """A record with FRAME ops between its ops (and before it), each FRAME a group.

        ``pickle.dump`` frames protocols 4 and 5 every 64 KB, between two ops of whatever it
        writes: one record in every few hundred is split. A frame is no op to the machine, and
        pickle's ops are self-delimiting, so where this matches, the machine reads the record
        exactly as the same bytes without the FRAMEs (`ColumnRuns._stitch`).
        """
        if self._framed is None:
            frame = rb"(?:(\x95).{8})?"
            self._framed = re.compile(frame + self._pattern(False, lambda: frame), re.S)
        return self._framed

    def _pattern(self, cap: bool, gap: Callable[[], bytes]) -> bytes:
        """The record's pattern: its fields captured (`cap`), `gap` between any two ops."""
        kind, ndim, slots, memo = self.kind, self.ndim, self.slots, self._memo
        size_class = _E(_get(slots["Size"]))

        def seq(*ops: bytes) -> bytes:  # ops (or sequences of them) one after another
            out = ops[0]
            for op in ops[1:]:
                out += gap() + op
            return out

        def g(x: bytes, cap: bool) -> bytes:
            return (b"(" if cap else b"(?:") + x + b")"

        def get(name: str) -> bytes:
            return _E(_get(slots[name]))

        args = seq(_E(b"\x85"), memo, b"R", memo)  # TUPLE1 (the arguments), REDUCE

        def size(cap: bool) -> bytes:
            if kind == "chunk":
                ends = [_E(_TUPLE_OP.get(ndim, b"t")), memo] if ndim else [_E(b")")]
                fresh_size = seq(size_class, *([b"\\("] if ndim > 3 else []), *[INT] * ndim,
                                 *ends, args)  # fmt: skip
            else:  # any number of dims: the empty size, TUPLE1-3, MARK ... TUPLE
                many = INT + b"{4,%d}" % MAX_DIMS
                if gap():  # the same, each INT its own op
                    many = seq(INT, INT, INT, INT)
                    for _ in range(MAX_DIMS - 4):
                        many += b"(?:" + gap() + INT
                    many += b")?" * (MAX_DIMS - 4)
                tup = b"(?:" + b"|".join([
                    g(_E(b")"), cap), seq(INT, rb"\x85", memo), seq(INT, INT, rb"\x86", memo),
                    seq(INT, INT, INT, rb"\x87", memo), seq(b"\\(", many, b"t", memo),
                ]) + b")"  # fmt: skip
                fresh_size = seq(size_class, tup, args)
            return b"(?:" + fresh_size + b"|" + g(_REF, cap) + b")"

        def string(cap: bool) -> bytes:
            return b"(?:" + seq(g(self._fresh_str, cap), memo) + b"|" + g(_REF, cap) + b")"

        def obj(cls: str, first: str) -> bytes:
            return seq(get(cls), _E(b")"), _E(b"\x81"), memo, b"\\}", memo, b"\\(", get(first))

        if kind == "chunk":
            return seq(obj("ChunkStorageMetadata", "offsets"), size(cap), get("sizes"), size(cap),
                       b"u", b"b")  # fmt: skip
        return seq(
            obj("MetadataIndex", "fqn"), string(cap), get("index"), b"(?:N|" + INT + b")",
            get("offset"), size(cap), b"u", b"b", obj("_StorageInfo", "relative_path"),
            string(cap), get("offset"), INT, get("length"), INT, b"u", b"b",
        )  # fmt: skip


#: Memo slots a template needs: class objects and field names.
_CHUNK_SLOTS = ("ChunkStorageMetadata", "offsets", "sizes", "Size")
_STORAGE_SLOTS = ("MetadataIndex", "fqn", "index", "offset", "Size", "_StorageInfo",
                  "relative_path", "length")  # fmt: skip
_FIELD_NAMES = frozenset({"offsets", "sizes", "fqn", "index", "offset", "relative_path", "length"})
#: The mirror classes templates are keyed to, by (module, name).
_TRACKED = (
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)
# Per-record flags: which fields were written fresh (the others are memo references).
_OFFSETS, _SIZES = 1, 2  # chunk records
_KEY, _OFFSET, _PATH, _EMPTY_SIZE = 1, 2, 4, 8  # storage records (the offset: an empty size)


def _parts(t: _Template, f: int) -> list[tuple[str, int]]:
    """What each memo slot of a record whose fresh fields are `f` holds, in order.

    ("object", 0) a record's object or its dict; ("key"/"path", 0) a fresh string;
    ("size", field) a fresh size's tuple (not for an empty size), arguments, the size itself.
    """
    if t.kind == "chunk":
        return ([("object", 0)] * 2 + [("size", 0)] * (t.sz if f & _OFFSETS else 0)
                + [("size", 1)] * (t.sz if f & _SIZES else 0))  # fmt: skip
    size = 0 if not f & _OFFSET else 2 if f & _EMPTY_SIZE else 3
    return ([("object", 0)] * 2 + [("key", 0)] * bool(f & _KEY) + [("size", 0)] * size
            + [("object", 0)] * 2 + [("path", 0)] * bool(f & _PATH))  # fmt: skip


def _per(t: _Template, f: int) -> int:
    """Memo slots of a record whose fresh fields are `f` (``len(_parts(t, f))``, kept)."""
    got = t.per.get(f)
    if got is None:
        got = t.per[f] = len(_parts(t, f))
    return got


# -- the decoder --------------------------------------------------------------------------------
_WIDTH = torch.zeros(256, dtype=torch.int64)  # bytes of an integer op (LONG1: plus its count)
_WIDTH[0x4B], _WIDTH[0x4D], _WIDTH[0x4A], _WIDTH[0x8A], _WIDTH[0x4E] = 2, 3, 5, 2, 1
_IS_INT = torch.zeros(256, dtype=torch.bool)
_IS_INT[[0x4B, 0x4D, 0x4A, 0x8A]] = True
# The bits of the 4 bytes after an integer op that are its value (BININT: all, sign extended).
_INT_BITS = torch.zeros(256, dtype=torch.int64)
_INT_BITS[0x4B], _INT_BITS[0x4D], _INT_BITS[0x4A] = 0xFF, 0xFFFF, -1
_PAD = 1024  # zero bytes after the records (the decoder reads a little past a record's end)
_PADDING = bytes(_PAD)
_BLOCK = 1 << 16  # references resolved at a time
_BATCH = 8 << 20  # record bytes decoded together (tensor ops cost per call, memory per byte)
_H, _J, _U, _MARK, _EMPTY_TUPLE = ord("h"), ord("j"), ord("u"), ord("("), ord(")")
_LITTLE = sys.byteorder == "little"
_RECORD = itemgetter(0)  # a match's record (its first group)


class _Walk:
    """Records walked together, one row each, every row at its own position (tensor ops).

    Attributes:
        pos: int64 [n]: each record's position in `data`.
        slot: int64 [n]: the memo slot its next memo op sets.
        bad: bool [n]: the record is not what the pattern said (a BINPUT naming another slot,
            a reference to a slot not set before it).
    """

    def __init__(self, data: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, put: bool):
        self.data, self.put = data, put
        # What every row moves by alike (skipped bytes, MEMOIZEs) is added when next read: one
        # tensor op for a run of them, not one each.
        self._pos, self._slot, self._dpos, self._dslot = pos, slot, 0, 0
        self.last = data.shape[0] - 16
        self.bad = torch.zeros_like(pos, dtype=torch.bool)
        self._k = {k: torch.arange(k, dtype=torch.int64) for k in (1, 5, 10)}
        # Each position's 4 bytes as a row of a view (nothing copied): `word_at` gathers rows
        # and reads each as an int32, in place of 4 gathers and 6 shifts and ors.
        self._rows4 = data.unfold(0, 4, 1)
        self._rows8 = data.unfold(0, 8, 1)

    @property
    def pos(self) -> torch.Tensor:
        if self._dpos:
            self._pos, self._dpos = self._pos + self._dpos, 0
        return self._pos

    @pos.setter
    def pos(self, value: torch.Tensor) -> None:
        self._pos, self._dpos = value, 0

    @property
    def slot(self) -> torch.Tensor:
        if self._dslot:
            self._slot, self._dslot = self._slot + self._dslot, 0
        return self._slot

    @slot.setter
    def slot(self, value: torch.Tensor) -> None:
        self._slot, self._dslot = value, 0

    def bytes_at(self, pos: torch.Tensor, k: int) -> torch.Tensor:
        """int64 [n, k]: the k bytes at each row's `pos` (clamped into the data)."""
        return self.raw_at(pos, k).to(torch.int64)

    def raw_at(self, pos: torch.Tensor, k: int) -> torch.Tensor:
        """uint8 [n, k]: the k bytes at each row's `pos` (clamped into the data)."""
        at = (pos.clamp(0, self.last).unsqueeze(1) + self._k[k]).view(-1)
        return self.data.index_select(0, at).view(-1, k)

    def op_at(self, pos: torch.Tensor) -> torch.Tensor:
        """int64 [n]: the byte at each row's `pos` (out of range: an error, so `Fallback`)."""
        return self.data.index_select(0, pos).to(torch.int64)

    def word_at(self, pos: torch.Tensor) -> torch.Tensor:
        """int64 [n]: the 4 bytes at each row's `pos` as a little-endian int32, sign extended."""
        rows = self._rows4.index_select(0, pos)
        if not _LITTLE:
            w = rows.to(torch.int64)
            word = w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24)
            return word - ((word >> 31) << 32)
        return rows.view(torch.int32).view(-1).to(torch.int64)

    def op_word(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(opcode, the 4 bytes after it as a little-endian int32, sign extended) at `pos`."""
        if not _LITTLE:
            return self.op_at(pos), self.word_at(pos + 1)
        # One gather of 8 bytes read as an int64: the opcode in bits 0-7, the word in 8-39.
        w = self._rows8.index_select(0, pos).view(torch.int64).view(-1)
        return w & 0xFF, (w << 24) >> 32

    def skip(self, n: int) -> None:
        self._dpos += n

    @staticmethod
    def _op_slot(op: torch.Tensor, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(memo slot, width) of a BINGET/BINPUT (1-byte) or its LONG_ form."""
        short = (op == BINGET) | (op == BINPUT)
        return torch.where(short, word & 0xFF, word & 0xFFFFFFFF), torch.where(short, 2, 5)

    def memo(self, mask: torch.Tensor | None = None) -> None:
        """A memo op (where `mask`): it sets slot `slot` (a BINPUT must name that slot)."""
        if mask is None and not self.put:  # MEMOIZE: every row alike
            self._dpos += 1
            self._dslot += 1
            return
        one: torch.Tensor | int = 1 if mask is None else mask.to(torch.int64)
        if self.put:
            op, word = self.op_word(self.pos)
            short = op == BINPUT
            wrong = torch.where(short, word & 0xFF, word & 0xFFFFFFFF) != self.slot
            self.bad |= wrong if mask is None else wrong & mask
            self.pos = self.pos + torch.where(short, 2, 5) * one
        else:
            self.pos = self.pos + one
        self.slot = self.slot + one

    def ref(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot, width, is a reference) at `pos` (not moved).

        A reference must name a slot set before it (else the row is `bad`).
        """
        op, word = self.op_word(self.pos)
        slot, width = self._op_slot(op, word)
        is_ref = (op == BINGET) | (op == LONG_BINGET)
        self.bad |= is_ref & (slot >= self.slot)
        return slot, width, is_ref

    def integer(self, none: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
        """An integer op (or NONE, read as 0, with `none`); where `mask` only."""
        op, word = self.op_word(self.pos)
        # Table lookups by index_select (a quarter of advanced indexing's time).
        v = word & _INT_BITS.index_select(0, op)
        width = _WIDTH.index_select(0, op)
        if int(op.max()) >= LONG1:  # LONG1 is the largest integer op: most batches have none
            longs = (op == LONG1).nonzero().flatten()
            lb = self.bytes_at(self.pos[longs], 10)
            nb = lb[:, 1].clamp(max=8)
            shifts = torch.arange(0, 64, 8, dtype=torch.int64).unsqueeze(0)
            keep = torch.arange(8).unsqueeze(0) < nb.unsqueeze(1)
            raw = ((lb[:, 2:10] * keep) << shifts).sum(1)  # wraps to int64 at 8 bytes
            top = torch.ones_like(nb) << (nb * 8 - 1).clamp(min=0, max=62)
            raw = torch.where((nb < 8) & (raw >= top), raw - (top << 1), raw)
            v[longs] = raw
            width = width.clone()
            width[longs] = 2 + nb
        if none:
            v = torch.where(op == NONE, 0, v)
        if mask is not None:
            v = torch.where(mask, v, 0)
            width = torch.where(mask, width, 0)
        self.pos = self.pos + width
        return v

    def size(self, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``torch.Size`` field of `ndim` dims.

        Returns:
            (values [n, ndim], its slot where a reference, else -1).
        """
        slot, width, _ = self.ref()
        after = self.op_at(self.pos + width)
        # Fresh: the class reference is followed by the ints (or its tuple's MARK / the empty
        # tuple); a reference by the next field's key or the end of the record's dict.
        fresh = (after != _H) & (after != _J) & (after != _U)
        ref_end = self.pos + width
        self.pos = ref_end + (1 if ndim > 3 else 0)
        values = [self.integer() for _ in range(ndim)]
        self.skip(1)  # TUPLEn / TUPLE / EMPTY_TUPLE
        if ndim:
            self.memo(fresh)
        self.skip(1)  # TUPLE1
        self.memo(fresh)
        self.skip(1)  # REDUCE
        self.memo(fresh)
        self.pos = torch.where(fresh, self.pos, ref_end)
        out = torch.stack(values, 1) if ndim else torch.empty(len(slot), 0, dtype=torch.int64)
        return out, torch.where(fresh, -1, slot)

    def size_any(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A ``torch.Size`` field of any number of dims.

        Returns:
            (values [n, most dims], dims, its slot where a reference, else -1).
        """
        slot, width, _ = self.ref()
        after = self.op_at(self.pos + width)
        fresh = (after != _H) & (after != _J) & (after != _U)
        empty = fresh & (after == _EMPTY_TUPLE)
        ref_end = self.pos + width
        self.pos = ref_end + (fresh & (after == _MARK)).long()
        values = []
        ndims = torch.zeros_like(self.pos)
        for _ in range(MAX_DIMS):
            more = fresh & _IS_INT.index_select(0, self.op_at(self.pos))
            if not bool(more.any()):
                break
            values.append(self.integer(mask=more))
            ndims += more.long()
        self.skip(1)  # EMPTY_TUPLE / TUPLE1-3 / TUPLE
        self.memo(fresh & ~empty)
        self.skip(1)  # TUPLE1
        self.memo(fresh)
        self.skip(1)  # REDUCE
        self.memo(fresh)
        self.pos = torch.where(fresh, self.pos, ref_end)
        out = torch.stack(values, 1) if values else torch.zeros(len(slot), 0, dtype=torch.int64)
        return out, ndims, torch.where(fresh, -1, slot)

    def string(self) -> None:
        """A string field: a fresh string and its memo op, or a memo reference."""
        op, word = self.op_word(self.pos)
        slot, width = self._op_slot(op, word)
        is_ref = (op == BINGET) | (op == LONG_BINGET)
        self.bad |= is_ref & (slot >= self.slot)
        n = torch.where(op == SHORT_BINUNICODE, 2 + (word & 0xFF), 5 + (word & 0xFFFFFFFF))
        self.pos = self.pos + torch.where(is_ref, width, n)
        self.memo(~is_ref)


def _decode_chunks(w: _Walk, t: _Template) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(coords [n, 2 * ndim], per size field its reference slots) of chunk records."""
    w.skip(t.ref_len["ChunkStorageMetadata"] + 2)  # the class, EMPTY_TUPLE, NEWOBJ
    w.memo()
    w.skip(1)  # EMPTY_DICT
    w.memo()
    w.skip(1 + t.ref_len["offsets"])  # MARK, the key
    offsets, off_ref = w.size(t.ndim)
    w.skip(t.ref_len["sizes"])
    sizes, size_ref = w.size(t.ndim)
    w.skip(2)  # SETITEMS, BUILD
    return torch.cat([offsets, sizes], 1), [off_ref, size_ref]


def _decode_storage(w: _Walk, t: _Template) -> tuple[torch.Tensor, ...]:
    """The columns of storage records.

    Returns:
        (offsets [n, most dims], dims, the offsets' reference slots, where [n, 2]).
    """
    w.skip(t.ref_len["MetadataIndex"] + 2)
    w.memo()
    w.skip(1)
    w.memo()
    w.skip(1 + t.ref_len["fqn"])
    w.string()
    w.skip(t.ref_len["index"])
    w.integer(none=True)  # the index hint (positions ignore it)
    w.skip(t.ref_len["offset"])
    offsets, ndims, off_ref = w.size_any()
    w.skip(2 + t.ref_len["_StorageInfo"] + 2)
    w.memo()
    w.skip(1)
    w.memo()
    w.skip(1 + t.ref_len["relative_path"])
    w.string()
    w.skip(t.ref_len["offset"])
    at = w.integer()
    w.skip(t.ref_len["length"])
    length = w.integer()
    w.skip(2)
    return offsets, ndims, off_ref, torch.stack([at, length], 1)


@dataclass(eq=False)
class _Sealed:
    """The memo slots some consecutive records of one run filled, and how they lie (`_parts`).

    A run is one segment or more: each a stretch of its records that wrote the same fields
    fresh (so the same number of memo slots each). A run's records mostly agree (a rank's
    first storage record writes its path fresh, the rest refer to it): a few segments.

    Attributes:
        start / end: Its slots.
        template: Its records' pattern.
        run: Its run's columns (shared by the run's segments).
        flags: Its records' fresh fields.
        per: Slots per record (`_per`).
        rec0: Its first record's place in its run.
        pending: Its records are queued, not decoded yet.
        batch / row0: Once decoded: its records are rows ``row0..`` of decoded batch `batch`.
    """

    start: int
    end: int
    template: _Template
    run: Any
    flags: int
    per: int
    rec0: int = 0
    pending: bool = True
    batch: int = -1
    row0: int = 0

    def record_of(self, i: int) -> tuple[int, int, int]:
        """(record in its run, its slot's place in the record, the record's flags) of slot `i`."""
        j, at = divmod(i - self.start, self.per)
        return self.rec0 + j, at, self.flags


@dataclass(eq=False)
class _Batch:
    """Runs of one template decoded together: their size columns share one tensor.

    Attributes:
        cols: chunks: coords [n, 2 * ndim]; storage: offsets [n, most dims].
        ndims: storage: each row's dims (None: chunks, `ndim` each).
        ndim: chunks: dims of each size.
        runs: Its runs' first segments (their columns are views of `cols`).
    """

    cols: torch.Tensor
    ndims: torch.Tensor | None
    ndim: int
    runs: list[_Sealed]


def _guarded(fn: Any) -> Any:
    """What the machine calls: any error of the column path becomes `Fallback`.

    The objects decide then; but for the file being too large (the object read refuses it too).
    """

    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except (Fallback, TooLarge):
            raise
        except Exception as exc:
            raise Fallback(f"{type(exc).__name__}: {exc}") from None

    call.__doc__, call.__name__ = fn.__doc__, fn.__name__
    return call


class ColumnRuns:
    """Reads runs of chunk and storage records as columns (NOTE: [metadata columns]).

    Handed to a `Machine` (as its plugin, ``dcp_vm.Plugin``) that builds the mirror classes.

    Args:
        resolve: The mirror resolver the machine builds classes with.

    Attributes:
        names: The strings storage runs refer to (keys and relative paths), by name id.
        storage_runs: Per dict (by ``id``), the `StorageRun` items set into it, in order, after
            its plain items' positions.
        chunk_runs / runs: How many chunk runs / runs of any kind were read as columns.
    """

    watched = frozenset({str, type})

    def __init__(self, resolve: Any) -> None:
        self.vm: Machine = None  # type: ignore[assignment]  # set by `attach`
        self.triggers: set[int] = set()
        # Slots of the names templates refer to (the latest slot holding each).
        self.slots: dict[str, int] = {}
        self.slot_name: dict[int, str] = {}
        self.mirror_names = {resolve(m, n): n for m, n in _TRACKED}
        self.lengths: set[int] = set()  # byte lengths of memoized strings (fresh alternatives)
        self.templates: dict[tuple[Any, ...], _Template] = {}
        # Templates in use, valid while `version` (bumped when a tracked slot or the set of
        # lengths changes) is the same.
        self.current: dict[tuple[str, int], tuple[int, _Template]] = {}
        self.version = 0
        self.last_ndim = 2
        self.sealed: list[_Sealed] = []
        self.sealed_starts: list[int] = []
        self.names: list[str] = []
        self.name_ids: dict[str, int] = {}
        self.raw_ids: dict[bytes, int] = {}  # a string field's bytes -> name id (bounded)
        self.last_keys: tuple[Sequence[bytes], array[int]] | None = None  # the last run's
        self.framed_left = 64  # `_Template.framed` patterns that may still be compiled
        # Per template, runs to decode: (segments, bytes, record lengths).
        self.pending: dict[_Template, list[tuple[list[_Sealed], list[Any], array[int]]]] = {}
        self.pending_bytes = 0
        self.batches: list[_Batch] = []
        # Sizes written as references: (batch, field, rows, the slots they name).
        self.size_refs: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self.storage_runs: dict[int, list[tuple[int, StorageRun]]] = {}
        self.keep: list[Any] = []  # dicts with runs (their ids must stay theirs)
        self.chunk_runs = 0
        self.runs = 0

    def attach(self, vm: Machine) -> None:
        """The machine this plugin reads for."""
        self.vm = vm

    def detach(self) -> None:
        """The read is over: drops the machine and what only resolving references needed.

        The runs handed out (`storage_runs`, the chunk runs in the metadata) keep their columns.
        """
        self.vm = None  # type: ignore[assignment]
        self.sealed, self.sealed_starts, self.batches = [], [], []
        self.pending.clear()
        self.size_refs.clear()

    # -- what the machine calls ---------------------------------------------------------------
    def noted(self, i: int, value: Any, overwrite: bool) -> None:
        """Tracks the slots of classes and field names, and the lengths of strings."""
        if overwrite:
            if self.sealed:
                # pickle.dump never sets a slot twice; what runs resolved against may change.
                raise Fallback("a memo slot set twice")
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
            if len(self.lengths) < 64:
                n = len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
                if 0 < n < 1 << 16 and n not in self.lengths:
                    self.lengths.add(n)
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

    def holds(self, i: int) -> bool:
        """Whether slot `i` is one a run filled."""
        k = bisect_right(self.sealed_starts, i) - 1
        return k >= 0 and i < self.sealed[k].end

    @_guarded
    def held(self, i: int) -> Any:
        """The value of slot `i` of a run: a string or a size (its tuples); else `Fallback`."""
        s = self.sealed[bisect_right(self.sealed_starts, i) - 1]
        j, at, f = s.record_of(i)
        parts = _parts(s.template, f)
        kind, field = parts[at]
        run = s.run
        if kind == "key":
            return self.names[int(run.fqns[j])]
        if kind == "path":
            return self.names[int(run.paths[j])]
        if kind != "size":
            raise Fallback("a reference to a record read as columns")
        if s.pending:
            self.flush()  # its integers, decoded
        if s.template.kind == "chunk":
            d = s.template.ndim
            v = tuple(run.coords[j, field * d : (field + 1) * d].tolist())
        else:
            v = tuple(run.offsets[j, : int(run.ndims[j])].tolist())
        # The size's own tuple (none for an empty one), its arguments' tuple, the size.
        first = parts.index(("size", field))
        size_parts = [(v,), torch.Size(v)] if not v else [v, (v,), torch.Size(v)]
        return size_parts[at - first]

    @_guarded
    def setitems(self, target: Any, items: list[Any]) -> bool:
        """Storage runs set into a dict: kept beside it, at their place among its items."""
        if not any(type(it) is StorageRun for it in items):
            return False
        if type(target) is not dict:
            raise Fallback("storage records outside a dict")
        lst = self.storage_runs.setdefault(id(target), [])
        if not lst:
            self.keep.append(target)
        plain: list[Any] = []
        for it in items:
            if type(it) is StorageRun:
                if len(plain) % 2:
                    raise Fallback("storage records where a value belongs")
                _setitems(target, plain)
                plain = []
                lst.append((len(target), it))
            else:
                plain.append(it)
        if len(plain) % 2:
            raise Fallback("storage records where a value belongs")
        _setitems(target, plain)
        return True

    @_guarded
    def appends(self, target: Any, items: list[Any]) -> bool:
        """Chunk runs appended to a list (a tensor's chunks)."""
        if not any(type(it) is ChunkRun for it in items):
            return False
        if type(target) is not list:
            raise Fallback("chunk records outside a list")
        target.extend(items)
        return True

    @_guarded
    def run_at(self, stack: list[Any]) -> bool:
        """Reads a run of chunk or storage records at the machine's position, if one starts."""
        vm = self.vm
        if not vm.in_order():
            return False  # a slot was set ahead: MEMOIZE would not append
        buf, pos = vm.buf, vm.pos
        op = buf[pos]
        if pos + (2 if op == BINGET else 5) > len(buf):
            return False
        slot = buf[pos + 1] if op == BINGET else struct.unpack_from("<I", buf, pos + 1)[0]
        name = self.slot_name.get(slot)
        if name == "ChunkStorageMetadata":
            if all(n in self.slots for n in _CHUNK_SLOTS):
                return self._run("chunk", stack)
        elif name == "MetadataIndex" and all(n in self.slots for n in _STORAGE_SLOTS):
            return self._run("storage", stack)
        return False

    @_guarded
    def finish(self) -> None:
        """Decodes what is queued and resolves sizes written as references (at STOP)."""
        self.flush()
        if self.size_refs:
            self._resolve_sizes()

    # -- runs ---------------------------------------------------------------------------------
    def template(self, kind: str, ndim: int) -> _Template | None:
        """The template of `kind` records (chunks: of `ndim` dims) for the slots known now.

        None past `_TEMPLATES` of them: a file that memoizes a field name again before each
        record would make one per record (a compiled pattern each, kept); its records are read
        op by op instead, as any record no template matches.
        """
        got = self.current.get((kind, ndim))
        if got is not None and got[0] == self.version:
            return got[1]
        names = _CHUNK_SLOTS if kind == "chunk" else _STORAGE_SLOTS
        lengths = tuple(sorted(self.lengths)) if kind == "storage" else ()
        proto = self.vm.proto
        key = (kind, ndim, tuple(self.slots[n] for n in names), lengths, proto >= 4)
        t = self.templates.get(key)
        if t is None:
            if len(self.templates) >= _TEMPLATES:
                return None
            t = self.templates[key] = _Template(
                kind, ndim, {n: self.slots[n] for n in names}, lengths, proto
            )
        self.current[(kind, ndim)] = (self.version, t)
        return t

    def _run(self, kind: str, stack: list[Any]) -> bool:
        vm = self.vm
        # Keep a window's worth in the buffer so a run is matched in one piece.
        if len(vm.buf) - vm.pos < WINDOW // 2 and not vm.input.eof:
            vm.need(WINDOW, soft=True)
        buf, pos = vm.buf, vm.pos
        # Chunks: the last number of dims first (a pattern that does not fit fails at the
        # first record). Storage records: any number of dims.
        last = self.last_ndim
        tries = (last, *(d for d in range(MAX_DIMS + 1) if d != last)) if kind == "chunk" else (-1,)
        frames = vm.proto >= 4  # pickle.dump frames protocols 4 and 5 (`_Template.framed`)
        for ndim in tries:
            t = self.template(kind, ndim)
            if t is None:
                continue
            # Per record: its bytes, then its fields that are fresh or references (C loops
            # over the records below; tensor ops for anything per record). A record split by
            # a frame header joins the run without it (`_stitch`), and the run goes on.
            found_all: list[tuple[bytes, ...]] = []
            lens = array("q")
            pieces: list[memoryview | bytes] = []
            at = pos
            while True:
                found = t.records.findall(buf, at)
                if not found[-1][0]:
                    found.pop()  # what follows the run
                if found:
                    part = array("q", map(len, map(_RECORD, found)))
                    # A view: the buffer it is cut from lives until the batch is decoded (a
                    # few windows), and the record bytes are copied once, into the batch.
                    n = sum(part)
                    pieces.append(memoryview(buf)[at : at + n])
                    at += n
                    lens += part
                    found_all += found
                    del found
                stitched = self._stitch(t, buf, at) if frames else None
                if stitched is None:
                    break
                record, spliced, at = stitched
                found_all.append(record)
                lens.append(len(spliced))
                pieces.append(spliced)
            if not found_all:
                continue
            groups = tuple(zip(*found_all))
            del found_all
            end = at
            start = vm.memo_len
            segs = self._layout(t, groups, start)
            if kind == "chunk":
                run: ChunkRun | StorageRun = ChunkRun(len(lens))
                self.chunk_runs += 1
                self.last_ndim = ndim
            else:
                run = self._storage(segs, groups)
            for seg in segs:
                seg.run = run
                self.sealed.append(seg)
                self.sealed_starts.append(seg.start)
            vm.seal(segs[-1].end - start)
            self.runs += 1
            self.pending.setdefault(t, []).append((segs, pieces, lens))
            self.pending_bytes += sum(map(len, pieces))
            if self.pending_bytes > _BATCH:
                self.flush()
            vm.pos = end
            stack.append(run)
            return True
        return False

    def _stitch(
        self, t: _Template, buf: bytes, at: int
    ) -> tuple[tuple[bytes, ...], bytes, int] | None:
        """A record at `at` that FRAME ops split, read as if they were not there.

        Returns:
            (its groups as `records` captures them, its bytes without the FRAMEs, where it ends
            in `buf`), or None: no such record there (it is read op by op).
        """
        if not t.has_framed:
            # Each template's is compiled once (a few ms): a file that makes template after
            # template (memoizing a field name again and again) gets a bounded number.
            if self.framed_left <= 0:
                return None
            self.framed_left -= 1
        m = t.framed.match(buf, at)
        if m is None:
            return None
        cuts = sorted(a for a, _ in m.regs[1:] if a >= 0)  # each FRAME that took part
        kept, prev = [], at
        for c in cuts:
            # As the machine: a FRAME longer than the file may be is an error, not a no-op.
            if c < prev or int.from_bytes(buf[c + 1 : c + 9], "little") > self.vm.input.limit:
                return None
            kept.append(buf[prev:c])
            prev = c + 9
        kept.append(buf[prev : m.end()])
        spliced = b"".join(kept)
        whole = t.records.match(spliced)
        if not cuts or whole is None or whole.end(1) != len(spliced):
            return None
        return whole.groups(b""), spliced, m.end()

    def _layout(self, t: _Template, groups: tuple[Any, ...], start: int) -> list[_Sealed]:
        """Which fields of each record were fresh, and so where its memo slots lie.

        The run's segments (`_Sealed`): where most records agree on a field, the few that do
        not are found by C loops (``tuple.index``), never a Python step per record.
        """
        n = len(groups[0])
        # Per field: the group of its reference (empty where the field was fresh), or for the
        # empty size the group of its empty tuple (empty where it was not one).
        if t.kind == "chunk":
            fields = [(groups[1], _OFFSETS, True), (groups[2], _SIZES, True)]
        else:
            fields = [(groups[2], _KEY, True), (groups[4], _OFFSET, True),
                      (groups[3], _EMPTY_SIZE, False), (groups[6], _PATH, True)]  # fmt: skip
        flags = 0
        odd: dict[int, int] = {}  # record -> the bits where it differs from `flags`
        for g, bit, set_if_empty in fields:
            empty = g.count(b"")
            have = empty if set_if_empty else n - empty  # records with `bit`
            if have * 2 > n:
                flags |= bit
            if have == 0 or have == n:
                continue
            # The records that differ from the majority (at most half).
            find_empty = (have * 2 > n) != set_if_empty
            for j in _where(g, find_empty, min(have, n - have)):
                odd[j] = odd.get(j, 0) | bit
        per = _per(t, flags)
        if not odd:
            return [_Sealed(start, start + n * per, t, None, flags, per)]
        segs: list[_Sealed] = []
        slot, rec = start, 0

        def add(j: int, k: int, f: int) -> None:
            nonlocal slot
            p = _per(t, f)
            last = segs[-1] if segs else None
            if last is not None and last.flags == f:
                last.end += k * p
            else:
                segs.append(_Sealed(slot, slot + k * p, t, None, f, p, j))
            slot += k * p

        for j in sorted(odd):
            if j > rec:
                add(rec, j - rec, flags)
            add(j, 1, flags ^ odd[j])
            rec = j + 1
        if rec < n:
            add(rec, n - rec, flags)
        return segs

    def _storage(self, segs: list[_Sealed], groups: tuple[Any, ...]) -> StorageRun:
        """The run's keys and paths as name ids (`names`)."""
        keys = _either(groups[1], groups[2])
        last = self.last_keys
        if last is not None and keys == last[0]:
            # The same keys in the same order as the run before (every rank's entries, one
            # run a rank): the same ids, for a compare of bytes instead of a lookup each.
            fqns = last[1][:]
        else:
            fqns = self._ids(keys, segs, groups)
            self.last_keys = (keys, fqns)
        path_ids = self._ids(_either(groups[5], groups[6]), segs, groups)
        if len(self.raw_ids) > 1 << 16:
            self.raw_ids.clear()
        return StorageRun(fqns, path_ids)

    def _ids(
        self, raws: Sequence[bytes], segs: list[_Sealed], groups: tuple[Any, ...]
    ) -> array[int]:
        """The name ids of one string field of every record (`raws`: as written)."""
        ids = self.raw_ids
        # itemgetter: one C loop, no call per item (of one item it gives the item itself)
        get = itemgetter(*raws) if len(raws) > 1 else lambda d: (d[raws[0]],)
        try:  # every one seen before (most runs)
            return array("q", get(ids))
        except KeyError:
            self._learn(set(raws).difference(ids), segs, groups)
            return array("q", get(ids))

    def _learn(self, raws: set[bytes], segs: list[_Sealed], groups: tuple[Any, ...]) -> None:
        """The name ids of key and path fields (fresh strings or references) not seen yet."""
        ids = self.raw_ids
        start = segs[0].start
        for raw in raws:
            if raw[0] in (BINGET, LONG_BINGET):
                slot = raw[1] if raw[0] == BINGET else struct.unpack_from("<I", raw, 1)[0]
                if slot >= start:  # a string an earlier record of this run memoized
                    got = _fresh_string(segs, slot, groups)
                    if got is None:
                        raise Fallback("a storage record whose key or path is not a string")
                    ids[raw] = self._fresh_id(got)
                else:
                    value = self.vm.get(slot)
                    if type(value) is not str:
                        raise Fallback("a storage record whose key or path is not a string")
                    ids[raw] = self.name_id(value)
            else:
                ids[raw] = self._fresh_id(raw)

    def _fresh_id(self, raw: bytes) -> int:
        """The name id of a fresh string's bytes (its opcode and length, then UTF-8)."""
        body = raw[2:] if raw[0] == SHORT_BINUNICODE else raw[5:]
        try:
            return self.name_id(body.decode("utf-8", "surrogatepass"))
        except UnicodeDecodeError:
            raise Fallback("a string that is not UTF-8") from None

    def name_id(self, value: str) -> int:
        """The id of `value` in `names` (added if new)."""
        i = self.name_ids.get(value)
        if i is None:
            i = self.name_ids[value] = len(self.names)
            self.names.append(value)
        return i

    def flush(self) -> None:
        """Decodes every queued run's integers into its columns (tensor ops cost per call)."""
        for t, queued in self.pending.items():
            raw = bytearray().join([*(p for _, d, _ in queued for p in d), _PADDING])
            data = torch.frombuffer(raw, dtype=torch.uint8)
            all_lens, seg_start, seg_per, seg_n = array("q"), array("q"), array("q"), array("q")
            for segs, _, ln in queued:
                all_lens += ln
                for g in segs:
                    seg_start.append(g.start)
                    seg_per.append(g.per)
                    seg_n.append((g.end - g.start) // g.per)
            lens = torch.frombuffer(all_lens, dtype=torch.int64)
            ends = torch.cumsum(lens, 0)
            # Each record's first slot: its segment's first, plus `per` for each record
            # before it in the segment.
            sn = torch.frombuffer(seg_n, dtype=torch.int64)
            if int(sn.sum()) != len(all_lens):
                raise Fallback("segments that are not their run's records")
            within = torch.arange(len(all_lens)) - torch.repeat_interleave(torch.cumsum(sn, 0)
                                                                           - sn, sn)  # fmt: skip
            first = torch.repeat_interleave(torch.frombuffer(seg_start, dtype=torch.int64), sn)
            first += within * torch.repeat_interleave(torch.frombuffer(seg_per, dtype=torch.int64),
                                                      sn)  # fmt: skip
            del within, sn
            # Each record's end slot: the next one's first, or its run's end.
            last_row = torch.cumsum(torch.tensor([len(ln) for _, _, ln in queued]), 0) - 1
            next_slot = torch.empty_like(first)
            next_slot[:-1] = first[1:]
            next_slot[last_row] = torch.tensor([segs[-1].end for segs, _, _ in queued])
            walk = _Walk(data, ends - lens, first, t.put)
            ndims: torch.Tensor | None = None
            if t.kind == "chunk":
                cols, refs = _decode_chunks(walk, t)
            else:
                cols, ndims, off_ref, where = _decode_storage(walk, t)
                refs = [off_ref]
            if bool(walk.bad.any()) or not (bool((walk.pos == ends).all())
                                            and bool((walk.slot == next_slot).all())):  # fmt: skip
                raise Fallback("a record that is not what its pattern matched")
            del walk, data, raw
            batch = len(self.batches)
            self.batches.append(_Batch(cols, ndims, t.ndim, [segs[0] for segs, _, _ in queued]))
            k = 0
            for segs, _, ln in queued:
                n = len(ln)
                run = segs[0].run
                if t.kind == "chunk":
                    run.coords = cols[k : k + n]
                else:
                    assert ndims is not None
                    run.offsets, run.ndims = cols[k : k + n], ndims[k : k + n]
                    run.where = where[k : k + n]
                for g in segs:
                    g.pending = False
                    g.batch, g.row0 = batch, k + g.rec0
                k += n
            for field, slots in enumerate(refs):
                rows = (slots >= 0).nonzero().flatten()
                if rows.numel():
                    self.size_refs.append((batch, field, rows, slots[rows]))
        self.pending.clear()
        self.pending_bytes = 0

    def _resolve_sizes(self) -> None:
        """Fills every size written as a reference with the values of the size it names.

        A fresh size of a run is found through the runs' segments (records of `per` slots
        each: `_parts`); any other slot through the machine's memo (a ``torch.Size`` or tuple
        of ints, else `Fallback`).
        """
        runs = self.sealed
        starts = torch.tensor(self.sealed_starts, dtype=torch.int64)
        ends = torch.tensor([s.end for s in runs], dtype=torch.int64)
        per = torch.tensor([s.per for s in runs], dtype=torch.int64)
        flags = torch.tensor([s.flags for s in runs], dtype=torch.int64)
        chunk = torch.tensor([s.template.kind == "chunk" for s in runs])
        sz = torch.tensor([s.template.sz for s in runs])
        batch = torch.tensor([s.batch for s in runs])
        row0 = torch.tensor([s.row0 for s in runs])
        cache: dict[int, tuple[int, ...] | None] = {}
        todo = [(b, field, rows[lo : lo + _BLOCK], slots[lo : lo + _BLOCK])
                for b, field, rows, slots in self.size_refs
                for lo in range(0, len(rows), _BLOCK)]  # fmt: skip
        self.size_refs.clear()
        for b, field, rows, slots in todo:  # a block at a time (bounded temporaries)
            r = (torch.searchsorted(starts, slots, right=True) - 1).clamp(min=0)
            inside = (slots >= starts[r]) & (slots < ends[r])
            off = slots - starts[r]
            p = per[r].clamp(min=1)
            rec, local, f = off // p, off % p, flags[r]
            # Which size (if any) each slot holds: its field in its record (`_parts`).
            b1, b2 = (f & 1) > 0, (f & 2) > 0  # chunk: offsets, sizes; storage: key, offset
            zs = sz[r]
            zs_storage = 3 - ((f & _EMPTY_SIZE) > 0).long()
            target = torch.where(
                chunk[r],
                torch.where(b1 & (local == 1 + zs), 0,
                            torch.where(b2 & (local == 1 + zs * b1.long() + zs), 1, -1)),
                torch.where(b2 & (local == 1 + b1.long() + zs_storage), 0, -1),
            )  # fmt: skip
            hit = inside & (target >= 0)
            values = torch.zeros(len(slots), MAX_DIMS, dtype=torch.int64)
            dims = torch.zeros(len(slots), dtype=torch.int64)
            tb = batch[r]
            for one in tb[hit].unique().tolist():
                sel = (hit & (tb == one)).nonzero().flatten()
                src = self.batches[one]
                row = (row0[r[sel]] + rec[sel]).unsqueeze(1)
                if src.ndims is None:
                    d = src.ndim
                    got = src.cols[row, (target[sel] * d).unsqueeze(1) + torch.arange(d)]
                    dims[sel] = d
                else:
                    got = src.cols[row.squeeze(1)]
                    dims[sel] = src.ndims[row.squeeze(1)].long()
                values[sel, : got.shape[1]] = got
            for k in (~hit).nonzero().flatten().tolist():
                slot = int(slots[k])
                if slot not in cache:
                    cache[slot] = _ints_of(self.vm.get(slot))
                ints = cache[slot]
                if ints is None:
                    raise Fallback("a size that refers to something else than a size")
                values[k, : len(ints)] = torch.tensor(ints, dtype=torch.int64)
                dims[k] = len(ints)
            self._fill(self.batches[b], field, rows, values, dims)

    def _fill(self, into: _Batch, field: int, rows: torch.Tensor, values: torch.Tensor,
              dims: torch.Tensor) -> None:  # fmt: skip
        """Writes resolved sizes into a batch's rows (widening a storage batch's offsets)."""
        if into.ndims is None:
            d = into.ndim
            if bool((dims != d).any()):
                raise Fallback("a chunk whose size has another number of dims")
            into.cols[rows, field * d : (field + 1) * d] = values[:, :d]
            return
        need = int(dims.max())
        if need > into.cols.shape[1]:
            wide = torch.zeros(into.cols.shape[0], need, dtype=torch.int64)
            wide[:, : into.cols.shape[1]] = into.cols
            into.cols = wide
            for s in into.runs:
                s.run.offsets = wide[s.row0 : s.row0 + len(s.run)]
        into.cols[rows] = values[:, : into.cols.shape[1]]
        assert into.ndims is not None
        into.ndims[rows] = dims.to(into.ndims.dtype)


def _either(fresh: tuple[bytes, ...], ref: tuple[bytes, ...]) -> tuple[bytes, ...] | list[bytes]:
    """Per record, whichever of its two groups took part (the other is empty)."""
    empty = fresh.count(b"")
    if empty == 0:
        return fresh
    if empty == len(fresh):
        return ref
    if empty * 2 < len(fresh):  # mostly fresh: the few references put in
        out = list(fresh)
        for j in _where(fresh, True, empty):
            out[j] = ref[j]
        return out
    out = list(ref)  # mostly references (a rank's path: fresh in its first record)
    for j in _where(ref, True, len(fresh) - empty):
        out[j] = fresh[j]
    return out


def _fresh_string(segs: list[_Sealed], slot: int, groups: tuple[Any, ...]) -> bytes | None:
    """The bytes of the fresh string a storage run's record memoized in `slot`, if one did."""
    s = segs[bisect_right([g.start for g in segs], slot) - 1]
    if slot >= s.end:
        return None
    j, at, f = s.record_of(slot)
    kind, _ = _parts(s.template, f)[at]
    return groups[1][j] if kind == "key" else groups[5][j] if kind == "path" else None


def _where(g: tuple[bytes, ...], empty: bool, k: int) -> list[int]:
    """The `k` places where `g` holds b"" (`empty`) or anything else, found by C loops."""
    out: list[int] = []
    j = -1
    if empty:
        for _ in range(k):
            j = g.index(b"", j + 1)
            out.append(j)
        return out
    mark = bytes(map(bool, g))  # 1 where something was captured
    for _ in range(k):
        j = mark.index(1, j + 1)
        out.append(j)
    return out


def _ints_of(value: Any) -> tuple[int, ...] | None:
    """`value` as a size's ints, when it is one (a ``torch.Size`` or tuple of int64 ints)."""
    if type(value) not in (torch.Size, tuple) or len(value) > MAX_DIMS:
        return None
    if not all(type(v) is int and -(1 << 63) <= v < 1 << 63 for v in value):
        return None
    return tuple(value)


def _setitems(target: dict[Any, Any], items: list[Any]) -> None:
    for i in range(0, len(items), 2):
        target[items[i]] = items[i + 1]


__all__ = ["MAX_DIMS", "ChunkRun", "ColumnRuns", "Fallback", "StorageRun"]
