"""torch's ``HuggingFaceStorageWriter`` per-rank output: safetensors shards placed by metadata.

``dcp.save(state, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))`` (torch
2.9 and newer; ``save_sharded=True`` in 2.8) has every rank write its local boxes to
``shard-<rank + 1>-model-<i>-of-<n>.safetensors``. Each file's header metadata holds
``DCP_SHARDING_INFO``, a JSON string mapping each tensor to ``{"saved_offsets": [...]}``: where
its box starts in the global tensor. With ``enable_consolidation=True`` those files go to
``path/sharded/`` and the full tensors (``model-<i>-of-<n>.safetensors`` and
``model.safetensors.index.json``) to ``path``.

NOTE: [HF shard extents] The files record no global shape. torch's own reader
(``HuggingFaceStorageReader.read_metadata``) takes each dim's extent as the largest offset +
size over a tensor's boxes, and so does this reader. Gaps and overlaps inside that extent are
problems; a file missing at the end of a dim shrinks the extent instead, which nothing in the
files can show: a check against the live model names it as a shape finding.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from fsdpcheck.errors import CheckpointError, CoverageError
from fsdpcheck.sources.base import Entry, Problem, Region, Source
from fsdpcheck.sources.fileio import check_regular, file_problem
from fsdpcheck.sources.rawio import populate
from fsdpcheck.sources.safetensors_files import _SAFETENSORS_DTYPES
from fsdpcheck.sources.text import one_line
from fsdpcheck.sources.tiling import Box, box_text, intersect, tiling_problems, uncovered

SHARDING_INFO = "DCP_SHARDING_INFO"
# safetensors refuses headers larger than this too.
_MAX_HEADER = 100_000_000
# Kernels index elements with 64-bit integers.
_MAX_NUMEL = 1 << 62


#: The name each rank gives its shard (``shard-<rank + 1>-model-<i>-of-<n>.safetensors``).
SHARD_NAME = re.compile(r"shard-\d+-model-\d+-of-\d+\.safetensors")


def shard_files(path: Path) -> list[Path]:
    """The per-rank shard files `path` names: the file itself, or those directly in a folder.

    Raises:
        ValueError: The folder cannot be listed.
    """
    if not path.is_dir():
        return [path] if SHARD_NAME.fullmatch(path.name) else []
    try:
        return sorted(path / n for n in os.listdir(path) if SHARD_NAME.fullmatch(n))
    except OSError as exc:
        raise ValueError(f"cannot list {path}: {exc.strerror or exc}") from None


class _Chunk(NamedTuple):
    """One saved box: where it lies in the global tensor and in its file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Path
    start: int  # byte offset of its first element in the file
    dtype: torch.dtype

    @property
    def box(self) -> Box:
        return self.offsets, self.sizes


