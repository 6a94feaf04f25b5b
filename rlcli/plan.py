"""`rlcli plan`: per-device memory of a composed config, estimated before anything is loaded.

The formulas, their sources and the measured check are in docs/memory.md. In short, per device:

    model states   weights + gradients + optimizer states of the policy (and of the critic), per parameter
                   by precision, then divided by the data-parallel world size N_d where the ZeRO stage
                   partitions them (Rajbhandari et al. 2020, arXiv:1910.02054), or moved to host memory by
                   DeepSpeed's offload (hw.offload_optimizer, hw.offload_params)
    reference      a frozen copy of the policy's weights when algo.kl_coef > 0 (none with LoRA: the base model
                   with its adapters disabled is the reference)
    activations    what the backward pass keeps per layer (Korthikanti et al. 2022, arXiv:2205.05198, counted
                   for a Llama/Qwen2 block), or only each layer's input with gradient checkpointing
    logits         fp32 [rows, chunk, vocab] copies of the log-prob pass (hw.logits_chunk)
    rollout        rollout.engine=hf: the KV cache of one generate call, 2 x layers x kv_heads x head_dim x
                   bytes x rows x (prompt + max_new_tokens); rollout.engine=vllm: what the colocated engine
                   reserves, rollout.gpu_memory_utilization of the device (its weights and KV cache; on CPU
                   its copy of the weights + rollout.cpu_kv_cache_gb)

Generation and the update never run at once, so the peak is the model states plus the larger of the two
phases, max(activations + logits, rollout), except that a vLLM engine without rollout.sleep_mode keeps
its reservation through the update. Units: bytes inside, GiB (2^30 bytes) in every table.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from rlcli import roofline
from rlcli.rewards.config import MODEL_PART

ROLLOUT = "rollout"  # the table row of generation memory (HF KV cache, or the vLLM engine)
GIB = 2**30
# Measured: peak RSS of `python -c "import rlcli.trainer, rlcli.cli"` (python, torch, transformers, DeepSpeed,
# hydra), 0.34 GiB on 2026-11-23 with torch 2.13.0 CPU (docs/memory.md, "Runtime baseline"). Counted on CPU,
# where the device memory is the process's RAM; on a GPU the process's host memory is not device memory.
CPU_RUNTIME_GIB = 0.34
# DeepSpeed's defaults for the buffers we do not set (https://www.deepspeed.ai/docs/config-json/):
# zero_optimization.reduce_bucket_size (gradient bucket of stages 2 and 3), in elements.
REDUCE_BUCKET = 500_000_000


@dataclass(frozen=True)
class Arch:
    """A decoder-only Llama/Qwen2-style transformer, as far as memory is concerned."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    source: str = ""

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def arch_of(model_cfg: Any) -> Arch:
    """The architecture of `model_cfg`'s policy, read without loading weights: a local model.path's config.json,
    else model.arch (hub ids; presets ship it), else model.tiny (model.path null)."""
    if model_cfg.path is None and model_cfg.gguf_file is None:
        from rlcli.models.config import CHARS, SPECIAL_TOKENS

        t = model_cfg.tiny
        return Arch(t.hidden_size, t.num_layers, t.intermediate_size, len(SPECIAL_TOKENS) + len(CHARS), t.num_heads,
                    t.num_heads, t.hidden_size // t.num_heads, t.tie_word_embeddings, False, "model.tiny")
    config_file = os.path.join(model_cfg.path, "config.json") if model_cfg.path else ""
    if os.path.isfile(config_file):
        with open(config_file) as f:
            c = json.load(f)
        c = c.get("text_config", c)  # multimodal wrappers nest the language model's config
        heads = c["num_attention_heads"]
        return Arch(c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"], heads,
                    c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads,
                    bool(c.get("tie_word_embeddings", False)),
                    c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False)), config_file)
    from rlcli.models.config import HUB_ID, download_hint

    a = model_cfg.arch
    required = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads")
    missing = [k for k in required if a[k] is None]
    if missing:
        raise SystemExit(
            f"model.path={model_cfg.path} is not a local directory with a config.json, and model.arch lacks "
            f"{', '.join('model.arch.' + k for k in missing)}: copy them from the model's config.json (e.g. "
            "model.arch.hidden_size=896 ...), or point model.path at a local copy of the model"
            + (f" (rlcli downloads nothing: {download_hint(model_cfg.path)})" if HUB_ID.fullmatch(model_cfg.path or "")
               else "")
        )
    heads = a.num_attention_heads
    return Arch(a.hidden_size, a.num_hidden_layers, a.intermediate_size, a.vocab_size, heads,
                a.num_key_value_heads or heads, a.head_dim or a.hidden_size // heads, a.tie_word_embeddings,
                a.attention_bias, "model.arch")


def layer_params(arch: Arch) -> int:
    """One block: q, k, v (with biases if any), o, SwiGLU gate/up/down, two RMSNorm weights."""
    h, q, kv, i = arch.hidden, arch.heads * arch.head_dim, arch.kv_width, arch.intermediate
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if arch.qkv_bias else 0)
    return attn + 3 * h * i + 2 * h


def param_count(arch: Arch) -> int:
    """Ψ of the causal LM: embedding, blocks, final norm, and the output projection unless tied."""
    embed = arch.vocab * arch.hidden
    return embed + arch.layers * layer_params(arch) + arch.hidden + (0 if arch.tied else embed)


def lora_param_count(arch: Arch, lora: Any) -> int:
    """Adapter parameters: r x (d_in + d_out) for each targeted projection of each block (Hu et al. 2021)."""
    h, q, kv, i = arch.hidden, arch.heads * arch.head_dim, arch.kv_width, arch.intermediate
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    per_layer = sum(lora.r * sum(shapes[m]) for m in lora.target_modules if m in shapes)
    return arch.layers * per_layer


