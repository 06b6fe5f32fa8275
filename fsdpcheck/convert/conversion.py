"""A compiled conversion: every target tensor as pieces of the sources, and their coverage.

``Conversion`` is what every way of stating a conversion compiles to (a callable, an adapter, a
spec): target name -> shape, dtype and pieces (``pieces.Piece``), each piece aligned with its
source (each dim of its view moves one dim of the source tensor). It is JSON-able
(``to_spec`` / ``from_spec``), and its ``digest`` is what ranks agree on.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdpcheck.convert.pieces import (
    NotStrided,
    Piece,
    align_to_source,
    groups,
    row_strides,
    source_digits,
    through,
    unravel,
)
from fsdpcheck.convert.trace import ConversionError
from fsdpcheck.sources.tiling import box_text, tiling_problems, uncovered

Shape = tuple[int, ...]

#: Intervals one piece's elements may take along one dim before its coverage is summed
#: instead of placed (a stride-2 de-interleave of a long dim).
_MAX_INTERVALS = 1024


@dataclass(frozen=True)
class Target:
    """One tensor of the converted layout.

    Attributes:
        name: Its name in the converted layout.
        shape: Its global shape.
        dtype: Its dtype (the sources' cast through the pieces' casts), e.g. "bfloat16".
        pieces: Its elements as pieces of the sources, tiling it.
    """

    name: str
    shape: Shape
    dtype: str
    pieces: tuple[Piece, ...]


@dataclass
class Conversion:
    """A conversion compiled into pieces: what each target tensor is made of.

    Build one with ``fsdpcheck.convert.compile_conversion`` (from a callable, an adapter or a
    spec) or ``Conversion.from_spec``; pass it as ``convert=`` anywhere.

    Attributes:
        targets: Target name -> Target, in the order the conversion wrote them.
        sources: Source name -> (global shape, dtype) of every tensor it was compiled for.
        dropped: Source name -> why the conversion leaves it out on purpose (a tied weight, a
            rotary cache buffer, a spec's ``drop``).
        description: What was compiled, in words.
        notes: What tracing noticed (values that are not tensors, ...).
    """

    targets: dict[str, Target] = field(default_factory=dict)
    sources: dict[str, tuple[Shape, str]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    description: str = "a conversion"
    notes: list[str] = field(default_factory=list)

    # -- queries -------------------------------------------------------------------------------
    def by_source(self) -> dict[str, list[tuple[str, Piece]]]:
        """Source name -> (target name, piece) of every piece reading it."""
        out: dict[str, list[tuple[str, Piece]]] = {}
        for t in self.targets.values():
            for p in t.pieces:
                out.setdefault(p.source, []).append((t.name, p))
        return out

    def locate(self, target: str, index: int) -> tuple[str, Shape] | None:
        """The source name and multi-index of a target element (its linear index)."""
        t = self.targets.get(target)
        if t is None:
            return None
        for p in t.pieces:
            at = unravel(index, p.view)
            if p.holds(at):
                shape = self.sources[p.source][0]
                return p.source, unravel(p.source_index(at), shape)
        return None

    def digest(self) -> str:
        """A hash of every target, its pieces and the sources' shapes (what ranks agree on)."""
        h = hashlib.blake2b(digest_size=16)
        for name, (shape, dtype) in sorted(self.sources.items()):
            h.update(f"s\0{name}\0{shape}\0{dtype}\0".encode())
        for t in self.targets.values():
            h.update(f"t\0{t.name}\0{t.shape}\0{t.dtype}\0".encode())
            for p in t.pieces:
                h.update(
                    f"{p.view}{p.offset}{p.size}\0{p.source}\0{p.start}{p.strides}{p.cast}".encode()
                )
        for name, why in sorted(self.dropped.items()):
            h.update(f"d\0{name}\0{why}\0".encode())
        return h.hexdigest()

    # -- coverage ------------------------------------------------------------------------------
    def target_problems(self) -> dict[str, str]:
        """Target name -> what keeps its pieces from tiling it exactly (gaps, overlaps)."""
        out = {}
        for t in self.targets.values():
            numel = math.prod(t.shape)
            if len(t.pieces) == 1 and t.pieces[0].numel == numel:
                continue  # one piece the size of its view: it is the whole target
            boxes = _target_boxes(t)
            if boxes is None:
                got = sum(p.numel for p in t.pieces)
                if got != numel:
                    out[t.name] = f"the conversion writes {got} of its {numel} elements"
                continue
            problems = tiling_problems(t.shape, boxes) if numel else []
            if problems:
                out[t.name] = "the conversion does not write it whole: " + "; ".join(problems)
        return out

    def source_unused(self) -> dict[str, tuple[int, str]]:
        """Source name -> (elements no piece reads, where) for sources not dropped on purpose.

        A source no piece reads at all is (numel, "") unless ``dropped`` names it.
        """
        used = self.by_source()
        out: dict[str, tuple[int, str]] = {}
        for name, (shape, _) in self.sources.items():
            numel = math.prod(shape)
            if name in self.dropped or numel == 0:
                continue
            pieces = [p for _, p in used.get(name, [])]
            if not pieces:
                out[name] = (numel, "")
                continue
            if any(p.numel == numel and _injective(p) for p in pieces):
                continue  # one piece reads as many distinct elements as the source has
            boxes: list[tuple[Shape, Shape]] = []
            exact = True
            for p in dict.fromkeys(pieces):  # a tied copy reads the same elements again
                got = _footprint_boxes(p, shape)
                if got is None:
                    exact = False
                    break
                boxes += got
            if not exact:
                total = sum(p.numel for p in dict.fromkeys(pieces))
                if total < numel:
                    out[name] = (numel - total, "")
                continue
            left = uncovered(((0,) * len(shape), shape), boxes, limit=1 << 30)
            missing = sum(math.prod(s) for _, s in left)
            if missing:
                out[name] = (missing, box_text(left[0]))
        return out

    # -- JSON ----------------------------------------------------------------------------------
    def to_spec(self) -> dict[str, Any]:
        """The conversion as JSON-able data (``from_spec`` reads it back)."""
        return {
            "fsdpcheck_conversion": 1,
            "description": self.description,
            "sources": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.sources.items()},
            "dropped": dict(self.dropped),
            "targets": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "pieces": [
                        {
                            "view": list(p.view),
                            "offset": list(p.offset),
                            "size": list(p.size),
                            "source": p.source,
                            "start": p.start,
                            "strides": list(p.strides),
                            **({"cast": list(p.cast)} if p.cast else {}),
                        }
                        for p in t.pieces
                    ],
                }
                for t in self.targets.values()
            ],
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Conversion:
        """A conversion from ``to_spec``'s data (checked: pieces inside their tensors)."""
        try:
            sources = {
                str(k): (_shape(v["shape"]), _dtype_name(v["dtype"]))
                for k, v in spec["sources"].items()
            }
            conv = cls(sources=sources, description=str(spec.get("description", "a conversion")))
            conv.dropped = {str(k): str(v) for k, v in dict(spec.get("dropped", {})).items()}
            for t in spec["targets"]:
                pieces = tuple(
                    Piece(
                        _shape(p["view"]),
                        _shape(p["offset"]),
                        _shape(p["size"]),
                        str(p["source"]),
                        int(p["start"]),
                        _shape(p["strides"]),
                        tuple(_dtype_name(c) for c in p.get("cast", ())),
                    )
                    for p in t["pieces"]
                )
                target = Target(str(t["name"]), _shape(t["shape"]), _dtype_name(t["dtype"]), pieces)
                conv.targets[target.name] = target
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConversionError(
                f"not a compiled conversion spec: {type(exc).__name__} {exc}"
            ) from None
        for t in conv.targets.values():
            _check_target(t, conv.sources)
        return conv


