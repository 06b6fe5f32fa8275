"""The embedded demo: shards of a small model checked against their checkpoint, faults planted.

A 4-rank FSDP2-style layout (each tensor split on dim 0 as torch.chunk does it, uneven and empty
shards included) is simulated in one process: each "rank" holds its shards, and one fused
``fsdpcheck.compare`` call checks every shard of every rank against its place in the full
reference, reading the reference in place. Each scenario plants one of the failures users
report and shows it caught at its key, global index and rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fsdpcheck.box import Box
from fsdpcheck.kernels import TensorDiff, compare, fingerprint_tensor, fingerprint_tensors

WORLD = 4


def reference_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small transformer's parameters and AdamW state, sizes that do not divide by 4."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (1003, 96), "head.bias": (3,)}
    for i in range(2):
        shapes |= {
            f"layers.{i}.attn.wq": (96, 96),
            f"layers.{i}.mlp.w1": (250, 96),
            f"layers.{i}.mlp.w2": (96, 250),
            f"layers.{i}.norm.weight": (96,),
        }
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        state[name] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        state[f"optim.{name}.exp_avg"] = torch.randn(shape, generator=gen) * 1e-3
        state[f"optim.{name}.exp_avg_sq"] = torch.rand(shape, generator=gen) * 1e-6
    return state


def shard_rows(full: torch.Tensor, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of `full` on `rank` under Shard(0), as torch.chunk splits them."""
    n = full.shape[0]
    per = -(-n // WORLD)
    start = min(rank * per, n)
    return start, min(start + per, n)


@dataclass
class Shard:
    """One rank's local tensor of one key, and its box in the full tensor."""

    key: str
    rank: int
    local: torch.Tensor
    box: Box


def load(state: dict[str, torch.Tensor]) -> list[Shard]:
    """What a correct load gives: each rank's rows, copied."""
    out = []
    for key, full in state.items():
        for rank in range(WORLD):
            start, stop = shard_rows(full, rank)
            offset = (start,) + (0,) * (full.dim() - 1)
            out.append(Shard(key, rank, full[start:stop].clone(), Box(tuple(full.shape), offset)))
    return out


def find(shards: list[Shard], key: str, rank: int) -> Shard:
    """The shard of `key` held by `rank`."""
    return next(s for s in shards if s.key == key and s.rank == rank)


def verify(shards: list[Shard], state: dict[str, torch.Tensor]) -> list[tuple[Shard, TensorDiff]]:
    """Every shard of every rank against its box of the reference, in one fused call."""
    refs = []
    for s in shards:
        start = s.box.offset[0] if s.box.offset else 0
        refs.append(state[s.key][start : start + s.local.shape[0]])  # a view: read in place
    diffs = compare([s.local for s in shards], refs, boxes=[s.box for s in shards])
    return [(s, d) for s, d in zip(shards, diffs) if not d.ok]


@dataclass
class Outcome:
    """One row of the demo's table."""

    scenario: str
    expected: str
    found: str
    ok: bool
    ms: float


def describe(bad: list[tuple[Shard, TensorDiff]]) -> str:
    """The findings in one line: key, rank, count and global index of the largest difference."""
    if not bad:
        return "pass"
    parts = []
    for s, d in bad[:2]:
        parts.append(
            f"{s.key} rank {s.rank}: {d.mismatched}/{d.numel} at {d.max_abs_index}"
            + (" (all zero)" if d.zeros == d.numel else "")
        )
    more = f" (+{len(bad) - 2} more)" if len(bad) > 2 else ""
    return "; ".join(parts) + more


def scenarios() -> list[tuple[str, str, Callable[[list[Shard]], None], Callable[[list], bool]]]:
    """(name, what must be found, fault to plant, check of the findings)."""

    def nothing(shards: list[Shard]) -> None:
        del shards

    def one_element(shards: list[Shard]) -> None:
        s = find(shards, "layers.1.mlp.w1", 2)
        s.local[5, 7] += 0.5

    def swapped(shards: list[Shard]) -> None:
        a, b = find(shards, "embed.weight", 0), find(shards, "embed.weight", 1)
        a.local, b.local = b.local, a.local

    def shifted(shards: list[Shard]) -> None:
        s = find(shards, "layers.0.mlp.w2", 3)
        s.local = torch.roll(s.local, 1, dims=0)

    def zeroed(shards: list[Shard]) -> None:
        find(shards, "optim.layers.0.attn.wq.exp_avg_sq", 1).local.zero_()

    def bit_flip(shards: list[Shard]) -> None:
        s = find(shards, "layers.0.attn.wq", 0)
        bits = s.local.view(torch.int16)
        bits[3, 4] ^= 1  # the lowest mantissa bit of one bf16 value

    def only(key: str, ranks: set[int], index: tuple[int, ...] | None = None) -> Callable:
        def check(bad: list[tuple[Shard, TensorDiff]]) -> bool:
            return (
                {s.key for s, _ in bad} == {key}
                and {s.rank for s, _ in bad} == ranks
                and (index is None or bad[0][1].max_abs_index == index)
            )

        return check

    return [
        ("clean load", "pass", nothing, lambda bad: not bad),
        (
            "one element changed",
            "layers.1.mlp.w1 rank 2 at (131, 7)",
            one_element,
            only("layers.1.mlp.w1", {2}, (131, 7)),
        ),
        ("shards swapped", "embed.weight ranks 0, 1", swapped, only("embed.weight", {0, 1})),
        ("shard shifted one row", "layers.0.mlp.w2 rank 3", shifted, only("layers.0.mlp.w2", {3})),
        (
            "optimizer moment zeroed",
            "exp_avg_sq of layers.0.attn.wq rank 1",
            zeroed,
            only("optim.layers.0.attn.wq.exp_avg_sq", {1}),
        ),
        ("one bit flipped", "layers.0.attn.wq rank 0 at (3, 4)", bit_flip,
         only("layers.0.attn.wq", {0}, (3, 4))),
    ]  # fmt: skip


def run() -> list[Outcome]:
    """Every scenario on a fresh load, then the fingerprint additivity check."""
    state = reference_state()
    outcomes = []
    for name, expected, plant, check in scenarios():
        shards = load(state)
        plant(shards)
        t0 = time.perf_counter()
        bad = verify(shards, state)
        ms = (time.perf_counter() - t0) * 1e3
        outcomes.append(Outcome(name, expected, describe(bad), check(bad), ms))
    # Layout independence: the shards' fingerprints add up to the full tensor's.
    shards = load(state)
    t0 = time.perf_counter()
    parts = fingerprint_tensors([s.local for s in shards], boxes=[s.box for s in shards])
    total: dict[str, int] = {}
    for s, fp in zip(shards, parts):
        total[s.key] = (total.get(s.key, 0) + fp) % 2**64
    equal = sum(total[k] == fingerprint_tensor(v) for k, v in state.items())
    ms = (time.perf_counter() - t0) * 1e3
    outcomes.append(
        Outcome(
            "shard fingerprints add up",
            "equal to the full tensors'",
            f"{equal}/{len(state)} equal",
            equal == len(state),
            ms,
        )
    )
    return outcomes


def main() -> int:
    """Runs the demo, prints the table, returns 0 when every outcome is as expected."""
    state = reference_state()
    n_el = sum(t.numel() for t in state.values())
    print(
        f"fsdpcheck demo: {len(state)} tensors ({n_el:,} elements) sharded over {WORLD} ranks "
        "(Shard(0), uneven and empty shards); each scenario checks every shard in one fused pass."
    )
    outcomes = run()
    width = max(len(o.found) for o in outcomes)
    print(f"\n{'scenario':26s} {'expected':40s} {'found':{width}s} {'ms':>6s}  ")
    for o in outcomes:
        mark = "ok" if o.ok else "UNEXPECTED"
        print(f"{o.scenario:26s} {o.expected:40s} {o.found:{width}s} {o.ms:6.1f}  {mark}")
    failed = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes) - len(failed)}/{len(outcomes)} outcomes as expected")
    return 1 if failed else 0
