"""VAPO and PPO with a critic: hand-computed decoupled / length-adaptive GAE, the positive-example
NLL, value pretraining (policy frozen, critic trained, explained variance rising), and 2-step runs.
"""

import math

import pytest
import torch
from metric_names import undocumented

from rlcli.algos.advantages import AdvantageInputs, compute_advantages
from rlcli.algos.config import AlgoConfig
from rlcli.algos.functional import positive_example_nll


def test_decoupled_length_adaptive_gae_hand_computed():
    """γ = 1, α = 0.5 (so short sequences give non-trivial λ), no whitening.

    Row A, length 4: r = [0, 0, 0, 1], V = [.5, .2, .4, .6]; λ_A = 1 - 1/(0.5·4) = 0.5.
      δ = [0+.2-.5, 0+.4-.2, 0+.6-.4, 1+0-.6] = [-.3, .2, .2, .4]
      A3 = .4; A2 = .2 + .5·.4 = .4; A1 = .2 + .5·.4 = .4; A0 = -.3 + .5·.4 = -.1
      critic returns with λ_critic = 1: Σ future rewards = [1, 1, 1, 1]
    Row B, length 2 of T = 4: r = [0, -1], V = [.3, -.2] (masked values 9 are ignored); λ_B = 1 - 1/1 = 0.
      A = δ = [0 - .2 - .3, -1 + 0 + .2] = [-.5, -.8]; returns = [-1, -1]; masked positions 0.
    """
    inp = AdvantageInputs(
        scores=torch.tensor([1.0, -1.0]),
        token_rewards=torch.tensor([[0.0, 0, 0, 1], [0, -1, 0, 0]]),
        mask=torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]]),
        group_index=torch.tensor([0, 0]),
        lengths=torch.tensor([4, 2]),
        values=torch.tensor([[0.5, 0.2, 0.4, 0.6], [0.3, -0.2, 9.0, 9.0]]),
    )
    cfg = AlgoConfig(adv_estimator="gae", gamma=1.0, lam_actor=0.95, lam_critic=1.0,
                     length_adaptive_gae=True, length_adaptive_alpha=0.5, whiten_advantages=False)
    adv, ret = compute_advantages(inp, cfg)
    torch.testing.assert_close(adv, torch.tensor([[-0.1, 0.4, 0.4, 0.4], [-0.5, -0.8, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]]))
    # Coupled GAE (λ_critic = λ_actor = 0.95, not length-adaptive) changes the critic's targets:
    # row A, A3 = .4, A2 = .2 + .95·.4 = .58, returns = A + V: [.., .98, 1.0]
    _, ret_coupled = compute_advantages(inp, AlgoConfig(adv_estimator="gae", lam_actor=0.95, lam_critic=0.95,
                                                        whiten_advantages=False))
    torch.testing.assert_close(ret_coupled[0, 2:], torch.tensor([0.98, 1.0]))


def test_positive_example_nll_touches_only_correct_responses():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0], [-4.0, -4.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 1, 1]])
    correct = torch.tensor([True, False, True])
    nll = positive_example_nll(logp, mask, correct)
    # correct tokens: row 0 (2 tokens: 1 + 2) and row 2 (3 tokens: 4+4+4) -> 15 / 5 = 3
    assert nll.item() == pytest.approx(3.0)
    nll.backward()
    expected = torch.tensor([[-0.2, -0.2, 0.0], [0.0, 0.0, 0.0], [-0.2, -0.2, -0.2]])
    torch.testing.assert_close(logp.grad, expected)
    # A mini-batch normalizer from outside (micro-batching) is used as given.
    assert positive_example_nll(logp.detach(), mask, correct, num_tokens=10).item() == pytest.approx(1.5)


@pytest.mark.slow
def test_value_pretraining_freezes_the_policy_trains_the_critic_and_ev_rises(make_trainer):
    """A reward predictable from the prompt (answer length / 4) over a fixed set of 8 prompts: the
    critic can learn V(prompt), so explained variance on each fresh batch (measured before that
    batch's update) rises. Measured 2026-11-22: 0.00 at step 1, ~0.18 at step 25 (critic lr 1e-3).
    1-3-digit problems, so answer lengths (1-4 characters) and hence rewards vary across prompts."""
    t = make_trainer("algo=vapo", "algo.group_sampling=false", "data.train_size=8",
             "data.min_digits=1", "data.max_digits=3",
             "rollout.prompts_per_step=8", "rollout.n=4", "critic.pretrain_steps=25", "critic.lr=1e-3",
             "~reward.weights.sevens", "~reward.custom.sevens", "+reward.weights.d=1.0",
             "+reward.custom.d=reward_fixtures.answer_digits")
    policy = {n: p.detach().clone() for n, p in t.learner.actor.module.named_parameters()}
    critic = {n: p.detach().clone() for n, p in t.learner.critic.module.named_parameters()}
    evs = []
    log = t.logger.log
    t.logger.log = lambda m, step: (evs.append(m["pretrain/critic/explained_var"]), log(m, step))
    out = t.pretrain_critic()
    assert out["steps"] == 25 and len(evs) == 25
    assert all(torch.equal(policy[n], p) for n, p in t.learner.actor.module.named_parameters())  # bit-identical
    assert all(not torch.equal(critic[n], p) for n, p in t.learner.critic.module.named_parameters())
    assert sum(evs[-3:]) / 3 > sum(evs[:3]) / 3 + 0.05, evs
    assert t.state.sampler.carry is None


