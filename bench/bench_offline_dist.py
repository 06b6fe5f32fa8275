"""The offline commands in one process against the same commands spread over torchrun processes.

Builds (or reuses, with ``--keep``) a checkpoint of about ``--size`` bytes: bf16 tensors, a few
large (so that one tensor is cut over the processes) and some small, saved by
``fsdpcheck.save`` in one process (a DCP directory with a manifest) and as one safetensors file.
Then, with the files in the page cache (read once first), times as whole processes:

  * ``python -m fsdpcheck fingerprint DCP``, ``audit --deep DCP``, ``compare DCP SAFETENSORS``,
  * the same under ``torchrun --standalone --nproc-per-node N -m fsdpcheck ...`` (the launcher's
    start included),

each the median of ``--reps`` rounds (a round runs every row once). Also checked: each launch
printed the one-process output (the reports' timing aside) and exited with its code.

Examples:
    python bench/bench_offline_dist.py                        # 2 GB, 2 processes
    python bench/bench_offline_dist.py --size 4G --nproc 2 --keep /tmp/dist-data
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
LARGE = 6  # tensors of about size / 8 each; the rest of the bytes in 64 small ones
SMALL = 64


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(float(t))


def build(root: Path, size: int) -> dict[str, Path]:
    """DCP (fsdpcheck.save, one process) and safetensors of the same bf16 model."""
    import torch
    from safetensors.torch import save_file

    import fsdpcheck

    paths = {"dcp": root / "ckpt", "st": root / "model.safetensors"}
    if (paths["dcp"] / ".metadata").exists() and paths["st"].exists():
        return paths
    cols = 4096
    big_rows = max(1, size // 8 // (cols * 2))
    small_rows = max(1, size // 4 // SMALL // (cols * 2))
    m = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    for i in range(LARGE):
        w = torch.randn(big_rows, cols, generator=g).to(torch.bfloat16)
        m.register_parameter(f"large{i}", torch.nn.Parameter(w, requires_grad=False))
    for i in range(SMALL):
        w = torch.randn(small_rows, cols, generator=g).to(torch.bfloat16)
        m.register_parameter(f"small{i}", torch.nn.Parameter(w, requires_grad=False))
    fsdpcheck.save(m, paths["dcp"])
    save_file({k: v.detach() for k, v in m.state_dict().items()}, str(paths["st"]))
    return paths


def _files(p: Path) -> list[Path]:
    return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]


def _warm(paths: dict[str, Path]) -> int:
    """Reads every file once (into the page cache); returns the bytes."""
    total = 0
    for p in paths.values():
        for f in _files(p):
            with f.open("rb") as fh:
                while chunk := fh.read(64 << 20):
                    total += len(chunk)
    return total


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, proc.returncode, proc.stdout


def _report(text: str) -> Any:
    data = json.loads(text)
    if isinstance(data, dict):
        data.pop("seconds", None)
    return data


def measure(paths: dict[str, Path], nproc: int, reps: int) -> list[dict[str, Any]]:
    """Median wall seconds of each command, alone and under torchrun."""
    commands = {
        "fingerprint DCP": ["fingerprint", str(paths["dcp"]), "--json"],
        "audit --deep DCP": ["audit", "--deep", str(paths["dcp"]), "--json"],
        "compare DCP safetensors": ["compare", str(paths["dcp"]), str(paths["st"]), "--json"],
    }
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    launch = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(reps):
        for name, args in commands.items():
            alone = _run([PY, "-m", "fsdpcheck", *args], env)
            spread = _run([*launch, "-m", "fsdpcheck", *args], env)
            if alone[1] != 0 or spread[1] != 0 or _report(alone[2]) != _report(spread[2]):
                raise SystemExit(f"{name}: the runs differ (exit {alone[1]} and {spread[1]})")
            times.setdefault((name, "1 process"), []).append(alone[0])
            times.setdefault((name, f"torchrun x{nproc}"), []).append(spread[0])
    return [
        {"command": c, "how": h, "seconds": statistics.median(v)} for (c, h), v in times.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=_size, default=2 << 30, help="bytes of the checkpoint (2G)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="build (or reuse) the data here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        paths = build(root, args.size)
        gb = _warm(paths) / 1e9
        rows = measure(paths, args.nproc, args.reps)
    print(f"# {gb:.2f} GB in the page cache (DCP + safetensors), median of {args.reps} rounds")
    print(f"{'command':26s} {'how':14s} {'seconds':>8s}")
    for r in rows:
        print(f"{r['command']:26s} {r['how']:14s} {r['seconds']:8.2f}")


if __name__ == "__main__":
    main()
