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

Exit codes (the verdict, and nothing else): 0 the check completed and passed; 1 a mismatch or
finding; 2 bad usage or unreadable input; 130 / 143 interrupted by SIGINT / SIGTERM. Errors are
one line on stderr (--debug adds the traceback; the exit code stays the same); with --json,
stdout is one valid JSON document in every case, usage errors and interruptions included. A
reader that leaves early (``| head``) never changes the exit code; a report that cannot be
written (a full disk, a closed stdout) turns a pass into 2 and leaves a finding 1, with one line
on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from fsdpcheck.errors import shown
from fsdpcheck.report import render

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM
#: Commands that split their reading over the processes of a torchrun launch.
SPREAD = ("compare", "fingerprint", "audit")
T = TypeVar("T")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT raises KeyboardInterrupt (so every handler of one sees both).

    Installed by `run` only (a process that exists for the command).
    """


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


class _Usage(Exception):
    """Bad usage (argparse's complaint), in one line, and the command it is about."""

    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # bad usage: one line, exit 2
        raise _Usage(f"{shown(message)} ({self.prog} --help shows the usage)", self.prog)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            raise _Usage(shown(message.strip()), self.prog)
        raise SystemExit(status)

    def print_help(self, file: Any = None) -> None:
        if _state.json and file is None:  # --help --json: the help as one JSON document
            _state.out.document({"ok": True, "help": self.format_help(), "exit_code": EXIT_OK})
            return
        super().print_help(file)


class _Stream(io.TextIOBase):
    """A command's stdout or stderr: what cannot be written is recorded, never raised.

    NOTE: [lost output] An output failure is not the verdict: a reader that left (``| head``,
    EPIPE) or a full disk (ENOSPC) must neither turn a FAILED into 0 (the old mapping of a
    closed pipe to 0) nor cut the check short with a traceback. Writes after the first failure
    are dropped; `main` decides the exit code from the verdict and what was lost.
    """

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self.stream = stream
        # Why output is lost: None (it is not), or the error (None stream: "closed").
        self.lost: BaseException | None = None if stream is not None else _Closed()

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                self.stream.write(text)
            except (OSError, ValueError) as exc:  # ValueError: the stream was closed
                self._lose(exc)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as exc:
                self._lose(exc)

    def _lose(self, exc: BaseException) -> None:
        self.lost = exc
        # Nothing more reaches the descriptor: a broken pipe or a full disk answers every
        # later write the same way, and a child process (the demo's ranks) writes there too.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    @property
    def pipe_closed(self) -> bool:
        """The reader left (EPIPE): what it did not read, it did not want."""
        return isinstance(self.lost, BrokenPipeError)

    def isatty(self) -> bool:
        try:
            return self.lost is None and bool(self.stream.isatty())
        except (OSError, ValueError, AttributeError):
            return False

    def fileno(self) -> int:
        return int(self.stream.fileno())

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.stream, "encoding", None) or "utf-8")

    def document(self, obj: Any) -> None:
        """Writes one whole JSON document (signals held until it is out, so never half)."""
        _state.json_done = True
        with _signals_held():
            self.write(json.dumps(obj, indent=1) + "\n")
            self.flush()


