"""compare, fingerprint and audit --deep spread over the processes of a torchrun launch.

The scenarios (tests/dist/offline/offline_dist_scenarios.py) run the command line on 2 and 4 gloo
ranks of the shared spawn, inside ``offline_dist`` sessions over the harness's group, against the
same command alone; two real ``torchrun`` launches then check what only the launcher shows (the
environment, the group made and destroyed, each process's exit code and output). The plan's
pieces (``share``, ``piece_bytes``) and the per-pair tally are checked as properties.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fsdpcheck import offline_dist
from fsdpcheck.box import Box
from fsdpcheck.comparison import _Tally
from fsdpcheck.kernels import TensorDiff
from fsdpcheck.ops import COLUMNS, ROW_WORDS
from fsdpcheck.stats import KeyStats
from tests import REPO_ROOT
from tests.dist.offline.offline_dist_scenarios import (
    PLANTED,
    REGISTRY,
    build,
    commands,
    without_seconds,
)
from tests.dist_harness import Checks, Spawns

SCENARIOS_MODULE = "tests.dist.offline.offline_dist_scenarios"
CASES = REGISTRY.cases()
CHECKS = checks = Checks(REGISTRY)
ROOT = REPO_ROOT


@pytest.mark.parametrize("case", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario(case: tuple[int, str], spawns: Spawns) -> None:
    world, name = case
    CHECKS[name](spawns.result(SCENARIOS_MODULE, world, name), world)


def test_every_scenario_is_checked() -> None:
    assert not CHECKS.missing()


# -------------------------------------------------------------------------------------------
FOUND = {
    "compare_dcp_clean": [],
    "compare_dcp_planted": [(PLANTED[0], "value", list(PLANTED[1]))],
    "compare_st_planted": [(PLANTED[0], "value", list(PLANTED[1]))],
    "compare_dcp_dcp_planted": [(PLANTED[0], "value", list(PLANTED[1]))],
    "audit_clean": [],
    "audit_rotten": [(PLANTED[0], "value", None)],  # a fingerprint knows the key, not the index
}


@checks("spread_runs_equal_one_process")
def each_command_gives_the_one_process_report_and_code(r: dict, world: int) -> None:
    assert set(r) == set(FOUND) | {"fingerprint_dcp", "fingerprint_st"}
    for name, run in r.items():
        code = 1 if FOUND.get(name) else 0
        assert run["ranks"][0] == {"codes": [code, code], "stdout": True, "stderr": ""}, name
        for rank in range(1, world):
            assert run["ranks"][rank] == {"codes": [code, code], "stdout": "", "stderr": ""}
        if name in FOUND:
            report = run["report"]
            got = [(f["key"], f["kind"], f["max_abs_index"]) for f in report["findings"]]
            assert got == FOUND[name], name
    # The planted element changes big.weight's fingerprint, in DCP and safetensors alike.
    assert r["fingerprint_dcp"]["report"] == r["fingerprint_st"]["report"]


@checks("read_failure_on_the_last_rank")
def the_failing_ranks_error_is_everyones(r: list[dict[str, Any]], world: int) -> None:
    last = world - 1
    code, alone = r[last]["alone"]
    assert code == 2 and alone.endswith(": Input/output error"), alone
    assert all(x["alone"] == [0, ""] for x in r[:last])  # alone, the others read fine
    said = f"{alone} (on rank {last})"
    assert r[0]["spread"] == [2, "", said]  # rank 0 says it, once, on stderr
    assert all(x["spread"] == [2, "", ""] for x in r[1:])  # the others exit 2 in silence
    api = "OfflineError: " + said.removeprefix("fsdpcheck fingerprint: ")
    assert [x["api"] for x in r] == [api] * world


@checks("open_fails_on_one_rank")
def an_error_before_any_collective_is_everyones(r: list[dict[str, Any]], world: int) -> None:
    assert world == 2
    code, alone = r[1]["alone"]
    assert code == 2 and alone.endswith(": No such file or directory"), alone
    said = f"{alone} (on rank 1)"
    assert r[0]["spread"] == [2, "", said] and r[1]["spread"] == [2, "", ""]
    assert [x["api"] for x in r] == ["OfflineError: " + said.split(": ", 1)[1]] * 2


@checks("ranks_see_different_checkpoints")
def different_checkpoints_are_refused(r: list[list[Any]], world: int) -> None:
    (code, said), (code1, said1) = r
    assert (code, code1, said1) == (2, 2, "")
    assert said.startswith("fsdpcheck compare: the processes of this launch see different ")
    assert "every process must read the same one" in said


@checks("bytes_per_rank_and_shares")
def each_rank_reads_its_share_and_receives_o_keys(r: dict, world: int) -> None:
    for name, per_rank in r["received"].items():
        assert len({json.dumps(x) for x in per_rank}) == 1, (name, per_rank)  # same everywhere
    for name in ("compare_dcp_planted", "fingerprint_dcp", "audit_rotten"):
        shares = r["read"][name]
        assert sum(shares) == r["read"][name + "_alone"], name  # every byte, once
        assert max(shares) < sum(shares), name
    # A tensor larger than a share is cut: with 4 ranks, 3 of them read parts of big.weight.
    assert sum(1 for s in r["read"]["compare_dcp_planted"] if s) == world


def test_bytes_received_per_rank_do_not_grow_with_the_world(spawns: Spawns) -> None:
    """The same collectives, of the same sizes, at 2 and at 4 processes (7 keys: 1,920 bytes).

    Pinned: each pass agrees on its failures and its plan in one agreement of 4 words (was a word
    and then 4), and the rows carry the counted copies' mismatches (a word per key).
    """
    name = "bytes_per_rank_and_shares"
    two = spawns.result(SCENARIOS_MODULE, 2, name)["received"]
    four = spawns.result(SCENARIOS_MODULE, 4, name)["received"]
    assert two == {k: v[:2] for k, v in four.items()}
    assert two["compare_dcp_planted"][0] == {"bytes": 1920, "calls": 9}


# -------------------------------------------------------------------------------------------
@given(st.lists(st.integers(0, 1000), max_size=40), st.integers(1, 9))
def test_shares_partition_the_items_by_bytes(sizes: list[int], world: int) -> None:
    runs = [offline_dist.share(sizes, rank, world) for rank in range(world)]
    assert [i for run in runs for i in run] == list(range(len(sizes)))  # in order, each once
    total = sum(sizes)
    if total:
        for run in runs:  # each share is its equal part, give or take an item at either end
            assert sum(sizes[i] for i in run) <= total / world + 2 * max(sizes)


def test_pieces_cut_a_tensor_over_the_processes() -> None:
    step = 128 << 20
    assert offline_dist.piece_bytes(10 << 30, 1, step) == step  # one process: as before
    assert offline_dist.piece_bytes(10 << 30, 2, step) == step
    assert offline_dist.piece_bytes(1 << 30, 8, step) == 16 << 20  # ~8 pieces per process
    assert offline_dist.piece_bytes(1 << 20, 8, step) == offline_dist.MIN_PIECE
    assert offline_dist.piece_bytes(1 << 30, 8, 1 << 20) == 1 << 20  # never above a batch


def test_launched_reads_torchruns_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in offline_dist.LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    assert not offline_dist.launched()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "0")
    assert not offline_dist.launched()  # no WORLD_SIZE: not torchrun
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not offline_dist.launched()  # one process: no group
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert offline_dist.launched()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' and RANK='0' must be integers"):
        offline_dist.launched()


_COUNTED = ("mismatched", "nan_actual", "nan_expected", "inf_actual", "inf_expected", "zeros")
VALUES = st.sampled_from([0.0, 0.25, 1.0, 1.0, 3.0, math.inf, math.nan])


@given(
    st.integers(1, 4),
    st.lists(
        st.tuples(st.integers(0, 3), VALUES, st.integers(-1, 9), VALUES, st.integers(-1, 9)),
        max_size=24,
    ),
    st.lists(st.integers(1, 24), max_size=4),
)
def test_tally_keeps_what_keystats_keeps(
    n: int, rows: list[tuple[int, float, int, float, int]], cuts: list[int]
) -> None:
    """Per pair, the vector tally of a batch's rows equals KeyStats fed the rows one by one."""
    rows = sorted(((p % n, *rest) for p, *rest in rows), key=lambda r: r[0])
    box = Box((10,), (0,))
    want = [KeyStats() for _ in range(n)]
    table = torch.zeros((len(rows), ROW_WORDS), dtype=torch.int64)
    floats = table.view(torch.float64)
    for j, (p, va, ia, vr, ir) in enumerate(rows):
        counts = [j + 1, j % 3, j % 2, 1, 0, 2, j]
        table[j, [COLUMNS[c] for c in _COUNTED]] = torch.tensor(counts[1:])
        floats[j, COLUMNS["max_abs_diff"]], table[j, COLUMNS["max_abs_index"]] = va, ia
        floats[j, COLUMNS["max_rel_diff"]], table[j, COLUMNS["max_rel_index"]] = vr, ir
        at_a, at_r = ((ia,) if ia >= 0 else None), ((ir,) if ir >= 0 else None)
        diff = TensorDiff(*counts[:6], va, at_a, vr, at_r, None, None, 0.0, 0.0, counts[6])
        want[p].add(diff, box)
    tally = _Tally(n)
    ids = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    numel = torch.arange(1, len(rows) + 1, dtype=torch.int64)
    edges = sorted({0, len(rows), *(c for c in cuts if c < len(rows))})
    for a, b in itertools.pairwise(edges):  # batches: consecutive runs of the rows
        tally.add(ids[a:b], numel[a:b], table[a:b])
    assert [tally.stats(i) for i in range(n)] == want
    assert tally.keystats() == want


