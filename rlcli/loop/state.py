"""What the loop carries from one step to the next, in one object saved and restored whole (`Carried`, which every job's
state is: torchtune's `TrainingProgress` habit): a checkpoint cannot forget a field, and the start-up summary reads it."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import torch

from rlcli.core.schema import ConfigError
from rlcli.data import PromptStream
from rlcli.rollout.sampler import GroupSampler

log = logging.getLogger(__name__)

HEADLINE = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "reward/mean", "acc/mean")


NO_SIGNAL_STEPS = 3
"""Steps in a row without any advantage after which the loop warns (rlcli.loop.summary.no_signal_warning)."""


def no_signal(metrics: dict[str, float]) -> bool:
    """Whether a step's advantages were all zero (`adv/mean` and `adv/std` over its loss tokens): the policy gradient
    had nothing to follow (GRPO: every group's rewards were equal)."""
    return abs(metrics.get("adv/mean", 1.0)) < 1e-12 and metrics.get("adv/std", 1.0) < 1e-12


class NonFiniteTraining(ConfigError):
    """Training produced only non-finite gradients for optim.max_skipped_steps steps in a row (reported in one
    line, like a config error: the fix is a knob)."""


def _load_rollout(rollout: Any, state: dict[str, Any]) -> None:
    if rollout:
        rollout.load_state_dict(state)


def _load_curriculum(curriculum: Any, state: dict[str, Any] | None) -> None:
    if curriculum is not None:
        curriculum.load_state_dict(state)


ADDED_LATER = {
    "entropy_coef": "with the entropy coefficient algo.entropy_coef (algo.entropy_control=adaptive starts over there)",
    "curriculum": "with data.curriculum's levels at their start (a run without a curriculum has none to resume)",
    "replay": "with an empty replay buffer (rollout.replay)",
}
"""Checkpoint keys newer than the first checkpoints, and what resuming an older checkpoint does without them (every
other key is required: a checkpoint without it is not resumed)."""

# LoopState's object fields: field -> (checkpoint key, save(value) -> data, load(value, data)). Every other field is
# data, saved and restored as it is (tests/test_train.py checks that each one survives).
CARRIED: dict[str, tuple[str, Any, Any]] = {
    "prompts": ("prompts", lambda p: p.state_dict(), lambda p, d: p.load_state_dict(d)),
    "sampler": ("carry", lambda s: s.carry, lambda s, d: setattr(s, "carry", d)),  # DAPO's surplus groups
    "kl_ctl": ("kl_coef", lambda k: k.value, lambda k, d: setattr(k, "value", d)),  # β (adaptive: it moves)
    "entropy_ctl": ("entropy_coef", lambda e: e.state_dict() if e is not None else None,
                    lambda e, d: e.load_state_dict(d) if e is not None and d is not None else None),  # α (adaptive)
    "rollout": ("rollout", lambda r: r.state_dict() if r else {}, _load_rollout),
    "curriculum": ("curriculum", lambda c: c.state_dict() if c is not None else None, _load_curriculum),  # levels
    "replay": ("replay", lambda b: b.state_dict() if b is not None else None,
               lambda b, d: b.load_state_dict(d) if b is not None and d is not None else None),  # rollout.replay
}


class Carried:
    """What a job carries from one step to the next, in one dataclass saved and restored whole (torchtune's
    `TrainingProgress` habit): every dataclass field, an object field through its entry in `CARRIED` (field ->
    (checkpoint key, save(value) -> data, load(value, data))), and the RNGs. A checkpoint cannot forget a field. A
    job's state has the fields `step`, `train_seconds` and `result` (rlcli.loop.job reads them)."""

    CARRIED: ClassVar[dict[str, tuple[str, Any, Any]]] = {}
    ADDED_LATER: ClassVar[dict[str, str]] = {}  # checkpoint key -> what resuming a checkpoint without it does

    def state_dict(self) -> dict[str, Any]:
        """Every dataclass field (an object field through its entry in CARRIED, under that entry's key) and the RNGs."""
        out = {"rng": rng_state()}
        for f in fields(self):  # type: ignore[arg-type]
            key, save, _ = self.CARRIED.get(f.name, (f.name, None, None))
            out[key] = save(getattr(self, f.name)) if save else getattr(self, f.name)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore everything; the RNGs last (building the trainer drew from them too). A key of ADDED_LATER that the
        checkpoint lacks leaves its field as the run built it."""
        for f in fields(self):  # type: ignore[arg-type]
            key, _, load = self.CARRIED.get(f.name, (f.name, None, None))
            if key not in state and key in self.ADDED_LATER:
                log.warning("the checkpoint predates %s: it resumes %s", key, self.ADDED_LATER[key])
                continue
            if load:
                load(getattr(self, f.name), state[key])
            else:
                setattr(self, f.name, state[key])
        set_rng_state(state["rng"])


@dataclass
class LoopState(Carried):
    CARRIED = CARRIED
    ADDED_LATER = ADDED_LATER

    prompts: PromptStream
    """The per-rank prompt stream: its position in the seeded, epoch-shuffled order."""
    sampler: GroupSampler
    """Whole-group sampling; its `carry` holds DAPO's surplus groups with their recorded old log-probs."""
    kl_ctl: Any
    """The KL coefficient β and its controller (fixed, or adaptive: Ziegler et al. 2019)."""
    next_group: int
    """Group ids handed out so far on this rank (unique across ranks and steps)."""
    replay: Any = None
    """rollout.replay's buffer of earlier informative groups (rlcli.rollout.replay; None when off), shared with the
    sampler."""
    rollout: Any = None
    """Where generation batches come from (rlcli.loop.remote): with rollout ranks, the batches asked for and not
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
    no_signal_in_a_row: int = 0
    """Training steps in a row whose advantages were all zero (every group's rewards equal): nothing to learn."""
    no_signal_steps: int = 0
    """Training steps of the run whose advantages were all zero."""
    entropy_ctl: Any = None
    """The entropy bonus coefficient α and its controller (rlcli.algos.entropy: fixed, or adaptive: Skywork-OR1), the
    learner's own object; None only in states built without a learner."""
    curriculum: Any = None
    """data.curriculum: each task's level and window of recent accuracies (rlcli.data.curriculum.Curriculum; the
    prompt stream draws at its levels); None without one."""

    def request(self, n: int, version: int) -> Any:
        """The next generation batch, rlcli.loop.remote.Request: `n` prompts from this rank's stream and their
        group ids, to be generated by policy `version`."""
        from rlcli.loop.remote import Request

        prompts = self.prompts.take(n)
        self.next_group += len(prompts)
        return Request([p["prompt"] for p in prompts], [p["answer"] for p in prompts], self.next_group - len(prompts),
                       version)

    def end_step(self, step: int, metrics: dict[str, float], optimizer_steps: int, max_skipped: int) -> None:
        """Record training step `step` done; raise NonFiniteTraining after `max_skipped` steps in a row that
        skipped all `optimizer_steps` of their actor updates."""
        self.step = step
        silent = no_signal(metrics)
        self.no_signal_in_a_row = self.no_signal_in_a_row + 1 if silent else 0
        self.no_signal_steps += silent
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
