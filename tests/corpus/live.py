"""What a multi-rank builder hands to the checks: the objects a user would pass to fsdpcheck."""

from __future__ import annotations

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


def train_steps(model: torch.nn.Module, optimizer: Any, rank: int, steps: int = 2) -> None:
    """`steps` AdamW steps on the rank's deterministic batches (same result on every launch)."""
    from tests.corpus import toy_batch

    for step in range(steps):
        loss = model(toy_batch(rank, step)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def adamw(params: Any) -> torch.optim.Optimizer:
    """The optimizer every toy case uses (weight decay on, so a stray step changes weights)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
