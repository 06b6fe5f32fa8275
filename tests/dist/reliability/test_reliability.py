"""A call a training job can trust: every rank ends with one line, within a deadline.

The registered scenarios (tests/dist/reliability/reliability_scenarios.py) run in the shared spawn:
a failure on one rank at every local step of every entry point, every argument that must agree
differing on one rank, two threads on one group, shards some rank leaves out, element counts under
HSDP.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests import REPO_ROOT
from tests.dist.reliability.reliability_scenarios import DEADLINE, INJECTED, REGISTRY
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.reliability.reliability_scenarios"
CASES = REGISTRY.cases()
CHECKS = checks = Checks(REGISTRY)


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    CHECKS[name](spawns.result(SCENARIOS_MODULE, world, name), world)


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


# -------------------------------------------------------------------------------------------
RAISING = {"save", "load", "load(verify='full', sentinel=True)", "write_checkpoint_manifest",
           "verify_resumed",
           "fingerprint"}  # fmt: skip


def _said(o: dict[str, Any]) -> str:
    return o.get("raised") or " | ".join(f"{f[0]}: {f[4]}" for f in o.get("findings", []))


@checks("a_failure_on_one_rank_at_each_step")
def every_step_fails_alike_on_every_rank(r: dict, world: int) -> None:
    last = world - 1
    assert set(r) == {
        "verify", "fingerprint", "check_replicas", "ReplicaWatch.step", "save", "load",
        "load(verify='full', sentinel=True)", "write_checkpoint_manifest", "verify_resumed",
    }  # fmt: skip
    for name, got in r.items():
        assert len(got["steps"]) >= 3, (name, got["steps"])
        assert "checking the arguments" in got["steps"], (name, got["steps"])
        assert got["after"].get("ok") is True, (name, got["after"])  # the group still works
        for o in got["faults"]:
            step, said = o["at"], _said(o)
            # One line, naming the fault, its step and the rank it happened on.
            assert INJECTED in said and f"{step!r} on rank {last}" in said, (name, step, o)
            assert "\n" not in said, (name, step, said)
            if "raised" in o:
                if step == "checking the arguments":  # a usage error: the error, then where
                    assert o["raised"].endswith(f" (on rank {last})"), (name, o)
                else:  # the step, the rank, the error
                    assert name in RAISING, (name, step, o)
                    assert f"{step} failed on rank {last}: " in o["raised"], (name, step, o)
            else:
                assert o["ok"] is False
                ranks = [f[2] for f in o["findings"]] + [x for f in o["findings"] for x in f[3]]
                assert last in ranks, (name, step, o)
            # Well within the deadline: nobody waited for the failed rank.
            assert o["rank_local"]["seconds"] < DEADLINE / 2, (name, step, o)


@checks("arguments_that_differ_on_one_rank")
def every_argument_that_differs_is_named(r: dict, world: int) -> None:
    last = world - 1
    named = {
        "verify rtol": "rtol=", "verify atol": "atol=", "verify equal_nan": "equal_nan=",
        "verify check_dtype": "check_dtype=", "verify ignore": "ignore=",
        "verify key_map": "key_map=", "verify convert": "convert=",
        "verify optimizer": "optimizer=", "verify reference": "reference=",
        "fingerprint optimizer": "optimizer=", "fingerprint convert": "convert=",
        "check_replicas optimizer": "optimizer=", "ReplicaWatch steps": "steps=",
        "save optimizer": "optimizer=", "save overwrite": "overwrite=",
        "load verify": "verify=", "load expect": "expect=", "load sentinel": "sentinel=",
        "load key_map": "key_map=", "load optimizer": "optimizer=", "load convert": "convert=",
        "write_checkpoint_manifest optimizer": "optimizer=",
        "verify_resumed optimizer": "optimizer=", "verify_resumed rtol": "rtol=",
    }  # fmt: skip
    for case, arg in named.items():
        said = r[case].get("raised", "")
        assert said.startswith("RanksDisagreeError: the ranks passed different arguments: "), (
            case,
            r[case],
        )
        assert f"{arg}" in said and f"on rank {last}" in said and "\n" not in said, (case, said)
    assert "different paths" in r["save path"]["raised"]
    assert r["different calls"]["raised"].startswith(
        "RanksDisagreeError: the ranks made different calls: 'verify' on "
    ), r["different calls"]
    # What depends on the data: agreed by the steps that compute it.
    for case, words in (
        ("verify key_map's result", "paired the model's keys"),
        ("verify convert's result", "conversion"),
        ("fingerprint convert's result", "the result of convert="),
    ):
        assert words in _said(r[case]), (case, r[case])
    assert r["call number"]["raised"].startswith(
        "RanksDisagreeError: the ranks are at different calls on this group ("
    ), r["call number"]
    assert f"on rank {last})" in r["call number"]["raised"]
    assert r["after"]["ok"] is True
    assert r["nothing saved"] == []


@checks("two_threads_on_one_group")
def a_second_thread_is_refused_and_the_first_stops(r: dict, world: int) -> None:
    assert r["second"]["raised"].startswith(
        "ConcurrentCallError: fingerprint refused: another thread of this process is inside "
        "verify on the same process group"
    ), r["second"]
    (f,) = r["first"]["findings"]
    assert f[1] == "error" and "another thread called fingerprint" in f[4], f
    assert sorted(f[3]) == list(range(world)), f  # every rank saw it
    assert r["after"]["ok"] is True
    assert r["race"]["crossed"] == 0
    assert set(r["race"]["rank_local"]) <= {"refused", "stopped", "right", "RankStoppedError"}


@checks("a_shard_one_rank_leaves_out")
def a_missing_shard_is_named(r: dict, world: int) -> None:
    key, last = "blocks.0.w1.weight", world - 1
    held = [f for f in r["verify"]["findings"] if f[0] == key and f[1] == "layout"]
    assert len(held) == 1 and not r["verify"]["ok"], r["verify"]
    msg = held[0][4]
    assert f"of its {r['numel']} elements" in msg and f"ranks [{last}] hold none of it" in msg
    assert held[0][3] == list(range(last))
    (fp,) = [f for f in r["fingerprint"] if f[0] == key]
    assert fp[1] == "layout" and f"ranks [{last}] hold none of it" in fp[3], fp
    assert not r["fingerprinted"]


@checks("element_counts_are_global")
def counts_are_global_numel_once(r: dict, world: int) -> None:
    assert r["clean_ok"]
    by_key = {(f[0], f[1]): f for f in r["findings"]}
    value = by_key[("blocks.0.w1.weight", "value")]
    assert (value[2], value[3]) == (1, r["global_numel"]), value
    step = by_key[("optim.state.blocks.0.w1.weight.step", "value")]
    assert (step[2], step[3]) == (1, 1), step
    assert ("blocks.0.w1.weight", "replica") in by_key
    assert r["elements_checked"] == r["global_numel_of_all"]


@checks("a_local_error_leaves_the_group_usable")
def a_local_error_is_everyones(r: dict, world: int) -> None:
    last = world - 1
    assert r["budget"]["raised"] == (
        f"ValueError: memory_budget must be a positive int (bytes), got 0 (on rank {last})"
    )
    (f,) = r["torch_error"]["findings"]
    assert f[1] == "error" and f[2] == last and INJECTED in f[4], f
    assert r["after"]["ok"] is True


# -------------------------------------------------------------------------------------------
# A rank that stops answering: worlds of their own (tests/dist/reliability/stop_worlds.py), both
# world sizes at once (their ranks mostly wait), each under a hard outer timeout.
ENTRIES = ("verify", "fingerprint", "save", "load")
#: The deadline of most cases (timeout=); the cases with timeout None take the group's own.
SHORT = 3.0


def _stop_cases(world: int) -> list[dict[str, Any]]:
    """Every entry point stopped before its 1st, 3rd and last collective on the last rank; at
    world 4 two on rank 0 (it hosts the store), at world 2 two with no timeout= (the deadline
    is then the group's 12 s)."""
    cases = [
        {"entry": e, "at": at, "victim": world - 1, "timeout": SHORT}
        for e in ENTRIES
        for at in (1, 3, "last")
    ]
    if world == 4:  # rank 0 hosts the store
        cases += [{"entry": e, "at": 3, "victim": 0, "timeout": SHORT} for e in ("verify", "load")]
    else:  # the group's own timeout
        cases += [{"entry": e, "at": 3, "victim": 1, "timeout": None} for e in ("verify", "save")]
    return cases


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[list[dict]]]:
    """Each world's per-rank results (both worlds run at the same time)."""
    import json
    import threading

    from fsdpcheck._spawn import spawn
    from tests.dist.reliability import stop_worlds

    root = tmp_path_factory.mktemp("stopped")
    out: dict[int, list[list[dict]]] = {}

    def world(w: int) -> None:
        d = root / f"w{w}"
        d.mkdir()
        cases = json.dumps(_stop_cases(w))
        spawn(stop_worlds.stopping, w, (str(d), cases), timeout=900)
        out[w] = [json.loads((d / f"rank{r}.json").read_text()) for r in range(w)]

    threads = [threading.Thread(target=world, args=(w,)) for w in (2, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_stopped_rank_is_named_by_every_other_rank_within_the_deadline(
    world: int, stopped: dict[int, list[list[dict]]]
) -> None:
    """SIGSTOP before the 1st, 3rd and last collective of verify, fingerprint, save and load:
    every other rank raises the same RankStoppedError naming the stopped rank and the step,
    within 3x the deadline (the call's timeout=, or the group's 12 s)."""
    per_rank = stopped[world]
    cases = _stop_cases(world)
    assert [len(r) for r in per_rank] == [len(cases)] * world
    for i, case in enumerate(cases):
        victim = case["victim"]
        deadline = case["timeout"] or 12.0
        others = [per_rank[r][i] for r in range(world) if r != victim]
        first = others[0]
        assert first["type"] == "RankStoppedError", (case, first)
        said = first["error"]
        assert said.startswith(f"rank {victim} stopped answering during "), (case, said)
        assert ", in " in said and "\n" not in said, (case, said)
        if victim == 0:  # it hosts the store: the others learn nothing from it, not even a cause
            assert said.endswith(
                "; it hosts the group's rendezvous store, which stopped answering too"
            ), (case, said)
        else:
            assert said.endswith(f" (no answer within {deadline:g} s)"), (case, said)
        for o in others:
            assert (o["type"], o["error"]) == (first["type"], said), (case, o, first)
            assert o["seconds"] <= 3 * deadline, (case, o)
        # For the record (pytest -s): the slowest other rank's time, against the deadline.
        print(f"w{world} {case} {max(o['seconds'] for o in others):.1f} s / {deadline:g} s")


def test_a_killed_rank_is_named_within_seconds_in_save_and_load(tmp_path) -> None:
    """SIGKILL inside DCP's writing (a rank that does not host the store) and inside DCP's
    reading (rank 0, which hosts it): the others name it within seconds, not at the deadline."""
    import json

    from fsdpcheck._spawn import spawn
    from tests.dist.reliability import stop_worlds

    codes = spawn(stop_worlds.killing, 3, (str(tmp_path),), timeout=300)
    assert codes[2] == -9 and codes[0] == -9, codes
    (save,) = json.loads((tmp_path / "rank0.json").read_text())[:1]
    results = json.loads((tmp_path / "rank1.json").read_text())
    assert results[0] == {**save, "seconds": results[0]["seconds"]}  # ranks 0 and 1 alike
    for r in (save, results[0]):
        assert r["type"] == "RankStoppedError", r
        assert r["error"].startswith("rank 2 stopped answering during fsdpcheck.save, in DCP "), r
        assert r["seconds"] < 20, r  # the answer window (5 s), not the 12 s deadline
    load = results[1]
    assert load["type"] == "RankStoppedError", load
    assert load["error"].startswith("rank 0 stopped answering during fsdpcheck.load, in DCP "), load
    assert "it hosts the group's rendezvous store" in load["error"], load
    assert load["seconds"] < 20, load


# -------------------------------------------------------------------------------------------
# The command line: a launcher's child joins, a process that inherited its variables does not.
def _fsdpcheck(args: list[str], env: dict[str, str], timeout: float = 120) -> Any:
    import os
    import subprocess
    import sys
    import time

    root = REPO_ROOT
    full = {k: v for k, v in os.environ.items() if k not in env}
    full.update(env, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done, time.monotonic() - t0


def _launch_env(port: int, rank: int = 1) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "job",
    }


@pytest.fixture
def st_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(path))
    return path


def test_inherited_launcher_variables_run_one_process(st_file) -> None:
    """Nothing listening on MASTER_PORT: the command runs alone at once, says why on stderr."""
    import json

    from fsdpcheck._spawn import free_port

    done, seconds = _fsdpcheck(["fingerprint", str(st_file), "--json"], _launch_env(free_port()))
    assert done.returncode == 0, done.stderr
    assert list(json.loads(done.stdout)) == ["w"]  # rank 1 of the job's env printed it
    assert "no launcher started this process" in done.stderr
    assert "pass --dist to join the launch" in done.stderr and done.stderr.count("\n") == 1
    assert seconds < 60


def test_inherited_variables_never_touch_a_live_store(st_file) -> None:
    """The job's own TCPStore listening on MASTER_PORT: the command neither joins it nor
    writes a key into it."""
    import datetime

    import torch.distributed as dist

    from fsdpcheck._spawn import free_port

    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )
    store.set("the job's own", "key")
    keys = store.num_keys()
    for rank in (0, 1):
        done, _ = _fsdpcheck(["audit", str(st_file), "--json"], _launch_env(port, rank))
        assert done.returncode == 0, done.stderr
        assert "no launcher started this process" in done.stderr
    assert store.num_keys() == keys


