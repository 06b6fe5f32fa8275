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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fsdpcheck._unpickle import on_a_deep_stack
from fsdpcheck.errors import CheckpointError

PAGE = mmap.PAGESIZE
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header (30 bytes)
# madvise advice numbers (Linux). POPULATE_READ (5.14+) maps the pages now, so the kernel that
# reads them next takes no page faults; WILLNEED only starts read-ahead into the page cache.
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22
# A tensor's data.pkl is a few hundred bytes; a larger one is read the safe slow way.
_MAX_PICKLE = 1 << 20
#: Bytes read at each end of a chunk's blob to find its records (`_scan_fast`): its records
#: (data.pkl, the data record's header; the central directory) fit, beyond that more is read.
SCAN_SPAN = 8192


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` whose first byte is page-aligned.

    Args:
        nbytes: Size in bytes.
        pin: Allocate page-locked host memory (for asynchronous copies to a GPU).
    """
    if pin:
        # NOTE: [pinned size] torch's caching host allocator rounds every request up to a power
        # of two (nbytes + PAGE for a 128 MiB arena would take 256 MiB of page-locked memory),
        # and its blocks start on a page (cudaHostAlloc): the exact size is asked for.
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % PAGE == 0:
            return raw
        del raw  # an allocator that does not align: pay for the extra page
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip : skip + nbytes]


def writable_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte-range reads go into contiguous CPU tensors only")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class RangeFile(Protocol):
    """A file read by byte range that is not a local descriptor (an object in a store).

    NOTE: [object storage] in ``remote``: the readers below take either an ``int`` descriptor
    (local files: ``os.pread``, unchanged) or one of these.
    """

    size: int

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset` (fewer only at the end)."""
        ...

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fills `view` from `offset`, or raises (never a partial buffer)."""
        ...


#: A local descriptor, or a file in an object store.
Readable = int | RangeFile


def pread(fd: Readable, n: int, offset: int) -> bytes:
    """Up to `n` bytes of `fd` at `offset`."""
    return os.pread(fd, n, offset) if isinstance(fd, int) else fd.pread(n, offset)


def pread_into(fd: Readable, t: torch.Tensor, offset: int, what: str, path: Any = None) -> None:
    """Fills the contiguous CPU tensor `t` with the bytes of `fd` from `offset` on.

    Raises:
        CheckpointError: The file ends first (it was truncated after it was checked).
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return
    view = writable_view(t)
    if not isinstance(fd, int):
        fd.readinto(view, offset)  # the store names the object when it fails
        return
    done = 0
    while done < n:
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise located(
                exc, path if path is not None else what, offset + done, n - done
            ) from None
        if got <= 0:
            changed = f"{path} changed while it was read: it was truncated" if path else (
                "the file changed after it was checked?")  # fmt: skip
            raise CheckpointError(
                f"{what}: only {done} of {n} bytes could be read at byte {offset} ({changed})"
            )
        done += got


def located(exc: OSError, path: Any, offset: int, n: int) -> OSError:
    """`exc` (a failed read) naming its file and where: "Invalid argument" alone says nothing.

    The same type (EIO stays an OSError, EACCES a PermissionError), with ``filename`` set, so
    the one-line message is ``<file>: <what the system said> (reading <n> bytes at byte <o>)``.
    """
    return type(exc)(exc.errno, f"{exc.strerror} (reading {n} bytes at byte {offset})", str(path))


_libc: Any = None
_madvise_ok = True


def elements_spanned(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a non-empty strided tensor's first element to one past its last."""
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)


def map_private(fd: int) -> mmap.mmap | None:
    """A whole open file mapped copy-on-write, or None (empty, or it cannot be mapped).

    Unguarded (see `map_guarded`): for views a caller keeps beyond a checked read.
    """
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size > 0 else None
    except (OSError, ValueError):
        return None


