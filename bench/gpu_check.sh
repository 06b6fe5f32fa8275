#!/usr/bin/env bash
# The one prepared run for a bare GPU machine: build there, run the CUDA tests, benchmark the
# kernels against what users do today on Llama-2-7B shapes, then verify on 2 ranks sharing the
# GPU, printing each table as it comes. Made for a machine with a CUDA build of torch already
# installed for `python3` (torch >= 2.6), nvcc (found through CUDACXX, CUDA_HOME, PATH or
# /usr/local/cuda), cmake, ninja, scikit-build-core, pytest and hypothesis, and no network.
#
#   bash bench/gpu_check.sh            # the run (<= 8 minutes, every step under a deadline)
#   bash bench/gpu_check.sh --dry-run  # on any machine: the plan, its time budget and the files
#                                      # it writes, checked (CI runs it)
#
# Results go to $OUT (default /tmp/fsdpcheck-gpu): at most MAX_FILES files. A failing step does
# not stop the later ones (each starts from the build); the exit code says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/fsdpcheck-gpu}
PY=${PYTHON:-python3}
BUDGET_S=480   # the whole run, start to end
MAX_FILES=8
# Steps: name, time limit (s), result files, command. The limits add up to less than BUDGET_S;
# each step also stops at the overall deadline.
STEPS=(
  "build|200|build.log|build"
  "tests|120|tests.log|$PY -m pytest -q -p no:cacheprovider -rf tests/unit/test_cuda.py"
  "bench|80|bench.log bench.json|$PY bench/bench_kernels.py --device cuda --workloads llama7b-bf16 --reps 5 --json \$OUT/bench.json"
  "verify|70|verify.log verify.json|$PY bench/bench_verify.py --device cuda --ranks 2 --layers 2 --hidden 1024 --json \$OUT/verify.json"
)
SUMMARY=summary.txt

# nvcc: CUDACXX, CUDA_HOME, PATH, then the usual install place.
find_nvcc() {
  local c
  for c in "${CUDACXX:-}" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc 2>/dev/null)" \
      /usr/local/cuda/bin/nvcc; do
    if [ -n "$c" ] && [ -x "$c" ]; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

build() {
  local nvcc arch
  nvcc=$(find_nvcc) || { echo "nvcc not found (CUDACXX, CUDA_HOME, PATH, /usr/local/cuda)"; return 1; }
  arch=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')")
  echo "nvcc: $nvcc; compiling for sm_$arch"
  # No -Werror: the warnings of an untried compiler must not stop the measurements.
  CUDACXX="$nvcc" FSDPCHECK_CUDA=ON FSDPCHECK_WERROR=OFF FSDPCHECK_CUDA_ARCHS="$arch" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" PIP_BREAK_SYSTEM_PACKAGES=1 \
    "$PY" -m pip install --disable-pip-version-check --no-build-isolation --no-deps \
    -C build-dir=build/gpu -e . || return 1
  "$PY" -c "import fsdpcheck; i = fsdpcheck.build_info(); print(i['backends']); assert 'cuda' in i['backends']"
}

# What each step prints as it ends (the table of that step).
show() {
  case "$1" in
    build) tail -3 "$OUT/build.log" ;;
    tests) tail -15 "$OUT/tests.log" ;;
    bench) grep -E "^# device|^workload|^llama" "$OUT/bench.log" ;;
    verify) grep -E "^#|^[a-z]" "$OUT/verify.log" | grep -v Warning | tail -14 ;;
  esac
}

if [ "$DRY" = 1 ]; then
  total=0
  files=1  # the summary
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit outs cmd <<<"$step"
    total=$((total + limit))
    files=$((files + $(wc -w <<<"$outs")))
    echo "plan: $name (<= ${limit} s) -> ${outs}: ${cmd}"
    case "$name" in
      build) declare -F build >/dev/null || { echo "dry-run: no build function"; exit 1; } ;;
      *)
        script=$(awk '{for (i = 1; i <= NF; i++) if ($i ~ /^bench\/.*\.py$/) print $i}' <<<"$cmd")
        tests=$(awk '{for (i = 1; i <= NF; i++) if ($i ~ /^tests\/.*\.py$/) print $i}' <<<"$cmd")
        for f in $script $tests; do
          [ -f "$f" ] || { echo "dry-run: $f is missing"; exit 1; }
        done
        if [ -n "$script" ]; then
          "$PY" "$script" --help >/dev/null || { echo "dry-run: $script --help failed"; exit 1; }
        fi
        ;;
    esac
  done
  echo "dry-run: nvcc would be $(find_nvcc || echo 'not found here')"
  echo "dry-run: $total s of step limits within a budget of $BUDGET_S s; $files result files (at most $MAX_FILES)"
  [ "$total" -le "$BUDGET_S" ] || { echo "dry-run: over the time budget"; exit 1; }
  [ "$files" -le "$MAX_FILES" ] || { echo "dry-run: too many result files"; exit 1; }
  echo "dry-run: ok"
  exit 0
fi

mkdir -p "$OUT"
start=$(date +%s)
deadline=$((start + BUDGET_S))
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$OUT/$SUMMARY"
all_ok=1
for step in "${STEPS[@]}"; do
  IFS='|' read -r name limit outs cmd <<<"$step"
  now=$(date +%s)
  left=$((deadline - now))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "$name: skipped (the ${BUDGET_S} s budget is spent)" | tee -a "$OUT/$SUMMARY"
    all_ok=0
    continue
  fi
  t0=$(date +%s)
  if [ "$name" = build ]; then
    timeout "$limit" bash -c "$(declare -f find_nvcc build); PY=$PY; build" > "$OUT/build.log" 2>&1
  else
    OUT=$OUT timeout "$limit" bash -c "$cmd" > "$OUT/${outs%% *}" 2>&1
  fi
  rc=$?
  show "$name"
  line="$name: rc=$rc, $(( $(date +%s) - t0 )) s (limit $limit s)"
  echo "$line" | tee -a "$OUT/$SUMMARY"
  [ "$rc" -eq 0 ] || all_ok=0
  if [ "$name" = build ] && [ "$rc" -ne 0 ]; then
    tail -40 "$OUT/build.log"
    echo "build failed: nothing else can run" | tee -a "$OUT/$SUMMARY"
    exit 1
  fi
done
echo "total: $(( $(date +%s) - start )) s; results in $OUT" | tee -a "$OUT/$SUMMARY"
[ "$all_ok" -eq 1 ]
