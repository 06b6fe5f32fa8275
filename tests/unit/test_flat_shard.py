"""FlatShard: a run of a tensor's row-major elements (FSDP1's optimizer state), without FSDP.

FSDP1 holds each original parameter's optimizer state as a contiguous run of its flattened
index; ``flat_shard_layout`` hands it to the kernels as at most 2 * (ndim - 1) + 1 boxes, each a
view. The mapping from torch's FlatParameter record is tested here on hand-made records, and
on real FSDP1 models on 2 and 4 ranks in tests/dist/fsdp1/test_fsdp1_dist.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fsdpcheck._compat import FlatParamInfo
from fsdpcheck.kernels import MASK64, fingerprint_tensor, fingerprint_tensors
from fsdpcheck.layout import FlatShard, global_meta, local_layout
from fsdpcheck.live import _fsdp1_state


@st.composite
def runs(draw: Any) -> tuple[tuple[int, ...], int, int, int]:
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    numel = math.prod(shape)
    world = draw(st.integers(1, 5))
    return shape, numel, world, draw(st.integers(0, 3))  # pad: elements of padding


@given(runs(), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_runs_tile_the_tensor(r: tuple[tuple[int, ...], int, int, int], dtype: torch.dtype) -> None:
    """Any cut of the flattened tensor into runs: every element once, at its place, as views."""
    shape, numel, world, pad = r
    full = torch.arange(numel).reshape(shape).to(dtype)
    per = -(-(numel + pad) // world)
    fps, covered = 0, 0
    for k in range(world):
        start, stop = min(k * per, numel), min((k + 1) * per, numel)
        data = full.flatten()[start:stop].clone()
        lay = local_layout(FlatShard(data, shape, start))
        assert lay.error is None and lay.owner is True and not lay.replicated
        assert len(lay.pieces) <= max(1, 2 * (len(shape) - 1) + 1)
        for piece in lay.pieces:
            assert piece.box.offset is not None
            box = tuple(slice(o, o + s) for o, s in zip(piece.box.offset, piece.tensor.shape))
            assert torch.equal(piece.tensor, full[box])
            assert piece.tensor.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            covered += piece.tensor.numel()
        if lay.pieces:
            got = fingerprint_tensors(
                [p.tensor for p in lay.pieces], boxes=[p.box for p in lay.pieces]
            )
            fps = (fps + sum(got)) & MASK64
    assert covered == numel
    assert fps == fingerprint_tensor(full)


def test_meta_is_the_global_tensor() -> None:
    v = FlatShard(torch.zeros(3, dtype=torch.bfloat16), (4, 5), 7)
    assert (global_meta(v).shape, global_meta(v).dtype) == ((4, 5), "bfloat16")
    # A 0-d value (an optimizer's step) held, and not held.
    assert [p.box.shape for p in local_layout(FlatShard(torch.ones(1), (), 0)).pieces] == [()]
    assert local_layout(FlatShard(torch.ones(0), (), 0)).pieces == []


@pytest.mark.parametrize(
    ("data", "start"), [(torch.zeros(5), 16), (torch.zeros(2, 2), 0), (torch.zeros(1), -1)]
)
def test_run_outside_the_tensor_is_a_layout_error(data: torch.Tensor, start: int) -> None:
    lay = local_layout(FlatShard(data, (4, 5), start, description="FSDP1 FULL_SHARD flat shard"))
    assert lay.pieces == []
    assert lay.error is not None and lay.error.startswith("FSDP1 FULL_SHARD flat shard: ")
    assert "(4, 5)" in lay.error


# ------------------------------------------------------------------------------------------
def _info(orig: bool, shards: tuple[tuple[int, int, int] | None, ...], **kw: Any) -> FlatParamInfo:
    """A FlatParameter record of two parameters, (2, 3) then (4,), as _compat reads torch's."""
    fields: dict[str, Any] = {
        "flat": object(),
        "prefix": "",
        "fqns": ("a.weight", "a.bias"),
        "shapes": ((2, 3), (4,)),
        "shards": shards,
        "params": (object(), object()) if orig else None,
        "local_numel": 6,
        "replicas": 1,
        "replica_index": 0,
        "strategy": "FULL_SHARD",
    }
    fields.update(kw)
    return FlatParamInfo(**fields)


