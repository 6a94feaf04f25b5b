"""Task rewards (docs/rewards.md): weighted reward functions, verified in sandboxed workers.

    manager = RewardManager(cfg.reward)          # starts the workers (non-blocking), once per run
    out = manager(responses, ground_truths)      # out.score [N], out.acc [N], out.parts, out.metrics
    manager.close()

    manager = RewardManager.for_run(cfg, tokenizer)   # the loop's: also loads reward.rm when weights has rm
    batch, counts = manager.reward_batch(batch)       # stage 2 on a RolloutBatch: every part, the model's too

The formula and the failure rules are in rlcli/rewards/config.py and docs/rewards.md. The reward functions
run in sandbox workers on the response text; the reward model's part (`rm`, rlcli/rewards/model.py) reads the
prompt as well, so `reward_batch` adds it in this process, into the same score.

This package does not import torch at module level: every sandbox worker imports this package (for
the reward functions) and must stay small and quick to start. torch is imported where the score
tensors are built, and rlcli.rewards.model only when a reward model is loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcli.rewards.config import MODEL_PART, RewardConfig, group_base, store_group_schema, validate
from rlcli.rewards.functions import REWARDS, extract_final_answer
from rlcli.rewards.pool import SandboxPool, TaskResult

if TYPE_CHECKING:
    import torch

__all__ = [
    "REWARDS",
    "RewardConfig",
    "RewardManager",
    "RewardOutput",
    "SandboxPool",
    "TaskResult",
    "extract_final_answer",
    "group_base",
    "store_group_schema",
    "validate",
]

log = logging.getLogger(__name__)


@dataclass
class RewardOutput:
    """Rewards of N responses, in input order."""

    score: torch.Tensor
    """[N] float32, the reward functions' weighted sum Σ_k w_k · v_k (math_verify mapped to correct/incorrect); the
    reward model's part, if any, is reward_batch's to add."""
    acc: torch.Tensor
    """[N] float32 in {0, 1}, math-verify correctness, computed even when math_verify has no weight."""
    parts: dict[str, torch.Tensor]
    """Reward function name -> [N] float32 raw values (math_verify raw = acc, before the ±1 mapping)."""
    metrics: dict[str, float]
    """reward/<part> (mean raw value), reward/timeouts, reward/errors, reward/restarts (this call)."""


class RewardManager:
    """Scores responses against ground truths with the configured reward functions, and (reward_batch) the
    prompts and responses of a rollout batch with the reward model too, when `scorer` is given."""

    def __init__(self, cfg: RewardConfig | Any, scorer: Any = None):
        """`scorer`: the `rm` part's ModelScorer (rlcli.rewards.model), owned from here on; None without one
        (`__call__` never needs it: evaluation reads acc alone)."""
        if not isinstance(cfg, RewardConfig):  # a composed DictConfig
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_object(cfg)
        validate(cfg)
        self.cfg, self.scorer = cfg, scorer
        self.weights = {name: float(w) for name, w in cfg.weights.items()}
        self.functions = {name: w for name, w in self.weights.items() if name != MODEL_PART}  # the sandbox's parts
        spec = {
            "parts": list(self.functions),
            "custom": dict(cfg.custom),
            "options": cfg.function_options(),
            "max_response_chars": cfg.max_response_chars,
        }
        self.pool = SandboxPool(
            "rlcli.rewards.functions.score_item",
            setup="rlcli.rewards.functions.setup_worker",
            setup_args=(spec,),
            num_workers=cfg.num_workers,
            timeout_s=cfg.timeout_s,
            memory_mb=cfg.memory_mb,
        )
        self._logged: set[str] = set()

    @classmethod
    def for_run(cls, cfg: Any, tokenizer: Any, with_model: bool = True) -> RewardManager:
        """The rewards of a run (root config `cfg`) that generates with the policy `tokenizer`: reward.rm's model is
        loaded here, on this process's device, when reward.weights has rm and `with_model` (false where another
        process makes the batches: a training rank with rollout ranks of its own)."""
        scorer = None
        if MODEL_PART in cfg.reward.weights and with_model:
            from rlcli.rewards.model import ModelScorer

            scorer = ModelScorer.of_run(cfg, tokenizer)
        return cls(cfg.reward, scorer)

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[str]) -> RewardOutput:
        """The reward functions' parts, from the texts alone: every part but the reward model's (`rm` reads the
        prompt too; `reward_batch` adds it)."""
        import torch

        if len(responses) != len(ground_truths):
            raise ValueError(f"got {len(responses)} responses but {len(ground_truths)} ground truths")
        restarts = self.pool.restarts
        results = self.pool.map(list(zip(responses, ground_truths)))
        n = len(results)
        acc = [0.0] * n
        raw = {name: [0.0] * n for name in self.functions}
        timeouts = errors = 0
        for i, r in enumerate(results):
            if r.status == "ok":
                acc[i] = r.value["acc"]
                for name in raw:
                    raw[name][i] = r.value["parts"][name]
                if r.value["error"]:
                    errors += 1
                    self._log_once(r.value["error"])
            else:  # the whole response failed: acc 0, every part 0 (their floor)
                timeouts += r.status == "timeout"
                errors += r.status == "error"
                self._log_once(f"{r.status}: {r.message}")
        acc_t = torch.tensor(acc, dtype=torch.float32)  # [N]
        parts = {name: torch.tensor(v, dtype=torch.float32) for name, v in raw.items()}  # [N] each
        score = torch.zeros(n, dtype=torch.float32)  # [N]
        for name, weight in self.functions.items():
            if name == "math_verify":  # the configured acc mapping (DAPO: ±1)
                value = self.cfg.incorrect_score + (self.cfg.correct_score - self.cfg.incorrect_score) * acc_t
            else:
                value = parts[name]
            score += weight * value
        metrics = {f"reward/{name}": (v.mean().item() if n else 0.0) for name, v in parts.items()}
        metrics["reward/timeouts"] = float(timeouts)
        metrics["reward/errors"] = float(errors)
        metrics["reward/restarts"] = float(self.pool.restarts - restarts)
        return RewardOutput(score=score, acc=acc_t, parts=parts, metrics=metrics)

    def reward_batch(self, b: Any) -> tuple[Any, dict[str, float]]:
        """Stage 2 of the loop on a RolloutBatch `b`: -> (`b` with its task reward `scores` [N], correctness
        `acc` [N] and each part's raw value `extras["reward/<name>"]` [N]; the verifier's
        timeout/error/restart counts, which add up over generation batches and ranks). The reward model's part
        adds weight x its score normalised over this batch (reward.rm.normalize, .clip); its raw score is the
        part. A multi-turn row's environment reward (`extras["env/reward"]`, rlcli.envs) adds to its score."""
        out = self(b.texts, b.answers)
        parts, score = dict(out.parts), out.score
        if MODEL_PART in self.weights:
            if self.scorer is None:
                raise RuntimeError(f"reward.weights has {MODEL_PART} but this RewardManager has no reward model: "
                                   "build it with RewardManager.for_run(cfg, tokenizer)")
            from rlcli.rewards.model import normalized

            parts[MODEL_PART] = self.scorer(b)  # [N] raw
            rm = self.cfg.rm
            score = score + self.weights[MODEL_PART] * normalized(parts[MODEL_PART], rm.normalize, rm.clip)
        extras = {**b.extras, **{f"reward/{k}": v for k, v in parts.items()}}
        counts = {f"reward/{k}": out.metrics[f"reward/{k}"] for k in ("timeouts", "errors", "restarts")}
        scores = score + b.extras["env/reward"] if "env/reward" in b.extras else score.clone()
        return b.replace(scores=scores, acc=out.acc, extras=extras), counts

    def _log_once(self, message: str) -> None:
        key = message.split(":", 2)[:2]  # status/part and exception type
        if str(key) not in self._logged:
            self._logged.add(str(key))
            log.warning("reward: %s (further failures of this kind are only counted)", message[:300])

    def close(self) -> None:
        """Stop the sandbox workers (also done at interpreter exit) and let the reward model go."""
        self.pool.close()
        self.scorer = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
