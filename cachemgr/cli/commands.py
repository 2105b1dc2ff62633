"""The list of subcommands `cachemgr` offers; a command is listed only once it exists."""

import click

from cachemgr.cli.config import config
from cachemgr.cli.exec import exec_
from cachemgr.cli.fingerprint import fingerprint
from cachemgr.cli.init import init
from cachemgr.cli.ls import ls
from cachemgr.cli.purge import purge
from cachemgr.cli.serve import serve
from cachemgr.cli.status import status

ALL: list[click.Command] = [
    config,
    fingerprint,
    init,
    exec_,
    ls,
    purge,
    serve,
    status,
]
