"""A byte size is a whole number of bytes: "1.5" (no unit) was read as a cap of 1 byte, which
deletes the whole cache. Refused in one line naming the setting from an env var, the TOML
file, a flag, and as a 422 from POST /v1/gc; "1.5GB" is still 1,500,000,000 bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachemgr.layout import Layout
from cachemgr.settings import load_settings
from tests.daemon_helpers import NS_A, page_name, register_namespace, running_daemon, store_page
from tests.nsfixtures import run_main

BYTE_SETTINGS = ["gc_max_bytes", "gc_namespace_max_bytes", "gc_min_free_bytes"]
FRACTIONS = ["1.5", "0.5", "1.5B", "1.5 b", "12bit", "1.0001kB"]


pytestmark = pytest.mark.usefixtures("no_caller_settings")


@pytest.mark.parametrize("name", BYTE_SETTINGS)
@pytest.mark.parametrize("value", FRACTIONS)
def test_a_fraction_of_a_byte_from_env_is_one_line_exit_2(
    name: str,
    value: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(f"CACHEMGR_{name.upper()}", value)
    code, err = run_main(["--root", str(tmp_path / "r"), "config"], capsys)
    assert code == 2
    (line,) = err
    assert line.startswith(f"cachemgr: error: invalid {name} ") and repr(value) in line, line
    assert "whole number of bytes" in line, line


@pytest.mark.parametrize("name", BYTE_SETTINGS)
def test_a_fraction_of_a_byte_in_toml_is_one_line_exit_2(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[cachemgr]\n{name} = "1.5"\n')
    code, err = run_main(["--config", str(cfg), "--root", str(tmp_path / "r"), "config"], capsys)
    assert code == 2
    (line,) = err
    assert line.startswith(f"cachemgr: error: invalid {name} ") and str(cfg) in line, line
    assert "whole number of bytes" in line, line


@pytest.mark.parametrize(
    ("flag", "name"),
    [
        ("--max-bytes", "gc_max_bytes"),
        ("--namespace-max-bytes", "gc_namespace_max_bytes"),
        ("--min-free-bytes", "gc_min_free_bytes"),
    ],
)
def test_a_fraction_of_a_byte_as_a_gc_flag_is_one_line_exit_2(
    flag: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_main(["--root", str(tmp_path / "r"), "gc", "--dry-run", flag, "1.5"], capsys)
    assert code == 2
    (line,) = err
    assert line.startswith(f"cachemgr: error: invalid {name} ") and "whole number" in line, line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("text", "size"),
    [("1.5GB", 1_500_000_000), ("1.5 GB", 1_500_000_000), ("2.5KiB", 2560), ("500", 500)],
)
def test_a_fraction_with_a_unit_is_still_a_size(text: str, size: int) -> None:
    for name in BYTE_SETTINGS:
        assert getattr(load_settings(**{name: text}), name) == size
    assert load_settings(gc_max_bytes=5.0).gc_max_bytes == 5  # a whole float is whole bytes


def test_post_gc_refuses_a_fraction_of_a_byte_and_deletes_nothing(layout: Layout) -> None:
    d = register_namespace(layout, NS_A, instance="gpu0")
    for i in range(4):
        store_page(d, page_name(i), size=1024)
    settings = load_settings(root=layout.root, gc_interval=3600, gc_min_age=0)
    with running_daemon(settings) as dm:
        for name in ("max_bytes", "namespace_max_bytes", "min_free_bytes"):
            for value in ("1.5", 1.5, "0.5B"):
                r = dm.post("/v1/gc", json={name: value})
                assert r.status_code == 422, (name, value, r.text)
                assert r.headers["content-type"] == "application/problem+json"
                assert name in r.json()["errors"][0]["loc"], r.text
        ok = dm.post("/v1/gc", json={"max_bytes": "1.5GB", "dry_run": True})
        assert ok.status_code == 200, ok.text
    assert len(list(d.glob("*.bin"))) == 4


def test_an_optional_size_or_duration_in_toml_takes_its_own_types(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A setting that may be unset is held to its type's TOML kinds, not to "a string": the
    validator that wraps it (whole bytes, duration words) hid the type."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[cachemgr]\ngc_max_bytes = 500\ngc_unbound_ttl = 30\n")
    code, err = run_main(["--config", str(cfg), "--root", str(tmp_path / "r"), "config"], capsys)
    assert code == 0, err
    cfg.write_text("[cachemgr]\ngc_namespace_max_bytes = 1.5\n")
    code, err = run_main(["--config", str(cfg), "--root", str(tmp_path / "r"), "config"], capsys)
    assert code == 2 and "must be a size" in err[0], err