class Mapped:
    """A file mapped read-only through the SIGBUS guard (NOTE: [mapped-file guard]).

    NOTE: [mapped files] Mapping page-cache pages costs a fraction of copying them (a few ms per
    100 MB against tens), so both DCP chunks and safetensors tensors are handed to the kernels
    as views of the mapped file (`view`), at whatever byte offset they lie: the kernels read
    misaligned elements (load_as). The mapping lives as long as the last view of it; it holds
    no file descriptor.

    Attributes:
        id: Its id in the guard's fault records.
        path: The file, for messages.
        data: uint8 tensor over the whole file as it was when mapped.
    """

    def __init__(self, ident: int, path: str, data: torch.Tensor) -> None:
        self.id, self.path, self.data = ident, path, data
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def view(
        self, start: int, dtype: torch.dtype, shape: Sequence[int], stride: Sequence[int]
    ) -> torch.Tensor | None:
        """The strided tensor whose first element is at byte `start`, or None (outside).

        At any byte offset (a view of a ctypes array over the bytes, which keeps the mapping
        alive: tensor views of the uint8 data cannot start between elements).
        """
        shape, stride = tuple(shape), tuple(stride)
        if 0 in shape:
            return torch.empty(shape, dtype=dtype)
        span = elements_spanned(shape, stride)
        end = start + span * dtype.itemsize
        if start < 0 or end > self.data.numel():
            return None
        item = dtype.itemsize
        if start % item == 0:  # one tensor per view (a batch may hold a hundred thousand)
            typed = self._typed.get(dtype)
            if typed is None:
                whole = self.data[: self.data.numel() - self.data.numel() % item]
                typed = self._typed[dtype] = whole.view(dtype)
            return typed.as_strided(shape, stride, start // item)
        buf = (ctypes.c_char * (end - start)).from_address(self.data.data_ptr() + start)
        buf.keep = self.data  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=dtype, count=span).as_strided(shape, stride)


_next_id = 0
_ids_lock = threading.Lock()
_faults_seen = 0
_faulted: set[int] = set()
_faults_lost = False


#: How the offline readers hand data to the kernels: "map" (views of files mapped through the
#: guard, the default: NOTE: [mapped files]) or "pread" (byte-range reads into buffers, never a
#: mapping; environment variable ``FSDPCHECK_READ``).
READ_MODE = os.environ.get("FSDPCHECK_READ", "map")


def map_guarded(fd: int, size: int, path: str) -> Mapped | None:
    """`fd` mapped through the guard, or None (empty, no guard, `READ_MODE` "pread", failed)."""
    global _next_id
    if size <= 0 or READ_MODE == "pread" or not _guard_available():
        return None
    with _ids_lock:
        _next_id += 1
        ident = _next_id
    try:
        data = torch.ops.fsdpcheck._map_file(fd, size, ident)
    except RuntimeError:
        return None
    if data.numel() != size:
        return None
    return Mapped(ident, path, data)


def damaged(ids: Iterable[int]) -> set[int]:
    """Which of the mappings `ids` had a page lost to a truncation since they were made."""
    global _faults_seen, _faults_lost
    ids = set(ids)
    if not ids or not _guard_available():
        return set()
    with _ids_lock:
        got = torch.ops.fsdpcheck._guard_faults(_faults_seen)
        total, new = got[0], got[1:]
        if total - _faults_seen > len(new):
            _faults_lost = True  # more faults than the ring holds: any mapping may be hit
        _faulted.update(new)
        _faults_seen = total
        if _faults_lost:
            return ids
        return ids & _faulted


def _guard_available() -> bool:
    global _GUARD
    if _GUARD is None:
        try:
            import fsdpcheck._ext  # noqa: F401  (registers the operators)

            _GUARD = hasattr(torch.ops.fsdpcheck, "_map_file") and sys.platform.startswith("linux")
        except (ImportError, RuntimeError, AttributeError):
            _GUARD = False
    return bool(_GUARD)


_GUARD: bool | None = None


