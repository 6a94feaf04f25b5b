"""algo.entropy_control: Skywork-OR1's adaptive entropy bonus, Clip-Cov and KL-Cov; algo.top_entropy_quantile, the
policy gradient of the highest-entropy tokens only (docs/algorithms.md#entropy-control).

Golden numbers are worked by hand in the comments (nothing to regenerate). The hand batch below, [N=2, T=3]:

    logp = [[-1, -2, -3], [-4, -5, 99]]    A = [[2, 2, 2], [-3, -3, 50]]    mask = [[1, 1, 1], [1, 1, 0]]
    over the 5 loss tokens: mean(logp) = -3, mean(A) = 0
    cov  = [[(2)(2), (1)(2), (0)(2)], [(-1)(-3), (-2)(-3), masked]] = [[4, 2, 0], [3, 6, 0]]

The masked token's numbers (99, 50) are chosen so that a selection that ignored the mask would pick it first.
"""

import io
import math

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from rlcli.algos import functional as F
from rlcli.algos.entropy import AdaptiveEntropyController, FixedEntropyController, build_entropy_controller
from rlcli.core.schema import ConfigError

D = torch.float64
LOGP = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, 99.0]], dtype=D)
ADV = torch.tensor([[2.0, 2.0, 2.0], [-3.0, -3.0, 50.0]], dtype=D)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
COV = torch.tensor([[4.0, 2.0, 0.0], [3.0, 6.0, 0.0]], dtype=D)


def cells(selected):
    return {tuple(i) for i in selected.nonzero().tolist()}


# ----------------------------------------------------------------------------------------- adaptive (Skywork-OR1)


def test_adaptive_coefficient_follows_the_hand_computed_sequence():
    """c_0 = 0.01, Δ = 0.005, c_max = 0.02, target 0.5. Entropies 0.4 0.3 0.45 (below: up, clipped at 0.02 on the
    third), 0.6 0.7 (above: down, and the gate closes: α = 0), 0.2 (below again: up, gate open)."""
    ctl = AdaptiveEntropyController(0.01, target=0.5, delta=0.005, coef_max=0.02)
    assert ctl.value == 0.01  # before any measurement the gate is open: α_1 = c_0
    coefs, alphas = [], []
    for e in (0.4, 0.3, 0.45, 0.6, 0.7, 0.2):
        ctl.update(e)
        coefs.append(ctl.coef)
        alphas.append(ctl.value)
    assert coefs == pytest.approx([0.015, 0.02, 0.02, 0.015, 0.01, 0.015], abs=1e-12)
    assert alphas == pytest.approx([0.015, 0.02, 0.02, 0.0, 0.0, 0.015], abs=1e-12)


def test_adaptive_coefficient_is_clipped_at_zero_and_equality_counts_as_not_below():
    ctl = AdaptiveEntropyController(0.004, target=0.5, delta=0.005, coef_max=1.0)
    ctl.update(0.5)  # not below: down, 0.004 - 0.005 -> clipped to 0, gate closed
    assert (ctl.coef, ctl.value) == (0.0, 0.0)
    ctl.update(0.9)
    assert (ctl.coef, ctl.value) == (0.0, 0.0)
    ctl.update(0.1)
    assert ctl.coef == pytest.approx(0.005) and ctl.value == pytest.approx(0.005)


def test_fixed_controller_never_moves():
    ctl = FixedEntropyController(0.01)
    for e in (0.0, 10.0):
        ctl.update(e)
    assert ctl.value == 0.01 and not ctl.adaptive


def test_loop_state_saves_and_restores_the_adaptive_coefficient_and_its_gate():
    """LoopState carries the learner's controller (key `entropy_coef` of rank_<r>.pt), like the KL controller's β."""
    from rlcli.algos.kl import FixedKLController
    from rlcli.data import PromptStream
    from rlcli.loop.state import LoopState
    from rlcli.rollout.sampler import GroupSampler

    def fresh():
        return LoopState(prompts=PromptStream([{"prompt": "q", "answer": "1"}] * 4, 0, True, 0, 1),
                         sampler=GroupSampler(2, False, "acc", 1, False), kl_ctl=FixedKLController(0.0), next_group=0,
                         entropy_ctl=AdaptiveEntropyController(0.01, 0.5, 0.005, 0.1))

    s = fresh()
    for e in (0.4, 0.4, 0.9):  # 0.015, 0.02, then above: 0.015 with the gate closed
        s.entropy_ctl.update(e)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    t = fresh()
    t.load_state_dict(torch.load(buf, weights_only=False))
    assert t.entropy_ctl.coef == pytest.approx(0.015) and t.entropy_ctl.gate is False and t.entropy_ctl.value == 0.0
    t.entropy_ctl.update(0.1)
    assert t.entropy_ctl.value == pytest.approx(0.02)


