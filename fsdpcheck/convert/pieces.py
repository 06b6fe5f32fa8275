"""Pieces: a box of a target tensor read from a strided box of one source tensor.

A conversion is recorded as pieces (NOTE: [pieces]). Everything here is integer arithmetic on
shapes and strides: no data, and no work per element.

NOTE: [pieces] A piece says: the elements of the box ``offset .. offset + size`` of ``view``
(the target's shape with some dims split into digits, e.g. ``(H, 2, hd/2, D)`` for a target of
shape ``(H*hd, D)``: row-major over the same elements, so a linear index in ``view`` IS the
target's linear index) come from the source tensor's elements at linear index
``start + sum(i[d] * strides[d])``, ``i`` the index inside the box, then cast through ``cast``.
One piece covers what a view, a transpose or a RoPE permutation within heads makes of a
tensor, however large: a reshape that is not a single strided map (the permutation's
``view(H, 2, hd/2, D).transpose(1, 2).reshape(H*hd, D)``) becomes a strided map over the
digits of a split view instead of one piece per row.

Digits: an affine index map (a start and one stride per dim) onto a row-major shape is "digit
aligned" when each of its dims moves exactly one dim (a "digit") of that shape, by a fixed
multiple, without carrying into the next (``factor``). A source box's preimage under an
aligned map is a union of a few boxes (``interval_boxes``: at most ``2 * depth + 1`` per
interval), so the part of a piece a rank's shard holds, the part a block of rows covers, or
the part of a base a view selects, is a handful of pieces again.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

Shape = tuple[int, ...]

#: Pieces one tensor may take before the map is called "not strided" (a reshape that shuffles
#: rows of uneven length would otherwise take one piece per row).
MAX_PIECES = 4096


class NotStrided(Exception):
    """An index map that is not piecewise strided within MAX_PIECES pieces."""


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of a target tensor and the strided box of one source tensor it comes from.

    Attributes:
        view: The target's shape refined (dims split into digits; row-major over the same
            elements), in which `offset` and `size` are given.
        offset: The box's first index in `view`.
        size: The box's size in `view`.
        source: The source tensor's name.
        start: The source linear index (row-major in its global shape) of the box's first
            element.
        strides: Source linear elements per step along each dim of `view`.
        cast: Dtypes the source values are cast to, in order (names such as "bfloat16").
    """

    view: Shape
    offset: Shape
    size: Shape
    source: str
    start: int
    strides: Shape
    cast: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.size)

    def source_index(self, index: Sequence[int]) -> int:
        """The source linear index of the element at `index` of `view` (inside the box)."""
        return self.start + sum((i - o) * s for i, o, s in zip(index, self.offset, self.strides))

    def holds(self, index: Sequence[int]) -> bool:
        """Whether the box holds the element at `index` of `view`."""
        return all(o <= i < o + n for i, o, n in zip(index, self.offset, self.size))

    def with_box(self, offset: Shape, size: Shape) -> Piece:
        """The piece restricted to a sub-box of its box (`offset` in `view`)."""
        start = self.source_index(offset)
        return Piece(self.view, offset, size, self.source, start, self.strides, self.cast)


