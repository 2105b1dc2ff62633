"""`cachemgr fingerprint`: compute, explain and compare identities."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from cachemgr import engines
from cachemgr.cli.context import AppContext, pass_app
from cachemgr.cli.init import version_warning
from cachemgr.cli.launch_options import LaunchRequest, launch_options
from cachemgr.errors import NotFoundError
from cachemgr.identity.record import Digested, Weights, diff_identities
from cachemgr.layout import NS_ID_RE, Layout


class _DefaultCommandGroup(click.Group):
    """A group that runs its default command unless the first word names a subcommand."""

    default_command = "compute"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        # Show `cachemgr fingerprint [OPTIONS]` in the default command's usage line.
        return ("" if name == self.default_command else name), cmd, rest

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "[OPTIONS] [-- LAUNCH_CMD…] | diff A B")


class _DefaultCommand(click.Command):
    """The default command: its usage line names the group alone."""

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        pieces = self.collect_usage_pieces(ctx)
        formatter.write_usage(ctx.command_path.rstrip(), " ".join(pieces))


@click.group("fingerprint", cls=_DefaultCommandGroup)
def fingerprint() -> None:
    """Compute the identity of an SGLang or vLLM server's KV cache, or compare two."""


@fingerprint.command(
    "compute",
    cls=_DefaultCommand,
    hidden=True,
    epilog="Compare two identities with: cachemgr fingerprint diff A B",
)
@launch_options
@click.option("--json", "as_json", is_flag=True, help="Print the identity record as JSON.")
@click.option("--explain", is_flag=True, help="List every component of the identity.")
@pass_app
def compute(app: AppContext, launch: LaunchRequest, as_json: bool, explain: bool) -> None:
    """Print the identity digest and namespace id for a model and its SGLang settings.

    Pass the SGLang launch command after `--` (e.g. `-- sglang serve --model-path M
    --kv-cache-dtype fp8_e4m3 --page-size 64`), explicit options, or both; options win.
    """
    ident = launch.compute_identity(app.settings)
    # an 'unknown' version is said each time it enters an identity
    for warning in (version_warning(ident), *launch.engine.identity_warnings(ident)):
        if warning is not None:
            click.echo(f"cachemgr: warning: {warning}", err=True)
    if as_json:
        click.echo(ident.model_dump_json(indent=2))
    elif explain:
        click.echo(explain_identity(ident))
    else:
        click.echo(f"ns_id   {ident.ns_id}\ndigest  {ident.digest}")


@fingerprint.command("diff")
@click.argument("a")
@click.argument("b")
@pass_app
def diff(app: AppContext, a: str, b: str) -> None:
    """Say how identity B differs from A; exit 0 if the same, 1 if not.

    A and B are namespace ids of the root, namespace manifests (<root>/ns/<id>.json) or
    identity records (--json output).
    """
    layout = Layout.at(app.settings.root, app.settings.state_dir)
    lines = diff_identities(_record(layout, a), _record(layout, b))
    for line in lines:
        click.echo(line)
    if lines:
        raise click.exceptions.Exit(1)
    click.echo("same identity")


def _record(layout: Layout, given: str) -> Digested:
    """A record or manifest file, else the manifest of the root's namespace of that id; of
    the engine its record names (the registry reads it)."""
    path = Path(given)
    if not NS_ID_RE.fullmatch(given) or path.exists():
        return engines.record_file(path)
    manifest = layout.manifest(given)
    if not manifest.is_file():
        raise NotFoundError(f"{given} is neither a file nor a namespace of {layout.root}")
    return engines.record_file(manifest)


def explain_identity(ident: Digested) -> str:
    """Every component, one per line, with the weights' files listed under them."""
    rows: list[tuple[str, Any]] = [
        ("ns_id", ident.ns_id),
        ("digest", ident.digest),
        ("schema_version", ident.schema_version),
        ("model", f"{ident.source.model_path} ({ident.source.model_dir})"),
    ]
    data = ident.model_dump(
        mode="json", exclude={"source", "digest", "ns_id", "schema_version", "weights"}
    )
    data.pop("draft_weights", None)
    for key, value in data.items():
        if isinstance(value, dict):
            rows += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            rows.append((key, value))
    full = ident.engine_version_full or "?"
    rows.append((f"{ident.VERSION_FIELD} (from)", f"{full} ({ident.engine_version_from})"))
    page_size_from = getattr(ident.source, "page_size_from", None)
    if page_size_from is not None:  # the engines whose page size the server may decide
        rows.append(("page_size (from)", page_size_from))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {'none' if v is None else v}" for k, v in rows]
    lines += _explain_weights("weights", ident.weights)
    draft = getattr(ident, "draft_weights", None)
    if draft is not None:
        src = ident.source
        given = src.draft_model_path or "the speculative algorithm's default"
        lines.append(f"draft model  {given} ({src.draft_model_dir})")
        lines += _explain_weights("draft_weights", draft)
    return "\n".join(lines)


def _explain_weights(label: str, w: Weights) -> list[str]:
    head = f"{label}  {w.mode} ({w.algo}), {len(w.files)} files, {w.total_bytes:,} bytes"
    return [head] + [f"  {f.digest}  {f.size:>15,}  {f.name}" for f in w.files]
