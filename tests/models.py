"""Small models shared by the single-process tests."""

from __future__ import annotations

import torch
from torch import nn


def small_model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear(5, 7) -> ReLU -> Linear(7, 3), after one AdamW step (so its state exists)."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(2, 5)).sum().backward()
    opt.step()
    return m, opt
