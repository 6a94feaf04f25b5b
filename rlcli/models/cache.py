"""The embedded tiny model's warm starts on disk: a key of everything that shapes one, the directory it lives in,
and whether it is there whole. torch-free (rlcli.models.source looks here before anything loads; sft.py builds
what is missing)."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, get_type_hints

from rlcli.data.arith import arith_examples
from rlcli.models.config import TOKENIZER_DIR, TinyModelConfig, WarmStartConfig

log = logging.getLogger(__name__)

WARM_START_VERSION = 1
"""Bump when the code behind warm_start changes what it produces: it invalidates every cache."""


def cached_warm_start(tiny_cfg: TinyModelConfig, ws_cfg: WarmStartConfig, data_kwargs: dict[str, Any]) -> str | None:
    """The directory of this warm start if the cache holds it whole (its warm_start.json is written last), else None."""
    final = warm_start_dir(tiny_cfg, ws_cfg, data_kwargs)
    if not (final / "warm_start.json").exists():
        return None
    log.info("warm start: cache hit %s", final)
    return str(final)


def warm_start_dir(tiny_cfg: TinyModelConfig, ws_cfg: WarmStartConfig, data_kwargs: dict[str, Any]) -> Path:
    """Where this warm start lives in the cache: cache_root / its key."""
    return cache_root(ws_cfg) / warm_start_key(tiny_cfg, ws_cfg, task_args(**data_kwargs))


def build_dir(tiny_cfg: TinyModelConfig, ws_cfg: WarmStartConfig, data_kwargs: dict[str, Any]) -> str:
    """The run directory of the `rlcli sft` run that builds this warm start for a run that needs it: beside the
    cache's entries (cache_root/../warm_start_runs/<key>), so a build that was stopped resumes from its checkpoint."""
    return str(cache_root(ws_cfg).parent / "warm_start_runs" / warm_start_key(tiny_cfg, ws_cfg, task_args(**data_kwargs)))


def task_args(**data_kwargs: Any) -> dict[str, Any]:
    """`data_kwargs` with arith_examples' defaults filled in, so equal tasks share a cache key."""
    bound = inspect.signature(arith_examples).bind("train", 0, **data_kwargs)  # TypeError if unknown
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k not in ("split", "size", "seed", "carry_slip")}


def publish(tmp: Path, final: Path, marker: str) -> None:
    """Rename the finished cache entry `tmp` (its `marker` file written last) to `final`; if a concurrent build got
    there first, keep that equivalent entry and drop `tmp`."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / marker).exists():
            raise
        shutil.rmtree(tmp)


def cache_root(ws_cfg: WarmStartConfig) -> Path:
    """Where warm-start checkpoints live: cache_dir, else $RLCLI_CACHE, else ~/.cache/rlcli."""
    root = ws_cfg.cache_dir or os.environ.get("RLCLI_CACHE") or "~/.cache/rlcli"
    return Path(root).expanduser() / "warm_start"


def warm_start_key(
    tiny_cfg: TinyModelConfig, ws_cfg: WarmStartConfig, data_kwargs: dict[str, Any]
) -> str:
    """Hash of everything that shapes the warm-started model (cache_dir excluded)."""
    # tool_demos=0 leaves the key of a warm start without tool demonstrations as it was before the knob existed
    ws = {k: v for k, v in typed(ws_cfg).items() if k != "cache_dir" and (k != "tool_demos" or v)}
    tokenizer_hash = hashlib.sha256((TOKENIZER_DIR / "tokenizer.json").read_bytes()).hexdigest()
    blob = json.dumps(
        {
            "version": WARM_START_VERSION,
            "tiny": typed(tiny_cfg),
            "warm_start": ws,
            "data": data_kwargs,
            "tokenizer": tokenizer_hash,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def typed(cfg: Any) -> dict[str, Any]:
    """asdict(cfg) with an int in a float field as a float: `carry_slip=0` and the config's `0.0` (how a Hydra
    override or a YAML file gives it) are one warm start, with one key."""
    hints = get_type_hints(type(cfg))
    return {k: float(v) if hints.get(k) is float and isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in asdict(cfg).items()}
