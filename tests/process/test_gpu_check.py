"""bench/gpu_check.sh, the one command for a GPU machine, checked where there is none: its plan
(the scripts and tests it runs exist and start), its time budget and the files it writes."""

from __future__ import annotations

import os
import subprocess
import sys

from tests import REPO_ROOT

ROOT = REPO_ROOT


def test_gpu_check_dry_run_fits_its_budget_and_file_count():
    env = dict(os.environ, PYTHON=sys.executable)
    res = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "dry-run: ok" in out
    steps = [line.split()[1] for line in out.splitlines() if line.startswith("plan: ")]
    assert steps == ["build", "tests", "bench", "verify"]
    limits = [
        int(line.split("(<= ")[1].split(" s)")[0])
        for line in out.splitlines()
        if line.startswith("plan: ")
    ]
    assert sum(limits) <= 480
    assert "result files (at most 8)" in out
    # No -Werror and no `-x` on the GPU machine: a warning or a failing test must not stop the
    # measurements.
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "FSDPCHECK_WERROR=OFF" in script and "pytest -q -x" not in script
    assert "/usr/local/cuda/bin/nvcc" in script
