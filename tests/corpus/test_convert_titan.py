"""Models that declare their own conversion, verified with nothing stated (FSDP2, gloo ranks).

torchtitan 0.3.0's Llama3 (fused q/k/v, split by its own state-dict hooks) against its own DCP
step and its own HF export; transformers' Mixtral (stacked experts) against its own
``save_pretrained``. Scenarios in tests/corpus/convert_titan_scenarios.py; the harness checks every
rank returned the same result.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed")
pytest.importorskip("triton", reason="torchtitan's Llama3 imports triton")
pytest.importorskip("transformers", reason="transformers is not installed")

from tests.corpus.convert_titan_scenarios import FAULTS, PLANT, REGISTRY
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.corpus.convert_titan_scenarios"
CASES = REGISTRY.cases()
checks = Checks(REGISTRY)
#: The model's 21 tensors in its state dict's layout (wq/wk/wv split) and in HF's.
TENSORS = 21


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    checks[name](spawns.result(SCENARIOS_MODULE, world, name), world)


def test_every_scenario_is_checked() -> None:
    assert not checks.missing()


@checks("titan_verified_nothing_stated")
def own_step_and_export_are_ok(r, world):
    for way in ("step", "hf", "hf_adapter", "bf16_cast"):
        assert r[way]["ok"], (way, r[way]["text"])
    # 21 model tensors and 17 parameters' exp_avg, exp_avg_sq and step (in wqkv's name).
    assert r["step"]["keys"] == [TENSORS + 3 * 17] * 3
    assert r["hf"]["keys"] == [TENSORS] * 3
    # Each rank reads the regions its own pieces name: every fp32 element of the export once
    # on 2 ranks (no shard cuts a head), at most twice where 3 ranks' shards cut heads.
    n = r["hf"]["elements"]
    assert n == r["bf16_cast"]["elements"] > 0
    assert 4 * n <= r["hf"]["bytes"] <= 8 * n
    assert 2 * n <= r["bf16_cast"]["bytes"] <= 4 * n
    if world == 2:
        assert r["hf"]["bytes"] == 4 * n
    assert any("state-dict hooks: 21 tensor(s) from 17" in n for n in r["step"]["notes"])
    assert any("Llama3StateDictAdapter.to_hf" in n for n in r["hf"]["notes"])
    # The bf16 export with its cast not stated: a dtype finding per tensor, no value finding.
    assert {f[1] for f in r["bf16_nothing"]["findings"]} == {"dtype"}
    assert len(r["bf16_nothing"]["findings"]) == TENSORS


@checks("titan_planted_exports")
def each_broken_export_names_exactly_its_keys(r, world):
    for fault in FAULTS:
        got = r[fault]
        assert sorted({f[0] for f in got["findings"]}) == r["expected"][fault], got["text"]
        assert {f[1] for f in got["findings"]} == {"value"}, got["text"]
    (f,) = r["one_element"]["findings"]
    # wqkv row 75 is kv group 1's first q head: rank 1's shard on 2 ranks (64..127) and on
    # 3 ranks (43..85).
    assert f == [PLANT[0], "value", list(PLANT[1]), 1]
    assert r["source"] == ["layers.1.attention.qkv_linear.wqkv.weight", [75, 5]]
    assert r["one_element"]["sources"] == [r["source"]]
    assert (
        "at index (45, 5) <- layers.1.attention.qkv_linear.wqkv.weight (75, 5) on rank 1"
        in (r["one_element"]["text"])
    )


@checks("titan_fingerprints")
def fingerprints_in_either_layout(r, world):
    assert r["own_equals_step"] and r["hf_equals_export"]
    assert r["hf_keys"] == TENSORS
    assert "layers.0.attention.qkv_linear.wq.weight" in r["own_keys"]
    assert r["planted_differs"] == [PLANT[0]]


@checks("titan_loaded")
def loaded_through_its_declared_layouts(r, world):
    assert r["step"]["ok"], r["step"]["text"]
    assert r["step_equal"] == [True, True]
    assert r["hf"]["ok"], r["hf"]["text"]
    assert r["hf_equal"]


@checks("mixtral_sharded_nothing_stated")
def mixtral_against_its_own_files(r, world):
    assert r["clean"]["ok"], r["clean"]["text"]
    for fault in ("experts_swapped", "gate_up_swapped", "zeros"):
        got = r[fault]
        assert sorted({f[0] for f in got["findings"]}) == r["expected"][fault], got["text"]
        assert {f[1] for f in got["findings"]} == {"value"}, got["text"]
    (f,) = r["one_element"]["findings"]
    assert f[:3] == [r["expected"]["one_element"][0], "value", [5, 9]]
    assert r["one_element"]["sources"] == [["model.layers.0.mlp.experts.gate_up_proj", [1, 53, 9]]]


@checks("titan_resumed_from_its_hf_export")
def torchtitans_hf_load_checked_through_its_adapter(r, world):
    assert r["loaded"] and r["equal"]
    assert r["report"]["ok"], r["report"]["text"]
    assert r["report"]["keys"] == [TENSORS] * 3
