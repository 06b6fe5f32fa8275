"""FSDP1 model and optimizer state verified from the flat runs, against torch and accelerate saves.

The torch FSDP1 scenarios (tests/dist/fsdp1/fsdp1_scenarios.py) run in the 2- and 4-rank spawns the
other multi-rank tests share; accelerate's run in a 2-rank spawn of their own (they change
process-wide accelerate state). Each check: no error on any rank, the ranks agree, and the
checks below hold.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist.fsdp1.fsdp1_scenarios import (
    ACCELERATE,
    LIVE_MOMENT,
    MODES,
    PLANT_MOMENT,
    PLANT_WEIGHT,
    REGISTRY,
)
from tests.dist_harness import Checks, Spawns, run_ranks

SCENARIOS_MODULE = "tests.dist.fsdp1.fsdp1_scenarios"
CASES = REGISTRY.cases()
CHECKS = checks = Checks(REGISTRY)
N_KEYS = 8 * 4  # 8 parameters; exp_avg, exp_avg_sq and step of each


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    result = spawns.result(SCENARIOS_MODULE, world, name)
    if name == "live_moment":
        result["held"] = [
            r["rank_local"]["held"] for r in spawns.per_rank(SCENARIOS_MODULE, world, name)
        ]
    CHECKS[name](result, world)


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


def _ok(r: dict[str, Any]) -> None:
    assert r["ok"], r["text"]
    assert r["counts"] == [N_KEYS, N_KEYS, N_KEYS], r["text"]
    # Every rank names the same keys, holding a parameter's state or not (one digest agrees on
    # them): no rank's key list differs as pipeline stages' do.
    assert not any("different sets of keys" in n for n in r.get("notes", [])), r["text"]


def _key(spot: tuple[str, str | None, tuple[int, ...]]) -> str:
    fqn, name, _ = spot
    return fqn if name is None else f"optim.state.{fqn}.{name}"


def _holder(spot: tuple[str, str | None, tuple[int, ...]], world: int) -> int:
    """The rank whose flat run holds the element: the toy's FlatParameters under the nested wrap.

    A pure reference: each Block is one FlatParameter (weight 64 then bias 8 elements), the
    root's holds embed (80), norm (8 + 8) and head (80) in that order; each is padded to a
    multiple of `world` and cut into `world` equal runs.
    """
    fqn, _, index = spot
    groups = {
        "layers.0.": [("layers.0.proj.weight", (8, 8)), ("layers.0.proj.bias", (8,))],
        "layers.1.": [("layers.1.proj.weight", (8, 8)), ("layers.1.proj.bias", (8,))],
        "": [("embed.weight", (10, 8)), ("norm.weight", (8,)), ("norm.bias", (8,)),
             ("head.weight", (10, 8))],
    }  # fmt: skip
    for members in groups.values():
        at = 0
        for name, shape in members:
            if name == fqn:
                lin = 0
                for i, s in zip(index, shape):
                    lin = lin * s + i
                total = sum(_numel(s) for _, s in members)
                per_rank = -(-total // world)
                return (at + lin) // per_rank
            at += _numel(shape)
    raise KeyError(fqn)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@checks("clean")
def clean_saves_verify_and_fingerprint(r: dict[str, Any], world: int) -> None:
    for mode in MODES:
        _ok(r[mode]["verify"])
        # The live flat runs hash to what torch's own save holds, key by key.
        assert r[mode]["live_fp"] == r[mode]["offline_fp"]
        assert len(r[mode]["live_fp"]) == N_KEYS


@checks("planted")
def planted_twin_named_at_key_index_and_rank(r: dict[str, Any], world: int) -> None:
    # The model's weight is a row-chunked ShardedTensor (row 0: rank 0); the moment is in the
    # flat run of the rank holding the element.
    for mode in MODES:
        got = sorted((k, kind, tuple(i), rank) for k, kind, i, rank in r[mode]["findings"])
        assert got == sorted(
            [
                (_key(PLANT_WEIGHT), "value", PLANT_WEIGHT[2], 0),
                (_key(PLANT_MOMENT), "value", PLANT_MOMENT[2], _holder(PLANT_MOMENT, world)),
            ]
        ), r[mode]["text"]


@checks("live_moment")
def live_moment_named_once(r: dict[str, Any], world: int) -> None:
    holder = _holder(LIVE_MOMENT, world)
    for mode in MODES:
        # Exactly the rank the reference says holds it changed it, and only that rank is named.
        assert [h[mode] for h in r["held"]] == [rank == holder for rank in range(world)]
        assert [(k, kind, tuple(i), rank) for k, kind, i, rank in r[mode]["findings"]] == [
            (_key(LIVE_MOMENT), "value", LIVE_MOMENT[2], holder)
        ], r[mode]["text"]


@checks("not_stepped")
def optimizer_without_state_is_one_finding(r: dict[str, Any], world: int) -> None:
    for mode in MODES:
        assert not r[mode]["ok"]
        assert [(k, kind) for k, kind, _, _ in r[mode]["findings"]][:1] == [
            ("optim.state", "missing")
        ], r[mode]["text"]


@checks("zero_rows")
def zero_row_rank(r: dict[str, Any], world: int) -> None:
    for mode in MODES:
        v = r[mode]["verify"]
        assert v["ok"], v["text"]
        assert v["counts"] == [16, 16, 16]
        # fsdpcheck.load pairs and loads every key itself: it works where a rank holds no rows.
        assert r[mode]["load_error"] is None
        assert r[mode]["load"]["ok"], r[mode]["load"]["text"]
        # torch's own resume recipe there (torch 2.13) fails on the rank holding no rows, naming a
        # key that is in the checkpoint: "Missing key in checkpoint state_dict:
        # optim.param_groups."
        said = r[mode]["torch_load_error"]
        assert said is None or "Missing key in checkpoint state_dict" in said, said


# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("accelerate")
    per_rank = run_ranks(2, ACCELERATE, tmp_path_factory.mktemp("accelerate_fsdp1"))
    assert per_rank[0] == per_rank[1]  # every rank reports the same
    return per_rank[0]


def test_accelerate_default_plugin_is_fsdp1_full_state(accelerate_run: dict[str, Any]) -> None:
    full = accelerate_run["FULL_STATE_DICT"]
    assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(full["files"])
    assert accelerate_run["use_orig_params"] is False


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_accelerate_save_state_verifies(accelerate_run: dict[str, Any], kind: str) -> None:
    r = accelerate_run[kind]
    _ok(r["clean"])
    _ok(r["direct"])
    got = sorted((k, kind_, tuple(i), rank) for k, kind_, i, rank in r["planted"]["findings"])
    assert got == sorted(
        [
            (_key(PLANT_WEIGHT), "value", PLANT_WEIGHT[2], 0),
            # accelerate wraps the root only: one FlatParameter of all 320 elements, 160 a rank.
            (_key(PLANT_MOMENT), "value", PLANT_MOMENT[2], 1),
        ]
    ), r["planted"]["text"]


def test_holder_reference() -> None:
    # head.weight (9, 7) is the root FlatParameter's last element: the last rank's.
    assert _holder(PLANT_MOMENT, 2) == 1 and _holder(PLANT_MOMENT, 4) == 3
    assert _holder(("embed.weight", None, (0, 0)), 4) == 0
    assert _holder(LIVE_MOMENT, 2) == 1  # element 42 of 72: the second run of 36
