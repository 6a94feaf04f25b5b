"""GSPO, CISPO and rollout-correction weights: hand-computed golden values and gradients, the
registry entries, validation and the conf/algo presets.

Run: pytest -q tests/test_objectives.py (CPU, seconds). Every expected number below is worked out in
the comments; the decimals are exp() of the stated log ratios.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONF, compose

from rlcli.algos import POLICY_LOSSES, AlgoConfig
from rlcli.algos import functional as F
from rlcli.algos.config import validate as validate_algo
from rlcli.config import validate as validate_config

D = torch.float64
NAN = float("nan")


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D), rtol=0, atol=atol
    )


def two_rows(row1_old_t1: float):
    """N=2, T=3; row 1 is padded at t=2, where logp is NaN (garbage must not leak).

    log ratios logp - old: row 0 = [0.3, -0.1, 0.1]; row 1 = [0.5, -1.2 - row1_old_t1, pad].
    """
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.5, -1.2, NAN]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1.3, -1.9, -0.6], [-1.0, row1_old_t1, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return logp, old, mask


def adv(a0: float, a1: float) -> torch.Tensor:
    """GRPO-style advantages: one value per sequence broadcast over its tokens, [2, 3]."""
    return torch.tensor([[a0] * 3, [a1] * 3], dtype=D)


# ---------------------------------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------------------------------


def test_gspo_values_gradients_and_clipfrac():
    # Row 0: mean log ratio (0.3 - 0.1 + 0.1)/3 = 0.1  -> s0 = e^0.1 = 1.1051709, A = +1:
    #   in [0.8, 1.2] -> unclipped, ℓ = -1·1.1051709 on each of 3 tokens, ∂ℓ/∂logp_t = -A·s0 = -1.1051709.
    # Row 1: mean log ratio (0.5 + 0.3)/2 = 0.4       -> s1 = e^0.4 = 1.4918247, A = +2:
    #   > 1.2 and A > 0 -> clipped, ℓ = -2·1.2 = -2.4 on its 2 tokens, gradient 0.
    logp, old, mask = two_rows(-1.5)
    loss, m = F.gspo_policy_loss(logp, old, adv(1.0, 2.0), mask, clip_low=0.2, clip_high=0.2)
    s0 = 1.1051709180756477
    close(loss, [[-s0, -s0, -s0], [-2.4, -2.4, 0.0]])
    loss.sum().backward()
    close(logp.grad, [[-s0, -s0, -s0], [0.0, 0.0, 0.0]])
    close(m["pg_clipfrac"], 2 / 5)  # row 1's two tokens of 5 valid
    close(m["pg_clipfrac_high"], 2 / 5)
    close(m["pg_clipfrac_low"], 0.0)
    close(m["ppo_kl"], -(0.3 - 0.1 + 0.1 + 0.5 + 0.3) / 5)  # mean(old - logp) = -0.22
    assert all(not v.requires_grad for v in m.values())


def test_gspo_negative_advantage_keeps_gradient_above_the_band():
    # Same ratios, A = (-1, -2). Row 0: -A·s0 = 1.1051709 = -A·clip(s0) (inside the band) -> not
    # clipped, gradient -A·s0 = +1.1051709. Row 1: -A·s1 = 2·1.4918247 = 2.9836494 > -A·1.2 = 2.4
    # -> the unclipped branch wins (PPO's pessimism), gradient -A·s1 = +2.9836494.
    logp, old, mask = two_rows(-1.5)
    loss, m = F.gspo_policy_loss(logp, old, adv(-1.0, -2.0), mask, clip_low=0.2, clip_high=0.2)
    s0, two_s1 = 1.1051709180756477, 2.9836493952825407
    close(loss, [[s0, s0, s0], [two_s1, two_s1, 0.0]])
    loss.sum().backward()
    close(logp.grad, [[s0, s0, s0], [two_s1, two_s1, 0.0]])
    close(m["pg_clipfrac"], 0.0)


def test_gspo_aggregated_gradient_is_the_sequence_level_gspo_gradient():
    # With seq_mean_token_mean over 2 sequences, each token of o_0 gets -A0·s0/|o_0|/2
    # = -1.1051709/3/2 = -0.1841952 (the paper's s_i·A_i/|o_i| per token, negated for a loss);
    # o_1 is clipped -> 0.
    logp, old, mask = two_rows(-1.5)
    loss, _ = F.gspo_policy_loss(logp, old, adv(1.0, 2.0), mask, clip_low=0.2, clip_high=0.2)
    F.aggregate(loss, mask, "seq_mean_token_mean").backward()
    g = 0.18419515301260794
    close(logp.grad, [[-g, -g, -g], [0.0, 0.0, 0.0]])

    # The same gradient from the sequence-level objective with s_i differentiated through its mean:
    # J = (1/2) Σ_i max(-A_i·s_i, -A_i·clip(s_i)), s_i = exp(mean_t (logp - old)).
    logp2, old2, _ = two_rows(-1.5)
    lr = torch.where(mask, logp2 - old2, torch.zeros_like(old2))
    s = torch.exp(lr.sum(-1) / mask.sum(-1))  # [2]
    a = torch.tensor([1.0, 2.0], dtype=D)
    torch.maximum(-a * s, -a * s.clamp(0.8, 1.2)).mean().backward()
    close(logp.grad, logp2.grad, atol=1e-12)


def test_gspo_paper_defaults_and_log_ratio_clamp():
    # Defaults 3e-4 / 4e-4: s = e^0.0002 = 1.0002 is inside [0.9997, 1.0004]; s = e^0.001 is above.
    logp = torch.tensor([[0.0002, 0.0002], [0.001, 0.001]], dtype=D, requires_grad=True)
    _, m = F.gspo_policy_loss(logp, torch.zeros(2, 2, dtype=D), torch.ones(2, 2, dtype=D), torch.ones(2, 2))
    close(m["pg_clipfrac"], 0.5)
    # Mean log ratio 12 > 10 -> s = e^10 = 22026.4658; A = -1 takes the unclipped branch, value
    # -A·e^10, and the clamp (on the combined log ratio, as verl) leaves no gradient.
    logp = torch.tensor([[12.0, 12.0]], dtype=D, requires_grad=True)
    loss, _ = F.gspo_policy_loss(
        logp, torch.zeros(1, 2, dtype=D), -torch.ones(1, 2, dtype=D), torch.ones(1, 2)
    )
    close(loss, [[22026.465794806718, 22026.465794806718]], atol=1e-6)
    loss.sum().backward()
    close(logp.grad, [[0.0, 0.0]])


# ---------------------------------------------------------------------------------------------------
# CISPO
# ---------------------------------------------------------------------------------------------------


def test_cispo_values_and_gradients_keep_clipped_tokens():
    # Bounds [1 - 0.2, 1 + 0.28] = [0.8, 1.28]. Token ratios ρ = e^(logp - old):
    #   row 0 (A = +1): e^0.3 = 1.3498588 -> w 1.28 (clipped high); e^-0.1 = 0.9048374; e^0.1 = 1.1051709
    #   row 1 (A = -2): e^0.5 = 1.6487213 -> w 1.28 (clipped high); e^-0.4 = 0.6703200 -> w 0.8 (low)
    # ℓ = -w·A·logp:
    #   row 0: -1.28·1·(-1.0) = 1.28; -0.9048374·(-2.0) = 1.8096748; -1.1051709·(-0.5) = 0.5525855
    #   row 1: -1.28·(-2)·(-0.5) = -1.28; -0.8·(-2)·(-1.2) = -1.92; pad 0
    # ∂ℓ/∂logp = -w·A, also on the clipped tokens (the point of CISPO):
    #   row 0: -1.28, -0.9048374, -1.1051709;  row 1: 2.56, 1.6, 0
    logp, old, mask = two_rows(-0.8)
    loss, m = F.cispo_policy_loss(logp, old, adv(1.0, -2.0), mask.to(D), clip_low=0.2, clip_high=0.28)
    w01, w02 = 0.9048374180359595, 1.1051709180756477
    close(loss, [[1.28, 2 * w01, 0.5 * w02], [-1.28, -1.92, 0.0]])
    loss.sum().backward()
    close(logp.grad, [[-1.28, -w01, -w02], [2.56, 1.6, 0.0]])
    close(m["pg_clipfrac"], 3 / 5)  # (0,0), (1,0) above 1.28; (1,1) below 0.8
    close(m["pg_clipfrac_high"], 2 / 5)
    close(m["pg_clipfrac_low"], 1 / 5)
    close(m["ppo_kl"], -(0.3 - 0.1 + 0.1 + 0.5 - 0.4) / 5)  # -0.08

    # The PPO clipped surrogate gives the clipped token (0, 0) (ρ 1.35 > 1.28, A > 0) no gradient.
    logp_ppo, _, _ = two_rows(-0.8)
    ppo, _ = F.clipped_policy_loss(logp_ppo, old, adv(1.0, -2.0), mask, clip_low=0.2, clip_high=0.28)
    ppo.sum().backward()
    assert logp_ppo.grad[0, 0] == 0 and logp.grad[0, 0] != 0


def test_cispo_defaults_have_no_lower_bound():
    # Defaults clip_low = 1.0 (lower bound 0), clip_high = 0.28: token (1, 1) with ρ = e^-0.4 = 0.6703200
    # keeps its weight, gradient -w·A = -0.6703200·(-2) = 1.3406401; (0,0) and (1,0) are still capped at 1.28.
    logp, old, mask = two_rows(-0.8)
    loss, m = F.cispo_policy_loss(logp, old, adv(1.0, -2.0), mask)
    loss.sum().backward()
    close(logp.grad, [[-1.28, -0.9048374180359595, -1.1051709180756477], [2.56, 1.3406400920712786, 0.0]])
    close(m["pg_clipfrac"], 2 / 5)
    close(m["pg_clipfrac_low"], 0.0)


# ---------------------------------------------------------------------------------------------------
# Rollout correction (trainer vs sampler importance weights)
# ---------------------------------------------------------------------------------------------------

# log ratios (trainer - sampler): row 0 = [0.5, -0.2, 1.0], row 1 = [0.3, -2.0, pad (NaN)].
# exp: e^0.5 = 1.6487213, e^-0.2 = 0.8187308, e^1 = 2.7182818, e^0.3 = 1.3498588, e^-2 = 0.1353353.
# Sequence sums: row 0 = 1.3 -> e^1.3 = 3.6692967; row 1 = -1.7 -> e^-1.7 = 0.1826835.
LOG_RATIO = [[0.5, -0.2, 1.0], [0.3, -2.0, NAN]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def correction(**kwargs):
    log_ratio = torch.tensor(LOG_RATIO, dtype=D, requires_grad=True)
    w, m = F.rollout_correction_weights(log_ratio, torch.tensor(MASK, dtype=D), **kwargs)
    assert not w.requires_grad and all(not v.requires_grad for v in m.values())
    return w, m


def test_decoupled_ppo_values_gradients_and_weights():
    """AReaL's decoupled loss by hand, one row of 3 tokens and a padded 4th (NaN there must not leak).
    r = exp(logp - prox) = [1.5, 0.7, 1.0], A = [1, -1, 2], w = exp(prox - behav) = [1, 2, 0.5], clip 0.2 / 0.28:
      t0: max(-1.5, -clip(1.5) = -1.28) = -1.28 (clipped), x w 1   -> -1.28, gradient 0
      t1: max(0.7, 0.8) = 0.8 (clipped), x w 2                       ->  1.6,  gradient 0
      t2: max(-2, -2) = -2 (inside the band), x w 0.5                 -> -1.0,  gradient -A·r·w = -1.0
    With behav_weight_cap = 1.5, t1's weight 2 exceeds it: its loss is 0."""
    import math

    prox = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=D)
    logp = torch.tensor([[math.log(1.5), math.log(0.7), 0.0, NAN]], dtype=D, requires_grad=True)
    behav = torch.tensor([[0.0, -math.log(2.0), math.log(2.0), 0.0]], dtype=D)
    a = torch.tensor([[1.0, -1.0, 2.0, 5.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, m = F.decoupled_policy_loss(logp, prox, behav, a, mask, clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.28, 1.6, -1.0, 0.0]])
    close(m["pg_clipfrac"], 2 / 3)
    close(m["behav_weight_mean"], (1 + 2 + 0.5) / 3)
    loss.sum().backward()
    close(logp.grad, [[0.0, 0.0, -1.0, 0.0]])

    capped, m = F.decoupled_policy_loss(logp, prox, behav, a, mask, clip_low=0.2, clip_high=0.28, behav_weight_cap=1.5)
    close(capped, [[-1.28, 0.0, -1.0, 0.0]])
    close(m["behav_weight_mean"], (1 + 0 + 0.5) / 3)
    close(m["behav_weight_capped_frac"], 1 / 3)


def test_decoupled_ppo_with_the_behaviour_policy_as_proximal_is_clipped_ppo():
    """prox = behav: every weight is 1, so the loss and its gradient are clipped_policy_loss's."""
    logp, old, mask = two_rows(-1.0)
    a = adv(1.0, -2.0)
    loss, m = F.decoupled_policy_loss(logp, old, old, a, mask, clip_low=0.2, clip_high=0.28)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    ppo, pm = F.clipped_policy_loss(logp, old, a, mask, clip_low=0.2, clip_high=0.28)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), logp)
    close(loss, ppo)
    close(grad, ppo_grad)
    close(m["pg_clipfrac"], pm["pg_clipfrac"])
    close(m["behav_weight_mean"], 1.0)


