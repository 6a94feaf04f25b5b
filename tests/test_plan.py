"""`rlcli plan`: the memory formulas against hand-computed numbers, parameter counts against real models, the
refusal of `rlcli train` before anything loads, and the estimate against measured peak memory on CPU.

Regenerate the measured numbers (docs/memory.md): python tests/helpers/peak_memory.py STEPS OVERRIDES...
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, compose

from rlcli.plan import roofline
from rlcli.plan.activations import activation_elements_per_token, kv_cache_bytes, kv_token_bytes
from rlcli.plan.budget import budget_pending, fix_budget
from rlcli.plan.estimate import BUDGET, estimate, micro_slots, with_overrides
from rlcli.plan.fixes import fixes
from rlcli.plan.inputs import arith_bound, measure_prompts, prompt_tokens
from rlcli.plan.report import fits_line, render
from rlcli.plan.shapes import Arch, arch_of, lora_param_count, param_count
from rlcli.plan.states import GIB, model_states

PSI = 1_000_000_000  # Ψ = 1B parameters, 8 ranks: the golden numbers below are in bytes


@pytest.mark.parametrize("stage, weights, grads, optim", [
    # ZeRO paper (arXiv:1910.02054) mixed-precision Adam: 2Ψ + 2Ψ + 12Ψ, partitioned by stage over N_d = 8.
    (1, 2 * PSI, 2 * PSI, 12 * PSI / 8),
    (2, 2 * PSI, 2 * PSI / 8 + 500_000_000 * 2, 12 * PSI / 8),  # + one reduce bucket of 5e8 bf16 gradients
    (3, 2 * PSI / 8 + 2 * 10_000_000 * 2, 2 * PSI / 8 + 500_000_000 * 2, 12 * PSI / 8),  # + two gathered blocks
])
def test_bf16_model_states_per_zero_stage(stage, weights, grads, optim):
    s = model_states(PSI, PSI, "bf16", stage, 8, False, False, layer=10_000_000, embed=5_000_000)
    assert (s.weights, s.grads, s.optim, s.host) == (weights, grads, optim, 0.0)


def test_zero0_and_fp32_model_states():
    # bf16 ZeRO-0 is autocast over fp32 weights: fp32's 4 + 4 + 8, and autocast's bf16 copy of the weights (2).
    s = model_states(PSI, PSI, "bf16", 0, 8, False, False)
    assert (s.weights, s.grads, s.optim) == (6 * PSI, 4 * PSI, 8 * PSI)
    # fp32 ZeRO-0: the weights are the master copy; Adam m and v (4 + 4 + 8 = 16 bytes per parameter).
    s = model_states(PSI, PSI, "fp32", 0, 1, False, False)
    assert (s.weights, s.grads, s.optim) == (4 * PSI, 4 * PSI, 8 * PSI)


def test_offload_moves_states_to_host():
    s = model_states(PSI, PSI, "bf16", 2, 8, True, False)
    assert s.optim == 0 and s.grads == 500_000_000 * 2 and s.host == 12 * PSI / 8 + 2 * PSI / 8
    s = model_states(PSI, PSI, "bf16", 3, 8, True, True, layer=10_000_000)
    assert s.weights == 2 * 10_000_000 * 2 and s.host == (12 + 2 + 2) * PSI / 8


def test_kv_cache_and_activation_counts():
    a = Arch(hidden=896, layers=24, intermediate=4864, vocab=151936, heads=14, kv_heads=2, head_dim=64, tied=True,
             qkv_bias=True)
    # 2 x 24 layers x 2 kv heads x 64 x 2 bytes = 12,288 bytes per token; 8 rows x 1,000 tokens.
    assert kv_cache_bytes(a, 8, 1000, 2) == 12_288 * 8_000
    # 6h + 4q + 4i + heads + seq = 5376 + 3584 + 19456 + 14 + 100 (k and v kept at the query's width)
    assert activation_elements_per_token(a, 100) == 28_530


def saved_bytes(layers: int, shape: dict, autocast: bool = False, response: int = 10) -> dict[str, int]:
    """Bytes a Llama model of `layers` blocks (`shape`: hidden, heads, kv_heads, head_dim, intermediate; vocab 100)
    keeps for backward in the log-prob pass of 4 rows (6 prompt tokens, one row padded, `response` tokens), by
    torch's saved-tensor hooks, by dtype: the parameters themselves and (autocast) their bf16 copies excluded
    (the plan counts those as weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlcli.models import response_logprobs

    torch.manual_seed(0)
    h, heads, kv, hd, inter = shape.values()
    model = LlamaForCausalLM(LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, vocab_size=100,
                                         tie_word_embeddings=True, attn_implementation="sdpa"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    prompt_mask = torch.ones(4, 6, dtype=torch.long)
    prompt_mask[0, :2] = 0  # a padded batch, as rollouts are
    storages: dict[int, tuple[int, str]] = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in params and not (x.dtype == torch.bfloat16 and tuple(x.shape) in weight_shapes):
            storages[ptr] = (x.untyped_storage().nbytes(), str(x.dtype))
        return x

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        response_logprobs(model, torch.randint(4, 100, (4, 6)), prompt_mask, torch.randint(4, 100, (4, response)),
                          torch.ones(4, response, dtype=torch.long), 1.0, chunk=256)
    out: dict[str, int] = {}
    for nbytes, dtype in storages.values():
        out[dtype] = out.get(dtype, 0) + nbytes
    return out


BLOCKS = {"mha": dict(hidden=128, heads=4, kv=4, head_dim=32, inter=512),
          "gqa": dict(hidden=128, heads=4, kv=2, head_dim=32, inter=256),
          "smollm2": dict(hidden=576, heads=9, kv=3, head_dim=64, inter=1536)}


def block_arch(shape: dict) -> Arch:
    return Arch(shape["hidden"], 2, shape["inter"], 100, shape["heads"], shape["kv"], shape["head_dim"], True, False)


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_activation_count_matches_saved_tensors_of_a_real_block(name):
    """fp32 elements one Llama block saves for backward (a 2-block model's minus a 1-block model's) equal the formula
    (to the RMSNorm's per-token rsqrt: 2 elements), with and without grouped-query attention (whose k and v are
    kept at the query's width: counting them at their own width undercounts every GQA model)."""
    shape = BLOCKS[name]
    per_block = (sum(saved_bytes(2, shape).values()) - sum(saved_bytes(1, shape).values())) // 4
    assert per_block == activation_elements_per_token(block_arch(shape), 16) * 4 * 16 + 2 * 4 * 16


def test_autocast_keeps_more_than_bf16_and_less_than_fp32_bytes_per_element(fp32_attention):
    """bf16 by autocast (ZeRO-0) keeps fp32 tensors beside the bf16 matmul inputs: at SmolLM2's block shape one
    block's saved bytes lie between 2 and 4 bytes per formula element, so the plan counts 4 (activation_element_bytes:
    a bound) and 2 would undercount. On a CPU the attention runs in fp32 under autocast
    (rlcli.models.policy.fp32_attention_on_cpu, which rlcli's autocast installs): q, k, v and its output kept in fp32,
    within the bound at 16 and at 160 positions."""
    from rlcli.plan.states import activation_element_bytes

    shape = BLOCKS["smollm2"]
    for response, seq in ((10, 16), (154, 160)):
        per_block = sum(saved_bytes(2, shape, True, response).values()) - sum(saved_bytes(1, shape, True, response).values())
        elements = activation_elements_per_token(block_arch(shape), seq) * 4 * seq
        assert 2 * elements < per_block < 4 * elements, seq
    assert activation_element_bytes(compose("hw.precision=bf16").hw) == 4
    assert activation_element_bytes(compose("hw.precision=bf16", "hw.zero_stage=1").hw) == 2


def test_param_count_equals_the_real_models():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcli.commands.gpu_smoke import QWEN25_05B
    from rlcli.models.config import TinyModelConfig
    from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer

    tok = load_tiny_tokenizer()
    for tiny in (TinyModelConfig(), TinyModelConfig(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=2048,
                                                    tie_word_embeddings=False)):
        real = sum(p.numel() for p in build_tiny_model(tiny, tok, 0).parameters())
        assert param_count(arch_of(SimpleNamespace(path=None, gguf_file=None, tiny=tiny))) == real
    for preset, shape in (("qwen2.5-0.5b", QWEN25_05B), ("qwen2.5-32b", None)):
        arch = arch_of(compose(f"model={preset}").model)
        if shape is None:  # the 32B preset's own numbers, built on the meta device (no memory)
            shape = {"hidden_size": arch.hidden, "intermediate_size": arch.intermediate, "vocab_size": arch.vocab,
                     "num_hidden_layers": arch.layers, "num_attention_heads": arch.heads,
                     "num_key_value_heads": arch.kv_heads, "tie_word_embeddings": arch.tied}
        with torch.device("meta"):
            real = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**shape)).parameters())
        assert param_count(arch) == real
    assert param_count(arch_of(compose("model=qwen2.5-0.5b").model)) == 494_032_768  # card: 0.49B
    assert param_count(arch_of(compose("model=qwen2.5-32b").model)) == 32_763_876_352  # card: 32.5B
    assert param_count(arch_of(compose("model=smollm2-135m").model)) == 134_515_008  # the converted GGUF's count


