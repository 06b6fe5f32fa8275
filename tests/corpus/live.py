"""What a multi-rank builder hands to the checks: the objects a user would pass to fsdpcheck."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Live:
    """One library's trained state on this rank.

    Attributes:
        model: What a user passes to ``fsdpcheck.verify`` (the library's wrapped module).
        optimizer: What a user passes as ``optimizer=`` (the library's optimizer object).
        inner: The bare sharded module (for snapshots and planting).
        keep: Objects that must stay alive (engines, accelerators, managers).
    """

    model: torch.nn.Module
    optimizer: Any
    inner: torch.nn.Module
    keep: dict[str, Any] = field(default_factory=dict)


def train_steps(
    model: torch.nn.Module,
    optimizer: Any,
    rank: int,
    steps: int = 2,
    first: int = 0,
    backward: Callable[[torch.Tensor], Any] | None = None,
) -> None:
    """`steps` optimizer steps on the rank's deterministic batches (same result on every launch).

    `first` is the first batch's step number; `backward` is the library's own backward
    (``fabric.backward``, ``accelerator.backward``) where it has one, else ``loss.backward()``.
    """
    from tests.corpus import toy_batch

    for step in range(first, first + steps):
        loss = model(toy_batch(rank, step)).float().pow(2).mean()
        if backward is None:
            loss.backward()
        else:
            backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def adamw(params: Any) -> torch.optim.Optimizer:
    """The optimizer every toy case uses (weight decay on, so a stray step changes weights)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
