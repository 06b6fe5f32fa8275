"""Running a conversion once on shape-only tensors, and recording what it did as pieces.

``trace(F, sources)`` calls ``F`` on a dict of tracing tensors: tensor subclasses over meta
tensors of the sources' global shapes and dtypes, which hold no data. Every operation ``F``
runs reaches ``__torch_dispatch__`` as an aten op. Views (view/reshape, transpose/permute/t,
slicing, select, split/chunk/unbind, narrow, squeeze/unsqueeze, expand) are followed as strided
views of the tensor they view; clone/contiguous, casts and cat/stack make a new tensor whose
pieces are composed from their inputs' (``pieces.compose``). Anything else (arithmetic, an
index by a tensor, ``.item()``, numpy, in-place writes) is one ``ConversionError`` naming the
op and the keys it was applied to: the map would otherwise be silently wrong.

NOTE: [traced bases] A traced tensor is a strided view (size, stride, storage offset) of a
"base": a tensor the trace made (a source, or the result of a clone, cast or cat), laid out
row-major, whose elements are described by pieces. A view costs nothing; a base costs one
composition of its input's view with its input's pieces. New bases are contiguous whatever
memory format an op would give (``clone`` preserves strides): only logical values matter, and
every view of a contiguous tensor exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from fsdpcheck.convert.pieces import MAX_PIECES, NotStrided, Piece, compose, groups, row_strides
from fsdpcheck.errors import FsdpcheckError

Shape = tuple[int, ...]

aten = torch.ops.aten


class ConversionError(FsdpcheckError, ValueError):
    """A conversion that cannot be followed as a strided map, or that is stated wrongly."""


# Views: followed as strided views of their input's base.
_VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.transpose.int,
    aten.permute.default,
    aten.t.default,
    aten.select.int,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.chunk.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.expand.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh.default,
    aten.movedim.int,
    aten.unflatten.int,
    aten.flatten.using_ints,
}
# New tensors made of their input's elements, maybe cast.
_COPIES = {aten.clone.default, aten._to_copy.default, aten.contiguous.default}
# Methods that would hand the (absent) data to Python.
_DATA_METHODS = {
    "numpy",
    "tolist",
    "item",
    "__array__",
    "data_ptr",
    "untyped_storage",
    "storage",
    "__reduce_ex__",
}


class _Base:
    """A tensor the trace made: its shape, the pieces of its elements, the sources it reads."""

    __slots__ = ("keys", "meta", "pieces", "shape")

    def __init__(self, shape: Shape, dtype: torch.dtype, pieces: list[Piece], keys: frozenset):
        self.shape = shape
        self.pieces = pieces
        self.keys = keys
        self.meta = torch.empty(shape, dtype=dtype, device="meta")


class _Trace:
    """What one trace knows: each source's dtype (for casts), and the last keys an op touched."""

    def __init__(self, dtypes: Mapping[str, torch.dtype]) -> None:
        self.dtypes = dict(dtypes)
        self.last: frozenset[str] = frozenset()


class Traced(torch.Tensor):
    """A shape-only tensor that records what a conversion does to the sources it comes from."""

    # One attribute, set once: attributes of a tensor subclass cost ~10 us each to set.
    _fc: tuple[torch.Tensor, _Base, _Trace]

    @property
    def _fc_elem(self) -> torch.Tensor:
        return self._fc[0]

    @property
    def _fc_base(self) -> _Base:
        return self._fc[1]

    @property
    def _fc_trace(self) -> _Trace:
        return self._fc[2]

    @staticmethod
    def __new__(cls, elem: torch.Tensor, base: _Base, trace: _Trace) -> Traced:  # noqa: D102
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=elem.device,
            requires_grad=False,
        )
        r._fc = (elem, base, trace)
        return r

    def __repr__(self) -> str:  # type: ignore[override]
        keys = ", ".join(sorted(self._fc_base.keys)[:3])
        return f"Traced(shape={tuple(self.shape)}, dtype={self.dtype}, from={keys})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _DATA_METHODS:
            traced = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, Traced)]
            raise ConversionError(_refusal(f"Tensor.{name}", traced))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        traced = [a for a in flat if isinstance(a, Traced)]
        trace = traced[0]._fc_trace
        trace.last = frozenset().union(*(t._fc_base.keys for t in traced))
        others = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, Traced)]
        if others:
            raise ConversionError(
                _refusal(str(func), traced, "with a tensor that is not one of the sources")
            )
        if func in _VIEWS:
            return _view(func, args, kwargs, traced[0])
        if func in _COPIES:
            return _copy(func, args, kwargs, trace)
        if func is aten.cat.default:
            return _cat(args, kwargs, trace)
        if func is aten.stack.default:
            tensors = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            dim = dim % (tensors[0].dim() + 1) if tensors else 0
            return _cat(([t.unsqueeze(dim) for t in tensors], dim), {}, trace)
        raise ConversionError(_refusal(str(func), traced))


