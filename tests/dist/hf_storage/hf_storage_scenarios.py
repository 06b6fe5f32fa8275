"""torch's HuggingFaceStorageWriter output checked against the live FSDP2 model (see dist_harness).

The setup saves the model three ways with torch's own writer on the two gloo ranks: per-rank
shards (``save_distributed=True``), the same after planting one element that rank 1 holds, and
consolidated (``enable_consolidation=True``: ``sharded/`` beside the full files). The tests in
tests/dist/hf_storage/test_hf_storage.py also read these folders offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fsdpcheck
from fsdpcheck.testing import build, unchanged
from tests.corpus import plant
from tests.corpus.hf_storage import MODEL, PLANTED, make_model, save
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario


@dataclass
class Base:
    model: torch.nn.Module  # FSDP2, what was saved (read-only for scenarios)


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, Base]:
    del rank, saved_by
    model = make_model(world)
    ckpts = {"clean": shared / "clean", "planted": shared / "planted"}
    save(model, ckpts["clean"])
    with plant(model, PLANTED):
        save(model, ckpts["planted"])
    ckpts["consolidated"] = shared / "consolidated"
    save(model, ckpts["consolidated"], consolidate=True)
    return ckpts, Base(model)


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.model,)


def run_world(rank: int, world: int, workdir: Path, shared: str | None = None, only=None) -> dict:
    """Entry point for dist_harness.run_ranks."""
    return REGISTRY.run(rank, world, workdir, shared, only)


def summary(r: fsdpcheck.Report) -> dict[str, Any]:
    return {
        "ok": r.ok,
        "findings": [
            (f.key, f.kind, list(f.max_abs_index) if f.max_abs_index else None, f.rank)
            for f in r.findings
        ],
        "keys": (r.keys_a, r.keys_b, r.keys_checked),
        "elements": r.elements_checked,
        "notes": r.notes,
        "text": str(r),
    }


def verified(w: World, path: Path) -> dict[str, Any]:
    with unchanged(w.base.model):
        return summary(fsdpcheck.verify(w.base.model, path))


@scenario(2)
def verify_clean(w: World) -> dict[str, Any]:
    return verified(w, w.ckpts["clean"])


@scenario(2)
def verify_planted(w: World) -> dict[str, Any]:
    return verified(w, w.ckpts["planted"])


@scenario(2)
def verify_consolidated(w: World) -> dict[str, Any]:
    return {
        "consolidated": verified(w, w.ckpts["consolidated"]),
        "sharded": verified(w, w.ckpts["consolidated"] / "sharded"),
    }


@scenario(2)
def fingerprint_live(w: World) -> dict[str, str]:
    with unchanged(w.base.model):
        return {k: f"{v:016x}" for k, v in fsdpcheck.fingerprint(w.base.model).items()}


@scenario(2)
def load_into_fresh_model(w: World) -> dict[str, Any]:
    """fsdpcheck.load reads the shards into another FSDP2 model (each rank keeps its part)."""
    fresh, _ = build("fsdp", w.size, seed=5, model_cls=MODEL)
    before = summary(fsdpcheck.verify(fresh, w.ckpts["clean"]))
    loaded = summary(fsdpcheck.load(fresh, w.ckpts["clean"]))
    return {"before_ok": before["ok"], "loaded": loaded}


@scenario(2)
def last_rank_file_missing(w: World) -> dict[str, Any]:
    """Without rank 1's file the extents shrink (no global shape is stored): shape findings."""
    path = w.copy("clean")
    if w.rank == 0:
        (path / "shard-00002-model-00001-of-00001.safetensors").unlink()
    w.barrier()
    return verified(w, path)
