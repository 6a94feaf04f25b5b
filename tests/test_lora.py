"""LoRA through peft (model.lora): only the adapters train, the reference policy is the base model with
the adapters disabled and equals the initial policy, checkpoints hold the adapters, and the saved policy
is the merged model, loadable by AutoModelForCausalLM."""

import pytest
import torch

from rlcli.models import response_logprobs

pytestmark = pytest.mark.slow


LORA = ["optim.lr=1e-2", "model.lora.r=4", "algo.kl_coef=0.04", "checkpoint.every=1"]


def test_lora_trains_the_adapters_only_and_the_reference_is_the_initial_policy(make_trainer):
    from transformers import AutoModelForCausalLM

    t = make_trainer(*LORA, "steps=2", "checkpoint.hf_every=2")
    model = t.learner.actor.module
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    batch, _ = t.collect(t.timer)  # a batch to score after training (fit closes the reward workers)
    result = t.fit()

    assert all(torch.equal(p.detach(), base[n]) for n, p in model.named_parameters() if n in base)
    assert any(not torch.equal(p.detach(), lora[n]) for n, p in model.named_parameters() if n in lora)
    # The reference log-probs (adapters disabled) equal the initial model's, loaded afresh.
    initial = AutoModelForCausalLM.from_pretrained(t.model_path).eval()
    ref = t.learner.reference_logprobs(batch)
    assert torch.allclose(ref, t.learner.logprobs(batch, initial), atol=1e-6)
    assert not torch.allclose(ref, t.learner.logprobs(batch, model), atol=1e-3)  # the adapters do change the policy
    # The saved policy is the merged model: a plain transformers model equal to peft's own
    # merge_and_unload (on a copy), moved away from the base in the adapted layers only.
    import copy

    saved = dict(AutoModelForCausalLM.from_pretrained(result["policy_path"]).named_parameters())
    reference = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert saved.keys() == reference.keys() and not any("lora" in n for n in saved)
    assert all(torch.allclose(saved[n], reference[n], atol=1e-7) for n in saved)
    # checkpoint.hf_every saves the same merged model (here at the last step)
    snapshot = dict(AutoModelForCausalLM.from_pretrained(f"{t.cfg.run_dir}/hf/step_2").named_parameters())
    assert snapshot.keys() == saved.keys() and all(torch.equal(snapshot[n], saved[n]) for n in saved)
    start = dict(initial.named_parameters())
    moved = [n for n in saved if not torch.equal(saved[n], start[n])]
    assert moved and all(any(m in n for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj")) for n in moved)


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_identically(make_trainer):
    """Checkpoints leave the frozen base out (it is rebuilt from the model path): the actor checkpoint is
    a fraction of the full model's, and a run resumed from step 1 logs step 2 exactly as a straight run. Dropout is
    on: sampling draws from generators of its own, so without dropout nothing in a step reads the global torch RNG,
    and a resume that forgot to restore it would pass."""
    import json
    import os

    straight = make_trainer(*LORA, "steps=2", "model.lora.dropout=0.1", run="straight")
    straight.fit()
    step1 = os.path.join(straight.cfg.run_dir, "checkpoints", "step_1")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(step1, "actor")) for f in fs)
    full = sum(p.numel() * 4 for n, p in straight.learner.actor.module.named_parameters())
    assert size < 0.5 * full
    resumed = make_trainer(*LORA, "steps=2", "model.lora.dropout=0.1", "save=false", f"resume={step1}", run="resumed")
    resumed.fit()

    def rows(t):
        with open(os.path.join(t.cfg.run_dir, "metrics.jsonl")) as f:
            return [{k: v for k, v in json.loads(x).items() if "timing_s/" not in k and "perf/" not in k} for x in f]

    assert rows(resumed) == rows(straight)


def test_scoring_runs_in_eval_mode_so_dropout_never_moves_old_log_probs(make_trainer):
    """With model.lora.dropout=0.1, scoring in train mode gave two different old log-probs for one batch (up to
    0.20 nats per token, issue 21), so the ratio of an untouched mini-batch was not 1. Scoring (old
    log-probs, the carry's recorded ones, the reference) runs in eval mode; only the update trains."""
    from rlcli.loop.learner import rl_phase

    t = make_trainer(*LORA, "steps=2", "model.lora.dropout=0.1", "algo.mini_batches=2", "save=false")
    t.train_step(1)  # the adapters move away from B = 0, so their dropout changes the output
    model, phase = t.learner.actor.module, rl_phase(t.cfg)
    assert model.training  # as the update leaves it
    batch, _ = t.collect(t.timer)
    first = t.learner.score(batch, 2, phase)["old_logp"]
    assert model.training  # scoring puts back the mode it found
    second = t.learner.score(batch, 2, phase)["old_logp"]
    assert torch.equal(first, second)
    model.train()
    noisy = [t.learner.per_token(lambda *x: response_logprobs(model, *x, 1.0)[0], batch) for _ in range(2)]
    assert not torch.equal(noisy[0], noisy[1])  # dropout is really on in train mode: the test can fail
