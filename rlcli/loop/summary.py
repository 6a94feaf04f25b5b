"""The start-up summary `rlcli train` prints: units, derived batch sizes, and what will be loaded."""

from __future__ import annotations

from typing import Any


def startup_summary(t: Any) -> str:
    """The start-up summary of a Trainer `t`: what was loaded, the algorithm, and every batch unit."""
    from rlcli.algos.config import off_policy
    from rlcli.core.topology import asynchronous, rollout_ranks, staleness, world_size

    cfg, a, r, hw, u, learner, s = t.cfg, t.cfg.algo, t.cfg.rollout, t.cfg.hw, t.units, t.learner, t.state
    # ZeRO-3 leaves empty placeholders in the module; ds_numel is the full count of a partitioned one.
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in learner.actor.module.parameters())
    n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in learner.actor.module.parameters() if p.requires_grad)
    p, g = u.P, u.G
    d = cfg.data
    digits = f"{d.min_digits}" + (f"-{d.max_digits}" if d.max_digits != d.min_digits else "")
    lines = [
        "rlcli train",
        f"  run dir        {cfg.run_dir}",
        f"  model          {cfg.model.name}: {t.model_path} ({t.model_source})",
        f"  parameters     {n_params / 1e6:.2f}M, dtype {cfg.model.dtype}"
        + (f"; LoRA r={cfg.model.lora.r}: {n_trainable / 1e6:.2f}M trainable" if cfg.model.lora.r else ""),
        f"  precision      {precision_note(hw, r.engine)}",
        f"  hardware       {hw.name}: device {hw.device}, world size {world_size(hw)}"
        + (f" ({u.world} training, {rollout_ranks(cfg)} rollout rank(s))" if rollout_ranks(cfg) else "")
        + f", ZeRO-{hw.zero_stage}"
        + (f"; sequence parallel: groups of {hw.sp_size} ranks (Ulysses attention), data-parallel size "
           f"{u.world // hw.sp_size}" if hw.sp_size > 1 else ""),
        "  rollout        " + (f"{r.engine}, synchronous in each training process" if not asynchronous(cfg)
                               else f"asynchronous: {rollout_ranks(cfg)} rollout rank(s) with their own {r.engine} "
                               f"engine, max_staleness {staleness(cfg)}, off_policy {off_policy(cfg)}")
        + (("; ZeRO-3: the whole model gathered once per generate call" if r.zero3_generation != "per_layer" else
            "; ZeRO-3: each layer gathered at every decoding step") + f" (rollout.zero3_generation={r.zero3_generation})"
           if learner.lockstep and r.engine == "hf" else ""),
        "  environment    " + environment(cfg),
        f"  algorithm      {a.name}: advantage={a.adv_estimator} loss={a.policy_loss} "
        f"clip=({a.clip_low}, {a.clip_high}) agg={a.loss_agg} kl_coef={a.kl_coef}"
        f"{' (in reward)' if a.kl_in_reward else ''} reference model="
        + ("no" if learner.ref is None else "the base model, adapters disabled" if cfg.model.lora.r else "yes"),
        f"  shaping        overlong_filter={a.overlong_filter} soft_overlong={a.soft_overlong} "
        f"(buffer {r.overlong_buffer_len} of {r.max_new_tokens} tokens) "
        f"dynamic_sampling={a.dynamic_sampling}",
        f"  reward         {dict(cfg.reward.weights)}{reward_model_note(cfg, t.rewards.scorers.get('rm'))}"
        f"{judge_note(cfg, 'judge' in t.rewards.scorers)}",
        "  distillation   " + ("none" if learner.teacher is None else
                               f"teacher {cfg.distill.teacher}"
                               + (f" (the policy reading {cfg.distill.privileged!r})" if cfg.distill.teacher == "self"
                                  else "") + f", coef {cfg.distill.coef} per sampled token (discount "
                               f"{cfg.distill.discount}), full-vocabulary KL coef {cfg.distill.full_kl_coef}"),
        "  critic         "
        + (f"{cfg.critic.head} head from {cfg.critic.path or 'the policy'}, lr {cfg.critic.lr}, "
           f"value pretraining {u.pretrain_steps} steps" if learner.critic is not None else "none"),
        "  batch units per step",
        f"    prompts P            {p} ({u.p_local} per rank)"
        + ("" if a.group_sampling else f" (no group sampling: {r.prompts_per_step} x {r.n} prompts, 1 response each)"),
        f"    responses/prompt G   {g}",
        f"    trajectories N=P*G   {u.N}",
        f"    mini-batches         {a.mini_batches} x {a.ppo_epochs} epoch(s) = "
        f"{a.mini_batches * a.ppo_epochs} optimizer steps/step, {u.mini_batch_trajectories} trajectories each",
        f"    micro-batch          {hw.micro_batch} trajectories"
        + (f", <= {hw.max_tokens_per_micro_batch} tokens" if hw.max_tokens_per_micro_batch else ""),
        f"    old-logprob pass     {old_logprob_pass(cfg, u.on_policy)}",
        f"    log-prob pass        {learner.chunk_note}",
        f"    prompts              {learner.share_note}",
        *([f"    long sequences       {long_sequence_note(cfg)}"] if hw.tiled_mlp or hw.offload_checkpoints else []),
        f"  schedule       {cfg.steps} steps = {u.optimizer_steps} optimizer steps, lr {cfg.optim.lr} "
        f"({cfg.optim.scheduler}, warmup {cfg.optim.warmup_steps})",
        f"  lengths        max_new_tokens {r.max_new_tokens}, temperature {r.temperature}, "
        f"top_p {r.top_p}, top_k {r.top_k}",
        f"  data           {cfg.data.name if d.source != 'file' or cfg.data.name != 'arith' else 'a data file'}"
        + (f" ({digits}-digit operands)" if d.source == "arith" else "")
        + f": {len(s.prompts.examples)} train prompts; evaluation on {t.eval_which}; {t.train_report.summary()}",
        "  checkpoints    "
        + ("none: save=false writes no weights (no checkpoint, no policy/)" if not cfg.save else
           (f"every {cfg.checkpoint.every} steps" if cfg.checkpoint.every else "only on SIGTERM/SIGINT")
           + f" to {cfg.run_dir}/checkpoints, newest {cfg.checkpoint.keep_last} kept"
           + (f"; Hugging Face snapshots every {cfg.checkpoint.hf_every} steps to {cfg.run_dir}/hf"
              if cfg.checkpoint.hf_every else ""))
        + (f"; resuming from {t.resumed_from} (step {s.step})" if t.resumed_from else ""),
    ]
    lines += small_held_out(len(t.eval_examples))  # held-out accuracy is always reported at the end
    return "\n".join(lines)


