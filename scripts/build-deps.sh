#!/usr/bin/env bash
# What installing cachemgr needs besides Python: a C compiler and the Python headers (the
# directory scanner, cachemgr/fs/_dirscan.c, the batch unlink, cachemgr/fs/_unlink.c, and the
# eviction order's one-page pass, cachemgr/gc/_rank.c, are compiled at install). Installed with apt if missing; PY is the interpreter the venv is made
# from.
set -euo pipefail
PY=${PY:-python3}
missing=()
command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
headers=$("$PY" -c 'import os, sysconfig; print(os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))')
if [ "$headers" != "True" ]; then
  # Debian's own python3 keeps its headers in python3-dev; another Python must bring its own.
  [ "$("$PY" -c 'import sys; print(sys.prefix)')" = "/usr" ] || {
    echo "scripts/build-deps.sh: $PY has no Python.h; install its headers" >&2
    exit 1
  }
  missing+=(python3-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
  bash "$(dirname "$0")/apt-install.sh" "${missing[@]}"
fi
