"""What keeps per-key costs down, pinned: the paused cyclic GC, the chunk filter, the fast paths."""

from __future__ import annotations

import gc
import itertools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsdpcheck
from fsdpcheck.layout import local_layout
from fsdpcheck.sources.tiling import intersect, uncovered
from fsdpcheck.verification import _along_chunks


def _gc_seen_by(**kw: Any) -> list[bool]:
    """gc.isenabled() as seen from inside verify (through its key_map), per key."""
    seen: list[bool] = []

    def key_map(name: str) -> str | None:
        seen.append(gc.isenabled())
        return name  # the same name in the reference

    state = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    report = fsdpcheck.verify(state, dict(state), key_map=key_map, **kw)
    assert report.ok, report
    return seen


def test_verify_pauses_the_cyclic_gc_and_restores_it() -> None:
    assert gc.isenabled()
    seen = _gc_seen_by()
    assert seen and not any(seen)
    assert gc.isenabled()


def test_verify_leaves_a_disabled_gc_disabled() -> None:
    gc.disable()
    try:
        assert not any(_gc_seen_by())
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_verify_restores_the_gc_when_it_raises() -> None:
    class Stop(BaseException):  # not an Exception: verify lets it through
        pass

    def key_map(name: str) -> str | None:
        raise Stop

    state = {"a": torch.ones(3)}
    with pytest.raises(Stop):
        fsdpcheck.verify(state, dict(state), key_map=key_map)
    assert gc.isenabled()


def _scan(offset: tuple[int, ...], size: tuple[int, ...], saved: list) -> list:
    """The piece cut along every saved chunk it meets, without the row filter."""
    import math

    piece = (offset, size)
    parts = [c for c in (intersect(piece, c) for c in saved) if c]
    whole = sum(math.prod(s) for _, s in parts) == math.prod(size)
    return parts if len(parts) > 1 and whole and not uncovered(piece, parts) else [piece]


@st.composite
def chunks_and_piece(draw: Any) -> tuple:
    rows, cols = draw(st.integers(1, 12)), draw(st.integers(1, 6))
    cuts = sorted(set(draw(st.lists(st.integers(1, rows - 1), max_size=4)))) if rows > 1 else []
    bounds = [0, *cuts, rows]
    saved = [((a, 0), (b - a, cols)) for a, b in itertools.pairwise(bounds)]
    if draw(st.booleans()) and saved:  # damage: drop or duplicate a chunk, or add an empty one
        i = draw(st.integers(0, len(saved) - 1))
        saved = draw(
            st.sampled_from(
                [saved[:i] + saved[i + 1 :], [*saved, saved[i]], [*saved, ((0, 0), (0, cols))]]
            )
        )
    saved = draw(st.permutations(saved))
    r0 = draw(st.integers(0, rows))
    r1 = draw(st.integers(r0, rows))
    c0 = draw(st.integers(0, cols))
    c1 = draw(st.integers(c0, cols))
    return (r0, c0), (r1 - r0, c1 - c0), list(saved)


@given(chunks_and_piece())
def test_cutting_along_chunks_filters_by_rows_without_changing_the_cut(case: tuple) -> None:
    offset, size, saved = case
    assert _along_chunks(offset, size, saved) == _scan(offset, size, saved)


def test_a_plain_tensor_with_zero3_attributes_is_still_read_as_zero3() -> None:
    # The plain-tensor shortcut holds only for tensors carrying no attribute of their own.
    t = torch.zeros(2, 3)
    t.ds_tensor = None  # type: ignore[attr-defined]
    lay = local_layout(t, 2)
    assert lay.error is not None and "ZeRO-3" in lay.error and not lay.pieces
    assert local_layout(torch.zeros(2, 3), 2).pieces[0].box.offset == (0, 0)


def test_whole_tensors_of_one_shape_share_their_box() -> None:
    a, b = local_layout(torch.zeros(4, 5)), local_layout(torch.ones(4, 5))
    assert a.pieces[0].box is b.pieces[0].box
    assert a.pieces[0].box.shape == (4, 5) and a.pieces[0].box.offset == (0, 0)