def test_rollout_correction_token_level_truncation():
    # TIS, upper 2: e^1 = 2.718 -> 2 (1 of 5 valid tokens cut); padding 0.
    # mean (1.6487213 + 0.8187308 + 2 + 1.3498588 + 0.1353353)/5 = 5.9526461/5 = 1.1905292
    w, m = correction()  # defaults: level token, upper 2.0, lower None
    close(w, [[1.6487212707001282, 0.8187307530779818, 2.0], [1.3498588075760032, 0.1353352832366127, 0.0]])
    close(m["weight_mean"], 1.1905292229181452)
    close(m["weight_max"], 2.0)
    close(m["clipped_frac"], 1 / 5)


def test_rollout_correction_token_level_masking():
    # Masked IS, [0.5, 2]: e^1 = 2.718 > 2 -> 0, e^-2 = 0.135 < 0.5 -> 0; the rest untouched.
    # mean (1.6487213 + 0.8187308 + 1.3498588)/5 = 0.7634622, max 1.6487213, 2 of 5 cut.
    w, m = correction(level="token", upper=2.0, lower=0.5)
    close(w, [[1.6487212707001282, 0.8187307530779818, 0.0], [1.3498588075760032, 0.0, 0.0]])
    close(m["weight_mean"], 0.7634621662708226)
    close(m["weight_max"], 1.6487212707001282)
    close(m["clipped_frac"], 2 / 5)


