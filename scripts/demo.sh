#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs the embedded demo.
set -euo pipefail
cd "$(dirname "$0")/.."
# The demo needs no trainer library: skip installing the test corpus's.
FSDPCHECK_TEST_LIBS=${FSDPCHECK_TEST_LIBS:-0} bash scripts/setup.sh > /dev/null
VENV=${FSDPCHECK_VENV:-.venv}
exec "$VENV/bin/python" -m fsdpcheck demo "$@"
