"""The memory plan of `rlcli rm` (and `rlcli plan rm ...`): a reward model's per-device memory, before anything loads.

It is rlcli.plan's count (docs/memory.md) for a different model and a different step: the policy's backbone without
the LM head's vocabulary projection (a tied head is the input embedding, which stays) plus a [hidden, 1] score head;
the same per-parameter bytes by precision, ZeRO stage and offload (rlcli.plan.states.model_states); activations of
one micro-batch of sequences (hw.micro_batch of them, each at most rm.max_len tokens), counted as rlcli.plan counts a
Llama/Qwen2 block (rlcli.plan.activations.activation_bytes); no rollout, no reference model, no vocabulary logits
(the head's output is [rows, L, 1]). Torch-free.
"""

from __future__ import annotations

from typing import Any

from rlcli.plan.activations import activation_bytes
from rlcli.plan.estimate import CPU_RUNTIME_GIB, Plan
from rlcli.plan.inputs import device_memory
from rlcli.plan.shapes import arch_of, layer_params, lora_param_count, rm_param_count
from rlcli.plan.states import GIB, activation_element_bytes, model_states, state_bytes


def micro_rows(cfg: Any) -> int:
    """Sequences per forward/backward: hw.micro_batch, rounded down to whole pairs (at least one pair)."""
    from rlcli.core.topology import trainer_ranks

    per_rank = cfg.rm.batch_size // trainer_ranks(cfg)
    return 2 * max(1, min(cfg.hw.micro_batch // 2, per_rank))


def estimate(cfg: Any, longest: tuple[int, str] | None = None) -> Plan:
    """The per-device plan; `longest`: the longest pair side in tokens and where that number comes from (None =
    rm.max_len, a bound)."""
    from rlcli.core.topology import trainer_ranks

    hw, m = cfg.hw, cfg.model
    arch = arch_of(m)
    world = trainer_ranks(cfg)
    psi = rm_param_count(arch)
    trainable = lora_param_count(arch, m.lora) + arch.hidden if m.lora.r else psi
    on_cpu = hw.device == "cpu"
    states = model_states(psi, trainable, hw.precision, hw.zero_stage, world, hw.offload_optimizer and not on_cpu,
                          hw.offload_params and not on_cpu, layer_params(arch), arch.vocab * arch.hidden)
    if m.lora.r:
        states.weights += trainable * state_bytes(hw.precision, hw.zero_stage).weight
    seq, seq_note = longest or (cfg.rm.max_len, "rm.max_len, a bound")
    rows = micro_rows(cfg)
    table = {"weights": states.weights, "gradients": states.grads, "optimizer states": states.optim,
             "activations": activation_bytes(arch, rows, seq, activation_element_bytes(hw), m.gradient_checkpointing)}
    notes = {"weights": f"Ψ = {psi / 1e9:.4f}B (backbone + score head) x {state_bytes(hw.precision, hw.zero_stage).weight} B",
             "gradients": f"{trainable / 1e9:.4f}B trainable" + (" (LoRA + head)" if m.lora.r else ""),
             "optimizer states": "Adam" + (", offloaded to host" if hw.offload_optimizer and not on_cpu else ""),
             "activations": f"[{rows} sequences, {seq} tokens]"}
    if on_cpu:
        table["runtime"] = CPU_RUNTIME_GIB * GIB
        notes["runtime"] = "python + torch + transformers + DeepSpeed (measured)"
    dev, dev_note = device_memory(hw)
    shape = {"psi": psi, "trainable": trainable, "world": world, "micro_rows": rows, "seq": seq, "seq_note": seq_note,
             "arch": arch}
    return Plan(table, notes, sum(table.values()), dev, dev_note, states.host, shape)


def line(plan: Plan) -> str:
    """The start-up summary's memory line."""
    s = plan.shape
    where = "" if plan.device is None else f" of {plan.device / GIB:.2f} GiB ({plan.device_note}): " + (
        "fits" if plan.fits else "DOES NOT FIT")
    return (f"memory plan: peak {plan.peak / GIB:.2f} GiB per device{where}; reward model {s['psi'] / 1e6:.2f}M "
            f"parameters ({s['trainable'] / 1e6:.2f}M trainable); micro-batches of {s['micro_rows']} sequences x "
            f"{s['seq']} tokens ({s['seq_note']})")


def render(cfg: Any, plan: Plan) -> str:
    """The table `rlcli plan rm ...` prints."""
    s, hw = plan.shape, cfg.hw
    lines = [f"memory plan of `rlcli rm`, per device: model={cfg.model.name} as a reward model ({s['psi'] / 1e9:.4f}B "
             f"parameters; from {s['arch'].source}) hw={hw.name} ({s['world']} x {hw.device}, ZeRO-{hw.zero_stage}, "
             f"{hw.precision})", "", f"  {'':<18}{'GiB':>9}"]
    lines += [f"  {name:<18}{value / GIB:>9.3f}   {plan.notes[name]}" for name, value in plan.rows.items()]
    lines.append(f"  {'peak':<18}{plan.peak / GIB:>9.3f}   model states + one micro-batch's activations")
    if plan.device is not None:
        lines.append(f"  {'device':<18}{plan.device / GIB:>9.2f}   {plan.device_note}: "
                     + (f"fits, margin {(plan.device - plan.peak) / GIB:.2f} GiB" if plan.fits else "DOES NOT FIT"))
    return "\n".join(lines)


def measure_pairs(cfg: Any) -> tuple[int, str]:
    """The longest side (prompt + response) of the run's train and eval pairs in tokens, read as the trainer reads
    them, with the run's tokenizer; no weights are loaded."""
    import logging

    from rlcli.models import load_tokenizer, tokenizer_source
    from rlcli.rm.pairs import load_pairs

    tokenizer = load_tokenizer(tokenizer_source(cfg.model), cfg.model.trust_remote_code)
    logging.disable(logging.WARNING)  # the trainer reports the load (kept, dropped, bad rows)
    try:
        if cfg.rm.source == "samples":  # sampled once the weights load: the task's longest prompt + the budget
            from rlcli.rm.samples import longest_prompt

            bound = longest_prompt(cfg, tokenizer) + cfg.rollout.max_new_tokens + 8
            return bound, "bound: the longest prompt + rollout.max_new_tokens + 8 (the pairs are not sampled yet)"
        pairs = [p for split in ("train", "eval") for p in load_pairs(cfg, split, tokenizer)[0]]
    finally:
        logging.disable(logging.NOTSET)
    texts = [p["prompt"] + p[side] for p in pairs for side in ("chosen", "rejected")]
    longest = max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return longest, f"measured: the longest of {len(pairs)} pairs"


def check_fits(cfg: Any) -> Plan:
    """`rlcli rm`'s check before any weights load, on the pairs' measured lengths: refuse a run whose estimate
    exceeds the device (unless hw.check_memory=false), with the knobs that lower it."""
    from rlcli.core.schema import ConfigError

    plan = estimate(cfg, measure_pairs(cfg))
    if cfg.hw.check_memory and plan.fits is False:
        raise ConfigError(
            f"the estimated peak memory per device of the reward model, {plan.peak / GIB:.2f} GiB, exceeds the "
            f"device's {plan.device / GIB:.2f} GiB ({plan.device_note}): lower hw.micro_batch or rm.max_len, set "
            "model.gradient_checkpointing=true, hw.zero_stage (with hw.nproc > 1) or model.lora.r; or "
            "hw.check_memory=false to train anyway (`rlcli plan rm ...` prints the table)"
        )
    return plan


def main(argv: list[str]) -> int:
    """`rlcli plan rm [overrides]`."""
    from hydra import compose, initialize_config_dir

    from rlcli.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=argv)
    from rlcli.config import validate
    from rlcli.rm.config import validate as validate_rm

    validate(cfg)
    validate_rm(cfg)
    plan = estimate(cfg)
    print(render(cfg, plan))
    return 0 if plan.fits is not False else 1
