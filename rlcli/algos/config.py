"""`algo` config group schema: every knob of the math, with its default and its paper.

Defaults here are plain PPO/GRPO defaults; the presets in conf/algo/*.yaml set the paper values.
`validate` is called by the config loader at compose time (rlcli.config.validate).

Papers cited by arXiv id: PPO 1707.06347, GAE 1506.02438, GRPO (DeepSeekMath) 2402.03300,
DAPO 2503.14476, Dr.GRPO 2503.20783, VAPO 2504.05118, RLOO 2402.14740, REINFORCE++ 2501.03262,
adaptive KL (Ziegler et al.) 1909.08593, dual clip (Ye et al.) 1912.09729, GSPO 2507.18071, CISPO
(MiniMax-M1) 2506.13585, adaptive entropy control (Skywork-OR1) 2505.22312, Clip-Cov / KL-Cov (Cui et al.) 2505.22617. Fields marked "rlcli option" are variants that come from no paper: off by
default, documented in docs/algorithms.md#rlcli-options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcli.core.names import (
    ADVANTAGES,
    AGG_MODES,
    ENTROPY_CONTROLS,
    KL_ESTIMATORS,
    OFF_POLICY,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_LEVELS,
    TOKEN_RATIO_LOSSES,
)
from rlcli.core.schema import ConfigError, check_ranges, rng
from rlcli.core.topology import staleness

BASELINE_WEIGHTS = ("inv_sqrt_len", "uniform")
"""`weighted_baseline` estimator weights (algo.baseline_weights)."""


@dataclass
class AlgoConfig:
    name: str = "grpo"
    """Preset name, for logs and run names (set by conf/algo/<name>.yaml)."""

    # --- advantage estimation (docs/algorithms.md, "Advantage estimators") ---------------------
    adv_estimator: str = rng("grpo", choices=ADVANTAGES)
    """ADVANTAGES registry name: grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae |
    rank | weighted_baseline | hierarchical | vapo_grpo_hybrid | pkpo | grpo_passk | maxrl | none."""
    gamma: float = rng(1.0, ge=0, le=1)
    """Discount γ over response tokens (GAE and token-level returns; 1.0 for outcome rewards)."""
    lam_actor: float = rng(0.95, ge=0, le=1)
    """GAE λ for the actor's advantages (VAPO decoupled GAE: 0.95); plain PPO sets both λ equal."""
    lam_critic: float = rng(0.95, ge=0, le=1)
    """GAE λ for the critic's return targets (VAPO decoupled GAE: 1.0, i.e. Monte-Carlo returns)."""
    length_adaptive_gae: bool = False
    """VAPO length-adaptive GAE: the actor's λ is 1 - 1/(α·l_i) per sequence instead of lam_actor."""
    length_adaptive_alpha: float = rng(0.05, gt=0, why="VAPO: 0.05")
    """α of length-adaptive GAE (VAPO: 0.05). α·l_i is the horizon, so α scales inversely with response
    length: a scale knob, set by model presets (model=tiny: 1.0)."""
    whiten_advantages: bool = True
    """Whiten advantages over the batch's valid tokens (gae, vapo_grpo_hybrid's GAE part, reinforce_pp,
    reinforce_pp_baseline); group estimators normalise per group and ignore it."""

    # --- policy loss and aggregation (docs/algorithms.md, "Policy loss") -----------------------
    policy_loss: str = rng("clipped", choices=POLICY_LOSSES)
    """POLICY_LOSSES registry name: clipped (PPO/GRPO/DAPO token-ratio surrogate) | gspo (GSPO,
    sequence-level ratio) | cispo (CISPO, clipped stop-gradient IS weight on logp)."""
    clip_low: float = rng(0.2, ge=0, le=1, why="the ratio is clipped below at 1 - clip_low; 1 = no lower bound")
    """ε_low: the ratio is clipped below at 1 - clip_low (PPO 0.2; GSPO 3e-4; CISPO 1.0 = no lower
    bound, ratios being ≥ 0)."""
    clip_high: float = rng(0.2, ge=0)
    """ε_high: the ratio is clipped above at 1 + clip_high (DAPO clip-higher: 0.28; GSPO 4e-4)."""
    dual_clip: float | None = rng(None, gt=1, why="e.g. 3 or 10; null = off")
    """Dual-clip constant c > 1 bounding the loss of A < 0 tokens at -A·c (Ye et al. 2020; DAPO script: 10)."""
    ratio_clamp: float | None = rng(None, gt=1, why="e.g. 10; null = off")
    """rlcli option (not from a paper): hard-clamp the ratio to [1/C, C] before the surrogate (C = 10);
    null = off."""
    loss_agg: str = rng("seq_mean_token_mean", choices=AGG_MODES)
    """Loss aggregation: token_mean (DAPO, VAPO) | seq_mean_token_mean (GRPO) | seq_mean_token_sum |
    seq_sum_const (Dr.GRPO). Normalizers span the whole optimizer mini-batch."""
    seq_reweight_alpha: float | None = rng(None, ge=0, why="null = off")
    """rlcli option (not from a paper): scale each sequence's advantages by (l_i/L_median)^(-α) (α in [0, 0.5]);
    null = off."""
    ppo_epochs: int = rng(1, ge=1)
    """Passes over each rollout batch (GRPO's μ); 1 epoch with 1 mini-batch is exactly on-policy."""
    mini_batches: int = rng(1, ge=1)
    """Optimizer steps per epoch; each mini-batch holds whole groups."""

    # --- KL to the reference policy ------------------------------------------------------------
    kl_coef: float = rng(0.0, ge=0, why="0 turns the KL term and the reference model off")
    """β: weight of the KL to the reference policy; 0 = no reference model is loaded at all."""
    kl_estimator: str = rng("k3", choices=KL_ESTIMATORS)
    """KL_ESTIMATORS name: k1 | k2 | k3 (Schulman 2020, 'Approximating KL divergence')."""
    kl_in_reward: bool = False
    """True: r_t -= β·k(old_logp, ref_logp) per token (PPO/RLOO/REINFORCE++); False: + β·k in the loss (GRPO)."""
    kl_target: float | None = rng(None, gt=0, why="null = fixed β")
    """Adaptive KL controller target (Ziegler et al. 2019); null = fixed β."""
    kl_horizon: int = rng(10000, ge=1)
    """Adaptive KL controller horizon, in trajectories (Ziegler et al. 2019)."""

    # --- extra loss terms ----------------------------------------------------------------------
    entropy_coef: float = rng(0.0, ge=0)
    """c_ent: entropy bonus weight (loss -= c_ent·H); with entropy_control=adaptive, its starting value c_0."""

    # --- entropy control (docs/algorithms.md#entropy-control) ----------------------------------
    entropy_control: str = rng("none", choices=ENTROPY_CONTROLS)
    """none (a fixed entropy_coef) | adaptive (Skywork-OR1, arXiv:2505.22312: the bonus coefficient moves by
    entropy_coef_delta toward entropy_target) | clip_cov | kl_cov (Cui et al. 2025, arXiv:2505.22617: cut the gradient
    of, or put a KL penalty on, the tokens of largest covariance between log-prob and advantage)."""
    entropy_target: float | None = rng(None, gt=0, why="Skywork-OR1: 0.2; null = unset, required by adaptive")
    """adaptive: the target token entropy (nats, of the temperature-scaled policy); the bonus is on while the measured
    entropy is below it (Skywork-OR1: 0.2)."""
    entropy_coef_delta: float = rng(0.005, gt=0)
    """adaptive: Δ, the step of the coefficient after each training step, up below the target, down above it
    (Skywork-OR1: 0.005)."""
    entropy_coef_max: float = rng(0.1, ge=0)
    """adaptive: the coefficient is clipped to [0, entropy_coef_max] (an rlcli bound that keeps a long stretch below
    the target from growing the bonus without limit)."""
    clip_cov_ratio: float = rng(2e-4, gt=0, le=1)
    """clip_cov: fraction r of the loss tokens whose gradient is cut, drawn among those with clip_cov_lb ≤ cov ≤
    clip_cov_ub (Cui et al.: 2e-4)."""
    clip_cov_lb: float = rng(1.0, why="Cui et al.: 1; must be ≤ clip_cov_ub")
    """clip_cov: lower bound ω_low of the covariance band tokens are drawn from (Cui et al.: 1)."""
    clip_cov_ub: float = rng(5.0, why="Cui et al.: 5; must be ≥ clip_cov_lb")
    """clip_cov: upper bound ω_high of the covariance band (Cui et al.: 5)."""
    kl_cov_ratio: float = rng(2e-3, gt=0, le=1)
    """kl_cov: fraction k of the loss tokens, those of largest covariance, that get the KL penalty (Cui et al.:
    2e-3 for 7B models, 2e-4 for 32B)."""
    kl_cov_coef: float = rng(1.0, gt=0)
    """kl_cov: β of the penalty β·|logp − old_logp| on the selected tokens (Cui et al.: 1)."""
    top_entropy_quantile: float = rng(1.0, gt=0, le=1)
    """ρ: the policy-gradient loss is kept on the ρ share of each micro-batch's loss tokens of highest entropy, the
    "forking" tokens, and zeroed on the rest, which still count in the aggregation's normalizer (Wang et al. 2025,
    "Beyond the 80/20 Rule", arXiv:2506.01939: ρ = 0.2); 1 = every token. The entropy bonus and KL terms keep every
    token."""
    nll_coef: float = rng(0.0, ge=0)
    """μ: VAPO positive-example LM loss weight, NLL over responses with acc = 1 (paper: 0.1)."""

    # --- reward shaping and sampling (DAPO, arXiv:2503.14476 §3.2, §3.4) -----------------------
    overlong_filter: bool = False
    """DAPO overlong filtering: truncated responses get no loss (mask 0) but keep their reward."""
    soft_overlong: bool = False
    """DAPO soft overlong punishment: a linear penalty in the last rollout.overlong_buffer_len tokens."""
    overlong_penalty_factor: float = rng(1.0, ge=0)
    """Scale of the soft overlong punishment added to the task reward."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: keep only groups whose filter metric varies (0 < #correct < G), refill."""
    filter_metric: str = rng("acc", choices=("acc", "score"), why="acc: verified correctness, DAPO; score: the shaped reward")
    """Per-trajectory metric whose zero within-group variance drops a group under dynamic sampling:
    acc | score."""
    max_gen_batches: int = rng(10, ge=1)
    """Dynamic sampling: generation batches allowed per step before failing (or training on fewer)."""
    train_on_partial: bool = False
    """Dynamic sampling: when max_gen_batches runs out, train on the groups kept so far instead of failing."""

    pass_k: int = rng(1, ge=1)
    """k of the pass@k objective that `adv_estimator=pkpo` trains for (2 <= k <= rollout.n; 1 = pass@1, the
    other estimators' objective)."""

    # --- rlcli estimator options (not from a paper; docs/algorithms.md#rlcli-options) ----------
    hierarchical_alpha: float = rng(0.5, ge=0, le=1)
    """`hierarchical` estimator: weight α of the within-group advantage vs the whole-batch one."""
    hybrid_alpha0: float = rng(1.0, ge=0, le=1)
    """`vapo_grpo_hybrid`: α_0 in α(t) = α_0·exp(-κ t/T), the weight of the GAE advantage."""
    hybrid_kappa: float = rng(5.0, ge=0)
    """`vapo_grpo_hybrid`: decay rate κ of α(t)."""
    baseline_weights: str = rng("inv_sqrt_len", choices=BASELINE_WEIGHTS)
    """`weighted_baseline` estimator weights: inv_sqrt_len (1/sqrt(|y|)) | uniform."""

    # --- VAPO switches (arXiv:2504.05118 §3); their scale lives in `critic` and `rollout` ---------
    value_pretrain: bool = False
    """VAPO value pretraining: before any actor update, train only the critic on λ=1 returns of the
    frozen initial policy for critic.pretrain_steps steps (50 in the paper)."""
    group_sampling: bool = True
    """Sample rollout.n responses for each of rollout.prompts_per_step prompts (every group estimator, and
    VAPO §4.3 "Group-Sampling"). false = VAPO's vanilla-PPO use of the same budget: P*G prompts, each
    sampled once (only for estimators that need no groups: gae, reinforce_pp)."""

    # --- rollout correction: the sampler's log-probs differ from the trainer's -----------------
    rollout_correction: str = rng("none", choices=("none", *ROLLOUT_CORRECTION_LEVELS))
    """Importance weights π_trainer/π_sampler on the policy loss (functional.rollout_correction_weights):
    none | token | sequence (one weight per response, from its summed log ratio)."""
    rollout_correction_upper: float | None = rng(2.0, gt=0, why="TIS: 2; null = none")
    """Upper bound C of the weights: truncated IS min(w, C) (TIS, Yao et al. 2025: 2); null = none."""
    rollout_correction_lower: float | None = rng(None, ge=0, why="null = truncate only")
    """Lower bound: weights outside [lower, upper] are zeroed (masked IS, IcePop) instead of truncated;
    null = truncate only."""

    # --- off-policy rows: asynchronous rollout (docs/async.md) -------------------
    off_policy: str = rng("auto", choices=OFF_POLICY)
    """What the update takes as the old policy of rows a lagging sampler generated: recompute (the trainer's
    log-probs under this step's weights: the ratio ignores the lag; the synchronous loop) | bypass (the sampler's
    own log-probs: the PPO ratio and its clip span the whole lag; TRL's async GRPO, prime-rl) | decoupled (AReaL's
    decoupled PPO, arXiv:2505.24298: the clip around the proximal policy, this step's weights, and each token
    weighted by π_prox/μ, zeroed above algo.behav_weight_cap, or shaped by algo.rollout_correction when set) |
    auto = decoupled when rollout.async.max_staleness > 0, else recompute."""
    behav_weight_cap: float | None = rng(None, gt=0, why="null = no cap")
    """off_policy=decoupled: tokens whose behaviour weight π_prox/μ exceeds this get weight 0 (AReaL's rule);
    null = no cap."""

    # --- critic (docs/algorithms.md#critic-and-other-terms) ------------------------------------
    value_clip: float | None = rng(0.5, gt=0, why="null = unclipped")
    """ε_v: value-loss clip range around the old values; null = unclipped."""


