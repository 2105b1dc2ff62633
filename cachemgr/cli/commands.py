"""The list of subcommands `cachemgr` offers; a command is listed only once it exists."""

import click

ALL: list[click.Command] = []
