"""KL to the reference policy: the per-token estimators and the β controllers.

Estimators (k1, k2, k3) live in `functional` as the `KL_ESTIMATORS` registry and are re-exported
here. Controllers hold β (`algo.kl_coef`): fixed, or adaptive (Ziegler et al. 2019,
arXiv:1909.08593) when `algo.kl_target` is set.
"""

from __future__ import annotations

from typing import Any

from rlcli.algos.functional import KL_ESTIMATORS, kl_estimate

__all__ = ["KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "build_kl_controller", "kl_estimate"]


class FixedKLController:
    """Constant β."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same interface as the adaptive controller)."""


class AdaptiveKLController:
    """Proportional β controller of Ziegler et al. 2019 (arXiv:1909.08593, §2.2).

        e = clip(KL_current / KL_target - 1, -0.2, 0.2),   β <- β · (1 + e · n_steps / horizon)

    `n_steps` and `horizon` are in the same unit (trajectories in the paper and in rlcli's
    default horizon of 10000).
    """

    def __init__(self, init: float, target: float, horizon: int):
        self.value = float(init)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(cfg: Any) -> FixedKLController | AdaptiveKLController:
    """The controller an `algo` config asks for: adaptive iff `kl_target` is set."""
    if cfg.kl_target is None:
        return FixedKLController(cfg.kl_coef)
    return AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
