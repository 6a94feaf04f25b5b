"""The reward config schema (Hydra structured config) and its validation.

Scoring (docs/rewards.md#scoring), per response i:

    score_i = Σ_k weights[k] · v_k,i
    v_math_verify,i = correct_score if acc_i == 1 else incorrect_score
    v_k,i = the raw value of reward function k, for every other part

``acc`` (math-verify correctness) is computed for every response even when ``math_verify`` has no
weight: metrics and dynamic sampling need it. A response whose verification times out or errors
gets acc = 0 and raw value 0 for every part, so with DAPO's ±1 mapping it scores
``weights.math_verify · incorrect_score`` (−1), exactly like a wrong answer: a timeout must never pay
more than an honest mistake.

Hydra: the ``reward`` group is a *list* group (``reward=[math_verify,format]``), each YAML setting only
its own ``weights.<name>`` (and options). Its schema node must therefore start with EMPTY weights, or
the default ``{"math_verify": 1.0}`` would leak into every selection: use :func:`group_base` (see
docs/rewards.md for the two wiring patterns, both tested in tests/test_rewards.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcli.answers import ANSWER_FORMATS
from rlcli.rewards.functions import REWARDS
from rlcli.schema import ConfigError, check_ranges, rng

# Metric names the manager emits besides "reward/<part>"; a part may not take one of them, nor
# the trainer's reward/mean and reward/std (docs/metrics.md).
RESERVED_NAMES = ("timeouts", "errors", "restarts", "mean", "std", "pool_mean")


@dataclass
class RewardConfig:
    """Task reward: which reward functions, their weights, and the verifier sandbox."""

    weights: dict[str, float] = rng(factory=lambda: {"math_verify": 1.0})
    """Active reward parts, name -> weight: built-ins (math_verify, format, length) or custom names."""
    correct_score: float = rng(1.0)
    """Value of the math_verify part when the answer is correct (acc = 1)."""
    incorrect_score: float = rng(0.0)
    """Value of the math_verify part when wrong, missing, timed out or errored (DAPO uses -1)."""
    custom: dict[str, str] = field(default_factory=dict)
    """User reward functions, name -> dotted path 'pkg.module.fn' with fn(response, ground_truth) -> float."""
    length_target: int = rng(0, ge=0, why="0 = shorter is better")
    """`length` reward: target response length in characters; 0 means shorter is better."""
    length_scale: int = rng(8192, ge=1)
    """`length` reward: distance from length_target, in characters, at which the reward reaches 0."""
    timeout_s: float = rng(5.0, gt=0)
    """Wall-clock budget per response in a worker; slower responses score as failures (timeouts)."""
    num_workers: int = rng(2, ge=1)
    """Sandbox worker processes (each imports math-verify once, ~1 s, and is reused)."""
    memory_mb: int = rng(2048, ge=256, why="a worker needs ~100 MiB to import math-verify")
    """Address-space cap per worker process (RLIMIT_AS), in MiB."""
    answer_format: str = rng("boxed", choices=ANSWER_FORMATS)
    """How responses state their final answer (rlcli/answers.py): boxed (a \\boxed{} or an `Answer:` line, else
    none) | last_number (also the last number of a reply, for tasks that ask for the number alone). Data presets
    set it; evaluation's maj@k reads answers the same way."""
    max_response_chars: int = rng(100_000, ge=1)
    """Longer responses (or ground truths) are rejected unparsed and count as errors (20k tokens fit)."""

    def function_options(self) -> dict[str, Any]:
        """The keyword options every built-in reward function receives."""
        return {"length_target": self.length_target, "length_scale": self.length_scale,
                "answer_format": self.answer_format}


def group_base() -> RewardConfig:
    """The node the ``reward`` config group composes onto: every default except ``weights``,
    which starts empty so each selected YAML adds exactly its own part."""
    return RewardConfig(weights={})


def store_group_schema(name: str = "reward_schema") -> None:
    """Store :func:`group_base` in Hydra's ConfigStore as ``name`` at package ``reward``.

    For a root config without a structured ``reward`` field: list ``- reward_schema`` before
    ``- reward: math_verify`` in the root defaults list.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=name, node=group_base(), package="reward")


def validate(cfg: Any, prefix: str = "reward") -> None:
    """Raise ConfigError naming the offending key if `cfg` (RewardConfig or DictConfig) is unusable."""
    check_ranges(cfg, RewardConfig, prefix + ".")
    custom = dict(cfg.custom)
    valid = sorted(set(REWARDS) | set(custom))
    if not cfg.weights:
        raise ConfigError(f"{prefix}.weights is empty; select a reward, e.g. {prefix}=math_verify")
    for name in cfg.weights:
        if name not in valid:
            raise ConfigError(
                f"{prefix}.weights.{name}: unknown reward {name!r}; valid names: {', '.join(valid)} "
                f"(add user functions under {prefix}.custom)"
            )
    for name, path in custom.items():
        if name in REWARDS or name in RESERVED_NAMES:
            raise ConfigError(f"{prefix}.custom.{name}: the name {name!r} is taken; choose another")
        if "." not in path.strip("."):
            raise ConfigError(f"{prefix}.custom.{name}={path!r} must be a dotted path 'pkg.module.fn'")
        if name not in cfg.weights:
            raise ConfigError(
                f"{prefix}.custom.{name} is never used: add {prefix}.weights.{name}=<weight> (0 to only log it)"
            )
    if cfg.correct_score <= cfg.incorrect_score:
        raise ConfigError(
            f"{prefix}.correct_score={cfg.correct_score} must exceed "
            f"{prefix}.incorrect_score={cfg.incorrect_score}"
        )


def check_importable(cfg: Any, prefix: str = "reward") -> None:
    """`rlcli train` and `rlcli eval`, before anything loads: every reward.custom function imports here and is
    callable, so a typo fails in a second rather than in the reward workers after the model loaded. The workers
    import it from the same sys.path (rlcli/rewards/pool.py), which holds the working folder (rlcli.cli)."""
    from rlcli.rewards.functions import import_dotted

    for name, path in dict(cfg.custom).items():
        try:
            fn = import_dotted(path)
        except Exception as e:  # ImportError, AttributeError, or whatever the user's module raises on import
            where = (f" from the working folder (a file ./{path.rpartition('.')[0].replace('.', '/')}.py) or an "
                     "installed package" if isinstance(e, ModuleNotFoundError) else "")
            raise ConfigError(
                f"{prefix}.custom.{name}={path!r} cannot be imported ({type(e).__name__}: {e}): name a function "
                f"fn(response, ground_truth) -> float as package.module.function, importable{where}"
            ) from None
        if not callable(fn):
            raise ConfigError(f"{prefix}.custom.{name}={path!r} is a {type(fn).__name__}, not a function "
                              "fn(response, ground_truth) -> float")