def mapped_view(
    mapped: mmap.mmap,
    start: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    stride: Sequence[int],
) -> torch.Tensor | None:
    """The strided tensor whose first element is at byte `start` of a mapped file, or None.

    None when the file is now shorter than the view needs (it shrank after it was mapped):
    touching a mapped page past the end of a file kills the process with SIGBUS, where a read
    raises an error, so the caller reads those bytes instead.
    """
    shape, stride = tuple(shape), tuple(stride)
    if 0 in shape:
        return torch.empty(shape, dtype=dtype)
    span = elements_spanned(shape, stride)
    end = start + span * dtype.itemsize
    if start < 0 or end > len(mapped) or end > mapped.size():  # size(): the file's size now
        return None
    t = torch.frombuffer(mapped, dtype=dtype, count=span, offset=start)
    return t.as_strided(shape, stride)


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
    hi = lo + elements_spanned(t.shape, t.stride()) * t.element_size()
    start = lo - lo % PAGE
    if _libc.madvise(start, hi - start, _MADV_POPULATE_READ) != 0:
        _libc.madvise(start, hi - start, _MADV_WILLNEED)


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable read-only file."""

    def __init__(self, fd: Readable, start: int, length: int) -> None:
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
        data = pread(self._fd, n, self._start + self._pos)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def read_at(self, pos: int, n: int) -> bytes:
        if pos < 0 or pos + n > self._len:
            raise ValueError("outside the blob")
        data = pread(self._fd, n, self._start + pos)
        if len(data) != n:
            raise ValueError("short read")
        return data


@dataclass(frozen=True)
class RawChunk:
    """Where a DCP chunk's elements lie in its ``.distcp`` file, and how they are laid out.

    `locate_chunk` makes one only when every element (from `storage_offset`, spanning `shape`
    and `stride`) lies inside the `nbytes` of the storage record.

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
    fd: Readable,
    start: int,
    length: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    span: int = SCAN_SPAN,
) -> RawChunk | None:
    """The raw location of a torch.save'd tensor chunk at ``[start, start + length)`` of `fd`.

    See NOTE: [raw DCP chunks]. Returns None whenever the blob is not exactly one uncompressed,
    little-endian tensor of `dtype` and `shape` whose bytes lie inside the blob; the caller then
    reads it the safe slow way, which reports what is wrong with it. `span`: bytes read at each
    end of the blob first (`scan_spans`).
    """
    if sys.byteorder != "little":
        return None
    try:
        found = _scan_fast(fd, start, length, span) or _scan_zipfile(fd, start, length)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, struct.error):
        return None
    if found is None:
        return None
    pickled, order, begin, nbytes = found
    if order != b"little" or begin + nbytes > length:
        return None
    layout = _layout(pickled, fd, start, length)
    if layout is None:
        return None
    l_dtype, l_shape, l_stride, l_off, l_nbytes = layout
    if l_dtype != dtype or l_shape != tuple(shape) or l_nbytes != nbytes:
        return None
    item = dtype.itemsize
    if any(st < 0 for st in l_stride) or l_off < 0:
        return None
    extent = l_off + elements_spanned(l_shape, l_stride)
    if all(s > 0 for s in l_shape) and extent * item > l_nbytes:
        return None
    if _overlapping(l_shape, l_stride):
        return None
    return RawChunk(start + begin, l_nbytes, dtype, l_shape, l_stride, l_off)


# (data.pkl bytes, byteorder bytes, offset of the storage record's bytes in the blob, its size)
_Found = tuple[bytes, bytes, int, int]
_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory (22 bytes)
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header (46 bytes)
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory (56 bytes)
_ZIP64_LOCATOR = struct.Struct("<4sIQI")  # zip64 end of central directory locator (20 bytes)


def _pick(names: list[str]) -> tuple[str, str, str] | None:
    """(data.pkl, byteorder, storage record) names of a one-tensor torch.save archive, or None."""
    pkl = [n for n in names if n.endswith("/data.pkl")]
    if len(pkl) != 1:
        return None
    prefix = pkl[0][: -len("data.pkl")]
    data = [n for n in names if n.startswith(prefix + "data/") and "/" not in n[len(prefix) + 5 :]]
    others = [n for n in names if "/data/" in n and n not in data]
    order = [n for n in names if n == prefix + "byteorder"]
    if len(data) != 1 or others or len(order) != 1:
        return None
    return pkl[0], order[0], data[0]


def scan_spans(start: int, length: int, span: int = SCAN_SPAN) -> list[tuple[int, int]]:
    """(offset, bytes) of the reads `locate_chunk` starts with (one when the blob is small)."""
    span = min(length, span)
    if length <= 2 * span:
        return [(start, length)]
    return [(start, span), (start + length - span, span)]