def validate(cfg: Any) -> None:
    """Check every field against its declared range or choices, then the rules that relate fields; raise
    ConfigError. `cfg` is an AlgoConfig or the composed `algo` DictConfig. Messages name the key and the fix."""
    check_ranges(cfg, AlgoConfig, "algo.")
    if cfg.kl_target is not None and cfg.kl_coef == 0:
        raise ConfigError(
            f"algo.kl_target={cfg.kl_target} needs an initial algo.kl_coef > 0: the adaptive controller "
            "multiplies β, so it would stay 0; set algo.kl_coef (e.g. 0.01) or algo.kl_target=null"
        )
    if cfg.kl_target is not None and not cfg.kl_in_reward:
        raise ConfigError(
            f"algo.kl_target={cfg.kl_target} adapts β of the KL penalty in the reward (Ziegler et al. 2019), "
            "but algo.kl_in_reward=false puts the KL in the loss with a fixed β: set algo.kl_in_reward=true "
            "or algo.kl_target=null"
        )
    validate_entropy_control(cfg)
    upper, lower = cfg.rollout_correction_upper, cfg.rollout_correction_lower
    if lower is not None and upper is not None and not lower < upper:
        raise ConfigError(
            f"algo.rollout_correction_lower={lower} must be below algo.rollout_correction_upper={upper} (weights "
            "outside [lower, upper] are zeroed), or null"
        )


