"""The math of rlcli as pure tensor functions (docs/algorithms.md): no model, no DeepSpeed, only torch.

Letters as in docs/design.md#units: N trajectories, T padded response length. Per-token tensors
are [N, T], right-padded; `mask` is the response (loss) mask, any nonzero entry counts as a valid
token (bool or float 0/1 both work). Every per-token output is exactly 0 at masked positions,
whatever garbage (even NaN) the inputs hold there.

Group-level functions take `group_index` [N]: any integers, not necessarily contiguous or sorted;
responses to one prompt share a value. Groups may have any size, including 1.

These functions are differentiable where that makes sense; advantages are constants for the policy
gradient, so the advantage registry (`rlcli.algos.advantages.compute_advantages`) runs them under
`torch.no_grad()`.

Departures and choices the papers leave open are stated in each docstring and in docs/algorithms.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from rlcli.core import names
from rlcli.core.names import AGG_MODES, ROLLOUT_CORRECTION_LEVELS
from rlcli.core.registry import Registry

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "aggregate",
    "aggregation_counts",
    "bradley_terry_loss",
    "cispo_policy_loss",
    "clipped_policy_loss",
    "decoupled_policy_loss",
    "discounted_returns",
    "entropy_from_log_probs",
    "entropy_from_logits",
    "gae",
    "group_advantages",
    "gspo_policy_loss",
    "hierarchical_advantages",
    "hybrid_alpha",
    "kl_estimate",
    "length_adaptive_lambda",
    "masked_mean",
    "masked_whiten",
    "preference_metrics",
    "rank_advantages",
    "rloo_advantages",
    "rollout_correction_weights",
    "sequence_reweight",
    "soft_overlong_penalty",
    "value_loss",
    "weighted_baseline_advantages",
]

LOG_RATIO_CLAMP = 20.0
"""|logp - old_logp| is clamped to this before exp: exp(20) ~ 5e8 stays finite (docs/design.md)."""
GSPO_LOG_RATIO_MAX = 10.0
"""Upper clamp of GSPO's per-token log ratio log s_i,t (as verl): s ≤ exp(10) ~ 2.2e4."""
K3_INPUT_CLAMP = 20.0
K3_OUTPUT_CLAMP = 10.0
LENGTH_ADAPTIVE_LAMBDA_MAX = 1.0 - 1e-6
"""Upper bound of the length-adaptive λ: 1 - 1/(αl) < 1 for every finite l, this only guards float32
rounding to exactly 1.0 (αl > ~1e7), which would make GAE undiscounted instead of merely long."""


# ---------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------


def _valid(mask: Tensor) -> Tensor:
    """Mask as bool: nonzero = valid token."""
    return mask if mask.dtype == torch.bool else mask != 0


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _nonzero_den(den: Tensor | float | int) -> Tensor | float | int:
    """A normalizer that is 0 (empty batch: the numerator is 0 too) becomes 1, giving a loss of 0."""
    if isinstance(den, Tensor):
        return torch.where(den > 0, den, torch.ones_like(den))
    return den if den > 0 else 1


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over valid entries of `mask` (same shape); 0-dim. 0 when nothing is valid."""
    m = _valid(mask)
    total = torch.where(m, x, torch.zeros_like(x)).sum()
    return total / _nonzero_den(m.sum().to(total.dtype))


def _groups(group_index: Tensor) -> tuple[Tensor, int]:
    """Dense group ids [N] in 0..P-1 and the number of groups P."""
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    return inv, n_groups


def _group_sum(values: Tensor, inv: Tensor, n_groups: int) -> Tensor:
    """[P] per-group sums of [N] values."""
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inv, values)


def _group_is_constant(scores: Tensor, inv: Tensor, n_groups: int) -> Tensor:
    """[N] bool: every member of the trajectory's group has the same score.

    Tested exactly (max == min) rather than via the mean, because sum/n of equal floats need not
    round back to the same float; constant groups must give advantages that are exactly 0.
    """
    empty = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    gmax = empty.scatter_reduce(0, inv, scores, "amax", include_self=False)
    gmin = empty.scatter_reduce(0, inv, scores, "amin", include_self=False)
    return (gmax == gmin)[inv]


# ---------------------------------------------------------------------------------------------------
# Outcome-level advantages (one number per trajectory) — docs/algorithms.md, "Advantage estimators"
# ---------------------------------------------------------------------------------------------------


def group_advantages(
    scores: Tensor, group_index: Tensor, std_normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO / Dr.GRPO group-relative advantage per trajectory.

    Shapes: scores [N] float, group_index [N] int -> [N].

    std_normalize=True (GRPO, Shao et al. 2024, arXiv:2402.03300):
        A_i = (R_i - mean_g) / (std_g + eps), std_g the unbiased (n-1) standard deviation.
    std_normalize=False (Dr.GRPO, Liu et al. 2025, arXiv:2503.20783):
        A_i = R_i - mean_g.
    A group of one uses mean 0 and std 1, i.e. A = R / (1 + eps) (GRPO) or A = R (Dr.GRPO).
    A group whose scores are all equal gives exactly 0 (no NaN, no rounding residue).
    """
    scores = _float(scores)
    if scores.numel() == 0:
        return scores.clone()
    inv, n_groups = _groups(group_index)
    ones = torch.ones_like(scores)
    count = _group_sum(ones, inv, n_groups)  # [P]
    mean = _group_sum(scores, inv, n_groups) / count  # [P]
    singleton = (count == 1)[inv]  # [N]
    centered = scores - mean[inv]
    adv = centered
    if std_normalize:
        sq = _group_sum(centered**2, inv, n_groups)  # [P]
        std = (sq / (count - 1).clamp_min(1)).sqrt()  # [P] unbiased
        adv = centered / (std[inv] + eps)
        singleton_adv = scores / (1.0 + eps)  # mean 0, std 1
    else:
        singleton_adv = scores
    adv = torch.where(_group_is_constant(scores, inv, n_groups), torch.zeros_like(adv), adv)
    return torch.where(singleton, singleton_adv, adv)


def rloo_advantages(scores: Tensor, group_index: Tensor) -> Tensor:
    """REINFORCE leave-one-out advantage (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    Shapes: scores [N], group_index [N] -> [N].
    A_i = R_i - (1/(G-1)) Σ_{j≠i} R_j  ( = G/(G-1) · (R_i - mean_g) ).
    A group of one has no "others" and keeps A_i = R_i. A constant group gives exactly 0.
    """
    scores = _float(scores)
    if scores.numel() == 0:
        return scores.clone()
    inv, n_groups = _groups(group_index)
    count = _group_sum(torch.ones_like(scores), inv, n_groups)[inv]  # [N]
    total = _group_sum(scores, inv, n_groups)[inv]  # [N]
    baseline = (total - scores) / (count - 1).clamp_min(1)
    adv = torch.where(count == 1, scores, scores - baseline)
    constant = _group_is_constant(scores, inv, n_groups) & (count > 1)
    return torch.where(constant, torch.zeros_like(adv), adv)


