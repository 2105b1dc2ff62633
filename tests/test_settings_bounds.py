"""Every setting has a range and a type: a value that would break what uses it is refused in
one line naming the field and the value, from an env var, the TOML file or a flag alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from cachemgr.settings import Settings, unknown_env_vars
from cachemgr.units import parse_duration
from tests.nsfixtures import run_main

# (setting, a value as an env var or flag gives it, what the message says about it)
OUT_OF_RANGE = [
    ("gc_interval", "0", "at least 0.1s"),  # 0 busy-looped a core
    ("gc_sweep_interval", "0.01", "at least 0.1s"),
    ("gc_delete_rate", "1e-300", "greater than or equal to 1"),  # killed the GC worker
    ("gc_delete_rate", "inf", "finite number"),
    ("gc_min_age", "99999999999d", "at most 100 years"),  # an OverflowError traceback
    ("gc_min_age", "36526d", "at most 100 years"),
    ("gc_tmp_ttl", "-5m", "must not be negative"),
    ("gc_unbound_ttl", "5300w", "at most 100 years"),
    ("batch_interval", "0.001", "greater than or equal to 0.01"),
    ("reconcile_interval", "0.5", "0 (never) or at least 1 second"),
    ("reconcile_interval", "1e12", "less than or equal to"),
    ("reconcile_interval", "nan", "finite number"),
    ("sglang_poll_interval", "0", "greater than or equal to 0.01"),
    # 1e-300 closed every connection whose request was not in its first packet
    ("http_header_timeout", "1e-300", "greater than or equal to 0.5"),
    ("gc_keep_unbound", "10000000", "less than or equal to 1000000"),
    ("gc_max_bytes", "10EB", "less than or equal to 9223372036854775807"),
    ("gc_namespace_max_bytes", "10EB", "less than or equal to"),
    ("gc_min_free_bytes", "10EB", "less than or equal to"),
    ("host", "", "at least 1 character"),
    # A decimal was read as its whole part: CACHEMGR_PORT=1.0 served on port 1.
    ("port", "1.0", "must be a whole number"),
    ("http_keep_alive_timeout", "5.0", "must be a whole number"),
    ("http_max_connections", "1024.0", "must be a whole number"),
    ("http_fd_reserve", "256.0", "must be a whole number"),
    ("gc_keep_unbound", "2.0", "must be a whole number"),
    ("hash_workers", "4.0", "must be a whole number"),
    # CACHEMGR_GC_MAX_FILES=1.0 was a cap of one file: a GC that deleted the whole cache.
    ("gc_max_files", "1.0", "must be a whole number"),
    ("gc_max_files", "1e6", "must be a whole number"),
    ("gc_namespace_max_files", "1.5", "must be a whole number"),
    ("fleet_buffer", "100000.0", "must be a whole number"),
    ("sglang_url", "localhost:30000", "http:// or https:// URL"),
    # Often meant as "no cap": it evicted every page at start.
    ("gc_max_bytes", "0", "leave it unset for no cap"),
    ("gc_namespace_max_bytes", "0B", "leave it unset for no cap"),
    # A month to systemd and ISO 8601 (P1M): read as a minute, a TTL deleted 43,200x sooner.
    ("gc_unbound_ttl", "1M", '"M" is ambiguous'),
    ("gc_min_age", "1h 5M", '"M" is ambiguous'),
]


pytestmark = pytest.mark.usefixtures("no_caller_settings")


def test_every_integer_setting_refuses_a_decimal() -> None:
    """A new integer setting is held to it too: the file counts, added later, were not."""
    integers = {n for n, f in Settings.model_fields.items() if f.annotation in (int, int | None)}
    decimals = {name for name, _, says in OUT_OF_RANGE if says == "must be a whole number"}
    assert integers == decimals


@pytest.mark.parametrize(("name", "value", "says"), OUT_OF_RANGE)
def test_an_out_of_range_env_var_is_one_line_exit_2(
    name: str,
    value: str,
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(f"CACHEMGR_{name.upper()}", value)
    code, err = run_main(["--root", str(tmp_path / "r"), "config"], capsys)
    assert code == 2
    (line,) = err
    assert line.startswith(f"cachemgr: error: invalid {name} ") and f"{value!r}" in line, line
    assert says in line, line


def _run_with_toml(
    line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[int, list[str]]:
    """`cachemgr config` with a TOML file at tmp_path/c.toml holding one setting's `line`."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[cachemgr]\n{line}\n")
    return run_main(["--config", str(cfg), "--root", str(tmp_path / "r"), "config"], capsys)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("gc_interval = 0", "at least 0.1s"),
        ("gc_delete_rate = 1e-300", "greater than or equal to 1"),
        ('gc_min_age = "99999999999d"', "at most 100 years"),
        ("gc_min_age = 1e300", "durations may not exceed"),
        ("sglang_poll_interval = 0.0", "greater than or equal to 0.01"),
    ],
)
def test_an_out_of_range_toml_value_is_one_line_exit_2(
    line: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_with_toml(line, tmp_path, capsys)
    cfg = tmp_path / "c.toml"
    assert code == 2
    (message,) = err
    assert message.startswith(f"cachemgr: error: invalid {line.split()[0]} "), message
    assert f"or {cfg})" in message and says in message, message


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("port = true", "true: must be an integer"),  # was port 1
        ('port = "9477"', '"9477": must be an integer'),
        ("hash_workers = 2.0", "2.0: must be an integer"),
        ('batch_interval = "0.5"', '"0.5": must be a number'),
        ("gc_delete_rate = false", "false: must be a number"),
        (
            "gc_max_bytes = 1.5",
            '1.5: must be a size: a number of bytes or a string such as "500GB"',
        ),
        ("gc_min_age = true", 'true: must be a duration: seconds or a string such as "5m"'),
        ("root = 5", "5: must be a string"),
        ('instance = ["a"]', '["a"]: must be a string'),
        ("log_level = 1", "1: must be a string"),
        ("sglang_url = 3000", "3000: must be a string"),
    ],
)
def test_a_toml_value_of_the_wrong_type_is_refused(
    line: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_with_toml(line, tmp_path, capsys)
    cfg = tmp_path / "c.toml"
    assert code == 2
    assert err == [f"cachemgr: error: invalid {line.split()[0]} in {cfg}: {says}"]


def test_toml_values_of_the_right_types_are_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "[cachemgr]\nport = 2222\nbatch_interval = 1\ngc_max_bytes = 500\n"
        'gc_namespace_max_bytes = "1GB"\ngc_min_age = 30\ngc_tmp_ttl = "2 minutes"\n'
    )
    code, err = run_main(["--config", str(cfg), "--root", str(tmp_path / "r"), "config"], capsys)
    assert code == 0, err


