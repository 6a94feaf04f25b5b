"""Advantage estimators: registry `ADVANTAGES`, one signature for all (docs/algorithms.md).

    fn(inp: AdvantageInputs, cfg) -> (advantages [N, T], returns [N, T])

`cfg` is an `rlcli.algos.config.AlgoConfig` or the composed `algo` DictConfig, hence annotated `Any`.

`returns` are the critic's targets for estimators that need values (NEEDS_VALUES) and equal the
advantages otherwise. Both are 0 at masked positions. The trainer calls `compute_advantages`,
which looks the estimator up, runs it without gradients and applies the sequence-reweight option.

Outcome-level estimators (grpo, dr_grpo, rloo, rank, weighted_baseline, hierarchical) compute one
number a_i per trajectory and put it where the outcome reward sat, on the last valid token; the
token advantage is then the reward-to-go of those token rewards. Without KL in the reward and with
γ = 1 this is exactly a_i broadcast over the response tokens (× mask); with KL in the reward
(rloo and ppo presets) each token also carries the discounted sum of the -β·KL_t that follow it,
as in OpenRLHF's RLOO. The outcome-level a_i itself never sees the KL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlcli.algos import functional as F
from rlcli.core import names
from rlcli.core.names import GROUP_ESTIMATORS, NEEDS_VALUES  # noqa: F401 (re-exported: rlcli.algos)
from rlcli.core.registry import Registry


@dataclass
class AdvantageInputs:
    scores: Tensor
    """[N] shaped outcome reward per trajectory (task reward + soft overlong punishment)."""
    token_rewards: Tensor
    """[N, T] `scores` on the last valid token, minus β·KL_t on every token when KL is in the reward."""
    mask: Tensor
    """[N, T] loss mask (response mask minus overlong-filtered rows), bool or 0/1 float: rewards sit on
    its last valid token, and whitening statistics are taken over it (tokens that get no loss do not
    shift the advantages of those that do)."""
    group_index: Tensor
    """[N] int, equal for responses to the same prompt."""
    lengths: Tensor
    """[N] response lengths in tokens (of the response itself, even if its mask row was filtered)."""
    values: Tensor | None = None
    """[N, T] critic values at sampling time; None without a critic."""
    step: int = 0
    """Current training step (schedules such as the VAPO-GRPO hybrid α(t))."""
    total_steps: int = 1
    """Planned training steps."""
    reduce: Callable[[Tensor], Tensor] | None = None
    """Sum over data-parallel ranks (whitening statistics over the whole batch); None in one process."""


ADVANTAGES = Registry(names.ADVANTAGES)


def outcome_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """The outcome reward as a token tensor: each trajectory's score [N] on its last generated token (the
    last valid position of response_mask [N, T], which in a multi-turn row is not its length - 1: observation
    tokens sit between turns), 0 elsewhere; an empty row holds it on position 0. -> [N, T]"""
    n, t = response_mask.shape
    positions = torch.arange(t).expand(n, t)  # [N, T]
    last = torch.where(F._valid(response_mask), positions, torch.zeros_like(positions)).amax(-1)  # [N]
    rewards = torch.zeros(n, t)  # [N, T]
    rewards[torch.arange(n), last] = scores
    return rewards


def compute_advantages(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """Run `ADVANTAGES[cfg.adv_estimator]` without gradients, then the optional sequence reweight.

    Shapes: -> (advantages [N, T], returns [N, T]). With `cfg.seq_reweight_alpha` set, each row of
    the advantages is scaled by w_i = (l_i/L_median)^(-α): for the clipped surrogate, scaling A by
    w > 0 scales the token loss by w, so this is a sequence-level loss reweighting (an rlcli option,
    not from a paper; docs/algorithms.md#rlcli-options), done
    once over the whole batch (a per-micro-batch median would depend on memory settings).
    """
    estimator = ADVANTAGES[cfg.adv_estimator]
    with torch.no_grad():
        adv, returns = estimator(inp, cfg)
        if cfg.seq_reweight_alpha is not None:
            adv = adv * F.sequence_reweight(inp.lengths, cfg.seq_reweight_alpha)[:, None]  # [N, T]
    return adv, returns


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------


def _last_valid(mask: Tensor) -> Tensor:
    """[N, T] bool, True at each row's last valid token (all False for an empty row)."""
    m = F._valid(mask)
    t_len = m.shape[1]
    if t_len == 0:
        return m.clone()
    last = t_len - 1 - torch.flip(m.to(torch.int8), dims=[1]).argmax(dim=1)  # [N]
    onehot = torch.zeros_like(m).scatter_(1, last[:, None], True)
    return onehot & m.any(dim=1, keepdim=True)


def _outcome_to_tokens(inp: AdvantageInputs, outcome_adv: Tensor, gamma: float) -> Tensor:
    """Swap the outcome reward on the last token for the outcome advantage; reward-to-go. [N, T]."""
    last = _last_valid(inp.mask)
    swapped = inp.token_rewards - inp.scores[:, None] + outcome_adv[:, None]  # [N, T], used at `last`
    rewards = torch.where(last, swapped, inp.token_rewards)
    return F.discounted_returns(rewards, inp.mask, gamma)


def _require_values(inp: AdvantageInputs, name: str) -> Tensor:
    if inp.values is None:
        raise ValueError(
            f"algo.adv_estimator={name} needs critic values (AdvantageInputs.values is None): "
            "the trainer must build a critic for the estimators in NEEDS_VALUES"
        )
    return inp.values


def _whiten(x: Tensor, inp: AdvantageInputs, cfg: Any) -> Tensor:
    return F.masked_whiten(x, inp.mask, reduce=inp.reduce) if cfg.whiten_advantages else x


def _same(x: Tensor) -> tuple[Tensor, Tensor]:
    return x, x


# ---------------------------------------------------------------------------------------------------
# estimators
# ---------------------------------------------------------------------------------------------------


@ADVANTAGES.register("none")
def no_advantage(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """Zero task advantage: the policy learns only from terms added after this stage (on-policy distillation's
    per-token signal, `algo=distill`)."""
    return _same(torch.zeros_like(inp.mask, dtype=torch.float32))


@ADVANTAGES.register("grpo")
def grpo(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """GRPO (arXiv:2402.03300): (R - mean_g)/(std_g + 1e-6) per group, on every response token."""
    a = F.group_advantages(inp.scores, inp.group_index, std_normalize=True)
    return _same(_outcome_to_tokens(inp, a, cfg.gamma))


@ADVANTAGES.register("dr_grpo")
def dr_grpo(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """Dr.GRPO (arXiv:2503.20783): R - mean_g, no std division."""
    a = F.group_advantages(inp.scores, inp.group_index, std_normalize=False)
    return _same(_outcome_to_tokens(inp, a, cfg.gamma))


@ADVANTAGES.register("rloo")
def rloo(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """RLOO (arXiv:2402.14740): R_i minus the mean of the other G-1 responses."""
    a = F.rloo_advantages(inp.scores, inp.group_index)
    return _same(_outcome_to_tokens(inp, a, cfg.gamma))


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (arXiv:2501.03262): reward-to-go of the token rewards, whitened over the batch."""
    returns = F.discounted_returns(inp.token_rewards, inp.mask, cfg.gamma)
    return _same(_whiten(returns, inp, cfg))


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262): whiten(R_i - mean_g) over the batch (plus KL-to-go)."""
    a = F.group_advantages(inp.scores, inp.group_index, std_normalize=False)
    return _same(_whiten(_outcome_to_tokens(inp, a, cfg.gamma), inp, cfg))


def _gae_parts(inp: AdvantageInputs, cfg: Any, name: str) -> tuple[Tensor, Tensor]:
    """(actor advantages, critic returns), VAPO-decoupled: returns use λ_critic, advantages λ_actor."""
    values = _require_values(inp, name)
    lam_actor: float | Tensor = cfg.lam_actor
    if cfg.length_adaptive_gae:
        lam_actor = F.length_adaptive_lambda(inp.lengths, cfg.length_adaptive_alpha)  # [N]
    adv, returns = F.gae(inp.token_rewards, values, inp.mask, cfg.gamma, cfg.lam_critic)
    if cfg.length_adaptive_gae or cfg.lam_actor != cfg.lam_critic:
        adv, _ = F.gae(inp.token_rewards, values, inp.mask, cfg.gamma, lam_actor)
    return _whiten(adv, inp, cfg), returns  # returns are taken before whitening


@ADVANTAGES.register("gae")
def gae(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """PPO's GAE (arXiv:1506.02438) with VAPO's decoupled and length-adaptive λ (arXiv:2504.05118)."""
    return _gae_parts(inp, cfg, "gae")


@ADVANTAGES.register("rank")
def rank(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """rlcli option (not from a paper): (rank_i - (G+1)/2)/(G/2) within the group, ties averaged."""
    a = F.rank_advantages(inp.scores, inp.group_index)
    return _same(_outcome_to_tokens(inp, a, cfg.gamma))


@ADVANTAGES.register("weighted_baseline")
def weighted_baseline(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """rlcli option (not from a paper): R_i - Σ w_j R_j / Σ w_j, w_j = 1/sqrt(|y_j|).

    Weights chosen by cfg.baseline_weights (inv_sqrt_len | uniform).
    """
    lengths = inp.lengths.to(F._float(inp.scores).dtype)  # [N]
    if cfg.baseline_weights == "inv_sqrt_len":
        weights = lengths.clamp_min(1.0).rsqrt()
    elif cfg.baseline_weights == "uniform":
        weights = torch.ones_like(lengths)
    else:
        raise ValueError(
            f"algo.baseline_weights={cfg.baseline_weights!r}; valid names: inv_sqrt_len, uniform"
        )
    a = F.weighted_baseline_advantages(inp.scores, inp.group_index, weights)
    return _same(_outcome_to_tokens(inp, a, cfg.gamma))


@ADVANTAGES.register("hierarchical")
def hierarchical(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """rlcli option (not from a paper): α·A_group + (1-α)·A_batch, α = cfg.hierarchical_alpha."""
    a = F.hierarchical_advantages(inp.scores, inp.group_index, cfg.hierarchical_alpha)
    return _same(_outcome_to_tokens(inp, a, cfg.gamma))


@ADVANTAGES.register("pkpo")
def pkpo(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """PKPO (arXiv:2505.15201): each response's unbiased credit for pass@k (max@k), k = algo.pass_k."""
    a = F.pkpo_advantages(inp.scores, inp.group_index, cfg.pass_k)
    return _same(_outcome_to_tokens(inp, a, cfg.gamma))


@ADVANTAGES.register("grpo_passk")
def grpo_passk(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """Pass@k as verl's GRPO_PASSK (arXiv:2503.19595): the best response's margin over the second, std-normalised;
    every other response 0."""
    a = F.best_of_group_advantages(inp.scores, inp.group_index)
    return _same(_outcome_to_tokens(inp, a, cfg.gamma))


@ADVANTAGES.register("maxrl")
def maxrl(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """MaxRL (arXiv:2602.02710): (R - mean_g) / mean_g, the gradient of log pass rate."""
    a = F.maxrl_advantages(inp.scores, inp.group_index)
    return _same(_outcome_to_tokens(inp, a, cfg.gamma))


@ADVANTAGES.register("vapo_grpo_hybrid")
def vapo_grpo_hybrid(inp: AdvantageInputs, cfg: Any) -> tuple[Tensor, Tensor]:
    """rlcli option (not from a paper): α(t)·A_gae + (1-α(t))·A_grpo, α(t) = α_0·exp(-κ t/T).

    Returns come from GAE.
    """
    adv_gae, returns = _gae_parts(inp, cfg, "vapo_grpo_hybrid")
    adv_grpo, _ = grpo(inp, cfg)
    alpha = F.hybrid_alpha(inp.step, inp.total_steps, cfg.hybrid_alpha0, cfg.hybrid_kappa)
    return alpha * adv_gae + (1.0 - alpha) * adv_grpo, returns
