"""`python -m rlcli` is `rlcli`."""

from rlcli.commands.cli import run

run()
