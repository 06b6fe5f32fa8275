"""Bytes received per rank do not grow with the world size, for every collective entry point.

The scenarios (tests/dist/scale/scale_scenarios.py) run each entry point at world sizes 2 and 4
with every torch.distributed collective counted; here the counts of the two world sizes are
compared: the same collectives, and the same bytes received per rank (exact counts, not times).
fsdpcheck's own collectives only: DCP's (its planner gathers every rank's plan to the coordinator)
are counted apart. Where a gather of a few words per rank is the design (the ranks holding each
version of a replica that disagrees), its exact size is pinned.
"""

from __future__ import annotations

import ast
import pickle
from typing import Any

import pytest

from tests import REPO_ROOT
from tests.dist.scale.scale_scenarios import KEYS, REGISTRY, WORLDS
from tests.dist_harness import Spawns

SCENARIOS_MODULE = "tests.dist.scale.scale_scenarios"
SMALL, LARGE = WORLDS
REPO = REPO_ROOT
# Entry point -> its scenario, where its result sits in it, and the name it gives the step
# runner (``fsdpcheck.dist.runner.call``): every such name of the package is measured here, or
# pinned where `PINNED_ELSEWHERE` says (test_every_collective_entry_point_is_measured).
ENTRY_POINTS = {
    "verify": ("verify", (), "verify"),
    "verify, a planted element": ("verify_planted", (), "verify"),
    "fingerprint": ("fingerprint", (), "fingerprint"),
    "check_replicas": ("check_replicas", (), "check_replicas"),
    "ReplicaWatch.step": ("watch_step", (), "ReplicaWatch.step"),
    "load(verify='fingerprint')": ("load_fingerprint", (), "fsdpcheck.load"),
    "load(verify='full', sentinel=True)": ("load_full", (), "fsdpcheck.load"),
    "save": ("save", (), "fsdpcheck.save"),
    "write_checkpoint_manifest": ("checkpoint_manifest", (), "write_checkpoint_manifest"),
    "check_against_manifest": ("against_manifest", (), "check_against_manifest"),
    "verify_resumed, a manifest": ("resumed", ("manifest",), "verify_resumed"),
    "verify_resumed, the files": ("resumed", ("files",), "verify_resumed"),
    "torchtitan: save with save_manifests": (
        "torchtitan",
        ("save",),
        "torchtitan write_step_manifest",
    ),
    "torchtitan: verify_after_load": (
        "torchtitan",
        ("verify_after_load",),
        "torchtitan verify_after_load",
    ),
    "accelerate: verify_state": ("integrations", ("accelerate",), "accelerate verify_state"),
    "lightning: VerifyOnResume": ("integrations", ("lightning",), "VerifyOnResume"),
    "transformers: VerifyOnResume": ("integrations", ("transformers",), "VerifyOnResume"),
}
# Step-runner names whose bytes per rank are pinned by another test (the test named).
PINNED_ELSEWHERE = {
    "the launch": (
        "tests/dist/offline/test_offline_dist.py",
        "test_bytes_received_per_rank_do_not_grow_with_the_world",
    ),
}
# Entry points that run DCP underneath (its collectives are counted apart).
WITH_DCP = {
    "load(verify='fingerprint')",
    "load(verify='full', sentinel=True)",
    "save",
    "torchtitan: save with save_manifests",
}


def _at(result: Any, path: tuple[str, ...]) -> Any:
    for p in path:
        result = result[p]
    return result


def counts(spawns: Spawns, world: int, entry: str) -> list[dict[str, Any]]:
    """Every rank's counts of one entry point at one world size, by origin."""
    name, path, _ = ENTRY_POINTS[entry]
    agreed = _at(spawns.result(SCENARIOS_MODULE, world, name), path)  # every rank agrees
    if "absent" in agreed:
        pytest.skip(f"{agreed['absent']} is not installed")
    per_rank = spawns.per_rank(SCENARIOS_MODULE, world, name)
    return [_at(r, path)["rank_local"]["counts"] for r in per_rank]


def ours(per_rank: list[dict[str, Any]]) -> tuple[set[int], int]:
    """(the numbers of fsdpcheck's collective calls on the ranks, the most bytes a rank got)."""
    mine = [c.get("fsdpcheck", {"calls": 0, "bytes": 0, "ops": {}}) for c in per_rank]
    return {m["calls"] for m in mine}, max(m["bytes"] for m in mine)


def test_every_scenario_is_an_entry_point_or_the_counter() -> None:
    used = {name for name, _, _ in ENTRY_POINTS.values()}
    assert set(REGISTRY.scenarios) == used | {"replica_differs", "counter"}