def _refusal(op: str, traced: list[Traced], how: str = "") -> str:
    keys = sorted(frozenset().union(*(t._fc_base.keys for t in traced))) if traced else []
    named = ", ".join(keys[:3]) + (f" (and {len(keys) - 3} more)" if len(keys) > 3 else "")
    return (
        f"the conversion applies {op} to {named or 'a traced tensor'}{' ' + how if how else ''}: "
        "not a strided map of the source elements; a conversion may use views, reshapes, "
        "transposes, slices, split/cat/stack, clone and casts only (arithmetic, a gather by "
        "index, .item() or numpy need the data, which is never read to follow a conversion)"
    )


def _unwrap(x: Any) -> Any:
    return x._fc_elem if isinstance(x, Traced) else x


def _view(func: Any, args: Any, kwargs: Any, src: Traced) -> Any:
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    base, trace = src._fc_base, src._fc_trace
    return tree_map(lambda o: Traced(o, base, trace) if isinstance(o, torch.Tensor) else o, out)


def _pieces_of(t: Traced) -> list[Piece]:
    """The pieces of a traced tensor as a new row-major tensor of its shape."""
    e, base = t._fc_elem, t._fc_base
    shape = tuple(e.shape)
    if shape == base.shape and e.storage_offset() == 0 and e.stride() == row_strides(shape):
        return base.pieces  # the base itself: its pieces refine its shape already
    try:
        return compose(base.pieces, shape, tuple(e.stride()), int(e.storage_offset()))
    except NotStrided as exc:
        raise ConversionError(
            f"a view of {', '.join(sorted(base.keys)[:3])} is not piecewise strided ({exc})"
        ) from None


def _dtype_of(p: Piece, trace: _Trace) -> torch.dtype:
    return getattr(torch, p.cast[-1]) if p.cast else trace.dtypes[p.source]


def _cast(pieces: list[Piece], dtype: torch.dtype, trace: _Trace) -> list[Piece]:
    name = str(dtype).removeprefix("torch.")
    out = []
    for p in pieces:
        if _dtype_of(p, trace) != dtype:
            p = Piece(p.view, p.offset, p.size, p.source, p.start, p.strides, (*p.cast, name))
        out.append(p)
    return out


def _copy(func: Any, args: Any, kwargs: Any, trace: _Trace) -> Traced:
    src = args[0]
    dtype = src.dtype
    if func is aten._to_copy.default:
        dtype = kwargs.get("dtype") or dtype
    pieces = _cast(_pieces_of(src), dtype, trace)
    return _new(tuple(src.shape), dtype, pieces, src._fc_base.keys, trace)


def _new(
    shape: Shape, dtype: torch.dtype, pieces: list[Piece], keys: frozenset, trace: _Trace
) -> Traced:
    base = _Base(shape, dtype, pieces, keys)
    return Traced(base.meta, base, trace)


def _cat(args: Any, kwargs: Any, trace: _Trace) -> Traced:
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not all(isinstance(t, Traced) for t in tensors):
        raise ConversionError(
            _refusal("aten.cat", [t for t in tensors if isinstance(t, Traced)], "with constants")
        )
    out_meta = aten.cat.default([t._fc_elem for t in tensors], dim)
    z = tuple(out_meta.shape)
    dim = dim % len(z) if z else 0
    pieces: list[Piece] = []
    at = 0
    for t in tensors:
        y = tuple(t.shape)
        if t.dim() == 1 and y[0] == 0 and len(z) != 1:
            continue  # torch.cat skips legacy empty tensors
        for p in _cast(_pieces_of(t), out_meta.dtype, trace):
            pieces += _embed(p, y, z, dim, at)
        at += y[dim]
        if len(pieces) > MAX_PIECES:
            named = ", ".join(sorted(frozenset().union(*(x._fc_base.keys for x in tensors)))[:3])
            raise ConversionError(
                f"cat of {named} takes more than {MAX_PIECES} pieces: not a strided map"
            )
    keys = frozenset().union(*(t._fc_base.keys for t in tensors))
    return _new(z, out_meta.dtype, pieces, keys, trace)