def _shape(v: Iterable[Any]) -> Shape:
    out = tuple(int(x) for x in v)
    if any(x < 0 for x in out):
        raise ValueError(f"negative size in {out}")
    return out


def _dtype_name(v: Any) -> str:
    name = str(v).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"{v!r} is not a torch dtype")
    return name


def _check_target(t: Target, sources: Mapping[str, tuple[Shape, str]]) -> None:
    """Every piece of `t` lies in `t` and reads inside its source (no index out of range)."""
    for p in t.pieces:
        where = f"{t.name}: a piece"
        if p.source not in sources:
            raise ConversionError(f"{where} reads {p.source}, which is not a source")
        n = len(p.view)
        if not (len(p.offset) == len(p.size) == len(p.strides) == n):
            raise ConversionError(f"{where} has dims of different lengths")
        if groups(p.view, t.shape) is None or math.prod(p.view) != math.prod(t.shape):
            raise ConversionError(f"{where} has view {p.view}, which does not refine {t.shape}")
        if any(o < 0 or k < 0 or o + k > v for o, k, v in zip(p.offset, p.size, p.view)):
            raise ConversionError(f"{where} lies outside its view {p.view}")
        shape = sources[p.source][0]
        if p.numel:
            last = p.start + sum((k - 1) * s for k, s in zip(p.size, p.strides))
            if p.start < 0 or min(p.strides, default=0) < 0 or last >= math.prod(shape):
                raise ConversionError(f"{where} reads outside {p.source} {shape}")
            try:
                source_digits(p, shape)
            except Exception:
                raise ConversionError(f"{where} is not aligned with {p.source}") from None


def _injective(p: Piece) -> bool:
    """Whether an aligned piece reads each of its source elements once (no broadcast dim)."""
    return all(s != 0 or k <= 1 for k, s in zip(p.size, p.strides))