def _runner_names() -> dict[str, list[str]]:
    """Each name the package passes to the step runner's ``call``, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "fsdpcheck").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "call"
            ):
                first = node.args[0] if node.args else None
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
                    f"{where}: a step runner call named by a literal string, so this test sees it"
                )
                found.setdefault(first.value, []).append(where)
    return found


def test_every_collective_entry_point_is_measured() -> None:
    """A collective entry point (a ``call`` of the step runner) cannot skip this test: its
    name is in ENTRY_POINTS, measured here, or its bytes per rank are pinned elsewhere."""
    names = _runner_names()
    assert "verify" in names and "fingerprint" in names, names  # the scan finds them
    measured = {tag for _, _, tag in ENTRY_POINTS.values()} | set(PINNED_ELSEWHERE)
    unmeasured = {n: w for n, w in names.items() if n not in measured}
    assert not unmeasured, f"entry points whose bytes per rank no test measures: {unmeasured}"
    assert measured <= set(names), measured - set(names)  # no stale name
    for file, test in PINNED_ELSEWHERE.values():
        assert f"def {test}(" in (REPO / file).read_text(), (file, test)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_bytes_per_rank_do_not_grow_with_the_world(entry: str, spawns: Spawns) -> None:
    small, large = counts(spawns, SMALL, entry), counts(spawns, LARGE, entry)
    calls_small, bytes_small = ours(small)
    calls_large, bytes_large = ours(large)
    # Every rank makes the same collectives, as many at either world size.
    assert len(calls_small) == 1 and calls_small == calls_large, (calls_small, calls_large)
    # The rows of KEYS keys: ~200 bytes a key whatever the world size.
    assert bytes_small > 100 * KEYS
    assert abs(bytes_large - bytes_small) <= 32, (bytes_small, bytes_large)
    for c in large:  # no rank receives more than the busiest rank of the smaller world
        assert c.get("fsdpcheck", {}).get("bytes", 0) <= bytes_small + 32
    # No collective of an origin other than fsdpcheck and DCP.
    assert {o for c in small + large for o in c} <= {"fsdpcheck", "dcp"}
    if entry in WITH_DCP:
        assert all(c["dcp"]["calls"] > 0 for c in small + large)
    else:
        assert not any("dcp" in c for c in small + large)


def test_dcp_counted_apart_grows_with_the_world(spawns: Spawns) -> None:
    # DCP's planner gathers every rank's plan to its coordinator: more ranks, more bytes there.
    small, large = counts(spawns, SMALL, "save"), counts(spawns, LARGE, "save")
    assert max(c["dcp"]["bytes"] for c in large) > max(c["dcp"]["bytes"] for c in small)
    assert "gather_object" in small[0]["dcp"]["ops"]


def test_reports_are_what_they_should_be(spawns: Spawns) -> None:
    for world in WORLDS:

        def result(name: str, world: int = world) -> Any:
            return spawns.result(SCENARIOS_MODULE, world, name)

        for name in ("verify", "check_replicas", "watch_step", "load_fingerprint", "load_full"):
            assert result(name)["ok"], (world, name, result(name))
            assert result(name)["keys_checked"] == KEYS, (world, name)
        assert result("fingerprint")["keys"] == KEYS
        assert result("save")["keys"] == result("checkpoint_manifest")["keys"] == KEYS
        assert result("torchtitan")["verify_after_load"]["ok"]
        assert result("against_manifest")["ok"]
        assert result("resumed")["manifest"]["ok"] and result("resumed")["files"]["ok"]
        for name, got in result("integrations").items():
            assert "absent" in got or (got["ok"] and got["keys_checked"] == KEYS), (name, got)
        planted = result("verify_planted")
        assert planted["findings"] == [["p.5", "value", 1]], planted
        assert result("replica_differs")["findings"] == [["p.3", "replica", 1]]


def test_a_disagreeing_replica_costs_two_words_per_rank(spawns: Spawns) -> None:
    # Ranks grouped by content for the key whose copies differ: 2 words from every rank.
    small = counts(spawns, SMALL, "check_replicas")
    (calls_clean,), clean = ours(small)
    for world in WORLDS:
        per_rank = [
            r["rank_local"]["counts"]
            for r in spawns.per_rank(SCENARIOS_MODULE, world, "replica_differs")
        ]
        (calls,), got = ours(per_rank)
        assert calls == calls_clean + 1
        assert got == clean + 16 * world
        assert per_rank[0]["fsdpcheck"]["ops"]["all_gather"] == [1, 16 * world]


def test_the_counter_counts_bytes_received(spawns: Spawns) -> None:
    for world in WORLDS:
        per_rank = [
            r["rank_local"]["counts"] for r in spawns.per_rank(SCENARIOS_MODULE, world, "counter")
        ]
        for rank, c in enumerate(per_rank):
            assert set(c) == {"tests"}  # the caller's package names the origin
            pickled = len(pickle.dumps("x" * 100))
            assert c["tests"]["ops"] == {
                "all_reduce": [1, 80],
                "all_gather": [1, 12 * world],
                "broadcast": [1, 0 if rank == 0 else 20],
                # the sizes (int64), then every rank's pickle padded to the largest
                "all_gather_object": [1, 8 * world + pickled * world],
            }
            assert c["tests"]["calls"] == 4


# The collectives of the checks themselves, pinned: verify agrees on the keys (1), on the
# pairing (1), combines (4: the tie-break rounds run since the compared keys have maxima) and
# gathers the local findings (1); a fingerprint pass has no maxima, so 2 rounds fewer.
PINNED = {
    "verify": {"all_reduce": 7, "broadcast": 1},
    "verify, a planted element": {"all_reduce": 7, "broadcast": 1},
    "fingerprint": {"all_reduce": 4},
    "check_replicas": {"all_reduce": 4},
    "ReplicaWatch.step": {"all_reduce": 4},
}


@pytest.mark.parametrize("entry", list(PINNED))
def test_the_collectives_of_a_check(entry: str, spawns: Spawns) -> None:
    for world in WORLDS:
        for c in counts(spawns, world, entry):
            calls = {op: n for op, (n, _) in c["fsdpcheck"]["ops"].items()}
            assert calls == PINNED[entry], (world, calls)
