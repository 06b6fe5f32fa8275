"""torch's own HuggingFaceStorageWriter: per-rank safetensors shards, and their consolidation.

``dcp.save(state, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))`` on
every rank of an FSDP2 model writes ``shard-<rank + 1>-model-00001-of-00001.safetensors`` per
rank, its boxes placed by ``DCP_SHARDING_INFO`` in the header; ``enable_consolidation=True``
moves those to ``path/sharded/`` and writes full tensors plus ``model.safetensors.index.json``
to ``path``. Used by tests/dist/hf_storage/hf_storage_scenarios.py (2 gloo ranks, in the shared
spawn).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fsdpcheck.testing import TinyTransformer, build, train

# 7 embedding rows over 2 ranks are 4 + 3, 10 hidden rows 5 + 5, and the 1-row head leaves
# rank 1 an empty box (saved as a 0-row tensor at offset 1).
MODEL = functools.partial(TinyTransformer, vocab=7, dim=6, hidden=10, out=1)
KEYS = sorted(
    ["emb.weight", "head.weight", "head.bias"]
    + [f"blocks.{i}.{n}" for i in range(2) for n in
       ("norm.weight", "norm.bias", "w1.weight", "w1.bias", "w2.weight")]
)  # fmt: skip
# An element rank 1 holds (rows 4..6 of emb.weight are its box).
PLANTED = ("emb.weight", (5, 2))


def make_model(world: int) -> torch.nn.Module:
    """The FSDP2 model every rank saves (two AdamW steps, so the weights are not the init)."""
    model, opt = build("fsdp", world, model_cls=MODEL)
    train(model, opt)
    return model


def save(model: torch.nn.Module, path: Path, *, consolidate: bool = False) -> None:
    """The model's sharded state through torch's HuggingFaceStorageWriter (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    writer = HuggingFaceStorageWriter(
        str(path), save_distributed=True, enable_consolidation=consolidate
    )
    dcp.save(get_model_state_dict(model), storage_writer=writer)
