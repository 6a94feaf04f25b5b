"""The algorithm registries, the AlgoConfig schema and validation, the conf/algo presets.

Run: pytest -q tests/test_algo_registry.py (CPU, seconds).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlcli.algos import (
    ADVANTAGES,
    AGG_MODES,
    KL_ESTIMATORS,
    NEEDS_VALUES,
    POLICY_LOSSES,
    AdaptiveKLController,
    AdvantageInputs,
    AlgoConfig,
    FixedKLController,
    build_kl_controller,
    compute_advantages,
    validate,
)
from rlcli.algos import functional as F

CONF = Path(__file__).resolve().parents[1] / "conf" / "algo"
D = torch.float64


def make_inputs(kl_beta: float = 0.0, with_values: bool = True) -> AdvantageInputs:
    """N=7: group 10 = rows 0,2,5 ; group 4 = rows 1,3 ; group 99 = row 4 (singleton) ; group 4 also
    row 6, whose mask row is empty (overlong-filtered). Ragged right padding, T=6."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 3, 1, 4, 2, 5, 6])
    mask = torch.arange(6)[None, :] < lengths[:, None]  # [N, T]
    mask[6] = False
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], dtype=D)
    kl = torch.rand(7, 6, generator=g, dtype=D)  # [N, T] per-token KL estimate
    last = torch.zeros_like(mask)  # [N, T] the last valid token carries the outcome
    for i, n in enumerate(lengths.tolist()):
        last[i, n - 1] = bool(mask[i].any())
    token_rewards = torch.where(last, scores[:, None], 0.0) - kl_beta * torch.where(mask, kl, 0.0)
    values = torch.randn(7, 6, generator=g, dtype=D) if with_values else None
    return AdvantageInputs(
        scores=scores,
        token_rewards=token_rewards,
        mask=mask,
        group_index=torch.tensor([10, 4, 10, 4, 99, 10, 4]),
        lengths=lengths,
        values=values,
        step=3,
        total_steps=10,
    )


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
@pytest.mark.parametrize("kl_beta", [0.0, 0.05])
def test_every_estimator_is_finite_and_zero_when_masked(name, kl_beta):
    inp = make_inputs(kl_beta)
    cfg = AlgoConfig(adv_estimator=name, length_adaptive_gae=name == "gae", pass_k=2 if name == "pkpo" else 1)
    validate(cfg)
    adv, ret = compute_advantages(inp, cfg)
    for x in (adv, ret):
        assert x.shape == (7, 6)
        assert torch.isfinite(x).all()
        assert (x[~inp.mask] == 0).all()
        assert not x.requires_grad
    if name == "none":  # algo=distill: the task adds nothing; the teacher's term comes after this stage
        assert (adv == 0).all() and (ret == 0).all()
    else:
        assert adv[inp.mask].abs().sum() > 0


def test_needs_values_is_a_subset_and_enforced():
    assert set(NEEDS_VALUES) == {"gae", "vapo_grpo_hybrid"}
    assert set(NEEDS_VALUES).issubset(ADVANTAGES)
    for name in NEEDS_VALUES:
        with pytest.raises(ValueError, match="needs critic values"):
            compute_advantages(make_inputs(with_values=False), AlgoConfig(adv_estimator=name))


def test_outcome_estimators_broadcast_over_valid_tokens():
    inp = make_inputs()
    expected = {
        "grpo": F.group_advantages(inp.scores, inp.group_index),
        "dr_grpo": F.group_advantages(inp.scores, inp.group_index, std_normalize=False),
        "rloo": F.rloo_advantages(inp.scores, inp.group_index),
        "rank": F.rank_advantages(inp.scores, inp.group_index),
        "hierarchical": F.hierarchical_advantages(inp.scores, inp.group_index, 0.5),
        "weighted_baseline": F.weighted_baseline_advantages(
            inp.scores, inp.group_index, inp.lengths.to(D).rsqrt()
        ),
        "grpo_passk": F.best_of_group_advantages(inp.scores, inp.group_index),
        "maxrl": F.maxrl_advantages(inp.scores, inp.group_index),
    }
    for name, a in expected.items():
        adv, ret = compute_advantages(inp, AlgoConfig(adv_estimator=name))
        assert torch.equal(adv, torch.where(inp.mask, a[:, None], 0.0)), name
        assert torch.equal(ret, adv)


