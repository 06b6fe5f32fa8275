#!/usr/bin/env bash
# Runs the DCP metadata reader's tests once more under the system's python3 when it is another
# CPython release of the venv's minor version (Debian 12's python3 is 3.11.2, whose pickle
# writes enum members by name: NOTE: [enum members by name] in fsdpcheck/_unpickle.py). Same
# minor version, same ABI: it imports torch, fsdpcheck and the test libraries from the venv
# (nothing to install) with its own standard library (pickle, enum). Another minor version would
# need a venv of its own (torch, the build): it is skipped, and says so.
#
#   FSDPCHECK_SYSTEM_PYTHON   the interpreter (default /usr/bin/python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FSDPCHECK_VENV:-.venv}
SYS=${FSDPCHECK_SYSTEM_PYTHON:-/usr/bin/python3}
if [ ! -x "$SYS" ]; then
  echo "system python: no $SYS, skipped"
  exit 0
fi
version() { "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])'; }
mine=$(version "$VENV/bin/python")
theirs=$(version "$SYS")
if [ "$mine" = "$theirs" ]; then
  echo "system python: $SYS is CPython $theirs, as the venv: nothing more to run"
  exit 0
fi
if [ "${mine%.*}" != "${theirs%.*}" ]; then
  echo "system python: $SYS is CPython $theirs, the venv $mine: another minor version needs a venv of its own, skipped"
  exit 0
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# A venv of the system python (no pip: nothing is installed) that sees the venv's packages
# through a .pth line, so that the tests' own subprocesses (sys.executable) see them too.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$SYS" -m venv --without-pip "$tmp/venv"
tmp_site=$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$site')" > "$tmp_site/fsdpcheck-venv.pth"
echo "system python: the metadata reader's tests under $SYS (CPython $theirs; the venv: $mine)"
"$tmp/venv/bin/python" -m pytest -q -p no:cacheprovider tests/unit/test_metadata_enums.py \
  tests/hostile/test_reading.py tests/hostile/test_security.py "$@"