ADAPTIVE_ONLY = ("entropy_target", "entropy_coef_delta", "entropy_coef_max")
CLIP_COV_ONLY = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")
KL_COV_ONLY = ("kl_cov_ratio", "kl_cov_coef")


def validate_entropy_control(cfg: Any) -> None:
    """algo.entropy_control against the knobs it reads and the policy loss it edits (ConfigError, one line each)."""
    mode, defaults = cfg.entropy_control, AlgoConfig()
    for only, owner in ((ADAPTIVE_ONLY, "adaptive"), (CLIP_COV_ONLY, "clip_cov"), (KL_COV_ONLY, "kl_cov")):
        changed = [k for k in only if getattr(cfg, k) != getattr(defaults, k)]
        if changed and mode != owner:
            raise ConfigError(
                f"algo.{changed[0]}={getattr(cfg, changed[0])} is read only by algo.entropy_control={owner}, but "
                f"algo.entropy_control={mode}: set algo.entropy_control={owner} or drop algo.{changed[0]}"
            )
    if mode == "adaptive" and cfg.entropy_target is None:
        raise ConfigError("algo.entropy_control=adaptive needs algo.entropy_target, the entropy (nats) it steers "
                          "toward: set it (Skywork-OR1: algo.entropy_target=0.2)")
    if mode == "adaptive" and cfg.entropy_coef > cfg.entropy_coef_max:
        raise ConfigError(f"algo.entropy_coef={cfg.entropy_coef} starts above algo.entropy_coef_max="
                          f"{cfg.entropy_coef_max}, the adaptive coefficient's clip: raise algo.entropy_coef_max or "
                          "lower algo.entropy_coef")
    if mode in ("clip_cov", "kl_cov") and cfg.policy_loss not in TOKEN_RATIO_LOSSES:
        raise ConfigError(
            f"algo.entropy_control={mode} cuts or penalises single tokens, but algo.policy_loss={cfg.policy_loss} "
            f"has one ratio per sequence: use algo.policy_loss={' or '.join(sorted(TOKEN_RATIO_LOSSES))}, or "
            "algo.entropy_control=none|adaptive"
        )
    if cfg.top_entropy_quantile < 1 and cfg.policy_loss not in TOKEN_RATIO_LOSSES:
        raise ConfigError(
            f"algo.top_entropy_quantile={cfg.top_entropy_quantile} trains single tokens, but algo.policy_loss="
            f"{cfg.policy_loss} has one ratio per sequence: use algo.policy_loss="
            f"{' or '.join(sorted(TOKEN_RATIO_LOSSES))}, or algo.top_entropy_quantile=1"
        )
    if mode == "clip_cov" and not cfg.clip_cov_lb <= cfg.clip_cov_ub:
        raise ConfigError(f"algo.clip_cov_lb={cfg.clip_cov_lb} must be <= algo.clip_cov_ub={cfg.clip_cov_ub}: the "
                          "tokens are drawn from the covariance band [lb, ub] (Cui et al.: 1 and 5)")