@pytest.mark.slow
def test_pretraining_stops_early_at_the_ev_threshold(make_trainer):
    t = make_trainer("algo=vapo", "rollout.prompts_per_step=4", "rollout.n=2",
             "critic.pretrain_steps=5", "critic.pretrain_ev_threshold=-1.0")
    assert t.pretrain_critic()["steps"] == 1  # any explained variance passes a threshold of -1


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "vapo"])
def test_ppo_and_vapo_train_two_steps(algo, make_trainer):
    t = make_trainer(f"algo={algo}", "rollout.prompts_per_step=4", "rollout.n=4", "steps=2",
             "critic.pretrain_steps=2", "optim.lr=1e-3")
    assert t.learner.critic is not None and (t.learner.ref is not None) == (t.cfg.algo.kl_coef > 0)
    if algo == "vapo":
        assert (t.units.P, t.units.G) == (4, 4)  # group sampling: P x G as configured (without it: 16 x 1)
        t.pretrain_critic()
    before = {n: p.detach().clone() for n, p in t.learner.actor.module.named_parameters()}
    for step in (1, 2):
        m = t.train_step(step)
        assert all(math.isfinite(v) for v in m.values()), m
        for k in ("critic/vf_loss", "critic/explained_var", "critic/values_mean", "critic/grad_norm",
                  "actor/pg_loss", "actor/entropy"):
            assert k in m, k
        assert ("actor/nll_loss" in m) == (algo == "vapo")
        assert not undocumented(m, reward_parts=("sevens",))
    assert all(not torch.equal(before[n], p) for n, p in t.learner.actor.module.named_parameters())


@pytest.mark.slow
def test_value_pretraining_runs_the_score_stage_so_kl_in_the_reward_works(make_trainer):
    """algo=ppo puts β·KL in the token rewards, which needs old and reference log-probs: pretraining used
    to skip the score stage and crash in kl_estimate(None, None). The policy must stay frozen and the
    β controller untouched (no policy update happened to adapt to)."""
    t = make_trainer("algo=ppo", "algo.value_pretrain=true", "algo.kl_target=0.01",
             "rollout.prompts_per_step=4", "rollout.n=2", "critic.pretrain_steps=2")
    assert t.learner.ref is not None and t.cfg.algo.kl_in_reward and t.units.pretrain_steps == 2
    policy = {n: p.detach().clone() for n, p in t.learner.actor.module.named_parameters()}
    beta = t.state.kl_ctl.value
    out = t.pretrain_critic()
    assert out["steps"] == 2 and math.isfinite(out["vf_loss"])
    assert all(torch.equal(policy[n], p) for n, p in t.learner.actor.module.named_parameters())
    assert t.state.kl_ctl.value == beta
    m = t.train_step(1)
    assert t.state.kl_ctl.value != beta and m["actor/kl_coef"] == t.state.kl_ctl.value  # the step itself adapts β


def test_explained_variance_of_constant_returns_is_zero_not_one():
    from rlcli.models.value import explained_variance

    mask = torch.ones(2, 3)
    assert explained_variance(torch.zeros(2, 3), -torch.ones(2, 3), mask).item() == 0.0
    # and the ordinary case: V = ret exactly explains everything
    ret = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 5.0]])
    assert explained_variance(ret, ret, mask).item() == pytest.approx(1.0)


@pytest.mark.slow
def test_critic_schedule_spans_pretraining_and_every_epoch(make_trainer):
    """The critic steps once per mini-batch and epoch, in pretraining too: with 2 epochs, 1 mini-batch,
    3 steps and 2 pretraining steps that is 3·2 + 2·2 = 10 optimizer steps. A cosine schedule sized for
    fewer (the old 3·2 + 2·1 = 8) would reach lr 0 two steps early."""
    t = make_trainer("algo=vapo", "steps=3", "algo.ppo_epochs=2", "critic.pretrain_steps=2",
             "optim.scheduler=cosine", "rollout.prompts_per_step=2", "rollout.n=2")
    lam = t.learner.critic.scheduler.lr_lambdas[0]
    assert lam(9) > 0 and lam(10) == pytest.approx(0.0, abs=1e-12)
    assert t.learner.actor.scheduler.lr_lambdas[0](5) > 0 and t.learner.actor.scheduler.lr_lambdas[0](6) == pytest.approx(0.0)


@pytest.mark.slow
def test_value_pretraining_skips_policy_log_probs_it_does_not_use(make_trainer, monkeypatch):
    """Off-policy VAPO (2 mini-batches) without KL: pretraining never updates the policy and has no KL
    penalty, so it must not spend a policy forward pass on old log-probs (one per step at 32B scale)."""
    t = make_trainer("algo=vapo", "algo.mini_batches=2", "rollout.prompts_per_step=4",
             "rollout.n=2", "critic.pretrain_steps=2")
    assert not t.units.on_policy and t.learner.ref is None
    calls = []
    logprobs = t.learner.logprobs
    monkeypatch.setattr(t.learner, "logprobs", lambda *a: (calls.append(1), logprobs(*a))[1])
    assert t.pretrain_critic()["steps"] == 2 and calls == []
    t.train_step(1)
    assert calls, "the actor's update does need them"
