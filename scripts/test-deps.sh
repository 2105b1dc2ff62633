#!/usr/bin/env bash
# Install the Debian packages the test suite uses, if missing: prometheus + promtool (a real
# scrape in tests), g++ / OpenSSL headers (SGLang compiles its page hash on first use), and
# chromium (a headless browser renders the daemon's /docs page offline), etcd-server and bindfs
# (the fleet tests: a real etcd coordinator, nodes as FUSE pass-through mounts of one dir).
set -euo pipefail
bash "$(dirname "$0")/apt-install.sh" prometheus docker-compose g++ libssl-dev chromium \
  etcd-server bindfs