def test_kl_in_reward_adds_discounted_kl_to_go():
    # rloo with r_t = R at the last token - beta*kl_t: A_t = a_i - beta * sum_{k>=t} kl_k (gamma 1)
    beta = 0.05
    inp = make_inputs(beta)
    kl_part = inp.token_rewards - make_inputs(0.0).token_rewards  # -beta * kl_t on valid tokens
    a = F.rloo_advantages(inp.scores, inp.group_index)
    expected = torch.where(inp.mask, a[:, None] + F.discounted_returns(kl_part, inp.mask, 1.0), 0.0)
    adv, _ = compute_advantages(inp, AlgoConfig(adv_estimator="rloo"))
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_estimators():
    inp = make_inputs()
    # without KL and gamma 1 the reward-to-go is R on every valid token, then batch-whitened
    adv, _ = compute_advantages(inp, AlgoConfig(adv_estimator="reinforce_pp"))
    torch.testing.assert_close(
        adv, F.masked_whiten(torch.where(inp.mask, inp.scores[:, None], 0.0), inp.mask)
    )
    adv, _ = compute_advantages(inp, AlgoConfig(adv_estimator="reinforce_pp_baseline"))
    centered = F.group_advantages(inp.scores, inp.group_index, std_normalize=False)
    torch.testing.assert_close(adv, F.masked_whiten(torch.where(inp.mask, centered[:, None], 0.0), inp.mask))
    adv, _ = compute_advantages(inp, AlgoConfig(adv_estimator="reinforce_pp", whiten_advantages=False))
    torch.testing.assert_close(adv, torch.where(inp.mask, inp.scores[:, None], 0.0))


def test_gae_decoupled_and_length_adaptive():
    inp = make_inputs(0.05)
    cfg = AlgoConfig(adv_estimator="gae", lam_actor=0.95, lam_critic=1.0)
    adv, ret = compute_advantages(inp, cfg)
    a_actor, _ = F.gae(inp.token_rewards, inp.values, inp.mask, 1.0, 0.95)
    _, r_critic = F.gae(inp.token_rewards, inp.values, inp.mask, 1.0, 1.0)
    torch.testing.assert_close(ret, r_critic)  # critic targets use lambda_critic, unwhitened
    torch.testing.assert_close(adv, F.masked_whiten(a_actor, inp.mask))
    cfg = AlgoConfig(adv_estimator="gae", lam_critic=1.0, length_adaptive_gae=True, whiten_advantages=False)
    adv, _ = compute_advantages(inp, cfg)
    lam = F.length_adaptive_lambda(inp.lengths, 0.05)  # all 0 here: every length < 20
    torch.testing.assert_close(adv, F.gae(inp.token_rewards, inp.values, inp.mask, 1.0, lam)[0])


def test_vapo_grpo_hybrid_endpoints():
    inp = make_inputs()
    gae_adv, gae_ret = compute_advantages(inp, AlgoConfig(adv_estimator="gae"))
    grpo_adv, _ = compute_advantages(inp, AlgoConfig(adv_estimator="grpo"))
    adv, ret = compute_advantages(inp, AlgoConfig(adv_estimator="vapo_grpo_hybrid", hybrid_kappa=0.0))
    torch.testing.assert_close(adv, gae_adv)  # alpha = 1 * e^0
    torch.testing.assert_close(ret, gae_ret)
    adv, _ = compute_advantages(inp, AlgoConfig(adv_estimator="vapo_grpo_hybrid", hybrid_alpha0=0.0))
    torch.testing.assert_close(adv, grpo_adv)
    # step 3 of 10, alpha0 1, kappa 5: alpha = e^-1.5
    adv, _ = compute_advantages(inp, AlgoConfig(adv_estimator="vapo_grpo_hybrid"))
    alpha = F.hybrid_alpha(3, 10, 1.0, 5.0)
    torch.testing.assert_close(adv, alpha * gae_adv + (1 - alpha) * grpo_adv)


