"""Reading tensor bytes where they lie: page-aligned buffers, byte-range reads, mapped pages.

NOTE: [raw DCP chunks] torch's FileSystemWriter stores each tensor chunk as a torch.save blob (a
zip archive) at a byte range of a ``.distcp`` file. torch.save writes every record uncompressed
("stored") and pads the data records to 64 bytes inside the blob, so a chunk's elements are one
run of bytes at an offset found from the zip's headers alone. Its layout (dtype, shape, strides,
storage offset) is in the blob's ``data.pkl``, which is loaded here with torch's weights-only
unpickler and ``map_location="meta"``: no element is read and nothing beyond what
``weights_only`` admits is built. The result is then checked against ``.metadata`` (dtype,
chunk size), the record (stored, one storage, of exactly the bytes that layout needs, inside the
storage entry) and the byte order. Anything else (compressed, a storage transform, several
storages, big-endian, a shape that differs from ``.metadata``) returns None: that chunk goes
through the safe storage reader instead (torch.load ``weights_only`` of the whole blob).
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import struct
import sys
import threading
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from fsdpcheck.sources.base import CheckpointError

PAGE = mmap.PAGESIZE
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header (30 bytes)
# madvise advice numbers (Linux). POPULATE_READ (5.14+) maps the pages now, so the kernel that
# reads them next takes no page faults; WILLNEED only starts read-ahead into the page cache.
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` whose first byte is page-aligned.

    Args:
        nbytes: Size in bytes.
        pin: Allocate page-locked host memory (for asynchronous copies to a GPU).
    """
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip : skip + nbytes]


def _writable_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte-range reads go into contiguous CPU tensors only")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def pread_into(fd: int, t: torch.Tensor, offset: int, what: str) -> None:
    """Fills the contiguous CPU tensor `t` with the bytes of `fd` from `offset` on.

    Raises:
        CheckpointError: The file ends first (it shrank after it was checked).
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return
    view = _writable_view(t)
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CheckpointError(
                f"{what}: only {done} of {n} bytes could be read at byte {offset} (the file "
                "changed after it was checked?)"
            )
        done += got


_libc: Any = None
_madvise_ok = True


def populate(t: torch.Tensor) -> None:
    """Maps the pages under a memory-mapped CPU tensor now (read-ahead for the next kernel).

    A hint: errors are ignored (an address that is not a file mapping, an old kernel). Called on
    a worker thread, it moves the page faults off the thread that runs the kernel.
    """
    global _libc, _madvise_ok
    if (
        not _madvise_ok
        or t.numel() == 0
        or t.device.type != "cpu"
        or not sys.platform.startswith("linux")
    ):
        return
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _madvise_ok = False
            return
    lo = t.data_ptr()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    hi = lo + span * t.element_size()
    start = lo - lo % PAGE
    if _libc.madvise(start, hi - start, _MADV_POPULATE_READ) != 0:
        _libc.madvise(start, hi - start, _MADV_WILLNEED)


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable read-only file."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._len, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        data = os.pread(self._fd, n, self._start + self._pos)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def read_at(self, pos: int, n: int) -> bytes:
        if pos < 0 or pos + n > self._len:
            raise ValueError("outside the blob")
        data = os.pread(self._fd, n, self._start + pos)
        if len(data) != n:
            raise ValueError("short read")
        return data


@dataclass(frozen=True)
class RawChunk:
    """Where a DCP chunk's elements lie in its ``.distcp`` file, and how they are laid out.

    Attributes:
        data_offset: File offset of the chunk's storage byte 0.
        nbytes: Bytes of the storage record.
        dtype: Element type (the one ``.metadata`` declares).
        shape: The chunk's size (the one ``.metadata`` declares).
        stride: Strides in elements (a saved view keeps its strides: a transposed tensor).
        storage_offset: Offset of element 0 in the storage, in elements.
    """

    data_offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def row_major(self) -> bool:
        """Whether the elements are stored in row-major order without gaps."""
        expected = 1
        for s, st in zip(reversed(self.shape), reversed(self.stride)):
            if s > 1 and st != expected:
                return False
            expected *= s
        return True


# data.pkl bytes -> the layout it describes (identical for chunks of one shape and dtype).
_layouts: dict[bytes, tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int] | None] = {}
_layouts_lock = threading.Lock()


def locate_chunk(
    fd: int, start: int, length: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> RawChunk | None:
    """The raw location of a torch.save'd tensor chunk at ``[start, start + length)`` of `fd`.

    See NOTE: [raw DCP chunks]. Returns None whenever the blob is not exactly one uncompressed,
    little-endian tensor of `dtype` and `shape` whose bytes lie inside the blob; the caller then
    reads it the safe slow way, which reports what is wrong with it.
    """
    if sys.byteorder != "little":
        return None
    win = _Window(fd, start, length)
    try:
        with zipfile.ZipFile(io.BufferedReader(win, 1 << 14)) as zf:
            infos = zf.infolist()
            pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
            data = [i for i in infos if "/data/" in i.filename]
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            if len(pkl) != 1 or len(data) != 1 or len(order) != 1:
                return None
            prefix = pkl[0].filename[: -len("data.pkl")]
            record = data[0]
            if (
                record.filename != prefix + "data/" + record.filename.rsplit("/", 1)[-1]
                or any(i.compress_type != zipfile.ZIP_STORED for i in (record, pkl[0]))
                or zf.read(order[0]) != b"little"
            ):
                return None
            pickled = zf.read(pkl[0])
            head = win.read_at(record.header_offset, _LOCAL_HEADER.size)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, struct.error):
        return None
    sig, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    if sig != b"PK\x03\x04" or method != 0 or name_len != len(record.filename.encode()):
        return None
    begin = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if begin + record.file_size > length:
        return None
    layout = _layout(pickled, fd, start, length)
    if layout is None:
        return None
    l_dtype, l_shape, l_stride, l_off, l_nbytes = layout
    if l_dtype != dtype or l_shape != tuple(shape) or l_nbytes != record.file_size:
        return None
    item = dtype.itemsize
    if any(st < 0 for st in l_stride) or l_off < 0:
        return None
    extent = l_off + 1 + sum((s - 1) * st for s, st in zip(l_shape, l_stride) if s > 0)
    if all(s > 0 for s in l_shape) and extent * item > l_nbytes:
        return None
    if _overlapping(l_shape, l_stride):
        return None
    return RawChunk(start + begin, l_nbytes, dtype, l_shape, l_stride, l_off)


def _overlapping(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for st, s in sorted((st, s) for s, st in zip(shape, stride) if s > 1):
        if st < expected:
            return True
        expected = st * s
    return False


def _layout(
    pickled: bytes, fd: int, start: int, length: int
) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int] | None:
    """(dtype, shape, stride, storage offset, storage bytes) that a chunk's data.pkl describes."""
    with _layouts_lock:
        if pickled in _layouts:
            return _layouts[pickled]
    try:
        # weights_only: torch's restricted unpickler; "meta": no storage bytes are read.
        t = torch.load(
            io.BufferedReader(_Window(fd, start, length), 1 << 14),
            map_location="meta",
            weights_only=True,
        )
    except Exception:
        t = None
    layout = None
    if type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided:
        layout = (
            t.dtype,
            tuple(t.shape),
            tuple(t.stride()),
            t.storage_offset(),
            t.untyped_storage().nbytes(),
        )
    with _layouts_lock:
        if len(_layouts) > 4096:
            _layouts.clear()
        _layouts[pickled] = layout
    return layout