def pkpo_advantages(scores: Tensor, group_index: Tensor, k: int) -> Tensor:
    """PKPO: credit for the pass@k (max@k) objective (Walder & Karkhanis 2025, "Pass@K Policy Optimization",
    arXiv:2505.15201), with the k-1 leave-one-out baseline, the lowest-variance of the paper's unbiased estimators.

    Shapes: scores [N], group_index [N] -> [N]. For a group of n responses with rewards g, the objective is
    E[max of k samples]; averaging its score-function gradient over all C(n, k) subsets S of size k, each subset
    S containing i baselined by the max of its other k-1 members (which does not depend on response i), gives
        A_i = (1 / C(n, k)) Σ_{S ∋ i, |S| = k} (max_{j∈S} g_j − max_{j∈S∖i} g_j),
    response i's marginal contribution to the max of the subsets it is in. With the group sorted ascending
    (ties by row order) and i at position m (1-based), only subsets in which i is the last are counted:
        A_i = (C(m−1, k−1)·g_(m) − Σ_{j=k−1}^{m−1} C(j−1, k−2)·g_(j)) / C(n, k).
    Binary rewards with c correct: a correct response gets C(n−c, k−1)/C(n, k), an incorrect one 0 (it never
    raises a subset's max); k = n: only the best response moves, by its margin over the second best.
    Needs k >= 2 (algo.pass_k; k = 1 is pass@1, the other estimators' objective). A group of fewer than k responses
    has no k-subset and gets 0 (none occurs in a run: groups hold rollout.n responses, and validation asks k <= n)."""
    if k < 2:
        raise ValueError(f"pkpo needs algo.pass_k >= 2, got {k}")
    scores = _float(scores)
    if scores.numel() == 0:
        return scores.clone()
    inv, n_groups = _groups(group_index)
    by_score = torch.argsort(scores, stable=True)
    order = by_score[torch.argsort(inv[by_score], stable=True)]  # [N] by (group, score, row)
    g, grp = scores[order].double(), inv[order]  # [N] sorted within each group, ascending
    count = _group_sum(torch.ones_like(g), grp, n_groups).long()  # [P]
    first = torch.cumsum(count, 0) - count  # [P] each group's first position in `order`
    m = torch.arange(len(g)) - first[grp] + 1  # [N] 1-based position within the group
    size = int(count.max())  # positions m - 1 < the largest group's size
    comb = [math.comb(i, k - 1) for i in range(size)], [math.comb(i, k - 2) for i in range(size)]
    top = torch.tensor(comb[0], dtype=torch.float64)[m - 1]  # [N] C(m-1, k-1): subsets in which it is the last
    below = torch.tensor(comb[1], dtype=torch.float64)[m - 1] * g  # [N] C(m-1, k-2)·g_(m)
    running = torch.cumsum(below, 0) - below  # [N] Σ over every earlier position, other groups' too
    before = running - running[first][grp]  # [N] Σ over the earlier positions of its own group
    n = count[grp]
    total = torch.tensor([float(math.comb(int(c), k)) for c in count.tolist()], dtype=torch.float64)[grp]  # C(n, k)
    a = torch.where(n >= k, (top * g - before) / total.clamp_min(1.0), 0.0)
    out = torch.empty_like(scores)
    out[order] = a.to(scores.dtype)
    return out


def best_of_group_advantages(scores: Tensor, group_index: Tensor, std_normalize: bool = True,
                             eps: float = 1e-6) -> Tensor:
    """Pass@k credit to the best response only (verl's `grpo_passk` estimator, after Tang et al. 2025, "Optimizing
    Language Models for Inference Time Objectives using Reinforcement Learning", arXiv:2503.19595).

    Shapes: scores [N], group_index [N] -> [N]. In each group, the best response (the first in row order among
    equal maxima) gets A = (g_max − g_second) / (std_g + eps) (std_g unbiased, as GRPO; without std_normalize,
    g_max − g_second), and every other response exactly 0 (a copy of the estimator that left the others
    untouched trained them on stale values). A group of one, or whose two best are equal, gives 0."""
    scores = _float(scores)
    if scores.numel() == 0:
        return scores.clone()
    inv, n_groups = _groups(group_index)
    rows = torch.arange(len(scores))
    empty = torch.zeros(n_groups, dtype=scores.dtype)
    top = empty.scatter_reduce(0, inv, scores, "amax", include_self=False)  # [P]
    at_top = torch.where(scores == top[inv], rows, len(scores))
    best = torch.full((n_groups,), len(scores)).scatter_reduce(0, inv, at_top, "amin")  # [P] first row at the max
    is_best = rows == best[inv]  # [N]
    rest = torch.where(is_best, torch.full_like(scores, -math.inf), scores)
    second = empty.scatter_reduce(0, inv, rest, "amax", include_self=False)  # [P] -inf for a group of one
    count = _group_sum(torch.ones_like(scores), inv, n_groups)  # [P]
    margin = torch.where(count > 1, top - second, 0.0)  # [P]
    if std_normalize:
        mean = _group_sum(scores, inv, n_groups) / count
        var = _group_sum((scores - mean[inv]) ** 2, inv, n_groups) / (count - 1).clamp_min(1)
        margin = margin / (var.sqrt() + eps)
    return torch.where(is_best, margin[inv], 0.0)


def maxrl_advantages(scores: Tensor, group_index: Tensor) -> Tensor:
    """MaxRL, maximum-likelihood RL (arXiv:2602.02710): the group advantage divided by the group's mean reward,
    A_i = (R_i − mean_g) / mean_g. For rewards in {0, 1} the mean is the prompt's pass rate p̂, and the update is
    the gradient of log p(success) (∇p / p) instead of p: hard prompts weigh 1/p̂ more. Rewards are read as
    success rates (>= 0); a group whose mean is <= 0 (nothing solved), or whose rewards are equal, gives 0.

    Shapes: scores [N], group_index [N] -> [N]."""
    scores = _float(scores)
    if scores.numel() == 0:
        return scores.clone()
    inv, n_groups = _groups(group_index)
    count = _group_sum(torch.ones_like(scores), inv, n_groups)
    mean = (_group_sum(scores, inv, n_groups) / count)[inv]  # [N]
    adv = torch.where(mean > 0, (scores - mean) / torch.where(mean > 0, mean, torch.ones_like(mean)), 0.0)
    return torch.where(_group_is_constant(scores, inv, n_groups), torch.zeros_like(adv), adv)