def test_sequence_reweight_scales_rows():
    inp = make_inputs()
    base, _ = compute_advantages(inp, AlgoConfig(adv_estimator="dr_grpo"))
    adv, _ = compute_advantages(inp, AlgoConfig(adv_estimator="dr_grpo", seq_reweight_alpha=0.5))
    w = F.sequence_reweight(inp.lengths, 0.5)
    torch.testing.assert_close(adv, base * w[:, None])


def test_clipped_loss_registry_matches_functional():
    g = torch.Generator().manual_seed(2)
    logp, old, adv = (torch.randn(3, 4, generator=g) for _ in range(3))
    mask = torch.ones(3, 4)
    cfg = AlgoConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss, metrics = POLICY_LOSSES["clipped"](logp, old, adv, mask, cfg)
    ref, ref_metrics = F.clipped_policy_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip=3.0)
    torch.testing.assert_close(loss, ref)
    assert metrics.keys() == ref_metrics.keys()


def test_unknown_names_list_valid_names():
    with pytest.raises(KeyError, match="valid names: dr_grpo, gae, grpo"):
        ADVANTAGES["grpoo"]
    with pytest.raises(KeyError, match="valid names: cispo, clipped, gspo"):
        POLICY_LOSSES["ppo"]
    with pytest.raises(KeyError, match="valid names: k1, k2, k3"):
        KL_ESTIMATORS["k5"]
    with pytest.raises(KeyError, match="valid names"):
        compute_advantages(make_inputs(), AlgoConfig(adv_estimator="nope"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_agg": "token_sum"}, r"algo\.loss_agg='token_sum'.*token_mean, seq_mean_token_mean"),
        ({"clip_low": 1.5}, r"algo\.clip_low=1\.5 must be in \[0, 1\]"),
        ({"clip_low": -0.1}, r"algo\.clip_low"),
        ({"dual_clip": 0.5}, r"algo\.dual_clip=0\.5 must be > 1"),
        ({"mini_batches": 0}, r"algo\.mini_batches=0 must be >= 1"),
        ({"adv_estimator": "ppo"}, r"algo\.adv_estimator='ppo'.*valid names: dr_grpo, gae"),
        ({"kl_estimator": "k4"}, r"algo\.kl_estimator='k4'.*k1, k2, k3"),
        ({"policy_loss": "vanilla"}, r"algo\.policy_loss='vanilla'.*cispo, clipped, gspo"),
        ({"kl_target": 6.0}, r"algo\.kl_target=6\.0 needs an initial algo\.kl_coef"),
        ({"baseline_weights": "confidence"}, r"algo\.baseline_weights.*inv_sqrt_len, uniform"),
    ],
)
def test_validate_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(AlgoConfig(**overrides))


def test_schema_is_a_structured_config_with_docstrings():
    schema = OmegaConf.structured(AlgoConfig)
    validate(schema)  # DictConfig works too
    with pytest.raises(Exception, match="clip_hihg"):
        OmegaConf.merge(schema, {"clip_hihg": 0.28})  # typo fails at compose time
    with pytest.raises(Exception, match="mini_batches"):
        OmegaConf.merge(schema, {"mini_batches": "two"})  # wrong type too
    source = Path(F.__file__).with_name("config.py").read_text()
    for f in dataclasses.fields(AlgoConfig):
        after = source.split(f"\n    {f.name}:", 1)[1].split("\n", 2)[1].strip()
        assert after.startswith('"""'), f"AlgoConfig.{f.name} has no docstring line"
    assert "lam" not in {f.name for f in dataclasses.fields(AlgoConfig)}
    assert set(AGG_MODES) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_const"}


