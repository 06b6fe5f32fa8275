#!/usr/bin/env bash
# Compiles the CUDA implementation against a CUDA build of torch (warnings are errors), on a
# machine without a GPU, and runs the test suite with that build (CUDA tests skip cleanly). Then
# reads the kernels' SASS (bench/sass_report.py --check): any spill, a hot kernel below 32 warps
# per SM or an instruction count past its target fails it.
#
#   FSDPCHECK_CUDA_VENV   the venv for this check (default .venv-cuda)
#   FSDPCHECK_CUDA_TORCH  the CUDA torch to install (default torch==2.14.1)
#   FSDPCHECK_CUDA_ARCHS  CUDA architectures to compile for (default 90)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FSDPCHECK_CUDA_VENV:-.venv-cuda}
# shellcheck source=scripts/_env.sh
source scripts/_env.sh
make_venv
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  # A CUDA build of torch and the NVIDIA libraries it loads take ~5.6 GiB in the venv.
  need_disk 7 "installing ${FSDPCHECK_CUDA_TORCH:-torch==2.14.1} into $VENV"
  echo "cuda-build: installing ${FSDPCHECK_CUDA_TORCH:-torch==2.14.1} into $VENV"
  pip_install "${FSDPCHECK_CUDA_TORCH:-torch==2.14.1}"
fi
# nvdisasm (for the SASS report) from NVIDIA's pip package: the toolkit here ships without it.
pip_install numpy safetensors accelerate pytest hypothesis "cmake>=3.26" ninja "scikit-build-core>=0.10" \
  nvidia-cuda-nvdisasm
mkdir -p build; LOG=build/cuda-build.log
echo "cuda-build: compiling ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'), nvcc: $(command -v nvcc || echo none))"
FSDPCHECK_CUDA=ON FSDPCHECK_WERROR=ON FSDPCHECK_CUDA_ARCHS=${FSDPCHECK_CUDA_ARCHS:-90} \
  "$VENV/bin/pip" install --disable-pip-version-check --no-build-isolation -C build-dir=build/cuda \
  -e . > "$LOG" 2>&1 || { grep -v "is ignored" "$LOG" | tail -60; exit 1; }
"$VENV/bin/python" - <<'PY'
import fsdpcheck
info = fsdpcheck.build_info()
assert "cuda" in info["backends"], info
print("cuda-build: ok", info["backends"], "torch", info["torch"])
PY
"$VENV/bin/python" bench/sass_report.py --check
# The library corpus and trainer integrations test checkpoint layouts, not the build: they run
# in the main venv (scripts/test.sh), which has the trainer libraries.
"$VENV/bin/python" -m pytest -q -m "not corpus" --ignore=tests/dist/integrations
