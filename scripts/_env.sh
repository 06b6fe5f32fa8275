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

# need_disk GIB WHAT: stop with a clear message when the file system that holds $VENV has less
# than GIB GiB free (pip's own "No space left on device" names neither the need nor the place).
need_disk() {
  local dir free_kib
  dir=$(dirname "$(realpath -m "$VENV")")
  free_kib=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
  if [ "$free_kib" -lt $(($1 * 1024 * 1024)) ]; then
    echo "setup: $2 needs about $1 GiB free in $dir; $((free_kib / 1024)) MiB are free there" >&2
    df -h "$dir" >&2
    echo "setup: free disk space (old clones, build trees, other venvs) and run again" >&2
    return 1
  fi
}

make_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
}
