"""Benchmark of fsdpcheck.compare / fingerprint_tensors against what users do today.

Same data, one run: our op and the baselines, reported as time, GB/s of input read, fraction of
the read bandwidth measured in this run (a large sum), and the ratio of each baseline's time to
ours. Nothing here is asserted about speed; the numbers are for reading.

Examples:
    python bench/bench_kernels.py                       # CPU (or the GPU when there is one)
    python bench/bench_kernels.py --device cuda --json out.json
    python bench/bench_kernels.py --workloads small-4000 --reps 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

import fsdpcheck
from fsdpcheck import ops


@dataclass
class Result:
    workload: str
    method: str
    time_ms: float
    gbps: float
    frac_bw: float
    ratios: dict[str, float] = field(default_factory=dict)


def llama2_7b_shapes(scale: int) -> list[tuple[int, ...]]:
    """The 291 parameter shapes of Llama-2-7B, every dim divided by `scale`."""
    h, inter, vocab, layers = 4096 // scale, 11008 // scale, 32000 // scale, 32
    shapes: list[tuple[int, ...]] = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h, h)] * 4 + [(inter, h), (inter, h), (h, inter), (h,), (h,)]
    shapes += [(h,), (vocab, h)]
    return shapes


def make_workloads(names: list[str], device: str, scale: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    out: dict[str, list[torch.Tensor]] = {}
    for name in names:
        if name in ("llama7b-bf16", "llama7b-fp32"):
            dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
            shapes = llama2_7b_shapes(scale)
            out[name] = [_randn(s, dtype, device, gen) for s in shapes]
        elif name == "small-4000":
            out[name] = [_randn((4096,), torch.float32, device, gen) for _ in range(4000)]
        elif name == "cpu-mix":
            big = [_randn((1 << 20,), torch.float32, device, gen) for _ in range(24)]
            out[name] = big + [_randn((4096,), torch.float32, device, gen) for _ in range(1000)]
        else:
            raise SystemExit(f"unknown workload {name!r}")
    return out


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator):
    if device == "cpu":
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randn(shape, device=device, dtype=dtype)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timeit(fn: Callable[[], object], device: str, reps: int, warmup: int = 1) -> float:
    """Median wall time in ms, synchronised."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def read_bandwidth(device: str, reps: int) -> float:
    """GB/s of a large float32 sum: the ceiling for a kernel that reads its inputs once."""
    numel = (1 << 30) if device.startswith("cuda") else (1 << 27)
    x = torch.ones(numel, device=device)
    ms = timeit(lambda: x.sum(), device, reps)
    return x.numel() * 4 / ms / 1e6


# --------------------------------------------------------------------------------------------
# What users do today.
# --------------------------------------------------------------------------------------------
def allclose_loop(a: list[torch.Tensor], e: list[torch.Tensor], exact: bool) -> bool:
    kw = {"rtol": 0.0, "atol": 0.0} if exact else {}
    return all(torch.allclose(x, y, equal_nan=True, **kw) for x, y in zip(a, e))


def assert_close_loop(a: list[torch.Tensor], e: list[torch.Tensor]) -> bool:
    ok = True
    for x, y in zip(a, e):
        try:
            torch.testing.assert_close(x, y, rtol=0.0, atol=0.0, equal_nan=True)
        except AssertionError:
            ok = False
    return ok


def pytorch_report_loop(a: list[torch.Tensor], e: list[torch.Tensor]) -> list[tuple]:
    """The report fields of fsdpcheck.compare (without fingerprints), in plain PyTorch."""
    out = []
    for x, y in zip(a, e):
        xd, yd = x.double(), y.double()
        diff = (xd - yd).abs()
        mismatched = (~torch.isclose(xd, yd, rtol=0.0, atol=0.0, equal_nan=True)).sum()
        rel = diff / yd.abs()
        valid = ~(xd.isnan() | yd.isnan())
        dmax = torch.where(valid, diff, -1).max() if diff.numel() else diff.new_zeros(())
        out.append(
            (
                mismatched.item(),
                dmax.item(),
                int(torch.argmax(torch.where(valid, diff, -1))) if diff.numel() else -1,
                torch.where(valid, rel.nan_to_num(0.0), -1).max().item() if diff.numel() else 0,
                xd.isnan().sum().item(),
                yd.isnan().sum().item(),
                xd.isinf().sum().item(),
                yd.isinf().sum().item(),
            )
        )
    return out


def foreach_norm(a: list[torch.Tensor], e: list[torch.Tensor]) -> bool:
    norms = torch._foreach_norm(torch._foreach_sub(a, e))
    return bool((torch.stack(norms) == 0).all())