def test_rollout_correction_sequence_level():
    # One weight per row: e^1.3 = 3.669 -> truncated to 2 on row 0's 3 tokens; e^-1.7 = 0.1826835 on
    # row 1's 2 tokens. mean (3·2 + 2·0.1826835)/5 = 1.2730734; 3 of 5 tokens cut.
    w, m = correction(level="sequence")
    r1 = 0.18268352405273466
    close(w, [[2.0, 2.0, 2.0], [r1, r1, 0.0]])
    close(m["weight_mean"], 1.2730734096210938)
    close(m["clipped_frac"], 3 / 5)
    # Masked at [0.2, 4]: row 0 (3.669) kept untruncated, row 1 (0.183 < 0.2) zeroed.
    w, m = correction(level="sequence", upper=4.0, lower=0.2)
    r0 = 3.6692966676192444
    close(w, [[r0, r0, r0], [0.0, 0.0, 0.0]])
    close(m["weight_max"], r0)
    close(m["clipped_frac"], 2 / 5)


def test_rollout_correction_clamps_and_rejects_unknown_levels():
    # log ratio 30 is clamped to 20 before exp: e^20 = 485165195.41 (upper=None: no truncation).
    w, _ = F.rollout_correction_weights(torch.tensor([[30.0, 0.0]], dtype=D), torch.ones(1, 2), upper=None)
    close(w, [[485165195.4097903, 1.0]], atol=1e-3)
    with pytest.raises(ValueError, match="valid levels: token, sequence"):
        F.rollout_correction_weights(torch.zeros(1, 2), torch.ones(1, 2), level="geometric")


