"""The restricted pickle machine that reads DCP ``.metadata``: no code from a file ever runs.

NOTE: [restricted machine] Every ``.metadata`` fsdpcheck reads goes through this machine, never
through Python's unpickler:

* Code: every global a file names is resolved by ``fsdpcheck._unpickle.admitted_global`` (DCP's
  metadata classes or fsdpcheck's mirrors of them, torch dtypes and ``torch.Size``, pure paths,
  DCP's enums, plain containers); anything else is refused before it is built.
* Memory: CPython's C unpickler sizes its memo by the index a file names (one ``LONG_BINPUT``
  2**31 - 1 asks for 16 GiB, then the OOM killer). Here the memo is a list while it fills in
  order (8 bytes a slot) and a dict for any other slot: a slot the file names allocates one
  entry, whatever its number. No length the file names is read before those bytes are there
  (`Input`), and the file is read at most `Input.limit` bytes.
* Nesting: the caller runs `Machine.load` on a stack sized for what the bytes can nest
  (``fsdpcheck._unpickle.on_a_deep_stack``).

It is the same kind of code as torch's ``_weights_only_unpickler``: one loop over opcodes
(the ones ``pickle.dump`` writes for metadata first, the others after) and a memo. Readers
that turn long runs of records into columns are handed to it as a `Plugin` (``dcp_runs``); it
knows nothing of them but the calls below.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import struct
from collections.abc import Callable
from typing import Any, Protocol

from fsdpcheck._unpickle import UnsafePickleError, admitted_global

#: Bytes read from the file at a time.
WINDOW = 4 << 20


class StreamError(ValueError):
    """The pickle is malformed (the same situations where the unpickler raises)."""


class TooLarge(Exception):
    """The file is longer than the machine may read."""


class Stream(Protocol):
    """A file read from its start that is not a local descriptor (an object in a store)."""

    size: int

    def read(self, n: int) -> bytes:
        """Up to `n` more bytes (b"" at the end)."""
        ...

    def seek(self, pos: int) -> int:
        """Moves to `pos`."""
        ...


class Input:
    """The file as windows read on demand: the bytes read so far are hashed and counted.

    Attributes:
        limit: Most bytes read (`TooLarge` past it).
        read_total: Bytes read so far.
        eof: The end of the file was reached.
    """

    def __init__(self, fd: int | Stream, limit: int) -> None:
        self.fd, self.limit = fd, limit
        self.read_total = 0
        self.eof = False
        self._hash = hashlib.sha256()

    def window(self) -> bytes:
        """The next window of the file (b"" at its end)."""
        data = os.read(self.fd, WINDOW) if isinstance(self.fd, int) else self.fd.read(WINDOW)
        if not data:
            self.eof = True
            return data
        self.read_total += len(data)
        if self.read_total > self.limit:
            raise TooLarge()
        self._hash.update(data)
        return data

    def rest(self) -> None:
        """Reads the rest of the file (for the digest; bytes after STOP are ignored)."""
        while not self.eof:
            self.window()

    def digest(self) -> str:
        """sha256 (hex) of the bytes read."""
        return self._hash.hexdigest()


class Plugin(Protocol):
    """What reads some records its own way, handed to a `Machine` (``dcp_runs.ColumnRuns``).

    The machine calls it where it meets what the plugin asked for, and nowhere else:

    Attributes:
        triggers: Memo slots whose reference (``BINGET``, any ``LONG_BINGET`` while it is
            non-empty) may start records the plugin reads (`run_at`).
        watched: Types of memoized values the plugin is told of (`noted`) when they are
            appended to the memo; any value overwriting a slot is told of too.
    """

    triggers: set[int]
    watched: frozenset[type]

    def run_at(self, stack: list[Any]) -> bool:
        """At a reference to a trigger slot (``machine.pos``): read records there, if it can.

        When it does, it pushes what stands for them onto `stack`, moves ``machine.pos`` past
        them and accounts for their memo slots (`Machine.seal`); returns whether it did.
        """
        ...

    def noted(self, i: int, value: Any, overwrite: bool) -> None:
        """Memo slot `i` was set to `value` (`overwrite`: it held a value already)."""
        ...

    def holds(self, i: int) -> bool:
        """Whether memo slot `i` is one of the plugin's (set by records it read)."""
        ...

    def held(self, i: int) -> Any:
        """The value in the plugin's memo slot `i` (it may refuse: see ``dcp_runs``)."""
        ...

    def setitems(self, target: Any, items: list[Any]) -> bool:
        """SETITEM(S) or DICT: whether it set `items` (some of them its own) into `target`."""
        ...

    def appends(self, target: Any, items: list[Any]) -> bool:
        """APPEND(S): whether it appended `items` (some of them its own) to `target`."""
        ...

    def finish(self) -> None:
        """At STOP, before the root object is returned."""
        ...


