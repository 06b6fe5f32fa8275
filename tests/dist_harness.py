"""Runs a scenario function on N gloo ranks (CPU) in fresh processes; collects JSON results."""

from __future__ import annotations

import importlib
import json
import os
import socket
import traceback
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, target, str(workdir)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = []
    for r in range(world):
        f = workdir / f"result_{r}.json"
        if not f.exists():
            raise RuntimeError(f"rank {r} wrote no result (exit code {procs[r].exitcode})")
        results.append(json.loads(f.read_text()))
    for r, res in enumerate(results):
        if "__crash__" in res:
            raise RuntimeError(f"rank {r} crashed:\n{res['__crash__']}")
    return results
