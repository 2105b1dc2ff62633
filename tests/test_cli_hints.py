"""Click's "No such option" says where the option lives: a global flag given after the command,
or a setting the command takes no flag for (its env var and config key)."""

from __future__ import annotations

import json

import pytest

from cachemgr.cli.main import main


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The CLI's exit code must be Click's usage error (2); its `Error:` line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("Error: ")]
    return line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["init", "--root", "X"],
            "--root is a global option: give it before the command, cachemgr --root X init …",
        ),
        (["gc", "--dry-run", "--state-dir=/s"], "cachemgr --state-dir=/s gc …"),
        (["status", "--log-level", "debug"], "cachemgr --log-level debug status …"),
        (["ls", "--config", "c.toml"], "cachemgr --config c.toml ls …"),
        # a subcommand's hint names its whole path; the value is the misplaced one's
        (["fingerprint", "diff", "a", "b", "--root", "X"], "cachemgr --root X fingerprint diff …"),
        (["--root", "A", "init", "--root", "B"], "cachemgr --root B init …"),
    ],
)
def test_a_global_option_after_the_command_says_it_is_global(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in _error(argv, capsys)


@pytest.mark.parametrize(
    ("argv", "setting"),
    [
        (["serve", "--max-bytes", "10GB"], "gc_max_bytes"),
        (["serve", "--gc-interval", "5s"], "gc_interval"),
        (["init", "--min-age=5m"], "gc_min_age"),
        (["serve", "--max-byte", "1"], "gc_max_bytes"),  # a near miss of another command's flag
        (["status", "--identity-salt", "x"], "identity_salt"),
        (["--max-bytes", "1", "gc"], "gc_max_bytes"),  # a command flag given to the group
    ],
)
def test_a_setting_without_a_flag_here_names_its_env_var_and_config_key(
    argv: list[str], setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error(argv, capsys)
    assert f"no flag for the {setting} setting: set CACHEMGR_{setting.upper()} or " in line, line
    assert f"`{setting} = …` in the config file" in line, line
    assert "Did you mean" not in line, line  # Click's guess (--reconcile-interval) misleads


def test_the_hint_says_which_command_takes_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(["serve", "--max-bytes", "10GB"], capsys)
    assert line.endswith("; `cachemgr gc` takes it as --max-bytes"), line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["gc", "--dry-runn"], "Error: No such option '--dry-runn'. Did you mean '--dry-run'?"),
        (["gc", "--totally-bogus"], "Error: No such option '--totally-bogus'."),
    ],
)
def test_other_unknown_options_keep_clicks_message(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _error(argv, capsys) == says


def test_the_top_level_help_and_the_api_docs_name_both_engines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cachemgr.daemon.app import openapi_document

    with pytest.raises(SystemExit):
        main(["--help"])
    summary = " ".join(capsys.readouterr().out.split("Options:")[0].split())
    assert "SGLang" in summary and "vLLM" in summary, summary
    info = json.loads(openapi_document())["info"]
    assert "SGLang" in info["description"] and "vLLM" in info["description"], info
