"""A live model through a conversion: its shards cut into the pieces of the converted layout.

Every rank compiles the same conversion from the job's agreed names and global shapes
(``convert.compile_conversion``: F runs once on shape-only tensors, never on a shard), pairs
its targets with the checkpoint, and then, for each piece, takes the part its own shards of the
piece's source hold (``pieces.within``): a strided view of a local shard, compared with (or
hashed at) the piece's box of the target. Nothing is gathered and no data moves between ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fsdpcheck.convert import Conversion, Target, compile_conversion, resolve_declared
from fsdpcheck.convert.pieces import Piece, cut, split_for_reading, within
from fsdpcheck.layout import Layout, local_layout
from fsdpcheck.live import LiveState
from fsdpcheck.reading.plan import source_view, whole_piece

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


def buffer_names(live: LiveState) -> set[str]:
    """The persistent buffers among a live model's state-dict names (not parameters)."""
    if not live.requires_grad:  # a state dict: no telling
        return set()
    return {name for name in live.model if name not in live.requires_grad}


__all__ = [
    "buffer_names",
    "compile_for_live",
    "converted_state",
    "local_parts",
    "source_layouts",
    "tied_targets",
]