def rank_advantages(scores: Tensor, group_index: Tensor) -> Tensor:
    """Rank-based group advantage (rlcli option, not from a paper; off by default).

    Shapes: scores [N], group_index [N] -> [N].
    A_i = (rank_i - (G+1)/2) / (G/2), ranks 1..G ascending within the group, ties get the average
    of their ranks. Values lie in (-1, 1); a group of one or a constant group gives 0.
    Memory: builds [N, N] boolean comparisons (N = 8192 -> 64 MiB each), fine for RL batch sizes.
    """
    scores = _float(scores)
    if scores.numel() == 0:
        return scores.clone()
    inv, _ = _groups(group_index)
    same = inv[:, None] == inv[None, :]  # [N, N]
    below = ((scores[None, :] < scores[:, None]) & same).sum(1)  # [N] #{j in g: R_j < R_i}
    ties = ((scores[None, :] == scores[:, None]) & same).sum(1)  # [N] includes i itself
    size = same.sum(1).to(scores.dtype)  # [N] G of i's group
    rank = 1 + below.to(scores.dtype) + (ties.to(scores.dtype) - 1) / 2
    return (rank - (size + 1) / 2) / (size / 2)


def weighted_baseline_advantages(scores: Tensor, group_index: Tensor, weights: Tensor) -> Tensor:
    """Group advantage against a weighted baseline (rlcli option, not from a paper; off by default).

    Shapes: scores [N], group_index [N], weights [N] positive -> [N].
    A_i = R_i - Σ_{j in g} w_j R_j / Σ_{j in g} w_j.
    A group of one uses baseline 0 (A_i = R_i), as GRPO's "group of one uses mean 0"; a constant
    group gives exactly 0.
    """
    scores = _float(scores)
    if scores.numel() == 0:
        return scores.clone()
    weights = weights.to(scores.dtype)
    inv, n_groups = _groups(group_index)
    count = _group_sum(torch.ones_like(scores), inv, n_groups)[inv]
    baseline = (_group_sum(weights * scores, inv, n_groups) / _group_sum(weights, inv, n_groups))[inv]
    adv = torch.where(count == 1, scores, scores - baseline)
    constant = _group_is_constant(scores, inv, n_groups) & (count > 1)
    return torch.where(constant, torch.zeros_like(adv), adv)


def hierarchical_advantages(scores: Tensor, group_index: Tensor, alpha: float, eps: float = 1e-6) -> Tensor:
    """Mix of within-group and whole-batch normalisation (rlcli option, not from a paper; off by default).

    Shapes: scores [N], group_index [N] -> [N].
    A_i = α · A_local + (1 - α) · A_global, with A_local the GRPO advantage within the group and
    A_global = (R_i - mean_batch) / (std_batch + eps) over all N trajectories (unbiased std; the
    same group-of-one and constant rules as `group_advantages`, the batch being one group).
    """
    local = group_advantages(scores, group_index, std_normalize=True, eps=eps)
    everyone = torch.zeros_like(group_index)
    global_ = group_advantages(scores, everyone, std_normalize=True, eps=eps)
    return alpha * local + (1.0 - alpha) * global_


def hybrid_alpha(step: int, total_steps: int, alpha0: float, kappa: float) -> float:
    """Weight of the GAE advantage in the VAPO-GRPO hybrid (rlcli option, not from a paper; off by default).

    α(t) = α0 · exp(-κ · t / T_total); `total_steps` below 1 is treated as 1.
    """
    return float(alpha0 * math.exp(-kappa * step / max(total_steps, 1)))


def sequence_reweight(lengths: Tensor, alpha: float) -> Tensor:
    """Per-sequence loss weight w_i = (|o_i| / L_median)^(-α) (rlcli option, not from a paper).

    Off by default (algo.seq_reweight_alpha = null).

    Shapes: lengths [N] -> [N] float. L_median is the batch median (the mean of the two middle
    values for even N); lengths are floored at 1 so empty responses get a finite weight.
    Longer-than-median responses get weights < 1 for α > 0. α = 0 gives all ones.
    """
    lengths = _float(lengths).clamp_min(1.0)
    if lengths.numel() == 0:
        return lengths.clone()
    median = torch.quantile(lengths, 0.5)
    return (lengths / median).pow(-alpha)


# ---------------------------------------------------------------------------------------------------
# Token-level returns and advantages
# ---------------------------------------------------------------------------------------------------


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, reduce: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """Whiten `x` with statistics over the valid entries of `mask` (the loss mask in the trainer).

    Shapes: x, mask any equal shape (typically [N, T]) -> same shape.
    (x - mean) / sqrt(var + eps) with the mean and the UNBIASED variance (n-1) over valid entries;
    shift_mean=False adds the mean back (rescale only). Masked-out positions are returned as 0.
    With a single valid entry the variance is taken as 0 (n-1 is floored at 1). `reduce` sums a tensor
    over data-parallel ranks, so that the statistics are those of the whole batch on every rank.
    """
    m = _valid(mask)
    zero = torch.zeros_like(x)
    reduce = reduce or (lambda t: t)
    n, total = reduce(torch.stack([m.sum().to(x.dtype), torch.where(m, x, zero).sum()]))
    mean = total / _nonzero_den(n)
    var = reduce(torch.where(m, (x - mean) ** 2, zero).sum()) / (n - 1).clamp_min(1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, zero)


