"""The process group fsdpcheck talks over: collectives with a deadline, and the ranks that stopped.

NOTE: [a rank that stops answering] A rank may die in the middle of a call (SIGKILL, a lost
host), stop without dying (SIGSTOP, a debugger, a swapped-out host: its connections stay open),
or never reach the collective the others wait in (stuck in other code). gloo fails the ranks
wired to a dead one ("Connection reset by peer") and leaves the others waiting until its
timeout; a stopped rank fails nobody. So on gloo every collective here waits in slices of
``_POLL_S``; between slices it asks the group's store whether another rank reported a failure,
and gives up once it has waited `Comm.timeout` seconds (the deadline: the group's own timeout
unless the call set another, which is then the group's for the call, so that gloo's own wait
and the collectives DCP makes inside ``save`` and ``load`` end at the same time). A rank whose
collective failed, or whose deadline passed, reports it in the store, and every rank that learns
of it (from its own failure or from the store) writes its answer there and waits up to
``_ANSWER_S`` for the others: the ranks that never answer are the ones named. Everyone raises
the same ``RankStoppedError``, worded from the lowest answering rank whose own wait failed, and
the first wording is kept in the store so that a rank that answers late (a stopped rank resumed)
raises it too. A dead rank thus costs the others about ``_ANSWER_S`` s, a stopped one the
deadline and ``_ANSWER_S`` s.

The store itself may be the one that stopped (it lives in rank 0 under a plain
``init_process_group``): TCPStore's ``add`` then waits with no timeout at all, so every store
call here is made from a helper thread (``_Line``) and abandoned after a second or a few
(``_STORE_S`` at most).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import math
import os
import pickle
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist

from fsdpcheck.errors import RankStoppedError, shown

__all__ = ["Comm", "RankStoppedError", "group_timeout"]

# Seconds between looks at the store while a gloo collective waits (at most), how long the
# ranks that still answer wait for each other's answers after a failure (at most), how long
# one store call may take before its host counts as stopped, and the deadline of a group whose
# own timeout cannot be read.
_POLL_S = 1.0
_ANSWER_S = 5.0
_STORE_S = 5.0
_DEFAULT_S = 1800.0
_HEARD = "another rank reported it"
_LATE = "no answer within"
# Failures seen per group in this process (each failure's answers get fresh store keys).
_EPOCH: dict[int, int] = {}
_TRANSPORT_WORDS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "no route to host",
    "timed out",
)

#: Tests: called as ``_BEFORE(comm, what)`` before each collective (fsdpcheck's own, and each
#: block of another library's, such as DCP's), after `Comm.made` counted it.
_BEFORE: Callable[[Comm, str], None] | None = None


def group_timeout(group: Any = None) -> float | None:
    """The group's own timeout in seconds (what its backend waits for one collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg: Any = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
            return float(backend.options._timeout.total_seconds())
        except Exception:  # no backend for that device, or no options to read
            continue
    return None