@dataclass
class DistillConfig:
    """On-policy distillation (docs/usage.md, "Distillation"): the student samples, a frozen teacher scores every sampled
    token, and coef x (log π_teacher(y_t) − log π_student(y_t)) joins the algorithm's advantage per token."""

    teacher: str | None = None
    """The teacher: a local Hugging Face model directory (a run's <run>/policy works) or a model preset's name
    (conf/model/, e.g. tiny_exact_carry); null = no distillation. Its tokenizer must be the student's (the same
    vocabulary and ids), checked before any weights load. Loaded once, frozen, in eval mode, in the student's dtype;
    sharded like the reference model under ZeRO-3. `self` = self-distillation: the policy itself (its current
    weights, no gradient), shown distill.privileged around the prompt; no second model is loaded."""
    privileged: str = "Reference answer: {answer}\n{prompt}"
    """distill.teacher=self: what the teacher reads instead of the prompt, {prompt} (the prompt's own tokens, never
    encoded again) with text around it, where {answer} is the row's ground truth. "{prompt}" alone = the student's
    own prompt: the teacher is then the student and the distillation advantage exactly 0."""
    coef: float = rng(1.0, ge=0)
    """Weight of the per-token distillation advantage coef x (log π_teacher(y_t) − log π_student(y_t)) on the sampled
    tokens, added to algo's advantage (algo=distill: the only one)."""
    full_kl_coef: float = rng(0.0, ge=0)
    """Weight of the exact reverse KL over the whole vocabulary, KL(π_student ‖ π_teacher) at every response
    position, as a loss term aggregated like the policy loss (GKD's reverse-KL objective, arXiv:2306.13649). 0 = off;
    it costs a teacher forward per update micro-batch and [rows, T, vocab] fp32 of the teacher's log-probs."""
    discount: float = rng(0.0, ge=0, le=1)
    """γ of the distillation advantage over response tokens: coef x Σ_{k≥t} γ^(k−t) r_k. 0 = each token's own reward
    (Thinking Machines' choice); 1 = the reverse KL of the rest of the response."""
    unlikely_p: float = rng(0.01, gt=0, lt=1)
    """distill/unlikely_frac counts the sampled tokens to which the teacher gives a probability below this."""


