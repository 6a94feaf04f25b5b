"""Every algorithm preset trains 2 steps on the tiny model: parameters move, metrics are finite, and the
losses equal committed golden numbers (torchtune's `loss_values_map` habit): a refactor of the loop must
leave every preset's first two steps unchanged.

Random-init tiny model with a scripted user reward (count of '7's) so groups have reward variance;
DAPO filters on that score (its default filter, acc, is always 0 for a random model).

Golden numbers: tests/golden/preset_losses.json, compared with rtol=1e-4, atol=1e-6 (CPU, fp32, one
thread). Regenerate after a deliberate change of the math with
    RLCLI_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_presets.py -k trains_two_steps
and say in the commit why the numbers moved.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from metric_names import undocumented

pytestmark = pytest.mark.slow

PRESETS = {
    "grpo": [],
    "dr_grpo": [],
    "rloo": [],
    "reinforce_pp": [],
    "reinforce_pp_baseline": [],
    "dapo": ["algo.filter_metric=score", "rollout.overlong_buffer_len=4"],
    "gspo": [],  # mini_batches 4: 4 prompts -> 1 per mini-batch, off-policy after the first
    "cispo": [],
    "ppo": [],
    "vapo": ["critic.pretrain_steps=2", "rollout.overlong_buffer_len=4"],
}
GOLDEN_FILE = Path(__file__).parent / "golden" / "preset_losses.json"
GOLDEN_KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "actor/entropy", "reward/mean")
REGEN = bool(os.environ.get("RLCLI_REGEN_GOLDEN"))


def check_golden(preset: str, got: dict[str, list[float]]) -> None:
    """Compare (or, with RLCLI_REGEN_GOLDEN=1, record) a preset's per-step golden metrics."""
    golden = json.loads(GOLDEN_FILE.read_text()) if GOLDEN_FILE.exists() else {}
    if REGEN:
        golden[preset] = got
        GOLDEN_FILE.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    assert preset in golden, f"no golden numbers for {preset}: run with RLCLI_REGEN_GOLDEN=1"
    assert got.keys() == golden[preset].keys(), (preset, sorted(got), sorted(golden[preset]))
    for key, want in golden[preset].items():
        torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                   torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-6,
                                   msg=lambda m, key=key: f"{preset} {key}: {m}")


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_two_steps(preset, make_trainer):
    t = make_trainer(f"algo={preset}", "save=false", "steps=2", *PRESETS[preset])
    cfg = t.cfg
    assert (t.learner.ref is not None) == (cfg.algo.kl_coef > 0)  # no reference model without KL
    got: dict[str, list[float]] = {}
    if t.units.pretrain_steps:  # VAPO: value pretraining first, as fit() runs it
        got["pretrain/vf_loss"] = [t.pretrain_critic()["vf_loss"]]
    before = {n: p.detach().clone() for n, p in t.learner.actor.module.named_parameters()}
    for step in (1, 2):
        m = t.train_step(step)
        for k in GOLDEN_KEYS:
            if k in m:
                got.setdefault(k, []).append(m[k])
        for k, v in m.items():
            assert math.isfinite(v), (k, v)
        assert m["actor/grad_norm"] > 0 and m["actor/skipped_steps"] == 0
        assert not undocumented(m, reward_parts=("sevens",))
    moved = [n for n, p in t.learner.actor.module.named_parameters() if not torch.equal(before[n], p)]
    assert len(moved) == len(before)
    if cfg.algo.kl_coef > 0:
        assert ("actor/reward_kl" in m) == cfg.algo.kl_in_reward
        assert ("actor/kl_loss" in m) == (not cfg.algo.kl_in_reward)
    check_golden(preset, got)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_trains_and_sees_no_gap_with_the_hf_sampler(level, make_trainer):
    """algo.rollout_correction weights the loss by π_trainer/π_sampler. With HF generate the sampler is
    the trainer's own model, so the weights are 1 up to float rounding: nothing is clipped, training runs."""
    t = make_trainer("save=false", "steps=2", f"algo.rollout_correction={level}", "algo.mini_batches=2")
    for step in (1, 2):
        m = t.train_step(step)
        assert m["rollout_corr/weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert m["rollout_corr/weight_max"] == pytest.approx(1.0, abs=1e-2)
        assert m["rollout_corr/clipped_frac"] == 0.0 and m["actor/grad_norm"] > 0
        assert not undocumented(m, reward_parts=("sevens",))


def test_rollout_correction_weights_the_loss_by_trainer_over_sampler(make_trainer):
    """A sampler that lags the trainer (an HF engine over a frozen copy of the initial policy, as a stale or
    asynchronous engine would be): after one update the token weights min(π_trainer/π_sampler, 2) are far
    from 1, and the step's loss is exactly the clipped surrogate weighted by them. An inverted ratio or weights
    never applied change pg_loss or weight_mean."""
    import copy

    from rlcli.algos.functional import aggregate, masked_mean, rollout_correction_weights
    from rlcli.loop.learner import rl_phase
    from rlcli.rollout.hf import HFEngine

    t = make_trainer("save=false", "steps=2", "optim.lr=1e-2", "algo.rollout_correction=token", "algo.kl_coef=0")
    cfg = t.cfg
    t.rollout = t.state.rollout.engine = HFEngine(copy.deepcopy(t.learner.actor.module).eval(), t.tokenizer,
                                                  t.model_path, cfg)
    t.train_step(1)  # the trainer moves, the sampler's copy does not
    phase = rl_phase(cfg)
    batch, _ = t.collect(t.timer)
    batch = batch.replace(**t.learner.score(batch, 2, phase))
    batch, _ = t.advantage(batch, 2, phase)
    mask = batch.loss_mask
    log_ratio = t.learner.logprobs(batch) - batch.rollout_logp  # [N, T] trainer minus sampler
    w, _ = rollout_correction_weights(log_ratio, mask, level="token", upper=2.0)
    assert abs(float(masked_mean(w, mask)) - 1.0) > 0.02, "the sampler must differ from the trainer"
    # On-policy step: ratio 1, so the clipped surrogate is -A per token, times the correction weight.
    want = aggregate(-batch.advantages * w, mask, cfg.algo.loss_agg, max_len=cfg.rollout.max_new_tokens)
    m = t.learner.update(batch, phase)
    assert m["actor/pg_loss"] == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    assert m["rollout_corr/weight_mean"] == pytest.approx(float(masked_mean(w, mask)), rel=1e-4)


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_off_policy_corrections_weight_or_clip_against_the_lagging_sampler(make_trainer, mode):
    """algo.off_policy with a sampler one update behind (as an asynchronous rollout rank at staleness 1): decoupled
    multiplies the on-policy surrogate -A by π_prox/μ (capped: weights above the cap are 0), bypass takes the
    sampler's log-probs as the old policy, so the step's loss is the clipped surrogate of π/μ. A weight never
    applied, an inverted ratio or a cap ignored change pg_loss."""
    import copy

    from rlcli.algos.functional import aggregate, behaviour_weights, clipped_policy_loss
    from rlcli.loop.learner import rl_phase
    from rlcli.rollout.hf import HFEngine

    cap = ["algo.behav_weight_cap=1.05"] if mode == "decoupled" else []
    t = make_trainer("save=false", "steps=2", "optim.lr=1e-2", f"algo.off_policy={mode}", "algo.kl_coef=0", *cap)
    cfg = t.cfg
    t.rollout = t.state.rollout.engine = HFEngine(copy.deepcopy(t.learner.actor.module).eval(), t.tokenizer,
                                                  t.model_path, cfg)
    t.train_step(1)
    phase = rl_phase(cfg)
    batch, _ = t.collect(t.timer)
    batch = batch.replace(**t.learner.score(batch, 2, phase))
    batch, _ = t.advantage(batch, 2, phase)
    mask, a = batch.loss_mask, cfg.algo
    logp = t.learner.logprobs(batch)  # [N, T] the trainer now
    agg = dict(max_len=cfg.rollout.max_new_tokens)
    if mode == "decoupled":
        w, wm = behaviour_weights(logp - batch.rollout_logp, mask, cap=1.05)
        assert 0 < float(wm["behav_weight_capped_frac"]) < 1, "the cap must bite on some tokens only"
        want = aggregate(-batch.advantages * w, mask, a.loss_agg, **agg)
    else:
        loss_mat, _ = clipped_policy_loss(logp, batch.rollout_logp, batch.advantages, mask, a.clip_low, a.clip_high)
        want = aggregate(loss_mat, mask, a.loss_agg, **agg)
    m = t.learner.update(batch, phase)
    assert m["actor/pg_loss"] == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    if mode == "decoupled":
        assert m["actor/behav_weight_mean"] == pytest.approx(float(wm["behav_weight_mean"]), rel=1e-4)
    else:
        assert m["actor/pg_clipfrac"] > 0  # the ratio π/μ spans the lag: some tokens leave the trust region


def test_a_run_whose_loss_is_never_finite_stops_naming_the_step(make_trainer, monkeypatch):
    """Every step's loss forced to NaN: each optimizer step is skipped (never applied), and after
    optim.max_skipped_steps steps in a row the run stops with an error that names the step and the last
    step that did update, instead of training on."""
    from rlcli.loop.state import NonFiniteTraining

    t = make_trainer("steps=10", "optim.max_skipped_steps=3", "save=false", "checkpoint.every=0")
    micro_loss = t.learner.micro_loss
    calls = []

    def poisoned(mb, norms, *rest):  # step 1 trains normally, every later loss is NaN
        loss, m = micro_loss(mb, norms, *rest)
        return (loss * float("nan") if t.state.step >= 1 else loss), m

    monkeypatch.setattr(t.learner, "micro_loss", lambda *a: (calls.append(1), poisoned(*a))[1])
    before = {n: p.detach().clone() for n, p in t.learner.actor.module.named_parameters()}
    with pytest.raises(NonFiniteTraining, match=r"step 4: 3 training steps in a row.*'step': 1"):
        t.fit()
    assert t.state.step == 4 and len(calls) == 4
    params = dict(t.learner.actor.module.named_parameters())
    assert any(not torch.equal(before[n], p) for n, p in params.items())  # step 1 applied its update
    assert all(torch.isfinite(p).all() for p in params.values())  # no NaN step was applied
