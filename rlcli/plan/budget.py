"""The changes the planner makes to a run's config, before it is frozen (`rlcli train`) or the memory is measured
(benchmarks): hw.max_tokens_per_micro_batch=auto set to the budget the plan chose, rollout.zero3_generation=auto to
gathered or per_layer."""

from __future__ import annotations

from typing import Any

from rlcli.core.topology import generates_partitioned
from rlcli.plan.estimate import Plan, estimate


def budget_pending(cfg: Any) -> bool:
    """Whether the plan has a setting to fix before the run: hw.max_tokens_per_micro_batch=auto, or
    rollout.zero3_generation=auto where it applies (HF generation from ZeRO-3 partitions over ranks)."""
    return cfg.hw.max_tokens_per_micro_batch == "auto" or (
        cfg.rollout.zero3_generation == "auto" and generates_partitioned(cfg))


def fix_budget(cfg: Any, prompt: tuple[int, str]) -> Plan:
    """The plan with the longest prompt `prompt`; hw.max_tokens_per_micro_batch=auto is set (in `cfg`) to the
    budget it chose, a number of tokens or null (no cap), and rollout.zero3_generation=auto to how the plan generates
    (where it applies)."""
    from omegaconf import open_dict

    plan = estimate(cfg, prompt)
    with open_dict(cfg):
        if cfg.hw.max_tokens_per_micro_batch == "auto":
            cfg.hw.max_tokens_per_micro_batch = plan.shape["budget"]
        if cfg.rollout.zero3_generation == "auto" and plan.shape["zero3_generation"]:
            cfg.rollout.zero3_generation = plan.shape["zero3_generation"]
    return plan
