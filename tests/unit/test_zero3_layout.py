"""DeepSpeed ZeRO-3 partitions as boxes of the global tensor, without DeepSpeed.

A ZeRO-3 partition is a contiguous range of the row-major linear index; ``flat_range_boxes``
cuts it into boxes and ``partition_layout`` hands each box to the kernels as a view. The live
engine itself is tested on 2 ranks in tests/dist/deepspeed/test_deepspeed_dist.py.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsdpcheck
from fsdpcheck.box import Box, ravel
from fsdpcheck.kernels import MASK64, fingerprint_tensor, fingerprint_tensors
from fsdpcheck.layout import flat_range_boxes, partition_layout, zero3_problem
from tests import REPO_ROOT

ROOT = REPO_ROOT
INSTEAD = (
    "verify the consolidated weights instead (zero_to_fp32.py output, or a state dict of the "
    "parameters gathered with deepspeed.zero.GatheredParameters)"
)


def _linear_indices(shape: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...]):
    """Brute force: the row-major linear index of every element of a box, in its own order."""
    return [
        ravel(i, shape) for i in itertools.product(*(range(o, o + s) for o, s in zip(offset, size)))
    ]


@st.composite
def ranges(draw: Any) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    numel = math.prod(shape)
    start = draw(st.integers(0, numel))
    return shape, start, draw(st.integers(start, numel))


@given(ranges())
def test_flat_range_boxes_are_exactly_the_range(r: tuple[tuple[int, ...], int, int]) -> None:
    shape, start, stop = r
    boxes = flat_range_boxes(shape, start, stop)
    # In order, disjoint, nothing missing: the concatenation IS the range.
    assert [i for off, size in boxes for i in _linear_indices(shape, off, size)] == list(
        range(start, stop)
    )
    assert all(math.prod(size) > 0 and Box(shape, off).contains(size) for off, size in boxes)
    assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1)


def test_flat_range_boxes_worst_case() -> None:
    # A partial first row, whole rows, a partial last row, recursively: 2 * (3 - 1) + 1 boxes.
    assert flat_range_boxes((3, 3, 3), 1, 26) == [
        ((0, 0, 1), (1, 1, 2)),
        ((0, 1, 0), (1, 2, 3)),
        ((1, 0, 0), (1, 3, 3)),
        ((2, 0, 0), (1, 2, 3)),
        ((2, 2, 0), (1, 1, 2)),
    ]
    assert flat_range_boxes((4, 5), 5, 15) == [((1, 0), (2, 5))]  # whole rows: one box
    assert flat_range_boxes((), 0, 1) == [((), ())]
    assert flat_range_boxes((2, 0, 3), 0, 0) == []


def test_flat_range_boxes_rejects_outside() -> None:
    with pytest.raises(
        ValueError, match=r"range \[3, 7\) is not inside a tensor of shape \(2, 3\)"
    ):
        flat_range_boxes((2, 3), 3, 7)


@given(
    shape=st.lists(st.integers(0, 6), max_size=3).map(tuple),
    world=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
)
def test_partitions_tile_the_tensor(shape: tuple[int, ...], world: int, dtype: torch.dtype) -> None:
    """DeepSpeed's split: padded to a multiple of world, equal partitions, padding never read."""
    full = torch.arange(math.prod(shape)).reshape(shape).to(dtype)
    size = -(-full.numel() // world)
    flat = torch.full((size * world,), -7).to(dtype)  # the padding: must never be compared
    flat[: full.numel()] = full.flatten()
    fps, covered = 0, 0
    for k in range(world):
        part = flat[k * size : (k + 1) * size].clone()
        lay = partition_layout(shape, part, k, world)
        assert lay.error is None and not lay.replicated
        assert (lay.global_shape, lay.dtype) == (shape, dtype)
        for piece in lay.pieces:
            assert piece.box.offset is not None
            box = tuple(slice(o, o + s) for o, s in zip(piece.box.offset, piece.tensor.shape))
            assert torch.equal(piece.tensor, full[box])
            # A view of the partition, not a copy.
            assert piece.tensor.untyped_storage().data_ptr() == part.untyped_storage().data_ptr()
            covered += piece.tensor.numel()
        if lay.pieces:
            got = fingerprint_tensors(
                [p.tensor for p in lay.pieces], boxes=[p.box for p in lay.pieces]
            )
            fps = (fps + sum(got)) & MASK64
    assert covered == full.numel()
    assert fps == fingerprint_tensor(full)


def test_partition_that_does_not_tile() -> None:
    lay = partition_layout(
        (3, 4), torch.zeros(5), 1, 2, description="DeepSpeed ZeRO-3 partition 1 of 2"
    )
    assert lay.pieces == [] and lay.error == (
        "DeepSpeed ZeRO-3 partition 1 of 2: a partition of shape (5,) as number 1 of 2 does not "
        "tile the 12 elements of a tensor of shape (3, 4)"
    )
    assert partition_layout((2,), torch.zeros(2, 1), 0, 1).error is not None
    assert partition_layout((2,), torch.zeros(2), 1, 1).error is not None
    # A larger world than the partition's group: each partition has copies on other ranks.
    assert partition_layout((2,), torch.zeros(2), 0, 1, world_size=2).replicated


def _param(**attrs: Any) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty(0))
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _complete(**over: Any) -> dict[str, Any]:
    attrs = {
        "ds_tensor": torch.zeros(3),
        "ds_numel": 6,
        "ds_shape": torch.Size([2, 3]),
        "ds_process_group": None,
    }
    return {**attrs, **over}