def test_build_entropy_controller_is_adaptive_only_for_adaptive():
    from rlcli.algos.config import AlgoConfig

    assert not build_entropy_controller(AlgoConfig(entropy_coef=0.01)).adaptive
    ctl = build_entropy_controller(AlgoConfig(entropy_control="adaptive", entropy_target=0.2, entropy_coef=0.003))
    assert ctl.adaptive and (ctl.coef, ctl.target, ctl.delta, ctl.coef_max) == (0.003, 0.2, 0.005, 0.1)


# ----------------------------------------------------------------------------------------- Clip-Cov / KL-Cov


def test_token_covariance_of_the_hand_batch():
    torch.testing.assert_close(F.token_covariance(LOGP, ADV, MASK), COV, rtol=0, atol=1e-12)


def test_select_count_is_the_floor_of_ratio_times_tokens_at_least_one():
    assert [F.cov_select_count(n, r) for n, r in ((5, 0.4), (5, 0.5), (5, 1e-4), (10_000, 2e-4), (0, 0.5))] == \
        [2, 2, 1, 2, 0]


def test_clip_cov_draws_only_from_the_band_and_never_a_masked_token():
    # band [1, 5]: cov 4, 2 (row 0) and 3 (row 1); 6 is above it, 0 below. Ratio 1 -> min(5, 3 candidates) = 3.
    sel = F.clip_cov_select(COV, MASK, ratio=1.0, lb=1.0, ub=5.0, generator=torch.Generator().manual_seed(0))
    assert cells(sel) == {(0, 0), (0, 1), (1, 0)}
    # band [-1, 5] holds 0 as well: (0, 2) joins, the masked token (its cov is set to 0) must not.
    sel = F.clip_cov_select(COV, MASK, ratio=1.0, lb=-1.0, ub=5.0, generator=torch.Generator().manual_seed(0))
    assert cells(sel) == {(0, 0), (0, 1), (1, 0), (0, 2)}
    # ratio 0.5: floor(2.5) = 2 of the 3 candidates, drawn by the seeded generator: the same draw for the same seed
    draws = [cells(F.clip_cov_select(COV, MASK, 0.5, 1.0, 5.0, torch.Generator().manual_seed(s))) for s in range(8)]
    assert all(len(d) == 2 and d <= {(0, 0), (0, 1), (1, 0)} for d in draws)
    assert draws == [cells(F.clip_cov_select(COV, MASK, 0.5, 1.0, 5.0, torch.Generator().manual_seed(s)))
                     for s in range(8)]
    assert len({frozenset(d) for d in draws}) > 1  # the draw is random across seeds


def test_kl_cov_picks_the_largest_covariances_and_never_a_masked_token():
    assert cells(F.kl_cov_select(COV, MASK, 0.2)) == {(1, 1)}  # k = 1: cov 6
    assert cells(F.kl_cov_select(COV, MASK, 0.4)) == {(1, 1), (0, 0)}  # k = 2: cov 6 and 4
    assert cells(F.kl_cov_select(COV, MASK, 1.0)) == {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)}  # all 5, not (1, 2)
    loud = COV.clone()
    loud[1, 2] = 100.0  # whatever a caller leaves at a masked position, it is never picked
    assert cells(F.kl_cov_select(loud, MASK, 0.2)) == {(1, 1)}
    assert cells(F.clip_cov_select(torch.where(MASK.bool(), COV, torch.tensor(3.0, dtype=D)), MASK, 1.0, 1.0, 5.0)) == \
        {(0, 0), (0, 1), (1, 0)}
    # from the raw batch: the masked token (99, 50) would have the largest covariance if the mask were dropped
    _, m = F.cov_controlled_loss(torch.zeros_like(LOGP), LOGP, LOGP, ADV, MASK, mode="kl_cov", ratio=0.2)
    assert m["cov_selected_frac"].item() == pytest.approx(0.2) and m["cov_mean"].item() == pytest.approx(15 / 5)


def surrogate_and_grad(mode, old_shift=0.0, **kw):
    """The clipped surrogate of the hand batch after `mode`, summed over loss tokens, and d/dlogp."""
    logp = LOGP.clone().requires_grad_(True)
    old = LOGP - old_shift
    loss_mat, _ = F.clipped_policy_loss(logp, old, ADV, MASK)
    if mode != "none":
        loss_mat, _ = F.cov_controlled_loss(loss_mat, logp, old, ADV, MASK, mode=mode, **kw)
    (loss_mat * MASK).sum().backward()
    return loss_mat.detach(), logp.grad