def critic_param_count(arch: Arch, critic_cfg: Any) -> int:
    """The critic: the policy's backbone (no output projection; a tied one is the embedding, kept) plus its head,
    a linear map from the last hidden state to K outputs (rlcli/models/value.py)."""
    k = {"scalar": 1, "multi": critic_cfg.num_heads, "distributional": critic_cfg.num_bins}[critic_cfg.head]
    backbone = param_count(arch) - (0 if arch.tied else arch.vocab * arch.hidden)
    return backbone + arch.hidden * k + k


@dataclass(frozen=True)
class StateBytes:
    """Per-parameter bytes of model states under rlcli's DeepSpeed config (rlcli/engine ds_config)."""

    weight: int
    grad: int
    optim: int


def state_bytes(precision: str, zero_stage: int) -> StateBytes:
    """fp32: 4-byte weights (the master copy) and gradients, Adam m and v (8); ZeRO >= 1 also keeps an fp32 copy
    of its weight partition (12). bf16 at ZeRO >= 1: the paper's mixed precision, 2 + 2 + K=12 (fp32 master,
    m, v). bf16 at ZeRO-0 is rlcli's autocast over fp32 weights (rlcli.config.mixed_precision): the states of
    fp32, 4 + 4 + 8, and model_states adds autocast's bf16 copy of the weights."""
    if precision == "fp32" or zero_stage == 0:
        return StateBytes(4, 4, 12 if zero_stage else 8)
    return StateBytes(2, 2, 12)


def compute_bytes(precision: str) -> int:
    """Bytes per element of the HF KV cache, an inference engine's weights and the logits: 2 under bf16 (at every
    ZeRO stage), 4 in fp32."""
    return 2 if precision == "bf16" else 4


def activation_element_bytes(hw: Any) -> int:
    """Bytes per element of activation_elements_per_token that the update keeps for backward: 2 under DeepSpeed's
    bf16 (ZeRO >= 1: the module itself is bf16), 4 in fp32, and 4 under autocast (bf16 at ZeRO-0,
    config.mixed_precision), which keeps fp32 tensors (the residual stream's RMSNorms, SDPA's log-sum-exp) beside a
    bf16 copy of each matmul's input. Measured with torch's saved-tensor hooks on one block (2026-11-26, seq 16):
    autocast keeps 0.81 of fp32's bytes at SmolLM2-135M's block shape and 0.67 at Qwen2.5-0.5B's, against the 0.5
    that 2 bytes would claim; the plan counts 4 (a bound: planned at 2, a SmolLM2 run the plan passed at 99% of
    RAM was killed for memory)."""
    from rlcli.config import mixed_precision

    return 4 if mixed_precision(hw) else compute_bytes(hw.precision)


@dataclass
class ModelStates:
    weights: float
    grads: float
    optim: float
    host: float  # bytes moved to host memory by offload (per rank)


def model_states(psi: int, trainable: int, precision: str, stage: int, world: int, offload_optimizer: bool,
                 offload_params: bool, layer: int = 0, embed: int = 0) -> ModelStates:
    """Per-device bytes of weights (Ψ of them), gradients and optimizer states (`trainable` of them) at a ZeRO
    stage over `world` data-parallel ranks (ZeRO paper §5.1: P_os at 1, P_os+g at 2, P_os+g+p at 3).

    Beyond the paper: stages 2-3 hold one gradient bucket (DeepSpeed's reduce_bucket_size) besides their
    partition; stage 3 gathers the parameters of about two blocks (the one computing and the one prefetched,
    `layer` parameters each) or the embedding (`embed`); offload keeps the optimizer states (and at stages 2-3
    the gradient partition: ZeRO-Offload, arXiv:2101.06840) or the parameter partition in host memory."""
    b = state_bytes(precision, stage)
    weights = psi * b.weight
    if precision == "bf16" and stage == 0:  # autocast's bf16 copy of each weight, kept from forward to backward
        weights += psi * 2
    grads = trainable * b.grad
    optim = trainable * b.optim
    host = 0.0
    if stage >= 1:
        if offload_optimizer:
            host += optim / world
            optim = 0.0
        else:
            optim = optim / world
    if stage >= 2:
        bucket = min(trainable, REDUCE_BUCKET) * b.grad
        if offload_optimizer:
            host += grads / world
            grads = bucket
        else:
            grads = grads / world + bucket
    if stage == 3:
        gathered = max(2 * layer, embed) * b.weight
        if offload_params:
            host += weights / world
            weights = gathered
        else:
            weights = weights / world + gathered
    return ModelStates(weights, grads, optim, host)


def activation_elements_per_token(arch: Arch, seq: int) -> int:
    """Elements one Llama/Qwen2 block keeps for backward per token, counted like Korthikanti et al. 2022 §4.1
    for this block and checked with torch's saved-tensor hooks on Llama blocks with and without grouped-query
    attention (tests/test_plan.py): each RMSNorm's input and normalised input (2h each) and its weighted output
    as the next projection's input (h each), q and the attention output (heads x head_dim each), k and v at the
    query's width too (with a padding mask HF's SDPA path repeats a grouped-query model's key/value heads before
    attention, and attention keeps the repeated ones), the SwiGLU MLP's gate, SiLU(gate), up and their product
    (4 x intermediate), SDPA's log-sum-exp (one per head) and the [seq, seq] attention mask of a padded batch (seq
    per token). No dropout masks (these models have none)."""
    q = arch.heads * arch.head_dim
    return 6 * arch.hidden + 4 * q + 4 * arch.intermediate + arch.heads + seq


