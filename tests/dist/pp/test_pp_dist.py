"""Pipeline parallel x FSDP2 (torch's pipelining, 2 stages x 2 ranks): one verdict for the job.

The scenarios are in tests/dist/pp/pp_scenarios.py; the shared spawns run them (see dist_harness).
The harness checks that every rank returned the same result.
"""

from __future__ import annotations

import pytest

from tests.dist.pp.pp_scenarios import REGISTRY
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.pp.pp_scenarios"
CASES = REGISTRY.cases()
checks = Checks(REGISTRY)
STAGE0 = ["blocks.0.norm.bias", "blocks.0.norm.weight", "blocks.0.w1.bias", "blocks.0.w1.weight",
          "blocks.0.w2.weight", "emb.weight"]  # fmt: skip
STAGE1 = ["blocks.1.norm.bias", "blocks.1.norm.weight", "blocks.1.w1.bias", "blocks.1.w1.weight",
          "blocks.1.w2.weight", "head.bias", "head.weight"]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    checks[name](spawns.result(SCENARIOS_MODULE, world, name))


def test_every_scenario_is_checked() -> None:
    assert not checks.missing()


@checks("pp_verify")
def every_key_checked_on_the_ranks_that_hold_it(r):
    clean = r["clean"]
    assert clean["ok"], clean["text"]
    # 13 parameters, each with exp_avg, exp_avg_sq and step: every key of both stages.
    assert clean["keys"] == [52, 52, 52]
    assert any("2 different sets of keys (pipeline stages)" in n for n in clean["notes"])
    # The planted element: named at its key, global index and the rank holding it (stage 1 is
    # global ranks 2, 3; dp rank 1 of it holds rows 5..9 of 10), identically on every rank.
    assert r["planted"]["findings"] == [["blocks.1.w1.weight", "value", [8, 2], 3]]


@checks("pp_fingerprint_and_replicas")
def one_fingerprint_per_key_of_the_job(r):
    model = [k for k in r["keys"] if not k.startswith("optim.")]
    assert model == sorted(STAGE0 + STAGE1)
    assert len(r["keys"]) == 13 * 4  # the optimizer's exp_avg, exp_avg_sq, step too
    assert r["equal_offline"] and r["equal_with_optimizer"]
    assert r["replicas"]["ok"], r["replicas"]["text"]
    assert r["watch"]["ok"], r["watch"]["text"]


@checks("pp_load")
def a_fresh_job_loads_and_checks_clean(r):
    assert not r["before_ok"]
    assert r["load"]["ok"], r["load"]["text"]
    assert r["after"]["ok"], r["after"]["text"]


@checks("extra_parameter_on_one_rank")
def a_parameter_on_one_rank_only_is_named_the_same_everywhere(r):
    assert r["findings"] == [
        ["extra.bias", "missing", None, 1],
        ["extra.weight", "missing", None, 1],
    ]


@checks("several_model_parts_per_rank")
def a_list_of_model_parts_is_one_model(r):
    assert r["keys"] == 13 * 4 and r["offline_equal"]
    for what in ("clean", "load", "after"):
        assert r[what]["ok"], r[what]["text"]
    assert r["clean"]["keys"] == [52, 52, 52]
    assert r["planted"] == [["head.weight", "value", [2, 4], 1]]
