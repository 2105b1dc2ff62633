#!/usr/bin/env bash
# Install the named Debian packages that are not installed yet (sudo when not root).
set -euo pipefail
# make test runs its set-up steps at once and more than one may need apt, which fails rather
# than waits on another apt's lock: one caller at a time, each deciding what is missing after
# the one before it is done. (apt runs with the lock's fd closed: a service a package starts
# must not hold it.)
exec {lock}<"${BASH_SOURCE[0]}"
flock "$lock"
missing=()
for p in "$@"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
[ ${#missing[@]} -gt 0 ] || exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq {lock}<&-
# Debian's prometheus package would start a service; policy-rc.d-less containers just skip it.
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null {lock}<&-
