"""Ranks that stop answering in the middle of a call: worlds of their own
(tests/dist/reliability/test_reliability.py).

A rank stopped with SIGSTOP is alive (its connections stay open) and answers nothing; one killed
with SIGKILL is gone. Either way every other rank must end the call with the same one line
naming it, within the deadline. Many cases run in one world: each on a process group of its own
(``new_group``), the stopped rank resumed (SIGCONT, by the lowest other rank) once the others
ended, and the ranks meeting through the store before the next case.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The default group's timeout, and each case group's: the deadline when a call sets none.
PG_TIMEOUT = 12.0
#: How long the ranks wait for each other between cases (a rank that never comes: a failure).
MEET_S = 120.0


def _meet(store: Any, key: str, world: int) -> None:
    store.add(key, 1)
    end = time.monotonic() + MEET_S
    while int(store.add(key, 0)) < world:
        if time.monotonic() > end:
            raise TimeoutError(f"the ranks did not all reach {key}")
        time.sleep(0.05)


def _entries(ctx: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    import fsdpcheck

    m, o, fm, fo, ck, work = (ctx[k] for k in ("m", "o", "fm", "fo", "ck", "work"))
    n = iter(range(1 << 30))
    return {
        "verify": lambda **kw: fsdpcheck.verify(m, ck, optimizer=o, **kw),
        "fingerprint": lambda **kw: fsdpcheck.fingerprint(m, optimizer=o, **kw),
        "save": lambda **kw: fsdpcheck.save(m, work / f"save{next(n)}", optimizer=o, **kw),
        "load": lambda **kw: fsdpcheck.load(fm, ck, optimizer=fo, **kw),
    }


def stopping(rank: int, world: int, port: int, out: str, cases: str) -> None:
    """Runs `cases` (JSON: [{"entry", "at", "victim", "timeout"}]) one after another.

    ``at`` is the victim's collective to stop before (1-based, counting fsdpcheck's own and
    each block of DCP's), or "last". Writes rank<r>.json: per case, what this rank saw.
    """
    import torch
    import torch.distributed as dist

    import fsdpcheck
    from fsdpcheck.dist import comm as comm_mod
    from fsdpcheck.testing import models as T

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=PG_TIMEOUT)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    work = Path(out) / "work"
    ck = work / "ck"
    m, o = T.build("fsdp", world)
    T.train(m, o)
    fsdpcheck.save(m, ck, optimizer=o)
    fm, fo = T.build("fsdp", world, seed=1)
    T.train(fm, fo, steps=1)  # an optimizer with state: load makes no step of its own
    dist.barrier()
    pids = {r: int(store.get(f"pid/{r}")) for r in range(world)}
    entries = _entries({"m": m, "o": o, "fm": fm, "fo": fo, "ck": ck, "work": work})
    results: list[dict[str, Any]] = []
    made: dict[str, int] = {}

    def count(c: Any, what: str) -> None:
        made["n"] = c.made

    for i, case in enumerate(json.loads(cases)):
        group = dist.new_group(backend="gloo", timeout=timeout)
        entry, victim, at = case["entry"], case["victim"], case["at"]
        if at == "last":  # counted on a clean call first
            made.clear()
            comm_mod._BEFORE = count
            entries[entry](group=group, timeout=case["timeout"] or PG_TIMEOUT)
            comm_mod._BEFORE = None
            at = made["n"]
            _meet(store, f"case{i}/counted", world)

        def stop(c: Any, what: str, at: int = at, victim: int = victim) -> None:
            if c.made == at and rank == victim:
                os.kill(os.getpid(), signal.SIGSTOP)

        comm_mod._BEFORE = stop
        t0 = time.monotonic()
        said: dict[str, Any] = {"case": case, "at": at, "victim": rank == victim}
        try:
            entries[entry](group=group, timeout=case["timeout"])
            said["error"] = None
        except Exception as exc:
            said.update(type=type(exc).__name__, error=str(exc))
        said["seconds"] = round(time.monotonic() - t0, 2)
        comm_mod._BEFORE = None
        # The stopped rank may host the store: the others meet through files until it runs.
        others = [r for r in range(world) if r != victim]
        if rank != victim:
            Path(out, f"case{i}.{rank}").touch()
        if rank == others[0]:
            end = time.monotonic() + MEET_S
            while not all(Path(out, f"case{i}.{r}").exists() for r in others):
                if time.monotonic() > end:
                    break
                time.sleep(0.05)
            os.kill(pids[victim], signal.SIGCONT)
        results.append(said)
        _meet(store, f"case{i}/done", world)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    _meet(store, "end", world)
    os._exit(0)  # groups with abandoned collectives: no teardown that could wait on them


def killing(rank: int, world: int, port: int, out: str) -> None:
    """Three ranks: rank 2 killed inside save's DCP writing, then (ranks 0 and 1 on a group of
    their own) rank 0, which hosts the store, killed inside load's DCP reading."""
    import torch
    import torch.distributed as dist

    import fsdpcheck
    from fsdpcheck.dist import comm as comm_mod
    from fsdpcheck.testing import models as T

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=PG_TIMEOUT)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    work = Path(out) / "work"
    m, o = T.build("fsdp", world)
    T.train(m, o)
    ck = work / "ck"
    fsdpcheck.save(m, ck, optimizer=o)
    g1 = dist.new_group(backend="gloo", timeout=timeout)
    g2 = dist.new_group(ranks=[0, 1], backend="gloo", timeout=timeout)
    results: list[dict[str, Any]] = []

    def kill_in(victim: int, block: str) -> Callable[[Any, str], None]:
        def hook(c: Any, what: str) -> None:
            if rank == victim and block in what:
                os.kill(os.getpid(), signal.SIGKILL)

        return hook

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        said: dict[str, Any] = {"case": name}
        try:
            fn()
            said["error"] = None
        except Exception as exc:
            said.update(type=type(exc).__name__, error=str(exc))
        except BaseException:
            said.update(type="BaseException", error=traceback.format_exc())
        said["seconds"] = round(time.monotonic() - t0, 2)
        results.append(said)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))

    comm_mod._BEFORE = kill_in(2, "DCP writing")
    attempt("save", lambda: fsdpcheck.save(m, work / "s", optimizer=o, group=g1))
    if rank == 2:
        os._exit(0)  # (never reached: killed)
    # Ranks 0 and 1 load a checkpoint on a group of their own (rank 2 is gone).
    plain = torch.nn.Linear(64, 32)  # the same plain model on both ranks (seeded)
    torch.manual_seed(0)
    torch.nn.init.normal_(plain.weight)
    ck2 = work / "ck2"
    fsdpcheck.save(plain, ck2, group=g2)
    comm_mod._BEFORE = kill_in(0, "DCP reading")
    attempt("load", lambda: fsdpcheck.load(plain, ck2, group=g2))
    os._exit(0)