class HFStorageSource(Source):
    """Per-rank safetensors shards read as one sharded checkpoint (boxes from their headers).

    Opening reads each file's header only (a stat and one read per file; no descriptor is
    kept). `problems` lists what cannot be read: a file that is no regular file inside the
    folder, a header that is not safetensors or has no ``DCP_SHARDING_INFO``, a tensor whose
    saved offsets do not fit it, whose declared shape needs more bytes than its data holds or
    whose data runs past the end of its file, boxes of one tensor that disagree on dtype or
    dims, and, per tensor, gaps and overlaps among its boxes (NOTE: [HF shard extents]).

    `chunks` lists each file's box of the global tensor, and a read assembles a region from the
    boxes that overlap it, exactly as `DCPSource` does: a region that meets a gap raises
    `CoverageError`, one that meets two overlapping boxes raises `CheckpointError`, and neither
    ever returns an uninitialised buffer. On the CPU a region inside one box is a view of the
    mapped file (``UntypedStorage.from_file``: copy-on-write, no descriptor held, pages mapped
    now); other regions are copied from the mapped boxes into the destination.
    """

    kind = "safetensors"
    flat_names = True
    is_sharded = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.description = f"HuggingFaceStorageWriter shards {self.path}"
        files = shard_files(self.path)
        if not files:
            raise FileNotFoundError(f"{self.path} holds no shard-*-model-*-of-*.safetensors files")
        root = self.path if self.path.is_dir() else self.path.parent
        self._problems: list[Problem] = []
        self._sizes: dict[Path, int] = {}
        found: dict[str, list[_Chunk]] = {}
        for f in files:
            why = file_problem(root, f.name, 0, f.name)
            if why is None:
                try:
                    self._scan(f, found)
                    continue
                except CheckpointError as exc:
                    why = str(exc)
            self._problems.append(("*", "error", f"{self.description}: {why}"))
        self._entries: dict[str, Entry] = {}
        self._chunks: dict[str, list[_Chunk]] = {}
        self._overlapping: set[str] = set()
        # Per key: its boxes by offsets (a region that is one box), and sorted along dim 0 with
        # the tallest box's rows (the boxes a region can meet, found by bisection).
        self._at: dict[str, dict[tuple[int, ...], _Chunk]] = {}
        self._rows: dict[str, tuple[list[int], list[_Chunk], int]] = {}
        for key in sorted(found):
            self._settle(key, found[key])

    def _scan(self, f: Path, found: dict[str, list[_Chunk]]) -> None:
        """Adds the boxes of file `f` to `found`; what is wrong with them goes to problems.

        Raises:
            CheckpointError: The file has no readable safetensors header.
        """
        header, base, size = _header(f)
        self._sizes[f] = size
        offsets, missing = _sharding_info(header.pop("__metadata__", None))
        for key, spec in header.items():
            chunk = None
            try:
                chunk = _chunk(spec, offsets.get(key), missing, f, base, size)
            except ValueError as exc:
                why = f"{self.description}: {f.name}: {key}: {exc}"
                self._problems.append((key, "error", why))
            if chunk is not None:
                found.setdefault(key, []).append(chunk)

    def _settle(self, key: str, chunks: list[_Chunk]) -> None:
        """The entry of `key` from its boxes (NOTE: [HF shard extents]) and their tiling."""
        first = chunks[0]
        kept = []
        for c in chunks:
            if c.dtype != first.dtype or len(c.sizes) != len(first.sizes):
                self._problems.append(
                    (
                        key,
                        "layout",
                        f"{self.description}: {c.file.name} holds a {len(c.sizes)}-dim "
                        f"{c.dtype} box of {key} but {first.file.name} a {len(first.sizes)}-dim "
                        f"{first.dtype} one; the former is not read",
                    )
                )
                continue
            kept.append(c)
        shape = tuple(max(c.offsets[d] + c.sizes[d] for c in kept) for d in range(len(first.sizes)))
        if math.prod(shape) > _MAX_NUMEL or any(g > _MAX_NUMEL for g in shape):
            why = f"its boxes span {shape}, more than 2**62 elements: the saved offsets are wrong"
            self._problems.append((key, "layout", f"{self.description}: {key}: {why}"))
            return
        boxes = [c.box for c in kept if math.prod(c.sizes) > 0 or not shape]
        for p in tiling_problems(shape, boxes):
            if p.startswith("gap"):
                self._problems.append((key, "gap", f"{p}: no shard file read holds it"))
            else:
                self._overlapping.add(key)
                self._problems.append((key, "layout", f"{p}: saved in more than one shard file"))
        self._entries[key] = Entry(key, (key,), shape, first.dtype)
        self._chunks[key] = kept
        self._at[key] = {c.offsets: c for c in kept}
        if shape:
            by_row = sorted(kept, key=lambda c: c.offsets[0])
            tallest = max(c.sizes[0] for c in kept)
            self._rows[key] = ([c.offsets[0] for c in by_row], by_row, tallest)

    def entries(self) -> dict[str, Entry]:
        """Every tensor with at least one readable box (its shape: NOTE: [HF shard extents])."""
        return self._entries

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of each readable box of `key`, as the files' headers declare them."""
        return [c.box for c in self._chunks[key]]

    def problems(self) -> list[Problem]:
        """Unreadable files and boxes, boxes that disagree, gaps and overlaps."""
        return list(self._problems)

    def _meeting(self, region: Region) -> list[_Chunk]:
        """The boxes meeting `region`, after checking they cover it exactly once."""
        key, box = region.key, (tuple(region.offset), tuple(region.size))
        overlapping = key in self._overlapping
        exact = self._at[key].get(box[0])
        if exact is not None and exact.sizes == box[1] and not overlapping:
            return [exact]  # one saved box (read along the boxes, as fingerprints and verify do)
        near = self._chunks[key]
        if key in self._rows:
            starts, by_row, tallest = self._rows[key]
            # No box starting above `tallest` rows before the region reaches it.
            lo = bisect.bisect_left(starts, box[0][0] - tallest + 1)
            near = by_row[lo : bisect.bisect_left(starts, box[0][0] + box[1][0])]
        meeting = [c for c in near if intersect(box, c.box) is not None]
        missing = uncovered(box, [c.box for c in meeting], disjoint=not overlapping)
        if missing:
            raise CoverageError(
                f"{self.description}: {key}: region {box_text(missing[0])} is in no shard file "
                "(a gap in the checkpoint); it has no data to read"
            )
        for a, b in itertools.combinations(meeting if overlapping else [], 2):
            both = intersect(a.box, b.box)
            if both is not None and intersect(both, box) is not None:
                raise CheckpointError(
                    f"{self.description}: {key}: region {box_text(both)} is saved in both "
                    f"{a.file.name} and {b.file.name}; which copy is right is unknown"
                )
        return meeting

    def read(
        self,
        regions: Sequence[Region],
        device: torch.device,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Each region from the boxes that overlap it (a view of the file where one box holds it).

        Raises:
            CoverageError: A region meets a gap (checked for every region before any read).
            CheckpointError: A region meets overlapping boxes, or a file shrank since opening.
        """
        plans = [self._meeting(r) if r.numel else [] for r in regions]
        files = _Mapped(self._sizes, {c.file for p in plans for c in p})
        result = []
        for i, (r, meeting) in enumerate(zip(regions, plans)):
            box = (tuple(r.offset), tuple(r.size))
            if device.type == "cpu" and len(meeting) == 1 and r.numel:
                c = meeting[0]
                view = files.chunk(c)[_within(box, c.offsets)]
                populate(view)
                result.append(view)
                continue
            entry = self._entries[r.key]
            dest = out[i] if out is not None else torch.empty(r.size, dtype=entry.dtype,
                                                              device=device)  # fmt: skip
            for c in meeting:
                part = intersect(box, c.box)
                if part is not None:
                    dest[_within(part, r.offset)].copy_(files.chunk(c)[_within(part, c.offsets)])
            result.append(dest)
        return result


def _within(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """The index expression of `box` inside a tensor whose first element is at `origin`."""
    return tuple(slice(o - b, o - b + s) for o, b, s in zip(box[0], origin, box[1]))


class _Mapped:
    """The files of one read, each mapped once (after checking none shrank since opening)."""

    def __init__(self, sizes: dict[Path, int], files: set[Path]) -> None:
        self._sizes = sizes
        self._whole: dict[Path, torch.Tensor] = {}
        for f in files:
            try:
                now = os.stat(f).st_size
            except OSError as exc:
                raise CheckpointError(f"safetensors shard {f}: {exc.strerror or exc}") from None
            if now < sizes[f]:
                # A mapped page past the end of a file kills the process (SIGBUS).
                raise CheckpointError(
                    f"safetensors shard {f} shrank from {sizes[f]} to {now} bytes after it was "
                    "opened; refusing to read it (was it being rewritten?)"
                )

    def chunk(self, c: _Chunk) -> torch.Tensor:
        """A box's elements: a view of the mapped file (a copy when not aligned to its dtype)."""
        whole = self._whole.get(c.file)
        if whole is None:
            try:
                storage = torch.UntypedStorage.from_file(str(c.file), False, self._sizes[c.file])
            except RuntimeError as exc:
                raise CheckpointError(f"safetensors shard {c.file}: {one_line(exc)}") from None
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
            self._whole[c.file] = whole
        raw = whole[c.start : c.start + math.prod(c.sizes) * c.dtype.itemsize]
        if c.start % c.dtype.itemsize:
            raw = raw.clone()  # an aligned copy of just these bytes
        return raw.view(c.dtype).view(c.sizes)


def _header(f: Path) -> tuple[dict[str, Any], int, int]:
    """A safetensors file's header, where its data starts, and its size.

    Raises:
        CheckpointError: Not a safetensors file (too short, an oversized or truncated header,
            not JSON, a key twice).
    """

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice")
        return dict(pairs)

    with open(check_regular(f, "safetensors shard"), "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        n = int.from_bytes(fh.read(8), "little") if size >= 8 else -1
        if n < 0 or n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{f.name} has {size} bytes, too few for the safetensors header it starts "
                "(truncated, or not safetensors)"
            )
        try:
            header = json.loads(fh.read(n), object_pairs_hook=no_duplicates)
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{f.name}: its header is not JSON: {one_line(exc)}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{f.name}: its header is not a JSON object")
    return header, 8 + n, size


def _sharding_info(metadata: Any) -> tuple[dict[str, Any], str]:
    """The header's ``DCP_SHARDING_INFO`` (key -> entry), or {} and why it is missing."""
    raw = metadata.get(SHARDING_INFO) if isinstance(metadata, dict) else None
    if not isinstance(raw, str):
        return {}, f"its file has no {SHARDING_INFO} in its header metadata"
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return {}, f"its file's {SHARDING_INFO} is not JSON ({one_line(exc)})"
    if not isinstance(info, dict):
        return {}, f"its file's {SHARDING_INFO} is not a JSON object"
    return info, f"its file's {SHARDING_INFO} does not list it"


def _ints(value: Any) -> tuple[int, ...] | None:
    """`value` as a tuple of non-negative ints, or None."""
    if isinstance(value, list) and all(type(v) is int and v >= 0 for v in value):
        return tuple(value)
    return None


def _chunk(spec: Any, sharding: Any, missing: str, f: Path, base: int, size: int) -> _Chunk:
    """One header entry and its ``DCP_SHARDING_INFO`` entry as a box in the global tensor.

    Raises:
        ValueError: What is wrong with it, in words ("... where in the global tensor ...").
    """
    if not isinstance(spec, dict):
        raise ValueError("its header entry is not an object")
    name = spec.get("dtype")
    dtype = _SAFETENSORS_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(
            f"dtype {name!r:.40} cannot be compared (supported: {', '.join(_SAFETENSORS_DTYPES)})"
        )
    shape, data = _ints(spec.get("shape")), _ints(spec.get("data_offsets"))
    if shape is None or data is None or len(data) != 2 or data[0] > data[1]:
        raise ValueError("its header entry has no valid shape and data_offsets")
    need = math.prod(shape) * dtype.itemsize
    if data[1] - data[0] != need:
        raise ValueError(
            f"its box {list(shape)} of {name} needs {need} bytes but its data_offsets hold "
            f"{data[1] - data[0]}; not read"
        )
    if base + data[1] > size:
        raise ValueError(
            f"its data ends at byte {base + data[1]} but the file has {size} bytes (truncated?)"
        )
    if sharding is None:
        raise ValueError(f"{missing}: where its box lies in the global tensor is unknown")
    offsets = _ints(sharding.get("saved_offsets")) if isinstance(sharding, dict) else None
    if offsets is None or len(offsets) != len(shape):
        raise ValueError(
            f"its saved_offsets {sharding!r:.80} in {SHARDING_INFO} do not place a "
            f"{len(shape)}-dim box in a global tensor"
        )
    return _Chunk(offsets, shape, f, base + data[0], dtype)
