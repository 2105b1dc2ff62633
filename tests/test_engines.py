"""The engine registry: one `Engine` object per engine, and the tables below it agree."""

from __future__ import annotations

from pathlib import Path

from cachemgr import engines, formats
from cachemgr.daemon.metrics import METRICS
from cachemgr.engine import Probe, ProbeHooks
from cachemgr.identity.engines import RECORDS, record_class
from cachemgr.settings import Settings

URL = "http://127.0.0.1:30000"


def test_every_engine_table_lists_the_same_engines() -> None:
    assert {e.name: e.format for e in engines.ENGINES} == formats.FORMATS
    assert tuple(e.record for e in engines.ENGINES) == RECORDS
    assert all(e.name == e.record.ENGINE for e in engines.ENGINES)
    assert engines.DEFAULT.name == formats.DEFAULT_ENGINE


def test_a_launch_command_names_its_engine() -> None:
    vllm = ["vllm", "serve", "Qwen/Qwen3-0.6B"]
    assert engines.for_launch(vllm).name == "vllm"
    assert engines.for_launch(["sglang", "serve", "--model-path", "M"]).name == "sglang"
    assert engines.for_launch(["python", "-m", "sglang.launch_server"]).name == "sglang"
    assert engines.for_launch(()) is engines.DEFAULT  # an identity given by options alone


def test_an_identity_record_names_its_engine() -> None:
    assert record_class({"engine": "vllm"}).ENGINE == "vllm"
    assert record_class({}).ENGINE == "sglang"  # records from before vLLM have no key
    assert record_class({"engine": "lmcache"}).ENGINE == "sglang"  # as format_for reads it
    for engine in engines.ENGINES:
        assert engines.named(engine.name) is engine


def test_the_probe_is_the_engine_whose_server_the_settings_name(tmp_path: Path) -> None:
    """The daemon asks the registry: SGLang's probe with `sglang_url`, none without; every
    metric an engine's probe shows is one /metrics documents."""
    hooks = ProbeHooks(instance="gpu0", bound=lambda _: None, on_mismatch=lambda ns, d: None)
    assert engines.probe(Settings(root=tmp_path), hooks) is None
    assert engines.named("vllm").probe(Settings(root=tmp_path, sglang_url=URL), hooks) is None
    probe = engines.probe(Settings(root=tmp_path, sglang_url=URL, sglang_poll_interval=2), hooks)
    assert probe is not None and probe.name == "probe"
    assert isinstance(probe, Probe) and probe.state.up is False
    assert [m.name for m in probe.families()] == ["cachemgr_sglang_up"]  # no scrape yet
    assert set(engines.probe_metrics()) <= set(METRICS)
    assert "cachemgr_sglang_up" in engines.probe_metrics()
