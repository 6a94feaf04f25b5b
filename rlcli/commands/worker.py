"""A torchrun worker: loads the frozen run config written by `rlcli train` or `rlcli rm` and trains one rank of
that job (argv: the frozen config, the job's name)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def main() -> None:
    from rlcli.commands.launch import offline_environment
    from rlcli.config import load_frozen
    from rlcli.core.schema import ConfigError
    from rlcli.loop.checkpoint import stop_on_disk_full

    offline_environment()
    _log_like_the_launcher()
    cfg = load_frozen(sys.argv[1])
    try:
        with stop_on_disk_full(cfg):
            WORKERS[sys.argv[2]](cfg)
    except ConfigError as e:  # a full disk: one line, like the launcher's own errors
        print(f"rlcli: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from e


def train(cfg: Any) -> None:
    from rlcli.loop.remote import join, placement, serve
    from rlcli.loop.trainer import Trainer

    place = placement(cfg)
    channel = join(cfg, place) if place is not None else None  # asynchronous rollout: the rollout ranks' channel
    if place is not None and place.generates:
        return serve(cfg, channel, place)
    Trainer(cfg, channel).fit()


def rm(cfg: Any) -> None:
    from rlcli.rm.train import RewardModelTrainer

    RewardModelTrainer(cfg).fit()


WORKERS: dict[str, Callable[[Any], None]] = {"train": train, "rm": rm}
"""A job's name (rlcli.commands.launch.launch's `job`) -> what one of its ranks runs."""


def _log_like_the_launcher() -> None:
    """rlcli's own INFO messages (cache hits, conversions) in the format Hydra gives the launcher's, with the
    rank: a worker is a plain script, so without this they would be dropped."""
    import logging
    import os

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[%(asctime)s][%(name)s][rank {os.environ.get('RANK', '0')}] %(message)s"))
    log = logging.getLogger("rlcli")
    log.addHandler(handler)
    log.setLevel(logging.INFO)


if __name__ == "__main__":
    main()
    from rlcli.commands.launch import exit_now

    exit_now(0)  # an error raised above ends the worker the usual way, with its traceback
