"""Changes that would make a plan fit the device, each with its estimated peak and what it costs: memory-only knobs
first, then those that change the experiment or the hardware."""

from __future__ import annotations

import math
from typing import Any

from rlcli.core.topology import splits_heads
from rlcli.plan.activations import kv_token_bytes
from rlcli.plan.estimate import Plan, estimate, largest_value, with_overrides
from rlcli.plan.states import compute_bytes


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
    if not hw.tiled_mlp:  # ALST's savings (rlcli.engine.alst): the MLP's activations one tile at a time
        out.append(({"hw.tiled_mlp": True}, "one more MLP forward per update"))
    if gpu and not hw.offload_checkpoints:  # checkpointing's kept block inputs in host memory
        out.append(({"model.gradient_checkpointing": True, "hw.offload_checkpoints": True},
                    "checkpointing's recompute, and each block's input copied to the host and back"))
    if s["zero3_generation"] == "gathered":
        out.append(({"rollout.zero3_generation": "per_layer"}, "each layer gathered at every decoding step: slower"))
    for n in (2, 4, 8, 16):  # sequence parallelism: a rank keeps the activations of 1/N of each sequence's positions
        if n > hw.sp_size and s["world"] % n == 0 and splits_heads(s["arch"].heads, s["arch"].kv_heads, n):
            out.append(({"hw.sp_size": n}, f"each sequence split over {n} ranks: two all-to-alls per attention layer, "
                                           f"data-parallel size / {n}"))
            break
    if s["micro_rows"] > 1:
        best = largest_value(cfg, "hw.micro_batch", s["micro_rows"] - 1, dev, prompt)
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
        best = largest_value(cfg, "rollout.gen_batch_size", s["gen_rows"] - 1, dev, prompt)
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
                    best = largest_value(with_overrides(current, {key: 1}), key, high, plan.device, prompt)
                    if best is not None:
                        current, applied[key] = with_overrides(current, {key: best}), best
            if estimate(current, prompt).fits:
                return applied, estimate(current, prompt).peak
    return None
