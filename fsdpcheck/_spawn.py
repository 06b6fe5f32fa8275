"""Starting N local ranks (for the demo, the benchmarks and the multi-rank tests)."""

from __future__ import annotations

import socket
from collections.abc import Callable
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
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]
