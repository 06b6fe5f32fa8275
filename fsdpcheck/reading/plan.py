"""The reading plan of a check through pieces: blocks under a budget, and their views.

Every value check reads and compares the same way: a pair (a target tensor of side B and what
side A makes of it) is a list of pieces (``fsdpcheck.convert.pieces``); a pair without a
conversion is one piece, its whole tensor. A block is a part of a piece small enough for a
batch: side A's region is the smallest box of the source holding the block's source
elements, side B's the smallest box of the target holding its target elements (cut so that
neither reads over twice the block's elements: a piece that cuts a head reads at most twice
its rows), and the kernel compares strided views of the two regions at the block's box of the
target's view, so every index it reports is the target's.

``PiecePlan`` is the plan of an offline pass (compare, fingerprint of a checkpoint): blocks,
their bytes, their regions per batch. A live pass (verify, fingerprint of a model) holds side
A in memory and cuts each piece by the boxes a rank holds (``pieces.within``) first.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

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
from fsdpcheck.sources.base import Region
from fsdpcheck.sources.prefetch import batch_ranges

Shape = tuple[int, ...]


def whole_piece(source: str, shape: Sequence[int]) -> Piece:
    """The piece of a tensor that is its own source, whole (no conversion)."""
    shape = tuple(shape)
    return Piece(shape, (0,) * len(shape), shape, source, 0, row_strides(shape))


def source_view(t: torch.Tensor, lo: Sequence[int], p: Piece, shape: Shape) -> torch.Tensor:
    """The source elements of piece `p` as a view of `t`, which holds the source box at `lo`.

    Args:
        t: A tensor holding a box of the source (a region read, a rank's shard), any strides.
        lo: The box's offset in the source.
        p: An aligned piece whose source elements the box holds.
        shape: The source's global shape.

    Returns:
        A view of `t` of shape ``p.size``, cast as the piece says.
    """
    first = unravel(p.start, shape)
    st = t.stride()
    offset = t.storage_offset() + sum((f - a) * s for f, a, s in zip(first, lo, st))
    strides = [m * st[e] if e >= 0 else 0 for e, m in source_digits(p, shape)]
    v = t.as_strided(p.size, strides, offset)
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


def blocks_of(
    p: Piece, target_shape: Shape, source_shape: Shape, most: int, both: bool
) -> list[Piece]:
    """A piece cut into blocks of at most `most` elements, whose regions are at most twice them.

    Args:
        p: An aligned piece.
        target_shape: Its target's shape.
        source_shape: Its source's shape.
        most: Elements per block at most (at least one row of the piece's view each).
        both: Whether side B (the target) is read too, or side A alone (a fingerprint).
    """
    out = []
    for q in split_for_reading(p, target_shape) if both else [p]:
        for r in cut(q, most):
            out += _tight_source(r, source_shape)
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


@dataclass
class PlanPair:
    """One pair of the plan: a target and where each side holds it.

    Attributes:
        name: The name findings use (side B's canonical name, or the target's).
        shape: The target's global shape.
        pieces: Its aligned pieces.
        a_keys: Source name -> (side A's own key, its global shape, its dtype).
        b_key: Side B's own key of the target, or None when side B is not read.
        b_dtype: Side B's dtype (None without side B).
    """

    name: str
    shape: Shape
    pieces: Sequence[Piece]
    a_keys: Mapping[str, tuple[str, Shape, torch.dtype]]
    b_key: str | None = None
    b_dtype: torch.dtype | None = None


class PiecePlan:
    """The blocks of an offline pass over pieces, in order: the same on every process.

    Args:
        pairs: The pairs to read.
        block_bytes: Bytes of both sides per block at most (a batch's share, or a process's).
    """

    def __init__(self, pairs: Sequence[PlanPair], block_bytes: int) -> None:
        self.pairs = list(pairs)
        self.blocks: list[tuple[int, Piece]] = []
        self.bytes: list[int] = []
        for i, pair in enumerate(self.pairs):
            for p in pair.pieces:
                if p.numel == 0:
                    continue
                _key, shape, dtype = pair.a_keys[p.source]
                width = dtype.itemsize + (pair.b_dtype.itemsize if pair.b_dtype else 0)
                most = max(1, block_bytes // max(1, width))
                for q in blocks_of(p, pair.shape, shape, most, pair.b_key is not None):
                    self.blocks.append((i, q))
                    self.bytes.append(self._bytes(pair, q))

    def _bytes(self, pair: PlanPair, q: Piece) -> int:
        _, shape, dtype = pair.a_keys[q.source]
        _, span = source_box(q, shape)
        n = math.prod(span) * dtype.itemsize
        if pair.b_key is not None and pair.b_dtype is not None:
            _, size, _ = target_box(q, pair.shape)
            n += math.prod(size) * pair.b_dtype.itemsize
        return n

    def batches(self, items: range, step: int) -> Iterator[range]:
        """Runs of blocks of at most `step` bytes (``prefetch.batch_ranges``)."""
        return batch_ranges(self.bytes, items, step)

    def regions(self, batch: range) -> tuple[list[Region], list[Region]]:
        """The regions of side A and of side B (empty without side B) a batch reads."""
        a, b = [], []
        for j in batch:
            i, q = self.blocks[j]
            pair = self.pairs[i]
            key, shape, _ = pair.a_keys[q.source]
            a.append(Region(key, *source_box(q, shape)))
            if pair.b_key is not None:
                off, size, _ = target_box(q, pair.shape)
                b.append(Region(pair.b_key, off, size))
        return a, b

    def views(
        self, batch: range, xa: Sequence[torch.Tensor], xb: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Box]]:
        """Side A's and side B's views of a batch's blocks, and the boxes to index them in."""
        va, vb, boxes = [], [], []
        k = 0
        for n, j in enumerate(batch):
            i, q = self.blocks[j]
            pair = self.pairs[i]
            _, shape, _ = pair.a_keys[q.source]
            first, _ = source_box(q, shape)
            va.append(source_view(xa[n], first, q, shape))
            if pair.b_key is not None:
                vb.append(target_view(xb[k], q, pair.shape))
                k += 1
            boxes.append(kernel_box(q))
        return va, vb, boxes

    def digest_items(self) -> list[tuple[int, Piece]]:
        """What the plan reads, for a digest."""
        return self.blocks


__all__ = [
    "PiecePlan",
    "PlanPair",
    "blocks_of",
    "kernel_box",
    "source_view",
    "target_view",
    "whole_piece",
]
