#!/usr/bin/env bash
# Build (once) the environment in which tests drive SGLang's own HiCacheFile class:
# CPU torch from the machine's local wheel, SGLang installed with --no-deps, and the modules
# its package __init__ imports (FIELD_NOTES §5). Reused when already complete.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
env_dir=${CACHEMGR_SGLANG_ENV:-$here/.sglang-env}
sglang_version=0.5.23
stamp="$env_dir/.complete-$sglang_version"

if [ -f "$stamp" ]; then
  exit 0
fi

# The page hash is a C++ extension compiled on first use: it needs g++, ninja, OpenSSL headers.
if ! command -v g++ >/dev/null || ! dpkg -s libssl-dev >/dev/null 2>&1; then
  bash "$here/scripts/test-deps.sh"
fi

rm -rf "$env_dir"
python3 -m venv "$env_dir"
pip="$env_dir/bin/pip"
# pip warns about every configured-but-absent local index; those lines are noise here.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
quiet "$pip" install -q --upgrade pip >/dev/null
# torch first, pinned: on this project's machines pip's configured local wheel directory holds
# the CPU build of 2.13.0; a bare "torch" requirement would pull a multi-GB CUDA build.
quiet "$pip" install -q torch==2.13.0
# The rest at the versions the suite passed with (scripts/sglang-env.constraints.txt).
quiet "$pip" install -q -c "$here/scripts/sglang-env.constraints.txt" \
  numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec \
  pydantic pyzmq tqdm ipython aiohttp ninja
quiet "$pip" install -q --no-deps "sglang==$sglang_version"
# Import once and compile the hash extension now, not inside a timed test.
"$env_dir/bin/python" - <<'PY'
from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: F401
from sglang.srt.mem_cache.utils import get_hash_str
get_hash_str([1, 2, 3, 4], None, page_size=4)
PY
touch "$stamp"
echo "sglang env ready: $env_dir"