SELF = "self"
"""distill.teacher of self-distillation."""


def privileged_parts(template: str, answer: str) -> tuple[str, str]:
    """distill.privileged's text before and after {prompt}, with {answer} filled in (ValueError where {prompt} is not
    there exactly once; KeyError for another field)."""
    if template.count("{prompt}") != 1:
        raise ValueError("it must hold {prompt} exactly once")
    before, after = template.split("{prompt}")
    return before.format(answer=answer), after.format(answer=answer)


def validate_distill(cfg: Any) -> None:
    """The distill group against the algorithm (root config `cfg`)."""
    check_ranges(cfg.distill, DistillConfig, "distill.")
    d = cfg.distill
    if d.teacher and d.coef == 0 and d.full_kl_coef == 0:
        raise ConfigError(f"distill.teacher={d.teacher} with distill.coef=0 and distill.full_kl_coef=0 would load a "
                          "teacher that teaches nothing: set distill.coef (e.g. 1.0) or distill.full_kl_coef")
    if d.teacher == SELF:
        if d.full_kl_coef > 0:
            raise ConfigError(f"distill.teacher=self with distill.full_kl_coef={d.full_kl_coef}: the full-vocabulary KL "
                              "needs the teacher's distributions at the student's positions, which a teacher reading "
                              "another prompt does not give in the same update pass; use distill.coef (the sampled "
                              "tokens' advantage) with teacher=self")
        try:
            privileged_parts(d.privileged, "0")
        except (KeyError, IndexError, ValueError) as err:
            raise ConfigError(f"distill.privileged={d.privileged!r}: {err}: write text around {{prompt}} (once), "
                              "with {answer} where the ground truth goes") from None
    elif d.privileged != DistillConfig.privileged:
        raise ConfigError(f"distill.privileged is read by distill.teacher=self only, but distill.teacher={d.teacher}: "
                          "set distill.teacher=self (or drop distill.privileged)")
    if cfg.algo.adv_estimator == "none" and not cfg.distill.teacher:
        raise ConfigError(f"algo={cfg.algo.name} (algo.adv_estimator=none) learns only from a teacher: set "
                          "distill.teacher=<a model directory>, e.g. a trained run's <run>/policy")


def off_policy(cfg: Any) -> str:
    """algo.off_policy with auto resolved: decoupled when rollout.async.max_staleness > 0, else recompute."""
    if cfg.algo.off_policy != "auto":
        return cfg.algo.off_policy
    return "decoupled" if staleness(cfg) > 0 else "recompute"
