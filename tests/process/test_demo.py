from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fsdpcheck import demo

SCENARIOS = (
    "one element changed",
    "shards of two ranks swapped",
    "shard shifted one row",
    "optimizer moment zeroed",
    "missing optimizer step",
    "full checkpoint where sharded expected",
)


# The whole command, spawning its own ranks, at 2 ranks (shards of 52 and 51 rows swapped). The
# demo's rows at 2, 3 and 4 ranks (the default) also run inside the multi-rank tests' spawns
# (scenario demo_outcomes in tests/dist/verify/verify_scenarios.py), which saves a spawn each.
def test_demo_command_exits_zero_and_every_outcome_as_expected():
    out = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "demo", "--ranks", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "fsdpcheck demo: 2 ranks" in out.stdout
    assert "9/9 outcomes as expected" in out.stdout
    assert "UNEXPECTED" not in out.stdout
    for scenario in SCENARIOS:
        assert scenario in out.stdout


def _one_line_exit_2(code: int, capsys, *words: str) -> None:
    out = capsys.readouterr()
    assert code == 2, out.out + out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    for w in words:
        assert w in lines[0]
    assert out.out == ""


def test_demo_with_one_rank_is_one_line_and_exit_2(capsys):
    _one_line_exit_2(demo.main(1), capsys, "at least 2 ranks")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_demo_on_cuda_without_a_gpu_is_one_line_and_exit_2(capsys):
    _one_line_exit_2(demo.main(4, "cuda"), capsys, "no GPU", "--device cuda")
