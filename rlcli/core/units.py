"""The batch units of a run (docs/design.md#units: P, G, N, ranks, optimizer steps), derived from the config here only,
and quantities as people read them. Torch-free: the loop, `rlcli rm`, the memory plan and the start-up summary read
them alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcli.core.topology import trainer_ranks


def duration(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


@dataclass(frozen=True)
class BatchUnits:
    """The batch units of a run (docs/design.md#units), derived from the config in this one place: the
    trainer, the learner, the planner and the start-up summary read them here."""

    P: int
    """Prompts (groups) sampled per step over all ranks; without group sampling, P*G prompts of 1 response."""
    G: int
    """Responses per prompt (the group)."""
    world: int
    """Data-parallel ranks over all nodes."""
    p_local: int
    """Groups per rank per step."""
    gen_p_local: int
    """Prompts per rank per generation batch (dynamic sampling refills in such batches)."""
    mini_batch_trajectories: int
    """Trajectories per optimizer step, over all ranks."""
    optimizer_steps: int
    """Actor optimizer steps over the run: steps x mini_batches x ppo_epochs."""
    pretrain_steps: int
    """VAPO value-pretraining steps before the first actor update (0 = none)."""
    pretrain_optimizer_steps: int
    """Critic optimizer steps of value pretraining."""
    on_policy: bool
    """One mini-batch, one epoch and no KL in the reward: old_logp = logp.detach(), no old-log-prob pass."""

    @property
    def N(self) -> int:  # noqa: N802 (the papers' letter)
        """Trajectories per step over all ranks."""
        return self.P * self.G

def units(cfg: Any) -> BatchUnits:
    """The run's BatchUnits. (P, G) are as sampled: rollout.prompts_per_step x rollout.n with group
    sampling (every group estimator, and VAPO §4.3); without it, VAPO's other use of the same budget (its
    vanilla-PPO baseline: "8192 prompts, with each prompt sampled once"): P*G prompts x 1 response."""
    r, a = cfg.rollout, cfg.algo
    p, g = (r.prompts_per_step, r.n) if a.group_sampling else (r.prompts_per_step * r.n, 1)
    world = trainer_ranks(cfg)
    per_epoch = a.mini_batches * a.ppo_epochs
    pretrain = cfg.critic.pretrain_steps if a.value_pretrain else 0
    return BatchUnits(
        P=p, G=g, world=world, p_local=p // world,
        gen_p_local=(r.gen_prompts_per_step or p) // world if a.dynamic_sampling else p // world,
        mini_batch_trajectories=p * g // a.mini_batches, optimizer_steps=cfg.steps * per_epoch,
        pretrain_steps=pretrain, pretrain_optimizer_steps=pretrain * per_epoch,
        on_policy=a.mini_batches == 1 and a.ppo_epochs == 1 and not (a.kl_coef > 0 and a.kl_in_reward),
    )

def shares_prompts(cfg: Any) -> bool:
    """Whether scoring and the update run each group's prompt once (hw.share_prompts with G > 1 and an attention
    implementation that takes the block mask: sdpa, eager, or the library's default, sdpa): what the memory plan
    counts. The learner decides from the loaded model with a start-up check (rlcli.models.policy.prompt_sharing_for),
    which can also fall back to a forward per row. Never under sequence parallelism (hw.sp_size > 1)."""
    attention = cfg.model.attn_implementation
    return cfg.hw.share_prompts and units(cfg).G > 1 and attention in (None, "sdpa", "eager") and cfg.hw.sp_size == 1
