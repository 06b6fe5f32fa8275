"""verify and fingerprint through a conversion on FSDP2 gloo ranks: scenarios in
tests/dist/convert/convert_scenarios.py (the harness checks every rank returned the same report)."""

from __future__ import annotations

import pytest

from tests import convert_cases as cc
from tests.dist.convert.convert_scenarios import REGISTRY
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.convert.convert_scenarios"
CASES = REGISTRY.cases()
checks = Checks(REGISTRY)
TARGETS = 2 + 10 * cc.LAYERS
ELEMENTS = sum(v.numel() for v in cc.source_state().values())


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    checks[name](spawns.result(SCENARIOS_MODULE, world, name), world)


def test_every_scenario_is_checked() -> None:
    assert not checks.missing()


@checks("verify_through_conversion")
def clean_is_ok_each_way(r, world):
    for way in ("callable", "adapter", "spec", "small_budget", "bf16"):
        assert r[way]["ok"], (way, r[way]["text"])
        assert r[way]["keys"] == [TARGETS, TARGETS, TARGETS], way
        assert r[way]["elements"] == ELEMENTS, way
        # Each rank reads the reference regions its own pieces name: over all ranks, every
        # element once, and where a shard cuts a head at most twice its rows.
        itemsize = 2 if way == "bf16" else 4
        assert ELEMENTS * itemsize <= r[way]["bytes"] <= 2 * ELEMENTS * itemsize, way
        if world == 2 and way != "small_budget":
            assert r[way]["bytes"] == ELEMENTS * itemsize, way  # no shard cuts a head
    # The bf16 file against a conversion that does not cast: dtype findings, values compared
    # within bf16's tolerance (a cast must be stated to be compared exactly).
    kinds = {f[1] for f in r["bf16_without_cast"]["findings"]}
    assert kinds == {"dtype"}, r["bf16_without_cast"]["text"]
    assert "names pair; the two sides use different naming" in r["no_convert"]["text"]


@checks("verify_planted_conversion_bugs")
def each_bug_names_exactly_its_keys(r, world):
    for fault, keys in cc.FAULTS.items():
        for way, got in r[fault].items():
            assert sorted({f[0] for f in got["findings"]}) == sorted(keys), (
                fault,
                way,
                got["text"],
            )
            assert {f[1] for f in got["findings"]} == {"value"}, (fault, way)
    # Source row 19 of wq: rank 1's shard on 2 ranks (16..31) and on 3 ranks (11..21).
    for way, got in r["one_element"].items():
        assert got["findings"] == [[cc.PLANT[0], "value", list(cc.PLANT[1]), 1]], (way, got["text"])
        assert got["sources"] == [["layers.1.attention.wq.weight", [19, 5]]]
        assert "at index (21, 5) <- layers.1.attention.wq.weight (19, 5) on rank 1" in got["text"]


@checks("fingerprint_through_conversion")
def live_fingerprints_in_converted_coordinates(r, world):
    assert r["clean"] and r["bf16"] and r["spec_equal"]
    assert r["clean_keys"] == TARGETS
    assert r["planted_differs"] == [cc.PLANT[0]]


@checks("sharded_files_on_both_sides")
def sharded_files_agree_through_the_conversion(r, world):
    assert r["verify"]["ok"], r["verify"]["text"]
    assert r["compare"]["ok"], r["compare"]["text"]
    assert r["compare"]["elements"] == ELEMENTS
    assert r["fingerprints_equal"] == [True, True]