def _embed(p: Piece, y: Shape, z: Shape, dim: int, at: int) -> list[Piece]:
    """A piece of one input of a cat, placed at offset `at` along `dim` of the result `z`."""
    gs = groups(p.view, y)
    assert gs is not None
    g = gs[dim]
    view, off, size, strides = list(p.view), list(p.offset), list(p.size), list(p.strides)
    if len(g) == 0:  # the input has one element along dim: a digit of its own in the result
        j = g.start
        view.insert(j, z[dim])
        off.insert(j, at)
        size.insert(j, 1)
        strides.insert(j, 0)
        return [
            Piece(tuple(view), tuple(off), tuple(size), p.source, p.start, tuple(strides), p.cast)
        ]
    inner = math.prod(p.view[j] for j in g[1:])
    if z[dim] % inner == 0 and at % inner == 0:
        view[g.start] = z[dim] // inner
        off[g.start] += at // inner
        return [
            Piece(tuple(view), tuple(off), tuple(size), p.source, p.start, tuple(strides), p.cast)
        ]
    # The result's dim does not split like the input's: one part per value of the outer
    # digit, whose digit then merges into the next.
    out = []
    j = g.start
    for i in range(p.size[j]):
        q = p.with_box(
            (*p.offset[:j], p.offset[j] + i, *p.offset[j + 1 :]),
            (*p.size[:j], 1, *p.size[j + 1 :]),
        )
        merged = Piece(
            (*q.view[:j], q.view[j] * q.view[j + 1], *q.view[j + 2 :]),
            (*q.offset[:j], q.offset[j] * q.view[j + 1] + q.offset[j + 1], *q.offset[j + 2 :]),
            (*q.size[:j], q.size[j + 1], *q.size[j + 2 :]),
            q.source,
            q.start,
            (*q.strides[:j], q.strides[j + 1], *q.strides[j + 2 :]),
            q.cast,
        )
        out += _embed(merged, y, z, dim, at)
    return out


# -------------------------------------------------------------------------------------------
def trace(
    fn: Callable[[dict[str, Any]], Any],
    sources: Mapping[str, tuple[Shape, torch.dtype]],
    what: str = "the conversion",
) -> tuple[dict[str, tuple[Shape, torch.dtype, list[Piece]]], list[str]]:
    """Runs `fn` once on shape-only tensors of `sources`, and returns what it wrote.

    Args:
        fn: ``F(state_dict) -> state_dict``.
        sources: Name -> (global shape, dtype) of every tensor `fn` is given.
        what: The conversion in words, for messages.

    Returns:
        Target name -> (shape, dtype, pieces: boxes of the target's shape refined), and notes
        (values `fn` wrote that are not tensors, left out).

    Raises:
        ConversionError: `fn` did something that is not a strided map, or raised.
    """
    tr = _Trace({k: dt for k, (_, dt) in sources.items()})
    given: dict[str, Any] = {}
    for key, (shape, dtype) in sources.items():
        shape = tuple(shape)
        whole = [Piece(shape, (0,) * len(shape), shape, key, 0, row_strides(shape))]
        given[key] = _new(shape, dtype, whole if math.prod(shape) else [], frozenset([key]), tr)
    try:
        with torch.no_grad():
            out = fn(given)
    except ConversionError:
        raise
    except Exception as exc:
        at = ", ".join(sorted(tr.last)[:3])
        raise ConversionError(
            f"{what} raised {type(exc).__name__}: {exc}"
            + (f" (last at {at})" if at else "")
            + "; it ran on shape-only tensors of the sources' global shapes"
        ) from None
    if not isinstance(out, Mapping):
        raise ConversionError(f"{what} returned a {type(out).__name__}, not a state dict")
    targets: dict[str, tuple[Shape, torch.dtype, list[Piece]]] = {}
    notes = []
    skipped = []
    for name, value in out.items():
        if isinstance(value, Traced):
            targets[str(name)] = (tuple(value.shape), value.dtype, _pieces_of(value))
        elif isinstance(value, torch.Tensor):
            raise ConversionError(
                f"{what} writes {name} as a tensor it made itself, from none of the sources "
                "(a constant cannot be checked against them)"
            )
        else:
            skipped.append(str(name))
    if skipped:
        notes.append(
            f"{what} also writes {len(skipped)} value(s) that are not tensors "
            f"({', '.join(skipped[:3])}): not compared"
        )
    return targets, notes


__all__ = ["ConversionError", "Traced", "trace"]
