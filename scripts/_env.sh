# Sourced by the setup scripts: the venv and a pip install that fails loudly.
#
# pip_install ARGS...: pip install into $VENV; pip's own output is kept in a log and shown
# (last lines) only when it fails, and a failure stops the calling script.
pip_install() {
  local log
  log=$(mktemp)
  if ! "$VENV/bin/pip" install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" | tail -40 >&2
    rm -f "$log"
    echo "setup: pip install $* failed" >&2
    return 1
  fi
  rm -f "$log"
}

make_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
}