class _Closed(OSError):
    def __init__(self) -> None:
        super().__init__(9, "stdout is closed")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT / SIGTERM wait (pending) until the block is done: a JSON document is never cut."""
    held = {signal.SIGINT, signal.SIGTERM}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (ValueError, OSError, AttributeError):  # not the main thread, or no such call
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _State:
    """What one `main` call knows about its output (module state: one command per process)."""

    def __init__(self) -> None:
        self.json = False
        self.out: _Stream = _Stream(None)
        # A JSON document is complete on stdout (nothing more may be written there), or
        # `json_open` completes the one being streamed, given (error, exit code).
        self.json_done = False
        self.json_open: Callable[[str, int], str] | None = None
        # A process of a launch other than rank 0 (rank 0 speaks for them).
        self.quiet = False


_state = _State()


def run() -> NoReturn:
    """The ``fsdpcheck`` console script and ``python -m fsdpcheck``: `main` in its own process."""
    try:
        # SIGTERM as SIGINT: the command unwinds (the demo's ranks stopped, its files removed)
        # and exits 143. Installed first: from here on, a signal is an exit code, not a trace.
        signal.signal(signal.SIGTERM, _on_sigterm)
        _reserve_std_fds()
        code = main(own_process=True)
    except Terminated:
        code = EXIT_SIGTERM
    except KeyboardInterrupt:
        code = EXIT_SIGINT
    try:
        if not _teardown_needed:
            # The interpreter's teardown after importing torch (finalising its modules and
            # objects) costs 70-115 ms here and does nothing a finished command needs: what
            # it printed is flushed here, and its files are closed and its reader threads
            # joined before main returns. The demo exits normally (multiprocessing's exit
            # handlers tidy up after the ranks it spawned), as does any command that raised.
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    stream.flush()
            os._exit(code)
    except Terminated:
        os._exit(EXIT_SIGTERM)
    except KeyboardInterrupt:
        os._exit(EXIT_SIGINT)
    sys.exit(code)


# Whether `run` must let the interpreter tear down normally (set by `main`).
_teardown_needed = True


def _reserve_std_fds() -> None:
    """Opens /dev/null on a closed descriptor 0, 1 or 2 (``>&-``).

    Otherwise the first file the command opens takes that number, and whatever writes to
    "stdout" (a library's C code, a child process) would write into it.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            with contextlib.suppress(OSError):
                null = os.open(os.devnull, os.O_RDWR)
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)


def _wants_json(argv: list[str]) -> bool:
    """Whether the command line asks for --json (before parsing: for a usage error's output)."""
    words = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in words


def main(argv: list[str] | None = None, *, own_process: bool = False, session: Any = None) -> int:
    """Runs one fsdpcheck command.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).
        own_process: The process exists for this command (`run`): its garbage collector may be
            tuned for it.
        session: The caller's own ``offline_dist.Session`` (tests, embedding): the commands
            spread over it instead of joining a launch.

    Returns:
        The exit code: 0 all good, 1 a mismatch or finding, 2 bad usage or unreadable input (or
        a passing report that could not be written), 130 / 143 interrupted (SIGINT / SIGTERM).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    global _state
    _state = _State()
    _state.json = _wants_json(argv)
    out, err = _Stream(sys.stdout), _Stream(sys.stderr)
    _state.out = out
    command = next((a for a in argv if not a.startswith("-")), None)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):  # type: ignore[type-var]
        try:
            code = _main(argv, own_process, session)
        except KeyboardInterrupt as exc:
            code = _failed(command, exc, EXIT_SIGTERM if isinstance(exc, Terminated) else
                           EXIT_SIGINT)  # fmt: skip
        out.flush()
        return _delivered(command, code, out)


def _delivered(command: str | None, code: int, out: _Stream) -> int:
    """The exit code once the report's delivery is known (NOTE: [lost output])."""
    if out.lost is None or out.pipe_closed:
        return code  # delivered, or the reader left: the verdict stands
    if code == EXIT_OK:
        code, verdict = EXIT_USAGE, "exit 2, though the check passed"
    elif code == EXIT_FINDINGS:
        verdict = "the check found problems (exit 1)"
    else:
        verdict = f"exit {code}"
    why = getattr(out.lost, "strerror", None) or str(out.lost)
    _complain(f"fsdpcheck{' ' + command if command else ''}: the report could not be written to "
              f"stdout ({why}); {verdict}; send stdout where it can be written")  # fmt: skip
    return code


