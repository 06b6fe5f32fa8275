"""Checkpoints in object storage on 2 FSDP2 ranks (tests/dist/s3/s3_scenarios.py), against moto's
server.

verify of the live model against ``s3://`` (clean, and one element planted on rank 1, named at
its key, index and rank), load from and save to ``s3://``, the offline commands spread over the
ranks; and, from each rank's own port of the proxy, the byte ranges it fetched: every one inside
a chunk (or value) that rank needs to check its own shards, nothing from anyone else's.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.s3.s3_scenarios"
from tests.dist.s3.s3_scenarios import REGISTRY  # noqa: E402

CHECKS = Checks(REGISTRY)


@pytest.mark.parametrize("case", REGISTRY.cases(), ids=lambda c: f"w{c[0]}-{c[1]}")
def test_scenario(case: tuple[int, str], spawns: Spawns, s3_server: Any) -> None:
    world, name = case
    CHECKS[name](spawns.result(SCENARIOS_MODULE, world, name), spawns, world, name)


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


def _inside(get: list[Any], needed: list[list[Any]]) -> bool:
    key, lo, hi = get[0], get[1], get[2]
    return any(key == k and s <= lo and hi < e for k, s, e in needed)


@CHECKS("verify_clean")
def _(r: dict, spawns: Spawns, world: int, name: str) -> None:
    assert r["report"]["ok"], r["report"]["text"]
    assert r["report"]["keys_checked"] == 13 * 4  # params, exp_avg, exp_avg_sq, step
    per_rank = [x["rank_local"] for x in spawns.per_rank(SCENARIOS_MODULE, world, name)]
    data_bytes = []
    for rank, mine in enumerate(per_rank):
        data = [g for g in mine["fetched"] if g[0].endswith(".distcp")]
        assert data and all(g[4] == 206 for g in data), data
        # Every byte range lies inside a chunk (or value) this rank needs: nothing else.
        stray = [g for g in data if not _inside(g, mine["needed"])]
        assert not stray, (rank, stray)
        # The big tensors' chunks of the other rank are never touched: its own file only,
        # but for what rank 0 alone saved (replicated values: steps, hyperparameters).
        other = f"__{1 - rank}_0.distcp"
        big = [g for g in data if g[0].endswith(other) and g[3] > 4096]
        assert not big, (rank, big)
        # At most what the needed blobs hold (no blob is fetched twice over).
        assert sum(g[3] for g in data) <= sum(e - s for _, s, e in mine["needed"])
        data_bytes.append(sum(g[3] for g in data))
    assert all(n > 0 for n in data_bytes)


@CHECKS("verify_planted")
def _(r: dict, spawns: Spawns, world: int, name: str) -> None:
    assert not r["ok"]
    (f,) = r["findings"]
    assert (f["key"], f["kind"], f["rank"], f["mismatched"]) == (
        "blocks.1.w1.weight",
        "value",
        1,
        1,
    )
    # hidden=96 rows on 2 ranks: rank 1 holds rows 48..95; local row 3 is global row 51.
    assert f["max_abs_index"] == [51, 7]
    assert "at index (51, 7) on rank 1" in r["text"]


@CHECKS("verify_local_same_as_s3")
def _(r: dict, spawns: Spawns, world: int, name: str) -> None:
    assert r["local"]["ok"] and r["local"] == r["s3"]


@CHECKS("load_from_s3")
def _(r: dict, spawns: Spawns, world: int, name: str) -> None:
    assert r["load"]["ok"], r["load"]["text"]
    assert r["verify_local"]["ok"], r["verify_local"]["text"]


@CHECKS("save_to_s3_then_audit_deep")
def _(r: dict, spawns: Spawns, world: int, name: str) -> None:
    assert r["world_size"] == 2 and r["entries"] == r["fingerprinted"] == 13 * 4
    assert r["audit"]["ok"] and not r["audit"]["notes"], r["audit"]
    assert r["verify"]["ok"], r["verify"]["text"]


@CHECKS("fingerprint_split_over_ranks")
def _(r: dict, spawns: Spawns, world: int, name: str) -> None:
    assert r["same"] and r["compare_exit"] == 0
    per_rank = [x["rank_local"] for x in spawns.per_rank(SCENARIOS_MODULE, world, name)]
    got = [sum(g[3] for g in mine["fetched"] if g[0].endswith(".distcp")) for mine in per_rank]
    # Each process read a share of the data (both some, neither all of it).
    assert all(n > 0 for n in got), got
    assert max(got) < sum(got), got
