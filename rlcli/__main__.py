"""`python -m rlcli` is `rlcli`."""

from rlcli.cli import main

main()