# ---------------------------------------------------------------------------------------------------
# Registry, validation, presets
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "fn"), [("gspo", F.gspo_policy_loss), ("cispo", F.cispo_policy_loss)])
def test_registry_entries_read_clip_bounds_from_cfg(name, fn):
    g = torch.Generator().manual_seed(3)
    logp, old, a = (torch.randn(3, 4, generator=g, dtype=D) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    cfg = AlgoConfig(policy_loss=name, clip_low=0.1, clip_high=0.3)
    validate_algo(cfg)
    loss, metrics = POLICY_LOSSES[name](logp, old, a, mask, cfg)
    ref, ref_metrics = fn(logp, old, a, mask, clip_low=0.1, clip_high=0.3)
    torch.testing.assert_close(loss, ref)
    assert metrics.keys() == ref_metrics.keys() and "pg_clipfrac" in metrics and "ppo_kl" in metrics


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("gspo", dict(name="gspo", adv_estimator="grpo", policy_loss="gspo", clip_low=3e-4, clip_high=4e-4,
                      loss_agg="seq_mean_token_mean", kl_coef=0.0, mini_batches=4, ppo_epochs=1)),
        ("cispo", dict(name="cispo", adv_estimator="grpo", policy_loss="cispo", clip_low=1.0, clip_high=0.28,
                       loss_agg="token_mean", kl_coef=0.0, mini_batches=4, ppo_epochs=1)),
    ],
)  # fmt: skip
def test_presets_compose_to_the_paper_values(preset, expected):
    text = (CONF / "algo" / f"{preset}.yaml").read_text()
    assert text.startswith("#") and "arXiv:" in text.split("\nname:")[0], "header comment must cite the paper"
    for hw in ("cpu", "cpu_x2"):  # model=tiny: 16 prompts -> 16 or 8 per rank, divisible by 4
        cfg = compose(f"algo={preset}", f"hw={hw}")
        validate_config(cfg)
        for key, value in expected.items():
            assert cfg.algo[key] == value, f"{preset}.{key}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout_correction": "geometric"}, r"algo\.rollout_correction='geometric'.*none, token, sequence"),
        ({"rollout_correction_upper": 0.0}, r"algo\.rollout_correction_upper"),
        ({"rollout_correction_lower": 2.0}, r"algo\.rollout_correction_lower=2\.0"),  # not below upper 2
    ],
)
def test_validate_checks_rollout_correction(overrides, message):
    validate_algo(AlgoConfig(rollout_correction="sequence", rollout_correction_lower=0.5))
    with pytest.raises(ValueError, match=message):
        validate_algo(AlgoConfig(**overrides))
