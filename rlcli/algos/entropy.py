"""The entropy bonus coefficient and its controllers (`algo.entropy_control`, docs/algorithms.md#entropy-control).

The loss carries `- α · H` (H: the token entropy of the temperature-scaled logits). α is held by a controller, like
the KL coefficient β (rlcli.algos.kl): fixed at `algo.entropy_coef`, or adaptive (Skywork-OR1, He et al. 2025,
arXiv:2505.22312, section "Adaptive Entropy Control") when `algo.entropy_control=adaptive`. The controller is loop
state (rlcli.loop.state.LoopState.entropy_ctl): a checkpoint saves it and a resume restores it.
The covariance-based controls (clip_cov, kl_cov) act on the policy loss instead: rlcli.algos.functional.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdaptiveEntropyController", "FixedEntropyController", "build_entropy_controller"]


class FixedEntropyController:
    """Constant α = algo.entropy_coef."""

    adaptive = False

    def __init__(self, coef: float):
        self.coef = float(coef)

    @property
    def value(self) -> float:
        """α of the next update."""
        return self.coef

    def update(self, entropy: float) -> None:
        """No-op (same interface as the adaptive controller)."""

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state["coef"])


class AdaptiveEntropyController:
    """Skywork-OR1's adaptive entropy control (arXiv:2505.22312, "Adaptive Entropy Control"), after each training step k with measured
    entropy e_k (the step's token-mean entropy over loss tokens, `actor/entropy`):

        c_{k+1} = clip(c_k + Δ, 0, c_max)  if e_k < target,   clip(c_k − Δ, 0, c_max)  otherwise
        α_{k+1} = c_{k+1} · 1[e_k < target]        (the bonus is applied only while the entropy is below target)

    c_0 = algo.entropy_coef and the gate starts open (α_1 = c_0: no entropy has been measured yet). The paper gates
    step k with the entropy e_k of its own batch; rlcli measures the entropy in the update's own forward passes, so
    the gate and c both use the previous step's entropy (one step of lag, no extra forward pass).
    """

    adaptive = True

    def __init__(self, init: float, target: float, delta: float, coef_max: float):
        self.coef, self.target, self.delta, self.coef_max = float(init), float(target), float(delta), float(coef_max)
        self.gate = True  # the last measured entropy was below target (open before any measurement)

    @property
    def value(self) -> float:
        """α of the next update: c when the gate is open, else 0."""
        return self.coef if self.gate else 0.0

    def update(self, entropy: float) -> None:
        below = float(entropy) < self.target
        step = self.delta if below else -self.delta
        self.coef = min(max(self.coef + step, 0.0), self.coef_max)
        self.gate = below

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "gate": self.gate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.gate = float(state["coef"]), bool(state.get("gate", True))


def build_entropy_controller(cfg: Any) -> FixedEntropyController | AdaptiveEntropyController:
    """The controller an `algo` config asks for: adaptive iff algo.entropy_control=adaptive."""
    if cfg.entropy_control == "adaptive":
        return AdaptiveEntropyController(cfg.entropy_coef, cfg.entropy_target, cfg.entropy_coef_delta,
                                         cfg.entropy_coef_max)
    return FixedEntropyController(cfg.entropy_coef)