def activation_bytes(arch: Arch, rows: int, seq: int, act_bytes: int, checkpointing: bool) -> float:
    """Activations alive at the peak of a backward over [rows, seq] tokens. Without checkpointing every block
    keeps activation_elements_per_token; with it (HF gradient checkpointing, one checkpoint per block) each
    block keeps only its input (h per token; Korthikanti et al.: 2sbh bytes per layer in 16-bit) and the
    block being differentiated is rebuilt. Either way the backward holds the gradients of one block's
    activations at a time (one more block's worth), and the final RMSNorm keeps 3h."""
    tokens = rows * seq
    block = activation_elements_per_token(arch, seq) * tokens * act_bytes
    final = 3 * arch.hidden * tokens * act_bytes
    kept = arch.layers * arch.hidden * tokens * act_bytes + block if checkpointing else arch.layers * block
    return kept + block + final


def logits_bytes(arch: Arch, rows: int, prompt: int, response: int, chunk: int, act_bytes: int) -> float:
    """The log-prob pass's vocabulary projection: the head's output in the activation dtype plus four fp32
    copies (the upcast logits / temperature, their log-softmax, its gradient, the entropy's softmax) of
    [rows, chunk, vocab]; chunk 0 = the whole sequence, whose head output spans prompt + response."""
    if chunk:
        c = min(chunk, response)
        return rows * c * arch.vocab * (act_bytes + 16)
    return rows * arch.vocab * ((prompt + response) * act_bytes + response * 16)


def kv_cache_bytes(arch: Arch, rows: int, seq: int, kv_bytes: int) -> float:
    """Keys and values of every block for `rows` sequences of `seq` tokens: 2 x L x kv_heads x head_dim x bytes."""
    return kv_token_bytes(arch, 1, kv_bytes) * rows * seq


def kv_token_bytes(arch: Arch, tp: int, kv_bytes: int) -> float:
    """KV cache bytes of one token on each GPU of a `tp`-way tensor-parallel vLLM engine: each GPU holds its share of
    the KV heads, at least one (vLLM replicates KV heads when tp exceeds their number)."""
    return 2 * arch.layers * -(-arch.kv_heads // tp) * arch.head_dim * kv_bytes


@dataclass
class Plan:
    """One estimate: the table rows (bytes per device), the shapes they assume, and the device's memory."""

    rows: dict[str, float]
    notes: dict[str, str]
    peak: float
    device: float | None  # bytes; None = unknown
    device_note: str
    host: float
    shape: dict[str, Any] = field(default_factory=dict)
    blockers: list[str] = field(default_factory=list)
    """What fails whatever the total: a vLLM engine whose weights exceed its share of the device, or whose KV
    cache cannot hold one sequence."""

    @property
    def fits(self) -> bool | None:
        if self.blockers:
            return False
        return None if self.device is None else self.peak <= self.device


def prompt_tokens(cfg: Any) -> tuple[int, str]:
    """Longest prompt, in tokens: data.max_prompt_len bounds it (longer prompts are dropped); the embedded arith
    task with its character tokenizer and the plain template has an exact, smaller bound."""
    d = cfg.data
    tiny = cfg.model.path is None and cfg.model.gguf_file is None
    if d.source == "arith" and tiny and d.template == "question" and d.chat != "always":
        from rlcli.data.arith import make_example

        longest = 10**d.max_digits - 1
        n = max(len(make_example(longest, longest, op)["prompt"]) for op in "+-")
        return min(n, d.max_prompt_len), "arith prompt at data.max_digits (1 char = 1 token)"
    return d.max_prompt_len, "data.max_prompt_len, a bound: `rlcli train` measures the data's longest prompt"


def longest_prompt(tokenizer: Any, examples: list[dict[str, str]], env: Any = None) -> tuple[int, str]:
    """The longest of `examples`' prompts in tokens, encoded as the rollout engines encode them
    (rlcli.rollout.hf.encode_prompts: no special tokens added; a chat template is already rendered). With a
    multi-turn `env` (the config's env group), as the environment's chat template renders them (rlcli.envs)."""
    prompts = [e["prompt"] for e in examples]
    if env is not None and env.name is not None:
        from rlcli.envs.env import rendered_prompts

        prompts = rendered_prompts(tokenizer, env, prompts)
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    return max(lengths), f"measured: the longest of {len(lengths)} train and eval prompts"


def measure_prompts(cfg: Any) -> tuple[int, str]:
    """longest_prompt over the run's train and eval splits, read as the trainer reads them (template, chat
    template, data.max_prompt_len filter) with the run's tokenizer; no weights are loaded (a GGUF file is
    converted first: its tokenizer lives in the conversion)."""
    import logging

    from rlcli.data import load_split
    from rlcli.models import load_tokenizer, tokenizer_source

    tokenizer = load_tokenizer(tokenizer_source(cfg.model), cfg.model.trust_remote_code)
    logging.disable(logging.WARNING)  # the trainer reports the load (kept, dropped, bad rows) when it reads it
    try:
        examples = [e for split in ("train", "eval") for e in load_split(cfg.data, split, cfg.seed, tokenizer=tokenizer)[0]]
    finally:
        logging.disable(logging.NOTSET)
    return longest_prompt(tokenizer, examples, cfg.env)


def device_memory(hw: Any) -> tuple[float | None, str]:
    """(bytes per device or None, where the number comes from)."""
    if hw.device_memory_gb is not None:
        return hw.device_memory_gb * GIB, "hw.device_memory_gb"
    if hw.device == "cpu":
        import psutil

        ram = psutil.virtual_memory().total
        return ram / hw.nproc, f"RAM {ram / GIB:.1f} GiB (psutil) / hw.nproc={hw.nproc} ranks"
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory), f"torch.cuda: {torch.cuda.get_device_name(0)}"
    return None, "unknown: no CUDA device here; set hw.device_memory_gb"