@pytest.mark.parametrize(
    ("flag", "value", "name", "says"),
    [
        ("--min-age", "99999999999d", "gc_min_age", "at most 100 years"),
        ("--delete-rate", "1e-300", "gc_delete_rate", "greater than or equal to 1"),
        ("--tmp-ttl", "-1s", "gc_tmp_ttl", "must not be negative"),
        ("--max-bytes", "10EB", "gc_max_bytes", "less than or equal to"),
        # as the settings read it, not click's own message (its usage lines, a second name)
        ("--max-files", "1.0", "gc_max_files", "must be a whole number"),
        ("--namespace-max-files", "1e6", "gc_namespace_max_files", "must be a whole number"),
    ],
)
def test_an_out_of_range_flag_is_one_line_exit_2(
    flag: str,
    value: str,
    name: str,
    says: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = run_main(["--root", str(tmp_path / "r"), "gc", "--dry-run", flag, value], capsys)
    assert code == 2
    (line,) = err
    assert line.startswith(f"cachemgr: error: invalid {name} ") and says in line, line
    assert not (tmp_path / "r").exists()


def test_serve_refuses_a_busy_loop_interval_before_binding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--root", str(tmp_path / "r"), "serve", "--port", "0", "--reconcile-interval", "0.01"]
    code, err = run_main(argv, capsys)
    assert code == 2 and len(err) == 1 and "reconcile_interval" in err[0], err


def test_a_hundred_years_is_the_longest_duration_and_it_works(tmp_path: Path) -> None:
    """The bound is usable: a GC run with 100-year ages does its date arithmetic."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEMGR_")}
    env |= {"CACHEMGR_GC_UNBOUND_TTL": "36525d", "CACHEMGR_GC_TMP_TTL": "36525d"}
    root = str(tmp_path / "r")
    for argv in (["config", "--check"], ["gc", "--dry-run", "--min-age", "36525d"], ["ls"]):
        out = subprocess.run(
            [sys.executable, "-m", "cachemgr", "--root", root, *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert "Traceback" not in out.stderr and out.returncode in (0, 1), (argv, out.stderr)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2 minutes", 120),
        ("1 minute", 60),
        ("90 sec", 90),
        ("1 hour 30 min", 5400),
        ("1h 30m", 5400),
        ("1.5h", 5400),
        ("2 days", 172800),
        ("1w", 604800),
        ("2 weeks", 1209600),
        ("5 mins", 300),
        ("3 hrs", 10800),
        ("PT5M", 300),
        ("90", 90),
        (" 10s ", 10),
        ("1h, 30m", 5400),
        ("1 Min", 60),
        ("P1M", 30 * 86400),  # ISO 8601's month, as pydantic reads it
    ],
)
def test_durations_in_the_common_forms_are_read(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["2 fortnights", "soon", "1h30", "5m x", ""])
def test_a_duration_in_no_form_lists_the_forms(
    text: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CACHEMGR_GC_MIN_AGE", text)
    code, err = run_main(["--root", str(tmp_path / "r"), "config"], capsys)
    assert code == 2
    (line,) = err
    assert "invalid character" not in line, line  # pydantic's message said nothing useful
    assert '"2 minutes"' in line and '"1h30m"' in line and '"PT5M"' in line, line


def test_a_misspelt_env_var_is_warned_once_with_the_name_it_may_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CACHEMGR_GCMAXBYTES", "100kB")
    monkeypatch.setenv("CACHEMGR_WHATEVER", "1")
    monkeypatch.setenv("CACHEMGR_SGLANG_ENV", "/opt/sglang-env")  # the tests' own variable
    monkeypatch.setenv("CACHEMGR_LOG_FORMAT", "json")
    code, err = run_main(["--root", str(tmp_path / "r"), "config"], capsys)
    assert code == 0, err
    messages = [json.loads(line)["msg"] for line in err]
    assert messages == [
        "environment variable CACHEMGR_GCMAXBYTES is ignored; did you mean CACHEMGR_GC_MAX_BYTES?",
        "environment variable CACHEMGR_WHATEVER is ignored (not a cachemgr setting)",
    ]
    code, err = run_main(["--root", str(tmp_path / "r"), "config"], capsys)
    assert code == 0 and err == []  # once per process


def test_every_cachemgr_variable_the_repo_uses_is_known() -> None:
    """The variables cachemgr, its tests, scripts and deploy files set are never warned about."""
    repo = Path(__file__).resolve().parent.parent
    listed = subprocess.run(
        ["git", "grep", "-ohE", r"\bCACHEMGR_[A-Z0-9_]+", "--", f":!tests/{Path(__file__).name}"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    used = {name for name in listed if not name.endswith("_")}  # a prefix in prose: CACHEMGR_*
    assert "CACHEMGR_SGLANG_ENV" in used
    assert unknown_env_vars(dict.fromkeys(used, "x")) == []


@pytest.mark.parametrize("root", ["/srv/cache\r", "/srv/cache ", " /srv/cache", "/srv/cache\n"])
def test_a_root_with_whitespace_around_it_is_refused_not_served_beside_the_real_one(
    root: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CRLF env file's root served a new, empty dir `/srv/cache\r` while the engine wrote to
    /srv/cache, and every check passed."""
    monkeypatch.setenv("CACHEMGR_ROOT", root)
    code, err = run_main(["config", "--check"], capsys)
    assert code == 2
    (line,) = err
    assert line.startswith("cachemgr: error: invalid root ") and "whitespace" in line, line
    assert not Path(root).exists()


def test_settings_outside_the_cachemgr_table_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Beside a [cachemgr] table, top-level keys were ignored, typos and all, and the check
    passed on the default root."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('root = "/x"\ngc_max_byts = "1GB"\n[cachemgr]\nlog_level = "info"\n')
    code, err = run_main(["--config", str(cfg), "config", "--check"], capsys)
    assert code == 2
    (line,) = err
    assert "gc_max_byts, root outside the [cachemgr] table" in line, line
    # without the table, the top level is the settings, as before
    cfg.write_text(f'root = "{tmp_path / "r"}"\nlog_level = "info"\n')
    code, err = run_main(["--config", str(cfg), "config", "--check"], capsys)
    assert code == 0, err
