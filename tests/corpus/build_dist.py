"""Builds every multi-rank corpus checkpoint in one launch (each launch costs seconds here).

Usage: torchrun --nproc-per-node 2 -m tests.corpus.build_dist OUT_DIR [LIBRARY ...]

Each library's builder runs on all ranks; a library that is not installed, or whose save code
cannot run here, becomes a Case with ``skip`` set to the reason. Rank 0 writes
``OUT_DIR/cases.json``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tests.corpus import Case, resolve, write_cases

# name -> (builder, the module a missing install shows up as, the expected layout)
BUILDERS = {
    "dcp": ("tests.corpus.dcp_plain:build", "torch", "dcp"),
    "torchtitan": ("tests.corpus.titan:build", "torchtitan", "torchtitan"),
    "lightning": ("tests.corpus.fabric:build", "lightning", "lightning"),
    "accelerate": ("tests.corpus.accel:build", "accelerate", "accelerate"),
    "deepspeed": ("tests.corpus.ds:build", "deepspeed", "deepspeed"),
    "deepspeed_universal": ("tests.corpus.ds_universal:build", "deepspeed", "deepspeed_universal"),
    "megatron": ("tests.corpus.megatron:build", "megatron.core", "megatron"),
}


def main() -> None:
    out = Path(sys.argv[1])
    wanted = sys.argv[2:] or list(BUILDERS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    cases: list[Case] = []
    for lib in wanted:
        target, module, layout = BUILDERS[lib]
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
