"""A rough time per training step from a roofline model, for `rlcli plan` (formulas: docs/memory.md, "Step time").

Each stage takes the longer of its compute time (FLOPs over the devices' dense peak at an assumed utilisation)
and, for decoding, its memory time (bytes read over the memory bandwidth); offload and sleep mode add transfers
over the device-host link. Two estimates: every response at its expected length (rollout.expected_response_len,
null = half of rollout.max_new_tokens), and the worst case, every response at rollout.max_new_tokens (a bound, like
the memory plan's). Torch-free: it reads a composed config and the memory plan.

    generation  prefill and decode of the step's P_gen x G sequences, spread over world / k engines of k GPUs;
                decoding runs in waves of as many sequences as the engine's KV cache holds, each wave's step
                reading the engine's weights once and the KV cache of its sequences, plus (k > 1) two
                all-reduces per layer
    scoring     forward passes of the old policy (off-policy) and of the reference (KL): 2 Psi per token
    update      6 Psi per token (8 Psi with gradient checkpointing's recomputation) per epoch, the critic too
    offload     per optimizer step: gradients to the host and weights back (2 + 2 bytes per parameter of the
                rank's partition), and the CPU Adam step
    sleep       per step: the engine's weights to the host and back
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcli.core.units import duration

# Assumed fraction of the dense peak that training and prefill reach (model FLOPs utilisation). Published large
# runs report about 0.4-0.55 (e.g. Megatron-LM, arXiv:2104.04473: 52% on A100s); RL steps on one node with
# ZeRO-3 gathers do worse, so the estimate takes the low end.
MFU = 0.4
# Seconds one all-reduce of a tensor-parallel engine takes during decoding, whose tensors ([sequences, hidden]) are
# small: latency-bound, of order 10 microseconds over NVLink (an assumption). Two per layer per decoding step
# (after attention and after the MLP: Megatron-LM's tensor parallelism, arXiv:1909.08053).
ALLREDUCE_S = 10e-6
# Parameters per second one rank's CPU Adam step updates (DeepSpeedCPUAdam, AVX): an assumption of order
# 1e9 for a few cores per rank, not a measurement; it only matters with hw.offload_optimizer.
CPU_ADAM_PARAMS_PER_S = 1e9


@dataclass
class StepTime:
    """Seconds per training step by stage, and what bounds generation ('compute' or 'memory')."""

    stages: dict[str, float]
    generation_bound: str
    waves: int
    concurrency: int

    @property
    def total(self) -> float:
        return sum(self.stages.values())


def expected_response_len(cfg: Any) -> int:
    """The mean response length the expected estimate assumes: rollout.expected_response_len, null = half the budget."""
    r = cfg.rollout
    return r.expected_response_len or max(1, r.max_new_tokens // 2)


def step_time(cfg: Any, plan: Any, response: int | None = None) -> StepTime | None:
    """The estimate for `cfg` with its memory plan `plan` (rlcli.plan.estimate), every response `response` tokens
    long (None = rollout.max_new_tokens: the worst case); None without the device's peak and bandwidth
    (hw.peak_tflops, hw.memory_bandwidth_gbs)."""
    from rlcli.core.names import NEEDS_VALUES
    from rlcli.core.units import units
    from rlcli.plan.activations import kv_token_bytes
    from rlcli.plan.states import compute_bytes

    hw, r, a = cfg.hw, cfg.rollout, cfg.algo
    if hw.peak_tflops is None or hw.memory_bandwidth_gbs is None:
        return None
    s, arch = plan.shape, plan.shape["arch"]
    u, world = units(cfg), plan.shape["world"]
    flops, bandwidth = hw.peak_tflops * 1e12 * MFU, hw.memory_bandwidth_gbs * 1e9
    psi, wbytes = s["psi"], compute_bytes(hw.precision)
    prompt, response = s["prompt"], response or r.max_new_tokens
    k = r.tensor_parallel_size if r.engine == "vllm" else 1
    engines = max(world // k, 1)
    gen_p = (r.gen_prompts_per_step or u.P) if a.dynamic_sampling else u.P
    seqs = -(-gen_p * u.G // engines)  # sequences per engine

    # Attention reads the context: 2 x 2 x L x (heads x head_dim) FLOPs per token per context token.
    attn = 4 * arch.layers * arch.heads * arch.head_dim
    prefill = seqs * prompt * (2 * psi + attn * prompt / 2)
    decode_flops = seqs * response * (2 * psi + attn * (prompt + response / 2))
    compute = (prefill + decode_flops) / (k * flops)
    # Decoding: each step of a wave reads the engine's weights shard and the wave's KV cache, on every GPU.
    concurrency = max(1, min(seqs, int(s["kv_room_tokens"] // (prompt + response))))
    waves = -(-seqs // concurrency)
    kv_read = concurrency * (prompt + response / 2) * kv_token_bytes(arch, k, wbytes)
    memory = waves * response * ((psi * wbytes / k + kv_read) / bandwidth + (2 * arch.layers * ALLREDUCE_S if k > 1 else 0))
    stages = {"generation": max(compute, memory)}

    tokens = u.P * u.G * (prompt + response) / world  # per rank
    passes = (0 if u.on_policy else 1) + (1 if a.kl_coef > 0 else 0)
    stages["scoring"] = passes * 2 * psi * tokens / flops
    per_token = 8 if cfg.model.gradient_checkpointing else 6
    critic = a.adv_estimator in NEEDS_VALUES
    stages["update"] = a.ppo_epochs * (2 if critic else 1) * per_token * psi * tokens / flops
    link = (hw.host_link_gbs or 0) * 1e9
    optimizer_steps = a.mini_batches * a.ppo_epochs
    if hw.offload_optimizer:
        partition = psi / world * (2 if critic else 1)
        transfer = 4 * partition / link if link else 0.0
        stages["offload"] = optimizer_steps * (transfer + partition / CPU_ADAM_PARAMS_PER_S)
    if r.engine == "vllm" and r.sleep_mode and link:
        stages["sleep"] = 2 * psi * wbytes / k / link
    return StepTime(stages, "memory" if memory >= compute else "compute", waves, concurrency)


def render(cfg: Any, plan: Any) -> list[str]:
    """The plan's step-time lines: the expected step, stage by stage, and the worst case."""
    expected, worst = step_time(cfg, plan, expected_response_len(cfg)), step_time(cfg, plan)
    if expected is None or worst is None:
        return ["step time: not estimated (set hw.peak_tflops and hw.memory_bandwidth_gbs; docs/memory.md)"]
    r = cfg.rollout
    mean = (f"rollout.expected_response_len={r.expected_response_len}" if r.expected_response_len else
            "half of rollout.max_new_tokens; set rollout.expected_response_len")
    parts = ", ".join(f"{name} {sec:,.0f} s" if sec >= 10 else f"{name} {sec:.2g} s"
                      for name, sec in expected.stages.items())
    return [
        f"step time, rough (roofline at {MFU:.0%} of peak): {duration(expected.total)} per step with responses of "
        f"{expected_response_len(cfg)} tokens on average ({mean}) = {parts}",
        f"  worst case, every response at rollout.max_new_tokens={r.max_new_tokens}: {duration(worst.total)} per step",
        f"  generation is {expected.generation_bound}-bound: {expected.waves} wave(s) of {expected.concurrency} "
        f"sequences per engine ({r.tensor_parallel_size if r.engine == 'vllm' else 1} device(s) per engine)",
    ]