def test_lora_count_and_local_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 256,
        "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}))
    arch = arch_of(SimpleNamespace(path=str(tmp_path)))
    assert (arch.kv_width, arch.qkv_bias, arch.tied) == (32, False, True)
    lora = SimpleNamespace(r=8, target_modules=["q_proj", "v_proj", "down_proj"])
    assert lora_param_count(arch, lora) == 2 * 8 * ((64 + 64) + (64 + 32) + (256 + 64))


def test_reference_and_critic_rows_follow_the_algorithm():
    grpo = estimate(compose("algo=grpo"))  # kl_coef 0.04: a frozen copy
    assert grpo.rows["reference model"] == grpo.rows["weights"] and grpo.rows["critic"] == 0
    assert estimate(compose("algo=dapo")).rows["reference model"] == 0  # kl_coef 0
    ppo = estimate(compose("algo=ppo"))  # gae needs values: backbone + head, own Adam
    assert ppo.rows["critic"] > 0.9 * (ppo.rows["weights"] + ppo.rows["gradients"] + ppo.rows["optimizer states"])
    lora = estimate(compose("algo=grpo", "model.lora.r=8"))
    assert lora.rows["reference model"] == 0 and lora.rows["gradients"] < 0.1 * grpo.rows["gradients"]


def test_zero_shards_over_the_training_ranks_only():
    """With asynchronous rollout the rollout ranks hold no model states: ZeRO-2 on hw=cpu_x2 with one rollout rank
    shards over the one training rank, as hw.nproc=1 does, not over two."""
    one = estimate(compose("hw=cpu_x2", "hw.nproc=1", "hw.zero_stage=2"))
    two = estimate(compose("hw=cpu_x2", "hw.zero_stage=2"))
    split = estimate(compose("hw=cpu_x2", "hw.zero_stage=2", "rollout.async.max_staleness=1"))
    assert two.rows["optimizer states"] < one.rows["optimizer states"]
    assert split.rows["optimizer states"] == one.rows["optimizer states"]


