"""A failure on one rank, arguments that differ, two threads, coverage: inside gloo ranks.

Every collective entry point runs here under ``dist.runner`` (NOTE: [one step runner]); each
scenario returns what every rank saw, and the harness checks that every rank returned the same
(entries named "rank_local" aside). Every call is given ``timeout=`` (``DEADLINE``), so a rank
left waiting would end the scenario with RankStoppedError instead of hanging the spawn. The
faults that stop a rank (SIGSTOP, SIGKILL) need worlds of their own:
tests/dist/reliability/test_reliability.py.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdpcheck
from fsdpcheck.dist import runner
from fsdpcheck.saving import write_checkpoint_manifest
from fsdpcheck.testing import models as T
from fsdpcheck.testing.faults import plant
from fsdpcheck.watch import verify_resumed
from tests.dist_harness import Registry, World

REGISTRY = Registry()
scenario = REGISTRY.scenario

#: The deadline every call here is given: far above what a call takes, far below a hang.
DEADLINE = 60.0
#: The deadline of the racing threads' calls (one left alone on a rank ends there).
RACE_DEADLINE = 5.0
#: The text of every fault planted here.
INJECTED = "injected fault"


@dataclass
class Base:
    model: torch.nn.Module
    opt: torch.optim.Optimizer


def setup(rank: int, world: int, shared: Path, saved_by: str | None) -> tuple[dict, Base]:
    del rank, saved_by
    model, opt = T.build("fsdp", world)
    T.train(model, opt)
    saved = shared / "saved"
    fsdpcheck.save(model, saved, optimizer=opt, timeout=DEADLINE)
    return {"saved": saved}, Base(model, opt)


REGISTRY.setup = setup
REGISTRY.base_state = lambda b: (b.model, b.opt)


def run_world(rank: int, world: int, workdir: Path, shared: str | None = None, only=None) -> dict:
    """Entry point for dist_harness.run_ranks."""
    return REGISTRY.run(rank, world, workdir, shared, only)


# -------------------------------------------------------------------------------------------
def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """What a call gave, as every rank must see it: its exception, or its verdict."""
    t0 = time.perf_counter()
    try:
        got = fn()
    except Exception as exc:
        said: dict[str, Any] = {"raised": f"{type(exc).__name__}: {exc}"}
    else:
        if isinstance(got, fsdpcheck.Report):
            said = {
                "ok": got.ok,
                "findings": [[f.key, f.kind, f.rank, f.ranks, f.message] for f in got.findings],
            }
        else:
            said = {"ok": True}
    said["rank_local"] = {"seconds": round(time.perf_counter() - t0, 3)}
    return said


def entries(w: World) -> dict[str, Callable[[], Any]]:
    """Every collective entry point, on the setup's model, given the deadline."""
    b, saved = w.base, w.ckpts["saved"]
    folder = w.copy("saved")
    n = iter(range(1 << 30))

    # One model to load into, again and again (a load that failed half-way is overwritten by
    # the next); its optimizer has state for load to fill.
    fm, fo = T.build("fsdp", w.size, seed=1)
    T.train(fm, fo, steps=1)

    def load(**kw: Any) -> Any:
        return fsdpcheck.load(fm, saved, optimizer=fo, timeout=DEADLINE, **kw)

    def watch() -> Any:
        return fsdpcheck.ReplicaWatch(b.model, b.opt, every=1, timeout=DEADLINE).step()

    return {
        "verify": lambda: fsdpcheck.verify(b.model, saved, optimizer=b.opt, timeout=DEADLINE),
        "fingerprint": lambda: fsdpcheck.fingerprint(b.model, optimizer=b.opt, timeout=DEADLINE),
        "check_replicas": lambda: fsdpcheck.check_replicas(
            b.model, optimizer=b.opt, timeout=DEADLINE
        ),
        "ReplicaWatch.step": watch,
        "save": lambda: fsdpcheck.save(
            b.model, w.workdir / f"save{next(n)}", optimizer=b.opt, timeout=DEADLINE
        ),
        "load": lambda: load(),
        "load(verify='full', sentinel=True)": lambda: load(verify="full", sentinel=True),
        "write_checkpoint_manifest": lambda: write_checkpoint_manifest(
            b.model, folder, optimizer=b.opt, timeout=DEADLINE
        ),
        "verify_resumed": lambda: verify_resumed(b.model, saved, optimizer=b.opt, timeout=DEADLINE),
    }


@contextlib.contextmanager
def faulted(hook: Callable[[runner.Call, str], None]) -> Iterator[None]:
    runner._FAULT = hook
    try:
        yield
    finally:
        runner._FAULT = None


def steps_of(fn: Callable[[], Any]) -> list[str]:
    """The local steps of one clean call, in order (a step named twice is listed twice)."""
    seen: list[str] = []
    with faulted(lambda call, step: seen.append(step)):
        fn()
    return seen