BUDGET = "hw.max_tokens_per_micro_batch"


def estimate(cfg: Any, prompt: tuple[int, str] | None = None) -> Plan:
    """The per-device memory plan of a composed config (see the module docstring). `prompt`: the longest prompt
    in tokens and where that number comes from (measure_prompts); None = the bound prompt_tokens gives.
    hw.max_tokens_per_micro_batch=auto is planned at the budget auto_budget chooses."""
    prompt = prompt or prompt_tokens(cfg)
    budget = cfg.hw.max_tokens_per_micro_batch
    if budget == "auto":
        return auto_budget(cfg, prompt)
    return _estimate(cfg, prompt, budget, f"{BUDGET}={budget}" if budget else "no token cap")


def auto_budget(cfg: Any, prompt: tuple[int, str]) -> Plan:
    """hw.max_tokens_per_micro_batch=auto: the plan at the largest token budget, a whole number of the longest
    rows (prompt + rollout.max_new_tokens), whose peak fits the device: no cap when hw.micro_batch rows fit (or
    the device's memory is unknown), one row when nothing fits (check_fits then refuses). Activations grow with
    the tokens of a micro-batch, the model states not at all, so the search is over rows."""
    whole = _estimate(cfg, prompt, None, "auto: no cap needed, hw.micro_batch rows fit")
    if whole.device is None:
        whole.shape["budget_note"] = "auto: no cap, the device's memory is unknown"
        return whole
    if whole.peak <= whole.device:  # (a blocker, if any, stays in the plan: it is not the micro-batch's doing)
        return whole
    seq = whole.shape["seq"]
    rows = largest(lambda n: _estimate(cfg, prompt, n * seq, "").peak <= whole.device, 1, whole.shape["micro_rows"] - 1)
    if rows is None:
        return _estimate(cfg, prompt, seq, f"auto: not even one row of {seq} tokens fits")
    return _estimate(cfg, prompt, rows * seq, f"auto: {rows} rows of {seq} tokens, the most that fit")


