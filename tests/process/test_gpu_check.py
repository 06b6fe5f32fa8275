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


def test_the_verify_step_runs_on_the_cpu_at_a_small_size(tmp_path):
    """The GPU run's verify step, its bench on 2 CPU ranks: a bench that cannot run its own
    baseline (a bare dcp.load of what fsdpcheck.save wrote) fails here, not on the GPU machine.
    """
    out = tmp_path / "verify.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_verify.py"), "--ranks", "2", "--layers",
         "1", "--hidden", "64", "--vocab", "257", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "verdicts: verify ok=True, recipe ok=True, load ok=[True, True, True]" in res.stdout
    assert out.exists()
