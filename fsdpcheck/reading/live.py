"""A live model through a conversion: its shards cut into the pieces of the converted layout.

Every rank compiles the same conversion from the job's agreed names and global shapes
(``convert.compile_conversion``: F runs once on shape-only tensors, never on a shard), pairs
its targets with the checkpoint, and then, for each piece, takes the part its own shards of the
piece's source hold (``pieces.within``): a strided view of a local shard, compared with (or
hashed at) the piece's box of the target. Nothing is gathered and no data moves between ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from fsdpcheck.convert import Conversion, Target, compile_conversion, resolve_declared
from fsdpcheck.convert.pieces import Piece, cut, split_for_reading, target_box, within
from fsdpcheck.layout import Layout, local_layout
from fsdpcheck.live import LiveState
from fsdpcheck.reading.plan import source_view, target_view, whole_piece

Shape = tuple[int, ...]


def compile_for_live(
    convert: Any,
    job: LiveState,
    other_names: set[str] | None = None,
    buffers: set[str] | frozenset[str] = frozenset(),
) -> Conversion | None:
    """The conversion of the job's model names (the same on every rank that agreed on them).

    Tied duplicates and (persistent) `buffers` that the conversion leaves out are listed as
    left out on purpose. A model's declared layouts (``convert.declared``) resolve to the one
    whose names `other_names` holds; None when that is the live layout (nothing to convert).
    """
    sources = {
        name: (meta.shape, getattr(torch, meta.dtype))
        for name, meta in job.model.items()
        if name not in job.buffers
    }
    convert = resolve_declared(convert, sources, other_names)
    if convert is None:
        return None
    purpose = {
        name: "a buffer the model recomputes (such as a rotary cache)"
        for name in buffers
        if name in sources
    }
    purpose.update({dup: f"tied to {first}" for dup, first in job.tied.items()})
    return compile_conversion(convert, sources, other_names=other_names, purpose=purpose)


def converted_state(job: LiveState, conv: Conversion) -> LiveState:
    """The job's names with the model tensors replaced by the conversion's targets.

    The optimizer's state keeps its names (the parameters' as live); non-persistent buffers are
    not part of what the conversion is given.
    """
    tied = tied_targets(conv, job.tied)
    return dataclasses.replace(
        job, model=dict(conv.targets), tied=tied, buffers={}, requires_grad={}, adapters=()
    )


def tied_targets(conv: Conversion, tied: Mapping[str, str]) -> dict[str, str]:
    """Target -> the target it is a tied duplicate of.

    A target is one when it is a whole, unchanged copy of a tied parameter whose first name
    the conversion also copies whole (a spec that keeps every other key keeps
    ``lm_head.weight`` beside ``transformer.wte.weight``).
    """
    whole: dict[str, str] = {}
    for t in conv.targets.values():
        if len(t.pieces) != 1:
            continue
        p = t.pieces[0]
        shape = conv.sources[p.source][0]
        if not p.cast and t.shape == shape and p == whole_piece(p.source, shape):
            whole.setdefault(p.source, t.name)
    out = {}
    for dup, first in tied.items():
        if dup in whole and first in whole and whole[dup] != whole[first]:
            out[whole[dup]] = whole[first]
    return out


def source_layouts(
    target: Target, values: Mapping[str, Any], world: int, cache: dict[str, Layout]
) -> tuple[dict[str, Layout], str | None]:
    """This rank's layout of each source a target reads (those it holds), or why not."""
    out: dict[str, Layout] = {}
    for p in target.pieces:
        if p.source in out or p.source not in values:
            continue
        lay = cache.get(p.source)
        if lay is None:
            lay = cache[p.source] = local_layout(values[p.source], world)
        if lay.error is not None:
            return out, f"{p.source}: {lay.error}"
        out[p.source] = lay
    return out, None


