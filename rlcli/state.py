"""What the loop carries from one step to the next, in one object saved and restored whole (torchtune's
`TrainingProgress` habit): a checkpoint cannot forget a field, and the start-up summary reads it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlcli.data import PromptStream
from rlcli.rollout.sampler import GroupSampler
from rlcli.schema import ConfigError

HEADLINE = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "reward/mean", "acc/mean")


class NonFiniteTraining(ConfigError):
    """Training produced only non-finite gradients for optim.max_skipped_steps steps in a row (reported in one
    line, like a config error: the fix is a knob)."""


@dataclass
class LoopState:
    prompts: PromptStream
    """The per-rank prompt stream: its position in the seeded, epoch-shuffled order."""
    sampler: GroupSampler
    """Whole-group sampling; its `carry` holds DAPO's surplus groups with their recorded old log-probs."""
    kl_ctl: Any
    """The KL coefficient β and its controller (fixed, or adaptive: Ziegler et al. 2019)."""
    next_group: int
    """Group ids handed out so far on this rank (unique across ranks and steps)."""
    rollout: Any = None
    """Where generation batches come from (rlcli.rollout.remote): with rollout ranks, the batches asked for and not
    trained on yet."""
    step: int = 0
    """Training steps done."""
    train_seconds: float = 0.0
    """Seconds spent in value pretraining and training steps (not evaluation)."""
    result: dict[str, Any] = field(default_factory=dict)
    """What the run reports at the end (held-out accuracy before training, value pretraining, ...)."""
    skipped_in_a_row: int = 0
    """Training steps in a row whose every actor optimizer step was skipped (non-finite gradient norm)."""
    last_finite: dict[str, float] = field(default_factory=dict)
    """Headline metrics of the last step that applied an update (for the error when updates stop)."""

    def end_step(self, step: int, metrics: dict[str, float], optimizer_steps: int, max_skipped: int) -> None:
        """Record training step `step` done; raise NonFiniteTraining after `max_skipped` steps in a row that
        skipped all `optimizer_steps` of their actor updates."""
        self.step = step
        if metrics.get("actor/skipped_steps", 0.0) < optimizer_steps:
            self.skipped_in_a_row = 0
            self.last_finite = {k: metrics[k] for k in HEADLINE if k in metrics} | {"step": step}
            return
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row >= max_skipped:
            raise NonFiniteTraining(
                f"step {step}: {self.skipped_in_a_row} training steps in a row had a non-finite gradient norm on "
                f"every optimizer step (optim.max_skipped_steps={max_skipped}), so nothing was trained. Last step "
                f"with an update: {self.last_finite or 'none'}. Lower optim.lr, check the reward for inf, or try "
                "hw.precision=fp32"
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "next_group": self.next_group, "train_seconds": self.train_seconds,
            "result": self.result, "prompts": self.prompts.state_dict(), "carry": self.sampler.carry,
            "kl_coef": self.kl_ctl.value, "rng": rng_state(), "skipped_in_a_row": self.skipped_in_a_row,
            "last_finite": self.last_finite, "rollout": self.rollout.state_dict() if self.rollout else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore everything; the RNGs last (building the trainer drew from them too)."""
        self.step, self.next_group = state["step"], state["next_group"]
        self.train_seconds, self.result = state["train_seconds"], state["result"]
        self.prompts.load_state_dict(state["prompts"])
        self.sampler.carry = state["carry"]
        self.kl_ctl.value = state["kl_coef"]
        self.skipped_in_a_row, self.last_finite = state["skipped_in_a_row"], state["last_finite"]
        if self.rollout:
            self.rollout.load_state_dict(state["rollout"])
        set_rng_state(state["rng"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,  # this rank's device
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