def _complain(line: str) -> None:
    """One line on stderr, if stderr can take it."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(line, file=sys.stderr, flush=True)


def _failed(command: str | None, exc: BaseException, code: int) -> int:
    """Says why the command did not finish (one line; with --json, the JSON too): `code`."""
    if _state.quiet:
        return code  # a process of a launch other than rank 0: rank 0 says it
    if isinstance(exc, KeyboardInterrupt):
        name = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        message = f"interrupted by {name} before the check finished; nothing was concluded"
    else:
        message = str(exc) if isinstance(exc, _Usage) else _one_line(exc)
    if isinstance(exc, _Usage):
        _complain(f"{exc.prog}: error: {message}")
    else:
        _complain(f"fsdpcheck{' ' + command if command else ''}: {message}")
    if _state.json and not _state.json_done:
        closing = _state.json_open
        _state.json_open = None
        if closing is not None:  # a document is being streamed: it ends with the error
            _state.json_done = True
            with _signals_held():
                _state.out.write(closing(message, code))
                _state.out.flush()
        else:
            _state.out.document({"ok": False, "error": message, "exit_code": code})
    return code


def _main(argv: list[str], own_process: bool, session: Any = None) -> int:
    parser = _build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command they were given to (argparse names the top level)
            sub = parser if args.command is None else _subparser(parser, args.command)
            sub.error(f"unrecognized arguments: {' '.join(extra)}")
    except _Usage as exc:
        return _failed(None, exc, EXIT_USAGE)
    except SystemExit as exc:  # --help (printed), or argparse's own exit
        return int(exc.code or 0) if isinstance(exc.code, int) or exc.code is None else EXIT_USAGE
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
            _state.quiet = rank != 0
            return int(args.run(args))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        if rank and not _lost_rank(exc):
            return EXIT_USAGE  # rank 0 says it (if it is the one that was lost, everyone does)
        if getattr(args, "debug", False):
            with contextlib.suppress(OSError, ValueError):
                traceback.print_exc()
        return _failed(args.command, exc, EXIT_USAGE)


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


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]  # type: ignore[no-any-return]
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
        _document(report.to_dict())
    else:
        lines = report.lines()
        if getattr(args, "show_mapping", False) and report.mapping:
            lines += ["mapping:", *report.mapping_lines()]
        _say(lines)
    return EXIT_OK if report.ok else EXIT_FINDINGS


def _document(obj: Any) -> None:
    """Prints one whole JSON document on stdout (rank 0's; see `_Stream.document`)."""
    if sys.stdout is _state.out:
        _state.out.document(obj)


def _say(lines: list[str], file: Any = None) -> None:
    """Prints human output: every line through `render` (keys and paths from files escaped)."""
    if lines:
        print(render(lines), file=file if file is not None else sys.stdout)


# -------------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    from fsdpcheck import demo

    if not args.json:
        return demo.main(args.ranks, args.device)
    summary = demo.summary(args.ranks, args.device)
    _document(summary)
    return int(summary["exit_code"])


def _info(args: argparse.Namespace) -> int:
    from fsdpcheck.kernels import build_info

    _document(build_info())
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
        _document({k: f"{v:#018x}" for k, v in fps.items()})
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
            _stream_inspect(info, tensors, count)
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
                if _state.out.lost is not None:
                    break  # the reader left (`| head`): the rest would go nowhere
        _say(out)
    return code


def _stream_inspect(
    info: dict[str, Any], tensors: Callable[[], Iterator[dict[str, Any]]], count: int
) -> None:
    """`inspect --json`: the summary, its tensors written as they are made, one document.

    Whatever stops it half way (an unreadable entry, an interruption) ends the document with
    the error (`_State.json_open`), so stdout stays one valid JSON document.
    """
    out = _state.out
    if sys.stdout is not out:
        return  # not the process that prints
    head, tail = json.dumps(info, indent=1).split(json.dumps(info["tensors"]))
    written = [0]

    def closing(error: str, exit_code: int) -> str:
        end = ("\n ]" if written[0] else "]") if count else ""
        fields = {"ok": False, "error": error, "exit_code": exit_code}
        return (
            end
            + "".join(f",\n {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items())
            + ("\n}\n")
        )

    out.write(head + ("[" if count else "[]"))
    _state.json_open = closing
    sep = "\n"
    for t in tensors():
        text = json.dumps(t, indent=1).replace("\n", "\n  ")
        out.write(f"{sep}  {text}")
        written[0] += 1
        sep = ",\n"
        if out.lost is not None:
            break
    _state.json_open = None
    _state.json_done = True
    with _signals_held():
        out.write(("\n ]" if count else "") + tail + "\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
