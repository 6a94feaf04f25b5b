"""DAPO dynamic sampling in the real trainer (tiny random-init model, real reward workers).

Scripted user rewards make it deterministic: `even_answer` ignores the response (every group has
zero variance), and `count_sevens` on a random-init model gives a seeded mix. Seed 1 was found by
scanning seeds 0-15 (a loop over Trainer.collect, 2026-11-24, since each generation batch samples from its own
seed): its first generation batch of 3 groups keeps fewer than P=2, the refill overshoots, and one informative
group is carried. Seed 7 needs 4 generation batches.
"""

import pytest
import torch

from rlcli.loop.learner import rl_phase
from rlcli.loop.metrics import Timer
from rlcli.loop.trainer import DynamicSamplingExhausted
from rlcli.models import response_logprobs

pytestmark = pytest.mark.slow


def trainer(make_trainer, reward, *extra):
    """A DAPO-sampling trainer (P=2 groups from generation batches of 3 prompts) with the scripted `reward`."""
    return make_trainer(
        "~reward.weights.sevens", "~reward.custom.sevens", "+reward.weights.scripted=1.0",
        f"+reward.custom.scripted=reward_fixtures.{reward}", "rollout.prompts_per_step=2", "rollout.gen_prompts_per_step=3",
        "algo.dynamic_sampling=true", "algo.filter_metric=score", "algo.max_gen_batches=4", "optim.lr=5e-5", *extra,
    )


def finish_step(t, batch, step=1):
    """Stages 4-6 of a collected batch, as train_step runs them. -> update metrics"""
    phase = rl_phase(t.cfg)
    batch = batch.replace(**t.learner.score(batch, step, phase))
    batch, _ = t.advantage(batch, step, phase)
    return t.learner.update(batch, phase)


def group_has_variance(batch, g):
    s = batch.scores[batch.group_index == g]
    return bool((s.max() - s.min()) > 0)


def test_keeps_informative_groups_refills_and_carries_the_surplus(make_trainer):
    t = trainer(make_trainer, "count_sevens", "seed=1")
    batch, metrics = t.collect(Timer())
    # Exactly P groups, each informative, found over a refill.
    assert len(batch.groups) == 2 and len(batch) == 8
    assert all(group_has_variance(batch, g) for g in batch.groups.tolist())
    assert metrics["dynamic_sampling/gen_batches"] == 2
    assert metrics["dynamic_sampling/carried"] == 0
    assert 0 < metrics["dynamic_sampling/kept_fraction"] < 1
    # The surplus group is carried, with the sampling policy's log-probs recorded now.
    carry = t.state.sampler.carry
    assert carry is not None and len(carry.groups) == 1 and carry.stale.all()
    assert group_has_variance(carry, carry.groups.item())
    with torch.no_grad():
        logp, _ = response_logprobs(t.learner.actor.module, carry.prompt_ids, carry.prompt_mask, carry.response_ids,
                                    carry.response_mask, t.cfg.rollout.temperature)
    torch.testing.assert_close(carry.old_logp, logp * carry.response_mask)
    carried_group = carry.groups.item()
    # Finish step 1, then step 2 starts from the carried group.
    finish_step(t, batch)
    batch2, m2 = t.collect(Timer())
    assert batch2.groups[0].item() == carried_group and m2["dynamic_sampling/carried"] == 1
    rows = batch2.group_index == carried_group
    assert batch2.stale[rows].all() and not batch2.stale[~rows].any()
    torch.testing.assert_close(batch2.old_logp[rows], carry.old_logp)  # stale: one update old
    assert all(group_has_variance(batch2, g) for g in batch2.groups.tolist())
    # The LR schedule counts optimizer steps, not generation batches.
    assert t.learner.actor.scheduler.last_epoch == 1


def test_carried_groups_keep_their_old_logp_in_the_update(make_trainer):
    """On-policy shortcut (1 mini-batch, 1 epoch) must not apply to carried rows: their ratio is
    π_now / π_sampling, so after one update it differs from 1 (DAPO, arXiv:2503.14476 §3.2; the carry is rlcli's)."""
    t = trainer(make_trainer, "count_sevens", "seed=1")
    b1, _ = t.collect(Timer())
    finish_step(t, b1)
    b2, _ = t.collect(Timer())
    stale = b2.select(b2.stale.nonzero().squeeze(-1))
    with torch.no_grad():
        now, _ = response_logprobs(t.learner.actor.module, stale.prompt_ids, stale.prompt_mask, stale.response_ids,
                                   stale.response_mask, t.cfg.rollout.temperature)
    assert not torch.allclose(now * stale.response_mask, stale.old_logp)
    m2 = finish_step(t, b2, 2)
    assert m2["actor/ppo_kl"] != 0.0  # the stale rows bring a non-trivial ratio into the loss


def test_fails_with_an_actionable_message_when_the_cap_is_hit(make_trainer):
    t = trainer(make_trainer, "even_answer", "seed=0")
    with pytest.raises(DynamicSamplingExhausted) as e:
        t.collect(Timer())
    msg = str(e.value)
    assert "found only 0 informative groups of the 2 needed" in msg
    assert "algo.max_gen_batches=4" in msg and "rollout.gen_prompts_per_step" in msg
    assert "algo.train_on_partial=true" in msg


def test_train_on_partial_uses_what_was_found(make_trainer):
    # seed 7 needs 4 batches to fill P=2; with a cap of 1 batch it keeps fewer groups and trains on them.
    t = trainer(make_trainer, "count_sevens", "seed=7", "algo.max_gen_batches=1",
                "algo.train_on_partial=true")
    batch, m = t.collect(Timer())
    assert m["dynamic_sampling/gen_batches"] == 1 and 1 <= len(batch.groups) < 2
    assert finish_step(t, batch)["actor/grad_norm"] > 0
