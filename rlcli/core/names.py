"""The names every torch-backed registry accepts, importable without torch.

Validation (`rlcli.config.validate`) runs before anything heavy is imported, so `rlcli train` with a typo
fails in a second (docs/design.md#config). It checks names against these catalogues; the registries
themselves (rlcli/algos/, rlcli/rollout/) are built with them and refuse to register a name that is not
declared here, and a test checks that every declared name is registered (tests/test_algo_registry.py).
Adding an estimator = its decorated function + its name below.
"""

from __future__ import annotations

from rlcli.core.schema import ConfigError


class Names(tuple):
    """A catalogue of registry names of one kind, with the config error `Registry.check` gives."""

    kind: str

    def __new__(cls, kind: str, names: tuple[str, ...]) -> Names:
        self = super().__new__(cls, names)
        self.kind = kind
        return self

    def check(self, name: str, key: str) -> None:
        """Raise a config error naming `key` unless `name` is declared."""
        if name not in self:
            raise ConfigError(f"{key}={name!r} is not a known {self.kind}; valid names: {', '.join(sorted(self))}")


ADVANTAGES = Names("advantage estimator", (
    "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "rank", "weighted_baseline",
    "hierarchical", "vapo_grpo_hybrid", "none", "pkpo", "grpo_passk", "maxrl",
))
NEEDS_VALUES = frozenset({"gae", "vapo_grpo_hybrid"})
"""Estimators that read `values`: the trainer builds a critic exactly when the estimator is here."""
GROUP_ESTIMATORS = frozenset(
    {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "rank", "weighted_baseline", "hierarchical", "vapo_grpo_hybrid",
     "pkpo", "grpo_passk", "maxrl"}
)
"""Estimators that compare the responses of one prompt: they need rollout.n > 1 responses per prompt."""
POLICY_LOSSES = Names("policy loss", ("clipped", "gspo", "cispo"))
KL_ESTIMATORS = Names("KL estimator", ("k1", "k2", "k3"))
ENTROPY_CONTROLS = ("none", "adaptive", "clip_cov", "kl_cov")
"""algo.entropy_control (docs/algorithms.md#entropy-control): a fixed entropy bonus | Skywork-OR1's adaptive bonus |
Clip-Cov | KL-Cov (Cui et al. 2025)."""
TOKEN_RATIO_LOSSES = frozenset({"clipped", "cispo"})
"""Policy losses with a per-token ratio, whose per-token loss Clip-Cov and KL-Cov can cut or penalise (GSPO's ratio is
one per sequence)."""
AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_const")
"""Loss aggregation modes (docs/algorithms.md, "Policy loss and aggregation"), see `functional.aggregate`."""
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
OFF_POLICY = ("auto", "recompute", "bypass", "decoupled")  # algo.off_policy (docs/async.md)
ROLLOUT_ENGINES = Names("rollout engine", ("hf", "vllm"))
TOOL_FORMATS = ("compact", "hermes")  # env.tool_format (rlcli/envs/tools.py)
SCHEDULERS = ("constant_with_warmup", "constant", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt")
"""optim.scheduler: the transformers.get_scheduler names that need only warmup and total steps (the others need
extra arguments rlcli does not pass)."""
MODEL_DTYPES = ("float32", "bfloat16", "float16")
"""model.dtype: rlcli.models.policy.DTYPES's keys."""
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""model.attn_implementation: the transformers attention backends (null = the library's default)."""
