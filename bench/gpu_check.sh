#!/usr/bin/env bash
# The one prepared run for the GPU machine (no network; torch, cmake, ninja, scikit-build-core,
# pytest and hypothesis preinstalled): build there, run the CUDA tests, run the benchmark, and
# print a short table last. Budget: under 10 minutes. Results also land in $OUT (if set).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fsdpcheck-gpu}
mkdir -p "$OUT"
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
python -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true

t0=$(date +%s)
if ! FSDPCHECK_CUDA=ON FSDPCHECK_WERROR=ON MAX_JOBS=16 pip install --no-build-isolation --no-deps \
    -C build-dir=build/gpu -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
python -c "import fsdpcheck; print(fsdpcheck.build_info())"

t0=$(date +%s)
timeout 200 python -m pytest -q -x -p no:cacheprovider -k "not emulators" tests/test_cuda.py \
  tests/test_kernels.py tests/test_prefetch.py tests/test_verify.py tests/test_checkpoint.py \
  > "$OUT/tests.log" 2>&1
tests_rc=$?
tail -25 "$OUT/tests.log"
echo "tests: rc=$tests_rc, $(( $(date +%s) - t0 )) s"
# The CUDA kernels on the GPU against the same kernels run by the CPU emulator (fsdpcheck::
# _emulated, what every CI runs): every path, dtype and special-value placement, row for row.
t0=$(date +%s)
timeout 150 python -m pytest -q -p no:cacheprovider -k "emulators" tests/test_cuda.py \
  > "$OUT/emulator.log" 2>&1
emulator_rc=$?
emulator_line="emulator vs cuda: rc=$emulator_rc, $(tail -1 "$OUT/emulator.log"), $(( $(date +%s) - t0 )) s"
echo "$emulator_line"

t0=$(date +%s)
timeout 170 python bench/bench_kernels.py --device cuda --reps 10 --json "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
bench_rc=$?
echo "bench: rc=$bench_rc, $(( $(date +%s) - t0 )) s"
# verify / load / fingerprint on 2 ranks sharing the GPU over gloo (a small model: the path, not speed).
timeout 90 python bench/bench_verify.py --device cuda --ranks 2 --layers 2 --hidden 1024 \
  --json "$OUT/verify.json" > "$OUT/verify.log" 2>&1
verify_rc=$?
grep -E "^#|^[a-z]" "$OUT/verify.log" | grep -v "Warning" | tail -14
# ReplicaWatch against a training step (2 ranks sharing the GPU over gloo), and the offline
# commands on a smaller data set with compare on the GPU.
timeout 90 python bench/bench_watch.py --device cuda --ranks 2 --layout ddp \
  --json "$OUT/watch.json" > "$OUT/watch.log" 2>&1
watch_rc=$?
tail -4 "$OUT/watch.log"
timeout 240 python bench/bench_offline.py --device cuda --size 512M --reps 1 --settle 0.2 \
  --json "$OUT/offline.json" > "$OUT/offline.log" 2>&1
offline_rc=$?
tail -14 "$OUT/offline.log"
# The table last.
grep -E "^# device|^workload|^(llama|small|cpu-mix)" "$OUT/bench.log" | grep -v "^  " | tail -45
echo "$emulator_line"
echo "tests rc=$tests_rc emulator rc=$emulator_rc bench rc=$bench_rc verify rc=$verify_rc" \
  "watch rc=$watch_rc offline rc=$offline_rc"
[ "$tests_rc" -eq 0 ] && [ "$emulator_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$verify_rc" -eq 0 ] \
  && [ "$watch_rc" -eq 0 ] && [ "$offline_rc" -eq 0 ]
