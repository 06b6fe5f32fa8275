#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then lints and runs the whole test suite (extra arguments go to
# pytest).
#
#   scripts/test.sh --fast   the edit-and-run loop: tests/unit and tests/hostile without the
#                            tests marked slow, a few hypothesis examples each, no lint; sets up
#                            only when the venv cannot import fsdpcheck yet
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FSDPCHECK_VENV:-.venv}
if [ "${1:-}" = "--fast" ]; then
  shift
  "$VENV/bin/python" -c "import fsdpcheck" 2>/dev/null || bash scripts/setup.sh
  export FSDPCHECK_HYPOTHESIS=${FSDPCHECK_HYPOTHESIS:-fast}
  # Only the two folders are collected (the others import the trainer libraries at collection);
  # paths given on the command line replace them.
  exec "$VENV/bin/python" -m pytest -q -o "testpaths=tests/unit tests/hostile" \
    -m "(unit or hostile) and not slow" "$@"
fi
bash scripts/setup.sh
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"
"$VENV/bin/python" -m pytest -q "$@"
