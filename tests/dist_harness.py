"""Multi-rank scenarios on gloo CPU ranks: a registry, one spawn per world size, JSON results.

A scenario is a module-level function registered with ``@registry.scenario(world, ...)``. It
takes a ``World`` and returns something JSON-able. Scenarios do not depend on each other: each
gets its own empty directory (``world.workdir``), reads the checkpoints the world's setup saved
only through ``world.ckpts`` (read-only; ``world.copy`` gives a private copy to damage), and may
use the setup's live models (``world.base``) only under faults that restore on exit: after every
scenario the runner checks that the base models' state is bit-identical to what it was before, and
fails the scenario that changed it.

Spawning ranks costs 5-10 s on two cores, so one spawn runs every scenario of one world size, in
registry order; the results come back keyed by function name. ``Spawns`` (the session fixture
``spawns`` in conftest.py) goes further: one spawn per world size for all the registries whose
tests are selected, each running only the selected scenarios.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpcheck._spawn import spawn


@dataclass(frozen=True)
class World:
    """What a scenario gets: its rank, the world size, its own directory, the shared state."""

    rank: int
    size: int
    workdir: Path  # this scenario's own directory (the same path on every rank)
    ckpts: dict[str, Path]  # checkpoints the setup saved: read them, never write them
    base: Any  # the setup's live models: change them only under a fault that restores on exit

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def copy(self, name: str) -> Path:
        """A private copy of the shared checkpoint `name` in this scenario's directory."""
        dst = self.workdir / name
        if self.rank == 0:
            shutil.copytree(self.ckpts[name], dst)
        self.barrier()
        return dst


@dataclass(frozen=True)
class Scenario:
    fn: Callable[[World], Any]
    worlds: tuple[int, ...]


@dataclass
class Registry:
    """Scenarios by function name, a setup per world size and the state it shares."""

    scenarios: dict[str, Scenario] = field(default_factory=dict)
    setup: Callable[..., tuple[dict[str, Path], Any]] | None = None
    base_state: Callable[[Any], tuple[Any, ...]] = lambda base: ()
    # The world size whose setup saves what the other world sizes' setups read (None: none).
    saved_by_world: int | None = None
    # Where the registry runs inside a shared spawn: lower first (state a library leaves in the
    # process, such as accelerate's, then cannot reach the others).
    order: int = 0

    def scenario(self, *worlds: int) -> Callable[[Callable[[World], Any]], Callable[[World], Any]]:
        def register(fn: Callable[[World], Any]) -> Callable[[World], Any]:
            if fn.__name__ in self.scenarios:
                raise ValueError(f"two scenarios named {fn.__name__}")
            self.scenarios[fn.__name__] = Scenario(fn, worlds)
            return fn

        return register

    def cases(self) -> list[tuple[int, str]]:
        """(world size, scenario name) of every registered run."""
        return [(w, name) for name, s in self.scenarios.items() for w in s.worlds]

    def run(
        self, rank: int, world: int, workdir: Path, shared: str | None = None, only=None
    ) -> dict[str, Any]:
        """Inside a rank: the setup, then every scenario of this world size (or those in `only`).

        Returns: name -> {"result", "error" (a traceback or None), "seconds"}.
        """
        import torch.distributed as dist

        from fsdpcheck.testing import changes, snapshot

        assert self.setup is not None
        ckpts, base = self.setup(rank, world, workdir / "shared", shared)
        out: dict[str, Any] = {
            "__shared__": str(workdir / "shared"),
            "__ckpts__": {k: str(v) for k, v in ckpts.items()},
        }
        for name, sc in self.scenarios.items():
            if world not in sc.worlds or (only is not None and name not in only):
                continue
            wd = workdir / name
            wd.mkdir(parents=True, exist_ok=True)  # every rank: no barrier needed before it
            before = snapshot(*self.base_state(base))
            t0 = time.perf_counter()
            error = None
            try:
                result = sc.fn(World(rank, world, wd, ckpts, base))
            except Exception:
                result, error = None, traceback.format_exc()
            seconds = time.perf_counter() - t0
            left = changes(before, snapshot(*self.base_state(base)))
            if left and error is None:
                error = f"the scenario left the shared models changed on rank {rank}: {left[:8]}"
            out[name] = {"result": result, "error": error, "seconds": round(seconds, 3)}
            dist.barrier()
        return out