LONG = ["model=llama3.1-8b", "hw=8xh100", "hw.zero_stage=3", "hw.offload_params=true", "hw.offload_optimizer=true",
        "rollout.engine=vllm", "rollout.sleep_mode=true", "algo.kl_coef=0", "rollout.n=1", "hw.micro_batch=1",
        "hw.logits_chunk=64", "rollout.prompts_per_step=8", "hw.max_tokens_per_micro_batch=null"]
"""Llama-3.1-8B on 8 H100s, everything offloaded, one sequence per micro-batch: ALST's long-sequence setting
(docs/sequence_parallel.md, "How long")."""


def test_sequence_parallel_counts_a_ranks_slice_of_each_sequence():
    """hw.sp_size=8: a rank keeps the activations of 1/8 of each sequence's positions (no [seq, seq] mask: Ulysses
    attention is causal without one) and its slice's logits, and the group's ranks pool their rows (the micro-batch
    is drawn from 8x the rows); the model states and the rollout's KV cache are unchanged."""
    from rlcli.plan.activations import activation_bytes

    whole, sliced = (estimate(compose(*LONG, "rollout.max_new_tokens=65280", f"hw.sp_size={n}")) for n in (1, 8))
    arch = whole.shape["arch"]
    # one whole row per micro-batch: no padding, no shared prompt, so no mask (sdpa runs causal) with or without SP
    assert whole.rows["activations"] == activation_bytes(arch, 1, 65536, 2, True, mask=False)  # prompt 256 + 65280
    assert sliced.rows["activations"] == activation_bytes(arch, 1, 8192, 2, True, mask=False)
    # 32 layers x 4096 x 8192 x 2 B of checkpoints + 2 blocks of (6h + 4q + 4i + heads) x 8192 x 2 B + final 3h
    per_token = 32 * 4096 * 2 + 2 * (6 * 4096 + 4 * 4096 + 4 * 14336 + 32) * 2 + 3 * 4096 * 2
    assert sliced.rows["activations"] == per_token * 8192
    assert sliced.rows["logits chunk"] == 64 * 128256 * (2 + 16)  # [1 row, 64 positions of the slice, vocab]
    for row in ("weights", "gradients", "optimizer states", "rollout"):
        assert sliced.rows[row] == whole.rows[row], row
    assert "8192 positions per rank (hw.sp_size=8)" in sliced.notes["activations"]


