"""Offline compare and fingerprint of many small tensors against a bare ``dcp.load``.

Per-key costs, not bandwidth: two checkpoints of ``--keys`` small tensors (fp32 and bf16, 64 to
1,024 elements each; the second differs in one element), each written as a DCP directory (one
process, ``dcp.save``) and as one safetensors file. In one process, after one warm-up round,
each row is the median of ``--reps`` rounds (a round runs every row once, files in the page
cache):

  * ``dcp.load`` of A into preallocated tensors (``no_dist=True``): what torch itself pays to
    read one checkpoint of these keys (the floor the ratios are taken against),
  * ``compare_checkpoints`` of A and B as DCP/DCP, DCP/safetensors and safetensors/safetensors,
  * ``fingerprint_checkpoint`` of A (DCP, safetensors).

Each row reports wall seconds and the process's CPU seconds (every thread): on a machine other
jobs share, CPU time moves less than wall time. ``--src DIR`` measures the fsdpcheck package in
DIR instead of the installed one (e.g. an earlier commit exported with ``git archive``, its
compiled ``_C`` module copied in), so that two versions are timed on the same data.

Examples:
    python bench/bench_offline_keys.py                 # 50,000 keys
    python bench/bench_offline_keys.py --keys 5000 --reps 3
    python bench/bench_offline_keys.py --profile compare_dcp_dcp   # cProfile of one row
    python bench/bench_offline_keys.py --keep /tmp/keys --src /tmp/old  # another version
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SHAPES = ((64,), (16, 16), (4, 8, 32), (1024,))
DTYPES = (torch.float32, torch.bfloat16)


def tensors(keys: int, planted: bool = False) -> dict[str, torch.Tensor]:
    """`keys` small tensors named like a model's; with `planted`, one element differs."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(keys):
        shape = SHAPES[i % len(SHAPES)]
        dtype = DTYPES[(i // len(SHAPES)) % len(DTYPES)]
        out[f"layers.{i // 8}.block{i % 8}.weight"] = torch.randn(shape, generator=g).to(dtype)
    if planted:
        t = out[f"layers.{keys // 16}.block{(keys // 2) % 8}.weight"]
        t.view(-1)[5] += 1.0
    return out


def build(root: Path, keys: int) -> dict[str, Path]:
    """A and B, each as a DCP directory and a safetensors file."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    paths = {}
    for name, planted in (("a", False), ("b", True)):
        sd = tensors(keys, planted)
        paths[f"{name}_dcp"] = root / f"{name}_dcp"
        paths[f"{name}_st"] = root / f"{name}.safetensors"
        if not (paths[f"{name}_dcp"] / ".metadata").exists():
            dcp.save(sd, checkpoint_id=str(paths[f"{name}_dcp"]), no_dist=True)
        if not paths[f"{name}_st"].exists():
            save_file(sd, str(paths[f"{name}_st"]))
    return paths


def rows(paths: dict[str, Path], keys: int) -> dict[str, Callable[[], Any]]:
    """The timed calls, by row name."""
    import torch.distributed.checkpoint as dcp

    from fsdpcheck.comparison import compare_checkpoints
    from fsdpcheck.fingerprints import fingerprint_checkpoint

    dest = {k: torch.empty_like(v) for k, v in tensors(keys).items()}

    def load() -> Any:
        dcp.load(dest, checkpoint_id=str(paths["a_dcp"]), no_dist=True)

    def compare(a: str, b: str) -> Callable[[], Any]:
        def run() -> Any:
            r = compare_checkpoints(paths[a], paths[b], device="cpu")
            assert [f.kind for f in r.findings] == ["value"], r.findings[:3]
            return r

        return run

    return {
        "dcp.load": load,
        "compare_dcp_dcp": compare("a_dcp", "b_dcp"),
        "compare_dcp_st": compare("a_dcp", "b_st"),
        "compare_st_st": compare("a_st", "b_st"),
        "fingerprint_dcp": lambda: fingerprint_checkpoint(paths["a_dcp"]),
        "fingerprint_st": lambda: fingerprint_checkpoint(paths["a_st"]),
    }


def measure(calls: dict[str, Callable[[], Any]], reps: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds per row; rounds interleave the rows (the first: a warm-up)."""
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in calls}
    for rnd in range(reps + 1):
        for name, fn in calls.items():
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if rnd:
                times[name].append((dt, dc))
    return {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in times.items()
    }


def use_source_tree(src: Path) -> None:
    """Imports fsdpcheck from `src` rather than from the installed (editable) package."""
    sys.meta_path[:] = [f for f in sys.meta_path if "fsdpcheck" not in type(f).__module__]
    sys.path.insert(0, os.fspath(src))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=50_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--keep", type=Path, default=None, help="build (or reuse) the data here")
    ap.add_argument("--profile", default=None, metavar="ROW", help="cProfile one row instead")
    ap.add_argument("--src", type=Path, default=None, help="time the fsdpcheck package in DIR")
    args = ap.parse_args()
    if args.src is not None:
        use_source_tree(args.src)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        paths = build(root, args.keys)
        calls = rows(paths, args.keys)
        if args.profile:
            import cProfile
            import pstats

            calls[args.profile]()  # warm
            prof = cProfile.Profile()
            prof.runcall(calls[args.profile])
            pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
            return
        med = measure(calls, args.reps)
    import fsdpcheck

    wall, cpu = med["dcp.load"]
    print(f"# {args.keys:,} keys, median of {args.reps} rounds, files in the page cache")
    print(f"# fsdpcheck from {Path(fsdpcheck.__file__).parent}")
    print(f"{'row':18s} {'wall s':>8s} {'x load':>7s} {'CPU s':>8s} {'x load':>7s}")
    for name, (w, c) in med.items():
        print(f"{name:18s} {w:8.3f} {w / wall:7.2f} {c:8.3f} {c / cpu:7.2f}")


if __name__ == "__main__":
    main()
