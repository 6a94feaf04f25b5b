"""The algorithm library: pure tensor math (`functional`) wired into name registries.

Registries (one signature per kind, docs/design.md#registries): ADVANTAGES (advantages.py), POLICY_LOSSES
(losses.py), KL_ESTIMATORS (functional.py, re-exported by kl.py); loss aggregations are the
AGG_MODES names of `functional.aggregate`. The `algo` config schema is `AlgoConfig` (config.py).
"""

from rlcli.algos.advantages import ADVANTAGES, NEEDS_VALUES, AdvantageInputs, compute_advantages
from rlcli.algos.config import AlgoConfig, validate
from rlcli.algos.functional import AGG_MODES, KL_ESTIMATORS
from rlcli.algos.kl import AdaptiveKLController, FixedKLController, build_kl_controller
from rlcli.algos.losses import POLICY_LOSSES

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "NEEDS_VALUES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AlgoConfig",
    "FixedKLController",
    "build_kl_controller",
    "compute_advantages",
    "validate",
]