# -------------------------------------------------------------------------------------------
@scenario(2, 4)
def a_failure_on_one_rank_at_each_step(w: World) -> Any:
    """Every local step of every entry point, failing on the last rank only (an exception, as a
    bug, a torch internal error or a user's callable raises): the same one-line outcome on every
    rank, naming the rank and the step, and the group still works after it."""
    out: dict[str, Any] = {}
    last = w.size - 1
    for name, fn in entries(w).items():
        steps = steps_of(fn)
        out[name] = {"steps": steps, "faults": [], "after": None}
        for k in range(len(steps)):
            hit: list[str] = []

            def fault(call: runner.Call, at: str, k: int = k, hit: list[str] = hit) -> None:
                hit.append(at)
                if len(hit) == k + 1 and w.rank == last:
                    raise RuntimeError(f"{INJECTED} at {at!r} on rank {last}")

            with faulted(fault):
                o = outcome(fn)
            o["at"] = hit[k] if len(hit) > k else None  # the step's name in this run
            out[name]["faults"].append(o)
        out[name]["after"] = outcome(fn)
    return out


# -------------------------------------------------------------------------------------------
def _identity_spec() -> dict[str, Any]:
    return {"rules": [], "others": "keep"}


@scenario(2, 4)
def arguments_that_differ_on_one_rank(w: World) -> Any:
    """Each argument that must agree, different on the last rank only: one RanksDisagreeError
    on every rank, naming it, before anything is read or written."""
    b, saved = w.base, w.ckpts["saved"]
    last = w.rank == w.size - 1
    t = DEADLINE

    def on_last(a: Any, other: Any) -> Any:
        return a if last else other

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m, o = T.build("fsdp", w.size, seed=1)
        T.train(m, o, steps=1)
        return m, o

    def load(**kw: Any) -> Any:
        m, o = fresh()
        kw.setdefault("optimizer", o)
        return fsdpcheck.load(m, saved, timeout=t, **kw)

    sd = {k: v for k, v in T.full_state(b.model).items()}
    ref_sd = {"model." + k: v for k, v in sd.items()}

    def rank_dependent_map(key: str) -> str | None:  # same function, other answers on one rank
        return ("model." + key) if not last or "blocks.0" not in key else "model.head.weight"

    def rank_dependent_conversion(state: dict[str, Any]) -> dict[str, Any]:
        if last:
            return {("renamed." + k if "head" in k else k): v for k, v in state.items()}
        return dict(state)

    def watch() -> Any:
        wt = fsdpcheck.ReplicaWatch(b.model, b.opt, every=1, timeout=t)
        wt.steps = on_last(5, 0)  # this rank stepped the watch a different number of times
        return wt.step()

    cases: dict[str, Callable[[], Any]] = {
        "verify rtol": lambda: fsdpcheck.verify(
            b.model, saved, rtol=on_last(1e-3, None), timeout=t
        ),
        "verify atol": lambda: fsdpcheck.verify(
            b.model, saved, atol=on_last(1e-3, None), timeout=t
        ),
        "verify equal_nan": lambda: fsdpcheck.verify(
            b.model, saved, equal_nan=on_last(False, True), timeout=t
        ),
        "verify check_dtype": lambda: fsdpcheck.verify(
            b.model, saved, check_dtype=on_last(False, True), timeout=t
        ),
        "verify ignore": lambda: fsdpcheck.verify(
            b.model, saved, ignore=on_last(["head.*"], None), timeout=t
        ),
        "verify key_map": lambda: fsdpcheck.verify(
            b.model, saved, key_map=on_last({"head.bias": None}, None), timeout=t
        ),
        "verify convert": lambda: fsdpcheck.verify(
            b.model, saved, convert=on_last(_identity_spec(), None), timeout=t
        ),
        "verify optimizer": lambda: fsdpcheck.verify(
            b.model, saved, optimizer=on_last(None, b.opt), timeout=t
        ),
        "verify reference": lambda: fsdpcheck.verify(b.model, on_last(ref_sd, saved), timeout=t),
        "verify key_map's result": lambda: fsdpcheck.verify(
            b.model, saved, key_map=rank_dependent_map, timeout=t
        ),
        "verify convert's result": lambda: fsdpcheck.verify(
            b.model, saved, convert=rank_dependent_conversion, timeout=t
        ),
        "fingerprint optimizer": lambda: fsdpcheck.fingerprint(
            b.model, optimizer=on_last(None, b.opt), timeout=t
        ),
        "fingerprint convert": lambda: fsdpcheck.fingerprint(
            b.model, convert=on_last(_identity_spec(), None), timeout=t
        ),
        "fingerprint convert's result": lambda: fsdpcheck.fingerprint(
            b.model, convert=rank_dependent_conversion, timeout=t
        ),
        "check_replicas optimizer": lambda: fsdpcheck.check_replicas(
            b.model, optimizer=on_last(None, b.opt), timeout=t
        ),
        "ReplicaWatch steps": watch,
        "save optimizer": lambda: fsdpcheck.save(
            b.model, w.workdir / "s1", optimizer=on_last(None, b.opt), timeout=t
        ),
        "save overwrite": lambda: fsdpcheck.save(
            b.model, w.workdir / "s2", overwrite=on_last(True, False), timeout=t
        ),
        "save path": lambda: fsdpcheck.save(
            b.model, w.workdir / on_last("s3", "s4"), optimizer=b.opt, timeout=t
        ),
        "load verify": lambda: load(verify=on_last("full", "fingerprint")),
        "load expect": lambda: load(expect=on_last("sharded", None)),
        "load sentinel": lambda: load(sentinel=on_last(True, False)),
        "load key_map": lambda: load(key_map=on_last({"head.bias": None}, None)),
        "load optimizer": lambda: load(optimizer=on_last(None, fresh()[1])),
        "load convert": lambda: load(convert=on_last(_identity_spec(), None)),
        "write_checkpoint_manifest optimizer": lambda: write_checkpoint_manifest(
            b.model, w.workdir / "s0", optimizer=on_last(None, b.opt), timeout=t
        ),
        "verify_resumed optimizer": lambda: verify_resumed(
            b.model, saved, optimizer=on_last(None, b.opt), timeout=t
        ),
        "verify_resumed rtol": lambda: verify_resumed(
            b.model, w.ckpts["saved"] / "nonexistent-subfolder", rtol=on_last(1e-3, None), timeout=t
        ),
        "different calls": lambda: (
            fsdpcheck.fingerprint(b.model, timeout=t)
            if last
            else fsdpcheck.verify(b.model, saved, timeout=t)
        ),
    }
    fsdpcheck.save(b.model, w.workdir / "s0", timeout=t)  # a checkpoint for the manifest writer
    out = {name: outcome(fn) for name, fn in cases.items()}
    # A rank whose count of calls on the group is off by one (as when it left a call the others
    # were still in): its next call is refused everywhere, never paired with the others'.
    guard = runner._GUARDS[runner._key(None)]
    guard.calls += 1 if last else 0
    out["call number"] = outcome(lambda: fsdpcheck.fingerprint(b.model, timeout=t))
    guard.calls -= 1 if last else 0
    out["after"] = outcome(lambda: fsdpcheck.verify(b.model, saved, optimizer=b.opt, timeout=t))
    out["nothing saved"] = sorted(
        p.name for p in w.workdir.iterdir() if p.name.startswith(("s1", "s2", "s3", "s4"))
    )
    return out


