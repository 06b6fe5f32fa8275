"""The one reading plan: what each check reads, in which blocks, and the views it compares.

Every value check reads the same way, whatever its entry point: the pairing (``matching``)
gives pairs, the checks (``checks``) keep those whose values can be compared, and each pair
is cut here into blocks small enough for a batch under the memory budget. A pair without a
conversion is its tensor (or the saved chunks of it, or a rank's shards of it); a pair through
a conversion is its target's pieces (``convert.pieces``). A block of a piece reads, on side A,
the smallest box of the source holding its source elements and, on side B, the smallest box
of the target holding its target elements (cut so that neither reads over twice the block's
elements: a piece that cuts a head reads at most twice its rows); the kernel then compares (or
hashes) strided views of the two at the block's box of the target's view, so every index it
reports is the target's.

- ``Plan``: the blocks of an offline pass (compare, fingerprint of a checkpoint) as columns
  (NOTE: [compare memory] in ``comparison``): per block its pair, elements and bytes; the
  offset and size of the blocks that are not a whole tensor; the piece of the blocks of a
  conversion. The same on every process of a launch.
- ``along_chunks``, ``box_blocks`` and ``piece_blocks``: how a live rank's shard (verify) or a
  piece is cut; ``DeviceBatches``: the batches of a live pass, per device.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from fsdpcheck.box import Box
from fsdpcheck.convert.pieces import (
    Piece,
    cut,
    row_strides,
    source_box,
    source_digits,
    split_for_reading,
    target_box,
    unravel,
)
from fsdpcheck.readplan import row_blocks
from fsdpcheck.sources.base import Region
from fsdpcheck.sources.prefetch import MAX_REGIONS, batch_ranges
from fsdpcheck.sources.tiling import intersect, uncovered

Shape = tuple[int, ...]
T = TypeVar("T")


# -------------------------------------------------------------------------------------------
# Views of the regions read.
def whole_piece(source: str, shape: Sequence[int]) -> Piece:
    """The piece of a tensor that is its own source, whole (no conversion)."""
    shape = tuple(shape)
    return Piece(shape, (0,) * len(shape), shape, source, 0, row_strides(shape))


def source_view(
    t: torch.Tensor, lo: Sequence[int], p: Piece, shape: Shape, *, cast: bool = True
) -> torch.Tensor:
    """The source elements of piece `p` as a view of `t`, which holds the source box at `lo`.

    Args:
        t: A tensor holding a box of the source (a region read, a rank's shard), any strides.
        lo: The box's offset in the source.
        p: An aligned piece whose source elements the box holds.
        shape: The source's global shape.
        cast: Whether to cast it as the piece says (a copy: ``cast_as`` does it later).

    Returns:
        A view of `t` of shape ``p.size``.
    """
    first = unravel(p.start, shape)
    st = t.stride()
    offset = t.storage_offset() + sum((f - a) * s for f, a, s in zip(first, lo, st))
    strides = [m * st[e] if e >= 0 else 0 for e, m in source_digits(p, shape)]
    v = t.as_strided(p.size, strides, offset)
    return cast_as(v, p) if cast else v


def cast_as(v: torch.Tensor, p: Piece) -> torch.Tensor:
    """`v` cast as piece `p` says (round to nearest even, as ``Tensor.to``), or `v` itself."""
    for c in p.cast:
        v = v.to(getattr(torch, c))
    return v


def target_view(t: torch.Tensor, p: Piece, shape: Shape) -> torch.Tensor:
    """The target elements of piece `p` as a view of `t`, the region ``target_box(p)``."""
    _, _, moves = target_box(p, shape)
    st = t.stride()
    return t.as_strided(p.size, [step * st[d] for d, step in moves], t.storage_offset())


def kernel_box(p: Piece) -> Box:
    """The box the kernel indexes a piece's elements in: the target's linear indices."""
    return Box(p.view, p.offset)


# -------------------------------------------------------------------------------------------
# Cutting into blocks.
def piece_blocks(
    p: Piece, target_shape: Shape, source_shape: Shape | None, most: int, read_target: bool
) -> list[Piece]:
    """A piece cut into blocks of at most `most` elements, whose regions are at most twice them.

    Args:
        p: An aligned piece.
        target_shape: Its target's shape.
        source_shape: Its source's shape when the source is read too (offline), else None (a
            rank's shard is in memory: its views cost nothing).
        most: Elements per block at most (at least one row of the piece's view each).
        read_target: Whether the target's region is read (a compare), or only the source's (a
            fingerprint).
    """
    out = []
    for q in split_for_reading(p, target_shape) if read_target else [p]:
        for r in cut(q, most):
            out += [r] if source_shape is None else _tight_source(r, source_shape)
    return out


def _tight_source(p: Piece, shape: Shape) -> list[Piece]:
    """`p` cut where the source box holding it would be over twice its elements."""
    _, span = source_box(p, shape)
    if math.prod(span) <= 2 * p.numel or p.numel <= 1:
        return [p]
    d = next(j for j, k in enumerate(p.size) if k > 1)
    out = []
    for i in range(p.size[d]):
        off = (*p.offset[:d], p.offset[d] + i, *p.offset[d + 1 :])
        out += _tight_source(p.with_box(off, (*p.size[:d], 1, *p.size[d + 1 :])), shape)
    return out


def along_chunks(
    offset: tuple[int, ...],
    size: tuple[int, ...],
    saved: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A box cut along the reference's saved chunks, when they tile it exactly.

    Each part then lies inside one saved chunk, which a reader can hand over where it lies (a
    mapped DCP chunk) instead of assembling it from several. When the chunks do not tile the
    box (a gap or an overlap in a damaged checkpoint), the box is returned whole, so that
    reading it raises the coverage error the report names.

    `saved` is the chunks meeting the box (``Source.chunks_overlapping``: found by bisection,
    so a box meets the few chunks it overlaps, not every chunk of a key saved by W ranks); any
    others would cut nothing.
    """
    box = (offset, size)
    if len(saved) <= 1:  # the chunk holds the box, or reading it names what is missing
        return [box]
    parts = [c for c in (intersect(box, (tuple(o), tuple(s))) for o, s in saved) if c]
    # Volumes adding up to the box's and no part of it uncovered: the parts are disjoint.
    if (
        len(parts) <= 1
        or sum(math.prod(s) for _, s in parts) != math.prod(size)
        or uncovered(box, parts)
    ):
        return [box]
    return parts


def box_blocks(
    offset: Sequence[int], size: Sequence[int], itemsize: int, budget: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A box cut along dim 0 into blocks of at most `budget` bytes (``readplan.row_blocks``)."""
    return row_blocks(offset, size, itemsize, budget)


# -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceKey:
    """Where side A holds a conversion's source: its own key, global shape and dtype."""

    key: str
    shape: Shape
    dtype: torch.dtype


class Plan:
    """The blocks of an offline pass, in order: the same on every process of a launch.

    Per block (NOTE: [compare memory] in ``comparison``: a million tensors are a million
    blocks): its pair, elements and bytes in three int64 arrays; `cut` holds (offset, size) of
    the blocks that are a box of their tensor but not all of it (a whole tensor's box is
    implied); `pieces` the piece of each block of a conversion, whose source is named in
    `sources`.
    """

    def __init__(self, sources: Mapping[str, SourceKey] | None = None) -> None:
        self.block_pair = array("q")
        self.block_numel = array("q")
        self.block_bytes = array("q")
        self.cut: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.pieces: dict[int, Piece] = {}
        self.sources: Mapping[str, SourceKey] = sources or {}

    def __len__(self) -> int:
        return len(self.block_pair)

    def _add(self, pair: int, numel: int, nbytes: int) -> int:
        j = len(self.block_pair)
        self.block_pair.append(pair)
        self.block_numel.append(numel)
        self.block_bytes.append(nbytes)
        return j

    def add_tensor(self, pair: int, shape: Shape, width: int, block: int) -> None:
        """A whole tensor, cut into row blocks of at most `block` bytes (`width` per element)."""
        numel = math.prod(shape)
        if numel * width <= block or not shape or shape[0] <= 1:
            self._add(pair, numel, numel * width)
            return
        for off, size in row_blocks((0,) * len(shape), shape, width, block):
            self.add_box(pair, off, size, width)

    def add_chunk(
        self, pair: int, offset: Shape, size: Shape, shape: Shape, width: int, block: int
    ) -> None:
        """A saved chunk of a tensor (its box), cut into row blocks of at most `block` bytes."""
        whole = size == shape and not any(offset)
        for off, sz in row_blocks(offset, size, width, block):
            if whole and sz == size:
                n = math.prod(sz)
                self._add(pair, n, n * width)
            else:
                self.add_box(pair, off, sz, width)

    def add_box(self, pair: int, offset: Shape, size: Shape, width: int) -> None:
        """A box of a tensor that is not all of it, as one block."""
        n = math.prod(size)
        self.cut[self._add(pair, n, n * width)] = (offset, size)

    def add_pieces(
        self,
        pair: int,
        pieces: Sequence[Piece],
        target_shape: Shape,
        target_itemsize: int | None,
        block: int,
    ) -> None:
        """A target's pieces as blocks (`target_itemsize`: None when the target is not read)."""
        for p in pieces:
            if p.numel == 0:
                continue
            src = self.sources[p.source]
            width = src.dtype.itemsize + (target_itemsize or 0)
            most = max(1, block // max(1, width))
            for q in piece_blocks(p, target_shape, src.shape, most, target_itemsize is not None):
                _, span = source_box(q, src.shape)
                nbytes = math.prod(span) * src.dtype.itemsize
                if target_itemsize is not None:
                    nbytes += math.prod(target_box(q, target_shape)[1]) * target_itemsize
                self.pieces[self._add(pair, q.numel, nbytes)] = q

    def batches(self, items: range, step: int) -> Iterator[range]:
        """Runs of blocks of at most `step` bytes and MAX_REGIONS blocks."""
        return batch_ranges(self.block_bytes, items, step)

    # -- one batch ----------------------------------------------------------------------------
    def regions(
        self, batch: range, keys: Sequence[str], shapes: Sequence[Shape], side: str
    ) -> list[Region]:
        """The regions side "a" (the source of a conversion) or "b" (its target) reads.

        Args:
            batch: The blocks.
            keys: Each pair's own key on this side (a conversion's side A keys come from
                `sources`).
            shapes: Each pair's global shape (a target's, for a conversion).
            side: "a" or "b".
        """
        pair, cut, pieces = self.block_pair, self.cut, self.pieces
        out = []
        for j in batch:
            i = pair[j]
            q = pieces.get(j) if pieces else None
            if q is not None:
                if side == "a":
                    src = self.sources[q.source]
                    out.append(Region(src.key, *source_box(q, src.shape)))
                else:
                    off, size, _ = target_box(q, shapes[i])
                    out.append(Region(keys[i], off, size))
                continue
            box = cut.get(j)
            if box is None:
                shape = shapes[i]
                out.append(Region(keys[i], (0,) * len(shape), shape))
            else:
                out.append(Region(keys[i], *box))
        return out

    def views(
        self, batch: range, tensors: Sequence[torch.Tensor], shapes: Sequence[Shape], side: str
    ) -> list[torch.Tensor]:
        """The tensors read for a batch, as the kernel takes them (pieces: strided views)."""
        if not self.pieces:
            return list(tensors)
        out = list(tensors)
        for n, j in enumerate(batch):
            q = self.pieces.get(j)
            if q is None:
                continue
            if side == "a":
                src = self.sources[q.source]
                out[n] = source_view(tensors[n], source_box(q, src.shape)[0], q, src.shape)
            else:
                out[n] = target_view(tensors[n], q, shapes[self.block_pair[j]])
        return out

    def boxes(self, blocks: Sequence[int], shapes: Sequence[Shape]) -> tuple[list[int], list[int]]:
        """The kernel's ``box_shapes`` and ``box_offsets`` of some blocks (both empty: whole)."""
        cut, pieces, pair = self.cut, self.pieces, self.block_pair
        if not any(j in cut or j in pieces for j in blocks):
            return [], []
        sh: list[int] = []
        off: list[int] = []
        for j in blocks:
            q = pieces.get(j)
            if q is not None:
                sh.extend(q.view)
                off.extend(q.offset)
                continue
            shape = shapes[pair[j]]
            box = cut.get(j)
            sh.extend(shape)
            off.extend(box[0] if box is not None else (0,) * len(shape))
        return sh, off

    def digest_items(self) -> list[tuple[int, Shape, Shape, str]]:
        """Every block's pair and box (of a piece: its offset, size and source), for a digest."""
        out = []
        for j, i in enumerate(self.block_pair):
            q = self.pieces.get(j)
            if q is not None:
                out.append((i, q.offset, q.size, q.source))
            else:
                box = self.cut.get(j)
                out.append((i, *(box or ((), ())), ""))
        return out


# -------------------------------------------------------------------------------------------
@dataclass
class DeviceBatches(Generic[T]):
    """The batches of a live pass: work on one device per batch, under bytes and regions caps.

    Args:
        step: Bytes of reference data per batch.
        cap: Regions per batch at most (NOTE: [regions per batch] in prefetch).
    """

    step: int
    cap: int = MAX_REGIONS
    batches: dict[torch.device, list[list[T]]] = field(default_factory=dict)
    held: dict[torch.device, int] = field(default_factory=dict)

    def add(self, device: torch.device, work: T, nbytes: int) -> None:
        """Adds one work item, starting a new batch of its device when this one is full."""
        mine = self.batches.setdefault(device, [])
        if not mine or self.held[device] + nbytes > self.step or len(mine[-1]) >= self.cap:
            mine.append([])
            self.held[device] = 0
        mine[-1].append(work)
        self.held[device] += nbytes


__all__ = [
    "DeviceBatches",
    "Plan",
    "SourceKey",
    "along_chunks",
    "box_blocks",
    "cast_as",
    "kernel_box",
    "piece_blocks",
    "source_view",
    "target_view",
    "whole_piece",
]