def test_clip_cov_tokens_get_no_policy_gradient_and_the_others_keep_theirs():
    # on-policy (ρ = 1): d(-A·ρ)/dlogp = -A on every loss token
    _, g = surrogate_and_grad("clip_cov", ratio=1.0, lb=1.0, ub=5.0, generator=torch.Generator().manual_seed(0))
    want = torch.tensor([[0.0, 0.0, -2.0], [0.0, 3.0, 0.0]], dtype=D)  # band tokens cut; (0,2) and (1,1) keep -A
    torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def test_kl_cov_adds_beta_abs_log_ratio_on_the_selected_tokens_only():
    # old = logp - 0.1: |logp - old| = 0.1 and d|.|/dlogp = +1 on the selected tokens (cov 6 and 4 at ratio 0.4)
    base, g0 = surrogate_and_grad("none", old_shift=0.1)
    loss, g = surrogate_and_grad("kl_cov", old_shift=0.1, ratio=0.4, kl_coef=0.5)
    sel = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=D)
    torch.testing.assert_close((loss - base) * MASK, 0.5 * 0.1 * sel, rtol=0, atol=1e-12)
    torch.testing.assert_close(g - g0, 0.5 * sel, rtol=0, atol=1e-12)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum_const"])
def test_clip_cov_composes_with_every_aggregation(agg):
    """The cut tokens are 0 in the loss matrix and still in the normalizer: the aggregate is the uncut one minus
    their share."""
    base, _ = surrogate_and_grad("none")
    cut, _ = surrogate_and_grad("clip_cov", ratio=1.0, lb=1.0, ub=5.0, generator=torch.Generator().manual_seed(0))
    keep = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=D)
    kw = dict(num_tokens=5.0, num_seqs=2.0, max_len=3)
    torch.testing.assert_close(F.aggregate(cut, MASK, agg, **kw), F.aggregate(base * keep, MASK, agg, **kw))


# ----------------------------------------------------------------------------------------- validation


def algo(**overrides):
    from rlcli.algos.config import AlgoConfig

    cfg = OmegaConf.structured(AlgoConfig)
    with open_dict(cfg):
        for k, v in overrides.items():
            cfg[k] = v
    return cfg


@pytest.mark.parametrize("overrides, words", [
    ({"entropy_target": 0.2}, "algo.entropy_target=0.2 is read only by algo.entropy_control=adaptive"),
    ({"entropy_control": "adaptive"}, "needs algo.entropy_target"),
    ({"entropy_control": "adaptive", "entropy_target": 0.2, "entropy_coef": 0.5}, "algo.entropy_coef_max"),
    ({"entropy_control": "clip_cov", "policy_loss": "gspo"}, "algo.policy_loss=gspo has one ratio per sequence"),
    ({"entropy_control": "kl_cov", "policy_loss": "gspo"}, "algo.policy_loss=gspo has one ratio per sequence"),
    ({"kl_cov_ratio": 0.01, "entropy_control": "clip_cov"}, "read only by algo.entropy_control=kl_cov"),
    ({"clip_cov_lb": 6.0}, "read only by algo.entropy_control=clip_cov"),
    ({"entropy_control": "clip_cov", "clip_cov_lb": 6.0}, "must be <= algo.clip_cov_ub=5.0"),
    ({"top_entropy_quantile": 0.2, "policy_loss": "gspo"}, "algo.policy_loss=gspo has one ratio per sequence"),
])
def test_senseless_combinations_are_refused_in_one_line_with_the_fix(overrides, words):
    from rlcli.algos.config import validate

    with pytest.raises(ConfigError) as e:
        validate(algo(**overrides))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_documented_combinations_validate():
    from rlcli.algos.config import validate

    for overrides in ({"entropy_control": "adaptive", "entropy_target": 0.2},
                      {"entropy_control": "clip_cov", "policy_loss": "cispo"},
                      {"entropy_control": "kl_cov", "kl_cov_ratio": 2e-4, "entropy_coef": 0.001}):
        validate(algo(**overrides))


def test_explain_lists_the_entropy_control_keys():
    from rlcli.config import CONF_DIR
    from rlcli.schema_doc import explain

    text = explain("algo", CONF_DIR)
    for key in ("entropy_control", "entropy_target", "entropy_coef_delta", "entropy_coef_max", "clip_cov_ratio",
                "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef"):
        assert f"algo.{key} " in text, key
    assert "one of: none, adaptive, clip_cov, kl_cov" in text


# ----------------------------------------------------------------------------------------- top_entropy_quantile