# The presets table of docs/algorithms.md, the rows this module owns.
PRESETS = {
    "grpo": dict(adv_estimator="grpo", clip_low=0.2, clip_high=0.2, loss_agg="seq_mean_token_mean",
                 kl_coef=0.04, kl_estimator="k3", kl_in_reward=False),
    "dr_grpo": dict(adv_estimator="dr_grpo", clip_low=0.2, clip_high=0.2, loss_agg="seq_sum_const", kl_coef=0.0),
    "rloo": dict(adv_estimator="rloo", loss_agg="token_mean", kl_estimator="k1", kl_in_reward=True),
    "reinforce_pp": dict(adv_estimator="reinforce_pp", loss_agg="token_mean", kl_estimator="k1",
                         kl_in_reward=True),
    "reinforce_pp_baseline": dict(adv_estimator="reinforce_pp_baseline", loss_agg="token_mean"),
    "ppo": dict(adv_estimator="gae", gamma=1.0, lam_actor=0.95, lam_critic=0.95, loss_agg="token_mean",
                kl_estimator="k1", kl_in_reward=True, clip_low=0.2, clip_high=0.2),
    "pkpo": dict(adv_estimator="pkpo", pass_k=4, loss_agg="token_mean", kl_coef=0.0),
    "grpo_passk": dict(adv_estimator="grpo_passk", loss_agg="token_mean", kl_coef=0.0),
    "maxrl": dict(adv_estimator="maxrl", loss_agg="token_mean", kl_coef=0.0),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_compose_validate_and_match_design(name):
    path = CONF / f"{name}.yaml"
    text = path.read_text()
    assert text.startswith("#") and "arXiv:" in text.split("\n\n")[0], "header comment must cite the paper"
    assert "@package" not in text
    cfg = OmegaConf.merge(OmegaConf.structured(AlgoConfig), OmegaConf.load(path))
    validate(cfg)
    assert cfg.name == name
    for key, value in PRESETS[name].items():
        assert cfg[key] == value, f"{name}.{key}"
    if cfg.kl_in_reward:
        assert cfg.kl_coef > 0


def test_kl_controllers():
    fixed = FixedKLController(0.04)
    fixed.update(100.0, 64)
    assert fixed.value == 0.04
    ctl = AdaptiveKLController(init=0.1, target=6.0, horizon=10000)
    # KL 12: error 12/6 - 1 = 1 -> clipped 0.2 -> beta * (1 + 0.2 * 64/10000) = 0.1 * 1.00128
    ctl.update(12.0, 64)
    assert ctl.value == pytest.approx(0.100128, abs=1e-12)
    # KL 3: error -0.5 -> -0.2 -> * (1 - 0.2 * 100/10000) = * 0.998
    ctl.update(3.0, 100)
    assert ctl.value == pytest.approx(0.100128 * 0.998, abs=1e-12)
    # KL 6.6: error 0.1 (inside the clip) -> * (1 + 0.1 * 1000/10000) = * 1.01
    ctl.update(6.6, 1000)
    assert ctl.value == pytest.approx(0.100128 * 0.998 * 1.01, abs=1e-12)
    assert isinstance(build_kl_controller(AlgoConfig(kl_coef=0.04)), FixedKLController)
    adaptive = build_kl_controller(AlgoConfig(kl_coef=0.1, kl_target=6.0, kl_horizon=500))
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.horizon == 500


def test_every_declared_name_is_registered_and_nothing_else():
    """Validation checks names against rlcli/core/names.py without importing torch; the registries must hold
    exactly those names (a registry refuses an undeclared one)."""
    from rlcli.core import names
    from rlcli.rollout import ROLLOUT_ENGINES

    for declared, registry in ((names.ADVANTAGES, ADVANTAGES), (names.POLICY_LOSSES, POLICY_LOSSES),
                               (names.KL_ESTIMATORS, KL_ESTIMATORS), (names.ROLLOUT_ENGINES, ROLLOUT_ENGINES)):
        assert set(declared) == set(registry), declared.kind
    with pytest.raises(ValueError, match="not declared in rlcli/core/names.py"):
        ADVANTAGES.register("my_new_estimator")(lambda inp, cfg: None)