def row_strides(shape: Sequence[int]) -> Shape:
    """Row-major strides of a shape (in elements)."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * max(shape[d + 1], 1)
    return tuple(out)


def unravel(index: int, shape: Sequence[int]) -> Shape:
    """The multi-index of a row-major linear index."""
    out = []
    for n in reversed(shape):
        index, r = divmod(index, n) if n else (index, 0)
        out.append(r)
    return tuple(reversed(out))


def ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    """The row-major linear index of a multi-index."""
    out = 0
    for i, n in zip(index, shape):
        out = out * n + i
    return out


# -------------------------------------------------------------------------------------------
# Digits: an affine map onto a row-major shape, one digit per step.
#: One digit of a factored dim: (count, digit of the target shape (-1: none), multiplier).
Digit = tuple[int, int, int]


def factor(
    start: int,
    sizes: Sequence[int],
    strides: Sequence[int],
    into: Sequence[int],
    box: tuple[Sequence[int], Sequence[int]] | None = None,
) -> list[list[Digit]] | int:
    """The affine map ``start + sum(i[d] * strides[d])`` on the digits of shape `into`.

    Each dim ``d`` of the map (``sizes[d]`` steps) becomes digits ``(count, e, m)``, outer
    first, with the product of the counts ``sizes[d]``: a step of the digit moves dim ``e`` of
    `into` by ``m`` (a dim of one step, or of stride 0, moves nothing: ``e = -1``). A dim that
    runs off the end of its digit is split where it wraps into the next digit when it does so
    exactly (its steps fill the digit); `box` (offsets and full sizes of the map's dims) is then
    where the split must fall on whole digits of the map's own space.

    Returns:
        The digits of each dim, or the number of the first dim that is not aligned.
    """
    numel = math.prod(into)
    if start < 0 or (numel and start >= numel):
        return 0
    rs = row_strides(into)
    u = list(unravel(start, into))
    used = [0] * len(into)  # the span each digit of `into` already takes
    out: list[list[Digit]] = []
    for d, (n, stride) in enumerate(zip(sizes, strides)):
        if n <= 1 or stride == 0:
            out.append([(n, -1, 0)])
            continue
        if stride < 0:
            return d
        digits: list[Digit] = []
        inner = 1  # steps of this dim the digits so far take
        while True:
            e = _digit_of(stride, rs, into)
            if e < 0 or stride % rs[e]:
                return d
            m = stride // rs[e]
            if u[e] + used[e] + (n - 1) * m < into[e]:
                digits.append((n, e, m))
                used[e] += (n - 1) * m
                break
            # It wraps: only exactly, with whole periods, into a digit further out.
            if into[e] % m or u[e] >= m or e == 0 or used[e]:
                return d
            k = into[e] // m
            if n % k:
                return d
            if box is not None:
                offset, full = box[0][d], box[1][d]
                if offset % (inner * k) or full % (inner * k):
                    return d
            digits.append((k, e, m))
            used[e] += (k - 1) * m
            inner *= k
            n //= k
            stride = rs[e - 1]
        out.append(digits[::-1])
    return out


def _digit_of(stride: int, rs: Shape, into: Sequence[int]) -> int:
    """The digit of `into` whose strides hold `stride` (rs[e] <= stride < rs[e] * into[e])."""
    for e in range(len(into) - 1, -1, -1):
        if into[e] > 1 and rs[e] <= stride < rs[e] * into[e]:
            return e
    return -1


def interval_boxes(
    base: int, digits: Sequence[tuple[int, int]], lo: int, hi: int
) -> list[list[tuple[int, int]]]:
    """Boxes of digit indices whose positions ``base + sum(i[k] * m[k])`` lie in [lo, hi).

    Args:
        base: The position of index 0.
        digits: (count, multiplier) of each digit, nested: sorted by multiplier, each greater
            than the span of the ones inside it (the digits of a view are).
        lo: First position wanted.
        hi: One past the last.

    Returns:
        Boxes as one (start, length) per digit, in the order given; at most ``2 * depth + 1``.

    Raises:
        NotStrided: The digits are not nested.
    """
    order = sorted(range(len(digits)), key=lambda k: -digits[k][1])
    seq = [digits[k] for k in order]
    spans = [0] * (len(seq) + 1)
    for k in range(len(seq) - 1, -1, -1):
        c, m = seq[k]
        if k + 1 < len(seq) and m <= spans[k + 1]:
            raise NotStrided("digits that are not nested")
        spans[k] = spans[k + 1] + (c - 1) * m
    found = _interval(seq, spans, 0, base, lo, hi)
    out = []
    for box in found:
        got = [(0, 1)] * len(digits)
        for k, se in zip(order, box):
            got[k] = se
        out.append(got)
    return out


def _interval(
    seq: list[tuple[int, int]], spans: list[int], k: int, base: int, lo: int, hi: int
) -> list[list[tuple[int, int]]]:
    if k == len(seq):
        return [[]] if lo <= base < hi else []
    c, m = seq[k]
    span = spans[k + 1]
    full_rest = [(0, cc) for cc, _ in seq[k + 1 :]]
    a = max(0, _ceil_div(lo - base - span, m))  # first i whose positions reach lo
    b = min(c - 1, (hi - 1 - base) // m)  # last i starting below hi
    if a > b:
        return []
    fa = max(a, _ceil_div(lo - base, m))
    fb = min(b, (hi - 1 - span - base) // m)
    out: list[list[tuple[int, int]]] = []
    if fa > fb:  # no digit value lies wholly inside: at most two partial ones
        for i in range(a, b + 1):
            out += [[(i, 1), *sub] for sub in _interval(seq, spans, k + 1, base + i * m, lo, hi)]
        return out
    for i in range(a, fa):
        out += [[(i, 1), *sub] for sub in _interval(seq, spans, k + 1, base + i * m, lo, hi)]
    out.append([(fa, fb - fa + 1), *full_rest])
    for i in range(fb + 1, b + 1):
        out += [[(i, 1), *sub] for sub in _interval(seq, spans, k + 1, base + i * m, lo, hi)]
    return out


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def preimage(
    digits: list[list[Digit]],
    start_digits: Sequence[int],
    lows: Sequence[int],
    highs: Sequence[int],
) -> list[list[tuple[int, int]]]:
    """Boxes of a factored map's digits whose images lie in the box [lows, highs) of `into`.

    Args:
        digits: ``factor``'s result.
        start_digits: The multi-index in `into` of the map's start.
        lows: The wanted box's first index in each dim of `into`.
        highs: One past its last.

    Returns:
        Boxes as (start, length) per digit, digits flattened in order (dim by dim, outer
        first).
    """
    flat = [dg for ds in digits for dg in ds]
    per_dim: dict[int, list[int]] = {}
    for j, (count, e, _) in enumerate(flat):
        if e >= 0 and count > 1:
            per_dim.setdefault(e, []).append(j)
    choices: list[list[tuple[list[int], list[tuple[int, int]]]]] = []
    for e in range(len(start_digits)):
        js = per_dim.get(e, [])
        if not js:
            if not lows[e] <= start_digits[e] < highs[e]:
                return []
            continue
        boxes = interval_boxes(
            start_digits[e], [(flat[j][0], flat[j][2]) for j in js], lows[e], highs[e]
        )
        if not boxes:
            return []
        choices.append([(js, box) for box in boxes])
    out = []
    for combo in itertools.product(*choices):
        got = [(0, c) for c, _, _ in flat]
        for js, box in combo:
            for j, se in zip(js, box):
                got[j] = se
        out.append(got)
    return out


# -------------------------------------------------------------------------------------------
# Composing a view with pieces, and aligning pieces with their sources.
def compose(
    pieces: Sequence[Piece],
    size: Shape,
    stride: Shape,
    offset: int,
) -> list[Piece]:
    """The pieces of a new tensor of shape `size` made of a strided view of a tensor's pieces.

    The view reads the old tensor (row-major, its elements described by `pieces`) at linear
    index ``offset + sum(j[d] * stride[d])`` for each index ``j`` of the new tensor. The
    result's pieces are boxes of `size` refined.

    Raises:
        NotStrided: The view is not a strided map of the pieces within MAX_PIECES pieces.
    """
    if math.prod(size) == 0:
        return []
    out: list[Piece] = []
    for p in pieces:
        if p.numel == 0:
            continue
        _compose_box(p, size, stride, offset, (0,) * len(size), size, out)
        if len(out) > MAX_PIECES:
            raise NotStrided(f"more than {MAX_PIECES} pieces")
    return out


def _compose_box(
    p: Piece,
    full: Shape,
    stride: Shape,
    offset: int,
    lo: Shape,
    n: Shape,
    out: list[Piece],
) -> None:
    """``compose`` of one piece over the sub-box [lo, lo + n) of the new tensor."""
    first = offset + sum(a * s for a, s in zip(lo, stride))
    last = first + sum((k - 1) * s for k, s in zip(n, stride))
    p_first = ravel(p.offset, p.view)
    p_last = ravel(tuple(o + k - 1 for o, k in zip(p.offset, p.size)), p.view)
    if last < p_first or first > p_last:
        return
    digits = factor(first, n, stride, p.view, (lo, full))
    if isinstance(digits, int):
        if all(k == 1 for k in n):
            return  # one element outside the piece's box: factor refused its start
        # Not aligned on this box: halve the dim that is not (or the largest), and retry.
        d = digits if n[digits] > 1 else max(range(len(n)), key=lambda i: n[i])
        half = n[d] // 2
        if len(out) > MAX_PIECES:
            raise NotStrided(f"more than {MAX_PIECES} pieces")
        for a, k in ((lo[d], half), (lo[d] + half, n[d] - half)):
            _compose_box(p, full, stride, offset, _put(lo, d, a), _put(n, d, k), out)
        return
    u = unravel(first, p.view)
    highs = tuple(o + k for o, k in zip(p.offset, p.size))
    flat = [dg for ds in digits for dg in ds]
    # The new tensor's shape, refined by the digits of its dims, and the box's place in it.
    view: list[int] = []
    base: list[int] = []
    for d, ds in enumerate(digits):
        inner = math.prod(c for c, _, _ in ds[1:])
        view.append(full[d] // inner)
        base.append(lo[d] // inner)
        for c, _, _ in ds[1:]:
            view.append(c)
            base.append(0)
    strides = tuple(m * p.strides[e] if e >= 0 else 0 for _, e, m in flat)
    for box in preimage(digits, u, p.offset, highs):
        start = p.start + sum((ui - o) * s for ui, o, s in zip(u, p.offset, p.strides))
        start += sum(a * s for (a, _), s in zip(box, strides))
        off = tuple(b + a for b, (a, _) in zip(base, box))
        size = tuple(k for _, k in box)
        out.append(Piece(tuple(view), off, size, p.source, start, strides, p.cast))


def through(p: Piece, pieces: Sequence[Piece]) -> list[Piece]:
    """`p`, whose source is itself made of `pieces`, as pieces of their sources.

    `p` reads its source (a row-major tensor whose elements `pieces` describe) at a strided
    box; composing that strided read with each of `pieces` gives the same elements of `p`'s
    target as pieces of the sources underneath (two conversions in a row, as one). Casts
    compose in order: the inner piece's, then `p`'s.

    Raises:
        NotStrided: Not within MAX_PIECES pieces.
    """
    if p.numel == 0:
        return []
    # The read of index j of p's view is at ``origin + sum(j[d] * strides[d])``; only the box
    # [offset, offset + size) is read, so the origin may lie before the source's first element.
    origin = p.start - sum(o * s for o, s in zip(p.offset, p.strides))
    out: list[Piece] = []
    for q in pieces:
        if q.numel == 0:
            continue
        _compose_box(q, p.view, p.strides, origin, p.offset, p.size, out)
        if len(out) > MAX_PIECES:
            raise NotStrided(f"more than {MAX_PIECES} pieces")
    if not p.cast:
        return out
    return [
        Piece(r.view, r.offset, r.size, r.source, r.start, r.strides, (*r.cast, *p.cast))
        for r in out
    ]


def _put(t: Shape, d: int, v: int) -> Shape:
    return (*t[:d], v, *t[d + 1 :])


def align_to_source(p: Piece, source_shape: Shape) -> list[Piece]:
    """`p` with each dim of its view moving one dim of the source (split into digits).

    Then the part of the piece that any box of the source holds (a rank's shard, a block of
    rows) is a few boxes of its view (``within``).

    Raises:
        NotStrided: Not within MAX_PIECES pieces.
    """
    if (
        p.view == source_shape
        and p.strides == row_strides(source_shape)
        and all(u + k <= n for u, k, n in zip(unravel(p.start, source_shape), p.size, source_shape))
    ):
        return [p]  # a box of the source in its own coordinates: aligned as it is
    out: list[Piece] = []
    _align(p, source_shape, p.offset, p.size, out)
    return out


def _align(p: Piece, shape: Shape, lo: Shape, n: Shape, out: list[Piece]) -> None:
    start = p.source_index(lo)
    digits = factor(start, n, p.strides, shape, (lo, p.view))
    if isinstance(digits, int):
        d = digits if n[digits] > 1 else max(range(len(n)), key=lambda i: n[i])
        if n[d] <= 1:
            raise NotStrided("a source index outside the source")
        if len(out) > MAX_PIECES:
            raise NotStrided(f"more than {MAX_PIECES} pieces")
        half = n[d] // 2
        for a, k in ((lo[d], half), (lo[d] + half, n[d] - half)):
            _align(p, shape, _put(lo, d, a), _put(n, d, k), out)
        return
    rs = row_strides(shape)
    view: list[int] = []
    off: list[int] = []
    size: list[int] = []
    strides: list[int] = []
    for d, ds in enumerate(digits):
        inner = math.prod(c for c, _, _ in ds[1:])
        view.append(p.view[d] // inner)
        off.append(lo[d] // inner)
        size.append(ds[0][0])
        for c, _, _ in ds[1:]:
            view.append(c)
            off.append(0)
            size.append(c)
        strides += [m * rs[e] if e >= 0 else 0 for _, e, m in ds]
    out.append(Piece(tuple(view), tuple(off), tuple(size), p.source, start, tuple(strides), p.cast))


def source_digits(p: Piece, source_shape: Shape) -> list[tuple[int, int]]:
    """Per dim of an aligned piece's view: (source dim moved, multiplier); (-1, 0) for none."""
    rs = row_strides(source_shape)
    out = []
    for k, s in zip(p.size, p.strides):
        if k <= 1 or s == 0:
            out.append((-1, 0))
            continue
        e = _digit_of(s, rs, source_shape)
        out.append((e, s // rs[e]))
    return out


def within(p: Piece, source_shape: Shape, lows: Sequence[int], sizes: Sequence[int]) -> list[Piece]:
    """The parts of an aligned piece whose source elements lie in a box of the source."""
    highs = [a + k for a, k in zip(lows, sizes)]
    sd = source_digits(p, source_shape)
    digits = [[(k, e, m)] for k, (e, m) in zip(p.size, sd)]
    got = preimage(digits, unravel(p.start, source_shape), lows, highs)
    out = []
    for box in got:
        off = tuple(o + a for o, (a, _) in zip(p.offset, box))
        out.append(p.with_box(off, tuple(k for _, k in box)))
    return [q for q in out if q.numel]


def source_box(p: Piece, source_shape: Shape) -> tuple[Shape, Shape]:
    """The smallest box of the source holding an aligned piece's source elements."""
    first = list(unravel(p.start, source_shape))
    span = [1] * len(source_shape)
    for k, (e, m) in zip(p.size, source_digits(p, source_shape)):
        if e >= 0:
            span[e] += (k - 1) * m
    return tuple(first), tuple(span) if p.numel else tuple(0 for _ in span)


def groups(view: Sequence[int], shape: Sequence[int]) -> list[range] | None:
    """The dims of `view` that make up each dim of `shape`, or None if it does not refine it."""
    out = []
    i = 0
    for n in shape:
        start = i
        prod = 1
        while prod < n and i < len(view):
            prod *= view[i]
            i += 1
        if prod != n:
            return None
        out.append(range(start, i))
    if any(view[j] != 1 for j in range(i, len(view))):
        return None
    if out and i < len(view):
        out[-1] = range(out[-1].start, len(view))
    return out


def target_box(p: Piece, shape: Shape) -> tuple[Shape, Shape, list[tuple[int, int]]]:
    """The smallest box of the target holding a piece, and how the piece's dims move in it.

    Returns:
        (offset, size) of the box in the target's shape, and per dim of the piece's view (the
        target dim it moves, the step along that dim).
    """
    gs = groups(p.view, shape)
    assert gs is not None, "a piece's view refines its target's shape"
    off: list[int] = []
    size: list[int] = []
    moves: list[tuple[int, int]] = [(0, 0)] * len(p.view)
    for d, g in enumerate(gs):
        sub = [p.view[j] for j in g]
        first = ravel([p.offset[j] for j in g], sub)
        last = ravel([p.offset[j] + p.size[j] - 1 for j in g], sub)
        off.append(first)
        size.append(last - first + 1 if p.numel else 0)
        for j, s in zip(g, row_strides(sub)):
            moves[j] = (d, s)
    return tuple(off), tuple(size), moves


def split_for_reading(p: Piece, shape: Shape) -> list[Piece]:
    """`p` cut where its box of the target would hold over twice its elements (or ever so).

    A piece that cuts a head (a rank's shard ending inside one) is a few digits partly
    covered; read as one box of the target it can span most of the head. Cut along its
    outermost partly covered digit, each part reads at most twice its elements.
    """
    _, size, _ = target_box(p, shape)
    if math.prod(size) <= 2 * p.numel or p.numel == 0:
        return [p]
    d = next(j for j, k in enumerate(p.size) if k > 1)
    out = []
    for i in range(p.size[d]):
        q = p.with_box(_put(p.offset, d, p.offset[d] + i), _put(p.size, d, 1))
        out += split_for_reading(q, shape)
    return out


def cut(p: Piece, most: int) -> list[Piece]:
    """`p` cut along its outer dims into parts of at most `most` elements (at least a row)."""
    if p.numel <= most or most <= 0:
        return [p]
    d = next((j for j, k in enumerate(p.size) if k > 1), None)
    if d is None:
        return [p]
    rest = p.numel // p.size[d]
    if rest > most:  # one step of this dim is too large: cut inside it
        out = []
        for i in range(p.size[d]):
            q = p.with_box(_put(p.offset, d, p.offset[d] + i), _put(p.size, d, 1))
            out += cut(q, most)
        return out
    step = max(1, most // rest)
    return [
        p.with_box(_put(p.offset, d, p.offset[d] + a), _put(p.size, d, min(step, p.size[d] - a)))
        for a in range(0, p.size[d], step)
    ]