def test_a_rendezvous_that_never_comes_ends_at_its_deadline(st_file) -> None:
    """--dist with nothing listening: one line naming the variables, within the deadline."""
    from fsdpcheck._spawn import free_port

    port = free_port()
    args = ["fingerprint", str(st_file), "--dist", "--timeout", "3"]
    done, seconds = _fsdpcheck(args, _launch_env(port), timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    line = done.stderr.strip()
    assert "\n" not in line, line
    assert line.startswith(
        f"fsdpcheck fingerprint: could not join the launch (WORLD_SIZE=2 RANK=1 "
        f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}) within 3 s: "
    ), line
    assert line.endswith("; unset these variables to run as one process"), line
    assert seconds < 3 * 3 + 10  # the deadline, and the interpreter's start


def test_dist_without_launcher_variables_is_a_usage_error(st_file) -> None:
    done, _ = _fsdpcheck(["fingerprint", str(st_file), "--dist"], {}, timeout=60)
    assert done.returncode == 2
    assert "--dist: WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT not set" in done.stderr


def test_who_started_this_process() -> None:
    from fsdpcheck import offline_dist as od

    assert od._is_launcher(["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes", "1"])
    assert od._is_launcher(["/venv/bin/python", "/venv/bin/torchrun", "train.py"])
    assert od._is_launcher(["torchrun", "--nproc-per-node", "8", "train.py"])
    assert od._is_launcher(["python", "-u", "-m", "deepspeed.launcher.launch", "--x"])
    assert od._is_launcher(["/venv/bin/python", "/venv/bin/accelerate", "launch", "t.py"])
    assert not od._is_launcher(["python", "train.py"])
    assert not od._is_launcher(["python", "-m", "fsdpcheck", "fingerprint", "ck"])
    assert not od.started_by_launcher()  # pytest's parent is no launcher
