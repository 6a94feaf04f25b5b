"""hw.precision=bf16 at ZeRO-0: fp32 master weights, every forward of the trained models in bf16 (rlcli.models.autocast);
hw.precision=auto decided once, at validation. The fp32 master's own test: tests/test_engine.py."""

import torch
from conftest import FAST, compose


def test_bf16_at_zero0_runs_every_forward_in_bf16_over_fp32_weights(make_trainer):
    """One GRPO step with a KL reference: generation, scoring (actor and reference) and the update each run the
    models' linear layers in bf16 while their weights stay fp32; the log-probs stay fp32. Dropping any one of the
    autocast contexts leaves that stage's matmuls in fp32 and fails this test."""
    from rlcli.loop.summary import startup_summary

    t = make_trainer("hw.precision=bf16", "algo.kl_coef=0.01", "save=false")
    seen: dict[str, set] = {"generate": set(), "score": set(), "update": set()}
    stage = {"now": "generate"}

    def hook(module, args, out):
        seen[stage["now"]].add(out.dtype)

    for m in [*t.learner.actor.module.modules(), *t.learner.ref.modules()]:
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(hook)
    score, update = t.learner.score, t.learner.update

    def scored(*a, **k):
        stage["now"] = "score"
        out = score(*a, **k)
        assert all(v.dtype == torch.float32 for v in out.values())
        stage["now"] = "update"
        return out

    t.learner.score, t.learner.update = scored, update
    metrics = t.train_step(1)
    assert seen == {"generate": {torch.bfloat16}, "score": {torch.bfloat16}, "update": {torch.bfloat16}}
    assert all(p.dtype == torch.float32 for p in t.learner.actor.module.parameters())
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if isinstance(v, float) and "loss" in k)
    assert "bf16 matmuls by autocast over fp32 weights" in startup_summary(t)


def test_precision_auto_is_decided_at_validation_for_this_machine():
    from rlcli.config import validate
    from rlcli.core.precision import native_bf16

    cfg = compose(*FAST, "hw.precision=auto", run_dir="/tmp/unused")
    validate(cfg)
    assert cfg.hw.precision == ("bf16" if native_bf16("cpu") else "fp32")
