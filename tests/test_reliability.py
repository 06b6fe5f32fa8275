"""A call a training job can trust: every rank ends with one line, within a deadline.

The registered scenarios (tests/reliability_scenarios.py) run in the shared spawn: a failure on
one rank at every local step of every entry point, every argument that must agree differing on
one rank, two threads on one group, shards some rank leaves out, element counts under HSDP.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist_harness import Checks, Spawns
from tests.reliability_scenarios import DEADLINE, INJECTED, REGISTRY

SCENARIOS_MODULE = "tests.reliability_scenarios"
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
    assert fp[1] == "layout" and f"not by ranks [{last}]" in fp[3], fp
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
