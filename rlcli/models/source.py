"""Which model a run trains and where it comes from (resolve_model_path): model.path, a GGUF file converted once, or
the embedded tiny model's warm start (cached: rlcli.models.cache). torch-free, so `rlcli train` finds a cached model
before its workers start without loading torch or transformers."""

from __future__ import annotations

from typing import Any

from rlcli.models.cache import cached_warm_start


def resolve_model_path(model_cfg: Any, data_cfg: Any) -> tuple[str, str]:
    """(path, how it was obtained). null path = model.gguf_file converted (cached), else the embedded tiny model,
    warm-started and cached."""
    if model_cfg.path:
        return model_cfg.path, "from model.path"
    if model_cfg.gguf_file:
        from rlcli.models.gguf import converted

        return converted(model_cfg.gguf_file), f"converted from {model_cfg.gguf_file} (cached)"
    tiny, ws = as_objects(model_cfg.tiny, model_cfg.warm_start)
    path = cached_warm_start(tiny, ws, warm_start_data(data_cfg))
    if path is None:
        from rlcli.models.sft import warm_start

        path = warm_start(tiny, ws, **warm_start_data(data_cfg))
    return path, (f"embedded tiny model, warm-started by `rlcli sft` (cached): {ws.steps}x{ws.batch_size} "
                  f"demonstrations, carry_slip {ws.carry_slip}")


def as_objects(*nodes: Any) -> list[Any]:
    """Config nodes as their schema dataclass instances (for code that takes dataclasses)."""
    from omegaconf import DictConfig, OmegaConf

    return [OmegaConf.to_object(n) if isinstance(n, DictConfig) else n for n in nodes]


def warm_start_data(data_cfg: Any) -> dict[str, int]:
    """The arith difficulty range the warm start trains on: data.min_digits..max_digits, which is the
    run's task when it trains on arith, and the schema's default range (as `rlcli sft` uses) otherwise."""
    return {"min_digits": data_cfg.min_digits, "max_digits": data_cfg.max_digits}