def local_parts(
    target: Target,
    layouts: Mapping[str, Layout],
    shapes: Mapping[str, Shape],
    most: int,
    *,
    for_reading: bool,
) -> Iterator[tuple[torch.Tensor, Piece]]:
    """Each part of the target this rank's shards hold: its view (not cast yet), and its piece.

    Args:
        target: The target.
        layouts: This rank's layouts of the sources it holds.
        shapes: Each source's global shape.
        most: Elements per part at most (the batch's share).
        for_reading: The target's region will be read (cut so that it reads at most twice the
            part's elements); else the part is hashed only.
    """
    for p in target.pieces:
        lay = layouts.get(p.source)
        if lay is None or p.numel == 0:
            continue
        shape = shapes[p.source]
        for lp in lay.pieces:
            assert lp.box.offset is not None
            if lp.tensor.numel() == 0:
                continue
            for sub in within(p, shape, lp.box.offset, tuple(lp.tensor.shape)):
                parts = split_for_reading(sub, target.shape) if for_reading else [sub]
                for q in parts:
                    for r in cut(q, most):
                        # Uncast: a cast is a copy, made when its batch is compared.
                        yield source_view(lp.tensor, lp.box.offset, r, shape, cast=False), r


def converted_reads(
    source: Any, items: Sequence[Any], conv: Conversion, values: Mapping[str, Any], world: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(view of a live shard, the checkpoint's values for it) for every converted piece here.

    What ``load`` through a conversion writes. Local I/O only: each part of a paired target
    (``items``: the pairing's items whose value is a Target) that this rank's shards hold is a
    strided view of a shard (``local_parts``); the checkpoint region its piece names is read to
    the CPU and viewed in the part's order (``plan.target_view``). Shapes are checked before
    anything is read, and nothing is written here.

    Raises:
        CheckpointError: A target's shape is not its entry's, or a shard's layout is not one
            fsdpcheck can cut into pieces (nothing was loaded).
    """
    from fsdpcheck.errors import CheckpointError
    from fsdpcheck.sources import Region

    entries = source.entries()
    shapes = {k: v[0] for k, v in conv.sources.items()}
    cache: dict[str, Layout] = {}
    parts: list[tuple[torch.Tensor, Piece, Target]] = []
    regions: list[Region] = []
    for item in items:
        t = item.value
        if not isinstance(t, Target):
            continue
        entry = entries[item.ckpt_key]
        if tuple(entry.shape) != t.shape:
            raise CheckpointError(
                f"{t.name}: the conversion makes it {t.shape} but the checkpoint's "
                f"{item.ckpt_key} is {tuple(entry.shape)} (nothing was loaded)"
            )
        layouts, error = source_layouts(t, values, world, cache)
        if error is not None:
            raise CheckpointError(f"{t.name}: {error} (nothing was loaded)")
        for view, q in local_parts(t, layouts, shapes, 1 << 62, for_reading=True):
            off, size, _ = target_box(q, t.shape)
            parts.append((view, q, t))
            regions.append(Region(item.ckpt_key, off, size))
    refs = source.read(regions, torch.device("cpu")) if regions else []
    return [
        (_once(view, q), _once(target_view(ref, q, t.shape), q))
        for (view, q, t), ref in zip(parts, refs)
    ]


def _once(v: torch.Tensor, p: Piece) -> torch.Tensor:
    """A piece's view with each broadcast dim (a source stride of 0) taken once: written once."""
    for d, (k, s) in enumerate(zip(p.size, p.strides)):
        if k > 1 and s == 0:
            v = v.narrow(d, 0, 1)
    return v


def write_in_place(writes: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each checkpoint region into the view of the shard it belongs to (``converted_reads``)."""
    with torch.no_grad():
        for view, ref in writes:
            view.copy_(ref)


def buffer_names(live: LiveState) -> set[str]:
    """The persistent buffers among a live model's state-dict names (not parameters)."""
    if not live.requires_grad:  # a state dict: no telling
        return set()
    return {name for name in live.model if name not in live.requires_grad}


__all__ = [
    "buffer_names",
    "compile_for_live",
    "converted_reads",
    "converted_state",
    "local_parts",
    "source_layouts",
    "tied_targets",
    "write_in_place",
]
