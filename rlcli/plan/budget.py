"""The one change the planner makes to a run's config: hw.max_tokens_per_micro_batch=auto set to the budget the plan
chose, before the config is frozen (`rlcli train`) or the memory is measured (benchmarks)."""

from __future__ import annotations

from typing import Any

from rlcli.plan.estimate import Plan, estimate


def fix_budget(cfg: Any, prompt: tuple[int, str]) -> Plan:
    """The plan with the longest prompt `prompt`; hw.max_tokens_per_micro_batch=auto is set (in `cfg`) to the
    budget it chose, a number of tokens or null (no cap)."""
    plan = estimate(cfg, prompt)
    if cfg.hw.max_tokens_per_micro_batch == "auto":
        from omegaconf import open_dict

        with open_dict(cfg):
            cfg.hw.max_tokens_per_micro_batch = plan.shape["budget"]
    return plan