def _scan_fast(fd: Readable, start: int, length: int, span: int = SCAN_SPAN) -> _Found | None:
    """The records torch.save writes, from one read of each end of the blob (no zip64).

    Records are found as a zip reader finds them: the end record, the central directory, then
    each record's local header. Anything unusual (zip64, a comment, compression) returns None
    and `_scan_zipfile` decides.
    """
    if length < _EOCD.size:
        return None
    span = min(length, span)
    if 2 * span >= length:
        span = length  # one read of the whole blob
    head = pread(fd, span, start)
    tail = head if span == length else pread(fd, span, start + length - span)
    if len(head) != span or len(tail) != span:
        return None

    def read(off: int, n: int) -> bytes:
        if off < 0 or n < 0 or off + n > length:
            raise ValueError("outside the blob")
        if off + n <= span:
            return head[off : off + n]
        if off >= length - span:
            return tail[off - (length - span) : off - (length - span) + n]
        data = pread(fd, n, start + off)
        if len(data) != n:
            raise ValueError("short read")
        return data

    sig, disk, _, count, total, cd_size, cd_off, comment = _EOCD.unpack(tail[-_EOCD.size :])
    if sig != b"PK\x05\x06" or comment or disk or count != total or 0xFFFF in (count, total):
        return None
    if 0xFFFFFFFF in (cd_size, cd_off):
        return None
    gap = length - _EOCD.size - (cd_off + cd_size)
    if gap == _ZIP64_EOCD.size + _ZIP64_LOCATOR.size:
        # torch's writer always adds zip64 end records; they must say what the plain one says.
        end = cd_off + cd_size
        z = _ZIP64_EOCD.unpack(read(end, _ZIP64_EOCD.size))
        loc = _ZIP64_LOCATOR.unpack(read(end + _ZIP64_EOCD.size, _ZIP64_LOCATOR.size))
        if (
            z[0] != b"PK\x06\x06"
            or (z[6], z[7], z[8], z[9]) != (count, total, cd_size, cd_off)
            or loc[0] != b"PK\x06\x07"
            or loc[2] != end
        ):
            return None
    elif gap != 0:
        return None
    cd = read(cd_off, cd_size)
    records: dict[str, tuple[int, int, int]] = {}  # name -> (method, size, local header)
    pos = 0
    for _ in range(count):
        f = _CENTRAL.unpack_from(cd, pos)
        if f[0] != b"PK\x01\x02":
            return None
        method, csize, size, n, e, c, offset = f[4], f[8], f[9], f[10], f[11], f[12], f[16]
        name = cd[pos + _CENTRAL.size : pos + _CENTRAL.size + n].decode("utf-8")
        if name in records or 0xFFFFFFFF in (csize, size, offset) or csize != size:
            return None
        records[name] = (method, size, offset)
        pos += _CENTRAL.size + n + e + c
    picked = _pick(list(records))
    if picked is None:
        return None
    parts = []
    for name in picked:
        method, size, offset = records[name]
        sig, _, _, lmethod, _, _, _, _, _, n, e = _LOCAL_HEADER.unpack(read(offset, 30))
        if method != 0 or lmethod != 0 or sig != b"PK\x03\x04":
            return None
        if read(offset + 30, n) != name.encode():
            return None
        parts.append((offset + 30 + n + e, size))
    (p_at, p_n), (o_at, o_n), (d_at, d_n) = parts
    if p_n > _MAX_PICKLE or o_n > 16:
        return None
    return read(p_at, p_n), read(o_at, o_n), d_at, d_n


def _scan_zipfile(fd: Readable, start: int, length: int) -> _Found | None:
    """`_scan_fast` through the standard library's zip reader (zip64 and other variants)."""
    win = _Window(fd, start, length)
    with zipfile.ZipFile(io.BufferedReader(win, 1 << 14)) as zf:
        infos = {i.filename: i for i in zf.infolist()}
        if len(infos) != len(zf.infolist()):
            return None
        picked = _pick(list(infos))
        if picked is None:
            return None
        pkl, order, record = (infos[n] for n in picked)
        # Only stored (never inflated) records, and small ones, are read here: a compressed
        # record could expand without bound.
        if any(i.compress_type != zipfile.ZIP_STORED for i in (pkl, order, record)):
            return None
        if pkl.file_size > _MAX_PICKLE or order.file_size > 16:
            return None
        pickled, byteorder = zf.read(pkl), zf.read(order)
        head = win.read_at(record.header_offset, _LOCAL_HEADER.size)
        sig, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL_HEADER.unpack(head)
        name = win.read_at(record.header_offset + _LOCAL_HEADER.size, name_len)
    if sig != b"PK\x03\x04" or method != 0 or name != record.filename.encode():
        return None
    begin = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    return pickled, byteorder, begin, record.file_size


def _overlapping(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for st, s in sorted((st, s) for s, st in zip(shape, stride) if s > 1):
        if st < expected:
            return True
        expected = st * s
    return False


def _layout(
    pickled: bytes, fd: Readable, start: int, length: int
) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int] | None:
    """(dtype, shape, stride, storage offset, storage bytes) that a chunk's data.pkl describes."""
    with _layouts_lock:
        if pickled in _layouts:
            return _layouts[pickled]
    try:
        # weights_only: torch's restricted unpickler; "meta": no storage bytes are read.
        # An object in a store is read in small pieces: what the parse asks for, not more.
        buffer = 1 << 14 if isinstance(fd, int) else 512
        t = on_a_deep_stack(
            lambda: torch.load(
                io.BufferedReader(_Window(fd, start, length), buffer),
                map_location="meta",
                weights_only=True,
            ),
            len(pickled),
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