def _adam(n: int, first: float = 0.0) -> dict[str, torch.Tensor]:
    return {
        "step": torch.tensor(2.0),
        "exp_avg": torch.arange(first, first + n),
        "exp_avg_sq": torch.arange(first, first + n) * 10,
    }


def test_flat_parameter_state_is_cut_per_parameter() -> None:
    # Rank 1 of 2 of a 10-element flat run (+ 2 padding): a.weight's elements 5.. and a.bias.
    info = _info(False, ((0, 1, 5), (1, 4, 0)))
    st_ = _adam(6)  # the FlatParameter's local run, padding included
    w = _fsdp1_state("a.weight", st_, info, 0, {})
    b = _fsdp1_state("a.bias", st_, info, 1, {})
    assert w["step"] is st_["step"] and b["step"] is st_["step"]  # one per FlatParameter
    assert (w["exp_avg"].start, w["exp_avg"].data.tolist()) == (5, [0.0])
    assert (b["exp_avg"].start, b["exp_avg"].data.tolist()) == (0, [1.0, 2.0, 3.0, 4.0])
    assert b["exp_avg_sq"].data.data_ptr() == st_["exp_avg_sq"][1:].data_ptr()  # a view
    # A parameter this rank holds none of: its state is there, and holds nothing.
    info = _info(False, ((0, 6, 0), None))
    b = _fsdp1_state("a.bias", _adam(6), info, 1, {})
    assert local_layout(b["exp_avg"]).pieces == [] and b["exp_avg"].shape == (4,)


def test_original_parameter_state() -> None:
    info = _info(True, ((0, 2, 4), (2, 4, 0)))
    w = _fsdp1_state("a.weight", _adam(2, 100), info, 0, {})
    assert (w["exp_avg"].start, w["exp_avg"].data.tolist()) == (4, [100.0, 101.0])
    # Its step: one value per parameter, counted on the rank holding its first element.
    assert w["step"].shape == () and w["step"].owner is False
    b = _fsdp1_state("a.bias", _adam(4), info, 1, {})
    assert b["step"].owner is True and [p.box.shape for p in local_layout(b["step"]).pieces] == [()]


def test_original_parameter_held_elsewhere_names_its_siblings_state() -> None:
    info = _info(True, ((0, 6, 0), None))
    sibling = {**_adam(6), "note": "not a tensor"}
    b = _fsdp1_state("a.bias", None, info, 1, sibling)
    assert sorted(b) == ["exp_avg", "exp_avg_sq", "step"]
    assert all(local_layout(v).pieces == [] for v in b.values())
    assert b["exp_avg"].shape == (4,) and b["step"].shape == () and b["step"].owner is False
    # No state where this rank holds part of the parameter: not made up (matching names it).
    assert _fsdp1_state("a.weight", None, info, 0, sibling) == {}


def test_state_that_is_not_the_run_is_a_layout_error() -> None:
    info = _info(True, ((0, 2, 4), (2, 4, 0)))
    st_ = {"exp_avg": torch.zeros(3), "factored": torch.zeros(2, 1)}
    w = _fsdp1_state("a.weight", st_, info, 0, {})
    for name in ("exp_avg", "factored"):
        err = local_layout(w[name]).error
        assert err is not None and "a.weight holds 2 elements" in err, err


def test_hybrid_copies_count_once() -> None:
    info = _info(False, ((0, 6, 0), None), replicas=2, replica_index=1)
    w = _fsdp1_state("a.weight", _adam(6), info, 0, {})
    lay = local_layout(w["exp_avg"])
    assert lay.replicated and lay.owner is False