def _estimate(cfg: Any, prompt: tuple[int, str], budget: int | None, budget_note: str) -> Plan:
    from rlcli.config import mixed_precision, trainer_ranks, units
    from rlcli.names import NEEDS_VALUES

    hw, m, r, a = cfg.hw, cfg.model, cfg.rollout, cfg.algo
    arch = arch_of(m)
    world = trainer_ranks(cfg)  # ZeRO shards over the training ranks (not asynchronous rollout's rollout ranks)
    psi = param_count(arch)
    lora = m.lora.r > 0
    trainable = lora_param_count(arch, m.lora) if lora else psi
    embed = arch.vocab * arch.hidden
    on_cpu = hw.device == "cpu"
    # Offload moves states to host memory; on CPU that is the same RAM, so it saves nothing there.
    off_opt, off_par = hw.offload_optimizer and not on_cpu, hw.offload_params and not on_cpu
    policy = model_states(psi, trainable, hw.precision, hw.zero_stage, world, off_opt, off_par,
                          layer_params(arch), embed)
    if lora:  # the adapters' weights are counted in psi's dtype: add them to the frozen base
        policy.weights += trainable * state_bytes(hw.precision, hw.zero_stage).weight
    wbytes = state_bytes(hw.precision, hw.zero_stage).weight  # the reference copy's (DeepSpeed casts to bf16 at ZeRO >= 1)
    act_bytes = compute_bytes(hw.precision)  # activations, the HF KV cache, the vLLM engine's weights

    rows, notes = {}, {}
    rows["weights"] = policy.weights
    notes["weights"] = f"Ψ = {psi / 1e9:.3f}B x {wbytes} B" + (" + its bf16 autocast copy x 2 B" if act_bytes < wbytes else "") + (
        f" (+ LoRA {trainable / 1e6:.1f}M)" if lora else "") + _zero_note(hw.zero_stage, world, "weights")
    rows["gradients"] = policy.grads
    notes["gradients"] = f"{'LoRA ' if lora else ''}{trainable / 1e9:.3f}B trainable" + (
        ": one reduce bucket here, the partition offloaded with the optimizer" if off_opt and hw.zero_stage >= 2
        else _zero_note(hw.zero_stage, world, "grads"))
    rows["optimizer states"] = policy.optim
    notes["optimizer states"] = ("Adam, offloaded to host" if off_opt else
                                 f"Adam, {state_bytes(hw.precision, hw.zero_stage).optim} B/param"
                                 + _zero_note(hw.zero_stage, world, "optim"))
    host = policy.host

    ref = 0.0
    if a.kl_coef > 0 and not lora:
        ref = psi * wbytes
        if hw.zero_stage == 3:
            if off_par:
                host += ref / world
                ref = 2 * layer_params(arch) * wbytes
            else:
                ref = ref / world
        notes["reference model"] = "frozen copy (algo.kl_coef > 0)"
    else:
        notes["reference model"] = ("none: the LoRA base with adapters disabled" if a.kl_coef > 0
                                    else "none (algo.kl_coef = 0)")
    rows["reference model"] = ref

    critic = 0.0
    if a.adv_estimator in NEEDS_VALUES:
        c_psi = critic_param_count(arch, cfg.critic)
        cs = model_states(c_psi, c_psi, hw.precision, hw.zero_stage, world, off_opt, off_par, layer_params(arch),
                          embed)
        critic, host = cs.weights + cs.grads + cs.optim, host + cs.host
        notes["critic"] = f"{c_psi / 1e9:.3f}B params, own Adam ({a.adv_estimator} needs values)"
    else:
        notes["critic"] = f"none ({a.adv_estimator} needs no values)"
    rows["critic"] = critic
    if MODEL_PART in cfg.reward.weights:
        rows["reward model"], notes["reward model"] = reward_model_bytes(cfg, arch, world)
    if cfg.distill.teacher:
        rows["teacher"], notes["teacher"], host = teacher_bytes(cfg, arch, wbytes, world, host)

    # The update: micro-batches of at most hw.micro_batch rows of the per-rank mini-batch, capped in tokens.
    u = units(cfg)
    p, g = u.P, u.G
    tp, tp_note = prompt
    seq = tp + r.max_new_tokens
    mini_rows = max(1, p // world // a.mini_batches * g)
    mb = min(hw.micro_batch, mini_rows)
    if budget:
        mb = max(1, min(mb, budget // seq))
    rows["activations"] = activation_bytes(arch, mb, seq, activation_element_bytes(hw), m.gradient_checkpointing)
    notes["activations"] = (f"[{mb} rows, {seq} tokens], "
                            f"{'gradient checkpointing' if m.gradient_checkpointing else 'no checkpointing'}"
                            + (", counted at fp32's 4 B under autocast (a bound)" if mixed_precision(hw) else ""))
    rows["logits chunk"] = logits_bytes(arch, mb, tp, r.max_new_tokens, hw.logits_chunk, act_bytes)
    c = min(hw.logits_chunk, r.max_new_tokens) if hw.logits_chunk else seq
    notes["logits chunk"] = f"fp32 [{mb}, {c}, {arch.vocab}] x 4 + head output"
    if cfg.distill.teacher and cfg.distill.full_kl_coef > 0:  # the teacher's whole distributions, held for the update
        rows["teacher log-probs"] = mb * r.max_new_tokens * arch.vocab * 4.0
        notes["teacher log-probs"] = f"fp32 [{mb}, {r.max_new_tokens}, {arch.vocab}] (distill.full_kl_coef)"

    gen_p = (r.gen_prompts_per_step or p) if a.dynamic_sampling else p
    gen_rows = min(r.gen_batch_size, max(1, gen_p // world * g))
    dev, dev_note = device_memory(hw)
    kv_room = gen_rows * seq  # tokens the rollout's KV cache holds at once: one generate call (hf), or vLLM's share
    blockers: list[str] = []
    if r.engine == "vllm" and arch.heads % r.tensor_parallel_size:
        blockers.append(f"vLLM shards attention heads: rollout.tensor_parallel_size={r.tensor_parallel_size} must "
                        f"divide the model's {arch.heads}")
    if r.engine == "vllm":
        if on_cpu:
            rows[ROLLOUT] = psi * act_bytes + r.cpu_kv_cache_gb * GIB
            notes[ROLLOUT] = f"vLLM: its weights + rollout.cpu_kv_cache_gb={r.cpu_kv_cache_gb}"
            kv_room = r.cpu_kv_cache_gb * GIB / kv_token_bytes(arch, 1, act_bytes)
        else:  # per GPU of a k-way tensor-parallel engine: its shard of the weights, and the KV cache in the rest
            k = r.tensor_parallel_size
            engine_weights, reserved = psi * act_bytes / k, r.gpu_memory_utilization * (dev or 0.0)
            rows[ROLLOUT] = max(reserved, engine_weights)
            kv_room = max(reserved - engine_weights, 0.0) / kv_token_bytes(arch, k, act_bytes)
            notes[ROLLOUT] = (f"vLLM at rollout.tensor_parallel_size={k}: weights {engine_weights / GIB:.1f} + KV cache "
                              f"{max(reserved - engine_weights, 0.0) / GIB:.1f} (rollout.gpu_memory_utilization="
                              f"{r.gpu_memory_utilization}), room for {kv_room / seq:.1f} sequences of {seq} tokens"
                              + ("; asleep during the update" if r.sleep_mode else "; held through the update too"))
            if dev and engine_weights > reserved:
                notes[ROLLOUT] = (f"vLLM's weights alone, {engine_weights / GIB:.1f} GiB at rollout.tensor_parallel_size="
                                  f"{k}, exceed rollout.gpu_memory_utilization={r.gpu_memory_utilization}: raise either")
                blockers.append(notes[ROLLOUT])
            elif dev and kv_room < seq:
                blockers.append(f"vLLM's KV cache, {kv_room:.0f} tokens per engine, cannot hold one sequence of {seq} "
                                "tokens: raise rollout.gpu_memory_utilization or rollout.tensor_parallel_size")
    else:
        rows[ROLLOUT] = kv_cache_bytes(arch, gen_rows, seq, act_bytes)
        notes[ROLLOUT] = f"HF generate KV cache: {gen_rows} rows x {seq} tokens, {act_bytes} B"
    resident = r.engine == "vllm" and not r.sleep_mode  # held while the actor updates too
    if on_cpu:
        rows["runtime"] = CPU_RUNTIME_GIB * GIB
        notes["runtime"] = "python + torch + transformers + DeepSpeed (measured)"

    static = sum(rows[k] for k in ("weights", "gradients", "optimizer states", "reference model", "teacher", "critic",
                                   "reward model", "runtime") if k in rows)
    update = (rows["activations"] + rows["logits chunk"] + rows.get("teacher log-probs", 0.0)
              + (rows[ROLLOUT] if resident else 0.0))
    peak = static + max(update, rows[ROLLOUT])
    shape = {"psi": psi, "trainable": trainable, "world": world, "micro_rows": mb, "seq": seq, "prompt": tp,
             "prompt_note": tp_note, "budget": budget, "budget_note": budget_note, "gen_rows": gen_rows,
             "kv_room_tokens": kv_room, "arch": arch, "phase": "update" if update >= rows[
                 ROLLOUT] else "rollout", "resident": resident}
    return Plan(rows, notes, peak, dev, dev_note, host, shape, blockers)


def teacher_bytes(cfg: Any, policy: Arch, wbytes: int, world: int, host: float) -> tuple[float, str, float]:
    """distill.teacher: its frozen weights in the student's bytes per weight, partitioned like the reference model
    under ZeRO-3 (offloaded with offload_params), from the teacher's config.json (else the student's shape, said so).
    -> (bytes per device, note, host bytes)"""
    from rlcli.config import teacher_model

    hw, model = cfg.hw, teacher_model(cfg)
    if model.path is None or os.path.isfile(os.path.join(model.path, "config.json")):
        arch, note = arch_of(model), f"frozen, {cfg.distill.teacher}"
    else:
        arch, note = policy, "frozen, the student's shape (distill.teacher has no config.json here)"
    size = param_count(arch) * wbytes
    if hw.zero_stage == 3:
        if hw.offload_params and hw.device != "cpu":
            host, size = host + size / world, 2 * layer_params(arch) * wbytes
        else:
            size = size / world
    return size, f"{note}: {param_count(arch) / 1e9:.3f}B params", host


def reward_model_bytes(cfg: Any, policy: Arch, world: int) -> tuple[float, str]:
    """reward=rm: the reward model's frozen weights on a rank that makes batches (rlcli/rewards/model.py), partitioned
    over the `world` training ranks where it is (config.reward_model_partitioned), else whole; counted as `rlcli rm`
    counts a reward model (rlcli.rm.plan.rm_param_count), from reward.rm.path's config.json (else the policy's size,
    said so). Its forward has no gradient and runs between generation and the update: its activations are not
    counted."""
    from types import SimpleNamespace

    from rlcli.config import inference_dtype, reward_model_partitioned
    from rlcli.rm.plan import rm_param_count

    path = cfg.reward.rm.path
    readable = path is not None and os.path.isfile(os.path.join(os.path.expanduser(path), "config.json"))
    arch = arch_of(SimpleNamespace(path=os.path.expanduser(path), gguf_file=None)) if readable else policy
    psi, nbytes = rm_param_count(arch), 4 if inference_dtype(cfg) == "float32" else 2
    where = "reward.rm.path" if readable else "the policy's size: reward.rm.path has no config.json here"
    if reward_model_partitioned(cfg):
        return psi * nbytes / world, f"Ψ = {psi / 1e9:.3f}B x {nbytes} B, frozen, / {world} ranks (ZeRO-3) ({where})"
    return psi * nbytes, f"Ψ = {psi / 1e9:.3f}B x {nbytes} B, frozen, whole on each rank ({where})"


def _zero_note(stage: int, world: int, what: str) -> str:
    split = {"weights": stage >= 3, "grads": stage >= 2, "optim": stage >= 1}[what]
    return f", / {world} ranks (ZeRO-{stage})" if split and world > 1 else ""


def with_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """A copy of `cfg` with dotted keys set."""
    from omegaconf import OmegaConf, open_dict

    new = copy.deepcopy(cfg)
    with open_dict(new):
        for k, v in overrides.items():
            OmegaConf.update(new, k, v, merge=False)
    return new


def largest(fits: Any, low: int, high: int) -> int | None:
    """The largest integer in [low, high] for which `fits` holds, `fits` being monotone (true, then false);
    None if it does not hold at `low`."""
    if not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _largest(cfg: Any, key: str, high: int, device: float, prompt: tuple[int, str], low: int = 1) -> int | None:
    """The largest integer value of `key` in [low, high] whose peak fits `device` (the estimate grows with it)."""
    return largest(lambda value: estimate(with_overrides(cfg, {key: value}), prompt).peak <= device, low, high)


def fixes(cfg: Any, plan: Plan) -> list[tuple[dict[str, Any], float, str]]:
    """Changes to try, each with its estimated peak: (overrides, peak bytes, what it costs). Memory-only knobs
    first, then the ones that change the experiment or the hardware."""
    if plan.device is None:
        return []
    hw, m, r = cfg.hw, cfg.model, cfg.rollout
    dev, s = plan.device, plan.shape
    prompt = (s["prompt"], s["prompt_note"])
    gpu = hw.device != "cpu"
    out: list[tuple[dict[str, Any], str]] = []
    if s["world"] > 1:
        for stage in range(hw.zero_stage + 1, 3 if m.lora.r else 4):
            out.append(({"hw.zero_stage": stage}, "more communication"))
    if gpu and not hw.offload_optimizer:
        out.append(({"hw.zero_stage": max(1, hw.zero_stage), "hw.offload_optimizer": True},
                    "Adam on the CPU: slower steps, host RAM"))
    if gpu and not hw.offload_params and not m.lora.r:
        out.append(({"hw.zero_stage": 3, "hw.offload_optimizer": True, "hw.offload_params": True},
                    "weights fetched from host RAM each pass: much slower"))
    if not m.gradient_checkpointing:
        out.append(({"model.gradient_checkpointing": True}, "about 1/3 more compute in the update"))
    if s["micro_rows"] > 1:
        best = _largest(cfg, "hw.micro_batch", s["micro_rows"] - 1, dev, prompt)
        if best is not None:
            out.append(({"hw.micro_batch": best}, "more, smaller forward/backward passes"))
        else:
            out.append(({"hw.micro_batch": 1}, "more, smaller forward/backward passes"))
    if hw.logits_chunk == 0 or hw.logits_chunk > 64:
        out.append(({"hw.logits_chunk": 64}, "more, smaller vocabulary projections"))
    engine_weights = s["psi"] * compute_bytes(hw.precision)
    tp = r.tensor_parallel_size
    runnable = [t for t in (2, 4, 8) if hw.nproc % t == 0 and s["arch"].heads % t == 0]  # vLLM's TP rules
    while r.engine == "vllm" and gpu and engine_weights / tp > r.gpu_memory_utilization * dev and tp * 2 in runnable:
        tp *= 2
    if tp != r.tensor_parallel_size:
        out.append(({"rollout.tensor_parallel_size": tp}, "each engine shards the model over more GPUs"))
    if r.engine == "vllm" and gpu and plan.blockers:  # the share that holds the weights and one sequence, in 0.05s
        need = (engine_weights / r.tensor_parallel_size + s["seq"] * kv_token_bytes(
            s["arch"], r.tensor_parallel_size, compute_bytes(hw.precision))) / dev
        if need < 0.95:
            out.append(({"rollout.gpu_memory_utilization": round(math.ceil(need / 0.05) * 0.05, 2)},
                        "the engine's share of the device, for its weights and one sequence"))
    if r.engine == "vllm" and gpu and not r.sleep_mode:
        out.append(({"rollout.sleep_mode": True}, "the engine sleeps while the actor updates: wake-up each step"))
    if r.engine == "hf" and s["gen_rows"] > 1:
        best = _largest(cfg, "rollout.gen_batch_size", s["gen_rows"] - 1, dev, prompt)
        out.append(({"rollout.gen_batch_size": best or 1}, "more, smaller generate calls"))
    if not m.lora.r:
        out.append(({"model.lora.r": 16, **({"hw.zero_stage": 2, "hw.offload_params": False}
                                             if hw.zero_stage == 3 else {})},
                    "LoRA adapters instead of full fine-tuning: a different experiment"))
    out.append(({"rollout.max_new_tokens": r.max_new_tokens // 2,
                 "rollout.overlong_buffer_len": max(1, min(r.overlong_buffer_len, r.max_new_tokens // 4))},
                "shorter responses: a different experiment"))
    if gpu:
        out.append(({"hw.nnodes": hw.nnodes * 2}, "twice the GPUs (rollout.prompts_per_step must divide)"))
    plans = [(o, estimate(with_overrides(cfg, o), prompt), why) for o, why in out]
    # only changes that lower the peak, or let the engine run
    return [(o, q.peak, why) for o, q, why in plans if q.peak < plan.peak or (plan.blockers and not q.blockers)]


def combined_fix(cfg: Any, plan: Plan) -> tuple[dict[str, Any], float] | None:
    """Memory-only fixes applied one after another until the estimate fits: (overrides, peak) or None."""
    if plan.device is None or plan.fits:
        return None
    applied: dict[str, Any] = {}
    current = cfg
    prompt = (plan.shape["prompt"], plan.shape["prompt_note"])
    for overrides, _, why in fixes(cfg, plan):
        if "experiment" in why or "GPUs" in why:
            continue
        trial = with_overrides(current, overrides)
        now, then = estimate(current, prompt), estimate(trial, prompt)
        if then.peak < now.peak or len(then.blockers) < len(now.blockers):
            current, applied = trial, {**applied, **overrides}
            # micro-batch and generate sizes were chosen for the original config: re-fit them to this one
            for key, high in (("hw.micro_batch", cfg.hw.micro_batch), ("rollout.gen_batch_size", cfg.rollout.gen_batch_size)):
                if key in applied:
                    best = _largest(with_overrides(current, {key: 1}), key, high, plan.device, prompt)
                    if best is not None:
                        current, applied[key] = with_overrides(current, {key: best}), best
            if estimate(current, prompt).fits:
                return applied, estimate(current, prompt).peak
    return None


def render(cfg: Any, plan: Plan, with_fixes: bool = True) -> str:
    """The table `rlcli plan` prints (and `rlcli train` shows when it refuses a job)."""
    s, hw = plan.shape, cfg.hw
    arch: Arch = s["arch"]
    lines = [
        f"memory plan, per device: model={cfg.model.name} ({s['psi'] / 1e9:.3f}B parameters, {arch.layers} layers x "
        f"{arch.hidden}, vocab {arch.vocab}; from {arch.source}) hw={hw.name} ({s['world']} x {hw.device}, "
        f"ZeRO-{hw.zero_stage}, {hw.precision}) algo={cfg.algo.name}",
        f"tokens per row: prompt {s['prompt']} ({s['prompt_note']}) + response {cfg.rollout.max_new_tokens} "
        "(rollout.max_new_tokens, a bound)",
        f"update micro-batch: {s['micro_rows']} rows ({budget_text(plan)})",
        "",
        f"  {'':<18}{'GiB':>9}",
    ]
    for name, value in plan.rows.items():
        lines.append(f"  {name:<18}{value / GIB:>9.2f}   {plan.notes[name]}")
    phase = ("the update (activations + logits" + (" + the engine's reservation)" if s["resident"] else ")")
             if s["phase"] == "update" else "generation")
    lines.append(f"  {'peak':<18}{plan.peak / GIB:>9.2f}   model states + the larger phase: {phase}")
    if plan.device is None:
        lines.append(f"  {'device':<18}{'?':>9}   {plan.device_note}")
    else:
        verdict = f"fits, margin {(plan.device - plan.peak) / GIB:.2f} GiB" if plan.fits else "DOES NOT FIT"
        if plan.blockers:
            verdict = "DOES NOT RUN: " + "; ".join(plan.blockers)
        lines.append(f"  {'device':<18}{plan.device / GIB:>9.2f}   {plan.device_note}: {verdict} "
                     f"({plan.peak / plan.device:.0%})")
    if plan.host:
        lines.append(f"  {'host (offload)':<18}{plan.host / GIB:>9.2f}   per rank, in CPU RAM")
    if hw.device != "cpu":
        lines.append("  not counted: the CUDA context and allocator fragmentation (keep a margin)")
    lines += ["", *roofline.render(cfg, plan)]
    if with_fixes and plan.fits is False:
        lines += ["", "to try (estimated peak after each change, alone):"]
        for overrides, peak, why in fixes(cfg, plan):
            mark = "fits" if estimate(with_overrides(cfg, overrides), (s["prompt"], s["prompt_note"])).fits else "    "
            lines.append(f"  {peak / GIB:>8.2f} GiB {mark}  {_overrides_text(overrides)}   ({why})")
        combo = combined_fix(cfg, plan)
        if combo:
            lines += ["", f"memory-only changes that fit together ({combo[1] / GIB:.2f} GiB): {_overrides_text(combo[0])}"]
    return "\n".join(lines)


def _overrides_text(overrides: dict[str, Any]) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items())


def budget_text(plan: Plan) -> str:
    """The micro-batch token budget and why: '<= 264 tokens (auto: 4 rows of 66 tokens, the most that fit)'."""
    s = plan.shape
    return (f"<= {s['budget']} tokens, " if s["budget"] else "") + s["budget_note"]


def fix_budget(cfg: Any, prompt: tuple[int, str]) -> Plan:
    """The plan with the longest prompt `prompt`; hw.max_tokens_per_micro_batch=auto is set (in `cfg`) to the
    budget it chose, a number of tokens or null (no cap)."""
    plan = estimate(cfg, prompt)
    if cfg.hw.max_tokens_per_micro_batch == "auto":
        from omegaconf import open_dict

        with open_dict(cfg):
            cfg.hw.max_tokens_per_micro_batch = plan.shape["budget"]
    return plan


def check_fits(cfg: Any) -> Plan | None:
    """`rlcli train`'s memory step before any weights load: measure the data's longest prompt (the tokenizer and
    the prompts are read), plan with it, fix hw.max_tokens_per_micro_batch=auto to the budget that fits (the
    frozen config and every rank then use that number), and refuse a job whose estimate still exceeds the
    device's memory (with auto: not even one row per micro-batch fits) unless hw.check_memory=false. None when
    there is nothing to do (the check off and an explicit budget)."""
    if not cfg.hw.check_memory and cfg.hw.max_tokens_per_micro_batch != "auto":
        return None
    plan = fix_budget(cfg, measure_prompts(cfg))
    if cfg.hw.check_memory and plan.fits is False:
        print(render(cfg, plan) + "\n", file=sys.stderr, flush=True)  # the breakdown and the fixes, then the error
        from rlcli.schema import ConfigError

        if plan.blockers:
            raise ConfigError("the rollout engine cannot run as configured: " + "; ".join(plan.blockers)
                              + ". Apply one of the changes above (docs/memory.md explains the estimate).")
        one_row = plan.shape["budget_note"].startswith("auto: not even one row")
        raise ConfigError(
            f"the estimated peak memory per device, {plan.peak / GIB:.2f} GiB"
            + (f" with one row of {plan.shape['seq']} tokens per micro-batch (hw.max_tokens_per_micro_batch=auto "
               "found no budget that fits)" if one_row else "")
            + f", exceeds the device's {plan.device / GIB:.2f} GiB ({plan.device_note}). Apply one of the changes "
            "above; or set hw.device_memory_gb if the device has more; or hw.check_memory=false to train anyway "
            "(docs/memory.md explains the estimate)."
        )
    return plan


def fits_line(plan: Plan) -> str:
    """The start-up summary's memory line."""
    s = plan.shape
    where = "" if plan.device is None else f" of {plan.device / GIB:.2f} GiB ({plan.device_note}): " + (
        "fits" if plan.fits else "DOES NOT FIT, hw.check_memory=false")
    return (f"memory plan: peak {plan.peak / GIB:.2f} GiB per device{where}; longest prompt {s['prompt']} tokens "
            f"({s['prompt_note']}); update micro-batches {budget_text(plan)} (`rlcli plan` shows the table)")


HELP = """rlcli plan: per-device memory of a training config, estimated before anything is loaded.

usage: rlcli plan [group=option ...] [key=value ...]      e.g. rlcli plan model=qwen2.5-32b hw=8xa100 algo=dapo
       rlcli plan rm [group=option ...] [key=value ...]   the reward model of `rlcli rm` (rlcli/rm/plan.py)

Prints, in GiB per device: the policy's weights, gradients and optimizer states (by hw.precision, hw.zero_stage
over hw.nproc x hw.nnodes ranks, hw.offload_optimizer, hw.offload_params), the reference model (algo.kl_coef > 0,
none with LoRA), the critic (estimators that need values), the update's activations (model.gradient_checkpointing,
hw.micro_batch, hw.max_tokens_per_micro_batch), the log-prob pass's logits (hw.logits_chunk) and the rollout's
memory (rollout.engine=hf: the KV cache of rollout.gen_batch_size rows; vllm: the engine's reservation,
rollout.gpu_memory_utilization, held through the update unless rollout.sleep_mode); then the peak against
the device's memory (hw.device_memory_gb; null = this
machine's GPU, or its RAM on CPU) and, when it does not fit, the changes to try with the estimate after each.
The architecture comes from model.path's config.json (a local directory), model.arch (hub presets) or
model.tiny. `rlcli train` runs the same check first (hw.check_memory). Formulas and sources: docs/memory.md.
"""


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(HELP)
        return 0
    if argv[:1] == ["rm"]:  # `rlcli plan rm ...`: the reward model `rlcli rm ...` would train
        from rlcli.rm.plan import main as plan_rm

        return plan_rm(argv[1:])
    from hydra import compose, initialize_config_dir

    from rlcli.cli import CONF_DIR
    from rlcli.config import register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=argv)
    validate(cfg)  # a ConfigError: rlcli's one-line error, exit status 2 (rlcli.cli.main)
    plan = estimate(cfg)
    print(render(cfg, plan))
    return 0 if plan.fits is not False else 1