# -------------------------------------------------------------------------------------------
@scenario(2, 4)
def two_threads_on_one_group(w: World) -> Any:
    """Two threads of every rank call on the same group at once: the second is refused at once
    (before any collective), the call in progress fails on every rank, nobody hangs or crashes,
    and the group works after. Then calls racing from two threads, many times: each either
    completes with the right verdict or fails with one of those two errors, never a crossed
    answer."""
    b, saved = w.base, w.ckpts["saved"]
    ref = {k: v.clone() for k, v in T.full_state(b.model).items()}
    wrong = {k: v.clone() for k, v in ref.items()}
    key = sorted(wrong)[0]
    wrong[key].view(-1)[0] += 1.0
    said: dict[str, Any] = {}
    refused = threading.Event()

    def second() -> None:
        said["second"] = outcome(lambda: fsdpcheck.fingerprint(b.model, timeout=DEADLINE))
        refused.set()

    def first() -> Any:
        def start_the_other(call: runner.Call, step: str) -> None:
            if not refused.is_set() and "second" not in said:
                other = threading.Thread(target=second)
                other.start()
                other.join()

        with faulted(start_the_other):
            return fsdpcheck.verify(b.model, saved, optimizer=b.opt, timeout=DEADLINE)

    said["first"] = outcome(first)
    said["after"] = outcome(lambda: fsdpcheck.verify(b.model, saved, optimizer=b.opt,
                                                     timeout=DEADLINE))  # fmt: skip

    # Racing, on a group of their own (a call that ends at its deadline leaves that group
    # unusable): thread A checks against the right reference, thread B against a wrong one. A
    # crossed answer would be an OK for B or a finding for A.
    group = dist.new_group(backend="gloo")
    kinds: set[str] = set()
    crossed = 0
    for _ in range(6):
        got: dict[str, Any] = {}
        go = threading.Barrier(2)

        def run(
            name: str, reference: Any, go: threading.Barrier = go, got: dict[str, Any] = got
        ) -> None:
            go.wait()
            got[name] = outcome(
                lambda: fsdpcheck.verify(b.model, reference, group=group, timeout=RACE_DEADLINE)
            )

        threads = [threading.Thread(target=run, args=a) for a in (("A", ref), ("B", wrong))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for name, o in got.items():
            raised = o.get("raised", "")
            if raised.startswith("ConcurrentCallError"):
                kinds.add("refused")
            elif "another thread called" in str(o.get("findings")):
                kinds.add("stopped")
            elif raised:
                kinds.add(raised.split(":")[0])
            elif o["ok"] != (name == "A"):
                crossed += 1
            else:
                kinds.add("right")
        # A call left alone on one rank by the other rank's refusal ends at its deadline, and
        # the race group is then spent: every rank stops at the first rank that saw that.
        spent = torch.tensor([int(any("RankStoppedError" in str(o) for o in got.values()))])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        if spent.item():
            break
    return {
        "first": said["first"],
        "second": said["second"],
        "after": said["after"],
        "race": {"crossed": crossed, "rank_local": sorted(kinds)},
    }


# -------------------------------------------------------------------------------------------
@scenario(2, 4)
def a_shard_one_rank_leaves_out(w: World) -> Any:
    """A state dict missing one sharded key on the last rank: verify and fingerprint name the
    key, the elements no rank holds, and the ranks that do hold it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fsdpcheck.fingerprints import fingerprint_report

    b, saved = w.base, w.ckpts["saved"]
    key = "blocks.0.w1.weight"
    sd = dict(get_model_state_dict(b.model))
    shape = tuple(sd[key].shape)
    if w.rank == w.size - 1:
        del sd[key]
    result = fingerprint_report(sd, timeout=DEADLINE)
    return {
        "verify": outcome(lambda: fsdpcheck.verify(sd, saved, timeout=DEADLINE)),
        "fingerprint": [[f.key, f.kind, f.ranks, f.message] for f in result.findings],
        "fingerprinted": key in result.fingerprints,
        "numel": math.prod(shape),
    }


@scenario(2, 4)
def element_counts_are_global(w: World) -> Any:
    """HSDP (a replicate dimension of 2): an element changed in one replica reads 1 of the
    tensor's global numel, as does the 0-d optimizer step every rank keeps; the elements
    checked are every tensor's global numel, once."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = T.build("hsdp", w.size)
    T.train(m, o)
    ck = w.workdir / "hsdp"
    fsdpcheck.save(m, ck, optimizer=o, timeout=DEADLINE)
    param = m.get_parameter("blocks.0.w1.weight")
    # Every tensor's global numel, once (a DTensor's numel is its global one).
    msd, osd = get_state_dict(m, o)
    numel = [v.numel() for v in msd.values()]
    numel += [v.numel() for s in osd["state"].values() for v in s.values()]
    clean = fsdpcheck.verify(m, ck, optimizer=o, timeout=DEADLINE)
    step = o.state[param]["step"]
    saved_step = step.clone()
    last = w.size - 1
    with plant(param, 0, on_rank=last):
        if w.rank == last:
            step.add_(1)
        try:
            planted = fsdpcheck.verify(m, ck, optimizer=o, timeout=DEADLINE)
        finally:
            step.copy_(saved_step)
    return {
        "clean_ok": clean.ok,
        "elements_checked": clean.elements_checked,
        "global_numel_of_all": sum(numel),
        "global_numel": param.numel(),
        "findings": [[f.key, f.kind, f.mismatched, f.numel, f.message] for f in planted.findings],
    }


@scenario(2, 4)
def a_local_error_leaves_the_group_usable(w: World) -> Any:
    """``memory_budget=0`` on one rank (refused before the first collective), then a tensor
    kind that raises inside torch on one rank: the same error everywhere, then a clean call."""
    b, saved = w.base, w.ckpts["saved"]
    last = w.rank == w.size - 1

    class Broken(torch.Tensor):
        """A tensor subclass whose every torch function raises (a torch internal error)."""

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            raise RuntimeError(f"{INJECTED}: a torch internal error")

    sd = {k: v for k, v in T.full_state(b.model).items()}
    if last:
        sd["head.bias"] = sd["head.bias"].as_subclass(Broken)
    return {
        "budget": outcome(
            lambda: fsdpcheck.verify(
                b.model, saved, memory_budget=0 if last else 1 << 20, timeout=DEADLINE
            )
        ),
        "torch_error": outcome(lambda: fsdpcheck.verify(sd, saved, timeout=DEADLINE)),
        "after": outcome(lambda: fsdpcheck.verify(b.model, saved, timeout=DEADLINE)),
        "world": dist.get_world_size(),
    }
