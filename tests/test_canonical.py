"""Namespace ids and digests are taken over canonical JSON: its bytes, pinned here for every
caller (non-ASCII text too, which each caller writes as it always has), must never change, or
every namespace made before gets a new id and its cache is lost."""

from __future__ import annotations

from cachemgr.sglang.identity import _override_args
from cachemgr.sglang.record import Identity
from cachemgr.vllm.args import resolve_vllm_args
from cachemgr.vllm.identity import _config_digest

SGLANG_RECORD = {
    "schema_version": 2,
    "weights": {
        "mode": "full",
        "algo": "xxh3-128",
        "files": [
            {"name": "config.json", "size": 100, "digest": "ab" * 16},
            {"name": "model.safetensors", "size": 4096, "digest": "cd" * 16},
        ],
    },
    "kv_cache_dtype": "fp8_e4m3",
    "dtype": "bfloat16",
    "page_size": 64,
    "hicache_mem_layout": "page_first",
    "topology": {"tp_size": 2},
    "sglang_version": "0.5",
    "storage": {"key_scheme": "k"},
    "source": {"model_path": "/m", "model_dir": "/m", "served_model_name": "m"},
}
ACCENTED = '{ "b": "caf\u00e9",  "a": [1, {"d": null, "c": 2.5}] }'


def test_sglang_override_args_keep_their_text() -> None:
    assert _override_args(ACCENTED) == '{"a":[1,{"c":2.5,"d":null}],"b":"caf\u00e9"}'
    assert _override_args("{}") is None


def test_vllm_json_flags_keep_their_text() -> None:
    args = resolve_vllm_args(
        [
            "vllm",
            "serve",
            "m",
            "--hf-overrides",
            ACCENTED,
            "--kv-transfer-config",
            '{"kv_connector_extra_config": {"note": "caf\u00e9"}, "kv_role": "kv_both"}',
            "--attention-backend",
            "FLASH_ATTN",
        ]
    )
    assert args.hf_overrides == '{"a":[1,{"c":2.5,"d":null}],"b":"caf\\u00e9"}'
    assert args.kv_transfer_config == (
        '{"kv_connector_extra_config":{"note":"caf\\u00e9"},"kv_role":"kv_both"}'
    )
    assert args.attention == '{"backend":"FLASH_ATTN"}'


def test_a_vllm_model_config_digest_is_unchanged() -> None:
    config = {"model_type": "llama", "name": "caf\u00e9", "layers": [1, 2]}
    assert _config_digest(config) == "2275393a563437cab69795e97b20be0e"


def test_the_sglang_record_digest_is_unchanged() -> None:
    """The digest of an SGLang record of the existing schema, pinned: namespaces made before
    vLLM support must keep their ids."""
    ident = Identity.model_validate(SGLANG_RECORD)
    assert ident.digest == "81382c037f07d6a020dea7db4b649f9c"
    assert "engine" not in ident.model_dump()


def test_an_identity_digest_over_non_ascii_text_is_unchanged() -> None:
    """The same record whose override args hold non-ASCII text (the record's JSON keeps it
    unescaped, the flag's own JSON too)."""
    ident = Identity.model_validate({**SGLANG_RECORD, "model_override_args": '{"b":"caf\u00e9"}'})
    assert '"model_override_args":"{\\"b\\":\\"caf\u00e9\\"}"' in ident.canonical().decode()
    assert ident.digest == "9dc554764a2ffbb93a51c2ba009e7050"