# entropies of the hand batch's tokens; the masked one (9.0) is the largest, so a selection ignoring the mask takes it
ENT = torch.tensor([[0.5, 2.0, 1.0], [3.0, 2.0, 9.0]], dtype=D)


@pytest.mark.parametrize("rho, kept", [
    (0.1, {(1, 0)}),                          # ⌈0.5⌉ = 1: at least one token
    (0.2, {(1, 0)}),                          # ⌈0.2·5⌉ = 1: the largest, 3.0
    (0.3, {(1, 0), (0, 1), (1, 1)}),          # ⌈1.5⌉ = 2 (not ⌊1.5⌋ = 1): threshold 2.0
    (0.4, {(1, 0), (0, 1), (1, 1)}),          # ⌈0.4·5⌉ = 2: threshold 2.0, both tokens of 2.0 kept (a tie)
    (0.5, {(1, 0), (0, 1), (1, 1)}),          # ⌈2.5⌉ = 3: threshold 2.0
    (0.8, {(1, 0), (0, 1), (1, 1), (0, 2)}),  # ⌈4⌉ = 4: threshold 1.0
    (1.0, {(1, 0), (0, 1), (1, 1), (0, 2), (0, 0)}),
])
def test_top_entropy_mask_keeps_the_ceil_rho_n_highest_loss_tokens_and_their_ties(rho, kept):
    assert cells(F.top_entropy_mask(ENT, MASK, rho)) == kept


def test_top_entropy_tokens_keep_their_policy_loss_and_the_rest_get_no_gradient_but_count(make_trainer):
    """Through micro_loss (token_mean over one micro-batch): with ρ = 0.5 the policy loss equals the full loss
    matrix's sum over the kept tokens divided by ALL loss tokens (the normalizer unchanged), and actor/entropy_kept_frac
    is the kept share; ρ = 1 is the plain loss."""
    from rlcli.algos.losses import POLICY_LOSSES
    from rlcli.loop.learner import rl_phase
    from rlcli.loop.metrics import Timer
    from rlcli.models import response_outputs

    t = make_trainer("algo.loss_agg=token_mean", "hw.micro_batch=64", "algo.top_entropy_quantile=0.5")
    phase = rl_phase(t.cfg)
    batch, _ = t.collect(Timer(), 1)
    batch = batch.replace(**t.learner.score(batch, 1, phase))
    batch, _ = t.advantage(batch, 1, phase)
    norms = t.learner.normalizers(batch)
    with torch.no_grad():
        loss, m = t.learner.micro_loss(batch, norms, 0.0)
        logp, entropy, _ = response_outputs(t.learner.actor.module, batch.prompt_ids, batch.prompt_mask,
                                            batch.response_ids, batch.token_mask, t.cfg.rollout.temperature,
                                            with_entropy=True, share=t.learner.share)
    mask = batch.loss_mask
    full, _ = POLICY_LOSSES[t.cfg.algo.policy_loss](logp, logp, batch.advantages, mask, t.cfg.algo)
    keep = F.top_entropy_mask(entropy, mask, 0.5)
    n = mask.sum()
    assert 0.5 <= keep.sum() / n < 0.6
    assert m["actor/pg_loss"] == pytest.approx(((full * keep).sum() / n).item(), rel=1e-5, abs=1e-7)
    assert m["actor/entropy_kept_frac"] == pytest.approx((keep.sum() / n).item(), rel=1e-6)
    assert m["actor/pg_loss"] != pytest.approx(((full * mask).sum() / n).item(), rel=1e-3)  # the cut changed the loss


# ----------------------------------------------------------------------------------------- through the trainer


def test_adaptive_runs_logs_alpha_and_a_resume_restores_it(make_trainer):
    """The tiny model's entropy (≤ log of its vocabulary) is always below a target of 100 nats: α goes up by Δ after
    every step. A checkpoint after step 1 holds c = 0.015; the trainer resumed from it uses α = 0.015 in step 2."""
    t = make_trainer("algo.entropy_control=adaptive", "algo.entropy_target=100", "algo.entropy_coef=0.01")
    m = t.train_step(1)
    assert m["actor/entropy_coef"] == pytest.approx(0.01) and math.isfinite(m["actor/entropy"])
    assert t.state.entropy_ctl is t.learner.entropy_ctl and t.state.entropy_ctl.value == pytest.approx(0.015)
    t.state.end_step(1, m, 1, 3)
    path = t.save_checkpoint()
    r = make_trainer("algo.entropy_control=adaptive", "algo.entropy_target=100", "algo.entropy_coef=0.01",
                     f"resume={path}", run="resumed")
    assert r.state.step == 1 and r.learner.entropy_ctl.value == pytest.approx(0.015)
    assert r.train_step(2)["actor/entropy_coef"] == pytest.approx(0.015)
    assert r.learner.entropy_ctl.value == pytest.approx(0.02)