SMALL_HELD_OUT = 20
"""Held-out prompts below which the start-up summary warns: at 50 % accuracy one prompt is 5 points of 20."""


def small_held_out(n: int) -> list[str]:
    """The start-up summary's warning line when held-out accuracy would rest on fewer than SMALL_HELD_OUT prompts."""
    if n >= SMALL_HELD_OUT:
        return []
    return [f"  warning        held-out accuracy will rest on {n} prompt{'s' * (n != 1)} (one prompt moves it "
            f"{100 / max(n, 1):.0f} points): give a held-out file (data.eval_path) or a larger data.eval_fraction / "
            "data.eval_size"]


def precision_note(hw: Any, engine: str) -> str:
    """Which precision each part of a run computes in, and whether this device has bf16 natively."""
    from rlcli.core.precision import mixed_precision, native_bf16

    native = native_bf16(hw.device)
    if hw.precision == "fp32":
        return "fp32 everywhere" + (f" (this {hw.device} has {native}: hw.precision=bf16 would use it)" if native else "")
    weights = ("bf16 matmuls by autocast over fp32 weights and AdamW states (ZeRO-0)" if mixed_precision(hw) else
               "bf16 weights and activations, fp32 master weights and AdamW states (DeepSpeed ZeRO partitions)")
    return (f"bf16: {weights}; fp32 log-softmax, losses and advantages; {engine} sampler in bf16; "
            + (f"native on this {hw.device} ({native})" if native else f"emulated on this {hw.device}: slower than fp32"))


def reward_model_note(cfg: Any, scorer: Any) -> str:
    """reward=rm: which reward model scores, how its score is normalised, and where (`scorer`: its ModelScorer in
    this process, None where the rollout ranks hold it)."""
    rm = cfg.reward.rm
    if "rm" not in cfg.reward.weights:
        return ""
    from rlcli.engine import is_partitioned

    where = ", on the rollout ranks" if scorer is None else (
        ", partitioned over the ranks (ZeRO-3)" if is_partitioned(scorer.model) else "")
    return (f"; rm = reward model {rm.path}, normalize={rm.normalize}" + (f", clip={rm.clip}" if rm.clip else "")
            + where)


def judge_note(cfg: Any, here: bool) -> str:
    """reward=judge: which judge, its verdict and failure policy, and where (`here`: in this process)."""
    j = cfg.reward.judge
    if "judge" not in cfg.reward.weights:
        return ""
    who = f"{j.url} (model {j.model})" if j.url is not None else f"{j.path} (in the job)"
    return (f"; judge = {who}, verdict={j.verdict}, on_error={j.on_error}"
            + ("" if here else ", on the rollout ranks"))