def _reverse_scan(
    token_rewards: Tensor, values: Tensor | None, mask: Tensor, gamma: float, lam: Tensor | float
) -> Tensor:
    """Backward recursion shared by GAE and discounted returns, skipping masked positions.

    With values=None it computes G_t = r_t + γ G_next (λ unused); otherwise the GAE recursion
    A_t = δ_t + γ λ A_next, δ_t = r_t + γ V_next - V_t. "next" is the next VALID position; after
    the last valid token V_next = 0 and A_next = 0.
    """
    m = _valid(mask)
    n, t_len = token_rewards.shape
    zero = torch.zeros(n, dtype=token_rewards.dtype, device=token_rewards.device)
    next_value, running = zero, zero  # [N]
    lam_t = torch.as_tensor(lam, dtype=token_rewards.dtype, device=token_rewards.device)
    columns: list[Tensor] = []
    for t in reversed(range(t_len)):
        valid = m[:, t]
        r = torch.where(valid, token_rewards[:, t], zero)
        if values is None:
            cur = r + gamma * running
        else:
            v = torch.where(valid, values[:, t], zero)
            delta = r + gamma * next_value - v
            cur = delta + gamma * lam_t * running
            next_value = torch.where(valid, v, next_value)
        running = torch.where(valid, cur, running)
        columns.append(torch.where(valid, cur, zero))
    if not columns:
        return torch.zeros_like(token_rewards)
    return torch.stack(columns[::-1], dim=1)  # [N, T]


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438). No whitening.

    Shapes: token_rewards [N, T], values [N, T], mask [N, T]; lam a float or a per-sequence
    tensor [N] (VAPO's length-adaptive λ) -> (advantages [N, T], returns [N, T]).
        δ_t = r_t + γ V_{t+1} - V_t,   A_t = Σ_l (γλ)^l δ_{t+l},   returns = A + V.
    Masked positions are skipped: t+1 means the next valid position, and V after the last valid
    token is 0 (the response ended). Both outputs are 0 at masked positions.
    """
    adv = _reverse_scan(token_rewards, values, mask, gamma, lam)
    m = _valid(mask)
    returns = torch.where(m, adv + torch.where(m, values, torch.zeros_like(values)), torch.zeros_like(adv))
    return adv, returns


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go G_t = Σ_{k≥t, k valid} γ^(k-t) r_k (REINFORCE / REINFORCE++).

    Shapes: token_rewards [N, T], mask [N, T] -> [N, T], 0 at masked positions. Each row is one
    response, so the sum restarts per response (nothing after its EOS is counted). The exponent
    counts valid positions only (masked positions are skipped, as in `gae`).
    """
    return _reverse_scan(token_rewards, None, mask, gamma, 0.0)


def length_adaptive_lambda(lengths: Tensor, alpha: float = 0.05) -> Tensor:
    """VAPO's per-sequence actor λ (Yue et al. 2025, arXiv:2504.05118): λ_i = 1 - 1/(α · l_i).

    Shapes: lengths [N] -> [N] float. Chosen so that Σ_t λ^t = 1/(1-λ) = α·l. Clamped to
    [0, 1 - 1e-6]: sequences shorter than 1/α tokens (20 at α=0.05) get λ = 0 (one-step TD), length
    0 gives 0; the upper bound only matters where float rounding would reach exactly 1.
    Example at α=0.05: l=10 -> 0, l=100 -> 0.8, l=1000 -> 0.98.
    """
    lengths = _float(lengths)
    lam = 1.0 - 1.0 / (alpha * lengths)  # l=0 -> -inf -> clamped to 0
    return lam.clamp(0.0, LENGTH_ADAPTIVE_LAMBDA_MAX)


# ---------------------------------------------------------------------------------------------------
# Reward shaping
# ---------------------------------------------------------------------------------------------------


def soft_overlong_penalty(
    lengths: Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

    Shapes: lengths [N] -> [N] float, to be ADDED to the task reward.
        0                                   if l ≤ L_max - L_c
        ((L_max - L_c) - l) / L_c           if L_max - L_c < l ≤ L_max   (linear 0 -> -1)
        -1                                  if l > L_max
    times `penalty_factor`. buffer_len (L_c) = 0 turns the punishment off (all zeros).
    """
    lengths = _float(lengths)
    if buffer_len <= 0:
        return torch.zeros_like(lengths)
    expected = max_len - buffer_len
    inside = (expected - lengths) / buffer_len
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), inside)
    penalty = torch.where(lengths > max_len, torch.full_like(lengths, -1.0), penalty)
    return penalty * penalty_factor


# ---------------------------------------------------------------------------------------------------
# KL, entropy
# ---------------------------------------------------------------------------------------------------

KL_ESTIMATORS = Registry(names.KL_ESTIMATORS)
"""Per-token estimators of KL(π || π_ref) from sampled-token log-probs (Schulman 2020,
"Approximating KL divergence", http://joschu.net/blog/kl-approx.html). fn(logp, ref_logp) -> [N, T]."""


@KL_ESTIMATORS.register("k1")
def _k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def _k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def _k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    d = (ref_logp - logp).clamp(-K3_INPUT_CLAMP, K3_INPUT_CLAMP)
    return (torch.exp(d) - d - 1).clamp(-K3_OUTPUT_CLAMP, K3_OUTPUT_CLAMP)


def distill_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float,
                       discount: float) -> Tensor:
    """On-policy distillation's per-token advantage (Agarwal et al. 2024, arXiv:2306.13649; Thinking Machines,
    "On-Policy Distillation", 2025). Each sampled token's reward is the negative of the sampled reverse-KL estimate,
    r_t = log π_teacher(y_t) − log π_student(y_t); the advantage is coef · Σ_{k ≥ t} γ^(k−t) r_k over the mask's
    tokens (γ = `discount`, counted in mask tokens: an observation between two turns neither pays nor discounts).
    γ = 0, the default, is each token's own r_t (Thinking Machines' choice). Shapes: [N, T] each -> [N, T]; exactly
    0 where the mask is 0, and exactly 0 everywhere when the teacher's log-probs equal the student's."""
    mask = mask.to(student_logp.dtype)
    r = (teacher_logp - student_logp) * mask  # [N, T]
    if discount == 0:
        return coef * r
    out, acc = torch.zeros_like(r), torch.zeros_like(r[:, 0])  # [N, T], [N]
    for t in range(r.shape[1] - 1, -1, -1):
        acc = torch.where(mask[:, t] > 0, r[:, t] + discount * acc, acc)
        out[:, t] = acc * mask[:, t]
    return coef * out


def reverse_kl_full(logits: Tensor, other_logp: Tensor) -> Tensor:
    """The exact reverse KL over the whole vocabulary at each position, KL(π ‖ π_other) = Σ_v π(v) (log π(v) −
    log π_other(v)), π = softmax(logits) (GKD's reverse-KL divergence with the student as π: Agarwal et al. 2024,
    arXiv:2306.13649, §3). Shapes: logits [..., V] (already temperature-scaled), other_logp [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), -1)
    return (logp.exp() * (logp - other_logp)).sum(-1)


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate. Shapes: logp, ref_logp [N, T] -> [N, T].

    Estimators from Schulman 2020, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html:
    k1 = logp - ref (unbiased, can be negative); k2 = ½ (logp - ref)²;
    k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, ≥ 0), with ref - logp clamped to ±20 and the
    result clamped to ±10. Not masked: multiply or aggregate with the mask yourself.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(sorted(KL_ESTIMATORS))}")
    return KL_ESTIMATORS[kind](logp, ref_logp)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim. Shapes: [..., V] -> [...]. Pass temperature-scaled logits
    (docs/design.md#conventions)."""
    return entropy_from_log_probs(torch.log_softmax(logits, dim=-1))


def entropy_from_log_probs(logp: Tensor) -> Tensor:
    """H = -Σ_v π(v) log π(v) from a log-softmax over the last dim, π = exp(logp): the pass that scores the tokens has
    computed logp already, so the entropy costs an exp, a product and a sum over the vocabulary. [..., V] -> [...]"""
    return -(logp.exp() * logp).sum(-1)


# ---------------------------------------------------------------------------------------------------
# Policy loss and aggregation
# ---------------------------------------------------------------------------------------------------


def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_clamp: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token, with DAPO's decoupled bounds and optional dual clip.

    Shapes: logp, old_logp, advantages, mask [N, T] -> (loss_mat [N, T], metrics).
        ρ = exp(clamp(logp - old_logp, -20, 20))
        ℓ = max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high))         (PPO, arXiv:1707.06347;
                                                                       clip-higher, arXiv:2503.14476)
        dual clip (Ye et al. 2020, arXiv:1912.09729), c = dual_clip > 1, only where A < 0:
        ℓ = min(ℓ, -A·c)
    ratio_clamp = C (rlcli option, not from a paper; off by default) first hard-clamps ρ to
    [1/C, C]; note that tokens outside that band get no gradient at all.
    loss_mat is 0 at masked positions; reduce it with `aggregate`.

    metrics (detached 0-dim tensors, masked token means):
        pg_clipfrac        the clipped branch is active (-A·clip(ρ) > -A·ρ), i.e. the token's
                           gradient is cut by the trust region; = pg_clipfrac_high + pg_clipfrac_low
        pg_clipfrac_high   ρ > 1 + clip_high and A > 0 (upper bound hit)
        pg_clipfrac_low    ρ < 1 - clip_low and A < 0 (lower bound hit)
        pg_clipfrac_lower  the dual clip is active (A < 0 and -A·c < ℓ); name kept from verl
        ppo_kl             mean of old_logp - logp (k1 estimate of KL(old || current))
    """
    m = _valid(mask)
    zero = torch.zeros_like(logp)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    if ratio_clamp is not None:
        ratio = ratio.clamp(1.0 / ratio_clamp, ratio_clamp)
    loss, metrics = _surrogate(ratio, advantages, clip_low, clip_high, logp, old_logp, m)
    dual_active = torch.zeros_like(m)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (bound < loss)
        loss = torch.where(dual_active, bound, loss)
    metrics["pg_clipfrac_lower"] = masked_mean(dual_active.to(logp.dtype), m).detach()
    return torch.where(m, loss, zero), metrics


def _surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, logp: Tensor, old_logp: Tensor, m: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high)) [N, T] (not masked) and
    its metrics over the valid tokens `m`: pg_clipfrac, pg_clipfrac_high, pg_clipfrac_low, ppo_kl."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(logp.dtype), m),
            "pg_clipfrac_high": masked_mean(((ratio > 1.0 + clip_high) & (advantages > 0)).to(logp.dtype), m),
            "pg_clipfrac_low": masked_mean(((ratio < 1.0 - clip_low) & (advantages < 0)).to(logp.dtype), m),
            "ppo_kl": masked_mean(old_logp - logp, m),
        }
    return torch.maximum(unclipped, clipped), metrics


def gspo_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 3e-4, clip_high: float = 4e-4
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO clipped surrogate with the sequence-level ratio (Zheng et al. 2025, arXiv:2507.18071).

    Shapes: logp, old_logp, advantages, mask [N, T] -> (loss_mat [N, T], metrics).
        log s_i   = (1/|o_i|) Σ_t m·(logp - old_logp)      (§4, the length-normalised sequence ratio)
        s_i,t     = sg[s_i] · π_t / sg[π_t] = exp(min(sg[log s_i] + logp_t - sg[logp_t], 10))
                                                    (§4, the GSPO-token variant)
        ℓ_t       = max(-A_t·s_i,t, -A_t·clip(s_i,t, 1 - clip_low, 1 + clip_high))
    s_i,t equals s_i in value; its gradient flows through each token's own logp, so where the
    unclipped branch is active ∂ℓ_t/∂logp_t = -A_t·s_i, and 0 where the clipped branch is. With A
    constant over the sequence (GRPO) and `aggregate(..., "seq_mean_token_mean")` this is GSPO's
    gradient (§4, gradient analysis): s_i·A_i/|o_i| on every token of o_i, per sequence.
    Defaults clip_low = 3e-4, clip_high = 4e-4 are the paper's (§5.1, setup): sequence ratios are
    geometric means and sit much closer to 1 than token ratios.
    The log ratio is clamped at GSPO_LOG_RATIO_MAX = 10 after combining (as verl): a sequence whose
    ratio exceeds e^10 gets no gradient at all. Rows with no valid token have s = 1 and loss 0.
    loss_mat is 0 at masked positions; reduce it with `aggregate`.

    metrics (detached 0-dim tensors, masked token means): pg_clipfrac (the clipped branch is
    active; token-weighted, i.e. longer sequences count more), pg_clipfrac_high (s > 1 + clip_high
    and A > 0), pg_clipfrac_low (s < 1 - clip_low and A < 0), ppo_kl (mean of old_logp - logp,
    the token-level k1 estimate, comparable across losses).
    """
    m = _valid(mask)
    zero = torch.zeros_like(logp)
    logp_v = torch.where(m, logp, zero)  # NaN-free stand-in at padding
    token_log_ratio = torch.where(m, logp - old_logp, zero)  # [N, T]
    n_tok = m.sum(-1, keepdim=True).clamp_min(1).to(logp.dtype)  # [N, 1]
    log_s = token_log_ratio.sum(-1, keepdim=True) / n_tok  # [N, 1]
    log_ratio = (log_s.detach() + logp_v - logp_v.detach()).clamp(max=GSPO_LOG_RATIO_MAX)  # [N, T]
    loss, metrics = _surrogate(torch.exp(log_ratio), advantages, clip_low, clip_high, logp, old_logp, m)
    return torch.where(m, loss, zero), metrics


