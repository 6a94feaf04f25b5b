"""The algorithm library: pure tensor math (`functional`) wired into name registries.

Registries (one signature per kind, docs/design.md#registries): ADVANTAGES (advantages.py), POLICY_LOSSES
(losses.py), KL_ESTIMATORS (functional.py, re-exported by kl.py); loss aggregations are the
AGG_MODES names of `functional.aggregate`. Their names are declared in rlcli/core/names.py. The `algo` config
schema is `AlgoConfig` (config.py). Attributes are imported on first use (rlcli.core.lazy): the schema needs no torch.
"""

from rlcli.core.lazy import exports

__all__ = [
    "ADVANTAGES", "AGG_MODES", "KL_ESTIMATORS", "NEEDS_VALUES", "POLICY_LOSSES", "AdaptiveEntropyController",
    "AdaptiveKLController", "AdvantageInputs", "AlgoConfig", "FixedEntropyController", "FixedKLController",
    "build_entropy_controller", "build_kl_controller", "compute_advantages", "validate",
]
__getattr__ = exports(__name__, {
    "ADVANTAGES": "advantages", "NEEDS_VALUES": "advantages", "AdvantageInputs": "advantages",
    "compute_advantages": "advantages", "AlgoConfig": "config", "validate": "config", "AGG_MODES": "functional",
    "KL_ESTIMATORS": "functional", "AdaptiveKLController": "kl", "FixedKLController": "kl",
    "build_kl_controller": "kl", "POLICY_LOSSES": "losses", "AdaptiveEntropyController": "entropy",
    "FixedEntropyController": "entropy", "build_entropy_controller": "entropy",
})
