"""Runs a scenario function on N gloo ranks (CPU) in fresh processes; collects JSON results."""

from __future__ import annotations

import importlib
import json
import os
import traceback
from pathlib import Path
from typing import Any

from fsdpcheck._spawn import spawn


def _worker(rank: int, world: int, port: int, target: str, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, Any]
    try:
        module, fn = target.rsplit(":", 1)
        result = getattr(importlib.import_module(module), fn)(rank, world, Path(workdir))
    except Exception:
        result = {"__crash__": traceback.format_exc()}
    Path(workdir, f"result_{rank}.json").write_text(json.dumps(result, default=str))
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(world: int, target: str, workdir: Path, timeout: float = 600) -> list[dict]:
    """Runs `module:function(rank, world, workdir) -> dict` on `world` ranks; their results."""
    workdir.mkdir(parents=True, exist_ok=True)
    codes = spawn(_worker, world, (target, str(workdir)), timeout)
    results = []
    for r in range(world):
        f = workdir / f"result_{r}.json"
        if not f.exists():
            raise RuntimeError(f"rank {r} wrote no result (exit code {codes[r]})")
        results.append(json.loads(f.read_text()))
    for r, res in enumerate(results):
        if "__crash__" in res:
            raise RuntimeError(f"rank {r} crashed:\n{res['__crash__']}")
    return results
