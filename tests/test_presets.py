"""Every algorithm preset trains 2 steps on the tiny model: parameters move, metrics are finite.

Random-init tiny model with a scripted user reward (count of '7's) so groups have reward variance;
DAPO filters on that score (its default filter, acc, is always 0 for a random model).
"""

import math

import pytest
import torch
from conftest import CONF
from hydra import compose, initialize_config_dir
from metric_names import undocumented

from rlcli.config import register_configs, validate
from rlcli.trainer import Trainer

pytestmark = pytest.mark.slow
register_configs()

PRESETS = {
    "grpo": [],
    "dr_grpo": [],
    "rloo": [],
    "reinforce_pp": [],
    "reinforce_pp_baseline": [],
    "dapo": ["algo.filter_metric=score", "rollout.overlong_buffer_len=4"],
    "gspo": [],  # mini_batches 4: 4 prompts -> 1 per mini-batch, off-policy after the first
    "cispo": [],
}


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_two_steps(preset, tmp_path, monkeypatch):
    monkeypatch.setenv("RLCLI_CACHE", str(tmp_path / "cache"))
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=[
            f"algo={preset}", "model.warm_start.enabled=false", "rollout.prompts_per_step=4", "rollout.n=4",
            "rollout.max_new_tokens=16", "data.eval_size=4", "eval.before=false", "save=false", "steps=2",
            "~reward.weights.math_verify", "+reward.weights.sevens=1.0",
            "+reward.custom.sevens=reward_fixtures.count_sevens", "optim.lr=1e-3", "hw.num_threads=1",
            *PRESETS[preset],
        ])
    cfg.run_dir = str(tmp_path / "run")
    validate(cfg)
    t = Trainer(cfg)
    try:
        assert (t.ref is not None) == (cfg.algo.kl_coef > 0)  # no reference model without KL
        before = {n: p.detach().clone() for n, p in t.actor.module.named_parameters()}
        for step in (1, 2):
            m = t.train_step(step)
            for k, v in m.items():
                assert math.isfinite(v), (k, v)
            assert m["actor/grad_norm"] > 0 and m["actor/skipped_steps"] == 0
            assert not undocumented(m, reward_parts=("sevens",))
        moved = [n for n, p in t.actor.module.named_parameters() if not torch.equal(before[n], p)]
        assert len(moved) == len(before)
        if cfg.algo.kl_coef > 0:
            assert ("actor/reward_kl" in m) == cfg.algo.kl_in_reward
            assert ("actor/kl_loss" in m) == (not cfg.algo.kl_in_reward)
    finally:
        t.rewards.close()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_trains_and_sees_no_gap_with_the_hf_sampler(level, tmp_path, monkeypatch):
    """algo.rollout_correction weights the loss by π_trainer/π_sampler. With HF generate the sampler is
    the trainer's own model, so the weights are 1 up to float rounding: nothing is clipped, training runs."""
    monkeypatch.setenv("RLCLI_CACHE", str(tmp_path / "cache"))
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=[
            "model.warm_start.enabled=false", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=16",
            "data.eval_size=4", "eval.before=false", "save=false", "steps=2", "~reward.weights.math_verify",
            "+reward.weights.sevens=1.0", "+reward.custom.sevens=reward_fixtures.count_sevens", "optim.lr=1e-3",
            "hw.num_threads=1", f"algo.rollout_correction={level}", "algo.mini_batches=2",
        ])
    cfg.run_dir = str(tmp_path / "run")
    validate(cfg)
    t = Trainer(cfg)
    try:
        for step in (1, 2):
            m = t.train_step(step)
            assert m["rollout_corr/weight_mean"] == pytest.approx(1.0, abs=1e-3)
            assert m["rollout_corr/weight_max"] == pytest.approx(1.0, abs=1e-2)
            assert m["rollout_corr/clipped_frac"] == 0.0 and m["actor/grad_norm"] > 0
            assert not undocumented(m, reward_parts=("sevens",))
    finally:
        t.rewards.close()
