"""Failures on some ranks only: the same one-line verdict on every rank, the failing rank named.

The registered scenarios (tests/dist/failures/failure_scenarios.py) run in the shared spawn; a rank
SIGKILLed in the middle of verify needs a world of its own.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from tests.dist.failures.failure_scenarios import REGISTRY
from tests.dist_harness import Spawns

SCENARIOS_MODULE = "tests.dist.failures.failure_scenarios"


def result(spawns: Spawns, name: str) -> dict:
    """Rank 0's result of a 2-rank scenario, after checking that every rank returned it."""
    return spawns.result(SCENARIOS_MODULE, 2, name)


def test_each_scenario_has_its_test() -> None:
    assert {f"test_{name}" for name in REGISTRY.scenarios} <= set(globals())


def test_load_with_a_different_kind_per_rank(spawns: Spawns) -> None:
    r = result(spawns, "load_with_a_different_kind_per_rank")
    full, ck = r["paths"]
    refused = (
        f"CheckpointError: the ranks were given different checkpoints to load (rank 0: {full} "
        f"(a torch.save file ({Path(full).name})); rank 1: {ck} (a DCP checkpoint written by "
        f"fsdpcheck.save ({ck}))); every rank must load the same checkpoint (nothing was loaded)"
    )
    assert r["plain"] == refused and r["expect_sharded"] == refused
    assert r["untouched"]


def test_load_copies_of_one_checkpoint_from_different_paths(spawns: Spawns) -> None:
    r = result(spawns, "load_copies_of_one_checkpoint_from_different_paths")
    assert r["ok"] and r["same_state"], r["rank_local"]


def test_a_failed_dcp_read_inside_load(spawns: Spawns) -> None:
    r = result(spawns, "a_failed_dcp_read_inside_load")
    error = r["error"]
    # Read while pairing (agreed on by every rank), before DCP's collectives and any write.
    assert error.startswith("CheckpointError: pairing ") and "\n" not in error
    assert "failed on rank 0 (and on ranks [1])" in error
    assert f"{r['file']}: " in error and "cannot be loaded weights_only" in error
    assert "FrameSummary" not in error and "Traceback" not in error


def test_load_refused_on_one_rank_writes_on_none(spawns: Spawns) -> None:
    r = result(spawns, "load_refused_on_one_rank_writes_on_none")
    for sentinel in ("sentinel=False", "sentinel=True"):
        got = r[sentinel]
        assert got["untouched"], sentinel  # on every rank (the harness compares them)
        error = got["error"]
        assert error.startswith(
            f"CheckpointError: loading {r['ck']} failed: the check before writing into the "
            f"model failed on rank 1: {r['ck']}/__1_0.distcp: model.p."
        ), error
        assert error.endswith(
            "inflates past 1048600 bytes, more than the entry can hold; refusing it (a "
            "decompression bomb?); nothing was written into the model (it is as it was)"
        ), error


def test_save_through_a_symlink(spawns: Spawns) -> None:
    r = result(spawns, "save_through_a_symlink")
    assert r["link"] and r["new"] and r["beside"] == ["ck", "v1"]
    assert r["refused"].startswith("FileExistsError: fsdpcheck.save to ")
    assert r["refused"].endswith("exists and is not empty; pass overwrite=True to replace it")


# ---------------------------------------------------------------------------------------------
VICTIM = 2


def _verify_until_a_rank_dies(rank: int, world: int, port: int, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    import fsdpcheck
    from fsdpcheck.dist.comm import Comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.Linear(4, 4)
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    calls = 0
    real = Comm.all_reduce

    def dies_in_its_third_verify(self: Comm, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if rank == VICTIM and calls == 7:  # inside verify's combine, mid-collectives
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    Comm.all_reduce = dies_in_its_third_verify  # type: ignore[method-assign]
    t0 = time.perf_counter()
    result: dict[str, Any] = {"error": None}
    try:
        for _ in range(10):
            fsdpcheck.verify(model, reference)
    except Exception as exc:
        result = {"type": type(exc).__name__, "error": str(exc)}
    result["seconds"] = time.perf_counter() - t0
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the group is broken: no teardown that could wait on the dead rank


def test_a_rank_killed_mid_verify_is_named_by_the_others(tmp_path):
    """Before: gloo's "Connection reset by peer ... GLHF!" on some ranks, no rank named, and
    ranks not wired to the dead one waited for gloo's 30-minute timeout."""
    from fsdpcheck._spawn import spawn

    codes = spawn(_verify_until_a_rank_dies, 3, (str(tmp_path),), timeout=120)
    assert codes[VICTIM] == -signal.SIGKILL
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["type"] == "RankStoppedError", r
        assert r["error"].startswith(f"rank {VICTIM} stopped answering during verify, in "), r
        assert r["error"].endswith("(connection reset by peer)") or r["error"].endswith(
            "(connection closed by peer)"
        ), r
    assert results[0]["error"] == results[1]["error"]  # the same verdict on every rank