# -------------------------------------------------------------------------------------------
# Each process: `run` "$@" in the repository, its output and exit code kept in $OUT/<rank>.*
# torchrun stops the other processes (SIGTERM) as soon as one exits non-zero: ignored here, so
# that each finishes on its own and its exit code is seen.
RUN_EACH = (
    'trap "" TERM; cd "$1"; shift; {run} > "$OUT/$RANK.out" 2> "$OUT/$RANK.err"; c=$?; '
    'echo $c > "$OUT/$RANK.code"; exit $c'
)


def _torchrun(run: str, out: Path, *args: str) -> list[tuple[int, str, str]]:
    """Each process's (exit code, stdout, stderr) of `run` "$@" under torchrun, 2 processes."""
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), OUT=str(out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    cmd += ["--no-python", "sh", "-c", RUN_EACH.format(run=run), "sh", str(ROOT), *args]
    subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return [
        (int((out / f"{r}.code").read_text()), (out / f"{r}.out").read_text(),
         (out / f"{r}.err").read_text())
        for r in range(2)
    ]  # fmt: skip


def test_torchrun_launch(tmp_path: Path) -> None:
    """``torchrun -m fsdpcheck``: one report from rank 0, the same exit code on every process.

    A planted element found at its key and index, as one process reports it; then reads that
    fail on rank 1 only: both processes exit 2, rank 0 says why in one line.
    """
    from fsdpcheck.cli import main

    c = build(tmp_path / "ckpts")
    argv = commands(c)["compare_dcp_planted"]
    alone = tmp_path / "alone.json"
    with alone.open("w") as f, contextlib.redirect_stdout(f):
        assert main(argv) == 1
    py = f'"{sys.executable}"'
    (code0, out0, err0), (code1, out1, err1) = _torchrun(
        f'{py} -m fsdpcheck "$@"', tmp_path / "compare", *argv
    )
    assert (code0, code1, err0, out1, err1) == (1, 1, "", "", ""), (err0, err1)
    assert without_seconds(out0) == without_seconds(alone.read_text())
    assert without_seconds(out0)["findings"][0]["max_abs_index"] == list(PLANTED[1])

    fp = ["fingerprint", str(c["clean"]), "--memory-budget", "64K"]
    run = (
        f'if [ "$RANK" = 1 ]; then {py} -m tests.dist.offline.offline_fault "$@"; '
        f'else {py} -m fsdpcheck "$@"; fi'
    )
    (code0, out0, err0), (code1, out1, err1) = _torchrun(run, tmp_path / "fault", *fp)
    assert (code0, code1, out0, out1, err1) == (2, 2, "", "", ""), (err0, err1)
    assert err0 == (
        f"fsdpcheck fingerprint: DCP checkpoint {c['clean']} (data): Input/output error "
        "(on rank 1)\n"
    )


def test_the_collector_is_paused_for_the_call_and_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE: [collector]: off inside compare and fingerprint, as the caller left it after."""
    import gc

    from safetensors.torch import save_file

    from fsdpcheck import fingerprints
    from fsdpcheck.comparison import compare_checkpoints

    path = tmp_path / "a.safetensors"
    save_file({"w": torch.ones(4, 3)}, str(path))
    seen = []

    def refused(*args: Any) -> None:
        seen.append(gc.isenabled())
        raise ValueError("refused inside")

    monkeypatch.setattr(fingerprints, "refuse_problems", refused)
    for was_on in (True, False):
        (gc.enable if was_on else gc.disable)()
        try:
            compare_checkpoints(path, path, progress=lambda d, t: seen.append(gc.isenabled()))
            assert gc.isenabled() is was_on
            with pytest.raises(ValueError, match="refused inside"):
                fingerprints.checkpoint_fingerprints(path)
            assert gc.isenabled() is was_on
        finally:
            gc.enable()
    assert seen == [False] * 4


def test_one_process_makes_no_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without torchrun's environment the commands run as they always did: no group, no session."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from fsdpcheck.cli import main

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a process group was made")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    for k in offline_dist.LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    path = str(tmp_path / "a.safetensors")
    save_file({"w": torch.ones(4, 3)}, path)
    assert main(["compare", path, path]) == 0
    assert main(["fingerprint", path]) == 0
    assert main(["audit", path, "--deep"]) == 0
    assert not dist.is_initialized()
    out = capsys.readouterr().out
    assert out.count("fsdpcheck: OK") == 2 and "w  0x" in out