def cispo_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 1.0, clip_high: float = 0.28
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient IS weight (MiniMax-M1, arXiv:2506.13585 §3.1).

    Shapes: logp, old_logp, advantages, mask [N, T] -> (loss_mat [N, T], metrics).
        ρ_t = exp(clamp(logp - old_logp, -20, 20))
        w_t = sg[clip(ρ_t, 1 - clip_low, 1 + clip_high)]
        ℓ_t = -w_t · A_t · logp_t                                  (§3.1, the CISPO objective)
    Unlike the PPO surrogate no token loses its gradient: ∂ℓ_t/∂logp_t = -w_t·A_t everywhere, the
    clip only bounds the weight. The value of ℓ is not a surrogate of the return (it is ∝ logp), only
    its gradient is meaningful. The paper aggregates over all tokens of the batch (token_mean).
    Defaults: clip_low = 1.0, i.e. no lower bound (ρ ≥ 0): the paper sets ε_low "to a large value"
    and tunes only ε_high, whose value it does not state; clip_high = 0.28 is DAPO's clip-higher
    ε_high (arXiv:2503.14476 §3.1), our choice.
    loss_mat is 0 at masked positions; reduce it with `aggregate`.

    metrics (detached 0-dim tensors, masked token means): pg_clipfrac (ρ outside
    [1 - clip_low, 1 + clip_high], i.e. its weight was clipped; = high + low), pg_clipfrac_high
    (ρ > 1 + clip_high), pg_clipfrac_low (ρ < 1 - clip_low), ppo_kl (mean of old_logp - logp).
    """
    m = _valid(mask)
    zero = torch.zeros_like(logp)
    with torch.no_grad():
        ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.where(m, -weight * advantages * torch.where(m, logp, zero), zero)

    with torch.no_grad():
        high = (ratio > 1.0 + clip_high).to(logp.dtype)
        low = (ratio < 1.0 - clip_low).to(logp.dtype)
        metrics = {
            "pg_clipfrac": masked_mean(high + low, m),
            "pg_clipfrac_high": masked_mean(high, m),
            "pg_clipfrac_low": masked_mean(low, m),
            "ppo_kl": masked_mean(old_logp - logp, m),
        }
    return loss, metrics


def decoupled_policy_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behav_weight_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL, Fu et al. 2025, arXiv:2505.24298 §5): the trust region is taken around a proximal
    policy π_prox, and the tokens, sampled by a behaviour policy μ (an older or different sampler), are
    importance-weighted from μ to π_prox.

    Shapes: logp, prox_logp, behav_logp, advantages, mask [N, T] -> (loss_mat [N, T], metrics).
        r_t = exp(clamp(logp - prox_logp, -20, 20))
        w_t = sg[exp(clamp(prox_logp - behav_logp, -20, 20))]
        ℓ_t = w_t · max(-A_t·r_t, -A_t·clip(r_t, 1 - clip_low, 1 + clip_high))
    behav_weight_cap = c: tokens with w_t > c get weight 0 (AReaL's rule: too stale to learn from), the rest keep
    theirs. With prox_logp = behav_logp (w = 1) this is clipped_policy_loss. loss_mat is 0 at masked positions;
    reduce it with `aggregate`.

    metrics (detached 0-dim tensors, masked token means): pg_clipfrac (the clipped branch is active),
    pg_clipfrac_high, pg_clipfrac_low, ppo_kl (mean of prox_logp - logp), behav_weight_mean (the weights applied,
    after the cap), behav_weight_capped_frac (tokens the cap zeroed).
    """
    m = _valid(mask)
    ratio = torch.exp((logp - prox_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss, metrics = _surrogate(ratio, advantages, clip_low, clip_high, logp, prox_logp, m)
    weight, wm = behaviour_weights(prox_logp - behav_logp, mask, behav_weight_cap)
    return torch.where(m, weight * loss, torch.zeros_like(logp)), metrics | wm


def behaviour_weights(log_ratio: Tensor, mask: Tensor, cap: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO's token weights π_prox/μ (AReaL, arXiv:2505.24298 §5), with its cap rule.

    Shapes: log_ratio [N, T] (prox_logp - behav_logp), mask [N, T] -> (weights [N, T], metrics).
        w_t = exp(clamp(log_ratio_t, -20, 20)), and 0 where w_t > cap (too stale to learn from) or masked.
    No gradient. metrics (masked token means): behav_weight_mean (after the cap), behav_weight_capped_frac.
    """
    with torch.no_grad():
        m = _valid(mask)
        zero = torch.zeros_like(log_ratio)
        weight = torch.exp(torch.where(m, log_ratio, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        capped = (weight > cap) if cap is not None else torch.zeros_like(m)
        weight = torch.where(capped | ~m, zero, weight)
        return weight, {"behav_weight_mean": masked_mean(weight, m),
                        "behav_weight_capped_frac": masked_mean(capped.to(log_ratio.dtype), m)}


"""Levels of `rollout_correction_weights`: one weight per token, or one per sequence."""


def rollout_correction_weights(
    log_ratio: Tensor,
    mask: Tensor,
    level: str = "token",
    upper: float | None = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights π_trainer / π_sampler correcting the rollout engine's mismatch.

    Shapes: log_ratio [N, T] (trainer logp - sampler logp of the sampled tokens), mask [N, T]
    -> (weights [N, T], metrics). Multiply the per-token policy loss by the weights.
        level="token":     w_t = exp(clamp(log_ratio_t, -20, 20))
        level="sequence":  w_i = exp(clamp(Σ_t m·log_ratio_t, -20, 20)), the same on every token of i
    lower=None: truncated IS (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"), w = min(w, upper). lower given: masked IS (IcePop-style), weights
    outside [lower, upper] become 0 and the rest are NOT truncated. upper=None means no upper bound.
    The weights carry no gradient (they are constants of the loss) and are 0 at masked positions.

    metrics (detached 0-dim tensors over valid tokens, of the RETURNED weights): weight_mean,
    weight_max (0 when nothing is valid), clipped_frac (share of valid tokens whose weight was
    truncated or masked; a sequence-level weight counts once per token).
    """
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(
            f"unknown rollout-correction level {level!r}; valid levels: {', '.join(ROLLOUT_CORRECTION_LEVELS)}"
        )
    if lower is not None and upper is not None and not lower < upper:
        raise ValueError(f"rollout correction needs lower < upper, got lower={lower}, upper={upper}")
    with torch.no_grad():
        m = _valid(mask)
        zero = torch.zeros_like(log_ratio)
        lr = torch.where(m, log_ratio, zero)  # [N, T]
        if level == "sequence":
            lr = lr.sum(-1, keepdim=True).expand_as(lr)  # [N, T], one value per row
        raw = torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        hi = math.inf if upper is None else upper
        if lower is None:
            cut = raw > hi
            weights = raw.clamp(max=hi)
        else:
            cut = (raw < lower) | (raw > hi)
            weights = torch.where(cut, zero, raw)
        weights = torch.where(m, weights, zero)
        metrics = {
            "weight_mean": masked_mean(weights, m),
            "weight_max": weights.amax() if weights.numel() else weights.new_zeros(()),
            "clipped_frac": masked_mean(cut.to(weights.dtype), m),
        }
    return weights, metrics


# ---------------------------------------------------------------------------------------------------
# Entropy control by covariance (Cui et al. 2025, arXiv:2505.22617, §4 "Clip-Cov" and "KL-Cov")
# ---------------------------------------------------------------------------------------------------


def token_covariance(logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """The per-token centred covariance term of Cui et al. 2025 (arXiv:2505.22617, eq. for Cov(y_i)).

    Shapes: logp, advantages, mask [N, T] -> cov [N, T], detached, 0 at masked positions.
        cov_i = (logp_i − mean(logp)) · (A_i − mean(A)),  both means over the valid tokens of the batch given.
    The batch's mean of cov_i is Cov(logp, A), whose sign drives the entropy change (their Lemma/eq. 7): a
    large positive cov_i is a confident token with a high advantage, the kind whose update lowers entropy.
    """
    with torch.no_grad():
        m = _valid(mask)
        lp, adv = logp.detach(), advantages.detach()
        cov = (lp - masked_mean(lp, m)) * (adv - masked_mean(adv, m))
        return torch.where(m, cov, torch.zeros_like(cov))


def cov_select_count(n_tokens: int, ratio: float) -> int:
    """How many tokens Clip-Cov / KL-Cov pick from `n_tokens` valid ones: max(1, floor(ratio·n)), 0 if there
    are none. The paper's r·N rounded down, floored at one token (as its reference code): at the paper's ratios
    (2e-4, 2e-3) a batch under 500 tokens would otherwise never select anything."""
    return 0 if n_tokens <= 0 else max(1, int(ratio * n_tokens))


def clip_cov_select(cov: Tensor, mask: Tensor, ratio: float, lb: float, ub: float,
                    generator: torch.Generator | None = None) -> Tensor:
    """Clip-Cov's token set I_clip (arXiv:2505.22617 §4): `cov_select_count(#valid, ratio)` tokens drawn uniformly
    without replacement among the valid tokens with lb ≤ cov_i ≤ ub (all of them if fewer qualify).

    Shapes: cov, mask [N, T] -> selected [N, T] bool (never a masked token). The draw is
    torch.randperm(#candidates, generator=generator) on the CPU: a seeded generator makes it reproducible.
    """
    m = _valid(mask)
    candidates = (m & (cov >= lb) & (cov <= ub)).flatten().nonzero().squeeze(-1)  # flat indices, row-major
    k = min(cov_select_count(int(m.sum()), ratio), len(candidates))
    picked = candidates[torch.randperm(len(candidates), generator=generator)[:k].to(candidates.device)]
    selected = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    selected[picked] = True
    return selected.view_as(cov)


def kl_cov_select(cov: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """KL-Cov's token set I_KL (arXiv:2505.22617 §4): the `cov_select_count(#valid, ratio)` valid tokens of largest
    cov_i (ties: the first in row-major order).

    Shapes: cov, mask [N, T] -> selected [N, T] bool (never a masked token).
    """
    m = _valid(mask)
    k = cov_select_count(int(m.sum()), ratio)
    ranked = torch.where(m, cov, torch.full_like(cov, -math.inf)).flatten()
    order = torch.sort(ranked, descending=True, stable=True).indices[:k]
    selected = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    selected[order] = True
    return selected.view_as(cov)


def cov_controlled_loss(loss_mat: Tensor, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                        mode: str, ratio: float, lb: float = 1.0, ub: float = 5.0, kl_coef: float = 1.0,
                        generator: torch.Generator | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """A policy loss's per-token matrix after Clip-Cov or KL-Cov (arXiv:2505.22617 §4), before aggregation.

    Shapes: loss_mat, logp, old_logp, advantages, mask [N, T] -> (loss_mat [N, T], metrics).
        mode="clip_cov": ℓ_i ← 0 on I_clip (those tokens' policy gradient is cut; they still count in the
                         aggregation's normalizer, as in the paper's reference code)
        mode="kl_cov":   ℓ_i ← ℓ_i + kl_coef·|logp_i − old_logp_i| on I_KL (the paper's β·|·|, its code's
                         `ppo_kl_coef * abs(log_prob - old_log_prob)`)
    metrics: cov_selected_frac (selected / valid tokens), cov_mean (the batch's Cov(logp, A), mean of cov_i).
    """
    m = _valid(mask)
    cov = token_covariance(logp, advantages, m)
    if mode == "clip_cov":
        selected = clip_cov_select(cov, m, ratio, lb, ub, generator)
        loss_mat = torch.where(selected, torch.zeros_like(loss_mat), loss_mat)
    elif mode == "kl_cov":
        selected = kl_cov_select(cov, m, ratio)
        loss_mat = loss_mat + torch.where(selected, kl_coef * (logp - old_logp).abs(), torch.zeros_like(loss_mat))
    else:
        raise ValueError(f"unknown covariance entropy control {mode!r}; valid: clip_cov, kl_cov")
    return loss_mat, {"cov_selected_frac": masked_mean(selected.to(logp.dtype), m).detach(),
                      "cov_mean": masked_mean(cov, m)}


def top_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """The loss tokens among the ρ = `quantile` share of highest entropy (algo.top_entropy_quantile; Wang et al. 2025,
    arXiv:2506.01939): with n valid tokens, those whose entropy is at least the ⌈ρ·n⌉-th largest (ties at the threshold
    all kept). The micro-batch's tokens are the population, as for Clip-Cov.

    Shapes: entropy, mask [N, T] -> bool [N, T] (False off the mask)."""
    m = _valid(mask)
    values = entropy.detach()[m]  # [n]
    if values.numel() == 0:
        return m
    k = math.ceil(quantile * values.numel())
    threshold = values.topk(k).values[-1]
    return m & (entropy.detach() >= threshold)


def aggregation_counts(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Normalizer counts of one (micro-)batch: (num_tokens, num_seqs), 0-dim float tensors.

    Shapes: mask [N, T]. num_tokens = number of valid tokens; num_seqs = number of sequences with
    at least one valid token. Sum these over every micro-batch and rank of an optimizer mini-batch
    (all-reduce) and pass the totals to `aggregate`: that is what makes gradient accumulation equal
    one big batch (the verl #5625 pitfall is normalizing per micro-batch).
    """
    m = _valid(mask)
    dtype = torch.get_default_dtype()
    return m.sum().to(dtype), m.any(dim=-1).sum().to(dtype)


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [N, T] to a scalar (docs/algorithms.md, "Policy loss and aggregation").

    With ℓ the loss and m the mask, sums over the rows of THIS (micro-)batch, and normalizers that
    the caller takes over the whole optimizer mini-batch (see `aggregation_counts`):
        token_mean            Σ ℓ·m / num_tokens                                (DAPO, VAPO)
        seq_mean_token_mean   Σ_i (Σ_t ℓ·m / Σ_t m) / num_seqs                  (GRPO)
        seq_mean_token_sum    Σ_i Σ_t ℓ·m / num_seqs
        seq_sum_const         Σ ℓ·m / (num_seqs · max_len)                      (Dr.GRPO)
    Defaults (this batch alone): num_tokens = Σ m; num_seqs = number of sequences with ≥ 1 valid
    token (fully masked rows, e.g. overlong-filtered ones, contribute 0 and are not counted);
    max_len = T. For seq_sum_const pass max_len = L_max (the generation budget), not the padded T
    of a micro-batch, or micro-batches of different widths get different constants.
    A zero normalizer (nothing valid anywhere) yields 0, not NaN.
    Because each mode is a sum over rows divided by a global constant, summing
    aggregate(micro_k, ..., global counts) over micro-batches equals aggregate(whole batch).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    m = _valid(mask)
    masked = torch.where(m, loss_mat, torch.zeros_like(loss_mat))
    tokens_here, seqs_here = aggregation_counts(m)
    if num_tokens is None:
        num_tokens = tokens_here.to(loss_mat.dtype)
    if num_seqs is None:
        num_seqs = seqs_here.to(loss_mat.dtype)
    if mode == "token_mean":
        return masked.sum() / _nonzero_den(num_tokens)
    if mode == "seq_mean_token_mean":
        per_seq_tokens = m.sum(-1).to(loss_mat.dtype)  # [N]
        per_seq = masked.sum(-1) / _nonzero_den(per_seq_tokens)  # [N], 0 for empty rows
        return per_seq.sum() / _nonzero_den(num_seqs)
    if mode == "seq_mean_token_sum":
        return masked.sum() / _nonzero_den(num_seqs)
    width = loss_mat.shape[-1] if max_len is None else max_len
    return masked.sum() / _nonzero_den(num_seqs * width)


# ---------------------------------------------------------------------------------------------------
# Critic
# ---------------------------------------------------------------------------------------------------


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None = 0.5,
    num_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss, token_mean over the mask (docs/algorithms.md#critic-and-other-terms).

    Shapes: values, old_values, returns, mask [N, T] -> (0-dim loss, metrics).
        ℓ = ½ · max((V - ret)², (clip(V, V_old - ε, V_old + ε) - ret)²),  ε = clip_range
    clip_range=None gives the unclipped ½ (V - ret)². num_tokens: the global normalizer over the
    optimizer mini-batch (default: valid tokens of this batch).
    metrics (detached): vf_clipfrac (the clipped term is the larger one), explained_var =
    1 - Var(ret - V) / (Var(ret) + 1e-8) over valid tokens (unbiased variances), values_mean.
    """
    m = _valid(mask)
    unclipped = (values - returns) ** 2
    if clip_range is None:
        loss_mat = 0.5 * unclipped
        clip_active = torch.zeros_like(m)
    else:
        v_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (v_clipped - returns) ** 2
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = aggregate(loss_mat, m, "token_mean", num_tokens=num_tokens)
    with torch.no_grad():
        zero = torch.zeros_like(values)
        n = m.sum().to(values.dtype)

        def _var(x: Tensor) -> Tensor:
            mean = torch.where(m, x, zero).sum() / _nonzero_den(n)
            return torch.where(m, (x - mean) ** 2, zero).sum() / (n - 1).clamp_min(1)

        # Returns with no variance leave nothing to explain: report 0, not the 1 the ratio gives
        # (a constant batch must not look like a perfect critic, e.g. to pretraining's early stop).
        var_ret = _var(returns)
        ev = 1.0 - _var(returns - values) / (var_ret + 1e-8)
        metrics = {
            "vf_clipfrac": masked_mean(clip_active.to(values.dtype), m),
            "explained_var": torch.where(var_ret > 1e-8, ev, torch.zeros_like(ev)),
            "values_mean": masked_mean(values, m),
        }
    return loss, metrics


def positive_example_nll(
    logp: Tensor, mask: Tensor, correct: Tensor, num_tokens: Tensor | float | None = None
) -> Tensor:
    """VAPO's positive-example LM loss (arXiv:2504.05118 §3.4): mean NLL over the tokens of correct
    responses, -Σ_{i: correct} Σ_t logp_it / Σ_{i: correct} |o_i|.

    Shapes: logp [N, T], mask [N, T], correct [N] (bool or 0/1) -> scalar. `num_tokens` is the
    normalizer reduced over the whole mini-batch (all micro-batches and ranks); default: this
    batch's count of correct-response tokens. Incorrect responses get exactly zero gradient.
    """
    m = _valid(mask) & correct.bool()[:, None]  # [N, T]
    if num_tokens is None:
        num_tokens = m.sum()
    nll = -torch.where(m, logp, torch.zeros_like(logp)).sum()
    return nll / torch.as_tensor(num_tokens, dtype=logp.dtype).clamp(min=1)


# ---------------------------------------------------------------------------------------------------
# Reward models (`rlcli rm`)
# ---------------------------------------------------------------------------------------------------


def bradley_terry_loss(
    r_chosen: Tensor, r_rejected: Tensor, margin: Tensor | None = None, center_coef: float = 0.0,
    num_pairs: Tensor | float | None = None,
) -> Tensor:
    """The reward model's loss over preference pairs, Bradley-Terry (InstructGPT, arXiv:2203.02155 eq. 1) with Llama
    2's margin (arXiv:2307.09288 eq. 2) and the reward-centring term (Eisenstein et al. 2023, arXiv:2312.09244; TRL
    RewardTrainer's center_rewards_coefficient):

        Σ_i [ -log σ(r_c,i - r_r,i - m_i) + center_coef · (r_c,i + r_r,i)² ] / num_pairs

    Shapes: r_chosen [N], r_rejected [N], margin [N] or None (m = 0) -> scalar. `num_pairs` is the normalizer over
    the whole mini-batch (all micro-batches and ranks); default N: the mean over these pairs. -log σ(z) is computed as
    softplus(-z), finite for any finite z. Swapping chosen and rejected is a different loss (the model would learn
    the opposite preference); a pair scored equal costs log 2.
    """
    z = r_chosen - r_rejected  # [N]
    if margin is not None:
        z = z - margin
    per_pair = torch.nn.functional.softplus(-z)  # [N] = -log σ(z)
    if center_coef:
        per_pair = per_pair + center_coef * (r_chosen + r_rejected) ** 2
    n = len(per_pair) if num_pairs is None else num_pairs
    return per_pair.sum() / torch.as_tensor(n, dtype=per_pair.dtype).clamp(min=1)


def preference_metrics(r_chosen: Tensor, r_rejected: Tensor) -> dict[str, Tensor]:
    """Means over N preference pairs (r_chosen, r_rejected [N]) -> {accuracy: share with r_c > r_r (a tie is wrong),
    margin: mean r_c - r_r, chosen_mean, rejected_mean}; all 0 for N = 0."""
    if not len(r_chosen):
        zero = torch.zeros(())
        return {"accuracy": zero, "margin": zero, "chosen_mean": zero, "rejected_mean": zero}
    return {
        "accuracy": (r_chosen > r_rejected).float().mean(),
        "margin": (r_chosen - r_rejected).float().mean(),
        "chosen_mean": r_chosen.float().mean(),
        "rejected_mean": r_rejected.float().mean(),
    }
