"""The learner: the actor, critic and reference engines, and everything a micro-batch touches.

The loop (rlcli/loop/trainer.py) asks the learner to score a batch (stage 4) and to update on it (stage 6); how
the batch is split into micro-batches, padded for ZeRO-3 lockstep, normalised over the whole mini-batch
and reduced over ranks is the learner's (verl's `compute_log_prob` / `update_actor` roles):

    learner = Learner(cfg, model_path)
    batch = batch.replace(**learner.score(batch, step, phase))   # old_logp, ref_logp, values
    metrics = learner.update(batch, phase)                         # ppo_epochs x mini_batches steps

A `Phase` says which roles learn: RL trains the actor (and the critic, if any); VAPO's value pretraining
trains the critic alone on Monte-Carlo returns. Scoring runs every model in eval mode (no dropout: the
log-probs of a batch are a function of the weights); only the update runs in train mode.
DeepSpeed and torch.distributed are called from rlcli/engine/ and from here only.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor

from rlcli import engine as eng
from rlcli.algos.config import SELF, privileged_parts
from rlcli.algos.entropy import build_entropy_controller
from rlcli.algos.functional import (
    aggregate,
    aggregation_counts,
    behaviour_weights,
    cov_controlled_loss,
    kl_estimate,
    masked_mean,
    positive_example_nll,
    rollout_correction_weights,
    top_entropy_mask,
)
from rlcli.algos.losses import POLICY_LOSSES
from rlcli.core.batch import RolloutBatch
from rlcli.core.layout import forward_shape
from rlcli.core.names import NEEDS_VALUES
from rlcli.core.precision import trained_model
from rlcli.core.units import BatchUnits
from rlcli.engine.alst import offload_checkpoints, tile_mlps
from rlcli.engine.collectives import agree_max, all_reduce, global_stats
from rlcli.engine.sequence import sequence_parallel
from rlcli.models import (
    DTYPES,
    autocast,
    eval_mode,
    load_policy,
    logits_chunk_for,
    resolve_model_path,
    response_log_softmax,
    response_logprobs,
    response_outputs,
)
from rlcli.models.policy import prompt_runs, prompt_sharing_for
from rlcli.models.value import (
    augmented_values,
    critic_loss,
    load_critic,
    response_head_outputs,
    response_values,
)


@dataclass(frozen=True)
class Phase:
    """What one training step learns. `algo` is the algorithm config its advantage stage uses."""

    name: str
    """rl | value_pretrain: metric prefix ("" for rl) and log name."""
    trains_actor: bool
    """The actor is scored, updated and pushed to the rollout engine (False: VAPO value pretraining)."""
    algo: Any

    @property
    def prefix(self) -> str:
        return "" if self.trains_actor else "pretrain/"


def rl_phase(cfg: Any) -> Phase:
    return Phase("rl", True, cfg.algo)


def value_pretrain_phase(cfg: Any) -> Phase:
    """VAPO value pretraining (arXiv:2504.05118 §4.1): the critic alone, on Monte-Carlo returns (λ_critic = 1)."""
    return Phase("value_pretrain", False, OmegaConf.merge(cfg.algo, {"lam_critic": 1.0}))


def split_to(parts: list[list[int]], k: int) -> list[list[int]]:
    """`parts` made `k` parts (k >= len(parts)) by halving the largest part while one has two rows or
    more, then adding empty parts: ranks of a lockstep run agree on the number of forward passes."""
    parts = [list(p) for p in parts]
    while len(parts) < k:
        big = max(range(len(parts)), key=lambda i: len(parts[i]), default=None)
        if big is None or len(parts[big]) < 2:
            parts += [[] for _ in range(k - len(parts))]
            break
        p = parts.pop(big)
        parts[big:big] = [p[: len(p) // 2], p[len(p) // 2 :]]
    return parts


class Learner:
    def __init__(self, cfg: Any, model_path: str, units: BatchUnits):
        from rlcli.algos.config import off_policy

        self.cfg, self.units = cfg, units
        self.off_policy = off_policy(cfg)  # recompute | bypass | decoupled (algo.off_policy, auto resolved)
        a = cfg.algo
        self.lockstep = eng.lockstep(cfg.hw)  # ZeRO-3 over ranks: every forward is a collective
        self.sp = sequence_parallel(cfg.hw)  # hw.sp_size > 1: each sequence sliced over a group of ranks
        with eng.sharded_construction(cfg.hw, cfg.optim):  # ZeRO-3: each rank loads only its partition
            model, self.tokenizer = load_policy(trained_model(cfg), model_path)
        self.device = eng.device(cfg.hw)
        if not eng.is_partitioned(model):
            model.to(self.device)
        self.model_path = model_path
        # The KL reference: a frozen copy of the initial policy, never built when beta = 0; with LoRA the
        # policy module itself, scored with its adapters disabled (reference_logprobs).
        self.ref = None
        if a.kl_coef > 0:
            self.ref = model if cfg.model.lora.r else self.frozen_copy(
                model, lambda: load_policy(trained_model(cfg), model_path)[0])
        # the distillation teacher: a frozen model, or (distill.teacher=self) the actor itself reading another prompt
        self.teacher = (None if not cfg.distill.teacher else SELF if cfg.distill.teacher == SELF else
                        self.load_teacher())
        # α of the entropy bonus (algo.entropy_control=adaptive moves it after each step); LoopState carries this object
        self.entropy_ctl = build_entropy_controller(a)
        self.cov_gen = torch.Generator().manual_seed(cfg.seed)  # Clip-Cov's draws; reseeded by every update
        self.actor = eng.Engine(model, cfg.hw, cfg.optim, units.optimizer_steps)
        # The critic exists only for estimators that need values; VAPO pretrains it first.
        self.critic: eng.Engine | None = None
        self.v_pretrained: torch.nn.Module | None = None  # frozen pretrained critic (V_aug option)
        if a.adv_estimator in NEEDS_VALUES:
            with eng.sharded_construction(cfg.hw, cfg.optim):
                critic = self.build_critic()
            if not eng.is_partitioned(critic):
                critic.to(self.device)
            if cfg.model.gradient_checkpointing:  # the critic is as large as the policy: the same trade
                critic.gradient_checkpointing_enable()
            self.critic = eng.Engine(critic, cfg.hw, cfg.optim, units.optimizer_steps + units.pretrain_optimizer_steps,
                                     lr=cfg.critic.lr, warmup_steps=cfg.critic.warmup_steps)
        if self.sp is not None:  # every model that scores sliced sequences: one the Ulysses adapter covers
            for role, m in (("policy", model), ("reference", self.ref),
                            ("critic", None if self.critic is None else self.critic.module),
                            ("teacher", None if self.teacher == SELF else self.teacher)):
                if m is not None:
                    self.sp.check(m, role)
        for role, m in (("policy", model), ("critic", None if self.critic is None else self.critic.module)):
            if m is not None:  # ALST's other savings for long sequences (hw.tiled_mlp, hw.offload_checkpoints)
                if cfg.hw.tiled_mlp:
                    tile_mlps(m, role, cfg.hw.tiled_mlp_positions, agree_max if self.lockstep else None)
                if cfg.hw.offload_checkpoints:
                    offload_checkpoints(m, role)
        # hw.logits_chunk only where the chunked pass reproduces the model's own logits (checked once here).
        with autocast(cfg.hw):
            self.chunk, self.chunk_note = logits_chunk_for(self.actor.module, cfg.hw.logits_chunk)
            # hw.share_prompts only where a shared forward reproduces the rows' own (checked once here).
            self.share, self.share_note = (
                prompt_sharing_for(self.actor.module, cfg.hw.share_prompts) if self.sp is None else
                (False, f"off: hw.sp_size={self.sp.size} slices each sequence (Ulysses attention takes no mask)"))

    def load_teacher(self) -> torch.nn.Module:
        """The distillation teacher (distill.teacher): frozen, eval mode, in the student's dtype and precision, sharded
        like the reference under ZeRO-3. No adapters, no checkpointing: it only scores."""
        from rlcli.engine.collectives import rank_zero_first
        from rlcli.models.config import teacher_model

        model_cfg = teacher_model(self.cfg)
        path, _ = rank_zero_first(lambda: resolve_model_path(model_cfg, self.cfg.data))
        teacher = eng.frozen_model(lambda: load_policy(model_cfg, path)[0], self.cfg.hw, self.cfg.optim)
        if not eng.is_partitioned(teacher):
            teacher.to(self.device)
        return teacher

    def build_critic(self) -> torch.nn.Module:
        return load_critic(self.cfg.critic, self.model_path, DTYPES[trained_model(self.cfg).dtype])

    def frozen_copy(self, model: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """An inference-only copy of `model`'s weights now; `build()` makes a module of its architecture
        (needed under ZeRO-3, where the copy is made partition by partition: rlcli.engine.frozen_copy)."""
        return eng.frozen_copy(model, self.cfg.hw, self.cfg.optim, build)

    def freeze_pretrained_critic(self) -> None:
        """Keep the critic as it is now (after value pretraining) for V_aug (critic.aug_w0)."""
        self.v_pretrained = self.frozen_copy(self.critic.module, self.build_critic)

    # ------------------------------------------------------------------ stage 4: score
    def per_token(self, fn: Callable[..., Tensor], b: RolloutBatch) -> Tensor:
        """fn(prompt_ids, prompt_mask, response_ids, token_mask) -> [n, T'] over the (trimmed) micro-batches of
        `b`, without grad; zero where response_mask is (padding, and the observations of multi-turn rows). -> [N, T]
        Under sequence parallelism the group scores its ranks' rows together, each rank its slice of every row."""
        if self.sp is not None:
            whole, own = self.sp.union(b)
            with self.sp.sharding():
                return self.per_token_of(fn, whole)[own]
        return self.per_token_of(fn, b)

    def per_token_of(self, fn: Callable[..., Tensor], b: RolloutBatch) -> Tensor:
        out = torch.zeros(b.response_mask.shape)  # [N, T]
        with torch.no_grad(), autocast(self.cfg.hw):
            for idx in self.micro_batches(b):
                if not len(idx):  # lockstep padding: a rank with fewer rows still joins the gathers
                    one = torch.full((1, 1), self.tokenizer.pad_token_id)
                    fn(one, torch.ones_like(one), one, torch.ones(1, 1))
                    continue
                mb = b.select(idx).trimmed()
                v = fn(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.token_mask).cpu()  # [n, T']
                out[idx, : v.shape[1]] = v
        return out * b.response_mask

    def logprobs(self, b: RolloutBatch, model: torch.nn.Module | None = None) -> Tensor:
        """Log-probs of `b`'s responses under `model` (default: the actor), temperature-scaled, in eval
        mode. -> [N, T]"""
        model = self.actor.module if model is None else model
        t = self.cfg.rollout.temperature
        with eval_mode(model):
            return self.per_token(
                lambda *x: response_logprobs(model, *x, t, chunk=self.chunk, share=self.share, sp=self.sp)[0], b)

    def reference_logprobs(self, b: RolloutBatch) -> Tensor:
        """Log-probs of `b`'s responses under the reference policy (the initial one). -> [N, T]"""
        if self.cfg.model.lora.r:  # the base weights never train: the base model is the initial policy
            with self.actor.module.disable_adapter():
                return self.logprobs(b)
        return self.logprobs(b, self.ref)

    def values(self, critic: torch.nn.Module, b: RolloutBatch) -> Tensor:
        """Critic values at `b`'s response positions, in eval mode. -> [N, T]"""
        with eval_mode(critic):
            return self.per_token(lambda *x: response_values(critic, *x, share=self.share, sp=self.sp), b)

    def score(self, batch: RolloutBatch, step: int, phase: Phase) -> dict[str, Tensor]:
        """-> {old_logp, ref_logp, values, adv_values} [N, T] each, those this phase uses. old_logp is the
        trainer's log-prob of the sampling policy: computed for fresh rows unless the update is on-policy
        (then it is logp.detach() in the loss); carried rows bring the one recorded when they were sampled.
        When the actor does not learn (value pretraining), log-probs serve only a KL penalty in the reward."""
        out: dict[str, Tensor] = {}
        kl_in_reward = self.ref is not None and phase.algo.kl_in_reward
        fresh = (~batch.stale).nonzero().squeeze(-1)  # [n_fresh]
        if phase.trains_actor and self.off_policy == "bypass":  # the sampler's log-probs are the old policy
            out["old_logp"] = batch.rollout_logp
        elif not self.units.on_policy if phase.trains_actor else kl_in_reward:  # lockstep: dummy passes if no fresh rows
            old = batch.old_logp.clone() if batch.old_logp is not None else torch.zeros_like(batch.response_mask)
            old[fresh] = self.logprobs(batch.select(fresh))
            out["old_logp"] = old
        if self.ref is not None and (phase.trains_actor or kl_in_reward):
            out["ref_logp"] = self.reference_logprobs(batch)
        if self.teacher is not None and phase.trains_actor:  # on-policy distillation: both policies' log-probs
            out["teacher_logp"] = (self.logprobs(privileged_batch(batch, self.tokenizer, self.cfg.distill.privileged))
                                   if self.teacher == SELF else self.logprobs(batch, self.teacher))
            if "old_logp" not in out:  # on-policy updates skip this pass otherwise
                out["old_logp"] = self.logprobs(batch)
        if self.critic is not None:
            out["values"] = out["adv_values"] = self.values(self.critic.module, batch)
            if self.v_pretrained is not None:  # option: V_aug = w(t) V_pre + (1 - w(t)) V
                c = self.cfg.critic
                v_pre = self.values(self.v_pretrained, batch)
                out["adv_values"] = augmented_values(out["values"], v_pre, step, self.cfg.steps, c.aug_w0,
                                                     c.aug_kappa) * batch.response_mask
        return out

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """Advantage (and critic) statistics over the step's valid loss tokens on all ranks, before the update."""
        valid = batch.loss_mask.bool()
        stats = global_stats({"adv": batch.advantages[valid]})["adv"]
        out = {"adv/mean": stats["mean"], "adv/std": stats["std"]}
        if self.critic is not None:  # over the whole step (verl's definition)
            out["critic/explained_var"] = self.explained_variance(batch)
            out["critic/returns_mean"] = global_stats({"ret": batch.returns[valid]})["ret"]["mean"]
        return out

    @staticmethod
    def explained_variance(batch: RolloutBatch) -> float:
        """1 - Var(ret - V)/(Var(ret) + 1e-8) over valid loss tokens on all ranks; 0 if returns are constant."""
        valid = batch.loss_mask.bool()
        s = global_stats({"ret": batch.returns[valid], "err": (batch.returns - batch.values)[valid]})
        var_ret = s["ret"]["std"] ** 2
        return 1.0 - s["err"]["std"] ** 2 / (var_ret + 1e-8) if var_ret > 1e-8 else 0.0

    # ------------------------------------------------------------------ stage 6: update
    def update(self, batch: RolloutBatch, phase: Phase) -> dict[str, float]:
        """ppo_epochs x mini_batches optimizer steps of the actor (if the phase trains it) and of the critic
        when there is one, over the same mini-batches. -> metrics, means over the optimizer steps (the
        `_max` ones: maxima)."""
        a = self.cfg.algo
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.actor.ds.global_steps)
        # Clip-Cov's draws: their own stream, a function of (seed, optimizer step, rank), so a resume repeats them
        self.cov_gen = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + self.actor.ds.global_steps) * 4099
                                                     + (eng.rank() if self.sp is None else self.sp.dp_rank) + 1)
        alpha = self.entropy_ctl.value  # this step's α (adaptive: set by the entropy of the steps before)
        groups = batch.groups
        engines = {"actor": self.actor if phase.trains_actor else None, "critic": self.critic}
        sums: dict[str, float] = defaultdict(float)
        n_updates, n_micro, slots, real = 0, 0, 0, 0.0  # micro-batches, their token slots, real tokens among them
        for engine in engines.values():
            if engine is not None:
                engine.train()
        with self.sharded():  # Ulysses attention through every forward and backward (sequence parallelism)
            for _ in range(a.ppo_epochs):
                order = groups[torch.randperm(len(groups), generator=gen)] if a.mini_batches > 1 else groups
                # Exactly mini_batches parts on every rank; ranks hold equal group counts, so an empty part
                # (fewer groups than mini-batches, algo.train_on_partial) is empty on all ranks alike.
                for mb_groups in order.tensor_split(a.mini_batches):
                    if not len(mb_groups):
                        continue
                    mb = batch.select_groups(mb_groups)
                    if self.sp is not None:  # the group's ranks pool their rows: each rank a slice of every row
                        mb = self.sp.union(mb)[0]
                    norms = self.normalizers(mb)
                    micro = self.micro_batches(mb)
                    n_micro += len(micro)
                    mb_sums: dict[str, float] = defaultdict(float)
                    for i, idx in enumerate(micro):
                        mbi, last = mb.select(idx).trimmed(), i == len(micro) - 1
                        runs = prompt_runs(mbi.prompt_ids, mbi.prompt_mask)
                        k, length = forward_shape(runs, mbi.prompt_ids.shape[1], mbi.response_ids.shape[1], self.share)
                        slots += k * length
                        prompts = mbi.prompt_mask if k == len(mbi) else mbi.prompt_mask[torch.tensor(runs).cumsum(0) - 1]
                        real += float(prompts.sum() + mbi.token_mask.sum())  # each shared prompt once
                        m: dict[str, float] = {}
                        if engines["actor"] is not None:
                            loss, m = self.micro_loss(mbi, norms, alpha)
                            self.actor.backward(loss, last=last)
                        if self.critic is not None:
                            vf_loss, cm = self.micro_value_loss(mbi, norms)
                            self.critic.backward(vf_loss, last=last)
                            m.update(cm)
                        for k, v in m.items():
                            mb_sums[k] = max(mb_sums.get(k, -math.inf), v) if k.endswith("_max") else mb_sums[k] + v
                    # Micro-batch metrics are shares of mini-batch means: they add up over ranks too.
                    for op in ("sum", "max"):
                        keys = sorted(k for k in mb_sums if k.endswith("_max") == (op == "max"))
                        totals = all_reduce(torch.tensor([mb_sums[k] for k in keys], dtype=torch.float64), op)
                        totals = totals / self.replicas if op == "sum" else totals
                        for k, v in zip(keys, totals.tolist()):
                            sums[k] = max(sums.get(k, -math.inf), v) if op == "max" else sums[k] + v
                    for name, engine in engines.items():
                        if engine is not None:
                            res = engine.step()
                            sums[f"{name}/grad_norm"] += res.grad_norm if math.isfinite(res.grad_norm) else 0.0
                            sums[f"{name}/skipped_steps"] += 0.0 if res.applied else 1.0
                    n_updates += 1
        metrics = {k: v if k.endswith(("_max", "skipped_steps")) else v / max(n_updates, 1) for k, v in sums.items()}
        slots_all, real_all, micro_all = all_reduce(torch.tensor([float(slots), real, n_micro], dtype=torch.float64)).tolist()
        slots_all, real_all = slots_all / self.replicas, real_all / self.replicas  # a group's ranks share their rows
        metrics["perf/padding_frac"] = 1.0 - real_all / max(slots_all, 1.0)
        metrics["perf/micro_batches"] = micro_all / self.units.world / max(n_updates, 1)
        metrics.update({f"{name}/lr": engine.lr() for name, engine in engines.items() if engine is not None})
        if phase.trains_actor and self.entropy_ctl.adaptive:  # Skywork-OR1: α follows the measured entropy
            metrics["actor/entropy_coef"] = alpha
            self.entropy_ctl.update(metrics["actor/entropy"])
        return metrics

    @property
    def replicas(self) -> int:
        """How many ranks hold each row of an update: the sequence-parallel group's size (they pool their rows)."""
        return 1 if self.sp is None else self.sp.size

    def sharded(self) -> Any:
        """The sequence-parallel group's `sharding()` (Ulysses attention), or nothing to do."""
        return nullcontext() if self.sp is None else self.sp.sharding()

    def normalizers(self, mb: RolloutBatch) -> dict[str, float]:
        """Loss normalizers over the whole optimizer mini-batch: all micro-batches and all ranks (a row pooled by a
        sequence-parallel group counted once)."""
        num_tokens, num_seqs = aggregation_counts(mb.loss_mask)
        correct_tokens = (mb.loss_mask * (mb.acc > 0.5)[:, None]).sum()
        tot = all_reduce(torch.stack([num_tokens, num_seqs, correct_tokens.to(num_tokens.dtype)])) / self.replicas
        return {
            "num_tokens": max(tot[0].item(), 1.0),
            "num_seqs": max(tot[1].item(), 1.0),
            "num_correct_tokens": max(tot[2].item(), 1.0),
        }

    def micro_loss(self, mb: RolloutBatch, norms: dict[str, float], alpha: float | None = None
                   ) -> tuple[Tensor, dict[str, float]]:
        """The loss of one micro-batch, already divided by the mini-batch normalizers, so summing
        micro-batch gradients over micro-batches and ranks gives the mini-batch gradient. `alpha`: the entropy
        bonus coefficient (default: the controller's)."""
        alpha = self.entropy_ctl.value if alpha is None else alpha
        a, d, t = self.cfg.algo, self.cfg.distill, self.cfg.rollout.temperature
        mask = mb.loss_mask.to(self.device)  # [n, T]
        inputs = (mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.token_mask)
        full_kl = self.teacher is not None and d.full_kl_coef > 0
        with autocast(self.cfg.hw):
            teacher = response_log_softmax(self.teacher, *inputs, t, self.share) if full_kl else None  # [n, T, V]
            logp, entropy, kl_full = response_outputs(
                self.actor.module, *inputs, t, with_entropy=True, entropy_grad=alpha != 0, chunk=self.chunk,
                kl_to=teacher, share=self.share, sp=self.sp,
            )  # [n, T] each, fp32
        old = logp.detach()  # on-policy: the ratio is exactly 1 and its gradient is ∇log π
        if self.off_policy == "bypass":
            old = mb.old_logp.to(self.device)  # the sampler's (score)
        elif not self.units.on_policy or mb.stale.any():  # carried rows always bring their sampling-time log-probs
            recorded = mb.old_logp.to(self.device)
            old = recorded if not self.units.on_policy else torch.where(mb.stale[:, None].to(self.device), recorded, old)
        loss_mat, pm = POLICY_LOSSES[a.policy_loss](logp, old, mb.advantages.to(self.device), mask, a)  # [n, T]
        if a.entropy_control in ("clip_cov", "kl_cov"):  # Cui et al. 2025: the micro-batch's tokens are the population
            loss_mat, cm = cov_controlled_loss(
                loss_mat, logp, old, mb.advantages.to(self.device), mask, mode=a.entropy_control,
                ratio=a.clip_cov_ratio if a.entropy_control == "clip_cov" else a.kl_cov_ratio, lb=a.clip_cov_lb,
                ub=a.clip_cov_ub, kl_coef=a.kl_cov_coef, generator=self.cov_gen,
            )
            pm = pm | cm
        share = mask.sum().item() / norms["num_tokens"]  # this micro-batch's share of mini-batch tokens
        if a.top_entropy_quantile < 1:  # the policy gradient of the highest-entropy ("forking") tokens only
            keep = top_entropy_mask(entropy, mask, a.top_entropy_quantile)  # [n, T]
            loss_mat = torch.where(keep, loss_mat, torch.zeros_like(loss_mat))
            pm = pm | {"entropy_kept_frac": masked_mean(keep.to(logp.dtype), mask)}
        metrics = {f"actor/{k}": float(v) * share for k, v in pm.items()}
        if mb.rollout_logp is not None:  # the sampler/trainer gap on the sampled tokens
            sampler_logp = mb.rollout_logp.to(self.device)
            trainer_logp = logp.detach() if self.off_policy == "bypass" else old  # bypass: `old` is the sampler's
            gap = (trainer_logp - sampler_logp).abs() * mask
            metrics["rollout_corr/logp_diff_mean"] = float(gap.sum()) / norms["num_tokens"]
            metrics["rollout_corr/logp_diff_max"] = float(gap.max()) if gap.numel() else 0.0
            metrics["rollout_corr/kl"] = float((kl_estimate(sampler_logp, trainer_logp, "k3") * mask).sum()) / norms["num_tokens"]
        if a.rollout_correction != "none":  # π_trainer / π_sampler on the sampling policy's tokens
            w, wm = rollout_correction_weights(
                old - mb.rollout_logp.to(self.device), mask, level=a.rollout_correction,
                upper=a.rollout_correction_upper, lower=a.rollout_correction_lower,
            )
            loss_mat = loss_mat * w
            metrics.update({"rollout_corr/weight_mean": float(wm["weight_mean"]) * share,
                            "rollout_corr/clipped_frac": float(wm["clipped_frac"]) * share,
                            "rollout_corr/weight_max": float(wm["weight_max"])})
        elif self.off_policy == "decoupled":  # AReaL's decoupled PPO: `old` is the proximal policy, tokens π_prox/μ
            w, wm = behaviour_weights(old - mb.rollout_logp.to(self.device), mask, a.behav_weight_cap)
            loss_mat = loss_mat * w
            metrics.update({f"actor/{k}": float(v) * share for k, v in wm.items()})
        agg = dict(num_tokens=norms["num_tokens"], num_seqs=norms["num_seqs"], max_len=self.cfg.rollout.max_new_tokens)
        loss = pg_loss = aggregate(loss_mat, mask, a.loss_agg, **agg)
        metrics["actor/pg_loss"] = pg_loss.item()
        metrics["actor/entropy"] = aggregate(entropy, mask, "token_mean", num_tokens=norms["num_tokens"]).item()
        if alpha:
            loss = loss - alpha * aggregate(entropy, mask, a.loss_agg, **agg)
        if self.ref is not None and not a.kl_in_reward:
            kl_loss = aggregate(kl_estimate(logp, mb.ref_logp.to(self.device), a.kl_estimator), mask, a.loss_agg, **agg)
            loss = loss + a.kl_coef * kl_loss  # in the loss β is fixed (algo.kl_target needs kl_in_reward)
            metrics["actor/kl_loss"] = kl_loss.item()
        if full_kl:  # on-policy distillation's exact term: KL(π_student ‖ π_teacher) over the vocabulary, per position
            kl_loss = aggregate(kl_full, mask, a.loss_agg, **agg)
            loss = loss + d.full_kl_coef * kl_loss
            metrics["distill/full_kl"] = aggregate(kl_full.detach(), mask, "token_mean",
                                                   num_tokens=norms["num_tokens"]).item()
        if a.nll_coef:  # VAPO positive-example LM loss: NLL over tokens of correct responses
            nll = positive_example_nll(logp, mask, (mb.acc > 0.5).to(self.device), norms["num_correct_tokens"])
            loss = loss + a.nll_coef * nll
            metrics["actor/nll_loss"] = nll.item()
        return loss, metrics

    def micro_value_loss(self, mb: RolloutBatch, norms: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
        """The clipped value loss of one micro-batch, normalised by the mini-batch's token count."""
        mask = mb.loss_mask.to(self.device)
        with autocast(self.cfg.hw):
            head = response_head_outputs(self.critic.module, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                         mb.token_mask, self.share, self.sp)  # [n, T, K] fp32
        loss, cm = critic_loss(head, mb.values.to(self.device), mb.returns.to(self.device), mask,
                               self.critic.module.spec, self.cfg.algo.value_clip, norms["num_tokens"])
        share = mask.sum().item() / norms["num_tokens"]
        out = {"critic/vf_loss": float(cm.pop("vf_loss"))}
        cm.pop("explained_var", None)  # not additive over micro-batches: logged per step instead
        out.update({f"critic/{k}": float(v) * share for k, v in cm.items()})
        return loss, out

    def micro_batches(self, b: RolloutBatch) -> list[Tensor]:
        """Row indices of `b` split into micro-batches of at most hw.micro_batch rows and, if set,
        hw.max_tokens_per_micro_batch token slots (the forward's positions after RolloutBatch.trimmed:
        rlcli.core.layout.forward_shape). Rows go longest first, so a micro-batch holds rows of similar length
        and little padding (perf/padding_frac); with shared prompts a group's rows go side by side (groups by their
        longest row), so that they share one forward of their prompt. Memory only: the math does not depend on it."""
        hw = self.cfg.hw
        tp, t = b.prompt_mask.sum(-1).long().tolist(), b.token_mask.sum(-1).long().tolist()
        group = b.group_index.tolist()
        order = sorted(range(len(b)), key=lambda i: -(tp[i] + t[i]))  # stable: ties keep their order
        if self.share:
            rank: dict[int, int] = {}
            for i in order:
                rank.setdefault(group[i], len(rank))
            order.sort(key=lambda i: rank[group[i]])
        parts: list[list[int]] = []
        width = (0, 0)  # longest prompt and response of the micro-batch being filled
        rows: dict[int, int] = {}  # its rows per group
        for i in order:
            wider = (max(width[0], tp[i]), max(width[1], t[i]))
            grown = {**rows, group[i]: rows.get(group[i], 0) + 1}
            k, length = forward_shape(list(grown.values()), *wider, self.share)
            full = parts and (len(parts[-1]) == hw.micro_batch or (
                hw.max_tokens_per_micro_batch and k * length > hw.max_tokens_per_micro_batch))
            if not parts or full:
                parts.append([])
                wider, grown = (tp[i], t[i]), {group[i]: 1}
            parts[-1].append(i)
            width, rows = wider, grown
        if self.lockstep:  # every rank runs as many forward passes as the rank that needs most
            parts = split_to(parts, agree_max(len(parts)))
        return [torch.tensor(p, dtype=torch.long) for p in parts]

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str) -> None:
        """The engines (weights, optimizer state, schedules) and the frozen pretrained critic into a
        checkpoint's staging `directory`. All ranks call it."""
        self.actor.save(directory, "actor")
        if self.critic is not None:
            self.critic.save(directory, "critic")
        if self.v_pretrained is not None:  # all ranks: under ZeRO-3 it is gathered from the partitions
            v_state = eng.full_state_dict(self.v_pretrained)
            if eng.rank() == 0:
                torch.save(v_state, os.path.join(directory, "v_pretrained.pt"))

    def load(self, directory: str) -> None:
        """Restore what `save` wrote; the actor is left in train mode, as the last update left it."""
        self.actor.load(directory, "actor")
        if self.critic is not None:
            self.critic.load(directory, "critic")
        if os.path.exists(v_file := os.path.join(directory, "v_pretrained.pt")):
            self.freeze_pretrained_critic()
            eng.load_full_state_dict(self.v_pretrained, torch.load(v_file, map_location=self.device))
        self.actor.train()

    def save_policy(self, path: str) -> str:
        """The policy at `path` in Hugging Face format (save_pretrained + tokenizer; LoRA merged, gathered under
        ZeRO-3), loadable by AutoModelForCausalLM. All ranks call it. -> `path`"""
        eng.save_policy(self.actor.module, self.tokenizer, path)
        return path

    def save_final(self, run_dir: str) -> str:
        """run_dir/policy (as save_policy) and run_dir/critic. All ranks call it."""
        path = self.save_policy(os.path.join(run_dir, "policy"))
        if self.critic is not None:
            critic_state = eng.full_state_dict(self.critic.module)
            if eng.rank() == 0:
                self.critic.module.save_pretrained(os.path.join(run_dir, "critic"), critic_state)
        return path


def privileged_batch(b: RolloutBatch, tokenizer: Any, template: str) -> RolloutBatch:
    """`b` with each prompt inside distill.privileged (distill.teacher=self): the text before {prompt} encoded with
    the row's answer, the prompt's own tokens, the text after it; left-padded again. The responses are untouched, so
    the actor scores the same sampled tokens as the teacher. -> the batch, prompts [N, Tp']"""
    rows = []
    for ids, mask, answer in zip(b.prompt_ids, b.prompt_mask, b.answers):
        before, after = privileged_parts(template, answer)
        pre, post = (tokenizer(t, add_special_tokens=False)["input_ids"] if t else [] for t in (before, after))
        rows.append(torch.cat([torch.tensor(pre, dtype=ids.dtype), ids[mask.bool()], torch.tensor(post, dtype=ids.dtype)]))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=b.prompt_ids.dtype)  # [N, Tp']
    mask = torch.zeros((len(rows), width), dtype=b.prompt_mask.dtype)  # [N, Tp']
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return b.replace(prompt_ids=ids, prompt_mask=mask)
