from __future__ import annotations

import subprocess
import sys


def test_demo_command_exits_zero_and_every_outcome_as_expected():
    out = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "demo"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "9/9 outcomes as expected" in out.stdout
    assert "UNEXPECTED" not in out.stdout
    for scenario in (
        "one element changed",
        "shards of two ranks swapped",
        "shard shifted one row",
        "optimizer moment zeroed",
        "missing optimizer step",
        "full checkpoint where sharded expected",
    ):
        assert scenario in out.stdout
