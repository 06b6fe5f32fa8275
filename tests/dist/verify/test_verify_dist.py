"""fsdpcheck.verify on gloo CPU ranks: FSDP2, HSDP, 2D, DDP, FSDP1, resharding, every reference.

The scenarios are registered functions in tests/dist/verify/verify_scenarios.py; one spawn per
world size (the ``spawns`` fixture) runs those the selected tests need.
``test_scenario[w4-one_element]`` checks that scenario: it ran without an error on every rank,
every rank got the same result, and its checks (registered here under the scenario's name) hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.dist.verify.verify_scenarios import REGISTRY
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.verify.verify_scenarios"
CASES = REGISTRY.cases()


@dataclass
class Case:
    world: int
    name: str
    spawns: Spawns

    def on_rank(self, rank: int) -> Any:
        return self.spawns.per_rank(SCENARIOS_MODULE, self.world, self.name)[rank]

    def other(self, world: int, name: str) -> Any:
        return self.spawns.result(SCENARIOS_MODULE, world, name)


CHECKS = checks = Checks(REGISTRY)


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    CHECKS[name](spawns.result(SCENARIOS_MODULE, world, name), Case(world, name, spawns))


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


def findings(report: dict, kind: str | None = None) -> list[dict]:
    return [f for f in report["findings"] if kind is None or f["kind"] == kind]


def only_value_finding(report: dict) -> dict:
    assert not report["ok"]
    assert [f["kind"] for f in report["findings"]] == ["value"], report["text"]
    return report["findings"][0]


# ---------------------------------------------------------------------------------------------
@checks("clean")
def clean_fsdp2_load_passes(r, case):
    assert r["ok"], r["text"]
    assert r["findings"] == []
    assert r["world_size"] == 4
    assert r["keys_checked"] == 13 + 13 * 3  # params + exp_avg, exp_avg_sq, step
    assert r["elements_checked"] > 0 and r["bytes_read"] > 0


@checks("one_element")
def one_changed_element_found_at_key_global_index_and_rank(r, case):
    f = only_value_finding(r)
    assert f["key"] == "blocks.1.w1.weight"
    assert f["mismatched"] == 1
    assert f["max_abs_index"] == [7, 4]  # rank 2 holds rows 6..8 of 10
    assert f["rank"] == 2
    assert "Mismatched elements: 1 / 60 (1.7%)" in r["text"]
    assert "at index (7, 4) on rank 2" in r["text"]


@checks("swapped")
def swapped_shards_reported_on_both_ranks(r, case):
    f = only_value_finding(r)
    assert f["key"] == "emb.weight"
    assert {f["rank"], f["rel_rank"]} <= {0, 1}
    assert f["max_abs_index"][0] < 4  # rows 0..3 are the swapped ones


@checks("shifted")
def shifted_shard(r, case):
    f = only_value_finding(r)
    assert f["key"] == "blocks.0.w1.weight"
    assert f["rank"] == 1
    assert 3 <= f["max_abs_index"][0] <= 5  # rank 1's rows


@checks("zeroed_moment")
def zeroed_optimizer_moment_on_one_rank(r, case):
    f = only_value_finding(r)
    assert f["key"] == "optim.state.blocks.0.w2.weight.exp_avg_sq"
    assert f["rank"] == 1 and f["mismatched"] == 20  # rank 1's 2 rows x 10
    assert f["max_rel_diff"] == 1.0


@checks("step_differs")
def step_that_differs_on_one_rank(r, case):
    kinds = {f["kind"] for f in r["findings"] if f["key"] == "optim.state.head.bias.step"}
    assert kinds == {"value", "replica"}
    replica = findings(r, "replica")[0]
    assert replica["rank"] == 1 and "ranks [1]" in replica["message"]


@checks("no_step")
def missing_step_in_checkpoint(r, case):
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [
        ("optim.state.emb.weight.step", "missing")
    ]


@checks("dtype_change")
def dtype_change(r, case):
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [("head.weight", "dtype")]


@checks("shape_change")
def shape_change(r, case):
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [("blocks.0.w2.weight", "shape")]
    assert "(6, 11)" in r["findings"][0]["message"]


@checks("key_missing")
def key_missing_from_checkpoint(r, case):
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [("blocks.1.norm.bias", "missing")]


@checks("references")
def every_reference_kind_passes_clean(r, case):
    kinds = ["dcp", "torch.save", "safetensors", "hf-index", "hf-dir", "mapping", "module"]
    assert sorted(r) == sorted(kinds)
    for kind in kinds:
        assert r[kind]["ok"], f"{kind}: {r[kind]['text']}"
        assert r[kind]["keys_checked"] == 13, kind


@checks("small_budget")
def tiny_memory_budget_reads_in_pieces_and_passes(r, case):
    assert r["ok"], r["text"]
    assert r["elements_checked"] == case.other(4, "clean")["elements_checked"]


@checks("unreadable")
def unreadable_file_on_one_rank_reaches_every_rank(r, case):
    # The truncation is a storage problem seen when the checkpoint is opened (rank 0 truncates
    # before opening; the others may open before or after): findings naming the file, on every
    # rank the same, and the keys stored there are never read.
    errs = findings(r, "error")
    assert errs and not r["ok"]
    assert all("__0_0.distcp" in f["message"] and "truncated" in f["message"] for f in errs)
    assert all(f["rank"] in (0, None) for f in errs)


@checks("not_a_checkpoint")
def missing_checkpoint_is_one_clear_error(r, case):
    assert len(r["findings"]) == 1
    f = r["findings"][0]
    assert f["kind"] == "error" and "does not exist" in f["message"]
    assert f["ranks"] == [0, 1, 2, 3]


@checks("hsdp")
def hsdp(h, case):
    assert "Replicate" in h["placements"]
    assert h["clean"]["ok"], h["clean"]["text"]
    bad = h["bad"]
    value = findings(bad, "value")
    assert len(value) == 1 and value[0]["rank"] == 3 and value[0]["max_abs_index"] == [5, 0]
    replica = findings(bad, "replica")
    assert len(replica) == 1 and replica[0]["rank"] == 3


@checks("two_d")
def fsdp_tp_2d_and_a_1d_checkpoint_loaded_into_2d(t, case):
    assert "_StridedShard" in t["placements"]["blocks.0.w1.weight"]
    assert t["clean"]["ok"], t["clean"]["text"]
    assert t["vs_full"]["ok"], t["vs_full"]["text"]
    f = only_value_finding(t["bad"])
    offset = case.on_rank(2)["rank_local"]["planted_offset"]
    assert f["key"] == "blocks.1.w1.weight"
    assert f["rank"] == 2 and f["max_abs_index"] == [offset[0], 1]
    assert t["resharded"]["ok"], t["resharded"]["text"]


@checks("ddp")
def ddp_plain_replicas(d, case):
    assert d["clean"]["ok"]
    value = findings(d["bad"], "value")
    assert value[0]["key"] == "head.bias" and value[0]["rank"] == 3
    assert value[0]["max_abs_index"] == [2]
    assert findings(d["bad"], "replica")[0]["rank"] == 3


@checks("fsdp1")
def fsdp1_sharded_state_dict(f1, case):
    assert f1["kinds"] == ["ShardedTensor"]
    assert f1["clean"]["ok"], f1["clean"]["text"]
    f = only_value_finding(f1["bad"])
    assert f["key"] == "blocks.0.w1.weight" and f["rank"] == 1


@checks("layouts")
def layouts_that_are_not_boxes_are_layout_findings(r, case):
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [
        ("partial", "layout"),
        ("strided_1d", "layout"),
        ("strided_2d", "layout"),
    ], r["text"]
    assert "Partial" in r["findings"][0]["message"]
    assert "not a box" in r["findings"][1]["message"]
    # Four keys matched; only box_2d could be compared (and is clean).
    assert r["keys_checked"] == 1 and r["keys_a"] == 4 and r["keys_b"] == 4


# --- fingerprint / save / load on several ranks ---------------------------------------------------
@checks("fp_layouts")
def fingerprints_identical_across_layouts_and_offline(fp, case):
    assert fp["fsdp"] == fp["plain"] == fp["hsdp"] == fp["2d"]
    assert fp["offline"] == fp["fsdp"] == fp["live_fresh"]
    assert len(fp["fsdp"]) == 13 * 4


@checks("fp_faults")
def fingerprint_faults_change_exactly_the_affected_keys(f, case):
    assert f["swapped"] == ["emb.weight"]
    assert f["shifted"] == ["blocks.0.w1.weight"]
    assert f["bit"] == ["blocks.1.norm.bias"]
    assert f["restored"] == []


@checks("replicas")
def diverged_replica_found_with_its_ranks(r, case):
    assert r["clean"]["ok"], r["clean"]["text"]
    bad = r["bad"]
    assert [(f["key"], f["kind"]) for f in bad["findings"]] == [("blocks.1.w2.weight", "replica")]
    assert bad["findings"][0]["rank"] == 2 and "ranks [2]" in bad["findings"][0]["message"]
    assert r["fingerprint_raised"] is None  # the lowest rank's copy counts; check_replicas tells


@checks("save_load")
def save_then_load_fingerprint_verified(s, case):
    assert s["manifest_world"] == 4 and s["manifest_meshes"] == ["(4,)"]
    assert s["clean"]["ok"], s["clean"]["text"]
    c = s["corrupted"]
    assert [(f["key"], f["kind"]) for f in c["findings"]] == [("blocks.0.w1.weight", "value")]
    assert "fingerprint" in c["findings"][0]["message"]
    assert s["refused"] is not None and "expected a sharded checkpoint" in s["refused"]
    assert "nothing was loaded" in s["refused"]
    assert s["untouched"]
    assert s["full_load"]["ok"], s["full_load"]["text"]
    assert s["full_same_fingerprints"]


@checks("one_rank_fails")
def a_failure_on_one_rank_reaches_every_rank_without_a_hang(r, case):
    (f,) = r["verify"]["findings"]
    assert f["kind"] == "error" and f["rank"] == 2 and "simulated" in f["message"]
    assert r["load_error"] is not None
    assert "failed on rank 1" in r["load_error"] and "simulated" in r["load_error"]


@checks("one_rank_differs")
def inputs_that_differ_on_one_rank_give_one_verdict_everywhere(r, case):
    # (The harness also checks that every rank returned exactly this.)
    assert r["load_missing_on_1"].startswith("FileNotFoundError: ")
    assert "on rank 1" in r["load_missing_on_1"] and "does not exist" in r["load_missing_on_1"]
    assert r["load_untouched"]
    assert "different paths" in r["save_paths_differ"] and r["save_wrote_nothing"]
    dtype = findings(r["dtype_on_3"], "dtype")
    assert [(f["key"], f["rank"]) for f in dtype] == [("head.bias", 3)], r["dtype_on_3"]["text"]
    assert r["fingerprint_extra_on_2"] == {"extra.weight": f"{fingerprint_of_ones(3):#x}"}
    assert r["replicas_extra_on_2"]["ok"], r["replicas_extra_on_2"]["text"]
    (f,) = r["verify_extra_on_2"]["findings"]
    assert (f["key"], f["kind"], f["rank"]) == ("extra.weight", "missing", 2)
    assert "2 different sets of keys" in r["verify_extra_on_2"]["text"]
    (f,) = findings(r["param_groups_fail_on_1"])
    assert (f["key"], f["kind"], f["rank"]) == ("optim.param_groups", "error", 1)
    assert "simulated on rank 1" in f["message"]


def fingerprint_of_ones(n: int) -> int:
    import torch

    import fsdpcheck

    return fsdpcheck.fingerprint_tensor(torch.ones(n))


# --- the world-4 checkpoint loaded at 2 and 3 ranks -----------------------------------------------
@checks("reshard_before_load")
def before_the_load_the_fresh_model_differs(r, case):
    assert not r["ok"]


@checks("reshard_after_load")
def after_the_load_nothing_differs(r, case):
    assert r["ok"], r["text"]
    assert r["world_size"] == case.world


@checks("reshard_planted")
def planted_after_resharding_found_on_the_last_rank(r, case):
    f = only_value_finding(r)
    assert f["key"] == "emb.weight" and f["rank"] == case.world - 1
    assert f["max_abs_index"] == [6, 5]  # the last row and column live on the last rank


@checks("reshard_fingerprints")
def loaded_at_another_world_size_the_same_fingerprints(fps, case):
    assert fps == case.other(4, "fp_layouts")["fsdp"]


@checks("demo_outcomes")
def demo_rows_as_expected_at_this_world_size(rows, case):
    assert len(rows) == 9
    assert [r for r in rows if not r["ok"]] == []
    assert rows[0]["scenario"].startswith(f"save FSDP2 x{case.world}, reload on")
