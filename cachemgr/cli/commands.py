"""The list of subcommands `cachemgr` offers; a command is listed only once it exists."""

import click

from cachemgr.cli.config import config
from cachemgr.cli.serve import serve
from cachemgr.cli.status import status

ALL: list[click.Command] = [
    config,
    serve,
    status,
]
