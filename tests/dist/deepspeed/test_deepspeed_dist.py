"""A live DeepSpeed ZeRO-3 engine, verified and fingerprinted from its partitions (2 ranks).

The scenarios of tests/dist/deepspeed/deepspeed_scenarios.py run in the 2-rank spawn that the other
multi-rank tests share (the ``spawns`` fixture); ``test_scenario[w2-<name>]`` checks one: no error
on any rank, the ranks agree, its checks hold.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("deepspeed")

from tests.dist.deepspeed.deepspeed_scenarios import PLANTS, REGISTRY
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.deepspeed.deepspeed_scenarios"
CASES = REGISTRY.cases()
CHECKS = checks = Checks(REGISTRY)
INSTEAD = (
    "verify the consolidated weights instead (zero_to_fp32.py output, or a state dict of the "
    "parameters gathered with deepspeed.zero.GatheredParameters)"
)


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    result = spawns.result(SCENARIOS_MODULE, world, name)
    if name == "layout":
        result = [r["rank_local"] for r in spawns.per_rank(SCENARIOS_MODULE, world, name)]
    CHECKS[name](result)


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


@checks("layout")
def partitions_cut_into_boxes(per_rank: list[dict[str, Any]]) -> None:
    r0, r1 = per_rank
    assert {n: v["data"] for n, v in r0.items()} == {n: [0] for n in r0}  # placeholders
    assert [v["description"] for v in r1.values()] == ["DeepSpeed ZeRO-3 partition 1 of 2"] * 5
    # conv.weight (5, 3, 3), flat [0, 23) and [23, 45): whole rows, then partial ones.
    assert r0["conv.weight"]["boxes"] == [
        [[0, 0, 0], [2, 3, 3]],
        [[2, 0, 0], [1, 1, 3]],
        [[2, 1, 0], [1, 1, 2]],
    ]
    assert r1["conv.weight"]["boxes"] == [
        [[2, 1, 2], [1, 1, 1]],
        [[2, 2, 0], [1, 1, 3]],
        [[3, 0, 0], [2, 3, 3]],
    ]
    # lin.weight (7, 5), flat [0, 18) and [18, 35) (one padding element on rank 1).
    assert r0["lin.weight"]["boxes"] == [[[0, 0], [3, 5]], [[3, 0], [1, 3]]]
    assert r1["lin.weight"]["boxes"] == [[[3, 3], [1, 2]], [[4, 0], [3, 5]]]
    # scale (1,): rank 1's partition is padding only.
    assert (r0["scale"]["boxes"], r1["scale"]["boxes"]) == ([[[0], [1]]], [])


def _clean(r: dict[str, Any], total: int) -> None:
    assert r["ok"], r["text"]
    assert (r["keys_a"], r["keys_b"], r["keys_checked"]) == (5, 5, 5)
    assert r["elements_checked"] == total == 93
    assert r["gathered"] == []  # nothing was gathered


@checks("clean")
def clean_against_zero_to_fp32(r: dict[str, Any]) -> None:
    for call in ("engine", "module", "folder"):
        _clean(r[call], r["total"])


@checks("fingerprints")
def fingerprint_equals_plain_model(r: dict[str, Any]) -> None:
    assert r["live"] == r["plain"] == r["offline"]
    assert sorted(r["live"]) == ["conv.bias", "conv.weight", "lin.bias", "lin.weight", "scale"]
    assert r["replicas"]["ok"] and r["replicas"]["keys_checked"] == 5
    assert r["gathered"] == []


@checks("planted_elements")
def planted_named_at_global_index_and_rank(r: dict[str, Any]) -> None:
    assert r["holders"] == {k: rank for k, (_, rank) in PLANTS.items()}
    assert r["findings"] == [
        ["conv.weight", "value", [2, 1, 1], 0, ""],
        ["lin.weight", "value", [3, 4], 1, ""],
    ]
    assert "at index (3, 4) on rank 1" in r["report"]["text"]
    assert r["report"]["elements_checked"] == 93
    assert r["report"]["gathered"] == []


@checks("gathered_parameters")
def gathered_status_does_not_matter(r: dict[str, Any]) -> None:
    assert len(r["inside"]) == 5
    assert r["clean"]["ok"] and r["clean"]["elements_checked"] == 93, r["clean"]["text"]
    assert r["planted"] == [["lin.weight", "value", [3, 4], 1, ""]]


@checks("with_optimizer")
def optimizer_refused_in_one_line(r: dict[str, Any]) -> None:
    why = (
        "DeepSpeed ZeRO-3 keeps the optimizer state in flat partitions that "
        "fsdpcheck does not map to parameters, so it cannot be verified: call without "
        "optimizer= to verify the model"
    )
    for call in ("engine", "torch"):
        [[key, kind, index, _, message]] = r[call]
        assert (key, kind, index) == ("*", "error", None)
        assert message == why  # every rank's error (the finding's ranks say so)
    assert r["fingerprint"] == f"reading the live state failed on rank 0 (and on ranks [1]): {why}"


@checks("attribute_missing")
def missing_attribute_refused_in_one_line(r: dict[str, Any]) -> None:
    [[key, kind, _, _, message]] = r["findings"]
    assert (key, kind) == ("*", "error")
    assert message.startswith(
        "conv.bias (and 4 more parameter(s)): a DeepSpeed ZeRO-3 parameter without "
        f"ds_process_group (another DeepSpeed version?): its partition cannot be located; {INSTEAD}"
    )


@checks("group_rank")
def partition_rank_is_the_group_rank(r: dict[str, Any]) -> None:
    # Global rank 1 holds partition 0 of its one-rank group: the whole tensor, a replica.
    assert r["layout"] == ["DeepSpeed ZeRO-3 partition 0 of 1", True, [[0, 0]]]
    # Each element once, though both ranks hold (and compare) a copy.
    assert r["clean"]["ok"] and r["clean"]["elements_checked"] == r["numel"]
    assert r["planted"] == [
        ["a", "value", [1, 2], 1, ""],
        [
            "a",
            "replica",
            None,
            1,
            "copies of the same elements differ across ranks: ranks [0] hold one value, ranks "
            "[1] another",
        ],
    ]
    live, plain = r["fingerprints"]
    assert live == plain
