"""Golden tests for rlcli.algos.functional: every number below is computed by hand in a comment.

Run: pytest -q tests/test_functional.py (CPU, < 5 s). The numbers are exact consequences of the
formulas in docs/algorithms.md; if one fails, the code changed the math — fix the code, not the number.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlcli.algos import functional as F

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, tol=1e-6):
    expected = t(expected) if not isinstance(expected, torch.Tensor) else expected
    torch.testing.assert_close(actual.to(D), expected.to(D), rtol=0, atol=tol)


# ---------------------------------------------------------------------------------------------------
# group advantages
# ---------------------------------------------------------------------------------------------------

# Non-contiguous, unsorted group ids: g7 = {0,2,3,5}, g3 = {1,4,7} (all equal), g42 = {6} (singleton).
SCORES = [1.0, 2.0, 0.0, 0.0, 2.0, 1.0, 5.0, 2.0]
GROUPS = [7, 3, 7, 7, 3, 7, 42, 3]


def test_grpo_group_advantages_golden():
    # g7: R = 1,0,0,1 -> mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503
    #     A = ±0.5 / (0.5773503 + 1e-6) = ±0.8660239
    # g3: 2,2,2 -> exactly 0 ; g42: singleton, mean 0 std 1 -> 5 / (1 + 1e-6) = 4.999995
    a = F.group_advantages(t(SCORES), torch.tensor(GROUPS))
    close(a, [0.8660239, 0.0, -0.8660239, -0.8660239, 0.0, 0.8660239, 4.999995, 0.0])
    assert a[[1, 4, 7]].eq(0).all()


def test_dr_grpo_group_advantages_golden():
    # no std: g7 -> R - 0.5 = ±0.5 ; g3 -> 0 ; singleton -> R - 0 = 5
    a = F.group_advantages(t(SCORES), torch.tensor(GROUPS), std_normalize=False)
    close(a, [0.5, 0.0, -0.5, -0.5, 0.0, 0.5, 5.0, 0.0], tol=1e-12)


def test_group_advantages_constant_group_exactly_zero_despite_rounding():
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004 in floats, /3 != 0.1: the result must still be exactly 0.
    for dtype in (torch.float32, torch.float64):
        scores = torch.full((3,), 0.1, dtype=dtype)
        for std_normalize in (True, False):
            a = F.group_advantages(scores, torch.zeros(3, dtype=torch.long), std_normalize=std_normalize)
            assert torch.equal(a, torch.zeros(3, dtype=dtype))
            assert torch.isfinite(a).all()


def test_group_advantages_accepts_integer_scores_and_empty_batch():
    a = F.group_advantages(torch.tensor([1, 0]), torch.tensor([5, 5]), std_normalize=False)
    close(a, [0.5, -0.5])
    assert F.group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_rloo_advantages_golden():
    # g0 = 1,0,0,1: A_0 = 1 - (0+0+1)/3 = 2/3, A_1 = 0 - (1+0+1)/3 = -2/3  (= 4/3 * (R - 0.5))
    # singleton 3 keeps R = 3 ; constant g2 = 2,2 -> 0
    a = F.rloo_advantages(t([1.0, 0.0, 0.0, 1.0, 3.0, 2.0, 2.0]), torch.tensor([0, 0, 0, 0, 9, 2, 2]))
    close(a, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 3.0, 0.0, 0.0], tol=1e-12)


def test_pkpo_advantages_golden_and_equal_to_the_subset_definition():
    # G = 4, k = 2, rows 0..3: R = 0, 1, 0.5, 1. C(4,2) = 6 pairs; A_i = Σ_{pairs ∋ i} (max - max of the other) / 6:
    #   row 0 (0): no pair's max rises -> 0; row 2 (0.5): only with row 0, +0.5 -> 0.5/6
    #   rows 1, 3 (1): with row 0 +1, with row 2 +0.5, with each other 0 -> 1.5/6 each (ties share)
    a = F.pkpo_advantages(t([0.0, 1.0, 0.5, 1.0]), torch.tensor([3, 3, 3, 3]), k=2)
    close(a, [0.0, 0.25, 0.5 / 6, 0.25], tol=1e-12)
    # binary, G = 8, k = 4, c = 2 correct: a correct row gets C(6,3)/C(8,4) = 20/70, an incorrect one 0
    b = F.pkpo_advantages(t([0, 1, 0, 0, 0, 1, 0, 0.0]), torch.zeros(8, dtype=torch.long), k=4)
    close(b, [0, 20 / 70, 0, 0, 0, 20 / 70, 0, 0], tol=1e-12)
    # k = G: only the best moves, by its margin over the second (C(G, G) = 1)
    close(F.pkpo_advantages(t([0.3, 0.9, 0.4]), torch.zeros(3, dtype=torch.long), k=3), [0, 0.5, 0], tol=1e-12)
    # the closed form equals the definition over every k-subset, for continuous rewards with ties, two groups
    import itertools

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (13,), generator=g).to(D) / 4  # ties on purpose
    groups = torch.tensor([0] * 7 + [1] * 6)
    for k in (2, 3, 5, 6):
        brute = torch.zeros(13, dtype=D)
        for rows in (range(7), range(7, 13)):
            for subset in itertools.combinations(rows, k):
                for i in subset:
                    others = max(float(scores[j]) for j in subset if j != i)
                    brute[i] += max(float(scores[j]) for j in subset) - others
            brute[list(rows)] /= math.comb(len(rows), k)
        close(F.pkpo_advantages(scores, groups, k=k), brute, tol=1e-12)
    close(F.pkpo_advantages(t([1.0, 0.0]), torch.zeros(2, dtype=torch.long), k=3), [0.0, 0.0])  # no 3-subset
    with pytest.raises(ValueError, match="pass_k >= 2"):
        F.pkpo_advantages(t([1.0, 0.0]), torch.zeros(2, dtype=torch.long), k=1)


def test_best_of_group_advantages_golden_and_others_exactly_zero():
    # R = 0.2, 1, 0.5, 0: the best (row 1) gets (1 - 0.5) / (std + 1e-6), std unbiased = 0.4349329...
    a = F.best_of_group_advantages(t([0.2, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 7.0]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 2]))
    close(a, [0.0, 1.1495998546932922, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], tol=1e-9)  # group 1: two best tie -> 0;
    # a group of one -> 0; every row but the best is exactly 0 (a copy that kept the others' values was the bug)
    assert int((a != 0).sum()) == 1
    close(F.best_of_group_advantages(t([0.2, 1.0, 0.5, 0.0]), torch.zeros(4, dtype=torch.long), std_normalize=False),
          [0.0, 0.5, 0.0, 0.0], tol=1e-12)


def test_maxrl_advantages_golden():
    # (R - mean)/mean per group: 1,0,0,0 (p = 1/4) -> 3, -1, -1, -1; 1,1,0,0 -> 1, 1, -1, -1;
    # nothing solved -> 0; all solved -> 0; 0.5, 1 (mean 0.75) -> -1/3, 1/3
    scores = t([1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0.5, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 4, 4])
    close(F.maxrl_advantages(scores, groups), [3, -1, -1, -1, 1, 1, -1, -1, 0, 0, 0, 0, -1 / 3, 1 / 3], tol=1e-12)


def test_rank_advantages_golden_with_ties():
    # group 0: R = 3,1,3,2 (G=4): ascending ranks 1->1, 2->2, the two 3s share (3+4)/2 = 3.5
    #   A = (rank - 2.5) / 2: 3 -> 0.5, 1 -> -0.75, 2 -> -0.25
    # group 5 (G=2): R = 0,1 -> ranks 1,2 -> (1-1.5)/1 = -0.5, +0.5 ; singleton -> (1-1)/0.5 = 0
    scores = t([3.0, 0.0, 1.0, 3.0, 7.0, 2.0, 1.0])
    groups = torch.tensor([0, 5, 0, 0, 8, 0, 5])
    close(F.rank_advantages(scores, groups), [0.5, -0.5, -0.75, 0.5, 0.0, -0.25, 0.5], tol=1e-12)


def test_weighted_baseline_advantages_golden():
    # group 0: R = 1,0 with w = 1,3 -> baseline (1*1 + 3*0)/4 = 0.25 -> A = 0.75, -0.25
    # singleton (w=2): baseline 0 -> 4 ; constant group -> 0
    a = F.weighted_baseline_advantages(
        t([1.0, 0.0, 4.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 2, 2]), t([1.0, 3.0, 2.0, 1.0, 5.0])
    )
    close(a, [0.75, -0.25, 4.0, 0.0, 0.0], tol=1e-12)


def test_hierarchical_advantages_golden():
    # R = 1,0 | 2,2, alpha = 0.5
    # local: group0 mean 0.5, unbiased std sqrt(0.5) = 0.7071068 -> ±0.5/0.7071078 = ±0.7071058; group1 -> 0
    # global: mean 1.25, deviations -0.25,-1.25,0.75,0.75, sum sq 2.75, std sqrt(2.75/3) = 0.9574271
    #   -> -0.2611162, -1.3055811, 0.7833486, 0.7833486
    # mix 0.5*local + 0.5*global -> 0.2229948, -1.0063434, 0.3916743, 0.3916743
    scores, groups = t([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1])
    close(F.hierarchical_advantages(scores, groups, 0.5), [0.2229948, -1.0063434, 0.3916743, 0.3916743])
    close(F.hierarchical_advantages(scores, groups, 1.0), F.group_advantages(scores, groups))


def test_hybrid_alpha_golden():
    # alpha(t) = a0 * exp(-kappa t / T)
    assert F.hybrid_alpha(0, 100, 1.0, 5.0) == 1.0
    assert F.hybrid_alpha(100, 100, 1.0, 5.0) == pytest.approx(0.006737947, abs=1e-9)  # e^-5
    assert F.hybrid_alpha(50, 100, 0.8, 2.0) == pytest.approx(0.2943036, abs=1e-7)  # 0.8 e^-1


def test_sequence_reweight_golden():
    # median of 10,20,40 is 20; alpha 0.5: (0.5)^-0.5 = 1.4142136, 1, 2^-0.5 = 0.7071068
    close(F.sequence_reweight(t([10.0, 20.0, 40.0]), 0.5), [1.4142136, 1.0, 0.7071068])
    # even count: median of 10,30 is 20; alpha 1: 2, 2/3
    close(F.sequence_reweight(torch.tensor([10, 30]), 1.0), [2.0, 2 / 3])


# ---------------------------------------------------------------------------------------------------
# whitening, returns, GAE
# ---------------------------------------------------------------------------------------------------


def test_masked_whiten_unbiased_variance_and_masked_zeros():
    # valid entries 1,2,3,4: mean 2.5, deviations ±1.5, ±0.5, sum sq 5, UNBIASED var 5/3
    # -> dev / sqrt(5/3 + 1e-8) = -1.1618950, -0.3872983, 0.3872983, 1.1618950 (biased var 1.25 would
    # give ±1.3416); masked entries (incl. a NaN) come back as 0
    x = t([[1.0, 2.0, 3.0, 100.0], [4.0, float("nan"), 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    out = F.masked_whiten(x, mask)
    close(out, [[-1.1618950, -0.3872983, 0.3872983, 0.0], [1.1618950, 0.0, 0.0, 0.0]])
    # shift_mean=False adds the mean 2.5 back on valid entries
    out = F.masked_whiten(x, mask.bool(), shift_mean=False)
    close(out, [[1.3381050, 2.1127017, 2.8872983, 0.0], [3.6618950, 0.0, 0.0, 0.0]])


# Ragged batch: row 0 three tokens, row 1 one token, row 2 has a masked hole at t=1 (skipped).
# Garbage (NaN, 7, 9) at masked positions must not leak.
NAN = float("nan")
GAE_R = [[0.0, 0.0, 1.0, NAN], [2.0, 0.0, 0.0, 0.0], [0.0, 7.0, 1.0, 7.0]]
GAE_V = [[0.5, 0.6, 0.7, NAN], [1.5, 9.0, 9.0, 9.0], [0.5, 9.0, 0.7, NAN]]
GAE_M = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 1, 0]]


def test_gae_golden_ragged_with_hole():
    # gamma 0.9, lambda 0.5 (gamma*lambda = 0.45)
    # row 0: d2 = 1 + 0.9*0 - 0.7 = 0.3 ; d1 = 0 + 0.9*0.7 - 0.6 = 0.03 ; d0 = 0.9*0.6 - 0.5 = 0.04
    #        A2 = 0.3 ; A1 = 0.03 + 0.45*0.3 = 0.165 ; A0 = 0.04 + 0.45*0.165 = 0.11425
    #        returns = A + V = 0.61425, 0.765, 1.0
    # row 1: d0 = 2 - 1.5 = 0.5 (V after the last token is 0) -> A 0.5, returns 2.0
    # row 2: next valid after t=0 is t=2: d2 = 1 - 0.7 = 0.3 ; d0 = 0.9*0.7 - 0.5 = 0.13
    #        A0 = 0.13 + 0.45*0.3 = 0.265 ; returns 0.765, 1.0
    adv, ret = F.gae(t(GAE_R), t(GAE_V), torch.tensor(GAE_M), gamma=0.9, lam=0.5)
    close(adv, [[0.11425, 0.165, 0.3, 0.0], [0.5, 0.0, 0.0, 0.0], [0.265, 0.0, 0.3, 0.0]], tol=1e-12)
    close(ret, [[0.61425, 0.765, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.765, 0.0, 1.0, 0.0]], tol=1e-12)


def test_gae_per_sequence_lambda():
    # two copies of row 0 with lambda 0.5 and 0: the second is the one-step TD error d_t
    r, v = t([GAE_R[0]] * 2), t([GAE_V[0]] * 2)
    m = torch.tensor([GAE_M[0]] * 2)
    adv, ret = F.gae(r, v, m, gamma=0.9, lam=t([0.5, 0.0]))
    close(adv, [[0.11425, 0.165, 0.3, 0.0], [0.04, 0.03, 0.3, 0.0]], tol=1e-12)
    close(ret[1], [0.54, 0.63, 1.0, 0.0], tol=1e-12)  # d + V


def test_gae_lambda_one_is_monte_carlo_minus_values():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(5, 8, generator=g, dtype=D)
    v = torch.randn(5, 8, generator=g, dtype=D)
    lengths = torch.tensor([8, 3, 1, 0, 6])
    m = torch.arange(8)[None, :] < lengths[:, None]
    adv, ret = F.gae(r, v, m, gamma=0.95, lam=1.0)
    mc = F.discounted_returns(r, m, gamma=0.95)
    close(adv, torch.where(m, mc - v, 0.0), tol=1e-10)
    close(ret, mc, tol=1e-10)


def test_discounted_returns_golden():
    # row 0, gamma 0.9, outcome 1 at t=2: 0.81, 0.9, 1 ; row 1, gamma 1 -> use a second call
    r = t([[0.0, 0.0, 1.0, 5.0], [-0.1, -0.1, 1.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    close(F.discounted_returns(r, m, 0.9)[0], [0.81, 0.9, 1.0, 0.0], tol=1e-12)
    # gamma 1 with a -0.1 KL penalty per token: 1 - 0.2 = 0.8, 1 - 0.1 = 0.9, 1, 0
    close(F.discounted_returns(r, m, 1.0)[1], [0.8, 0.9, 1.0, 0.0], tol=1e-12)


def test_length_adaptive_lambda_golden():
    # 1 - 1/(0.05 l): l=10 -> -1 -> clamped 0 ; l=100 -> 0.8 ; l=20 -> 0 ; l=0 -> -inf -> 0 ;
    # l=1000 -> 0.98 ; l=1e9 -> 1 - 2e-8, above the cap 1 - 1e-6
    lam = F.length_adaptive_lambda(t([10.0, 100.0, 20.0, 0.0, 1000.0, 1e9]), alpha=0.05)
    close(lam, [0.0, 0.8, 0.0, 0.0, 0.98, 1 - 1e-6], tol=1e-12)
    assert (F.length_adaptive_lambda(torch.tensor([10, 100]), 0.05) < 1).all()


# ---------------------------------------------------------------------------------------------------
# shaping, KL, entropy
# ---------------------------------------------------------------------------------------------------


def test_soft_overlong_penalty_golden():
    # L_max 20, L_c 4 -> expected length 16: l <= 16 -> 0 ; 17 -> (16-17)/4 = -0.25 ; 18 -> -0.5 ;
    # 20 (buffer end) -> -1 ; 21 (beyond) -> -1
    lengths = torch.tensor([10, 16, 17, 18, 20, 21])
    close(F.soft_overlong_penalty(lengths, 20, 4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(F.soft_overlong_penalty(lengths, 20, 4, penalty_factor=2.0), [0, 0, -0.5, -1.0, -2.0, -2.0])
    close(F.soft_overlong_penalty(lengths, 20, 0), [0.0] * 6)


def test_kl_estimators_golden():
    # logp = -1, -2 ; ref = -1.5, -1 ; ref - logp = -0.5, 1
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    close(F.kl_estimate(logp, ref, "k1"), [0.5, -1.0])  # logp - ref
    close(F.kl_estimate(logp, ref, "k2"), [0.125, 0.5])  # 0.5 * (0.5^2, 1^2)
    # k3 = e^d - d - 1: e^-0.5 + 0.5 - 1 = 0.1065307 ; e^1 - 2 = 0.7182818
    close(F.kl_estimate(logp, ref, "k3"), [0.1065307, 0.7182818])


def test_k3_clamping():
    # d = 2 -> e^2 - 3 = 4.3890561 (unclamped) ; d = 3 -> 16.09 -> clamped to 10 ;
    # d = -15 -> e^-15 + 14 = 14.0 -> clamped to 10 ; d = +inf (logp = -inf) -> input clamped to 20 -> 10
    # (without the input clamp e^inf - inf is NaN)
    logp = t([0.0, 0.0, 0.0, -math.inf])
    ref = t([2.0, 3.0, -15.0, 0.0])
    k3 = F.kl_estimate(logp, ref, "k3")
    close(k3, [4.3890561, 10.0, 10.0, 10.0])
    assert torch.isfinite(k3).all()


def test_kl_unknown_kind_lists_kinds():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        F.kl_estimate(t([0.0]), t([0.0]), "k4")


def test_entropy_from_logits_golden():
    # uniform over V=5 -> log 5 = 1.6094379 (any constant logit)
    close(F.entropy_from_logits(torch.full((2, 3, 5), 7.0, dtype=D)), torch.full((2, 3), 1.6094379))
    # logits 0, ln 3 -> p = 1/4, 3/4 -> H = 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351
    close(F.entropy_from_logits(t([0.0, math.log(3.0)])), t(0.5623351))
    # from log-probs (the scoring pass's log-softmax): the same 0.5623351, and 0 for a certain token
    close(F.entropy_from_log_probs(torch.log(t([0.25, 0.75]))), t(0.5623351))
    close(F.entropy_from_log_probs(torch.log_softmax(t([0.0, -200.0]), -1)), t(0.0))


# ---------------------------------------------------------------------------------------------------
# clipped policy loss
# ---------------------------------------------------------------------------------------------------

# Tokens (ratio rho, advantage A), clip_low 0.2, clip_high 0.28, dual clip c = 3:
#  a rho 1.5, A +1: max(-1.5, -1.28) = -1.28   clipped (upper bound)        grad 0
#  b rho 1.5, A -1: max( 1.5,  1.28) =  1.5    unclipped; min(1.5, 3) = 1.5  grad -A*rho = 1.5
#  c rho 0.5, A -1: max( 0.5,  0.8 ) =  0.8    clipped (lower bound)        grad 0
#  d rho 0.5, A +1: max(-0.5, -0.8 ) = -0.5    unclipped                    grad -0.5
#  e rho 4.0, A -1: max( 4.0,  1.28) =  4.0 -> dual clip min(4, 3) = 3      grad 0
#  f rho 1.0, A +2: -2                          unclipped                    grad -2
#  g masked (rho 5, A 1): loss 0, not counted, grad 0
RHO = [1.5, 1.5, 0.5, 0.5, 4.0, 1.0, 5.0]
ADV = [1.0, -1.0, -1.0, 1.0, -1.0, 2.0, 1.0]
MASK = [1, 1, 1, 1, 1, 1, 0]


def _loss_inputs():
    old = t([[-1.0] * 7])
    logp = (old + torch.log(t([RHO]))).requires_grad_(True)
    return logp, old, t([ADV]), torch.tensor([MASK])


def test_clipped_policy_loss_golden_with_dual_clip_and_gradients():
    logp, old, adv, mask = _loss_inputs()
    loss, metrics = F.clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    close(loss, [[-1.28, 1.5, 0.8, -0.5, 3.0, -2.0, 0.0]])
    # clipped branch active on a, c -> 2/6 ; upper a -> 1/6 ; lower c -> 1/6 ; dual e -> 1/6
    close(metrics["pg_clipfrac"], t(2 / 6))
    close(metrics["pg_clipfrac_high"], t(1 / 6))
    close(metrics["pg_clipfrac_low"], t(1 / 6))
    close(metrics["pg_clipfrac_lower"], t(1 / 6))
    # ppo_kl = mean(old - logp) = -(2 ln 1.5 + 2 ln 0.5 + ln 4 + 0)/6 = -0.1351550
    close(metrics["ppo_kl"], t(-0.1351550))
    (grad,) = torch.autograd.grad(loss.sum(), logp)  # d(-A rho)/dlogp = -A rho on unclipped tokens
    close(grad, [[0.0, 1.5, 0.0, -0.5, 0.0, -2.0, 0.0]])
    assert all(not v.requires_grad for v in metrics.values())


def test_clipped_policy_loss_without_dual_clip():
    logp, old, adv, mask = _loss_inputs()
    loss, metrics = F.clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss[0, 4], t(4.0))  # token e keeps max(4, 1.28) = 4
    close(metrics["pg_clipfrac_lower"], t(0.0))
    # symmetric 0.2: token a -> max(-1.5, -1.2) = -1.2
    loss, _ = F.clipped_policy_loss(logp, old, adv, mask)
    close(loss[0, 0], t(-1.2))


def test_ratio_log_clamp_and_hard_ratio_clamp():
    # log ratio 50 -> clamped to 20 -> rho = e^20, finite; A = -1 -> loss e^20 = 485165195.4
    logp, old = t([[50.0]]), t([[0.0]])
    loss, _ = F.clipped_policy_loss(logp, old, t([[-1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-12)
    # ratio_clamp 10: rho clamped to 10 -> max(10, 1.2) = 10 ; rho = 0.05 -> 0.1, A=+1 -> max(-0.1, -0.8) = -0.1
    loss, _ = F.clipped_policy_loss(
        t([[math.log(20.0), math.log(0.05)]]),
        t([[0.0, 0.0]]),
        t([[-1.0, 1.0]]),
        torch.ones(1, 2),
        ratio_clamp=10.0,
    )
    close(loss, [[10.0, -0.1]])


# ---------------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------------


def test_aggregate_golden():
    # valid losses: row 0 = 1,2,3 ; row 1 = 4 ; row 2 empty (e.g. overlong-filtered); NaN masked out
    loss = t([[1.0, 2.0, 3.0], [4.0, NAN, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(F.aggregate(loss, mask, "token_mean"), t(2.5))  # 10 / 4
    close(F.aggregate(loss, mask, "seq_mean_token_mean"), t(3.0))  # (6/3 + 4/1) / 2 non-empty rows
    close(F.aggregate(loss, mask, "seq_mean_token_sum"), t(5.0))  # (6 + 4) / 2
    close(F.aggregate(loss, mask, "seq_sum_const"), t(10 / 6))  # 10 / (2 rows * T=3)
    close(F.aggregate(loss, mask, "seq_sum_const", max_len=5), t(1.0))  # 10 / (2 * 5)
    close(F.aggregate(loss, mask, "seq_sum_const", num_seqs=3, max_len=5), t(10 / 15))
    close(F.aggregate(loss, mask, "token_mean", num_tokens=t(8.0)), t(1.25))  # global count 8
    num_tokens, num_seqs = F.aggregation_counts(mask)
    assert (num_tokens.item(), num_seqs.item()) == (4.0, 2.0)


def test_aggregate_empty_mask_is_zero_not_nan():
    for mode in F.AGG_MODES:
        out = F.aggregate(t([[1.0, 2.0]]), torch.zeros(1, 2), mode)
        assert out.item() == 0.0


def test_aggregate_unknown_mode_lists_modes():
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean"):
        F.aggregate(t([[1.0]]), torch.ones(1, 1), "sum")


@pytest.mark.parametrize("mode", F.AGG_MODES)
def test_gradient_accumulation_equals_one_batch(mode):
    """Summing micro-batch losses normalised by GLOBAL counts = the one-pass loss (verl #5625)."""
    g = torch.Generator().manual_seed(1)
    n, width, max_len = 7, 9, 12
    lengths = torch.tensor([9, 2, 0, 5, 3, 7, 1])  # row 2 empty
    mask = torch.arange(width)[None, :] < lengths[:, None]  # [N, T]
    logp = (-torch.rand(n, width, generator=g, dtype=D)).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(n, width, generator=g, dtype=D)  # some tokens clip
    adv = torch.randn(n, width, generator=g, dtype=D)

    def loss_of(rows, t_len, **counts):
        lm, _ = F.clipped_policy_loss(
            logp[rows, :t_len], old[rows, :t_len], adv[rows, :t_len], mask[rows, :t_len], clip_high=0.28
        )
        return F.aggregate(lm, mask[rows, :t_len], mode, max_len=max_len, **counts)

    full = loss_of(slice(0, n), width)
    (g_full,) = torch.autograd.grad(full, logp)

    num_tokens, num_seqs = F.aggregation_counts(mask)  # what the trainer all-reduces
    micro = [slice(0, 3), slice(3, 4), slice(4, 7)]  # unequal sizes
    widths = [int(lengths[s].max()) for s in micro]  # 9, 5, 7: unequal padded lengths
    assert len(set(widths)) == 3
    acc = sum(loss_of(s, w, num_tokens=num_tokens, num_seqs=num_seqs) for s, w in zip(micro, widths))
    (g_acc,) = torch.autograd.grad(acc, logp)

    assert g_full.abs().sum() > 0
    assert (acc - full).abs() <= 1e-6 * full.abs().clamp_min(1e-12)
    assert (g_acc - g_full).norm() <= 1e-6 * g_full.norm()
    if mode in ("token_mean", "seq_mean_token_mean"):
        # control: normalising per micro-batch (the bug) gives a different gradient
        bad = sum(loss_of(s, w) for s, w in zip(micro, widths))
        (g_bad,) = torch.autograd.grad(bad, logp)
        assert (g_bad - g_full).norm() > 1e-3 * g_full.norm()


# ---------------------------------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------------------------------


def test_value_loss_golden():
    # eps 0.5; 4th token masked (garbage)
    # t0: V 1, V_old 0, ret 2: (1-2)^2 = 1 ; clip(1, -0.5, 0.5) = 0.5 -> (0.5-2)^2 = 2.25 -> 2.25 clipped
    # t1: V 3, V_old 2, ret 0: 9 ; clip -> 2.5 -> 6.25 -> 9
    # t2: V 2, V_old 2, ret 1: 1 ; 1 -> 1 (tie: not counted as clipped)
    # loss = 0.5 * (2.25 + 9 + 1) / 3 = 2.0416667 ; clipfrac 1/3 ; values_mean 2
    # explained var: ret 2,0,1 -> var 1 ; ret - V = 1,-3,-1 -> mean -1, sq 4+4+0 -> var 4 -> 1 - 4 = -3
    v, v_old = t([[1.0, 3.0, 2.0, NAN]]), t([[0.0, 2.0, 2.0, 0.0]])
    ret, mask = t([[2.0, 0.0, 1.0, 0.0]]), torch.tensor([[1, 1, 1, 0]])
    loss, metrics = F.value_loss(v, v_old, ret, mask, clip_range=0.5)
    close(loss, t(2.0416667))
    close(metrics["vf_clipfrac"], t(1 / 3))
    close(metrics["explained_var"], t(-3.0))
    close(metrics["values_mean"], t(2.0))
    # global normaliser: 12.25 / 2 / 6 = 1.0208333 ; unclipped: 0.5 * (1 + 9 + 1) / 3 = 1.8333333
    close(F.value_loss(v, v_old, ret, mask, num_tokens=6)[0], t(1.0208333))
    close(F.value_loss(v, v_old, ret, mask, clip_range=None)[0], t(1.8333333))
