"""The per-device memory plan of a composed config: every row of the table, the peak, whether it fits the device, and
the update's micro-batch token budget (hw.max_tokens_per_micro_batch=auto: the largest that fits, by search)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

from rlcli.core.topology import generates_partitioned
from rlcli.plan.activations import activation_bytes, kv_cache_bytes, kv_token_bytes, logits_bytes, micro_shape
from rlcli.plan.inputs import device_memory, prompt_tokens
from rlcli.plan.shapes import (
    Arch,
    arch_of,
    critic_param_count,
    layer_params,
    lora_param_count,
    param_count,
    rm_param_count,
)
from rlcli.plan.states import GIB, activation_element_bytes, compute_bytes, model_states, state_bytes
from rlcli.rewards.config import MODEL_PART

ROLLOUT = "rollout"  # the table row of generation memory (HF KV cache, or the vLLM engine)


# Measured: peak RSS of `python -c "import rlcli.loop.trainer, rlcli.commands.cli"` (python, torch, transformers, DeepSpeed,
# hydra), 0.34 GiB on 2026-11-23 with torch 2.13.0 CPU (docs/memory.md, "Runtime baseline"). Counted on CPU,
# where the device memory is the process's RAM; on a GPU the process's host memory is not device memory.
CPU_RUNTIME_GIB = 0.34


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

    def slots(rows: int) -> int:
        return micro_slots(cfg, prompt[0], rows)

    rows = largest(lambda n: _estimate(cfg, prompt, slots(n), "").peak <= whole.device, 1, whole.shape["micro_rows"] - 1)
    if rows is None:
        return _estimate(cfg, prompt, slots(1), f"auto: not even one row of {seq} tokens fits")
    return _estimate(cfg, prompt, slots(rows), f"auto: {rows} rows of {seq} tokens, the most that fit")


def micro_slots(cfg: Any, prompt: int, rows: int) -> int:
    """Token positions a forward over a micro-batch of `rows` rows runs (rows x (prompt + max_new_tokens), or fewer
    with shared prompts: rlcli.plan.activations.micro_shape), what hw.max_tokens_per_micro_batch caps."""
    from rlcli.core.units import shares_prompts, units

    k, length = micro_shape(rows, units(cfg).G, prompt, cfg.rollout.max_new_tokens, shares_prompts(cfg))
    return k * length


def _estimate(cfg: Any, prompt: tuple[int, str], budget: int | None, budget_note: str) -> Plan:
    from rlcli.core.names import NEEDS_VALUES
    from rlcli.core.precision import mixed_precision
    from rlcli.core.topology import trainer_ranks
    from rlcli.core.units import shares_prompts, units

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
    if cfg.distill.teacher == "self":
        rows["teacher"], notes["teacher"] = 0.0, "the policy itself (distill.teacher=self): no weights of its own"
    elif cfg.distill.teacher:
        rows["teacher"], notes["teacher"], host = teacher_bytes(cfg, arch, wbytes, world, host)
    dev, dev_note = device_memory(hw)
    if "judge" in cfg.reward.weights and cfg.reward.judge.path:
        rows["judge model"], notes["judge model"] = judge_bytes(cfg, arch, wbytes, act_bytes, dev)

    # The update: micro-batches of at most hw.micro_batch rows of the per-rank mini-batch, capped in token slots (with
    # shared prompts a micro-batch of whole groups runs each group's prompt once: fewer, longer sequences).
    u = units(cfg)
    p, g = u.P, u.G
    tp, tp_note = prompt
    seq = tp + r.max_new_tokens
    sp = hw.sp_size  # a sequence-parallel group pools its ranks' rows; each rank runs a slice of every row
    mini_rows = max(1, p // (world // sp) // a.mini_batches * g)
    mb = min(hw.micro_batch, mini_rows)
    if budget:
        mb = largest(lambda n: micro_slots(cfg, tp, n) <= budget, 1, mb) or 1
    k, length = micro_shape(mb, g, tp, r.max_new_tokens, shares_prompts(cfg))
    part = -(-length // sp)  # positions per rank
    # an attention mask per sequence where rows are padded or share a prompt; one whole row attends causally without
    # (and Ulysses never takes one)
    tile = min(hw.tiled_mlp_positions or arch.hidden, part) if hw.tiled_mlp else 0
    off_ckpt = hw.offload_checkpoints and not on_cpu  # on CPU host memory is the device's
    rows["activations"] = activation_bytes(arch, k, part, activation_element_bytes(hw), m.gradient_checkpointing,
                                           mask=sp == 1 and mb > 1, tile=tile, offload=off_ckpt)
    if off_ckpt:  # each block's checkpointed input, in host memory until its recompute
        host += arch.layers * arch.hidden * k * part * activation_element_bytes(hw)
    notes["activations"] = (f"[{k} sequences, {length} tokens]"
                            + (f" ({mb} rows, each group's prompt once)" if k < mb else "")
                            + (f", {part} positions per rank (hw.sp_size={sp})" if sp > 1 else "") + ", "
                            + f"{'gradient checkpointing' if m.gradient_checkpointing else 'no checkpointing'}"
                            + (" (kept in host memory)" if off_ckpt else "")
                            + (f", the MLP in tiles of {tile} positions" if tile else "")
                            + (", counted at fp32's 4 B under autocast (a bound)" if mixed_precision(hw) else ""))
    if sp == 1:  # the response positions' logits, in chunks
        rows["logits chunk"] = logits_bytes(arch, mb, tp, r.max_new_tokens, hw.logits_chunk, act_bytes, k * length)
        c = min(hw.logits_chunk, r.max_new_tokens) if hw.logits_chunk else seq
    else:  # every position of a rank's slice is scored, in chunks
        rows["logits chunk"] = logits_bytes(arch, mb, 0, part, hw.logits_chunk, act_bytes, k * part)
        c = min(hw.logits_chunk, part) if hw.logits_chunk else part
    notes["logits chunk"] = f"fp32 [{mb}, {c}, {arch.vocab}] x 4 + head output"
    if cfg.distill.teacher and cfg.distill.full_kl_coef > 0:  # the teacher's whole distributions, held for the update
        rows["teacher log-probs"] = mb * r.max_new_tokens * arch.vocab * 4.0
        notes["teacher log-probs"] = f"fp32 [{mb}, {r.max_new_tokens}, {arch.vocab}] (distill.full_kl_coef)"

    gen_p = (r.gen_prompts_per_step or p) if a.dynamic_sampling else p
    gen_rows = min(r.gen_batch_size, max(1, gen_p // world * g))
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
                                   "reward model", "judge model", "runtime") if k in rows)
    update = (rows["activations"] + rows["logits chunk"] + rows.get("teacher log-probs", 0.0)
              + (rows[ROLLOUT] if resident else 0.0))
    zero3_generation = None  # HF generation under ZeRO-3 over ranks: the whole model gathered once, or layer by layer
    whole_fits = None  # ... and whether the whole model fits beside the rest
    if generates_partitioned(cfg):
        copy = psi * wbytes  # every parameter, beside this rank's partition, for the generate call
        whole_fits = dev is None or static + max(update, rows[ROLLOUT] + copy) <= dev
        zero3_generation = r.zero3_generation if r.zero3_generation != "auto" else "gathered" if whole_fits else "per_layer"
        if zero3_generation == "gathered":
            rows[ROLLOUT] += copy
            notes[ROLLOUT] += f" + the whole model gathered once per generation, {copy / GIB:.2f} GiB (ZeRO-3)"
        else:
            notes[ROLLOUT] += ("; ZeRO-3: each layer gathered at every decoding step"
                               + ("" if whole_fits else f" (the whole model, {copy / GIB:.2f} GiB, does not fit beside the rest)"))
    peak = static + max(update, rows[ROLLOUT])
    shape = {"psi": psi, "trainable": trainable, "world": world, "micro_rows": mb, "seq": seq, "prompt": tp,
             "prompt_note": tp_note, "budget": budget, "budget_note": budget_note, "gen_rows": gen_rows,
             "kv_room_tokens": kv_room, "arch": arch, "update_peak": static + update, "phase": "update" if update >= rows[
                 ROLLOUT] else "rollout", "resident": resident, "zero3_generation": zero3_generation,
             "whole_fits": whole_fits}
    return Plan(rows, notes, peak, dev, dev_note, host, shape, blockers)


def teacher_bytes(cfg: Any, policy: Arch, wbytes: int, world: int, host: float) -> tuple[float, str, float]:
    """distill.teacher: its frozen weights in the student's bytes per weight, partitioned like the reference model
    under ZeRO-3 (offloaded with offload_params), from the teacher's config.json (else the student's shape, said so).
    -> (bytes per device, note, host bytes)"""
    from rlcli.models.config import teacher_model

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


def arch_at(path: str | None, policy: Arch) -> tuple[Arch, bool]:
    """The shape of the model directory `path`, read from its config.json; the policy's where there is none here.
    -> (the shape, whether it was read)"""
    from types import SimpleNamespace

    path = os.path.expanduser(path) if path else None
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return arch_of(SimpleNamespace(path=path, gguf_file=None)), True
    return policy, False


def reward_model_bytes(cfg: Any, policy: Arch, world: int) -> tuple[float, str]:
    """reward=rm: the reward model's frozen weights on a rank that makes batches (rlcli/rewards/model.py), partitioned
    over the `world` training ranks where it is (config.reward_model_partitioned), else whole; counted as `rlcli rm`
    counts a reward model (rm_param_count), from reward.rm.path's config.json (else the policy's size,
    said so). Its forward has no gradient and runs between generation and the update: its activations are not
    counted."""
    from rlcli.core.precision import inference_dtype
    from rlcli.rewards.config import reward_model_partitioned

    arch, readable = arch_at(cfg.reward.rm.path, policy)
    psi, nbytes = rm_param_count(arch), 4 if inference_dtype(cfg) == "float32" else 2
    where = "reward.rm.path" if readable else "the policy's size: reward.rm.path has no config.json here"
    if reward_model_partitioned(cfg):
        return psi * nbytes / world, f"Ψ = {psi / 1e9:.3f}B x {nbytes} B, frozen, / {world} ranks (ZeRO-3) ({where})"
    return psi * nbytes, f"Ψ = {psi / 1e9:.3f}B x {nbytes} B, frozen, whole on each rank ({where})"


def judge_bytes(cfg: Any, policy: Arch, wbytes: int, act_bytes: int, dev: float | None) -> tuple[float, str]:
    """reward.judge.path: a judge model in the job (rlcli/rewards/judge.py), whole on each rank that makes batches, frozen
    and held through the run, from its config.json (else the policy's shape, said so). On HF generation its weights load
    as the policy's do (`wbytes`); on the vLLM engine the engine holds them in the inference dtype with its KV cache
    (rollout.cpu_kv_cache_gb on CPU; reward.judge.gpu_memory_utilization of the device on a GPU). A judge behind
    reward.judge.url costs nothing here. Its generation's own activations are not counted: they come and go between
    the rollout and the update."""
    j, r = cfg.reward.judge, cfg.rollout
    arch, readable = arch_at(j.path, policy)
    psi, where = param_count(arch), "reward.judge.path" if readable else "the policy's shape: no config.json here"
    if j.engine == "hf":
        return psi * wbytes, f"Ψ = {psi / 1e9:.3f}B x {wbytes} B, frozen, HF generation ({where})"
    weights = psi * act_bytes
    if cfg.hw.device == "cpu":
        return (weights + r.cpu_kv_cache_gb * GIB,
                f"vLLM: Ψ = {psi / 1e9:.3f}B x {act_bytes} B + rollout.cpu_kv_cache_gb={r.cpu_kv_cache_gb} ({where})")
    reserved = j.gpu_memory_utilization * (dev or 0.0)
    return max(weights, reserved), (f"vLLM: reward.judge.gpu_memory_utilization={j.gpu_memory_utilization} of the "
                                    f"device, its weights {weights / GIB:.1f} GiB inside ({where})")


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


def largest_value(cfg: Any, key: str, high: int, device: float, prompt: tuple[int, str], low: int = 1) -> int | None:
    """The largest integer value of `key` in [low, high] whose peak fits `device` (the estimate grows with it)."""
    return largest(lambda value: estimate(with_overrides(cfg, {key: value}), prompt).peak <= device, low, high)
