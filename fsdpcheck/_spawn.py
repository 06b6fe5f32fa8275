"""Starting N local ranks (for the demo, the benchmarks and the multi-rank tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    target: Callable[..., Any], world: int, args: tuple = (), timeout: float = 600
) -> list[int | None]:
    """Runs ``target(rank, world, port, *args)`` in `world` fresh processes; their exit codes.

    NOTE: [exit codes] A gloo process sometimes aborts in its exit handlers ("terminate called
    without an active exception") after finishing its work, so callers judge success by what the
    ranks wrote, not by these codes. Processes still running after `timeout` are killed.

    NOTE: [stopping ranks] The ranks never see SIGINT (a Ctrl-C reaches the whole process
    group): they start with it ignored, and this process stops them. Whatever ends the wait
    here (SIGINT, SIGTERM turned into an exception, an error) kills every rank started and
    reaps it before it propagates, so no rank outlives the call; `die_with_parent` covers this
    process being killed outright.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    started = []
    try:
        with _children_ignore_sigint():
            for p in procs:
                p.start()
                started.append(p)
        deadline = time.monotonic() + timeout
        for p in started:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join()
    return [p.exitcode for p in procs]


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Processes started in the block begin with SIGINT ignored (inherited through exec).

    A SIGINT that arrives meanwhile is held (blocked, pending) and delivered to this process
    once the block is over, so it still interrupts the caller.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers (and receives signals)
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def die_with_parent() -> None:
    """In a spawned rank: be killed when the process that spawned it dies (Linux; else nothing).

    Also unblocks the SIGINT inherited blocked and ignored (`spawn`): still ignored, so a pending
    one is dropped.
    """
    with contextlib.suppress(ValueError, OSError, AttributeError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = os.getppid()
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
