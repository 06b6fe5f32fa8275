"""fsdpcheck.verify on gloo CPU ranks: FSDP2, HSDP, 2D, DDP, FSDP1, resharding, every reference.

One spawn per world size; each spawn runs many scenarios (tests/verify_scenarios.py). Every
scenario's report comes back from every rank, and every rank must have the same verdict.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_harness import run_ranks


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("verify")


@pytest.fixture(scope="module")
def w4(base: Path) -> dict:
    return _same_on_every_rank(run_ranks(4, "tests.verify_scenarios:world4", base / "w4"))


@pytest.fixture(scope="module")
def w2(base: Path, w4: dict) -> dict:
    del w4  # the world-4 run wrote the checkpoint
    return _same_on_every_rank(run_ranks(2, "tests.verify_scenarios:resharded", base / "w2"))


@pytest.fixture(scope="module")
def w3(base: Path, w4: dict) -> dict:
    del w4
    return _same_on_every_rank(run_ranks(3, "tests.verify_scenarios:resharded", base / "w3"))


def _same_on_every_rank(results: list[dict]) -> dict:
    """Every rank's reports are identical (rank-specific extras are dropped first)."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("planted_offset",)}
        return x

    first = strip(results[0])
    for rank, r in enumerate(results[1:], start=1):
        for name in first:
            assert strip(r[name]) == first[name], f"rank {rank} disagrees on {name}"
    out = dict(results[0])
    out["__all__"] = results
    for name, v in out.items():
        if isinstance(v, dict) and "__error__" in v:
            raise AssertionError(f"scenario {name} raised:\n{v['__error__']}")
    return out


def findings(report: dict, kind: str | None = None) -> list[dict]:
    return [f for f in report["findings"] if kind is None or f["kind"] == kind]


def only_value_finding(report: dict) -> dict:
    assert not report["ok"]
    assert [f["kind"] for f in report["findings"]] == ["value"], report["text"]
    return report["findings"][0]


# ---------------------------------------------------------------------------------------------
def test_clean_fsdp2_load_passes(w4):
    r = w4["clean"]
    assert r["ok"], r["text"]
    assert r["findings"] == []
    assert r["world_size"] == 4
    assert r["keys_checked"] == 13 + 13 * 3  # params + exp_avg, exp_avg_sq, step
    assert r["elements_checked"] > 0 and r["bytes_read"] > 0


def test_one_changed_element_found_at_key_global_index_and_rank(w4):
    f = only_value_finding(w4["one_element"])
    assert f["key"] == "blocks.1.w1.weight"
    assert f["mismatched"] == 1
    assert f["max_abs_index"] == [7, 4]  # rank 2 holds rows 6..8 of 10
    assert f["rank"] == 2
    assert "Mismatched elements: 1 / 60 (1.7%)" in w4["one_element"]["text"]
    assert "at index (7, 4) on rank 2" in w4["one_element"]["text"]


def test_swapped_shards_reported_on_both_ranks(w4):
    f = only_value_finding(w4["swapped"])
    assert f["key"] == "emb.weight"
    assert {f["rank"], f["rel_rank"]} <= {0, 1}
    assert f["max_abs_index"][0] < 4  # rows 0..3 are the swapped ones


def test_shifted_shard(w4):
    f = only_value_finding(w4["shifted"])
    assert f["key"] == "blocks.0.w1.weight"
    assert f["rank"] == 1
    assert 3 <= f["max_abs_index"][0] <= 5  # rank 1's rows


def test_zeroed_optimizer_moment_on_one_rank(w4):
    f = only_value_finding(w4["zeroed_moment"])
    assert f["key"] == "optim.state.blocks.0.w2.weight.exp_avg_sq"
    assert f["rank"] == 1 and f["mismatched"] == 20  # rank 1's 2 rows x 10
    assert f["max_rel_diff"] == 1.0


def test_step_that_differs_on_one_rank(w4):
    r = w4["step_differs"]
    kinds = {f["kind"] for f in r["findings"] if f["key"] == "optim.state.head.bias.step"}
    assert kinds == {"value", "replica"}
    replica = findings(r, "replica")[0]
    assert replica["rank"] == 1 and "ranks [1]" in replica["message"]


def test_missing_step_in_checkpoint(w4):
    r = w4["no_step"]
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [
        ("optim.state.emb.weight.step", "missing")
    ]


def test_dtype_change(w4):
    r = w4["dtype_change"]
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [("head.weight", "dtype")]


def test_shape_change(w4):
    r = w4["shape_change"]
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [("blocks.0.w2.weight", "shape")]
    assert "(6, 11)" in r["findings"][0]["message"]


def test_key_missing_from_checkpoint(w4):
    r = w4["key_missing"]
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [("blocks.1.norm.bias", "missing")]


@pytest.mark.parametrize(
    "kind", ["dcp", "torch.save", "safetensors", "hf-index", "hf-dir", "mapping", "module"]
)
def test_every_reference_kind_passes_clean(w4, kind):
    r = w4["references"][kind]
    assert r["ok"], r["text"]
    assert r["keys_checked"] == 13


def test_tiny_memory_budget_reads_in_pieces_and_passes(w4):
    assert w4["small_budget"]["ok"]
    assert w4["small_budget"]["elements_checked"] == w4["clean"]["elements_checked"]


