"""fsdpcheck.integrations.accelerate with accelerate's real save_state / load_state (2 ranks)."""

from __future__ import annotations

import pytest

from tests.dist_harness import run_ranks

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def acc(tmp_path_factory) -> dict:
    results = run_ranks(2, "tests.accelerate_scenarios:main", tmp_path_factory.mktemp("acc"))
    for name, v in results[0].items():
        if isinstance(v, dict) and "__error__" in v:
            raise AssertionError(f"{name} raised:\n{v['__error__']}")
    assert results[0] == results[1], "the ranks disagree"
    return results[0]


def test_accelerate_wrote_sharded_state(acc):
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(acc["saved"])


def test_clean_load_state_verifies(acc):
    assert not acc["clean"]["before"]["ok"]  # perturbed: every parameter differs
    after = acc["clean"]["after"]
    assert after["ok"], after["text"]
    assert after["keys"] == 13 * 4  # parameters + exp_avg, exp_avg_sq, step


def test_missing_optimizer_step(acc):
    r = acc["missing_step"]
    assert [(k, kind) for k, kind, _ in r["findings"]] == [
        ("optim.state.blocks.0.w1.weight.step", "missing")
    ]


def test_dropped_optimizer_moment(acc):
    r = acc["dropped_moment"]
    assert [(k, kind) for k, kind, _ in r["findings"]] == [
        ("optim.state.head.weight.exp_avg", "missing")
    ]


def test_load_and_inspect_recognise_the_directory(acc):
    li = acc["load_and_inspect"]
    assert li["load"]["ok"], li["load"]["text"]
    assert li["kind"] == "sharded" and "accelerate" in li["format"]
    assert li["tensors"] == 52


def test_state_saved_full_then_loaded_sharded(acc):
    f = acc["full_then_sharded"]
    assert "pytorch_model_fsdp.bin" in f["files"] and "optimizer.bin" in f["files"]
    # The sharded model never got the full state: every parameter is a clear value finding.
    assert not f["report"]["ok"]
    assert {kind for _, kind, _ in f["report"]["findings"]} == {"value"}
    assert f["refused"] is not None and "expected a sharded checkpoint" in f["refused"]
    assert f["loaded"]["ok"], f["loaded"]["text"]  # fsdpcheck.load takes it the full way
