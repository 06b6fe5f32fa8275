#!/usr/bin/env bash
# Makes .venv (once) with torch and the build/test tools, then builds fsdpcheck into it.
#
#   FSDPCHECK_VENV   the virtual environment to use (default .venv)
#   FSDPCHECK_TORCH  the torch to install when the venv has none (default torch==2.13.0)
#   FSDPCHECK_CUDA   AUTO (default), ON or OFF: build the CUDA implementation
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FSDPCHECK_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip_quiet() { "$VENV/bin/pip" install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored" || true; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing ${FSDPCHECK_TORCH:-torch==2.13.0} into $VENV"
  pip_quiet "${FSDPCHECK_TORCH:-torch==2.13.0}"
fi
pip_quiet numpy safetensors accelerate pytest hypothesis ruff "mypy==2.4.1" "cmake>=3.26" ninja "scikit-build-core>=0.10"
# --no-build-isolation: the extension must be compiled against the torch it will run with.
echo "setup: building fsdpcheck ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
"$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation -e . 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import fsdpcheck; print('setup: fsdpcheck', fsdpcheck.__version__, fsdpcheck.build_info()['backends'])"