def test_alsts_savings_take_the_mlp_and_the_checkpoints_off_the_device():
    """hw.tiled_mlp: a block keeps no [positions, intermediate] tensors, one tile's (4 x intermediate and their
    gradients, for the hidden size's 4096 positions) live at a time; hw.offload_checkpoints: the 32 checkpoints per
    position move from the device to host memory (the plan's host row); on a CPU device they stay where they are."""
    cfg = [*LONG, "rollout.max_new_tokens=65280", "hw.sp_size=8"]
    plain, saved = (estimate(compose(*cfg, *extra)) for extra in (
        [], ["hw.tiled_mlp=true", "hw.offload_checkpoints=true"]))
    # 2 blocks of (6h + 4q + heads) x 8192 x 2 B + final 3h + one tile: 2 x 4 x 14336 x 4096 positions x 2 B
    assert saved.rows["activations"] == (2 * (6 * 4096 + 4 * 4096 + 32) * 2 + 3 * 4096 * 2) * 8192 + 2 * 4 * 14336 * 4096 * 2
    assert saved.host - plain.host == 32 * 4096 * 8192 * 2
    assert "(kept in host memory), the MLP in tiles of 4096 positions" in saved.notes["activations"]
    tiles = estimate(compose(*cfg, "hw.tiled_mlp=true", "hw.tiled_mlp_positions=512"))
    assert plain.rows["activations"] - tiles.rows["activations"] == 2 * 4 * 14336 * 2 * 8192 - 2 * 4 * 14336 * 512 * 2
    on_cpu = [estimate(compose(*cfg, "hw.device=cpu", *extra)) for extra in ([], ["hw.offload_checkpoints=true"])]
    assert on_cpu[0].rows["activations"] == on_cpu[1].rows["activations"] and on_cpu[0].host == on_cpu[1].host