def _intervals(base: int, digits: Sequence[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The positions ``base + sum(i[k] * m[k])`` as sorted (start, length) runs, or None if many."""
    ds = sorted((m, c) for c, m in digits if c > 1 and m > 0)
    run = 1
    k = 0
    while k < len(ds) and ds[k][0] == run:
        run *= ds[k][1]
        k += 1
    outer = ds[k:]
    if math.prod(c for _, c in outer) > _MAX_INTERVALS:
        return None
    starts = [base]
    for m, c in outer:
        starts = [s + i * m for s in starts for i in range(c)]
    out: list[tuple[int, int]] = []
    for s in sorted(starts):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + run)
        else:
            out.append((s, run))
    return out


def _product(per_dim: list[list[tuple[int, int]]]) -> list[tuple[Shape, Shape]] | None:
    if math.prod(len(x) for x in per_dim) > _MAX_INTERVALS:
        return None
    return [
        (tuple(s for s, _ in combo), tuple(n for _, n in combo))
        for combo in itertools.product(*per_dim)
    ]


def _footprint_boxes(p: Piece, shape: Shape) -> list[tuple[Shape, Shape]] | None:
    """The source elements an aligned piece reads, as boxes of the source (None: too many)."""
    if p.numel == 0:
        return []
    first = unravel(p.start, shape)
    by_dim: list[list[tuple[int, int]]] = [[] for _ in shape]
    for k, (e, m) in zip(p.size, source_digits(p, shape)):
        if e >= 0:
            by_dim[e].append((k, m))
    per_dim = []
    for d in range(len(shape)):
        got = _intervals(first[d], by_dim[d])
        if got is None:
            return None
        per_dim.append(got)
    return _product(per_dim)


def _target_boxes(t: Target) -> list[tuple[Shape, Shape]] | None:
    """The elements of `t` its pieces write, as boxes of `t` (None: too many to place)."""
    out: list[tuple[Shape, Shape]] = []
    for p in t.pieces:
        if p.numel == 0:
            continue
        gs = groups(p.view, t.shape)
        if gs is None:
            return None
        per_dim = []
        for g in gs:
            sub = [p.view[j] for j in g]
            st = row_strides(sub)
            base = sum(p.offset[j] * s for j, s in zip(g, st))
            got = _intervals(base, [(p.size[j], s) for j, s in zip(g, st)])
            if got is None:
                return None
            per_dim.append(got)
        boxes = _product(per_dim)
        if boxes is None:
            return None
        out += boxes
    return out


def compiled(
    targets: Mapping[str, tuple[Shape, torch.dtype, list[Piece]]],
    sources: Mapping[str, tuple[Shape, torch.dtype]],
    description: str,
) -> Conversion:
    """A Conversion from traced targets: each piece aligned with its source."""
    conv = Conversion(
        sources={k: (tuple(s), str(d).removeprefix("torch.")) for k, (s, d) in sources.items()},
        description=description,
    )
    for name, (shape, dtype, pieces) in targets.items():
        aligned: list[Piece] = []
        for p in pieces:
            try:
                aligned += align_to_source(p, tuple(sources[p.source][0]))
            except NotStrided as exc:
                raise ConversionError(
                    f"{description}: {name} reads {p.source} in a way that is not piecewise "
                    f"strided ({exc})"
                ) from None
        conv.targets[name] = Target(
            name, tuple(shape), str(dtype).removeprefix("torch."), tuple(aligned)
        )
    return conv


def composed(first: Conversion, second: Conversion) -> Conversion:
    """`second` after `first`, as one conversion of `first`'s sources.

    `second` was compiled for `first`'s targets (its sources are their names): each of its
    pieces, reading a strided box of a target of `first`, becomes pieces of the sources that
    target is made of (``pieces.through``). A source of `first` whose every target `second`
    leaves out on purpose is left out on purpose, for `second`'s reason.

    Raises:
        ConversionError: `second` reads a tensor `first` does not write, or the composition is
            not a strided map.
    """
    what = f"{first.description}, then {second.description}"
    conv = Conversion(sources=dict(first.sources), description=what)
    conv.notes = [*first.notes, *second.notes]
    for t in second.targets.values():
        out: list[Piece] = []
        for p in t.pieces:
            made = first.targets.get(p.source)
            if made is None:
                raise ConversionError(
                    f"{what}: {t.name} reads {p.source}, which {first.description} does not write"
                )
            try:
                for q in through(p, made.pieces):
                    out += align_to_source(q, first.sources[q.source][0])
            except NotStrided as exc:
                raise ConversionError(
                    f"{what}: {t.name} is not piecewise strided in the sources ({exc})"
                ) from None
        conv.targets[t.name] = Target(t.name, t.shape, t.dtype, tuple(out))
    conv.dropped = dict(first.dropped)
    readers: dict[str, set[str]] = {}
    for t in first.targets.values():
        for p in t.pieces:
            readers.setdefault(p.source, set()).add(t.name)
    for name, into in readers.items():
        if name in conv.dropped or not into or not into <= set(second.dropped):
            continue
        conv.dropped[name] = second.dropped[min(into)]
    return conv


__all__ = ["Conversion", "Target", "compiled", "composed"]
