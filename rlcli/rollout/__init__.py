"""Rollout: generation engines, reward shaping, and whole-group sampling (dynamic sampling, carry).

Engines are registered in ROLLOUT_ENGINES under their `rollout.engine` name and share one signature,
that of `rlcli.rollout.hf.generate`: prompts, answers and sampling settings -> a RolloutBatch of whole
groups (token ids, masks, `truncated`, optionally the sampler's own log-probs `rollout_logp`).
"""

from rlcli.registry import Registry
from rlcli.rollout.hf import generate

ROLLOUT_ENGINES = Registry("rollout engine")
ROLLOUT_ENGINES.register("hf")(generate)