def test_max_response_is_the_longest_that_fits_and_grows_with_the_sequence_parallel_group():
    """`rlcli plan --max-response`: the answer T fits and T + 1 does not (for the whole step and for the update
    alone); the update alone grows about N-fold with hw.sp_size=N, the whole step not past one sequence in vLLM's KV
    cache (generation is not split), and hw.sp_size is offered as a fix where the plan does not fit."""
    from rlcli.plan.report import longest_responses

    cfg = compose(*LONG)
    answers = {n: (whole, update) for n, whole, update in longest_responses(cfg)}
    assert list(answers) == [1, 2, 4, 8]
    for n, (whole, update) in answers.items():
        for tokens, fits in ((whole, lambda q: q.fits), (update, lambda q: q.shape["update_peak"] <= q.device)):
            at = [estimate(with_overrides(cfg, {"hw.sp_size": n, "rollout.max_new_tokens": t})) for t in (tokens, tokens + 1)]
            assert fits(at[0]) and not fits(at[1]), (n, tokens)
    assert answers[8][1] > 3.5 * answers[2][1] and answers[8][0] == answers[2][0]  # the KV cache binds the whole step
    big = compose(*LONG, f"rollout.max_new_tokens={answers[1][1] * 2}")
    table = render(big, estimate(big))
    assert "hw.sp_size=2" in table and "hw.tiled_mlp=true" in table  # ALST's savings among the fixes, with their peaks
    offered = {tuple(sorted(o)): peak for o, peak, _ in fixes(big, estimate(big))}
    assert offered[("hw.tiled_mlp",)] < estimate(big).peak
    assert ("hw.offload_checkpoints", "model.gradient_checkpointing") in offered
    out = subprocess.run([sys.executable, "-m", "rlcli", "plan", *LONG, "--max-response"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ["hw.sp_size=8", f"{answers[8][0]:,}", f"{answers[8][1]:,}"] in [line.split() for line in out.stdout.splitlines()]


# The headline command without its fit (conf/fit/qwen2.5-32b_8xa100.yaml): what it planned before.
UNFITTED = ["hw.offload_optimizer=false", "rollout.tensor_parallel_size=1", "rollout.sleep_mode=false",
            "rollout.gpu_memory_utilization=0.4"]


@pytest.mark.parametrize("engine,fix", [("vllm", "rollout.tensor_parallel_size=2"), ("hf", "rollout.gen_batch_size=")])
def test_the_32b_dapo_plan_without_its_fit_does_not_fit_and_names_fixes_that_do(engine, fix):
    """vLLM's 61 GiB of bf16 weights exceed the 0.4 x 80 GiB reservation at one GPU per engine; HF generate's KV
    cache for 128 rows of 20,736 tokens is 648 GiB."""
    cfg = compose("model=qwen2.5-32b", "hw=8xa100", "algo=dapo", f"rollout.engine={engine}", *UNFITTED)
    plan = estimate(cfg)
    assert plan.fits is False
    text = render(cfg, plan)
    assert fix in text and "memory-only changes that fit together" in text


@pytest.mark.parametrize("args", [["algo=dapo", "model=qwen2.5-32b", "hw=8xa100"],
                                  ["algo=dapo", "model=qwen2.5-32b", "hw=8xh100"],
                                  ["model=qwen2.5-0.5b", "hw=1xgpu"]])
def test_the_gpu_presets_fit_and_plan_says_so_with_exit_status_0(args):
    """The headline command fits by its own planner (its fit: optimizer offload, one 8-way tensor-parallel engine
    asleep during the update), with the margin printed and a step-time estimate."""
    out = subprocess.run([sys.executable, "-m", "rlcli", "plan", *args], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fits, margin" in out.stdout and "step time, rough" in out.stdout
    if "hw=8xa100" in args:
        assert "margin 21.62 GiB (the peak is 73% of it)" in out.stdout and "rollout.tensor_parallel_size=8" in out.stdout


def test_the_rollout_row_is_the_engines_shard_and_kv_cache_released_while_it_sleeps():
    """A k-way engine holds Psi x 2 / k bytes of bf16 weights per GPU and the rest of its share as KV cache, whose
    token is 2 x layers x ceil(kv_heads / k) x head_dim x 2 bytes per GPU (KV heads replicated past k = 8); asleep,
    it is not counted during the update. An engine that cannot hold its weights or one sequence does not run."""
    base = ["model=qwen2.5-32b", "hw=8xa100", "algo=dapo"]
    arch = arch_of(compose(*base).model)
    assert kv_token_bytes(arch, 4, 2) == 2 * 64 * 2 * 128 * 2 == 65536 and kv_token_bytes(arch, 16, 2) == 32768
    plan = estimate(compose(*base, "rollout.tensor_parallel_size=4"))
    psi = 32_763_876_352
    assert plan.rows["rollout"] == 0.6 * 80 * GIB and plan.shape["phase"] == "rollout"
    assert plan.shape["kv_room_tokens"] == pytest.approx((0.6 * 80 * GIB - psi * 2 / 4) / 65536)
    assert "weights 15.3 + KV cache 32.7" in plan.notes["rollout"] and plan.fits
    awake = estimate(compose(*base, "rollout.tensor_parallel_size=4", "rollout.sleep_mode=false"))
    assert awake.peak == pytest.approx(plan.peak - plan.rows["rollout"] + plan.rows["activations"]
                                       + plan.rows["logits chunk"] + plan.rows["rollout"])
    assert awake.fits is False  # 85.8 GiB: the reservation held through the update
    whole = estimate(compose(*base, "rollout.tensor_parallel_size=1"))
    assert whole.fits is False and "exceed rollout.gpu_memory_utilization" in whole.blockers[0]
    starved = estimate(compose(*base, "rollout.tensor_parallel_size=2", "rollout.gpu_memory_utilization=0.39"))
    assert starved.fits is False and "cannot hold one sequence" in starved.blockers[0]


def test_zero3_hf_generation_counts_the_gathered_model_and_falls_back_when_it_does_not_fit():
    """rollout.engine=hf under ZeRO-3 over 8 ranks: gathered adds every parameter once in the weights' 2 bytes (Psi x
    2) to the rollout row beside the KV cache; per_layer adds nothing; auto gathers when the peak with the copy fits
    the device and generates layer by layer when it does not (and fix_budget writes that choice into the config). One
    rank, or ZeRO-2, has nothing to choose."""
    base = ["model=qwen2.5-7b", "hw=8xa100", "rollout.engine=hf", "hw.zero_stage=3", "hw.max_tokens_per_micro_batch=null"]
    psi = param_count(arch_of(compose(*base).model))
    gathered, per_layer = (estimate(compose(*base, f"rollout.zero3_generation={m}")) for m in ("gathered", "per_layer"))
    assert gathered.rows["rollout"] - per_layer.rows["rollout"] == psi * 2
    assert gathered.shape["zero3_generation"] == "gathered" and per_layer.shape["zero3_generation"] == "per_layer"
    assert "gathered once per generation, 14.19 GiB" in gathered.notes["rollout"]
    roomy = compose(*base)
    assert fix_budget(roomy, (256, "")).shape["zero3_generation"] == "gathered"
    assert roomy.rollout.zero3_generation == "gathered"
    # a device where the KV cache fits beside the rest but the whole model does not: between the two peaks
    device = (per_layer.peak + gathered.peak) / 2 / GIB
    tight = compose(*base, f"hw.device_memory_gb={device}")
    plan = fix_budget(tight, (256, ""))
    assert plan.shape["zero3_generation"] == "per_layer" and tight.rollout.zero3_generation == "per_layer"
    assert "does not fit beside the rest" in plan.notes["rollout"] and plan.rows["rollout"] == per_layer.rows["rollout"]
    assert "each layer gathered at every decoding step, the whole model does not fit beside the rest" in fits_line(plan)
    assert fits_line(per_layer).endswith("each layer gathered at every decoding step (`rlcli plan` shows the table)")
    assert "the whole model gathered once per generate call" in fits_line(gathered)
    # auto waits for the plan only where it applies (a config without an auto budget)
    assert budget_pending(compose(*base)) and not budget_pending(compose(*base, "rollout.zero3_generation=per_layer"))
    for other in (["hw.nproc=1"], ["hw.zero_stage=2"], ["rollout.engine=vllm"]):
        assert estimate(compose(*base, *other)).shape["zero3_generation"] is None
        assert not budget_pending(compose(*base, *other))
    forced = compose(*base, "rollout.zero3_generation=gathered", f"hw.device_memory_gb={device}")
    offered = {tuple(o.items()): peak for o, peak, _ in fixes(forced, estimate(forced))}
    assert offered[(("rollout.zero3_generation", "per_layer"),)] == pytest.approx(per_layer.peak)


def test_an_engine_that_cannot_run_is_named_and_its_fix_offered():
    """A share of the device too small for one 20,736-token sequence's KV cache (0.1 x 80 GiB at k = 8) is a blocker
    whatever the total: the plan does not fit, the fixes offer the share that holds the weights and one sequence,
    and auto still sizes the micro-batches by the peak. Heads that k does not divide are a blocker too."""
    base = ["model=qwen2.5-32b", "hw=8xa100", "algo=dapo"]
    cfg = compose(*base, "rollout.gpu_memory_utilization=0.1")
    plan = estimate(cfg)
    assert plan.fits is False and "cannot hold one sequence" in plan.blockers[0] and plan.peak < plan.device
    offered = {o.get("rollout.gpu_memory_utilization") for o, _, _ in fixes(cfg, plan)}
    assert 0.15 in offered  # (7.6 GiB of weights + 20,736 x 32 KiB) / 80 GiB = 0.103: the next 0.05 above
    assert "fits  rollout.gpu_memory_utilization=0.15" in render(cfg, plan)
    odd = estimate(compose(*base, "hw.nproc=6", "rollout.tensor_parallel_size=3", "rollout.prompts_per_step=384",
                           "rollout.gen_prompts_per_step=1152"))
    assert any("must divide the model's 40" in b for b in odd.blockers)


def test_tensor_parallel_fixes_are_only_ones_vllm_can_run():
    """Suggested sizes divide the node's ranks and the attention heads (40 for Qwen2.5-32B): on 6 GPUs only 2."""
    cfg = compose("model=qwen2.5-32b", "hw=8xa100", "algo=dapo", "hw.nproc=6", "rollout.prompts_per_step=384",
                  "rollout.gen_prompts_per_step=1152", "algo.mini_batches=16", *UNFITTED)
    plan = estimate(cfg)
    suggested = [o["rollout.tensor_parallel_size"] for o, _, _ in fixes(cfg, plan) if "rollout.tensor_parallel_size" in o]
    assert suggested == [2]


def test_step_time_roofline_by_hand():
    """Qwen2.5-0.5B on one A100 (hw=1xgpu: 312 TFLOP/s, 2039 GB/s), 64 prompts x 8 responses of 256 + 1024 tokens,
    GRPO on-policy with a reference model, no checkpointing: every stage computed here from the formulas."""
    cfg = compose("model=qwen2.5-0.5b", "hw=1xgpu")
    plan = estimate(cfg)
    t = roofline.step_time(cfg, plan)
    psi, flops = 494_032_768, 312e12 * 0.4
    attn = 4 * 24 * 14 * 64  # 4 x layers x heads x head_dim
    seqs = 64 * 8
    compute = seqs * (256 * (2 * psi + attn * 128) + 1024 * (2 * psi + attn * (256 + 512))) / flops
    kv_token = 2 * 24 * 2 * 64 * 2  # 2 x layers x kv_heads x head_dim x 2 bytes
    assert plan.shape["kv_room_tokens"] == pytest.approx((0.4 * 80 * GIB - psi * 2) / kv_token)
    memory = 1024 * (psi * 2 + seqs * (256 + 512) * kv_token) / 2039e9  # one wave: all 512 fit
    tokens = seqs * (256 + 1024)
    assert t.waves == 1 and t.concurrency == 512 and t.generation_bound == "compute"
    assert t.stages["generation"] == pytest.approx(max(compute, memory))
    assert t.stages["scoring"] == pytest.approx(2 * psi * tokens / flops)  # the reference only: on-policy
    assert t.stages["update"] == pytest.approx(6 * psi * tokens / flops)
    assert set(t.stages) == {"generation", "scoring", "update"}  # no offload, no sleep
    assert roofline.step_time(compose(), estimate(compose())) is None  # hw=cpu: no speeds given


def test_step_time_expects_a_mean_response_length_beside_the_worst_case():
    """The plan's step time at the expected mean response length (rollout.expected_response_len, null = half of
    max_new_tokens), stage by stage, and the worst case (every response at max_new_tokens) on the line below; a mean
    above the budget is refused."""
    cfg = compose("model=qwen2.5-0.5b", "hw=1xgpu")  # 64 x 8 responses of up to 1024 tokens after 256
    plan = estimate(cfg)
    psi, flops, seqs = 494_032_768, 312e12 * 0.4, 64 * 8
    half = roofline.step_time(cfg, plan, 512)
    assert half.stages["update"] == pytest.approx(6 * psi * seqs * (256 + 512) / flops)
    lines = roofline.render(cfg, plan)
    from rlcli.core.units import duration

    assert duration(3 * 3600 + 125) == "3 h 02 min" and duration(75.5) == "1 min 15 s"  # hours read, not 10,925 s
    assert f"{duration(half.total)} per step with responses of 512 tokens on average (half of" in lines[0]
    assert lines[1].endswith(f"max_new_tokens=1024: {duration(roofline.step_time(cfg, plan).total)} per step")
    mine = compose("model=qwen2.5-0.5b", "hw=1xgpu", "rollout.expected_response_len=300")
    assert "responses of 300 tokens on average (rollout.expected_response_len=300)" in roofline.render(mine, plan)[0]
    from rlcli.config import validate
    from rlcli.core.schema import ConfigError

    with pytest.raises(ConfigError, match="expected_response_len=2000 must be <= rollout.max_new_tokens=1024"):
        validate(compose("model=qwen2.5-0.5b", "hw=1xgpu", "rollout.expected_response_len=2000"))


@pytest.mark.slow
def test_train_refuses_a_job_that_cannot_fit_before_loading_anything(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rlcli", "train", "hw.device_memory_gb=0.01", f"hydra.run.dir={run}"],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode != 0
    assert "DOES NOT FIT" in out.stderr and "hw.check_memory=false" in out.stderr
    assert "with one row of 61 tokens per micro-batch" in out.stderr  # auto tried every budget down to one row
    assert not (run / "config.yaml").exists()  # refused before the config was frozen, let alone a model loaded


def test_auto_budget_is_the_most_whole_rows_that_fit():
    """hw.max_tokens_per_micro_batch=auto (the default): no cap when hw.micro_batch rows fit; else the largest
    number of the longest rows whose plan fits: r rows fit, r + 1 do not; fix_budget writes it into the config. The
    budget counts the token positions the forward runs: with shared prompts (the default) each group's prompt once,
    so 40 rows (5 groups of 8) take 5 x (13 + 8 x 48) positions, not 40 x 61."""
    cfg = compose("hw.micro_batch=64")  # the default task: 16 x 8 rows per mini-batch, 13 + 48 tokens each
    assert cfg.hw.max_tokens_per_micro_batch == "auto" and estimate(cfg).shape["budget"] is None  # 24 GiB: fits
    seq, tp = estimate(cfg).shape["seq"], estimate(cfg).shape["prompt"]
    slots = {rows: micro_slots(cfg, tp, rows) for rows in (1, 40, 41, 48)}
    assert (slots[1], slots[40], slots[41], slots[48]) == (seq, 5 * (tp + 8 * 48), 6 * (tp + 8 * 48), 6 * (tp + 8 * 48))
    unshared = with_overrides(cfg, {"hw.share_prompts": False})
    assert micro_slots(unshared, tp, 40) == 40 * seq
    # Past 8 rows the update's activations outgrow the generate KV cache, so each group adds to the peak.
    at = {rows: estimate(with_overrides(cfg, {BUDGET: slots[rows]})).peak for rows in (40, 41)}
    small = with_overrides(cfg, {"hw.device_memory_gb": (at[40] + at[41]) / 2 / GIB})
    plan = fix_budget(small, prompt_tokens(small))
    assert (plan.shape["budget"], plan.shape["micro_rows"], plan.fits) == (slots[40], 40, True)
    assert small.hw.max_tokens_per_micro_batch == slots[40] and "auto: 40 rows of 61 tokens" in render(small, plan)
    tiny_device = with_overrides(cfg, {"hw.device_memory_gb": 0.01})
    assert (estimate(tiny_device).shape["budget"], estimate(tiny_device).fits) == (seq, False)


def test_the_plan_uses_the_longest_prompt_measured_in_the_data(tmp_path):
    """rlcli train plans with the longest prompt the run keeps (its tokenizer, its template, data.max_prompt_len),
    not the ceiling: the tiny tokenizer has one token per character, so the lengths are the texts' lengths."""
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "12+34=", "answer": "46"},
            {"prompt": "x" * 40, "answer": "0"}]  # over data.max_prompt_len=30: dropped
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose("data.source=file", f"data.train_path={data}", f"data.eval_path={data}", "data.adapter=columns",
                  "data.template=question", "data.chat=never", "data.max_prompt_len=30", "data.train_size=null",
                  "data.eval_size=null")
    assert prompt_tokens(cfg)[0] == 30  # without the data: the ceiling
    tokens, note = measure_prompts(cfg)
    assert (tokens, note) == (6, "measured: the longest of 4 train and eval prompts")
    assert estimate(cfg, (tokens, note)).shape["seq"] == 6 + cfg.rollout.max_new_tokens


@pytest.mark.parametrize("digits", [(1, 1), (1, 3), (2, 2)])
def test_the_arith_bound_is_the_longest_prompt_the_tiny_tokenizer_reads(digits):
    """On the embedded arith task and the tiny model `rlcli train` plans with arith_bound and reads no data: it
    equals the longest tokenized prompt of the train and eval splits (one token per character). With a
    multi-turn environment (its tool schema is in the prompt) there is no such bound."""
    from rlcli.data import load_split
    from rlcli.models import load_tokenizer, tokenizer_source

    cfg = compose(f"data.min_digits={digits[0]}", f"data.max_digits={digits[1]}")
    tokenizer = load_tokenizer(tokenizer_source(cfg.model), False)
    prompts = [e["prompt"] for split in ("train", "eval") for e in load_split(cfg.data, split, cfg.seed)[0]]
    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    assert measure_prompts(cfg) == arith_bound(cfg) == (longest, "arith prompt at data.max_digits (1 char = 1 token)")
    assert arith_bound(compose("recipe=tools/calculator")) is None


@pytest.mark.slow
def test_estimate_matches_measured_peak_memory_on_cpu(converted):
    """The estimate against measurement on two shapes, two training steps each on hw=cpu (the second is the
    steady state: Adam states exist during its update): an 8 x 512 tiny Llama on the arith task, and the real
    SmolLM2-135M-Instruct on its chat task (prompts measured from the data, as `rlcli train` plans them). The
    job's own memory (peak RSS minus the RSS of the idle, imported runtime, both measured in the training process)
    against the estimate minus its runtime row, within 25 %. Measured numbers: docs/memory.md."""
    common = ["rollout.prompts_per_step=4", "rollout.n=4", "eval.before=false", "save=false", "data.eval_size=8",
              "data.train_size=64", "checkpoint.every=0", "hw.micro_batch=16"]
    shapes = {
        "tiny 8x512": ["model.warm_start.enabled=false", "model.tiny.num_layers=8", "model.tiny.hidden_size=512",
                       "model.tiny.num_heads=8", "model.tiny.intermediate_size=2048"],
        "smollm2-135m": ["model=smollm2-135m", "data=chat_add", "rollout.prompts_per_step=2", "rollout.max_new_tokens=16"],
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLCLI_CACHE": str(converted[0] / "cache")}
    errors = {}
    for name, shape in shapes.items():
        out = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "peak_memory.py"), "2", *common, *shape],
                             capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        r = json.loads(out.stdout.strip().splitlines()[-1])
        measured, estimated = r["peak_gib"] - r["baseline_gib"], r["estimate_gib"] - r["runtime_gib"]
        errors[name] = (estimated, measured, (estimated - measured) / measured)
    assert all(abs(e) < 0.25 for _, _, e in errors.values()), errors
