"""Builds every multi-rank corpus checkpoint in one launch (each launch costs seconds here).

Usage: torchrun --nproc-per-node 2 -m tests.corpus.build_dist OUT_DIR [LIBRARY ...]

Each multi-rank builder (a module of ``tests.corpus`` whose ``CASES`` says ``dist``) runs on all
ranks; a library that is not installed, or whose save code cannot run here, becomes a Case with
``skip`` set to the reason. Rank 0 writes ``OUT_DIR/cases.json``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tests.corpus import Case, Cases, collect, resolve, write_cases


def main() -> None:
    out = Path(sys.argv[1])
    builders: dict[str, Cases] = {c.library: c for c in collect() if c.dist}
    wanted = sys.argv[2:] or list(builders)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    cases: list[Case] = []
    for lib in wanted:
        c = builders[lib]
        target, module, layout = c.target, c.requires, c.layout
        lib_dir = out / lib
        if rank == 0:
            lib_dir.mkdir(exist_ok=True)
        dist.barrier()
        try:
            __import__(module)
        except ImportError as exc:
            cases.append(Case(lib, lib, "", layout, skip=f"{module} is not installed ({exc})"))
            continue
        try:
            cases += resolve(target)(rank, world, lib_dir)
        except Exception:
            # One library failing must not hide the others; the case carries the traceback.
            cases.append(
                Case(lib, lib, "", layout, skip=f"build failed:\n{traceback.format_exc()}")
            )
        dist.barrier()
    if rank == 0:
        write_cases(out / "cases.json", cases)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