class Comm:
    """The process group fsdpcheck talks over (or a single process without one).

    Args:
        group: The process group (None: the default group, when there is one).
        timeout: Seconds any rank waits in one collective for the others before it names the
            ranks that did not answer (None: the group's own timeout).

    Attributes:
        entry: The fsdpcheck call in progress (for messages; set by ``runner.call``).
        step: The step of it in progress.
        made: Collectives made so far (fsdpcheck's own, and blocks of other libraries').
    """

    def __init__(self, group: Any = None, *, timeout: float | None = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world = dist.get_world_size(group) if self.enabled else 1
        self.device = torch.device("cpu")
        backend = dist.get_backend(group) if self.enabled else ""
        self._polled = backend == "gloo"
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        own = group_timeout(group)
        self.timeout: float = float(timeout) if timeout is not None else (own or _DEFAULT_S)
        self.entry = ""
        self.step = ""
        self.made = 0
        self._store_obj: Any = None

    # -- the collectives ---------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: Any, step: str = "") -> torch.Tensor:
        """All-reduce of a CPU tensor (moved to the backend's device and back)."""
        if not self.enabled:
            return t
        self._before("all_reduce")
        x = t.to(self.device, copy=True)  # never reduce the caller's tensor in place
        try:
            self._wait(dist.all_reduce(x, op=op, group=self.group, async_op=True))
            return x.cpu()
        except RuntimeError as exc:
            raise self._stopped(exc, "all_reduce", step) from None

    def all_gather_words(self, words: Sequence[int], step: str = "") -> list[list[int]]:
        """Every rank's few int64 words, in rank order: the one thing that grows with W."""
        if not self.enabled:
            return [list(words)]
        self._before("all_gather")
        mine = torch.tensor(list(words), dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            self._wait(dist.all_gather(out, mine, group=self.group, async_op=True))
        except RuntimeError as exc:
            raise self._stopped(exc, "all_gather", step) from None
        return [t.cpu().tolist() for t in out]

    def broadcast_object(self, obj: Any, src: int, step: str = "", inline: int = 0) -> Any:
        """`obj` of rank `src` (a rank of this group) on every rank: its pickle, once.

        The ranks are one job running one program: what one rank pickles, the others load.
        Two broadcasts (the size, then the pickle); one when the pickle fits in `inline`
        bytes, which then travel with the size whatever the pickle's length.
        """
        if not self.enabled:
            return obj
        self._before("broadcast")
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        data = pickle.dumps(obj, protocol=4) if self.rank == src else b""
        head = bytearray(8 + inline)
        head[:8] = len(data).to_bytes(8, "little")
        if len(data) <= inline:
            head[8 : 8 + len(data)] = data
        first = torch.frombuffer(head, dtype=torch.uint8).to(self.device)
        try:
            self._wait(dist.broadcast(first, src=root, group=self.group, async_op=True))
            got = bytes(first.cpu().numpy())
            size = int.from_bytes(got[:8], "little")
            if size <= inline:
                payload = got[8 : 8 + size]
            else:
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                if self.rank == src and data:
                    buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                self._wait(dist.broadcast(buf, src=root, group=self.group, async_op=True))
                host = buf.cpu()
                payload = ctypes.string_at(host.data_ptr(), host.numel())
        except RuntimeError as exc:
            raise self._stopped(exc, "broadcast", step) from None
        if self.rank == src:
            return obj
        return pickle.loads(payload)

    @contextlib.contextmanager
    def foreign(self, step: str) -> Iterator[None]:
        """A block of another library's collectives on this group (DCP's, torch's state dicts).

        They wait as the group does (its timeout is the call's deadline: ``runner.call`` sets
        it), not in slices; when one fails because a rank stopped answering, every rank that
        took part raises the same ``RankStoppedError`` naming it, as for fsdpcheck's own.
        """
        self.step = step
        if self.enabled:
            self._before(f"collectives of {step}")
        try:
            yield
        except BaseException as exc:  # torch's CheckpointException derives from BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit, RankStoppedError)):
                raise
            lost = self.lost_rank(exc, step)
            if lost is not None:
                raise lost from None
            raise

    def lost_rank(self, exc: BaseException, step: str) -> RankStoppedError | None:
        """The error naming the rank that stopped, when `exc` is a transport failure.

        For collectives made by other libraries on this group (`foreign`): call it on every
        rank that caught their failure. None when `exc` is not about the connection.
        """
        if not self.enabled or not _transport(exc):
            return None
        err = self._stopped(exc, "collective", step)
        return err if isinstance(err, RankStoppedError) else None

    def set_group_timeout(self, seconds: float) -> float | None:
        """Makes `seconds` the group's timeout; returns the one it had (None: unchanged)."""
        if not self.enabled:
            return None
        before = group_timeout(self.group)
        if before is None or math.isclose(before, seconds):
            return None
        pg: Any = self.group if self.group is not None else dist.group.WORLD
        try:
            pg.set_timeout(datetime.timedelta(seconds=seconds))
        except Exception:  # a backend that cannot change it: the deadline is ours alone
            return None
        return before

    # -- gloo, polled -----------------------------------------------------------------------
    def _before(self, what: str) -> None:
        self.made += 1
        if _BEFORE is not None:
            _BEFORE(self, what)

    def _wait(self, work: Any) -> None:
        if not self._polled:
            work.wait()
            return
        poll = datetime.timedelta(seconds=min(_POLL_S, max(0.05, self.timeout / 8)))
        start = time.monotonic()
        while True:
            try:
                work.wait(timeout=poll)
                return
            except RuntimeError:
                # A wait that ran out of its slice leaves the work pending ("Operation timed
                # out!"); one that failed (the transport, or gloo's own timeout: "Timed out
                # waiting ...") completes it.
                if work.is_completed():
                    raise
            if self._reports() > 0:
                raise _PeerReported()
            if time.monotonic() - start >= self.timeout:
                raise _NoAnswer()

    # -- who stopped ------------------------------------------------------------------------
    def _pg(self) -> Any:
        return self.group if self.group is not None else dist.group.WORLD

    def _store(self) -> Any:
        if self._store_obj is None:
            self._store_obj = self._pg().get_group_store()
        return self._store_obj

    def _key(self) -> str:
        return f"fsdpcheck/stopped/{_EPOCH.get(id(self.group), 0)}"

    def _reports(self) -> int:
        key = self._key()
        try:
            store = self._store()
            return int(_line(self._pg()).run(lambda: store.add(key, 0), self._store_s()))
        except Exception:  # the store is gone or silent: nothing to learn from it
            return 0

    def _store_s(self) -> float:
        return min(_STORE_S, max(1.0, self.timeout / 4))

    def _where(self, op: str, step: str) -> str:
        if self.entry:
            return f"{self.entry}, in {step or self.step or op}"
        return _step_name(op, step)

    def _stopped(self, exc: BaseException, op: str, step: str) -> RuntimeError:
        """The error every answering rank raises after `exc` (NOTE: [a rank that stops ...])."""
        what = self._where(op, step)
        if isinstance(exc, _PeerReported):
            cause = _HEARD
        elif isinstance(exc, _NoAnswer) or "timed out" in str(exc).lower():
            cause = f"{_LATE} {_seconds(self.timeout)}"
        else:
            cause = _cause(exc)
        key = self._key()
        _EPOCH[id(self.group)] = _EPOCH.get(id(self.group), 0) + 1
        window = min(_ANSWER_S, max(2.0, self.timeout / 4))
        try:
            store = self._store()
            line = _line(self._pg())
            line.run(lambda: store.add(key, 0), self._store_s())  # does the store answer?
            return line.run(
                lambda: self._answers(store, key, what, cause, window),
                2 * window + self._store_s(),
            )
        except Exception:  # the store went (or stopped) with the rank that hosts it
            return RankStoppedError(_store_lost(what, cause, self._store_host()))

    def _answers(self, store: Any, key: str, what: str, cause: str, window: float) -> Any:
        store.set(f"{key}/{self.rank}", f"{what}\0{cause}")
        store.add(key, 1)
        # One deadline for all, from the first answer (wall clock: ranks on other hosts).
        first = float(bytes(store.compare_set(f"{key}/t", "", repr(time.time()))))
        while int(store.add(key, 0)) < self.world and time.time() < first + window:
            time.sleep(0.05)
        answered = [r for r in range(self.world) if store.check([f"{key}/{r}"])]
        reports = [
            bytes(store.get(f"{key}/{r}")).decode(errors="replace").partition("\0")
            for r in answered
        ]
        # Worded from the lowest rank whose own wait ran out (a rank that times out closes its
        # connections, so the others may fail with "connection reset" because of it); else
        # from the lowest whose own collective failed (others only heard).
        what, _, cause = min(reports, key=lambda w: (w[2] == _HEARD, not w[2].startswith(_LATE)))
        silent = [r for r in range(self.world) if r not in answered]
        if not silent:  # every rank answered: a failure, but not a rank that went away
            said = f"failed\0a collective failed during {what}: {cause}"
        else:
            who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {_few(silent)}"
            said = f"stopped\0{who} stopped answering during {what} ({cause})"
        # The first wording is everyone's, a rank that answers late included.
        said = bytes(store.compare_set(f"{key}/verdict", "", said)).decode(errors="replace")
        try:
            # Nobody leaves before every answering rank has read the answers: the store may
            # live in one of them (rank 0 under a plain init_process_group). Once read, a
            # store that goes away no longer matters.
            store.add(f"{key}/read", 1)
            deadline = time.time() + window
            while int(store.add(f"{key}/read", 0)) < len(answered) and time.time() < deadline:
                time.sleep(0.05)
        except Exception:
            pass
        kind, _, text = said.partition("\0")
        return RankStoppedError(text) if kind == "stopped" else RuntimeError(text)

    def _store_host(self) -> int | None:
        """The rank whose process hosts the group's store, when it is known to be one."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return None  # torchrun's agent holds it, not a rank
        store = self._pg().get_group_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        if not isinstance(store, dist.TCPStore):
            return None
        return 0 if self.group is None else _group_rank(self.group, 0)


class _PeerReported(RuntimeError):
    """Raised inside a polled wait when another rank reported a failure in the store."""


class _NoAnswer(RuntimeError):
    """Raised inside a polled wait when the deadline passed."""


class _StoreSilent(RuntimeError):
    """A store call that did not return within its limit (its host stopped answering)."""


class _Line:
    """Store calls made one at a time from a helper thread, each abandoned after its limit.

    NOTE: [a silent store] TCPStore's client waits for an answer with no timeout in ``add``; a
    store whose host is stopped (SIGSTOP) keeps its connection open and never answers. A call
    left behind keeps the helper busy: until it returns, every later call fails at once.
    """

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._stuck: Future[Any] | None = None
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], Any], limit: float) -> Any:
        if self._stuck is not None and not self._stuck.done():
            raise _StoreSilent()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="fsdpcheck-store", daemon=True)
            self._thread.start()
        done: Future[Any] = Future()
        self._todo.put((fn, done))
        try:
            return done.result(timeout=limit)
        except FutureTimeout:
            self._stuck = done
            raise _StoreSilent() from None

    def _serve(self) -> None:
        while True:
            fn, done = self._todo.get()
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)


_LINES: dict[int, _Line] = {}
_LINES_LOCK = threading.Lock()


def _line(pg: Any) -> _Line:
    """The helper of a process group (one thread per group, for the process's life)."""
    with _LINES_LOCK:
        return _LINES.setdefault(id(pg), _Line())


def _group_rank(group: Any, global_rank: int) -> int | None:
    try:
        return int(dist.get_group_rank(group, global_rank))
    except Exception:  # global rank 0 is not in this group
        return None


def _store_lost(what: str, cause: str, host: int | None) -> str:
    if host is not None:
        # No cause: without the store the ranks cannot agree on one, and each saw its own (its
        # deadline, or a connection another rank's deadline closed).
        return (
            f"rank {host} stopped answering during {what}; it hosts the group's rendezvous "
            "store, which stopped answering too"
        )
    return (
        f"a rank stopped answering during {what} ({cause}), and the group's rendezvous store "
        "with it (its host is gone or stopped), so the ranks could not tell which"
    )


def _few(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"{ranks[:16]} and {len(ranks) - 16} more"


def _seconds(s: float) -> str:
    return f"{s:g} s" if s < 120 else f"{s / 60:g} min"


def _transport(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (_PeerReported, _NoAnswer)) or any(w in text for w in _TRANSPORT_WORDS)


def _cause(exc: BaseException) -> str:
    """The transport's reason in a few words (gloo's message carries a file:line and advice)."""
    text = str(exc).lower()
    for words in _TRANSPORT_WORDS:
        if words in text:
            return words
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]
    return shown(first[:200])


def _step_name(op: str, step: str) -> str:
    """What was going on outside a call: the fsdpcheck function, and the step or the caller."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = os.path.dirname(os.path.abspath(__file__))
    entry, caller = "", ""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name.startswith(package + os.sep) and not name.startswith(here + os.sep):
            entry = frame.f_code.co_name
            caller = caller or entry
        frame = frame.f_back  # type: ignore[assignment]
    detail = step or (f"in {caller}'s {op}" if caller != entry else f"in {op}")
    return f"{entry}, {detail}" if entry else detail
