"""The offline commands spread over the processes of a ``torchrun`` launch.

``torchrun --nproc-per-node N [--nnodes M ...] -m fsdpcheck compare|fingerprint|audit ...`` starts
N x M processes. Each opens the checkpoint(s) and computes the same plan from their metadata
(the tensors, cut into row blocks), reads and checks only its share of the bytes, and the shares
are combined by ``collectives.combine``: O(keys) bytes per process whatever their number. Every
process ends with the same report and exit code; rank 0 prints it. Started without torchrun
(or with one process) nothing here runs: no process group, the commands as they always were.

NOTE: [passes and rounds] A command stays ordinary single-process code: where it would read the
data it asks the session for a *pass* (`Session.run`), with a `Request` that another process can
rebuild the same work from (paths and settings) and its own prepared `Job`. Every collective is
made by every process in the same order whatever happened locally:

- A pass begins with a round: each process offers its Request, or None once its command is
  done (an agreement of the session's ``dist.runner`` call: one all-reduce of 4 words when all
  offer the same). Every
  request offered is then run by every process, in the order of the lowest rank offering it;
  a process that did not ask for it (its command failed earlier, or took another path) rebuilds
  the job from the request and takes its share all the same.
- Inside a pass, local steps that may fail (preparing, reading) are data, not exceptions:
  after each, one agreement (``dist.runner``: one all-reduce of 4 words) says whether any
  process failed, and if one did, its error becomes the pass's error on every process. The
  plan's digest travels in the first of them: processes that see different checkpoints stop
  there, never exchange rows that mean different keys.
- When its command is done, each process offers None until every process has (serving the
  passes others still ask for); then the outcomes are settled the same way: the lowest failing
  rank's error becomes every process's error, so each prints the same line and exits with the
  same code.

A collective that fails (a process died or stopped answering within the deadline:
``RankStoppedError``) ends the session: nothing more is sent.

The session is an argument (``compare_checkpoints(..., session=)``, ``checkpoint_fingerprints``,
``audit``), never a global: the command line makes one when a launcher started its process.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fsdpcheck.errors import OfflineError

if TYPE_CHECKING:
    import torch

    from fsdpcheck.collectives import Group
    from fsdpcheck.dist.comm import Comm
    from fsdpcheck.dist.runner import Call

# Nothing heavy is imported here: the command line asks `launched` before anything else.

T = TypeVar("T")

#: What torchrun sets in every process it starts (LOCAL_RANK too, used to pick a GPU).
LAUNCH_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")

#: How long a process waits in a collective for the others (the default deadline; the command
#: line's --timeout sets another).
#: NOTE: [waiting for the slowest share] A process that finished its share waits in the
#: combining all-reduce for the slowest one: shares hold equal bytes, but a host whose page
#: cache is cold, or whose filesystem is slower, reads its share at a tenth of the others'
#: speed (a 64 GB share: ~11 minutes at 100 MB/s). torch's default of 30 minutes would fail
#: such a launch; a process that died is found at once anyway (``dist.comm.Comm`` watches the
#: store), so only a hung process makes anyone wait this long.
TIMEOUT_S = 6 * 3600

#: Work items per process the plan aims at (a tensor larger than its share is cut into row
#: blocks of about share / PIECES bytes), and the smallest block cut for that.
PIECES = 8
MIN_PIECE = 4 << 20

# Passes other processes may ask for: Request.kind -> "module:function" building the Job.
_FACTORIES = {
    "compare": "fsdpcheck.comparison:serve_compare",
    "fingerprint": "fsdpcheck.fingerprints:serve_fingerprints",
}


def launched() -> bool:
    """Whether the environment names a launch of several processes (torchrun's variables).

    The variables say nothing about who set them: a process that a launched one started
    inherits them (see `started_by_launcher`).

    Raises:
        ValueError: WORLD_SIZE or RANK is set but is not an integer.
    """
    env = os.environ
    if not all(env.get(k) for k in LAUNCH_ENV):
        return False
    try:
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    except ValueError:
        raise ValueError(
            f"WORLD_SIZE={env['WORLD_SIZE']!r} and RANK={env['RANK']!r} must be integers "
            "(torchrun sets them; unset them to run in one process)"
        ) from None
    return world > 1 and 0 <= rank < world


#: Processes that start the processes of a launch (their own children join it), by what their
#: command line holds: a program's name, or the module run with ``python -m``.
LAUNCHERS = (
    "torchrun",
    "torch.distributed.run",
    "torch.distributed.launch",
    "deepspeed.launcher.launch",
    "deepspeed",
)
#: Programs that start the command they are given as a child or by exec, leaving it the same
#: process (a launcher may run the command through them: ``--no-python sh -c ...``).
WRAPPERS = frozenset(
    {"sh", "bash", "dash", "zsh", "ksh", "env", "nice", "ionice", "timeout", "stdbuf", "setsid",
     "taskset", "numactl", "chrt", "time", "nohup"}
)  # fmt: skip


def started_by_launcher() -> bool:
    """Whether a launcher started this very process (its parent, through wrapper shells).

    NOTE: [who joins a launch] in ``cli``: a process started by a launched process (a training
    rank shelling out) inherits the launch's variables but is not one of its processes. Read
    from ``/proc``: False where there is none (then only --dist joins).
    """
    pid = os.getppid()
    for _ in range(16):
        argv = _cmdline(pid)
        if not argv:
            return False
        if _is_launcher(argv):
            return True
        if os.path.basename(argv[0]) not in WRAPPERS:
            return False
        pid = _parent(pid)
        if pid <= 1:
            return False
    return False


def _is_launcher(argv: list[str]) -> bool:
    names = [os.path.basename(a) for a in argv[:4]]
    if names[0] in LAUNCHERS or (len(names) > 1 and names[1] in LAUNCHERS):
        return True  # torchrun ..., python /path/to/torchrun ...
    for i, a in enumerate(argv[1:6], start=1):
        if a == "-m" and i + 1 < len(argv) and argv[i + 1] in LAUNCHERS:
            return True  # python -m torch.distributed.run ...
    # accelerate launch: the agent runs inside the accelerate process
    return any(n == "accelerate" for n in names[:2]) and "launch" in argv[1:4]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


@contextlib.contextmanager
def session(timeout: float | None = None) -> Iterator[Session]:
    """Joins the launch's processes for the commands run inside (gloo, over TCP).

    Uses the default process group when one exists (and leaves it); otherwise creates it from
    the launcher's environment and destroys it on the way out, so that no process is torn down
    with the group's threads still running.

    Args:
        timeout: Seconds a process waits in one collective for the others before it names the
            ones that did not answer (default ``TIMEOUT_S``), and at most for the others to join.

    Raises:
        OfflineError: The processes did not all join within the deadline (one line naming the
            launcher's variables).
    """
    import torch.distributed as dist

    from fsdpcheck.dist.runner import call

    own = not dist.is_initialized()
    seconds = TIMEOUT_S if timeout is None else timeout
    if own:
        _rendezvous(seconds)
    try:
        with call("the launch", None, seconds if own else timeout) as c:
            yield Session(c)
    finally:
        if own:
            with contextlib.suppress(Exception):  # a group broken by a lost process
                dist.destroy_process_group()


#: The longest a process waits for the others to join (the rest of the deadline is the
#: collectives'): processes of one launch start within seconds of each other.
RENDEZVOUS_S = 600.0


def _rendezvous(seconds: float) -> None:
    """The default process group from the launcher's environment, or one line saying why not."""
    import torch.distributed as dist

    env = os.environ
    joining = min(seconds, RENDEZVOUS_S)
    try:
        # torch's C++ side logs every retry to the process's stderr: a page per attempt, where
        # the failure is one line (below).
        with _quiet_stderr():
            store, rank, world = next(
                dist.rendezvous("env://", timeout=datetime.timedelta(seconds=joining))
            )
        store.set_timeout(datetime.timedelta(seconds=seconds))
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=seconds),
        )
    except Exception as exc:
        said = " ".join(f"{k}={env.get(k, '')}" for k in LAUNCH_ENV)
        raise OfflineError(
            f"could not join the launch ({said}) within {joining:g} s: "
            f"{_first_line(exc)}; unset these variables to run as one process"
        ) from None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null inside (C++ writes there directly)."""
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr to quiet
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _first_line(exc: BaseException) -> str:
    from fsdpcheck.errors import shown

    text = str(exc).strip().splitlines()
    return shown(text[0][:200] if text else type(exc).__name__)


# -------------------------------------------------------------------------------------------
def share(sizes: Sequence[int], rank: int, world: int) -> range:
    """The items of `rank`: a contiguous run, the runs of all ranks holding equal bytes.

    Item i goes to the rank whose equal part of the total bytes holds the item's midpoint, so
    every process computes the same partition from the same sizes, each rank reads consecutive
    items (one region of each file, in order) and the ranks differ by at most one item's bytes.
    Without bytes (empty tensors only) items are dealt out by count.
    """
    n = len(sizes)
    if world <= 1:
        return range(n)
    total = sum(sizes)
    owners = []
    cum = 0
    for i, size in enumerate(sizes):
        owner = (2 * cum + size) * world // (2 * total) if total else i * world // n
        owners.append(min(owner, world - 1))
        cum += size
    return range(bisect.bisect_left(owners, rank), bisect.bisect_left(owners, rank + 1))


def piece_bytes(total: int, world: int, step: int) -> int:
    """Bytes per row block for a plan of `total` bytes over `world` processes.

    One process: `step` (the batch size; blocks are cut only to fit a batch). More: small
    enough that each process gets about ``PIECES`` blocks of a tensor larger than its share.
    """
    if world <= 1:
        return step
    return max(1, min(step, max(MIN_PIECE, total // (world * PIECES))))


class Job(Protocol):
    """A pass's work on one process: the plan (the same everywhere) and this process's share."""

    def digest(self) -> int:
        """A digest of the plan (equal on processes that read the same checkpoints)."""

    def sizes(self) -> Sequence[int]:
        """Bytes of each work item, in the plan's order."""

    def measure(self, items: range) -> Any:
        """Reads and checks the items given (local: no collective)."""

    def combine(self, comm: Comm, partial: Any) -> Any:
        """Every process's `measure` results combined (collective; the same on every process)."""

    def close(self) -> None:
        """Releases what the job opened."""


