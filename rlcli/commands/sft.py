"""The `rlcli sft` Hydra job (rlcli.commands.cli JOBS): check the config, then the tiny model's warm start from the cache
or trained here (rlcli.loop.sft.SFTTrainer), one build of a warm start at a time (a lock per cache key: a second
`rlcli sft` or a run that needs the same warm start waits, then reads the cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LOCK_TIMEOUT_S = 3 * 3600
"""How long a build waits for another build of the same warm start before it says so and stops."""


def sft_job(cfg: Any) -> dict[str, Any]:
    from omegaconf import open_dict

    from rlcli.commands.launch import run_dir
    from rlcli.config import Config
    from rlcli.core.schema import check_known_keys, check_ranges
    from rlcli.loop import checkpoint
    from rlcli.models import as_objects, warm_start_data
    from rlcli.models.cache import build_dir, cached_warm_start, task_args

    run_dir(cfg)
    check_known_keys(cfg, Config)
    check_ranges(cfg, Config)
    if cfg.model.path is not None or cfg.model.gguf_file is not None:
        raise SystemExit("rlcli sft warm-starts the embedded tiny model: leave model.path unset (and model.gguf_file)")
    if cfg.hw.nproc * cfg.hw.nnodes > 1:
        raise SystemExit(f"rlcli sft trains the 4M-parameter tiny model in one process: leave hw.nproc=1 and "
                         f"hw.nnodes=1 (got {cfg.hw.nproc} x {cfg.hw.nnodes})")
    tiny, ws = as_objects(cfg.model.tiny, cfg.model.warm_start)
    data = task_args(**warm_start_data(cfg.data))
    if not ws.enabled:  # the random init: nothing to train
        from rlcli.models.sft import warm_start

        return _report(warm_start(tiny, ws, **data))
    with open_dict(cfg):
        cfg.steps = ws.steps  # the job's length (`steps` is the RL run's, which sft does not read)
    from filelock import FileLock, Timeout

    lock = FileLock(build_dir(tiny, ws, data) + ".lock")
    Path(lock.lock_file).parent.mkdir(parents=True, exist_ok=True)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"another build of this warm start holds {lock.lock_file}: waiting for it (at most "
              f"{LOCK_TIMEOUT_S // 3600} h), then reading the cache", flush=True)
        try:
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        except Timeout:
            raise SystemExit(f"waited {LOCK_TIMEOUT_S} s for {lock.lock_file}: if no rlcli process is building this "
                             "warm start, delete the lock file and run again") from None
    try:
        if (hit := cached_warm_start(tiny, ws, data)) is not None:
            return _report(hit)
        # Under the lock: a build stopped in this directory is not moving on while this one reads it
        resume = checkpoint.resume_point(cfg, check=same_warm_start)
        with open_dict(cfg):
            cfg.resume = resume  # the frozen config names the checkpoint itself
        from rlcli.loop.sft import SFTTrainer  # torch: after the checks

        with checkpoint.stop_on_disk_full(cfg):
            return SFTTrainer(cfg).fit()
    finally:
        lock.release()


def same_warm_start(path: str, cfg: Any) -> None:
    """`rlcli sft`'s check of a checkpoint to resume: it trains the same warm start (the same cache key: the tiny
    model, model.warm_start but its cache_dir, the digits). Nothing else in the config shapes the job's steps, so
    nothing else is compared (a build stopped before an rlcli upgrade that moved an unrelated default resumes).
    Raises ConfigError naming both keys and the fix."""
    from dataclasses import fields

    from omegaconf import OmegaConf

    from rlcli.core.schema import ConfigError
    from rlcli.models.cache import task_args, warm_start_key
    from rlcli.models.config import TinyModelConfig, WarmStartConfig

    def key(c: Any) -> str:
        tiny, ws = (schema(**{f.name: node[f.name] for f in fields(schema) if f.name in node})
                    for schema, node in ((TinyModelConfig, c.model.tiny), (WarmStartConfig, c.model.warm_start)))
        return warm_start_key(tiny, ws, task_args(min_digits=c.data.min_digits, max_digits=c.data.max_digits))

    keys = [key(OmegaConf.load(f"{path}/config.yaml")), key(cfg)]
    if keys[0] != keys[1]:
        raise ConfigError(f"resume={path} trained another warm start (key {keys[0]}; this config's is {keys[1]}): "
                          "set model.tiny.*, model.warm_start.* and data.min_digits/max_digits back to its values "
                          "(its config.yaml), or start a new run in another hydra.run.dir")


def _report(path: str) -> dict[str, Any]:
    """A warm start that was there already (or the random init): where it is, and its warm_start.json."""
    print(f"warm-started tiny model (cached): {path}")
    report = Path(path) / "warm_start.json"
    print(report.read_text())
    return {"model_path": path}
