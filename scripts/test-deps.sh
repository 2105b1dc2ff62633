#!/usr/bin/env bash
# Install the Debian packages the test suite uses, if missing: prometheus + promtool (a real
# scrape in tests), and g++ / OpenSSL headers (SGLang compiles its page hash on first use).
set -euo pipefail
packages=(prometheus docker-compose g++ libssl-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  # Debian's prometheus package would start a service; policy-rc.d-less containers just skip it.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
