"""`cachemgr serve`: run the sidecar daemon (index, metrics, HTTP API)."""

from __future__ import annotations

import click

from cachemgr import logs
from cachemgr.cli.context import AppContext, pass_app, setting_option


@click.command()
@setting_option(
    "--host", setting="host", help="Bind address (default 127.0.0.1; others need --token)."
)
@setting_option(
    "--port", setting="port", type=int, help="HTTP port (default 9477; 0 picks a free one)."
)
@setting_option(
    "--token", setting="token", help="Bearer token for mutating routes (env CACHEMGR_TOKEN)."
)
@setting_option(
    "--reconcile-interval",
    setting="reconcile_interval",
    type=float,
    help="Seconds between full rescans.",
)
@setting_option(
    "--sglang-url",
    setting="sglang_url",
    help="SGLang server to scrape and check, e.g. http://127.0.0.1:30000.",
)
@setting_option(
    "--instance",
    setting="instance",
    help="Instance name that server was initialised as (init --instance).",
)
@pass_app
def serve(app: AppContext) -> None:
    """Run the sidecar: live page index, hit accounting, /metrics and the HTTP API."""
    from cachemgr.daemon.lifecycle import Daemon

    settings = app.settings
    logs.setup(settings.log_level, settings.log_format)  # the daemon's logs are its output
    daemon = Daemon(settings)
    daemon.start()
    click.echo(
        f"cachemgr: serving {daemon.layout.root} on http://{settings.host}:{daemon.port}", err=True
    )
    daemon.serve()
