"""The fsdpcheck command line.

Examples:
    fsdpcheck demo                          # the embedded demo (4 CPU ranks): every fault caught
    fsdpcheck inspect ckpt/ --show-mapping  # layout, how keys map, shapes, chunks, coverage
    fsdpcheck compare ckpt/ model.safetensors --rtol 1e-3   # a conversion against its source
    fsdpcheck compare step-10/ hf/ --ignore 'optim.*'       # training checkpoint vs model only
    fsdpcheck compare step-10/ hf/ --ignore 'optim.*' --convert mypkg.conv:to_hf  # a conversion
    fsdpcheck fingerprint ckpt/ --json      # Fingerprint v1 of every tensor, offline
    fsdpcheck audit ckpt/ --deep            # chunks tile every tensor, files whole, manifest
    python -m fsdpcheck audit ckpt/         # the same, without the console script

Across processes: torchrun --nproc-per-node 8 -m fsdpcheck compare|fingerprint|audit ... splits
the reading over the processes (on every node of --nnodes); rank 0 prints the report, every
process exits with the same code. A process joins a launch only when a launcher (torchrun,
torch.distributed.launch, accelerate launch, deepspeed) started it, or with --dist; one started
by a training job's own code (which inherits RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) runs
alone and says so on stderr.

Exit codes: 0 all good, 1 a mismatch or finding, 2 bad usage or unreadable input. Errors are
one line on stderr (--debug adds the traceback; the exit code stays the same); with --json,
stdout is valid JSON in every case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from fsdpcheck.errors import shown
from fsdpcheck.report import render

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
#: Commands that split their reading over the processes of a torchrun launch.
SPREAD = ("compare", "fingerprint", "audit")
T = TypeVar("T")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # bad usage: one line, exit 2
        self.print_usage(sys.stderr)
        print(f"fsdpcheck: error: {shown(message)}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def run() -> NoReturn:
    """The ``fsdpcheck`` console script and ``python -m fsdpcheck``: `main` in its own process."""
    code = main(own_process=True)
    if not _teardown_needed:
        # The interpreter's teardown after importing torch (finalising its modules and objects)
        # costs 70-115 ms here and does nothing a finished command needs: what it printed is
        # flushed here, and its files are closed and its reader threads joined before main
        # returns. The demo exits normally (multiprocessing's exit handlers tidy up after the
        # ranks it spawned), as does any command that raised.
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):  # the reader left (`| head`): nothing more to say
            pass
        os._exit(code)
    sys.exit(code)


# Whether `run` must let the interpreter tear down normally (set by `main`).
_teardown_needed = True


def main(argv: list[str] | None = None, *, own_process: bool = False, session: Any = None) -> int:
    """Runs one fsdpcheck command.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).
        own_process: The process exists for this command (`run`): its garbage collector may be
            tuned for it.
        session: The caller's own ``offline_dist.Session`` (tests, embedding): the commands
            spread over it instead of joining a launch.

    Returns:
        The exit code: 0 all good, 1 a mismatch or finding, 2 bad usage or unreadable input.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    global _teardown_needed
    _teardown_needed = args.command == "demo"
    if own_process:
        # Importing torch makes about a million objects that live as long as the process; a
        # full collection that scans them all costs ~45 ms, as much as hashing 300 MB. Frozen,
        # collections skip them. Not in someone else's process: main() leaves their collector
        # alone.
        import gc

        import torch  # noqa: F401  (every command but --help needs it)

        gc.freeze()
    rank = 0
    args.session = session
    try:
        # Under torchrun every process runs the command and rank 0 speaks for them all.
        with (
            _launch(args) as rank,
            contextlib.redirect_stdout(None) if rank else contextlib.nullcontext(),
        ):
            return int(args.run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _quiet_stdout()  # `fsdpcheck ... | head`: the reader left; not an error
        return EXIT_OK
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        if rank and not _lost_rank(exc):
            return EXIT_USAGE  # rank 0 says it (if it is the one that was lost, everyone does)
        if getattr(args, "debug", False):
            traceback.print_exc()
        message = _one_line(exc)
        print(f"fsdpcheck {args.command}: {message}", file=sys.stderr)
        if getattr(args, "json", False) and not rank:
            print(json.dumps({"ok": False, "error": message, "exit_code": EXIT_USAGE}))
        return EXIT_USAGE


@contextlib.contextmanager
def _launch(args: argparse.Namespace) -> Iterator[int]:
    """This process's rank: in a session of the launch when a launcher started it (`SPREAD`).

    NOTE: [who joins a launch] A command run by a training job's own code (a callback, a script
    that shells out) inherits RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the rank that
    ran it; joining on them would wait for a rendezvous that never comes, or join the job's own
    store. So a process joins only when a launcher started it (``offline_dist.started_by_launcher``:
    its parent, through shells, is torchrun's agent) or when asked (--dist); otherwise it runs
    alone, with a note on stderr. Joining has a deadline, and its failure is one line naming the
    variables.
    """
    from fsdpcheck import offline_dist

    command = args.command
    if args.session is not None:  # a caller's own session (tests, embedding)
        yield args.session.rank
        return
    asked = getattr(args, "dist", False)
    if not offline_dist.launched():
        if asked:
            missing = [k for k in offline_dist.LAUNCH_ENV if not os.environ.get(k)]
            raise ValueError(
                f"--dist: {', '.join(missing) or 'WORLD_SIZE > 1'} not set; start the command "
                "with a launcher (torchrun --nproc-per-node N -m fsdpcheck ...)"
            )
        yield 0
    elif not asked and not offline_dist.started_by_launcher():
        if command in SPREAD:
            said = ", ".join(f"{k}={os.environ.get(k)}" for k in offline_dist.LAUNCH_ENV)
            print(
                f"fsdpcheck {command}: note: launcher variables are set ({said}) but no launcher "
                "started this process (they were inherited): running as one process; pass "
                "--dist to join the launch",
                file=sys.stderr,
            )
        yield 0
    elif command in SPREAD:
        with offline_dist.session(timeout=getattr(args, "timeout", None)) as s:
            args.session = s
            yield s.rank
    else:  # the others run whole in every process; rank 0 prints
        yield int(os.environ["RANK"])


def _lost_rank(exc: BaseException) -> bool:
    """Whether `exc` says a process of the launch stopped (rank 0 may be the one)."""
    from fsdpcheck.errors import RankStoppedError

    return isinstance(exc, RankStoppedError)


def _agreed(args: argparse.Namespace, fn: Callable[[], T]) -> T:
    """`fn` (a command's work), agreed on by every process of the launch when there is one."""
    session = args.session
    return fn() if session is None else session.agreed(fn, _one_line)


def _speaker(args: argparse.Namespace) -> bool:
    """Whether this process prints (the only one, or rank 0 of a launch)."""
    return args.session is None or args.session.rank == 0


def _one_line(exc: BaseException) -> str:
    """The error in fsdpcheck's words: one line, its root cause named, nothing raw from a file."""
    from fsdpcheck.errors import describe_error

    text = describe_error(exc)
    if isinstance(exc, FileNotFoundError) and exc.filename and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    return shown(text)


def _quiet_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


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
    common.add_argument("--debug", action="store_true", help="also show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("demo", parents=[common], help="run the embedded demo")
    p.add_argument("--ranks", type=int, default=4, help="ranks to spawn (2 or more, default 4)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.set_defaults(run=_demo)

    p = sub.add_parser("inspect", parents=[common], help="what a checkpoint holds")
    p.add_argument("path")
    p.add_argument(
        "--show-mapping",
        action="store_true",
        help="list every tensor's checkpoint key, canonical name and role",
    )
    p.set_defaults(run=_inspect)

    p = sub.add_parser("compare", parents=[common], help="compare two checkpoints, any layouts")
    p.add_argument("actual")
    p.add_argument("expected")
    p.add_argument("--rtol", type=_tolerance, default=None)
    p.add_argument("--atol", type=_tolerance, default=None)
    p.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="PATTERN",
        help="exclude names or keys matching this fnmatch pattern (repeatable)",
    )
    p.add_argument(
        "--key-map",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="pair actual's names starting with OLD as expected's with NEW (repeatable; e.g. "
        "'model.=' drops a Lightning module's prefix)",
    )
    p.add_argument(
        "--no-check-dtype",
        dest="check_dtype",
        action="store_false",
        help="a dtype difference is a note, not a finding (a conversion: give --rtol/--atol)",
    )
    p.add_argument("--show-mapping", action="store_true", help="print how tensors were paired")
    _convert_option(p, "actual's layout into expected's")
    p.add_argument(
        "--device", type=_device, default=None, help="cpu or cuda (default: cuda when present)"
    )
    p.add_argument("--memory-budget", type=_size, default=1 << 30, help="bytes, e.g. 2G, 512M")
    _launch_options(p)
    p.set_defaults(run=_compare)

    p = sub.add_parser("fingerprint", parents=[common], help="Fingerprint v1 of every tensor")
    p.add_argument("path")
    p.add_argument("--ignore", action="append", default=[], metavar="PATTERN")
    p.add_argument("--memory-budget", type=_size, default=1 << 30)
    _convert_option(p, "the checkpoint's model tensors (fingerprints of the converted layout)")
    _launch_options(p)
    p.set_defaults(run=_fingerprint)

    p = sub.add_parser("audit", parents=[common], help="check a checkpoint's structure")
    p.add_argument("path")
    p.add_argument("--deep", action="store_true", help="also recompute every fingerprint")
    _launch_options(p)
    p.set_defaults(run=_audit)

    p = sub.add_parser("info", parents=[common], help="which backends were compiled")
    p.set_defaults(run=_info)
    return parser


def _launch_options(p: argparse.ArgumentParser) -> None:
    """Joining a launch (NOTE: [who joins a launch])."""
    p.add_argument(
        "--dist",
        action="store_true",
        help="join the launch named by RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT even if no "
        "launcher started this process (by default only a launcher's own processes join)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="under a launch: how long a process waits for the others, to join (at most 600 s) "
        "and in each collective, before it names the ones that did not answer (default 6 h)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a number of seconds > 0: {text!r}")
    return value


def _convert_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--convert",
        default=None,
        metavar="MODULE:ATTR|SPEC.json",
        help=f"a conversion of {what}: a function F(state_dict) -> state_dict or an adapter "
        "with to_hf/from_hf named as module:attr (importable from here), or a JSON spec file",
    )


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r} (e.g. 1G, 512M)")
    return int(value)


