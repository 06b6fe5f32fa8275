"""Benchmark of fsdpcheck.ReplicaWatch: one training step against one watch, in the same run.

On N gloo ranks (CPU by default; with --device cuda the ranks share the GPUs over gloo), a
bench model (embedding, MLP blocks, head) in the chosen layout trains with AdamW; each rank
times `--steps` training steps (forward, backward, optimizer step) and `--steps` watches
(``ReplicaWatch(model, optimizer, every=1).step()``: fingerprints of every local shard of the
model and of the optimizer state, one gather, the replica comparison). Reported: the median of
each over the steps (slowest rank), and the watch as a percentage of a step. A watch that runs
every N steps costs 1/N of that percentage on average.

Examples:
    python bench/bench_watch.py                           # HSDP 2x2 on 4 CPU ranks, 4096 tokens
    python bench/bench_watch.py --layout ddp --ranks 2
    python bench/bench_watch.py --device cuda --dim 1024 --hidden 4096 --json w.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck._spawn import spawn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, world: int, port: int, opts: dict[str, Any]) -> None:
    from fsdpcheck.testing import TinyTransformer, build
    from fsdpcheck.watch import ReplicaWatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device(opts["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    try:
        cls = functools.partial(
            TinyTransformer, vocab=opts["vocab"], dim=opts["dim"], hidden=opts["hidden"]
        )
        model, opt = build(opts["layout"], world, device=device.type, model_cls=cls)
        n_params = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(rank)
        watch = ReplicaWatch(model, opt, every=1)
        step_s, watch_s = [], []
        for i in range(opts["warmup"] + opts["steps"]):
            x = torch.randint(0, opts["vocab"], (opts["batch"], opts["seq"]), generator=g)
            x = x.to(device)
            _sync(device)
            t0 = time.perf_counter()
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            _sync(device)
            t1 = time.perf_counter()
            report = watch.step()
            _sync(device)
            t2 = time.perf_counter()
            assert report is not None and report.ok, str(report)
            if i >= opts["warmup"]:
                step_s.append(t1 - t0)
                watch_s.append(t2 - t1)
        row = {
            "rank": rank,
            "step_s": statistics.median(step_s),
            "watch_s": statistics.median(watch_s),
            "local_params": n_params,
            "keys": report.keys_checked,
        }
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            step = max(r["step_s"] for r in rows)
            watch_t = max(r["watch_s"] for r in rows)
            out = {
                "layout": opts["layout"],
                "ranks": world,
                "device": opts["device"],
                "tokens_per_rank_step": opts["batch"] * opts["seq"],
                "local_params_rank0": rows[0]["local_params"],
                "keys": rows[0]["keys"],
                "step_ms": round(step * 1e3, 2),
                "watch_ms": round(watch_t * 1e3, 2),
                "watch_pct_of_step": round(100 * watch_t / step, 2),
            }
            print(json.dumps(out, indent=1))
            if opts["json"]:
                with open(opts["json"], "w") as f:
                    json.dump(out, f, indent=1)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    """Parses the arguments and runs the ranks."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layout", default="hsdp", choices=("hsdp", "fsdp", "ddp", "2d"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default="", help="also write the result row here")
    args = p.parse_args()
    spawn(_worker, args.ranks, (vars(args),))


if __name__ == "__main__":
    main()
