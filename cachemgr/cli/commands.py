"""The list of subcommands `cachemgr` offers; a command is listed only once it exists."""

import click

from cachemgr.cli.config import config
from cachemgr.cli.gc import gc

ALL: list[click.Command] = [
    config,
    gc,
]