def _device(text: str) -> str:
    # A meta tensor has a shape and a dtype but no values: comparing on it would report
    # whatever the empty reads give, not what the files hold.
    if text.strip().lower().split(":")[0] == "meta":
        raise argparse.ArgumentTypeError(
            "meta tensors hold no values, so nothing can be compared on them; use cpu or cuda"
        )
    return text


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"not a tolerance >= 0: {text!r}")
    return value


def _emit_report(args: argparse.Namespace, report: Any) -> int:
    if args.json:
        print(report.to_json(indent=1))
    else:
        lines = report.lines()
        if getattr(args, "show_mapping", False) and report.mapping:
            lines += ["mapping:", *report.mapping_lines()]
        _say(lines)
    return EXIT_OK if report.ok else EXIT_FINDINGS


def _say(lines: list[str], file: Any = None) -> None:
    """Prints human output: every line through `render` (keys and paths from files escaped)."""
    if lines:
        print(render(lines), file=file if file is not None else sys.stdout)


# -------------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    from fsdpcheck import demo

    return demo.main(args.ranks, args.device)


def _info(args: argparse.Namespace) -> int:
    from fsdpcheck.kernels import build_info

    print(json.dumps(build_info(), indent=2))
    return EXIT_OK


def _audit(args: argparse.Namespace) -> int:
    from fsdpcheck.auditing import audit

    return _emit_report(
        args, _agreed(args, lambda: audit(args.path, deep=args.deep, session=args.session))
    )