_HOLE = object()  # a memo slot not set

# Opcodes (pickle's names).
_MARK, _STOP, _POP, _POP_MARK, _DUP = 0x28, 0x2E, 0x30, 0x31, 0x32
BININT, BININT1, BININT2, LONG1, _LONG4 = 0x4A, 0x4B, 0x4D, 0x8A, 0x8B
NONE, _NEWTRUE, _NEWFALSE, _BINFLOAT = 0x4E, 0x88, 0x89, 0x47
SHORT_BINUNICODE, BINUNICODE, _BINUNICODE8 = 0x8C, 0x58, 0x8D
_SHORT_BINBYTES, _BINBYTES, _BINBYTES8 = 0x43, 0x42, 0x8E
_EMPTY_TUPLE, _TUPLE, _TUPLE1, _TUPLE2, _TUPLE3 = 0x29, 0x74, 0x85, 0x86, 0x87
_EMPTY_LIST, _APPEND, _APPENDS, _LIST = 0x5D, 0x61, 0x65, 0x6C
_EMPTY_DICT, _DICT, _SETITEM, _SETITEMS = 0x7D, 0x64, 0x73, 0x75
_EMPTY_SET, _ADDITEMS, _FROZENSET = 0x8F, 0x90, 0x91
_GLOBAL, _STACK_GLOBAL, _REDUCE, _BUILD, _NEWOBJ, _NEWOBJ_EX = 0x63, 0x93, 0x52, 0x62, 0x81, 0x92
BINGET, LONG_BINGET, BINPUT, LONG_BINPUT, MEMOIZE = 0x68, 0x6A, 0x71, 0x72, 0x94
_PROTO, FRAME, _PERSID, _BINPERSID = 0x80, 0x95, 0x50, 0x51
_INT, _LONG, _FLOAT, _STRING, _UNICODE = 0x49, 0x4C, 0x46, 0x53, 0x56
_BINSTRING, _SHORT_BINSTRING, _BYTEARRAY8 = 0x54, 0x55, 0x96
_GET, _PUT, _INST, _OBJ, _EXT1, _EXT2, _EXT4 = 0x67, 0x70, 0x69, 0x6F, 0x82, 0x83, 0x84