class Checks(dict):
    """The test-side checks of a Registry, by scenario name: ``@checks("name")`` registers one.

    A check for a name the registry lacks fails at import, and ``missing()`` lists scenarios
    nobody checks, so scenario and check cannot drift apart.
    """

    def __init__(self, registry: Registry) -> None:
        super().__init__()
        self.registry = registry

    def __call__(self, name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
        def register(fn: Callable[..., None]) -> Callable[..., None]:
            assert name in self.registry.scenarios, f"no scenario named {name}"
            self[name] = fn
            return fn

        return register

    def missing(self) -> set[str]:
        """Scenarios without a check."""
        return set(self.registry.scenarios) - set(self)


def run_registries(rank: int, world: int, workdir: Path, plan: dict[str, dict]) -> dict:
    """Inside a rank: ``REGISTRY.run`` of each scenarios module in `plan` (module -> kwargs)."""
    out = {}
    for module, kwargs in plan.items():
        registry = importlib.import_module(module).REGISTRY
        out[module] = registry.run(rank, world, workdir / module.rsplit(".", 1)[-1], **kwargs)
    return out


class Spawns:
    """One spawn per world size for the scenarios the session's selected tests need.

    A test module takes part by naming its scenarios module in ``SCENARIOS_MODULE`` and
    parametrizing its per-scenario test over ``case`` = (world size, scenario name); any other
    test of such a module asks for all of that module's scenarios.
    """

    def __init__(self, base: Path, items: list[Any]) -> None:
        self.base = base
        self.per_world: dict[int, list[dict]] = {}
        self.wanted: dict[str, dict[int, set[str]] | None] = {}
        for item in items:
            module = getattr(getattr(item, "module", None), "SCENARIOS_MODULE", None)
            if module is None:
                continue
            callspec = getattr(item, "callspec", None)
            if callspec is None or "case" not in callspec.params:
                self.wanted[module] = None  # a test across scenarios: all of them
            elif self.wanted.setdefault(module, {}) is not None:
                world, name = callspec.params["case"]
                self.wanted[module].setdefault(world, set()).add(name)  # type: ignore[union-attr]

    def _plan(self, world: int) -> dict[str, dict]:
        plan = []
        for module, wanted in self.wanted.items():
            registry = importlib.import_module(module).REGISTRY
            worlds = {w for w, _ in registry.cases()}
            if world not in worlds:
                continue
            only = None if wanted is None else sorted(wanted.get(world, ()))
            feeds_others = registry.saved_by_world == world and (
                wanted is None or any(wanted.get(w) for w in worlds - {world})
            )
            if only == [] and not feeds_others:
                continue
            kwargs: dict[str, Any] = {"only": only}
            if registry.saved_by_world not in (None, world):
                kwargs["shared"] = self.get(registry.saved_by_world)[0][module]["__shared__"]
            plan.append((registry.order, module, kwargs))
        return {module: kwargs for _, module, kwargs in sorted(plan, key=lambda p: p[0])}

    def get(self, world: int) -> list[dict]:
        """Each rank's results at this world size: module -> scenario name -> result."""
        if world not in self.per_world:
            plan = self._plan(world)
            self.per_world[world] = run_ranks(
                world, "tests.dist_harness:run_registries", self.base / f"w{world}", plan=plan
            )
        return self.per_world[world]

    def result(self, module: str, world: int, name: str) -> Any:
        """Rank 0's result of one scenario, checked as ``scenario_result`` does."""
        return scenario_result([r[module] for r in self.get(world)], name)

    def per_rank(self, module: str, world: int, name: str) -> list[Any]:
        """Every rank's result of one scenario (for what differs between ranks)."""
        return [r[module][name]["result"] for r in self.get(world)]


def _worker(rank: int, world: int, port: int, target: str, workdir: str, kwargs: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, Any]
    try:
        module, fn = target.rsplit(":", 1)
        call = getattr(importlib.import_module(module), fn)
        result = call(rank, world, Path(workdir), **json.loads(kwargs))
    except Exception:
        result = {"__crash__": traceback.format_exc()}
    Path(workdir, f"result_{rank}.json").write_text(json.dumps(result, default=str))
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(
    world: int, target: str, workdir: Path, timeout: float = 600, **kwargs: Any
) -> list[dict]:
    """Runs `module:function(rank, world, workdir, **kwargs) -> dict` on `world` ranks.

    Returns: each rank's result. Raises when a rank wrote none or crashed outside its scenarios.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    codes = spawn(_worker, world, (target, str(workdir), json.dumps(kwargs)), timeout)
    results = []
    for r in range(world):
        f = workdir / f"result_{r}.json"
        if not f.exists():
            raise RuntimeError(f"rank {r} wrote no result (exit code {codes[r]})")
        results.append(json.loads(f.read_text()))
    for r, res in enumerate(results):
        if "__crash__" in res:
            raise RuntimeError(f"rank {r} crashed:\n{res['__crash__']}")
    return results


def strip_rank_local(x: Any) -> Any:
    """A result without its "rank_local" entries (what may differ between ranks)."""
    if isinstance(x, dict):
        return {k: strip_rank_local(v) for k, v in x.items() if k != "rank_local"}
    if isinstance(x, list):
        return [strip_rank_local(v) for v in x]
    return x


def scenario_result(per_rank: list[dict], name: str) -> Any:
    """Rank 0's result of scenario `name`, after checking it ran cleanly and every rank agrees."""
    if name not in per_rank[0]:
        raise AssertionError(f"scenario {name} did not run")
    for rank, res in enumerate(per_rank):
        if res[name]["error"]:
            raise AssertionError(f"scenario {name} failed on rank {rank}:\n{res[name]['error']}")
    first = strip_rank_local(per_rank[0][name]["result"])
    for rank, res in enumerate(per_rank[1:], start=1):
        if strip_rank_local(res[name]["result"]) != first:
            raise AssertionError(f"scenario {name}: rank {rank} disagrees with rank 0")
    return per_rank[0][name]["result"]