# --------------------------------------------------------------------------------------------
def methods_for(
    actual: list[torch.Tensor], expected: list[torch.Tensor]
) -> dict[str, Callable[[], object]]:
    """Every method timed, each a closure over the same data."""
    return {
        "fsdpcheck.compare": lambda: fsdpcheck.compare(actual, expected),
        "fsdpcheck.compare(fingerprints=False)": lambda: fsdpcheck.compare(
            actual, expected, fingerprints=False, stats=False
        ),
        "op only (fingerprints=True)": lambda: ops.compare_rows(
            actual, expected, [], [], 0.0, 0.0, True, True, False
        ).cpu(),
        "op only (fingerprints=False)": lambda: ops.compare_rows(
            actual, expected, [], [], 0.0, 0.0, True, False, False
        ).cpu(),
        "fsdpcheck.fingerprint_tensors": lambda: fsdpcheck.fingerprint_tensors(actual),
        "allclose loop (default tol)": lambda: allclose_loop(actual, expected, False),
        "allclose loop (exact)": lambda: allclose_loop(actual, expected, True),
        "pure-PyTorch report loop": lambda: pytorch_report_loop(actual, expected),
        "assert_close loop": lambda: assert_close_loop(actual, expected),
        "_foreach_sub+_foreach_norm": lambda: foreach_norm(actual, expected),
    }


def run(args: argparse.Namespace) -> list[Result]:
    device = args.device
    bw = args.bandwidth = read_bandwidth(device, args.reps)
    print(f"# device: {_device_name(device)}; measured read bandwidth {bw:.1f} GB/s", flush=True)
    results: list[Result] = []
    workloads = make_workloads(args.workloads, device, args.scale)
    for name, actual in workloads.items():
        expected = [t.clone() for t in actual]
        nbytes = sum(t.numel() * t.element_size() for t in actual) * 2
        _check_correct(actual, expected)
        methods = methods_for(actual, expected)
        times: dict[str, float] = {}
        for method, fn in methods.items():
            if method in args.skip:
                continue
            reps = (
                args.reps if not method.startswith(("pure", "assert")) else max(1, args.reps // 3)
            )
            times[method] = timeit(fn, device, reps)
            # fingerprint_tensors reads one side only.
            read = nbytes // 2 if method == "fsdpcheck.fingerprint_tensors" else nbytes
            gbps = read / times[method] / 1e6
            results.append(Result(name, method, times[method], gbps, gbps / bw))
            print(f"  {name:14s} {method:40s} {times[method]:10.2f} ms", flush=True)
        baselines = [m for m in times if not m.startswith(("fsdpcheck", "op only"))]
        for r in results:
            if r.workload == name and r.method.startswith(("fsdpcheck", "op only")):
                r.ratios = {b: times[b] / r.time_ms for b in baselines}
        del expected
    return results


def _check_correct(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """The benchmark times working code: a clean copy passes, a planted fault is found."""
    diffs = fsdpcheck.compare(actual, expected)
    assert all(d.ok for d in diffs), "clean copy reported a mismatch"
    i = len(actual) // 2
    saved = expected[i].reshape(-1)[7].clone()
    expected[i].reshape(-1)[7] += 1
    d = fsdpcheck.compare([actual[i]], [expected[i]])[0]
    expected[i].reshape(-1)[7] = saved
    assert d.mismatched == 1 and d.max_abs_index is not None, d


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def print_table(results: list[Result]) -> None:
    print()
    print(f"{'workload':14s} {'method':40s} {'ms':>9s} {'GB/s':>8s} {'of BW':>6s}  vs baselines")
    for r in results:
        ratios = ", ".join(f"{k.split(' ')[0]}{_tag(k)} {v:.1f}x" for k, v in r.ratios.items())
        print(
            f"{r.workload:14s} {r.method:40s} {r.time_ms:9.2f} {r.gbps:8.1f} "
            f"{100 * r.frac_bw:5.0f}%  {ratios}"
        )


def _tag(method: str) -> str:
    if "default" in method:
        return "(tol)"
    if "exact" in method:
        return "(exact)"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=None,
        help="llama7b-bf16 llama7b-fp32 small-4000 cpu-mix (default: all that fit the device)",
    )
    parser.add_argument(
        "--scale", type=int, default=None, help="divide Llama dims by this (CPU default 16)"
    )
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--skip", nargs="*", default=[], help="method names to skip")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    if args.workloads is None:
        args.workloads = ["llama7b-bf16", "llama7b-fp32", "small-4000", "cpu-mix"]
    if args.scale is None:
        args.scale = 1 if on_gpu else 16
    if args.reps is None:
        args.reps = 10 if on_gpu else 5
    results = run(args)
    print_table(results)
    if args.json:
        payload = {
            "device": _device_name(args.device),
            "torch": torch.__version__,
            "fsdpcheck": fsdpcheck.build_info(),
            "scale": args.scale,
            "read_bandwidth_gbps": args.bandwidth,
            "results": [asdict(r) for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
