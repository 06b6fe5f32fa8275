"""Benchmark of fsdpcheck.verify / load / fingerprint against a bare DCP load and the
full-state-dict recipe.

On N gloo ranks (CPU by default; with --device cuda the ranks share the GPUs over gloo), one
checkpoint (written by fsdpcheck.save, so it has a manifest), one run, each rank measures:
  * dcp.load alone (into a fresh FSDP2 model and optimizer),
  * fsdpcheck.load with verify=None, "fingerprint" and "full",
  * fsdpcheck.fingerprint alone (its throughput against this rank's measured read bandwidth),
  * fsdpcheck.verify of model and optimizer against the DCP directory,
  * the recipe users follow today: gather a full state dict on every rank, offload it to the
    CPU, read the full checkpoint, and compare with a torch.allclose loop.
Reported per method: wall time (slowest rank) and peak extra resident memory (largest rank,
sampled every few ms; on CUDA also the peak of torch.cuda.max_memory_allocated above the start).

Examples:
    python bench/bench_verify.py                          # 4 CPU ranks, ~60M parameters
    python bench/bench_verify.py --ranks 4 --layers 2 --hidden 512
    python bench/bench_verify.py --device cuda --json verify.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck._spawn import spawn


def _trim() -> None:
    """Returns freed heap memory to the OS, so the next phase's growth shows in its RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak resident (and CUDA) memory above the level at entry, sampled in a thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self.cuda_peak = 0

    def __enter__(self) -> PeakMemory:
        import gc

        gc.collect()
        _trim()
        self.base = _rss()
        self.stop = False
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.cuda_base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

        def sample() -> None:
            while not self.stop:
                self.peak = max(self.peak, _rss() - self.base)
                time.sleep(0.002)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, _rss() - self.base)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.cuda_peak = torch.cuda.max_memory_allocated() - self.cuda_base


def build(args: argparse.Namespace, device: torch.device, seed: int):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    h, f = args.hidden, args.hidden * 11 // 4 + 3  # a ragged MLP width, like real models
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False), nn.LayerNorm(h)]
    model = nn.Sequential(nn.Embedding(args.vocab, h), *layers).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, args.vocab, (2, 16), device=device)
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    import fsdpcheck
    import fsdpcheck.live

    ck = Path(args.workdir) / "ckpt"
    model, opt = build(args, device, seed=0)
    fsdpcheck.save(model, ck, optimizer=opt)
    del model, opt
    fresh, fopt = build(args, device, seed=1)
    results: dict[str, Any] = {}

    def phase(name: str, fn) -> Any:
        dist.barrier()
        with PeakMemory(device) as mem:
            t0 = time.perf_counter()
            value = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        results[name] = {"s": seconds, "rss": mem.peak, "cuda": mem.cuda_peak}
        return value

    # fsdpcheck.save writes the optimizer state flattened per parameter (as torchtitan does), so
    # the bare load reads it the same way.
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def load() -> None:
        msd, osd = get_state_dict(fresh, fopt, options=flat)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(ck))
        set_state_dict(
            fresh, fopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=flat
        )

    phase("dcp.load", load)
    for mode in (None, "fingerprint", "full"):
        r = phase(
            f"fsdpcheck.load(verify={mode!r})",
            lambda mode=mode: fsdpcheck.load(fresh, ck, optimizer=fopt, verify=mode),
        )
        results.setdefault("load_ok", []).append(r.ok)
    phase("fsdpcheck.fingerprint", lambda: fsdpcheck.fingerprint(fresh, optimizer=fopt))
    local_bytes = 0
    for v in fsdpcheck.live.flat_live(fresh, fopt).values():
        t = v.to_local() if hasattr(v, "to_local") else v
        local_bytes += t.numel() * t.element_size()
    big = torch.ones(max(local_bytes // 4, 1 << 20), device=device)
    phase("read bandwidth (a sum)", lambda big=big: big.sum())
    results["local_bytes"] = local_bytes
    results["sum_bytes"] = big.numel() * 4
    del big
    report = phase(
        "fsdpcheck.verify",
        lambda: fsdpcheck.verify(fresh, ck, optimizer=fopt, memory_budget=args.budget),
    )
    results["verify_ok"] = report.ok
    results["verify_summary"] = report.summary()
    phase(
        "fsdpcheck.verify (model only)",
        lambda: fsdpcheck.verify(fresh, ck, memory_budget=args.budget),
    )

    def full_state_dict_recipe() -> bool:
        full = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
        full = {k: v.cpu() for k, v in full.items()}  # the CPU offload
        ref = {k: torch.empty_like(v) for k, v in full.items()}
        dcp.load({"model": ref}, checkpoint_id=str(ck))  # every rank reads the whole model
        return all(torch.allclose(full[k], ref[k]) for k in full)

    results["recipe_ok"] = phase("full-state-dict + allclose loop", full_state_dict_recipe)
    # DTensor.numel() is the global size.
    results["bytes"] = sum(p.numel() * p.element_size() for p in fresh.parameters())
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8003)
    p.add_argument("--budget", type=int, default=256 << 20, help="verify's memory_budget")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = tmp
        codes = spawn(rank_main, args.ranks, (args, tmp))
        # Success is every rank's result file, not exit codes: a gloo process sometimes aborts
        # in its exit handlers after finishing.
        missing = [r for r in range(args.ranks) if not Path(tmp, f"rank{r}.json").exists()]
        if missing:
            raise SystemExit(f"ranks {missing} failed (exit codes {codes})")
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    methods = [k for k, v in per_rank[0].items() if isinstance(v, dict) and "s" in v]
    base = max(r["dcp.load"]["s"] for r in per_rank)
    params_mb = per_rank[0]["bytes"] / 1e6
    print(
        f"# {args.ranks} ranks on {args.device}, model {params_mb:.0f} MB of parameters "
        f"(+ AdamW state), verify memory_budget {args.budget / 2**20:.0f} MiB"
    )
    print(f"# {per_rank[0]['verify_summary']}")
    print(
        f"{'method':34s} {'time s':>8s} {'vs load':>8s} {'peak extra RSS MB':>18s} {'cuda MB':>8s}"
    )
    table = []
    for m in methods:
        t = max(r[m]["s"] for r in per_rank)
        rss = max(r[m]["rss"] for r in per_rank) / 1e6
        cuda = max(r[m]["cuda"] for r in per_rank) / 1e6
        table.append(
            {"method": m, "seconds": t, "vs_load": t / base, "rss_mb": rss, "cuda_mb": cuda}
        )
        print(f"{m:34s} {t:8.3f} {t / base:7.2f}x {rss:18.1f} {cuda:8.1f}")
    fp_s = max(r["fsdpcheck.fingerprint"]["s"] for r in per_rank)
    gbps = per_rank[0]["local_bytes"] / fp_s / 1e9
    bw = per_rank[0]["sum_bytes"] / per_rank[0]["read bandwidth (a sum)"]["s"] / 1e9
    print(
        f"# fingerprint throughput per rank: {gbps:.2f} GB/s = {100 * gbps / bw:.0f}% of this "
        f"rank's measured read bandwidth ({bw:.2f} GB/s, a sum of the same size, same run)"
    )
    ok = all(r["verify_ok"] and r["recipe_ok"] and all(r["load_ok"]) for r in per_rank)
    print(
        f"# verdicts: verify ok={per_rank[0]['verify_ok']}, recipe ok={per_rank[0]['recipe_ok']}, "
        f"load ok={per_rank[0]['load_ok']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "table": table}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
