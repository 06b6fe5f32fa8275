"""Small models for tests and the demo: uneven (and empty) shards, every layout fsdpcheck reads."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fsdpcheck._compat import is_dtensor

# Sizes chosen so that FSDP2 splits rows unevenly: 103 rows over 4 ranks are 26, 26, 26, 25,
# over 2 ranks 52, 51, over 3 ranks 35, 35, 33.
VOCAB, DIM, HIDDEN, OUT = 103, 24, 58, 5

LAYOUTS = ("fsdp", "hsdp", "2d", "ddp", "plain")


class Block(nn.Module):
    """A pre-norm MLP block: ``h + w2(relu(w1(norm(h))))``."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return h + self.w2(torch.relu(self.w1(self.norm(h))))


class TinyTransformer(nn.Module):
    """Embedding, two MLP blocks and a head: 13 parameters, with sizes that shard unevenly.

    With ``vocab=7, dim=6, hidden=10, out=3`` FSDP2 on 4 ranks gives rows 2,2,2,1 (7 rows),
    3,3,3,1 (10 rows) and 1,1,1,0 (3 rows): uneven and empty shards in one small model.
    """

    def __init__(
        self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN, out: int = OUT
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, hidden), Block(dim, hidden)])
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        # A fresh tensor, not a view: FSDP2 warns that in-place ops on a returned view would skip
        # its pre-backward hook.
        return self.head(h).clone()


def small_model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``Linear(5, 7) -> ReLU -> Linear(7, 3)`` after one AdamW step, so its state exists.

    A single-process model for tests that need a model and an optimizer with state.
    """
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(2, 5)).sum().backward()
    opt.step()
    return m, opt


def mesh_2d(world: int) -> tuple[int, int]:
    """The (data parallel, tensor parallel) mesh shape ``build("2d", world)`` uses.

    ``2 x world/2`` for an even world size; ``world x 1`` for an odd one, because tensor
    parallelism over a size that does not divide ``HIDDEN`` (58) fails in DTensor's matmul.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, not {world}")
    return (2, world // 2) if world % 2 == 0 else (world, 1)


def build(
    layout: str,
    world: int,
    seed: int = 0,
    device: str = "cpu",
    model_cls: Callable[[], nn.Module] = TinyTransformer,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model in a parallel layout, and its AdamW (no state yet: see ``train``).

    Needs an initialised default process group for every layout except "plain".

    Args:
        layout: "fsdp" (FSDP2 on every rank), "hsdp" (FSDP2 on a ``2 x world/2`` replicate x
            shard mesh; `world` must be even), "2d" (FSDP2 x tensor parallel on ``mesh_2d(world)``,
            blocks' ``w1`` colwise and ``w2`` rowwise), "ddp" or "plain" (no wrapper).
        world: The world size.
        seed: Seeds the initial weights (the same on every rank).
        device: "cpu" or "cuda".
        model_cls: Builds the model; it must have ``blocks`` of ``Block`` (a
            ``functools.partial(TinyTransformer, ...)`` does).

    Raises:
        ValueError: An unknown layout, or "hsdp" with an odd world size.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    torch.manual_seed(seed)
    model = model_cls().to(device)
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    if layout == "fsdp":
        for b in blocks:
            fully_shard(b)
        fully_shard(model)
    elif layout == "hsdp":
        if world % 2:
            raise ValueError(f"the hsdp layout needs an even world size, not {world}")
        mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for b in blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "2d":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh(device, mesh_2d(world), mesh_dim_names=("dp", "tp"))
        for b in blocks:
            parallelize_module(b, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2, vocab: int = 7) -> None:
    """A few AdamW steps on the same data on every rank (token ids below `vocab`)."""
    g = torch.Generator().manual_seed(123)
    device = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randint(0, vocab, (4, 5), generator=g).to(device)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def local_of(obj: nn.Module | torch.Tensor, fqn: str | None = None) -> torch.Tensor:
    """This rank's local tensor: of a parameter or buffer of a model by FQN, or of a tensor.

    A DTensor gives its ``to_local()`` (a view: writing to it writes the shard); a plain tensor is
    returned as it is.

    Raises:
        KeyError: `fqn` names no parameter or buffer of the model (the message lists a few).
    """
    if isinstance(obj, nn.Module):
        if fqn is None:
            raise TypeError("local_of(model, fqn): name the parameter or buffer")
        named: dict[str, torch.Tensor] = dict(obj.named_parameters())
        named.update(obj.named_buffers())
        if fqn not in named:
            some = ", ".join(sorted(named)[:5])
            raise KeyError(f"{fqn!r} is no parameter or buffer of the model (it has {some}, ...)")
        obj = named[fqn]
    return obj.to_local() if is_dtensor(obj) else obj  # type: ignore[attr-defined]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state dict on every rank (DTensors gathered), detached copies.

    Collective when the model holds DTensors. It gathers every tensor, so it is for small test
    models only; the ``module.`` prefix DDP adds is removed.
    """
    out = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if is_dtensor(v) else v
        out[k.removeprefix("module.")] = full.detach().clone()
    return out