def _fingerprint(args: argparse.Namespace) -> int:
    from fsdpcheck.fingerprints import checkpoint_fingerprints

    fps, notes = _agreed(
        args,
        lambda: checkpoint_fingerprints(
            args.path,
            ignore=args.ignore,
            memory_budget=args.memory_budget,
            convert=args.convert,
            session=args.session,
        ),
    )
    if args.json:
        print(json.dumps({k: f"{v:#018x}" for k, v in fps.items()}, indent=1))
    else:
        names = [shown(k) for k in fps]
        width = max((len(n) for n in names), default=0)
        _say([f"{n:{width}s}  {v:#018x}" for n, v in zip(names, fps.values())])
    if _speaker(args):
        _say([f"note: {n}" for n in notes], file=sys.stderr)
    return EXIT_OK


def _compare(args: argparse.Namespace) -> int:
    from fsdpcheck.comparison import compare_checkpoints

    bar = sys.stderr.isatty() and not args.json and _speaker(args)
    from fsdpcheck.matching import prefix_rules

    report = _agreed(
        args,
        lambda: compare_checkpoints(
            args.actual,
            args.expected,
            rtol=args.rtol,
            atol=args.atol,
            check_dtype=args.check_dtype,
            key_map=prefix_rules(args.key_map) if args.key_map else None,
            ignore=args.ignore,
            device=args.device,
            memory_budget=args.memory_budget,
            progress=_progress_bar() if bar else None,
            convert=args.convert,
            session=args.session,
        ),
    )
    if bar:
        print(file=sys.stderr)
    return _emit_report(args, report)