def old_logprob_pass(cfg: Any, on_policy: bool) -> str:
    """Whether the update computes the old policy's log-probs, and what stands in for them when it does not; with
    asynchronous rollout the rows lag even when the update is on-policy, and the summary must say so."""
    from rlcli.algos.config import off_policy
    from rlcli.core.topology import staleness

    mode, lag = off_policy(cfg), staleness(cfg)
    if mode == "bypass":
        return "skipped: the sampler's log-probs are the old policy (algo.off_policy=bypass)"
    if not on_policy:
        return "yes (several optimizer steps per batch, or KL in the reward)"
    if not lag:
        return "skipped (on-policy: one mini-batch, one epoch)"
    behind = f"rows lag up to {lag} policy version(s)"
    if mode == "decoupled":
        return f"skipped: the current policy is the proximal one (decoupled PPO); {behind}, weighted by pi_prox/mu"
    return f"skipped: ratios to the current policy; {behind}, corrected by algo.rollout_correction={cfg.algo.rollout_correction}"


def no_signal_warning(metrics: dict[str, float], steps: int) -> str:
    """The line printed when `steps` training steps in a row had all-zero advantages (rlcli.loop.state.no_signal),
    with the likely cause read off the last step's accuracy and what to try."""
    acc = metrics.get("acc/mean", 0.5)
    why = ("no reply was right: the task may be out of this model's reach, or the reward may not read its answers "
           "(reward.answer_format, data.template; logger.rollouts=true writes the replies to read)" if acc == 0.0 else
           "every reply was right: the task is too easy for this model" if acc == 1.0 else
           "the replies of each prompt scored alike")
    return (f"warning: {steps} steps in a row with every advantage 0 (adv/std=0): nothing to learn, {why}. Try a "
            "larger rollout.n, another task or model, or algo.dynamic_sampling=true to skip such groups")


TRAINING_ONLY = ("hydra", "steps", "seed", "algo", "optim", "checkpoint", "logger", "save", "resume", "critic",
                 "distill", "sweep", "rm")
"""Top-level config keys only training reads: `rlcli eval` of a run's policy leaves these overrides of the run out."""


def eval_command(run_dir: str, policy: str) -> str:
    """`rlcli eval` of a run's saved policy on the run's own task: the run's command-line overrides (Hydra keeps them
    in run_dir/.hydra/overrides.yaml; a Trainer built in code has none), less those only training reads and its
    model.path, then model.path=<policy>."""
    import os
    import shlex

    from omegaconf import OmegaConf

    overrides_file = os.path.join(run_dir, ".hydra", "overrides.yaml")
    kept = []
    if os.path.isfile(overrides_file):
        for o in OmegaConf.to_container(OmegaConf.load(overrides_file)):
            key = o.lstrip("+~").split("=", 1)[0]
            if key.split(".", 1)[0] not in TRAINING_ONLY and key != "model.path":
                kept.append(shlex.quote(o))
    return " ".join(["rlcli eval", *kept, f"model.path={shlex.quote(policy)}"])

def environment(cfg: Any) -> str:
    """The start-up summary's environment line: single-turn, an environment's tools, or an agent's episodes."""
    e, r = cfg.env, cfg.rollout
    budget = f"template {e.template or 'of the tokenizer'}, up to {e.max_turns} turns in {r.max_new_tokens} response tokens"
    if e.verifiers.id is not None:
        return (f"verifiers taskset {e.verifiers.id} (harness {e.verifiers.harness or 'its own, else the in-process chat'}) "
                f"through the OpenAI-compatible gateway on 127.0.0.1 ({e.episode_workers} worker(s) x "
                f"{e.episodes_per_worker} episodes at once, {e.episode_timeout_s:g} s each), {budget}")
    if r.agent is not None:
        return (f"agent {r.agent} through the OpenAI-compatible gateway on 127.0.0.1 ({e.episode_workers} worker(s) x "
                f"{e.episodes_per_worker} episodes at once, {e.episode_timeout_s:g} s each), {budget}")
    if e.name is None:
        return "none (single-turn)"
    if e.openenv.url or e.openenv.app:
        where = f"the server at {e.openenv.url}" if e.openenv.url else f"{e.openenv.app} served on 127.0.0.1 for the run"
        return f"OpenEnv: {where}, {budget}"
    return f"{e.name}: {list(e.tools)} ({e.tool_format} calls), {budget}"


def long_sequence_note(cfg: Any) -> str:
    """ALST's savings in use (rlcli.engine.alst), for the policy and the critic."""
    hw = cfg.hw
    parts = ([f"MLP in tiles of {hw.tiled_mlp_positions or 'hidden-size'} positions in the update (hw.tiled_mlp)"]
             if hw.tiled_mlp else [])
    parts += ["gradient checkpoints in host memory (hw.offload_checkpoints)"] if hw.offload_checkpoints else []
    return "; ".join(parts)
