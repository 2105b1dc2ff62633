"""`cachemgr serve`: run the sidecar daemon (index, metrics, HTTP API)."""

from __future__ import annotations

import click

from cachemgr import logs
from cachemgr.cli.context import AppContext


@click.command()
@click.option("--host", help="Bind address (default 127.0.0.1; others need --token).")
@click.option("--port", type=int, help="HTTP port (default 9477; 0 picks a free one).")
@click.option("--token", help="Bearer token for mutating routes (env CACHEMGR_TOKEN).")
@click.option("--reconcile-interval", type=float, help="Seconds between full rescans.")
@click.option(
    "--sglang-url", help="SGLang server to scrape and check, e.g. http://127.0.0.1:30000."
)
@click.option("--instance", help="Instance name that server was initialised as (init --instance).")
@click.pass_context
def serve(ctx: click.Context, /, **flags: object) -> None:
    """Run the sidecar: live page index, hit accounting, /metrics and the HTTP API."""
    app = ctx.find_object(AppContext)
    assert app is not None
    app.overrides.update({k: v for k, v in flags.items() if v is not None})
    from cachemgr.daemon.lifecycle import Daemon

    settings = app.settings
    logs.setup(settings.log_level, settings.log_format)  # the daemon's logs are its output
    daemon = Daemon(settings)
    daemon.start()
    click.echo(
        f"cachemgr: serving {daemon.layout.root} on http://{settings.host}:{daemon.port}", err=True
    )
    daemon.serve()