@pytest.mark.parametrize("mode, extra", [
    ("clip_cov", ["algo.clip_cov_ratio=0.05", "algo.clip_cov_lb=-100", "algo.clip_cov_ub=100"]),
    ("kl_cov", ["algo.kl_cov_ratio=0.05", "algo.mini_batches=2"]),
])
def test_one_step_of_each_covariance_control_runs_and_logs(make_trainer, mode, extra):
    from metric_names import undocumented

    t = make_trainer(f"algo.entropy_control={mode}", *extra)
    m = t.train_step(1)
    assert 0 < m["actor/cov_selected_frac"] <= 0.06 and math.isfinite(m["actor/cov_mean"]), m
    assert math.isfinite(m["actor/pg_loss"]) and "actor/entropy_coef" not in m
    assert not undocumented(["actor/cov_selected_frac", "actor/cov_mean", "actor/entropy_coef"])


def test_the_update_loss_carries_the_controllers_alpha(make_trainer):
    """micro_loss subtracts α·aggregate(H) with α the controller's current value (not algo.entropy_coef): with
    token_mean aggregation over one micro-batch, loss(α) - loss(0) = -α·actor/entropy."""
    from rlcli.loop.learner import rl_phase
    from rlcli.loop.metrics import Timer

    t = make_trainer("algo.entropy_control=adaptive", "algo.entropy_target=100", "algo.entropy_coef=0.01",
                     "algo.loss_agg=token_mean", "hw.micro_batch=64")
    phase = rl_phase(t.cfg)
    batch, _ = t.collect(Timer(), 1)
    batch = batch.replace(**t.learner.score(batch, 1, phase))
    batch, _ = t.advantage(batch, 1, phase)
    norms = t.learner.normalizers(batch)
    t.learner.entropy_ctl.coef = 0.7
    with torch.no_grad():
        loss0, m0 = t.learner.micro_loss(batch, norms, 0.0)
        loss, _ = t.learner.micro_loss(batch, norms)
    assert (loss - loss0).item() == pytest.approx(-0.7 * m0["actor/entropy"], rel=1e-5)


@pytest.mark.parametrize("mode, extra", [
    ("clip_cov", ["algo.clip_cov_ratio=0.3", "algo.clip_cov_lb=-100", "algo.clip_cov_ub=100"]),
    ("kl_cov", ["algo.kl_cov_ratio=0.3", "algo.mini_batches=2"]),
])
def test_observation_tokens_are_never_selected_and_get_no_gradient(make_trainer, monkeypatch, mode, extra):
    """A multi-turn batch (tests/test_envs.py: tool results at response positions OBS carry loss mask 0): the tokens
    the learner's Clip-Cov / KL-Cov select are loss tokens, ⌊0.3·n⌋ of them, and the logits at OBS get no gradient."""
    from test_envs import OBS, multi_turn_batch, retain_output

    from rlcli.loop.learner import rl_phase
    from rlcli.rollout.shaping import shape

    picked = []
    select = getattr(F, f"{mode}_select")
    monkeypatch.setattr(F, f"{mode}_select", lambda *a, **k: picked.append(select(*a, **k)) or picked[-1])
    t = make_trainer("algo=grpo", "hw.logits_chunk=0", f"algo.entropy_control={mode}", *extra)
    learner, phase = t.learner, rl_phase(t.cfg)
    b, _ = shape(multi_turn_batch(t.tokenizer.pad_token_id), t.cfg.algo, t.cfg.rollout)
    b = b.replace(**learner.score(b, 1, phase))
    b, _ = t.advantage(b, 1, phase)
    norms = learner.normalizers(b)
    outs: list = []
    handle = retain_output(learner.actor.module.get_output_embeddings(), outs)
    try:
        loss, m = learner.micro_loss(b, norms)
        loss.backward()
    finally:
        handle.remove()
    (sel,) = picked
    n = int(b.loss_mask.sum())
    assert int(sel.sum()) == int(0.3 * n)  # clip_cov: the band [-100, 100] holds every loss token
    assert sel.sum() > 0 and not sel[:, OBS].any() and not (sel & ~b.loss_mask.bool()).any()
    assert m["actor/cov_selected_frac"] == pytest.approx(float(sel.sum()) / n)
    grad = outs[0].grad[:, 5 - 1 : -1].abs().sum(-1)  # [N, T] at the state before each response token
    assert grad[:, OBS].sum() == 0