def test_unreadable_file_on_one_rank_reaches_every_rank(w4):
    r = w4["unreadable"]
    errs = findings(r, "error")
    assert errs and all(f["rank"] == 0 for f in errs)
    assert "reading the reference failed" in errs[0]["message"]


def test_missing_checkpoint_is_one_clear_error(w4):
    r = w4["not_a_checkpoint"]
    assert len(r["findings"]) == 1
    f = r["findings"][0]
    assert f["kind"] == "error" and "does not exist" in f["message"]
    assert f["ranks"] == [0, 1, 2, 3]


def test_hsdp(w4):
    h = w4["hsdp"]
    assert "Replicate" in h["placements"]
    assert h["clean"]["ok"], h["clean"]["text"]
    bad = h["bad"]
    value = findings(bad, "value")
    assert len(value) == 1 and value[0]["rank"] == 3 and value[0]["max_abs_index"] == [5, 0]
    replica = findings(bad, "replica")
    assert len(replica) == 1 and replica[0]["rank"] == 3


def test_2d_fsdp_tp(w4):
    t = w4["two_d"]
    assert "_StridedShard" in t["placements"]["blocks.0.w1.weight"]
    assert t["clean"]["ok"], t["clean"]["text"]
    assert t["vs_full"]["ok"], t["vs_full"]["text"]
    f = only_value_finding(t["bad"])
    offset = w4["__all__"][2]["two_d"]["planted_offset"]
    assert f["key"] == "blocks.1.w1.weight"
    assert f["rank"] == 2 and f["max_abs_index"] == [offset[0], 1]


def test_1d_checkpoint_loaded_into_2d(w4):
    assert w4["two_d"]["resharded"]["ok"], w4["two_d"]["resharded"]["text"]


def test_ddp_plain_replicas(w4):
    d = w4["ddp"]
    assert d["clean"]["ok"]
    value = findings(d["bad"], "value")
    assert value[0]["key"] == "head.bias" and value[0]["rank"] == 3
    assert value[0]["max_abs_index"] == [2]
    assert findings(d["bad"], "replica")[0]["rank"] == 3


def test_fsdp1_sharded_state_dict(w4):
    f1 = w4["fsdp1"]
    assert f1["kinds"] == ["ShardedTensor"]
    assert f1["clean"]["ok"], f1["clean"]["text"]
    f = only_value_finding(f1["bad"])
    assert f["key"] == "blocks.0.w1.weight" and f["rank"] == 1


@pytest.mark.parametrize("world", [2, 3])
def test_resharded_loads(world, w2, w3):
    r = {2: w2, 3: w3}[world]
    # Before the load the fresh model differs everywhere; after it, nothing does.
    assert not r["before_load"]["ok"]
    assert r["after_load"]["ok"], r["after_load"]["text"]
    assert r["after_load"]["world_size"] == world
    f = only_value_finding(r["planted"])
    assert f["key"] == "emb.weight" and f["rank"] == world - 1
    assert f["max_abs_index"] == [6, 5]  # the last row and column live on the last rank


def test_layouts_that_are_not_boxes_are_layout_findings(w4):
    r = w4["layouts"]
    assert [(f["key"], f["kind"]) for f in r["findings"]] == [
        ("partial", "layout"),
        ("strided_1d", "layout"),
        ("strided_2d", "layout"),
    ], r["text"]
    assert "Partial" in r["findings"][0]["message"]
    assert "not a box" in r["findings"][1]["message"]
    assert r["keys_checked"] == 4  # box_2d checked and clean


# --- fingerprint / save / load on several ranks --------------------------------------------------
def test_fingerprints_identical_across_layouts_and_offline(w4, w2, w3):
    fp = w4["fp_layouts"]
    assert fp["fsdp"] == fp["plain"] == fp["hsdp"] == fp["2d"]
    assert fp["offline"] == fp["fsdp"] == fp["live_fresh"]
    assert len(fp["fsdp"]) == 13 * 4
    # Loaded at 2 and 3 ranks: the same numbers.
    assert w2["fingerprints"] == fp["fsdp"]
    assert w3["fingerprints"] == fp["fsdp"]


def test_fingerprint_faults_change_exactly_the_affected_keys(w4):
    f = w4["fp_faults"]
    assert f["swapped"] == ["emb.weight"]
    assert f["shifted"] == ["blocks.0.w1.weight"]
    assert f["bit"] == ["blocks.1.norm.bias"]
    assert f["restored"] == []


def test_diverged_replica_found_with_its_ranks(w4):
    r = w4["replicas"]
    assert r["clean"]["ok"], r["clean"]["text"]
    bad = r["bad"]
    assert [(f["key"], f["kind"]) for f in bad["findings"]] == [("blocks.1.w2.weight", "replica")]
    assert bad["findings"][0]["rank"] == 2 and "ranks [2]" in bad["findings"][0]["message"]
    assert r["fingerprint_raised"] is None  # the lowest rank's copy counts; check_replicas tells


def test_save_then_load_fingerprint_verified(w4):
    s = w4["save_load"]
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


def test_a_failure_on_one_rank_reaches_every_rank_without_a_hang(w4):
    r = w4["one_rank_fails"]
    (f,) = r["verify"]["findings"]
    assert f["kind"] == "error" and f["rank"] == 2 and "simulated" in f["message"]
    assert r["load_error"] is not None
    assert "failed on rank 1" in r["load_error"] and "simulated" in r["load_error"]
