"""A torchrun worker: loads the frozen run config written by `rlcli train` and trains one rank."""

from __future__ import annotations

import sys


def main() -> None:
    from rlcli.cli import _environment
    from rlcli.config import load_frozen
    from rlcli.trainer import Trainer

    _environment()
    Trainer(load_frozen(sys.argv[1])).fit()


if __name__ == "__main__":
    main()
