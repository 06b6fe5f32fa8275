"""The fsdpcheck command line.

Examples:
    fsdpcheck demo                          # the embedded demo (4 CPU ranks): every fault caught
    fsdpcheck inspect ckpt/                 # format, keys, shapes, dtypes, chunks, coverage
    fsdpcheck compare ckpt/ model.safetensors --rtol 1e-3   # a conversion against its source
    fsdpcheck fingerprint ckpt/ --json      # Fingerprint v1 of every tensor, offline
    fsdpcheck audit ckpt/ --deep            # chunks tile every tensor, files whole, manifest
    python -m fsdpcheck audit ckpt/         # the same, without the console script

Exit codes: 0 all good, 1 a mismatch or finding, 2 bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # bad usage: one line, exit 2
        self.print_usage(sys.stderr)
        print(f"fsdpcheck: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fsdpcheck`` and ``python -m fsdpcheck``.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 all good, 1 a mismatch or finding, 2 bad usage or unreadable input.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"fsdpcheck: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fsdpcheck",
        description="Verify that every rank's shard of a sharded PyTorch checkpoint holds "
        "exactly the right values.",
        epilog=__doc__.split("\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("demo", parents=[common], help="run the embedded demo")
    p.add_argument("--ranks", type=int, default=4, help="ranks to spawn (even, default 4)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.set_defaults(run=_demo)

    p = sub.add_parser("inspect", parents=[common], help="what a checkpoint holds")
    p.add_argument("path")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("compare", parents=[common], help="compare two checkpoints, any formats")
    p.add_argument("actual")
    p.add_argument("expected")
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--atol", type=float, default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--memory-budget", type=_size, default=1 << 30, help="bytes, e.g. 2G, 512M")
    p.set_defaults(run=_compare)

    p = sub.add_parser("fingerprint", parents=[common], help="Fingerprint v1 of every tensor")
    p.add_argument("path")
    p.add_argument("--memory-budget", type=_size, default=1 << 30)
    p.set_defaults(run=_fingerprint)

    p = sub.add_parser("audit", parents=[common], help="check a checkpoint's structure")
    p.add_argument("path")
    p.add_argument("--deep", action="store_true", help="also recompute every fingerprint")
    p.set_defaults(run=_audit)

    p = sub.add_parser("info", parents=[common], help="which backends were compiled")
    p.set_defaults(run=_info)
    return parser


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1G, 512M)") from None


def _emit_report(args: argparse.Namespace, report: Any) -> int:
    print(report.to_json(indent=1) if args.json else str(report))
    return EXIT_OK if report.ok else EXIT_FINDINGS


# -------------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    from fsdpcheck import demo

    return demo.main(args.ranks, args.device)


def _info(args: argparse.Namespace) -> int:
    from fsdpcheck import build_info

    print(json.dumps(build_info(), indent=2))
    return EXIT_OK


def _audit(args: argparse.Namespace) -> int:
    from fsdpcheck.audit import audit

    return _emit_report(args, audit(args.path, deep=args.deep))


def _fingerprint(args: argparse.Namespace) -> int:
    from fsdpcheck.fingerprint import fingerprint_checkpoint

    fps = fingerprint_checkpoint(args.path, memory_budget=args.memory_budget)
    if args.json:
        print(json.dumps({k: f"{v:#018x}" for k, v in fps.items()}, indent=1))
    else:
        width = max((len(k) for k in fps), default=0)
        for k, v in fps.items():
            print(f"{k:{width}s}  {v:#018x}")
    return EXIT_OK


def _compare(args: argparse.Namespace) -> int:
    from fsdpcheck.ckpt_compare import compare_checkpoints

    report = compare_checkpoints(
        args.actual,
        args.expected,
        rtol=args.rtol,
        atol=args.atol,
        device=args.device,
        memory_budget=args.memory_budget,
        progress=_progress_bar() if sys.stderr.isatty() and not args.json else None,
    )
    if sys.stderr.isatty() and not args.json:
        print(file=sys.stderr)
    return _emit_report(args, report)


def _progress_bar() -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        pct = 100.0 * done / total if total else 100.0
        bar = "#" * int(pct / 4)
        print(f"\r  [{bar:25s}] {pct:5.1f}%  {done / 1e9:.2f} / {total / 1e9:.2f} GB",
              end="", file=sys.stderr, flush=True)  # fmt: skip

    return show


def _inspect(args: argparse.Namespace) -> int:
    info = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(info, indent=1))
        return EXIT_OK
    print(f"{args.path}: {info['format']}")
    m = info["manifest"]
    if m:
        print(f"  manifest: format v{m['format_version']}, saved on {m['world_size']} rank(s), "
              f"torch {m['torch']}, fsdpcheck {m['fsdpcheck']}")  # fmt: skip
    else:
        print("  manifest: none (not saved with fsdpcheck.save)")
    print(f"  {len(info['tensors'])} tensors, {info['elements']:,} elements, "
          f"{info['bytes'] / 1e6:,.1f} MB; optimizer state for {info['optimizer_params']} "
          f"parameter(s), {info['param_groups']} param group(s)")  # fmt: skip
    width = max((len(t["key"]) for t in info["tensors"]), default=3)
    print(f"  {'key':{width}s}  {'shape':>18s}  {'dtype':9s}  {'chunks':>6s}  coverage")
    for t in info["tensors"]:
        print(f"  {t['key']:{width}s}  {tuple(t['shape'])!s:>18s}  {t['dtype']:9s}  "
              f"{t['chunks']:6d}  {t['coverage']}")  # fmt: skip
    return EXIT_OK


def inspect_checkpoint(path: str) -> dict[str, Any]:
    """What a checkpoint holds: format, tensors (shape, dtype, chunks, coverage), manifest."""
    from pathlib import Path

    from fsdpcheck.audit import tiling_problems
    from fsdpcheck.checkpoint import detect_kind, read_manifest
    from fsdpcheck.keys import classify
    from fsdpcheck.sources import open_source
    from fsdpcheck.sources.dcp import is_dcp_dir

    p = Path(path)
    kind, what = detect_kind(p)
    dirs = [p] if is_dcp_dir(p) else [q for q in sorted(p.glob("*")) if is_dcp_dir(q)]
    sources = [(d.name + "/" if d != p else "", open_source(d)) for d in dirs] or [
        ("", open_source(p))
    ]
    tensors, state_params, groups = [], set(), 0
    for prefix, src in sources:
        chunks_of = getattr(src, "chunks", None)
        c = classify(src.entries())
        state_params |= {f for f, _ in c.state}
        groups += len(c.groups)
        for key, e in src.entries().items():
            if not e.is_tensor:
                continue
            chunks = chunks_of(key) if chunks_of else [((0,) * len(e.shape), e.shape)]
            nonempty = [b for b in chunks if all(s > 0 for s in b[1]) or not e.shape]
            problems = tiling_problems(e.shape, nonempty)
            n = math.prod(e.shape)
            tensors.append(
                {
                    "key": prefix + key,
                    "shape": list(e.shape),
                    "dtype": str(e.dtype).removeprefix("torch."),
                    "chunks": len(chunks),
                    "coverage": "complete" if not problems else "; ".join(problems),
                    "numel": n,
                    "bytes": n * (e.dtype.itemsize if e.dtype else 0),
                }
            )
    manifest = None
    for d in dirs:
        manifest = manifest or read_manifest(d)
    return {
        "path": str(p),
        "format": what,
        "kind": kind,
        "tensors": tensors,
        "elements": sum(t["numel"] for t in tensors),
        "bytes": sum(t["bytes"] for t in tensors),
        "optimizer_params": len(state_params),
        "param_groups": groups,
        "manifest": None
        if manifest is None
        else {k: manifest[k] for k in ("format_version", "world_size", "torch", "fsdpcheck")},
    }


if __name__ == "__main__":
    sys.exit(main())
