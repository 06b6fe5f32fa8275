from __future__ import annotations

import subprocess
import sys

from fsdpcheck import demo


def test_every_demo_outcome_as_expected():
    outcomes = demo.run()
    assert len(outcomes) >= 7
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]


def test_demo_command_exits_zero_and_prints_table():
    out = subprocess.run(
        [sys.executable, "-m", "fsdpcheck", "demo"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outcomes as expected" in out.stdout
    assert "UNEXPECTED" not in out.stdout


def test_cli_without_command_is_usage_error():
    out = subprocess.run([sys.executable, "-m", "fsdpcheck"], capture_output=True, text=True)
    assert out.returncode == 2
