"""Fingerprint v1's hash per core beside the hashing tools people know, on the same bytes.

One file of bfloat16 values (``--size``, default 1 GiB) in the page cache. Timed:

  * in this process, on one thread: ``fsdpcheck.fingerprint_tensor`` of the file's bytes viewed
    as bfloat16, float32, uint8 (1-byte elements) and float64 (the kernel alone: the bytes are
    in memory, read from the file once before);
  * as commands, each on the file: ``cat`` (to /dev/null), ``cmp`` (against a copy),
    ``xxh128sum``, ``b3sum --num-threads 1`` and ``b3sum``, ``sha256sum``. Start-up is taken out:
    each tool is also run on an empty file, and that time is subtracted.

Per row: wall time and CPU time (this process's, or the child's from getrusage), and GB/s per
core (bytes / CPU seconds), best of ``--reps``; the ratio of xxh128sum's per-core rate to each.
CPU time, not wall time, is what stays comparable on a machine others are using. The processor
is named in the table. The tools come from Debian packages (``xxhash``, ``b3sum``); a missing one
is reported as missing. Nothing here is asserted.

Examples:
    python bench/bench_hash.py
    python bench/bench_hash.py --size 256M --reps 3 --json hash.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import fsdpcheck

TOOLS = [
    ("cat", ["cat", "{f}"]),
    ("cmp", ["cmp", "{f}", "{copy}"]),
    ("xxh128sum", ["xxh128sum", "{f}"]),
    ("b3sum --num-threads 1", ["b3sum", "--num-threads", "1", "{f}"]),
    ("b3sum", ["b3sum", "{f}"]),
    ("sha256sum", ["sha256sum", "{f}"]),
]


def processor() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                name = line.split(":", 1)[1].strip()
                return f"{name}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.uname().machine}, {os.cpu_count()} cores"


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(float(t))


def child_run(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of cmd, its output discarded."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return min(w for w, _ in runs), min(c for _, c in runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", type=_size, default=1 << 30, help="bytes (1G)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp, "data.bin")
        copy = Path(tmp, "copy.bin")
        empty = Path(tmp, "empty.bin")
        empty.touch()
        gen = torch.Generator().manual_seed(0)
        data = torch.randn(args.size // 2, generator=gen).to(torch.bfloat16).view(torch.uint8)
        data.numpy().tofile(f)
        shutil.copyfile(f, copy)
        del data
        # In process: the bytes in memory (read once), one thread.
        raw = torch.from_file(str(f), shared=False, size=args.size, dtype=torch.uint8)
        for name, dtype in (
            ("bfloat16", torch.bfloat16),
            ("float32", torch.float32),
            ("uint8", torch.uint8),
            ("float64", torch.float64),
        ):
            t = raw.view(dtype)
            fsdpcheck.fingerprint_tensor(t)
            runs = []
            for _ in range(args.reps):
                w0, c0 = time.perf_counter(), time.process_time()
                fsdpcheck.fingerprint_tensor(t)
                runs.append((time.perf_counter() - w0, time.process_time() - c0))
            wall, cpu = best(runs)
            rows.append(
                {"what": f"fsdpcheck hash, {name} (1 thread)", "wall_s": wall, "cpu_s": cpu}
            )
        del raw
        for name, cmd in TOOLS:
            exe = shutil.which(cmd[0])
            if exe is None:
                rows.append({"what": name, "missing": True})
                continue
            full = [c.format(f=f, copy=copy) for c in cmd]
            start = [c.format(f=empty, copy=empty) for c in cmd]
            child_run(full)  # warm: the file in the page cache
            wall, cpu = best([child_run(full) for _ in range(args.reps)])
            w0, c0 = best([child_run(start) for _ in range(args.reps)])
            rows.append(
                {"what": name, "wall_s": max(wall - w0, 1e-9), "cpu_s": max(cpu - c0, 1e-9)}
            )
    for r in rows:
        if not r.get("missing"):
            r["gbps_per_core"] = args.size / r["cpu_s"] / 1e9
            r["gbps_wall"] = args.size / r["wall_s"] / 1e9
    xxh = next((r for r in rows if r["what"] == "xxh128sum" and not r.get("missing")), None)
    print(
        f"# {processor()}; {args.size / 1e9:.2f} GB in the page cache; best of {args.reps}; "
        "start-up subtracted from the commands"
    )
    print(f"{'':38s} {'wall s':>8s} {'CPU s':>8s} {'GB/s/core':>10s} {'xxh128sum / this':>17s}")
    for r in rows:
        if r.get("missing"):
            print(f"{r['what']:38s} {'(not installed)':>28s}")
            continue
        ratio = xxh["gbps_per_core"] / r["gbps_per_core"] if xxh else float("nan")
        r["xxh128sum_over_this"] = ratio
        print(
            f"{r['what']:38s} {r['wall_s']:8.3f} {r['cpu_s']:8.3f} {r['gbps_per_core']:10.2f} "
            f"{ratio:16.2f}x"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"processor": processor(), "size": args.size, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
