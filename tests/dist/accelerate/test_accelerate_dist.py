"""fsdpcheck.integrations.accelerate with accelerate's real save_state / load_state (2 ranks).

The registered scenarios of tests/dist/accelerate/accelerate_scenarios.py run in the 2-rank spawn
(the ``spawns`` fixture, shared with the other multi-rank tests);
``test_scenario[<name>]`` checks one: no error on any rank, the ranks agree, its checks hold.
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from tests.dist.accelerate.accelerate_scenarios import REGISTRY
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.accelerate.accelerate_scenarios"
CASES = REGISTRY.cases()


CHECKS = checks = Checks(REGISTRY)


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    CHECKS[name](spawns.result(SCENARIOS_MODULE, world, name))


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


@checks("saved")
def accelerate_wrote_sharded_state(saved):
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(saved)


@checks("clean")
def clean_load_state_verifies(r):
    assert not r["before"]["ok"]  # perturbed: every parameter differs
    after = r["after"]
    assert after["ok"], after["text"]
    assert after["keys"] == 13 * 4  # parameters + exp_avg, exp_avg_sq, step


@checks("missing_step")
def missing_optimizer_step(r):
    assert [(k, kind) for k, kind, _ in r["findings"]] == [
        ("optim.state.blocks.0.w1.weight.step", "missing")
    ]


@checks("dropped_moment")
def dropped_optimizer_moment(r):
    assert [(k, kind) for k, kind, _ in r["findings"]] == [
        ("optim.state.head.weight.exp_avg", "missing")
    ]


@checks("load_and_inspect")
def load_and_inspect_recognise_the_directory(li):
    assert li["load"]["ok"], li["load"]["text"]
    assert li["kind"] == "sharded" and "accelerate" in li["format"]
    assert li["tensors"] == 52


@checks("full_then_sharded")
def state_saved_full_then_loaded_sharded(f):
    assert "pytorch_model_fsdp.bin" in f["files"] and "optimizer.bin" in f["files"]
    # The sharded model never got the full state: every parameter is a clear value finding.
    assert not f["report"]["ok"]
    assert {kind for _, kind, _ in f["report"]["findings"]} == {"value"}
    assert f["refused"] is not None and "expected a sharded checkpoint" in f["refused"]
    assert f["loaded"]["ok"], f["loaded"]["text"]  # fsdpcheck.load takes it the full way