@dataclass(frozen=True)
class Request:
    """A pass, as another process rebuilds it: a kind of `_FACTORIES` and its arguments."""

    kind: str
    args: tuple[Any, ...]

    def prepare(self, session: Session) -> Job:
        """The job of this request on this process (opens the checkpoints)."""
        module, fn = _FACTORIES[self.kind].split(":")
        factory: Callable[..., Job] = getattr(importlib.import_module(module), fn)
        return factory(session, *self.args)


@dataclass(frozen=True)
class _Outcome:
    value: Any
    error: str | None

    def get(self) -> Any:
        if self.error is not None:
            raise OfflineError(self.error)
        return self.value


class Session:
    """This process's part in a launch: its rank and the passes it takes part in.

    Every collective goes through the ``dist.runner`` call it was made with (its deadline, its
    agreements).
    """

    def __init__(self, call: Call) -> None:
        self.call = call
        self.comm: Comm = call.comm
        self.rank, self.world = call.comm.rank, call.comm.world
        self.local_rank = int(os.environ.get("LOCAL_RANK") or 0)
        self._broken = False

    def device(self, device: str | torch.device | None) -> torch.device:
        """Where this process compares: ``cuda`` without an index is the GPU of LOCAL_RANK."""
        import torch

        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(dev)
        return dev

    def run(self, request: Request, job: Job) -> Any:
        """Runs the pass `request` on every process, `job` being this process's part of it.

        Collective (NOTE: [passes and rounds]). Returns the job's combined result, the same on
        every process.

        Raises:
            OfflineError: A process failed to prepare or read its share (the same on every
                process).
        """
        with self._collective():
            while True:
                mine = None
                groups, _ = self._round(request)
                for group in groups:
                    if group.payload is not None:
                        out = self._pass(group.payload, job if self.rank in group.ranks else None)
                        mine = out if self.rank in group.ranks else mine
                if mine is not None:
                    break
        return mine.get()

    def agreed(self, fn: Callable[[], T], describe: Callable[[BaseException], str]) -> T:
        """Runs a command's `fn`, then agrees with the other processes on how it ended.

        Collective, at the end of every command run in a session: serves the passes other
        processes still ask for, then raises on every process the error of the lowest rank
        that failed (the exception itself when every process failed the same way; else an
        OfflineError naming the ranks), or returns `fn`'s result.

        Args:
            fn: The command (it may call `run`).
            describe: An exception in one line, as the command line prints it.
        """
        error: Exception | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as exc:
            if self._broken:
                raise
            error = exc
        text = describe(error) if error is not None else None
        with self._collective():
            while True:
                groups, every = self._round(None)
                if every and len(groups) == 1 and groups[0].payload is None:
                    break  # every process is done
                for group in groups:
                    if group.payload is not None:
                        self._pass(group.payload, None)
            # An OfflineError was agreed on in a pass already: it is worded for every process.
            agreed = self._agree(text, worded=isinstance(error, OfflineError))
        if agreed is None:
            return result
        if error is not None and agreed == text:
            raise error
        raise OfflineError(agreed)

    # -- inside ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        if self._broken:
            raise OfflineError("a collective failed earlier in this launch; nothing more is sent")
        try:
            yield
        except BaseException:
            self._broken = True  # only collectives raise in here: the group is unusable
            raise

    def _round(self, payload: Request | None) -> tuple[list[Group], bool]:
        """The distinct offers of every process, and whether every process's is among them.

        Processes whose offers were past ``collectives.MAX_DISTINCT`` offer again next round.
        """
        groups, past = self.call.gather("offering passes", payload)
        return groups, not past

    def _pass(self, request: Request, job: Job | None) -> _Outcome:
        """One pass of `request` (collective); `job` is None on a process that did not ask."""
        own = job is not None
        error, word = None, 0
        try:
            if job is None:
                job = request.prepare(self)
            word = job.digest()
        except Exception as exc:  # never leave the other processes waiting below
            error = _describe(exc)
        try:
            failed = self._agree(error, word=word, what=_what(request))
            if failed is not None:
                return _Outcome(None, failed)
            assert job is not None
            partial = None
            try:
                partial = job.measure(share(job.sizes(), self.rank, self.world))
            except Exception as exc:
                error = _describe(exc)
            failed = self._agree(error)
            if failed is not None:
                return _Outcome(None, failed)
            return _Outcome(job.combine(self.comm, partial), None)
        finally:
            if not own and job is not None:
                job.close()

    def _agree(
        self,
        error: str | None,
        worded: bool = False,
        word: int | None = None,
        what: str = "the same paths",
    ) -> str | None:
        """The lowest failing rank's error on every process, or None when none failed.

        Collective (an agreement of the session's call). The error is named with the ranks it
        happened on, unless it happened on every rank or is `worded` already (an error a pass
        agreed on names them). With `word` (a pass's plan digest), processes whose plans differ
        fail too: they see different checkpoints.
        """
        from fsdpcheck.dist.runner import RankFailure

        if error is not None:
            self.call.fail("OfflineError", error, "worded" if worded else "")
        try:
            groups = self.call.exchange("agreeing on the outcome", word=word or 0)
        except RankFailure as f:
            failure = f.failure
            if failure.step == "worded" or len(failure.same) == self.world:
                return failure.message
            others = [r for r in failure.ranks if r not in failure.same]
            more = f"; other errors on {_ranks_text(others)}" if others else ""
            return f"{failure.message} (on {_ranks_text(list(failure.same))}{more})"
        if len(groups) > 1:
            return _DIFFERENT.format(what=what)
        return None


_DIFFERENT = (
    "the processes of this launch see different checkpoints at {what} (different files, or a "
    "shared filesystem not yet in sync on some hosts): every process must read the same one"
)


def _what(request: Request) -> str:
    paths = [str(a) for a in request.args if isinstance(a, (str, os.PathLike))]
    return " and ".join(paths[:2]) or "the same paths"


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(r) for r in ranks[:16])
    return f"ranks {shown}" + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def _describe(exc: BaseException) -> str:
    from fsdpcheck.report import describe_error

    return describe_error(exc)


__all__ = [
    "LAUNCHERS",
    "LAUNCH_ENV",
    "Job",
    "OfflineError",
    "Request",
    "Session",
    "launched",
    "piece_bytes",
    "session",
    "share",
    "started_by_launcher",
]
