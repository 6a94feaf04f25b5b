"""A torchrun worker: loads the frozen run config written by `rlcli train` and trains one rank."""

from __future__ import annotations

import sys


def main() -> None:
    from rlcli.checkpoint import stop_on_disk_full
    from rlcli.cli import _environment
    from rlcli.config import load_frozen
    from rlcli.rollout.remote import join, placement, serve
    from rlcli.schema import ConfigError
    from rlcli.trainer import Trainer

    _environment()
    _log_like_the_launcher()
    cfg = load_frozen(sys.argv[1])
    place = placement(cfg)
    channel = join(cfg, place) if place is not None else None  # asynchronous rollout: the rollout ranks' channel
    try:
        if place is not None and place.generates:
            return serve(cfg, channel, place)
        with stop_on_disk_full(cfg):
            Trainer(cfg, channel).fit()
    except ConfigError as e:  # a full disk: one line, like the launcher's own errors
        print(f"rlcli: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from e


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
