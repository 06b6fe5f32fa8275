#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then lints and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${FSDPCHECK_VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"
"$VENV/bin/python" -m pytest -q "$@"