def _progress_bar() -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        pct = 100.0 * done / total if total else 100.0
        bar = "#" * int(pct / 4)
        print(
            f"\r  [{bar:25s}] {pct:5.1f}%  {done / 1e9:.2f} / {total / 1e9:.2f} GB",
            end="",
            file=sys.stderr,
            flush=True,
        )

    return show


def _inspect(args: argparse.Namespace) -> int:
    from fsdpcheck.inspection import inspecting

    # The tensors are printed as they are made (NOTE: [inspect memory] in inspection.py).
    with inspecting(args.path) as (info, tensors, count):
        # Problems (a file missing, a tensor past its file's end) are findings: exit 1, as audit.
        code = EXIT_FINDINGS if info["problems"] else EXIT_OK
        if args.json:
            head, tail = json.dumps(info, indent=1).split(json.dumps(info["tensors"]))
            sys.stdout.write(head + ("[" if count else "[]"))
            sep = "\n"
            for t in tensors():
                text = json.dumps(t, indent=1).replace("\n", "\n  ")
                sys.stdout.write(f"{sep}  {text}")
                sep = ",\n"
            print(("\n ]" if count else "") + tail)
            return code
        out = [f"{args.path}: {info['format']}", f"layout: {info['layout']} ({info['kind']})"]
        m = info["manifest"]
        if m:
            out.append(
                f"  manifest: format v{m['format_version']}, saved on {m['world_size']} rank(s), "
                f"torch {m['torch']}, fsdpcheck {m['fsdpcheck']}"
            )
        else:
            out.append("  manifest: none (not saved with fsdpcheck.save)")
        ids = " (keyed by integer ids)" if info["optimizer_ids"] else ""
        out.append(
            f"  {count} tensors, {info['elements']:,} elements, "
            f"{info['bytes'] / 1e6:,.1f} MB: {info['model_tensors']} model tensor(s), optimizer "
            f"state for {info['optimizer_params']} parameter(s){ids} "
            f"({info['optimizer_tensors']} tensors), {info['param_groups']} param group(s)"
        )
        if info["other"]:
            other = ", ".join(info["other"][:8]) + (", ..." if len(info["other"]) > 8 else "")
            out.append(
                f"  {len(info['other'])} training-state entries (not model/optimizer): {other}"
            )
        out += [f"  note: {n}" for n in info["notes"]]
        out += [f"  [{p['kind']}] {p['key']}: {p['message']}" for p in info["problems"]]
        width = max((len(shown(t["key"])) for t in tensors()), default=3)
        if args.show_mapping:
            out.append(f"  {'checkpoint key':{width}s}  {'role':6s}  name")
            line = lambda t: f"  {shown(t['key']):{width}s}  {t['role']:6s}  {t['name']}"  # noqa: E731
        else:
            out.append(
                f"  {'key':{width}s}  {'shape':>18s}  {'dtype':9s}  {'chunks':>6s}  coverage"
            )
            line = lambda t: (  # noqa: E731
                f"  {shown(t['key']):{width}s}  {tuple(t['shape'])!s:>18s}  {t['dtype']:9s}  "
                f"{t['chunks']:6d}  {t['coverage']}"
            )
        for t in tensors():
            out.append(line(t))
            if len(out) >= 4096:
                _say(out)
                out = []
        _say(out)
    return code


if __name__ == "__main__":
    sys.exit(main())
