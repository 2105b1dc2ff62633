#!/usr/bin/env bash
# Build (once) the environment in which cachemgr drives vLLM's own file-system KV tier
# (FileSystemTierManager, tests/vllm_driver.py): CPU torch from the machine's local wheel,
# vLLM installed with --no-deps, and only the packages that importing the tier's modules
# needs (found by trial; docs/vllm-notes.md §Environment). Reused when already complete.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
env_dir=${CACHEMGR_VLLM_ENV:-$here/.vllm-env}
vllm_version=0.34.0
stamp="$env_dir/.complete-$vllm_version"

if [ -f "$stamp" ]; then
  exit 0
fi

rm -rf "$env_dir"
python3 -m venv "$env_dir"
pip="$env_dir/bin/pip"
# pip warns about every configured-but-absent local index; those lines are noise here.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
quiet "$pip" install -q --upgrade pip >/dev/null
# torch first, pinned, as for SGLang: pip's local wheel directory holds the CPU build of
# 2.13.0; vLLM's own requirement (torch==2.14.0) would pull a multi-GB CUDA build.
quiet "$pip" install -q torch==2.13.0
# Everything below goes in with --no-deps, so nothing can pull a CUDA torch or vLLM's ~80
# serving dependencies; each pin is the version vLLM 0.34.0 asks for where it pins one,
# else the one this set was verified with. The order is the order importing
# vllm.v1.kv_offload.tiering.fs.manager asked for them (vLLM's package __init__ and
# file_mapper's import of the KV connector pull in vllm.config, transformers, the OpenAI
# entrypoints' parsers and fastapi).
quiet "$pip" install -q --no-deps \
  packaging==26.4 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0 regex==2026.11.19 \
  numpy==2.4.6 transformers==5.20.2 safetensors==0.8.0 huggingface_hub==2.4.0 \
  tqdm==4.70.1 httpx2==2.16.2 idna==3.20 PyYAML==6.0.4 httpcore2==2.16.2 \
  truststore==0.10.5 h11==0.16.0 tokenizers==0.23.3 pydantic==2.14.4 \
  pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 cbor2==6.3.0 \
  aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 propcache==0.5.4 \
  aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 requests==2.34.2 \
  certifi==2026.10.19.post1 charset-normalizer==3.5.3 openai-harmony==0.0.8 openai==3.57.0 \
  sniffio==1.3.1 anyio==4.16.0 pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2 \
  msgspec==0.23.0 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 \
  prometheus_client==0.26.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 fastapi==0.136.3 \
  starlette==1.10.0 annotated-doc==0.0.7 partial-json-parser==0.2.1.1.post7 \
  "llguidance>=1.7.0,<1.8.0" xxhash==4.1.0
quiet "$pip" install -q --no-deps "vllm==$vllm_version"
# Import once now (and so check the set is complete), not inside a timed test.
"$env_dir/bin/python" - <<'PY'
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: F401
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: F401
PY
touch "$stamp"
echo "vllm env ready: $env_dir"
