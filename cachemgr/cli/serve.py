"""`cachemgr serve`: run the sidecar daemon (index, metrics, HTTP API)."""

from __future__ import annotations

from pathlib import Path

import click

from cachemgr import logs
from cachemgr.cli.context import AppContext, pass_app, setting_option
from cachemgr.cli.status import from_daemon, same_root
from cachemgr.errors import PortInUseError
from cachemgr.settings import Settings


@click.command()
@setting_option("--host", setting="host")
@setting_option("--port", setting="port", type=int)
@setting_option("--token", setting="token")
@setting_option("--reconcile-interval", setting="reconcile_interval", type=float)
@setting_option("--sglang-url", setting="sglang_url")
@setting_option("--instance", setting="instance")
@pass_app
def serve(app: AppContext) -> None:
    """Run the sidecar: live page index, hit accounting, /metrics and the HTTP API."""
    from cachemgr.daemon.lifecycle import Daemon

    settings = app.settings
    logs.setup(settings.log_level, settings.log_format)  # the daemon's logs are its output
    daemon = Daemon(settings)
    try:
        daemon.start()
    except PortInUseError as e:
        raise PortInUseError(f"{e}{_who_holds(settings, daemon.layout.root)}") from None
    click.echo(
        f"cachemgr: serving {daemon.layout.root} on http://{settings.host}:{daemon.port}", err=True
    )
    daemon.serve()


def _who_holds(settings: Settings, root: Path) -> str:
    """Who answers on the busy port, asked as `status` asks: this root's daemon (then there
    is nothing to start), another root's, or something that is not cachemgr."""
    answer = from_daemon(settings)
    if answer is None:
        return (
            " by another program (not a cachemgr daemon); pick another port with --port "
            "(0 picks a free one)"
        )
    if same_root(answer.get("root"), root):
        return (
            f": a cachemgr daemon already serves this root ({root}) there; use it, or stop it "
            "first, or pick another port with --port"
        )
    return (
        f": a cachemgr daemon serving another root ({answer.get('root')}) listens there; give "
        "this one its own port with --port"
    )
