"""RewardManager: stage 2 of the loop, every reward part of a batch in one weighted score (the package's docstring,
rlcli/rewards/__init__.py, shows its use)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcli.core.workers import WorkerPool
from rlcli.rewards.code import AUDIT, COUNTS
from rlcli.rewards.config import MODEL_PARTS, RewardConfig, validate

if TYPE_CHECKING:
    import torch


log = logging.getLogger(__name__)


@dataclass
class RewardOutput:
    """Rewards of N responses, in input order."""

    score: torch.Tensor
    """[N] float32, the reward functions' weighted sum Σ_k w_k · v_k (math_verify mapped to correct/incorrect); the
    model parts (rm, judge), if any, are reward_batch's to add."""
    acc: torch.Tensor
    """[N] float32 in {0, 1}, correctness: all tests pass (code), a full score (reasoning_gym), else math-verify's
    verdict, computed even when math_verify has no weight (rlcli.rewards.functions.ACC_PARTS)."""
    parts: dict[str, torch.Tensor]
    """Reward function name -> [N] float32 raw values (math_verify raw = acc, before the ±1 mapping)."""
    flagged: torch.Tensor
    """[N] float32 in {0, 1}: a reward function scored the response its maximum while an independent check failed
    (the reward audit, rlcli.rewards.code.AUDIT); 0 where none checks."""
    metrics: dict[str, float]
    """reward/<part> (mean raw value), reward/timeouts, reward/errors, reward/restarts (this call)."""


class RewardManager:
    """Scores responses against ground truths with the configured reward functions, and (reward_batch) the
    prompts and responses of a rollout batch with the model parts too (rm, judge), given their `scorers`."""

    def __init__(self, cfg: RewardConfig | Any, scorers: dict[str, Any] | None = None):
        """`scorers`: model part -> its scorer (rlcli.rewards.scorer), owned from here on; none where the batches
        are made elsewhere (`__call__` never needs them: evaluation reads acc alone)."""
        if not isinstance(cfg, RewardConfig):  # a composed DictConfig
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_object(cfg)
        validate(cfg, allow_empty=True)  # (no reward function is a run-level rule: rlcli.config.validate)
        self.cfg, self.scorers = cfg, dict(scorers or {})
        self.weights = {name: float(w) for name, w in cfg.weights.items()}
        self.functions = {name: w for name, w in self.weights.items() if name not in MODEL_PARTS}  # the workers' parts
        self.count_names = COUNTS if "code" in self.functions else ()  # what reward functions count (reward/<name>)
        spec = {
            "parts": list(self.functions),
            "custom": dict(cfg.custom),
            "options": cfg.function_options(),
            "max_response_chars": cfg.max_response_chars,
        }
        self.pool = WorkerPool(
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
        """The rewards of a run (root config `cfg`) that generates with the policy `tokenizer`: each model part in
        reward.weights (reward.rm's model, reward.judge) is loaded here, on this process's device, when `with_model`
        (false where another process makes the batches: a training rank with rollout ranks of its own)."""
        from rlcli.rewards.scorer import build_scorer

        parts = [p for p in MODEL_PARTS if p in cfg.reward.weights] if with_model else []
        return cls(cfg.reward, {p: build_scorer(p, cfg, tokenizer) for p in parts})

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[str]) -> RewardOutput:
        """The reward functions' parts, from the texts alone: every part but the model parts (they read the prompt
        too; `reward_batch` adds them)."""
        import torch

        if len(responses) != len(ground_truths):
            raise ValueError(f"got {len(responses)} responses but {len(ground_truths)} ground truths")
        restarts = self.pool.restarts
        results = self.pool.map(list(zip(responses, ground_truths)))
        n = len(results)
        acc = [0.0] * n
        raw = {name: [0.0] * n for name in self.functions}
        timeouts = errors = 0
        counts = dict.fromkeys(self.count_names, 0.0)
        flagged = [0.0] * n
        for i, r in enumerate(results):
            if r.status == "ok":
                acc[i], flagged[i] = r.value["acc"], r.value["flagged"]
                for k, v in r.value["counts"].items():
                    counts[k] = counts.get(k, 0.0) + v
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
        metrics |= {f"reward/{k}": v for k, v in counts.items()}
        return RewardOutput(score=score, acc=acc_t, parts=parts, metrics=metrics,
                            flagged=torch.tensor(flagged, dtype=torch.float32))  # [N]

    def reward_batch(self, b: Any) -> tuple[Any, dict[str, float]]:
        """Stage 2 of the loop on a RolloutBatch `b`: -> (`b` with its task reward `scores` [N], correctness
        `acc` [N], each part's raw value `extras["reward/<name>"]` [N] and the reward audit's flag
        `extras["reward/audit_flagged"]` [N] (any part's: rlcli.rewards.code.AUDIT); the verifier's
        timeout/error/restart counts and the model parts' counts (reward/judge_errors, ...), which add up over
        generation batches and ranks). A model part adds weight x its value (rm: the score normalised over this
        batch, reward.rm.normalize, .clip; judge: the verdict); its raw value is the part. A multi-turn row's
        environment reward (`extras["env/reward"]`, rlcli.envs; an agent's, rlcli.rollout.agent) adds to its score, and
        an agent's acc (`extras["env/acc"]`) is the row's acc; an episode counted in env/errors or env/timeouts scores
        0 with acc 0."""
        import torch

        out = self(b.texts, b.answers)
        parts, score, flagged = dict(out.parts), out.score, out.flagged
        counts = {f"reward/{k}": out.metrics[f"reward/{k}"] for k in ("timeouts", "errors", "restarts")}
        counts |= {f"reward/{k}": out.metrics[f"reward/{k}"] for k in self.count_names}
        more: dict[str, Any] = {}
        for part in (p for p in MODEL_PARTS if p in self.weights):
            if part not in self.scorers:
                raise RuntimeError(f"reward.weights has {part} but this RewardManager has no scorer for it: "
                                   "build it with RewardManager.for_run(cfg, tokenizer)")
            scored = self.scorers[part](b)
            parts[part] = scored.raw  # [N]
            score = score + self.weights[part] * scored.value
            own = dict(scored.extras)
            flagged = torch.maximum(flagged, own.pop(AUDIT, torch.zeros_like(flagged)))  # [N]
            more.update(own)
            counts.update({f"reward/{k}": v for k, v in scored.counts.items()})
        extras = {**b.extras, **{f"reward/{k}": v for k, v in {**parts, **more, AUDIT: flagged}.items()}}
        scores = score + b.extras["env/reward"] if "env/reward" in b.extras else score.clone()
        acc = b.extras.get("env/acc", out.acc)
        if "env/errors" in b.extras:  # an episode that failed or timed out scores 0, whatever its text and steps earned
            ok = (b.extras["env/errors"] + b.extras["env/timeouts"]) == 0  # [N]
            scores, acc = torch.where(ok, scores, 0.0), torch.where(ok, acc, 0.0)
        return b.replace(scores=scores, acc=acc, extras=extras), counts

    def _log_once(self, message: str) -> None:
        key = message.split(":", 2)[:2]  # status/part and exception type
        if str(key) not in self._logged:
            self._logged.add(str(key))
            log.warning("reward: %s (further failures of this kind are only counted)", message[:300])

    def close(self) -> None:
        """Stop the reward workers (also done at interpreter exit) and let the model parts go."""
        self.pool.close()
        for scorer in self.scorers.values():
            scorer.close()
        self.scorers = {}

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
