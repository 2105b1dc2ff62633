#!/usr/bin/env bash
# Install the Debian packages the test suite uses, if missing: prometheus + promtool (a real
# scrape in tests), g++ / OpenSSL headers (SGLang compiles its page hash on first use), and
# chromium (a headless browser renders the daemon's /docs page offline).
set -euo pipefail
bash "$(dirname "$0")/apt-install.sh" prometheus docker-compose g++ libssl-dev chromium