class Machine:
    """The restricted pickle machine (NOTE: [restricted machine]).

    Args:
        source: The file, read from its start.
        what: The file, for messages.
        resolve: Builds an admitted DCP class (the mirrors); None builds DCP's own classes.
        plugin: Reads runs of records its own way (None: every record an object).

    Attributes a plugin reads and moves (nothing else of the machine is its business):
        buf / pos: The bytes read and not yet consumed start at ``buf[pos]``.
        memo_len: Memo slots set (``MEMOIZE`` sets slot `memo_len`).
        max_slot: The greatest memo slot set (-1: none).
        proto: The pickle's protocol (0 before a ``PROTO`` opcode).
    """

    def __init__(
        self,
        source: Input,
        what: str,
        resolve: Callable[[str, str], Any] | None,
        plugin: Plugin | None = None,
    ) -> None:
        self.input, self.what, self.resolve, self.plugin = source, what, resolve, plugin
        self.buf = b""
        self.pos = 0
        self.proto = 0
        # The memo: a list while slots are set in order (8 bytes a slot: an objects-only read of
        # 100k keys memoizes ~1.5M objects), a dict for every other slot; a plugin's slots are
        # its own (`seal`).
        self.mlist: list[Any] = []
        self.memo: dict[int, Any] = {}
        self.memo_len = 0
        self.max_slot = -1

    # -- input ------------------------------------------------------------------------------
    def need(self, n: int, soft: bool = False) -> None:
        """At least `n` bytes from `pos` in `buf` (reads on; StreamError at the end).

        With `soft`, as many as there are up to `n` (no error).
        """
        if self.pos + n <= len(self.buf):
            return
        limit = self.input.limit
        if n > limit:  # a length no file within the limit can hold: read nothing
            if soft:
                n = limit
            else:
                raise StreamError("pickle data was truncated")
        parts: list[bytes | memoryview] = [memoryview(self.buf)[self.pos :]]  # copied once
        have = len(parts[0])
        while have < n and not self.input.eof:
            # Never more than a window at once: a length read from the file sizes no
            # allocation before those bytes exist.
            data = self.input.window()
            parts.append(data)
            have += len(data)
        self.buf = b"".join(parts)
        self.pos = 0
        if have < n and not soft:
            raise StreamError("pickle data was truncated")

    def take(self, n: int) -> bytes:
        """The next `n` bytes."""
        self.need(n)
        p = self.pos
        self.pos = p + n
        return self.buf[p : p + n]

    def line(self) -> bytes:
        """The bytes up to the next newline (text opcodes), at most 4 KB."""
        out = bytearray()
        while True:
            c = self.take(1)
            if c == b"\n":
                return bytes(out)
            out += c
            if len(out) > 4096:
                raise StreamError("pickle data was truncated")

    # -- memo -------------------------------------------------------------------------------
    def put(self, i: int, value: Any) -> None:
        """Sets memo slot `i` (never an allocation sized by `i`)."""
        mlist = self.mlist
        n = len(mlist)
        if i == n and self.memo_len == n and not self.memo:  # in order (the common case)
            mlist.append(value)
            self.memo_len = n + 1
            if i > self.max_slot:
                self.max_slot = i
            plugin = self.plugin
            if plugin is not None and type(value) in plugin.watched:
                plugin.noted(i, value, False)
            return
        if i < n:
            existed = mlist[i] is not _HOLE
            mlist[i] = value
        else:
            existed = i in self.memo
            if not existed and self.plugin is not None and i < self.memo_len:
                existed = self.plugin.holds(i)
            self.memo[i] = value
        if not existed:
            self.memo_len += 1
        if i > self.max_slot:
            self.max_slot = i
        if self.plugin is not None and (existed or type(value) in self.plugin.watched):
            self.plugin.noted(i, value, existed)

    def get(self, i: int) -> Any:
        """The value in memo slot `i`."""
        if i < len(self.mlist):
            got = self.mlist[i]
            if got is not _HOLE:
                return got
        got = self.memo.get(i, _HOLE)
        if got is not _HOLE:
            return got
        if self.plugin is not None and self.plugin.holds(i):
            return self.plugin.held(i)
        raise StreamError(f"Memo value not found at index {i}")

    def seal(self, n: int) -> None:
        """`n` memo slots from `memo_len` on were set by a plugin's records (it holds them)."""
        self.memo_len += n
        self.max_slot = max(self.max_slot, self.memo_len - 1)

    def in_order(self) -> bool:
        """Whether every slot below `memo_len` is set and none above (MEMOIZE appends)."""
        return self.max_slot < self.memo_len

    # -- containers ---------------------------------------------------------------------------
    def setitems(self, target: Any, items: list[Any]) -> None:
        """SETITEM(S) and DICT: the plugin's if it takes them, else key by key."""
        if self.plugin is not None and self.plugin.setitems(target, items):
            return
        if len(items) % 2:
            raise StreamError("odd number of items for SETITEMS")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def appends(self, target: Any, items: list[Any]) -> None:
        """APPEND(S): the plugin's if it takes them, else the target's own extend/append."""
        if self.plugin is not None and self.plugin.appends(target, items):
            return
        if type(target) is list:
            target.extend(items)
            return
        extend = getattr(target, "extend", None)
        if extend is not None:
            extend(items)
            return
        for it in items:
            target.append(it)

    # -- the machine --------------------------------------------------------------------------
    def load(self) -> Any:
        """Runs the pickle to its STOP; the root object."""
        stack: list[Any] = []
        marks: list[int] = []
        get = self.get
        put = self.put
        take = self.take
        plugin = self.plugin
        triggers: set[int] = plugin.triggers if plugin is not None else set()

        def pop_mark() -> list[Any]:
            if not marks:
                raise StreamError("could not find MARK")
            k = marks.pop()
            items = stack[k:]
            del stack[k:]
            return items

        mlist, memo = self.mlist, self.memo
        watched = plugin.watched if plugin is not None else frozenset()
        buf, buflen = self.buf, len(self.buf)
        while True:
            # Hot opcodes read their fixed-size argument from the buffer directly: at least 9
            # bytes (an opcode and 8) are in it, or the file ends.
            pos = self.pos
            if buf is not self.buf:
                buf, buflen = self.buf, len(self.buf)
            if pos + 9 > buflen:
                self.need(9, soft=True)
                pos, buf, buflen = self.pos, self.buf, len(self.buf)
                if pos >= buflen:
                    raise StreamError("pickle data was truncated")
            op = buf[pos]
            if op == MEMOIZE:
                if not stack:
                    raise StreamError("stack is empty")
                self.pos = pos + 1
                n = self.memo_len
                value = stack[-1]
                if n == len(mlist) and not memo and type(value) not in watched:
                    mlist.append(value)  # `put`'s common case, inline
                    self.memo_len = n + 1
                    self.max_slot = n
                else:
                    put(n, value)
                continue
            if op == BINGET:
                slot = buf[pos + 1] if pos + 1 < buflen else -1
                if slot in triggers:
                    assert plugin is not None
                    if plugin.run_at(stack):
                        continue
                    pos = self.pos  # the attempt may have refilled the buffer
                self.pos = pos + 2
                if slot < 0:
                    raise StreamError("pickle data was truncated")
                got = mlist[slot] if slot < len(mlist) else _HOLE
                stack.append(got if got is not _HOLE else get(slot))
                continue
            if op == LONG_BINGET:
                if triggers:
                    assert plugin is not None
                    if plugin.run_at(stack):
                        continue
                    pos = self.pos  # the attempt may have refilled the buffer
                if pos + 5 <= len(self.buf):
                    self.pos = pos + 5
                    stack.append(get(struct.unpack_from("<I", self.buf, pos + 1)[0]))
                    continue
                self.pos = pos + 1
                stack.append(get(struct.unpack("<I", take(4))[0]))
                continue
            if op == BININT1 and pos + 2 <= buflen:
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
            elif op == SHORT_BINUNICODE:
                n = take(1)[0]
                stack.append(take(n).decode("utf-8", "surrogatepass"))
            elif op == BININT2:
                stack.append(struct.unpack("<H", take(2))[0])
            elif op == BININT:
                stack.append(struct.unpack("<i", take(4))[0])
            elif op == BININT1:
                stack.append(take(1)[0])
            elif op == NONE:
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
            elif op == BINPUT:
                if not stack:
                    raise StreamError("stack is empty")
                put(take(1)[0], stack[-1])
            elif op == LONG_BINPUT:
                if not stack:
                    raise StreamError("stack is empty")
                put(struct.unpack("<I", take(4))[0], stack[-1])
            elif op == LONG1:
                n = take(1)[0]
                stack.append(int.from_bytes(take(n), "little", signed=True))
            elif op == _LONG4:
                (n,) = struct.unpack("<i", take(4))
                if n < 0:
                    raise StreamError("LONG pickle has negative byte count")
                stack.append(int.from_bytes(take(n), "little", signed=True))
            elif op == _BINFLOAT:
                stack.append(struct.unpack(">d", take(8))[0])
            elif op == BINUNICODE:
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
                proto = take(1)[0]
                if proto > 5:
                    raise StreamError("unsupported pickle protocol")
                self.proto = proto
            elif op == FRAME:
                (n,) = struct.unpack("<Q", take(8))
                if n > self.input.limit:
                    raise StreamError("frame size > sys.maxsize")
            elif op == _STOP:
                if len(stack) != 1 or marks:
                    raise StreamError("unpickling stack underflow" if not stack else
                                      "unexpected MARK found")  # fmt: skip
                self.input.rest()
                if plugin is not None:
                    plugin.finish()
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


__all__ = [
    "WINDOW",
    "Input",
    "Machine",
    "Plugin",
    "Stream",
    "StreamError",
    "TooLarge",
]
