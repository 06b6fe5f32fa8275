"""Chunk tiling: do a tensor's saved chunks cover its shape exactly, and what does a box miss?"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

#: (offsets, sizes) of one box.
Box = tuple[tuple[int, ...], tuple[int, ...]]

# At most this many gaps / overlaps are described per key.
MAX_PROBLEMS = 4


def tiling_problems(shape: Sequence[int], boxes: Sequence[Box]) -> list[str]:
    """What keeps `boxes` from tiling `shape` exactly (gaps and overlaps), or [].

    A sweep along dim 0: between consecutive chunk boundaries the set of chunks that cross the
    slab must tile the remaining dims, checked the same way, and each distinct set is checked
    once. Chunkings made by sharding (grids, uneven and strided ones included) cost
    O(chunks log chunks). Each problem starts with "gap at" or "overlap at".
    """
    problems: list[str] = []
    if len(shape) == 0:
        if len(boxes) != 1:
            problems.append(f"the scalar is saved {len(boxes)} times")
        return problems
    _tile(tuple(shape), [(tuple(o), tuple(s)) for o, s in boxes], (), problems)
    return problems[:MAX_PROBLEMS]


def _tile(
    shape: tuple[int, ...], boxes: list[Box], where: tuple[str, ...], problems: list[str]
) -> None:
    if len(problems) >= MAX_PROBLEMS:
        return
    if len(shape) == 1:
        pos = 0
        for lo, hi in sorted((o[0], o[0] + s[0]) for o, s in boxes):
            if lo > pos:
                problems.append(f"gap at {_at(where, pos, lo)}")
            elif lo < pos:
                problems.append(f"overlap at {_at(where, lo, min(pos, hi))}")
            pos = max(pos, hi)
        if pos < shape[0]:
            problems.append(f"gap at {_at(where, pos, shape[0])}")
        return
    cuts = sorted({0, shape[0]} | {o[0] for o, _ in boxes} | {o[0] + s[0] for o, s in boxes})
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    active: set[int] = set()
    seen: set[frozenset[int]] = set()
    nxt = 0
    for lo, hi in itertools.pairwise(cuts):
        while nxt < len(order) and boxes[order[nxt]][0][0] <= lo:
            active.add(order[nxt])
            nxt += 1
        active = {i for i in active if boxes[i][0][0] + boxes[i][1][0] > lo}
        key = frozenset(active)
        if key in seen:
            continue  # the same chunks cross this slab as an earlier one: already checked
        seen.add(key)
        sub = [(boxes[i][0][1:], boxes[i][1][1:]) for i in sorted(active)]
        if not sub:
            problems.append(f"gap at {_at(where, lo, hi)} (no chunk covers these rows)")
            continue
        _tile(shape[1:], sub, (*where, f"{lo}:{hi}"), problems)


def _at(where: tuple[str, ...], lo: int, hi: int) -> str:
    """A region in index notation, e.g. [0:4, 6:8]."""
    return "[" + ", ".join((*where, f"{lo}:{hi}")) + "]"


def box_text(box: Box) -> str:
    """A box in index notation, e.g. ``[0:4, 6:8]`` (``[]`` for a scalar)."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(*box)) + "]"


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same rank, or None when they share no element."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def uncovered(
    region: Box, boxes: Sequence[Box], *, disjoint: bool = False, limit: int = MAX_PROBLEMS
) -> list[Box]:
    """Parts of `region` that no box in `boxes` covers (at most `limit` of them; [] = covered).

    When the boxes do not overlap each other (`disjoint`: the caller knows it, e.g. from
    `tiling_problems`; else it is checked pairwise among the boxes meeting the region), the
    volumes of their overlaps with the region add up to the region's volume exactly when it is
    covered: that test decides the common case. Only a region that is not covered is split (box
    subtraction) to name what is missing.
    """
    offsets, sizes = region
    total = math.prod(sizes)
    if total == 0:
        return []
    if not offsets:  # a scalar: covered by any saved box
        return [] if boxes else [region]
    parts = [c for c in (intersect(region, b) for b in boxes) if c is not None]
    if sum(math.prod(p[1]) for p in parts) == total and (disjoint or not _overlapping(parts)):
        return []
    left = [region]
    for p in parts:
        left = [piece for r in left for piece in _subtract(r, p)]
        if not left:
            return []
    return left[:limit]


def _overlapping(parts: list[Box]) -> bool:
    """Whether any two boxes overlap (pairwise: only the few boxes meeting one region)."""
    return any(intersect(a, b) is not None for a, b in itertools.combinations(parts, 2))


def _subtract(r: Box, cut: Box) -> list[Box]:
    """`r` minus `cut`, as at most 2 * ndim disjoint boxes."""
    inter = intersect(r, cut)
    if inter is None:
        return [r]
    out: list[Box] = []
    off, size = list(r[0]), list(r[1])
    for d in range(len(off)):
        lo, hi = inter[0][d], inter[0][d] + inter[1][d]
        if lo > off[d]:
            out.append((tuple(off), (*size[:d], lo - off[d], *size[d + 1 :])))
        if hi < off[d] + size[d]:
            out.append(
                (
                    (*off[:d], hi, *off[d + 1 :]),
                    (*size[:d], off[d] + size[d] - hi, *size[d + 1 :]),
                )
            )
        off[d], size[d] = lo, hi - lo
    return out