def test_zero3_problems_name_what_to_pass_instead() -> None:
    what = "a DeepSpeed ZeRO-3 parameter"
    assert zero3_problem(_param(ds_numel=6)) == (
        f"{what} without ds_tensor, ds_shape, ds_process_group (another DeepSpeed version?): its "
        f"partition cannot be located; {INSTEAD}"
    )
    assert zero3_problem(_param(**_complete(ds_tensor=None))) == (
        f"{what} that is not partitioned (ds_tensor is None); {INSTEAD}"
    )
    quantized = torch.zeros(3, dtype=torch.int8)
    quantized.ds_quant_scale = torch.ones(1)  # type: ignore[attr-defined]
    assert zero3_problem(_param(**_complete(ds_tensor=quantized))) == (
        f"{what} whose partition is quantized (ds_quant_scale); {INSTEAD}"
    )
    swapped = torch.zeros(0)
    swapped.status = SimpleNamespace(name="NOT_AVAILABLE")  # type: ignore[attr-defined]
    assert zero3_problem(_param(**_complete(ds_tensor=swapped))) == (
        f"{what} whose partition is not in memory (NOT_AVAILABLE: NVMe?); {INSTEAD}"
    )
    assert zero3_problem(_param(**_complete(ds_numel=5))) == (
        f"{what} with ds_shape (2, 3) but ds_numel 5; {INSTEAD}"
    )
    said = torch.zeros(3)
    said.ds_numel = 4  # type: ignore[attr-defined]
    assert zero3_problem(_param(**_complete(ds_tensor=said))) == (
        f"{what} whose partition holds 3 elements but says ds_numel 4; {INSTEAD}"
    )
    assert zero3_problem(_param(**_complete())) == (
        f"{what} but torch.distributed is not initialized; {INSTEAD}"
    )


def test_zero3_layout_error_keeps_the_global_shape() -> None:
    from fsdpcheck.layout import local_layout

    lay = local_layout(_param(**_complete(ds_tensor=None)), 2)
    assert (lay.global_shape, lay.pieces, lay.description) == (
        (2, 3),
        [],
        "DeepSpeed ZeRO-3 partition",
    )
    assert (
        lay.error
        == f"a DeepSpeed ZeRO-3 parameter that is not partitioned (ds_tensor is None); {INSTEAD}"
    )


class _Zero3Like(torch.nn.Module):
    """A module whose parameters carry DeepSpeed's attributes but cannot be read here."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _param(**_complete())
        self.b = _param(ds_numel=4)


def test_unreadable_zero3_module_is_one_line() -> None:
    ref = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    r = fsdpcheck.verify(_Zero3Like(), ref)
    [f] = r.findings
    assert (f.key, f.kind) == ("*", "error")
    assert f.message.startswith(
        "a (and 1 more parameter(s)): a DeepSpeed ZeRO-3 parameter but "
        f"torch.distributed is not initialized; {INSTEAD}"
    )
    with pytest.raises(
        fsdpcheck.FingerprintError, match=r"^reading the live state failed: a \(and 1 more"
    ):
        fsdpcheck.fingerprint(_Zero3Like())


def test_zero3_module_with_optimizer_is_one_line() -> None:
    model = _Zero3Like()
    r = fsdpcheck.verify(model, {}, optimizer=torch.optim.AdamW(model.parameters()))
    assert [(f.key, f.kind) for f in r.findings] == [("*", "error")]
    assert r.findings[0].message.startswith(
        "DeepSpeed ZeRO-3 keeps the optimizer state in flat partitions that "
        "fsdpcheck does not map to parameters, so it cannot be verified: call without "
        "optimizer= to verify the model"
    )


# Runs in a fresh interpreter where `import deepspeed` fails: a one-rank gloo group, a module
# whose parameters carry DeepSpeed's attributes (one partition, as on a single rank), and a
# plain module with the same weights.
_WITHOUT_DEEPSPEED = """
import json, sys
sys.modules["deepspeed"] = None  # `import deepspeed` raises ImportError
import torch, torch.distributed as dist
import fsdpcheck

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
plain = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
zero3 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
for (name, p), q in zip(zero3.named_parameters(), plain.parameters()):
    p.ds_tensor, p.ds_numel, p.ds_shape = q.detach().flatten().clone(), q.numel(), q.shape
    p.ds_process_group = None
    p.data = torch.empty(0)  # the placeholder ZeRO-3 leaves in .data
ref = {k: v.clone() for k, v in plain.state_dict().items()}
out = {
    "plain": fsdpcheck.verify(plain, ref).summary(),
    "zero3": fsdpcheck.verify(zero3, ref).summary(),
    "same": fsdpcheck.fingerprint(zero3) == fsdpcheck.fingerprint(plain),
    "elements": fsdpcheck.verify(zero3, ref).elements_checked,
    "imported": sorted(m for m in sys.modules if m.startswith("deepspeed") and sys.modules[m]),
}
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_without_deepspeed(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_WITHOUT_DEEPSPEED), str(tmp_path / "store")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["plain"].startswith("fsdpcheck: OK: 4 keys on live, 4 on checkpoint, 4 compared")
    assert out["zero3"].startswith("fsdpcheck: OK: 4 keys on live, 4 on checkpoint, 4 compared")
    assert out["same"] and out["elements"] == 4 * 3 + 4 + 2 * 4 + 2
    assert out["imported"] == []
