"""One fsdpcheck call on this rank, made of steps that every rank agrees on.

NOTE: [one step runner] Every collective entry point (verify, fingerprint, save, load, the
manifest writers, the integrations, the offline session) runs inside ``call``. Between two
collectives a rank does local work that may fail (an argument check, a user's callable, a read,
a torch internal error): ``Call.local`` keeps the failure as data instead of raising, and the
rank goes on to the next agreement, ``Call.exchange``: one ``collectives.distinct`` of a tuple
(the failure or None, the arguments not yet agreed, the step's payload), which costs one
all-reduce of 4 words when every rank holds the same. When any rank failed, every rank raises
the same ``RankFailure`` there (the lowest failing rank's error, its type where ``REGISTRY``
knows it, the ranks it happened on), so nobody is left waiting in a collective the failed rank
never makes; the process group stays usable. The call's arguments (``Call.arguments``) travel in
its first agreement, as digests (``dist.arguments``): ranks that were given different ones end
there, on every rank, with one line naming the argument and the ranks. An entry point decides at
its boundary what a failure becomes: the exception (``Failure.error``, for load, save and the
writers) or a report's one finding (``Failure.finding``, for verify and the fingerprint pass).

A rank that stops answering is another matter (``comm``): nothing can be agreed with it, and
``RankStoppedError`` ends the call on every rank that still answers.

Calls on one process group must come from one thread at a time: gloo pairs the collectives of
two threads in whatever order they arrive, mixing their data or aborting the process. A call
from a second thread is refused at once (``ConcurrentCallError``, before any collective), and
the call in progress then fails at its next agreement on every rank: its partner on another
rank may be that rank's other thread. A call made inside another (``load`` checking with
``fingerprint``) on the same thread joins it: one deadline, one count of collectives.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist

from fsdpcheck.collectives import Group, digest, distinct
from fsdpcheck.dist.arguments import Argument, argument
from fsdpcheck.dist.comm import Comm
from fsdpcheck.errors import (
    REGISTRY,
    ConcurrentCallError,
    RankStoppedError,
    describe_error,
    type_name,
)
from fsdpcheck.report import Finding

__all__ = [
    "ARGUMENTS",
    "Call",
    "Failure",
    "RankFailure",
    "call",
    "checked_timeout",
    "failed_everywhere",
]

T = TypeVar("T")

#: The step that checks a call's arguments: its failures are usage errors, raised by every entry
#: point (never a report's finding), worded as the error itself.
ARGUMENTS = "checking the arguments"

_LOW = (1 << 17) - 1  # the word's failure bit and argument bits (NOTE: [what the words carry])

#: Tests: called as ``_FAULT(call, step)`` at the start of each local step (it may raise).
_FAULT: Callable[[Call, str], None] | None = None


@dataclass(frozen=True)
class Failure:
    """A failure the ranks agreed on: the same on every rank.

    Attributes:
        kind: The exception type's name (``errors.REGISTRY``; others are RuntimeError).
        text: One line: the step, the rank(s) and the error, as raised.
        message: The error alone (a report's finding says the ranks in its own fields).
        rank: The rank whose error is worded (None: every rank's).
        ranks: Every rank it happened on.
        step: The step it happened in (on the worded rank).
        same: The ranks whose error was exactly the worded one.
    """

    kind: str
    text: str
    message: str
    rank: int | None
    ranks: tuple[int, ...]
    step: str = ""
    same: tuple[int, ...] = ()

    def error(self) -> Exception:
        """The exception every rank raises (its type, its one line, `failure` set to this)."""
        err = REGISTRY.get(self.kind, RuntimeError)(self.text)
        err.failure = self  # type: ignore[attr-defined]
        return err

    def raise_(self) -> NoReturn:
        """Raises `error()`."""
        raise self.error()

    @property
    def usage(self) -> bool:
        """Whether it is about the arguments (entry points raise it, never report it)."""
        return self.step == ARGUMENTS

    def finding(self) -> Finding:
        """The failure as a report's one finding (key "*", kind "error")."""
        return Finding("*", "error", self.message, rank=self.rank, ranks=list(self.ranks))


class RankFailure(Exception):
    """Raised inside a call, identically on every rank, once the ranks agreed that it failed."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.text)
        self.failure = failure


def checked_timeout(value: Any) -> float | None:
    """A deadline in seconds: None or a positive finite number (TypeError / ValueError)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"timeout must be seconds (a number) or None, not {type(value).__name__}")
    if not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {value!r}")
    return float(value)


class Call:
    """One entry point's run on this rank (see NOTE: [one step runner]).

    Attributes:
        comm: The transport (its deadline, its count of collectives).
        entry: The entry point's name, for messages.
    """

    def __init__(self, entry: str, group: Any, timeout: Any, number: int = 0) -> None:
        self.entry = entry
        self._pending: tuple[str, str, str] | None = None
        # The calls this process made on the group so far: equal on every rank unless one
        # left a call the others were still in (NOTE: [calls in step]).
        self._args: list[Argument] = [argument("call", entry), argument(_NUMBER, number)]
        self._refused: list[str] = []
        seconds = None
        try:
            seconds = checked_timeout(timeout)
        except (TypeError, ValueError) as exc:
            self._fail(exc, ARGUMENTS)
        self.comm = Comm(group, timeout=seconds)
        self.comm.entry = entry
        self._restore: float | None = None

    # -- local work -----------------------------------------------------------------------
    def local(self, step: str, fn: Callable[[], T], default: Any = None) -> T:
        """Runs `fn` (no collective inside); a failure is kept for the next agreement.

        After a failure, later local steps are skipped (they return `default`) until the next
        `exchange` raises it on every rank.
        """
        if self._pending is not None:
            return default  # type: ignore[no-any-return]
        self.comm.step = step
        try:
            if _FAULT is not None:
                _FAULT(self, step)
            return fn()
        except BaseException as exc:
            # Failures are Exceptions, and torch's CheckpointException (a BaseException); other
            # BaseExceptions (KeyboardInterrupt, a caller's own) go through as they are.
            if isinstance(exc, (RankStoppedError, RankFailure)) or not (
                isinstance(exc, Exception) or type(exc).__name__ == "CheckpointException"
            ):
                raise
            self._fail(exc, step)
            return default  # type: ignore[no-any-return]

    def point(self, step: str) -> None:
        """Marks the start of a step whose failures the caller handles itself (tests may fault)."""
        self.comm.step = step
        if _FAULT is not None:
            _FAULT(self, step)

    def arguments(self, **named: Any) -> None:
        """Arguments every rank must pass alike: agreed by digest in the next agreement."""
        self._args += [argument(k, v) for k, v in named.items()]

    @property
    def failed(self) -> bool:
        """Whether a local step failed on this rank since the last agreement."""
        return self._pending is not None

    def fail(self, kind: str, message: str, step: str) -> None:
        """Records a failure of this rank (a type name and a message) for the next agreement."""
        if self._pending is None:
            self._pending = (kind, message, step)

    def take_failure(self) -> tuple[str, str, str]:
        """This rank's failure (type name, message, step), now agreed some other way."""
        failed, self._pending = self._pending, None
        return failed or ("RuntimeError", "failed (no error was kept)", self.comm.step)

    def _fail(self, exc: BaseException, step: str) -> None:
        if self._pending is None:
            self._pending = (type_name(exc), describe_error(exc), step)

    # -- agreements ----------------------------------------------------------------------
    def exchange(
        self,
        step: str,
        payload: Any = None,
        *,
        word: int | None = None,
        same: Any = None,
        same_what: str = "",
    ) -> list[Group]:
        """One agreement: each distinct payload once, with the ranks holding it.

        Carries this rank's failure (if a local step failed) and the arguments not yet agreed.
        One all-reduce of 4 words when every rank holds the same (`word`: the payload's
        digest, when the caller has one).

        Args:
            step: What the ranks are doing, for messages.
            payload: What to exchange (every distinct one travels once).
            word: Its digest, when the caller has one.
            same: What must be the same on every rank besides the arguments (a digest, say):
                ranks that differ end the call, `same_what` naming it.
            same_what: Says what `same` is, for that message.

        Raises:
            RankFailure: On every rank, when a rank failed, the arguments (or `same`) differ,
                or more ranks answered differently than ``collectives.MAX_DISTINCT``.
        """
        groups, past = self.gather(step, payload, word=word, same=same, same_what=same_what)
        if past:
            raise RankFailure(_failure([], past, self.comm.world))
        return groups

    def gather(
        self,
        step: str,
        payload: Any = None,
        *,
        word: int | None = None,
        same: Any = None,
        same_what: str = "",
    ) -> tuple[list[Group], list[int]]:
        """`exchange`, keeping the ranks past the cap instead of ending the call.

        Ranks past ``collectives.MAX_DISTINCT`` distinct payloads are returned (the ranks only):
        for findings, where many may differ.

        NOTE: [what the words carry] Each rank's word (the digest ``distinct`` compares) keeps
        a failure bit and 16 bits of the digest of the arguments and of `same`, so a failure, or
        an argument that differs, is seen on every rank, even past the cap.
        """
        self.comm.step = step
        if self._refused and self._pending is None:
            self._pending = ("ConcurrentCallError", _interrupted(self._refused[0]), step)
        args, self._args = tuple(self._args), []
        failed = self._pending
        self._pending = None
        agreed = (args, same)
        body = digest((failed, agreed, digest(payload) if word is None else word))
        w = (body & ~_LOW) | ((digest(agreed) & 0xFFFF) << 1) | (1 if failed else 0)
        words: list[int] = []
        groups, past = distinct(self.comm, (failed, agreed, payload), word=w, words=words)
        bad = [g for g in groups if g.payload[0] is not None]
        bad_past = [r for r in past if words[r] & 1]
        if bad or bad_past:
            raise RankFailure(_failure(bad, bad_past, self.comm.world))
        differ = _differing(groups)
        if differ is None and len({g.payload[1][1] for g in groups}) > 1:
            differ = _same_differs(groups, same_what or step)
        if differ is None and past and len({(x >> 1) & 0xFFFF for x in words}) > 1:
            differ = _differing_past(groups, past, self.comm.world)
        if differ is not None:
            raise RankFailure(differ)
        return [Group(g.ranks, g.payload[2]) for g in groups], past

    def step(
        self, step: str, fn: Callable[[], T], *, agree_on: Callable[[T], Any] | None = None
    ) -> T:
        """`fn` run locally, then one agreement (`exchange`).

        Args:
            step: What the step does, for messages ("reading the manifest of /ck").
            fn: The local work.
            agree_on: What of the result must be the same on every rank (small, picklable):
                ranks that differ end the call, named, on every rank.
        """
        value = self.local(step, fn)
        seen = self.local(step, lambda: agree_on(value)) if agree_on is not None else None
        groups = self.exchange(step, seen)
        if len(groups) > 1:
            found = "; ".join(f"{_shown(g.payload)} on {_ranks(g.ranks)}" for g in groups[:4])
            message = (
                f"the ranks found different things while {step} ({found}); every rank must "
                "see the same (a filesystem not yet in sync on some hosts?)"
            )
            raise RankFailure(
                Failure("RanksDisagreeError", message, message, None, tuple(range(self.comm.world)))
            )
        return value

    def check(self, step: str) -> None:
        """An agreement on failures alone (after local work with no result to compare)."""
        self.exchange(step)


@contextlib.contextmanager
def call(entry: str, group: Any = None, timeout: Any = None) -> Iterator[Call]:
    """This thread's call on `group` (see NOTE: [one step runner]).

    A call on a group this thread is already inside joins that call. For the call's length the
    group's timeout is the call's deadline (restored after).

    Raises:
        ConcurrentCallError: Another thread of this process is inside a call on `group`.
    """
    key = _key(group)
    me = threading.get_ident()
    with _GUARDS_LOCK:
        guard = _GUARDS.setdefault(key, _Guard())
        running = guard.call
        if running is not None and guard.thread != me:
            running._refused.append(entry)
            raise ConcurrentCallError(_refusal(entry, running.entry))
        outer = running is not None
        if not outer:
            guard.calls += 1
            guard.call = Call(entry, group, timeout, guard.calls)
            guard.thread, guard.depth = me, 0
        guard.depth += 1
    this = guard.call
    assert this is not None
    try:
        if not outer:
            this._restore = this.comm.set_group_timeout(this.comm.timeout)
        yield this
    finally:
        with _GUARDS_LOCK:
            guard.depth -= 1
            if guard.depth == 0:
                done, guard.call, guard.thread = guard.call, None, None
                if done is not None and done._restore is not None:
                    with contextlib.suppress(Exception):
                        done.comm.set_group_timeout(done._restore)


@dataclass
class _Guard:
    thread: int | None = None
    depth: int = 0
    call: Call | None = None
    calls: int = 0  # calls started on the group by this process


# NOTE: [calls in step] Every call on a group carries, in its first agreement, how many calls
# this process started on that group before it. A rank that left a call while the others were
# still in it (a bug that raised outside a step, a thread that another rank refused) would
# otherwise pair its next call's collectives with the old call's: the count differs there, and
# the call ends on every rank, naming it, instead of mixing the two calls' data.
_NUMBER = "call number"


_GUARDS: dict[Any, _Guard] = {}
_GUARDS_LOCK = threading.Lock()


def _key(group: Any) -> Any:
    if group is not None:
        return id(group)
    if dist.is_available() and dist.is_initialized():
        return id(dist.group.WORLD)
    return None


def _refusal(entry: str, running: str) -> str:
    return (
        f"{entry} refused: another thread of this process is inside {running} on the same "
        "process group, and the collectives of two calls would be paired in whatever order they "
        "arrive; call fsdpcheck from one thread at a time, or give each thread its own group="
    )


def _interrupted(other: str) -> str:
    return (
        f"another thread called {other} on this process group during this call (refused): "
        "the ranks cannot tell which thread's collectives are paired with which, so this call "
        "stops too; call fsdpcheck from one thread at a time, or give each thread its own group="
    )


def failed_everywhere(failed: tuple[str, str, str], world: int) -> Failure:
    """The agreed failure when every rank got the same error (one rank's, broadcast)."""
    return _failure([Group(list(range(world)), (failed, None, None))], [], world)


def _failure(failed: list[Group], past: list[int], world: int) -> Failure:
    """The agreed failure: the lowest failing rank's error, named with every failing rank."""
    ranks = sorted(r for g in failed for r in g.ranks) + list(past)
    if not failed:
        text = (
            f"ranks {_few(ranks)} failed or answered differently, past the distinct answers "
            "the ranks exchange; see each rank's log"
        )
        return Failure("RuntimeError", text, text, ranks[0], tuple(ranks))
    kind, message, step = failed[0].payload[0]
    rank = failed[0].ranks[0]
    more = [r for r in ranks if r != rank]
    others = f" (and on ranks {_few(more)})" if more else ""
    where = f" on rank {rank}{others}" if world > 1 else ""
    if step == ARGUMENTS:  # a usage error: the error itself, then where
        text = (
            f"{message} (on rank {rank}{', ' + str(more) if more else ''})"
            if world > 1
            else message
        )
    else:
        text = f"{step} failed{where}: {message}"
    everyone = len(ranks) == world and world > 1
    same = tuple(failed[0].ranks)
    return Failure(kind, text, message, None if everyone else rank, tuple(ranks), step, same)


def _differing(groups: list[Group]) -> Failure | None:
    """The arguments the ranks passed differently, as one line (None: they agree)."""
    if len(groups) < 2:
        return None
    per: dict[str, dict[int, tuple[str, set[int]]]] = {}
    order: list[str] = []
    for g in groups:
        for name, word, shown in g.payload[1][0]:
            if name not in per:
                per[name] = {}
                order.append(name)
            per[name].setdefault(word, (shown, set()))[1].update(g.ranks)
    names = [n for n in order if len(per[n]) > 1]
    counts = {len(g.payload[1][0]) for g in groups}
    if not names and len(counts) == 1:
        return None
    world = sum(len(g.ranks) for g in groups)
    if not names:  # one rank's call takes arguments another's does not: a different call
        names = ["call"]
    name = names[0]
    ways = sorted(per[name].values(), key=lambda v: min(v[1]))
    also = f" (also different: {', '.join(names[1:5])})" if len(names) > 1 else ""
    if name == "call":
        said = ", ".join(f"{shown} on {_ranks(sorted(ranks))}" for shown, ranks in ways[:4])
        text = f"the ranks made different calls: {said}; every rank must make the same call"
    elif name == _NUMBER:
        said = ", ".join(f"call {v} on {_ranks(sorted(ranks))}" for v, ranks in ways[:4])
        text = (
            f"the ranks are at different calls on this group ({said}): a rank left an earlier "
            "call the others were still in, or calls fsdpcheck more often; every rank must "
            "make the same calls"
        )
    else:
        said = ", ".join(f"{name}={v} on {_ranks(sorted(ranks))}" for v, ranks in ways[:4])
        text = f"the ranks passed different arguments: {said}{also}; every rank must pass the same"
    return Failure("RanksDisagreeError", text, text, None, tuple(range(world)), ARGUMENTS)


def _same_differs(groups: list[Group], what: str) -> Failure:
    world = sum(len(g.ranks) for g in groups)
    said = "; ".join(f"{_word(g.payload[1][1])} on {_ranks(g.ranks)}" for g in groups[:4])
    text = f"the ranks differ in {what} ({said}); every rank must compute the same"
    return Failure("RanksDisagreeError", text, text, None, tuple(range(world)))


def _differing_past(groups: list[Group], past: list[int], world: int) -> Failure:
    text = (
        f"the ranks passed different arguments or computed different plans (ranks "
        f"{_few(past)}, past the "
        f"{len(groups)} distinct answers shown, differ from ranks {_few(groups[0].ranks)}); "
        "every rank must pass the same"
    )
    return Failure("RanksDisagreeError", text, text, None, tuple(range(world)))


def _word(value: Any) -> str:
    return f"{value:#018x}" if isinstance(value, int) else _shown(value)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_few(ranks)}"


def _few(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"{ranks[:16]} and {len(ranks) - 16} more"


def _shown(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:76] + " ..."
