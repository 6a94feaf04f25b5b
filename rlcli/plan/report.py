"""`rlcli plan`'s table with its fixes and step time, and `rlcli train`'s memory check and start-up line."""

from __future__ import annotations

import sys
from typing import Any

from rlcli.plan import roofline
from rlcli.plan.budget import budget_pending, fix_budget
from rlcli.plan.estimate import Plan, estimate, with_overrides
from rlcli.plan.fixes import combined_fix, fixes
from rlcli.plan.inputs import measure_prompts
from rlcli.plan.shapes import Arch
from rlcli.plan.states import GIB


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
                     f"(the peak is {plan.peak / plan.device:.0%} of it)")
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


def check_fits(cfg: Any) -> Plan | None:
    """`rlcli train`'s memory step before any weights load: measure the data's longest prompt (the tokenizer and
    the prompts are read), plan with it, fix hw.max_tokens_per_micro_batch=auto to the budget that fits and
    rollout.zero3_generation=auto to what fits (the frozen config and every rank then use them), and refuse a job whose estimate still exceeds the
    device's memory (with auto: not even one row per micro-batch fits) unless hw.check_memory=false. None when
    there is nothing to do (the check off, nothing auto)."""
    if not cfg.hw.check_memory and not budget_pending(cfg):
        return None
    plan = fix_budget(cfg, measure_prompts(cfg))
    if cfg.hw.check_memory and plan.fits is False:
        print(render(cfg, plan) + "\n", file=sys.stderr, flush=True)  # the breakdown and the fixes, then the error
        from rlcli.core.schema import ConfigError

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
    gen = {"gathered": "; ZeRO-3 generation: the whole model gathered once per generate call",
           "per_layer": "; ZeRO-3 generation: each layer gathered at every decoding step"
           + (", the whole model does not fit beside the rest" if s["whole_fits"] is False else "")}
    return (f"memory plan: peak {plan.peak / GIB:.2f} GiB per device{where}; longest prompt {s['prompt']} tokens "
            f"({s['prompt_note']}); update micro-batches {budget_text(plan)}{gen.get(s['zero3_generation'], '')} "
            "(`rlcli plan` shows the table)")


HELP = """rlcli plan: per-device memory of a training config, estimated before anything is loaded.

usage: rlcli plan [group=option ...] [key=value ...]      e.g. rlcli plan model=qwen2.5-32b hw=8xa100 algo=dapo
       rlcli plan rm [group=option ...] [key=value ...]   the reward model of `rlcli rm` (rlcli/commands/rm_plan.py)

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

       rlcli plan --max-response [overrides]   the longest rollout.max_new_tokens whose plan fits the device, at
                                                hw.sp_size as configured and at each larger one the ranks and the
                                                attention heads allow (sequence parallelism: docs/sequence_parallel.md)
"""


def longest_responses(cfg: Any, high: int = 1 << 25) -> list[tuple[int, int | None, int | None]]:
    """`rlcli plan --max-response`: for hw.sp_size as configured and each larger one that divides the ranks and the
    attention heads, the longest rollout.max_new_tokens (up to `high`) whose whole plan fits the device, and the
    longest whose update alone fits (model states + the update's activations and logits: what a trainer without
    generation, an SFT run, would need), everything else as configured; None when not even one token does. The
    estimate grows with the response, so each is a search over it. -> [(sp_size, whole plan, update alone)]"""
    from rlcli.core.topology import splits_heads, trainer_ranks
    from rlcli.plan.estimate import largest
    from rlcli.plan.inputs import prompt_tokens

    prompt, arch = prompt_tokens(cfg), estimate(cfg).shape["arch"]
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64)
             if n >= cfg.hw.sp_size and trainer_ranks(cfg) % n == 0 and splits_heads(arch.heads, arch.kv_heads, n)]

    def plan_at(n: int, tokens: int) -> Plan:
        buffer = min(cfg.rollout.overlong_buffer_len, tokens)
        return estimate(with_overrides(cfg, {"hw.sp_size": n, "rollout.max_new_tokens": tokens,
                                             "rollout.overlong_buffer_len": buffer}), prompt)

    def update_fits(q: Plan) -> bool:
        return q.device is not None and q.shape["update_peak"] <= q.device

    return [(n, largest(lambda t, n=n: bool(plan_at(n, t).fits), 1, high),
             largest(lambda t, n=n: update_fits(plan_at(n, t)), 1, high)) for n in sizes]


def render_longest(cfg: Any, answers: list[tuple[int, int | None, int | None]]) -> str:
    def text(tokens: int | None) -> str:
        return "not one token" if tokens is None else f"{tokens:,}"

    lines = [f"the longest response that fits, in tokens (rollout.max_new_tokens; model={cfg.model.name} hw={cfg.hw.name} "
             f"x {cfg.hw.nproc * cfg.hw.nnodes} ranks, everything else as configured):",
             f"  {'':<14}{'whole step':>14}{'update alone':>16}"]
    lines += [f"  hw.sp_size={n:<3}{text(whole):>14}{text(update):>16}" for n, whole, update in answers]
    lines.append("  (whole step: generation too, whose KV cache sequence parallelism does not split; update alone: model "
                 "states + activations + logits)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(HELP)
        return 0
    longest = "--max-response" in argv
    argv = [a for a in argv if a != "--max-response"]
    from hydra import compose, initialize_config_dir

    from rlcli.config import CONF_DIR, register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=argv)
    validate(cfg)  # a ConfigError: rlcli's one-line error, exit status 2 (rlcli.commands.cli.main)
    if longest:
        if estimate(cfg).device is None:
            from rlcli.core.schema import ConfigError

            raise ConfigError("rlcli plan --max-response needs the device's memory: set hw.device_memory_gb")
        print(render_longest(cfg, longest_responses(cfg)))
        return 0
    plan = estimate(cfg)
    print(render(cfg, plan))
    return 0 if plan.fits is not False else 1
