"""The one orchestrating loop. Each training step reads as the papers' pseudo-code, one stage per line of
`Trainer.train_step`, each stage a method that returns what it makes:

    1 rollout    P prompts -> G responses each (whole groups per rank)          collect
    2 reward     responses -> task reward `score` and correctness `acc`          collect
    3 shape      soft overlong punishment, overlong filter; dynamic sampling     collect (rlcli.rollout)
    4 score      old log-probs (skipped on-policy), reference log-probs (only with KL), values (critic)
    5 advantage  token rewards (minus the in-reward KL), then ADVANTAGES[algo.adv_estimator]
    6 update     ppo_epochs x mini_batches optimizer steps, each over micro-batches, with loss
                 normalizers reduced over the whole mini-batch (all micro-batches, all ranks)
    7 log/eval/checkpoint (rlcli.checkpoint: every checkpoint.every steps, and on SIGTERM/SIGINT)

Algorithms never fork this loop: they are a config plus registered functions. VAPO value pretraining
runs the same stages 1-5 and an update of the critic alone.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import Tensor
from tqdm.auto import tqdm

from rlcli import checkpoint as ckpt
from rlcli import engine as eng
from rlcli.algos.advantages import NEEDS_VALUES, AdvantageInputs, compute_advantages
from rlcli.algos.functional import (
    aggregate,
    aggregation_counts,
    kl_estimate,
    positive_example_nll,
    rollout_correction_weights,
)
from rlcli.algos.kl import build_kl_controller
from rlcli.algos.losses import POLICY_LOSSES
from rlcli.batch import RolloutBatch
from rlcli.config import batch_units
from rlcli.data import PromptStream, load_split
from rlcli.engine.collectives import agree_max, agree_min, all_reduce, global_stats
from rlcli.metrics import MetricsLogger, Timer, peak_mem_gb
from rlcli.models import DTYPES, load_policy, resolve_model_path, response_logprobs
from rlcli.models.value import (
    augmented_values,
    critic_loss,
    load_critic,
    response_head_outputs,
    response_values,
)
from rlcli.rewards import RewardManager
from rlcli.rollout import ROLLOUT_ENGINES, Sampling
from rlcli.rollout.sampler import DynamicSamplingExhausted, GroupSampler
from rlcli.rollout.shaping import shape
from rlcli.summary import startup_summary

__all__ = ["DynamicSamplingExhausted", "Trainer", "seed_everything"]

REWARD_COUNTS = ("timeouts", "errors", "restarts")  # reward metrics that are counts: summed, not averaged


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Any):
        self.cfg = cfg
        eng.init_distributed(cfg.hw)
        self.rank, self.world = eng.rank(), eng.world_size()
        self.main = self.rank == 0
        seed_everything(cfg.seed)
        a, r = cfg.algo, cfg.rollout
        self.P, self.G = batch_units(cfg)  # as sampled (VAPO group sampling)
        self.p_local = self.P // self.world  # prompts (groups) per rank per step
        self.gen_p_local = (r.gen_prompts_per_step or self.P) // self.world if a.dynamic_sampling else self.p_local
        self.on_policy = a.mini_batches == 1 and a.ppo_epochs == 1 and not (a.kl_coef > 0 and a.kl_in_reward)

        # Model, reference, engine. The tiny default is warm-started once (rank 0 first, then cached).
        if self.main:
            self.model_path, self.model_source = resolve_model_path(cfg.model, cfg.data)
        if self.world > 1:
            torch.distributed.barrier()
            if not self.main:
                self.model_path, self.model_source = resolve_model_path(cfg.model, cfg.data)
        self.lockstep = eng.lockstep(cfg.hw)  # ZeRO-3 over ranks: every forward is a collective
        with eng.sharded_construction(cfg.hw, cfg.optim):  # ZeRO-3: each rank loads only its partition
            model, self.tokenizer = load_policy(cfg.model, self.model_path)
        self.device = eng.device(cfg.hw)
        if not eng.is_partitioned(model):
            model.to(self.device)
        # The KL reference: a frozen copy of the initial policy, never built when beta = 0; with LoRA the
        # policy module itself, scored with its adapters disabled (reference_logprobs).
        self.ref = None
        if a.kl_coef > 0:
            self.ref = model if cfg.model.lora.r else self.frozen_copy(model, lambda: load_policy(cfg.model, self.model_path)[0])
        self.optimizer_steps = cfg.steps * a.mini_batches * a.ppo_epochs
        self.actor = eng.Engine(model, cfg.hw, cfg.optim, self.optimizer_steps)
        self.kl_ctl = build_kl_controller(a)
        # The critic exists only for estimators that need values; VAPO pretrains it first.
        self.critic: eng.Engine | None = None
        self.v_pretrained: torch.nn.Module | None = None  # frozen pretrained critic (V_aug option)
        self.pretrain_steps = cfg.critic.pretrain_steps if a.value_pretrain else 0
        if a.adv_estimator in NEEDS_VALUES:
            with eng.sharded_construction(cfg.hw, cfg.optim):
                critic = self.build_critic()
            if not eng.is_partitioned(critic):
                critic.to(self.device)
            if cfg.model.gradient_checkpointing:  # the critic is as large as the policy: the same trade
                critic.gradient_checkpointing_enable()
            self.critic = eng.Engine(
                critic, cfg.hw, cfg.optim, self.optimizer_steps + self.pretrain_steps * a.mini_batches * a.ppo_epochs,
                lr=cfg.critic.lr, warmup_steps=cfg.critic.warmup_steps,
            )

        self.rewards = RewardManager(cfg.reward)
        train, self.train_report = load_split(cfg.data, "train", cfg.seed, tokenizer=self.tokenizer)
        self.train_prompts = PromptStream(train, cfg.seed, cfg.data.shuffle, self.rank, self.world)
        evals, _ = load_split(cfg.data, "eval", cfg.seed, tokenizer=self.tokenizer)
        self.eval_examples = evals[: cfg.eval.size] if cfg.eval.size else evals
        self.rollout = ROLLOUT_ENGINES[r.engine](self.actor.module, self.tokenizer, self.model_path, cfg)
        self.sampler = GroupSampler(self.p_local, a.dynamic_sampling, a.filter_metric, a.max_gen_batches,
                                    a.train_on_partial, agree=agree_min, lockstep=self.lockstep)
        self.next_group = self.rank * 10**9  # group ids unique across ranks and steps
        self.timer = Timer()  # the current step's stage timer (its last stage is named in errors)
        self.start_step, self.result, self.train_seconds = 0, {}, 0.0
        self.resumed_from = ckpt.resolve(cfg.resume, cfg.run_dir)
        meta = self.restore(self.resumed_from) if self.resumed_from else {}
        self.logger = MetricsLogger(
            cfg.logger, cfg.run_dir, OmegaConf.to_container(cfg, resolve=True), enabled=self.main,
            rows_from=os.path.join(self.resumed_from, "metrics.jsonl") if self.resumed_from else None,
            wandb_id=meta.get("wandb_id"),
        )

    def build_critic(self) -> torch.nn.Module:
        return load_critic(self.cfg.critic, self.model_path, DTYPES[self.cfg.model.dtype])

    def frozen_copy(self, model: torch.nn.Module, build: Any) -> torch.nn.Module:
        """An inference-only copy of `model`'s weights now; `build()` makes a module of its architecture
        (needed under ZeRO-3, where the copy is made partition by partition: rlcli.engine.frozen_copy)."""
        return eng.frozen_copy(model, self.cfg.hw, self.cfg.optim, build)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        cfg, result = self.cfg, self.result
        self.print(startup_summary(self))
        with ckpt.StopSignals(announce=ckpt.to_stderr if self.main else None) as signals:
            if self.start_step:
                self.print(f"resumed from {self.resumed_from}: {self.start_step} of {cfg.steps} steps done")
            elif cfg.eval.before:
                result["eval_before"] = self.evaluate()
                self.print(f"held-out accuracy before training: {result['eval_before']['eval/acc']:.3f}")
                self.logger.log({f"{k}_before": v for k, v in result["eval_before"].items()}, step=0)
            t_start = time.perf_counter()  # training time: value pretraining and steps, not evaluation
            if self.pretrain_steps and not self.start_step:
                result["value_pretrain"] = self.pretrain_critic()
            bar = tqdm(range(self.start_step + 1, cfg.steps + 1), desc="train", initial=self.start_step,
                       total=cfg.steps, disable=not self.main, dynamic_ncols=True)
            for step in bar:
                try:
                    metrics = self.train_step(step)
                except Exception as e:  # e.g. a collective timed out: say which rank was where
                    e.add_note(f"rank {self.rank} of {self.world}: training step {step}, in or after stage "
                               f"{self.timer.stage}")
                    raise
                if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
                    metrics.update(self.evaluate())
                self.logger.log(metrics, step)
                bar.set_postfix(acc=f"{metrics['acc/mean']:.2f}", len=f"{metrics['response_length/mean']:.0f}")
                if self.main and step % cfg.logger.log_every == 0:
                    tqdm.write(self.logger.headline(metrics, step))
                signum = int(all_reduce(torch.tensor(signals.signum), "max").item())  # any rank signalled
                every = cfg.checkpoint.every
                if signum or (every and (step % every == 0 or step == cfg.steps)):
                    path = self.save_checkpoint(step, self.train_seconds + time.perf_counter() - t_start)
                if signum:
                    self.stop(signum, step, path)
        result["train_seconds"] = self.train_seconds + time.perf_counter() - t_start
        result["eval_after"] = self.evaluate()
        self.logger.log({f"{k}_after": v for k, v in result["eval_after"].items()}, step=cfg.steps)
        self.print(
            f"held-out accuracy after training: {result['eval_after']['eval/acc']:.3f}"
            + (f" (before: {result['eval_before']['eval/acc']:.3f})" if "eval_before" in result else "")
        )
        if cfg.save:  # all ranks: under ZeRO-3 the weights are gathered from every rank's partition
            path = os.path.join(cfg.run_dir, "policy")
            eng.save_policy(self.actor.module, self.tokenizer, path)
            result["policy_path"] = path
            self.print(f"saved policy to {path} (AutoModelForCausalLM.from_pretrained loads it)")
            if self.critic is not None:
                critic_state = eng.full_state_dict(self.critic.module)
                if self.main:
                    self.critic.module.save_pretrained(os.path.join(cfg.run_dir, "critic"), critic_state)
        if self.main:
            with open(os.path.join(cfg.run_dir, "result.json"), "w") as f:
                json.dump(result, f, indent=2)
        self.logger.close()
        self.rewards.close()
        return result

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int, train_seconds: float) -> str:
        """Write everything step `step + 1` depends on (layout: rlcli.checkpoint); all ranks call it.
        -> the checkpoint directory"""
        cfg, barrier = self.cfg, torch.distributed.barrier
        t0 = time.perf_counter()
        tmp = ckpt.staging(cfg.run_dir, step, self.rank, barrier)
        self.actor.save(tmp, "actor")
        if self.critic is not None:
            self.critic.save(tmp, "critic")
        if self.v_pretrained is not None:  # all ranks: under ZeRO-3 it is gathered from the partitions
            v_state = eng.full_state_dict(self.v_pretrained)
            if self.main:
                torch.save(v_state, os.path.join(tmp, "v_pretrained.pt"))
        torch.save({
            "rng": ckpt.rng_state(), "prompts": self.train_prompts.state_dict(), "carry": self.sampler.carry,
            "next_group": self.next_group, "kl_coef": self.kl_ctl.value, "result": self.result,
            "train_seconds": train_seconds,
        }, os.path.join(tmp, f"rank_{self.rank}.pt"))
        if self.main:
            self.logger.snapshot(os.path.join(tmp, "metrics.jsonl"))
            OmegaConf.save(cfg, os.path.join(tmp, "config.yaml"), resolve=True)
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({"step": step, "world_size": self.world, "run_dir": cfg.run_dir,
                           "wandb_id": self.logger.wandb_id}, f, indent=2)
        path = ckpt.commit(cfg.run_dir, step, cfg.checkpoint.keep_last, self.rank, barrier)
        self.print(f"checkpoint {path} ({time.perf_counter() - t0:.1f} s)")
        return path

    def restore(self, path: str) -> dict[str, Any]:
        """Load the checkpoint at `path` into this freshly built trainer. -> its meta.json"""
        meta = ckpt.read_meta(path)
        if meta["world_size"] != self.world:
            raise ValueError(f"{path} was written by {meta['world_size']} ranks, this run has {self.world}: "
                             f"resume with hw.nproc={meta['world_size']}")
        self.actor.load(path, "actor")
        if self.critic is not None:
            self.critic.load(path, "critic")
        if os.path.exists(v_file := os.path.join(path, "v_pretrained.pt")):
            self.v_pretrained = self.frozen_copy(self.critic.module, self.build_critic)
            eng.load_full_state_dict(self.v_pretrained, torch.load(v_file, map_location=self.device))
        state = torch.load(os.path.join(path, f"rank_{self.rank}.pt"), weights_only=False)
        self.train_prompts.load_state_dict(state["prompts"])
        self.sampler.carry = state["carry"]
        self.next_group, self.kl_ctl.value = state["next_group"], state["kl_coef"]
        self.start_step, self.result, self.train_seconds = meta["step"], state["result"], state["train_seconds"]
        ckpt.set_rng_state(state["rng"])  # last: building the trainer drew from the RNGs too
        self.actor.train()  # the mode the last update left it in
        self.rollout.update_weights()  # the engine was built from the initial weights
        # The same run continues its wandb run; a branch into another run directory starts a new one.
        return meta if meta["run_dir"] == self.cfg.run_dir else {**meta, "wandb_id": None}

    def stop(self, signum: int, step: int, path: str) -> None:
        """Exit after the checkpoint a SIGTERM/SIGINT asked for, saying how to continue."""
        import signal

        self.print(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint: {path}\n"
                   f"continue with:\n  {ckpt.resume_command(self.cfg.run_dir)}")
        self.logger.close()
        self.rewards.close()
        raise ckpt.Stopped(128 + signum)

    def train_step(self, step: int) -> dict[str, float]:
        timer = self.timer = Timer()
        t0 = time.perf_counter()
        batch, sampled = self.collect(timer)  # 1-3 rollout, reward, shape (+ dynamic sampling)
        with timer("score"):  # 4
            batch = batch.replace(**self.score(batch, step))
        with timer("advantage"):  # 5
            rewards, kl = self.token_rewards(batch)
            advantages, returns = self.advantages(batch, rewards, step)
            batch = batch.replace(advantages=advantages, returns=returns)
        kl_metrics = self.update_kl_controller(batch, kl)
        with timer("update"):  # 6
            updated = self.update(batch)
        with timer("sync"):  # the rollout engine samples from the new weights from now on
            self.rollout.update_weights()
        n_tokens = all_reduce(batch.response_mask.sum()).item()
        rollout_s = timer.seconds.get("rollout", 0.0)  # 0 when carried groups filled the step
        return {
            **sampled, **self.batch_metrics(batch), **kl_metrics, **updated, **timer.metrics(),
            "timing_s/step": time.perf_counter() - t0, "perf/peak_mem_gb": peak_mem_gb(),
        } | ({"perf/tokens_per_s": n_tokens / rollout_s} if rollout_s > 0 else {})

    def pretrain_critic(self) -> dict[str, float]:
        """VAPO value pretraining (arXiv:2504.05118 §4.1, "value network warmup for 50 steps"): the same
        stages 1-5 on rollouts of the frozen initial policy, Monte-Carlo returns (λ_critic = 1), then an
        update of the critic alone; critic.pretrain_steps steps or until the explained variance of a fresh
        batch, measured before its update, reaches critic.pretrain_ev_threshold."""
        c = self.cfg.critic
        monte_carlo = OmegaConf.merge(self.cfg.algo, {"lam_critic": 1.0})
        out: dict[str, float] = {"steps": 0}
        bar = tqdm(range(1, self.pretrain_steps + 1), desc="value pretraining", disable=not self.main)
        for k in bar:
            timer = self.timer = Timer()
            batch, _ = self.collect(timer)
            with timer("score"):
                batch = batch.replace(**self.score(batch, 0, actor=False))
            with timer("advantage"):
                rewards, _ = self.token_rewards(batch)
                batch = batch.replace(returns=self.advantages(batch, rewards, 0, monte_carlo)[1])
            ev = self.explained_variance(batch)
            with timer("update"):
                m = self.update(batch, actor=False)
            m.update({**timer.metrics(), "critic/explained_var": ev})
            self.logger.log({f"pretrain/{key}": v for key, v in m.items()} | {"pretrain/step": k}, step=0)
            bar.set_postfix(ev=f"{ev:.3f}", vf_loss=f"{m['critic/vf_loss']:.4f}")
            out.update(steps=k, explained_var=ev, vf_loss=m["critic/vf_loss"])
            if c.pretrain_ev_threshold is not None and ev >= c.pretrain_ev_threshold:
                break
        if c.aug_w0 is not None:
            self.v_pretrained = self.frozen_copy(self.critic.module, self.build_critic)
        self.sampler.carry = None  # groups sampled for pretraining never reach the actor
        return out

    # ------------------------------------------------------------------ stages 1-3
    def collect(self, timer: Timer) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate, reward and shape batches of prompts until this rank holds P/world groups (one batch
        without dynamic sampling). -> (the step's batch, its sampling metrics over all ranks)"""
        a, r = self.cfg.algo, self.cfg.rollout
        per_trajectory: dict[str, list[Tensor]] = defaultdict(list)
        counts: dict[str, float] = defaultdict(float)

        def sample() -> RolloutBatch:
            prompts = self.train_prompts.take(self.gen_p_local)
            with timer("rollout"):
                b = self.rollout.generate(
                    [p["prompt"] for p in prompts], [p["answer"] for p in prompts], self.G, Sampling.of_rollout(r),
                    group_offset=self.next_group,
                    with_logprobs=a.rollout_correction != "none" or self.rollout.logprobs_are_free,
                )  # [N_gen = gen_p_local * G rows]
            self.next_group += len(prompts)
            with timer("reward"):
                b, reward_counts = self.reward(b)
            for k, v in reward_counts.items():
                counts[k] += v
            with timer("shape"):
                b, shaped = shape(b, a, r)
            for k, v in shaped.items():
                per_trajectory[k].append(v)
            return b

        batch, pool, sampling = self.sampler.collect(sample, lambda b: self.logprobs(self.actor.module, b))
        return batch, self.sampling_metrics(batch, pool, per_trajectory, {**counts, **sampling})

    def reward(self, b: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """Stage 2: -> (`b` with its task reward `scores` [N], correctness `acc` [N] and each reward
        function's part `extras["reward/<name>"]` [N]; the verifier's timeout/error/restart counts)."""
        out = self.rewards(b.texts, b.answers)
        extras = {f"reward/{k}": v for k, v in out.parts.items()}
        return b.replace(scores=out.score.clone(), acc=out.acc, extras=extras), {
            f"reward/{k}": out.metrics[f"reward/{k}"] for k in REWARD_COUNTS
        }

    def sampling_metrics(self, batch: RolloutBatch, pool: list[RolloutBatch], per_trajectory: dict[str, list[Tensor]],
                         counts: dict[str, float]) -> dict[str, float]:
        """Reward, accuracy, length and dynamic-sampling metrics of a step over all ranks: means over the
        trained batch, `pool_mean`s over every trajectory generated, counts summed."""
        stats = global_stats({
            "reward": batch.scores, "acc": batch.acc, "response_length": batch.lengths.float(),
            "response_length/clip_ratio": batch.truncated.float(),
            "reward/pool_mean": torch.cat([p.scores for p in pool] or [torch.zeros(0)]),
            "acc/pool_mean": torch.cat([p.acc for p in pool] or [torch.zeros(0)]),
            **batch.extras, **{k: torch.cat(v) for k, v in per_trajectory.items()},
        })
        keys = sorted(counts)
        total = dict(zip(keys, all_reduce(torch.tensor([counts[k] for k in keys], dtype=torch.float64)).tolist()))
        metrics = {k: v["mean"] for k, v in stats.items() if k not in ("reward", "acc", "response_length") and v["n"]}
        metrics.update({k: total[k] for k in keys if k.startswith("reward/")})
        return metrics | {
            "reward/mean": stats["reward"]["mean"], "reward/std": stats["reward"]["std"],
            "acc/mean": stats["acc"]["mean"],
            "response_length/mean": stats["response_length"]["mean"],
            "response_length/max": stats["response_length"]["max"],
            "dynamic_sampling/gen_batches": counts["dynamic_sampling/gen_batches"],
            "dynamic_sampling/kept_fraction": total["dynamic_sampling/kept_groups"]
            / max(total["dynamic_sampling/generated_groups"], 1.0),
            "dynamic_sampling/carried": total["dynamic_sampling/carried"],
        }

    # ------------------------------------------------------------------ stage 4
    def per_token(self, fn: Any, b: RolloutBatch) -> Tensor:
        """fn(prompt_ids, prompt_mask, response_ids, response_mask) -> [n, T'] over the (trimmed)
        micro-batches of `b`, without grad, zero on padding. -> [N, T]"""
        out = torch.zeros(b.response_mask.shape)  # [N, T]
        with torch.no_grad():
            for idx in self.micro_batches(b):
                if not len(idx):  # lockstep padding: a rank with fewer rows still joins the gathers
                    one = torch.full((1, 1), self.tokenizer.pad_token_id)
                    fn(one, torch.ones_like(one), one, torch.ones(1, 1))
                    continue
                mb = b.select(idx).trimmed()
                v = fn(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask).cpu()  # [n, T']
                out[idx, : v.shape[1]] = v
        return out * b.response_mask

    def logprobs(self, model: torch.nn.Module, b: RolloutBatch) -> Tensor:
        """Log-probs of `b`'s responses under `model` (temperature-scaled). -> [N, T]"""
        chunk = self.cfg.hw.logits_chunk
        return self.per_token(lambda *x: response_logprobs(model, *x, self.cfg.rollout.temperature, chunk=chunk)[0], b)

    def reference_logprobs(self, b: RolloutBatch) -> Tensor:
        """Log-probs of `b`'s responses under the reference policy (the initial one). -> [N, T]"""
        if self.cfg.model.lora.r:  # the base weights never train: the base model is the initial policy
            with self.actor.module.disable_adapter():
                return self.logprobs(self.actor.module, b)
        return self.logprobs(self.ref, b)

    def values(self, critic: torch.nn.Module, b: RolloutBatch) -> Tensor:
        """Critic values at `b`'s response positions. -> [N, T]"""
        return self.per_token(lambda *x: response_values(critic, *x), b)

    def score(self, batch: RolloutBatch, step: int, actor: bool = True) -> dict[str, Tensor]:
        """-> {old_logp, ref_logp, values, adv_values} [N, T] each, those this run uses. old_logp is the
        trainer's log-prob of the sampling policy: computed for fresh rows unless the update is on-policy
        (then it is logp.detach() in the loss); carried rows bring the one recorded when they were sampled.
        With `actor` False (value pretraining) the policy is not updated: log-probs are computed only
        for a KL penalty in the reward."""
        out: dict[str, Tensor] = {}
        kl_in_reward = self.ref is not None and self.cfg.algo.kl_in_reward
        fresh = (~batch.stale).nonzero().squeeze(-1)  # [n_fresh]
        if not self.on_policy if actor else kl_in_reward:  # no fresh rows: nothing (lockstep: dummy passes)
            old = batch.old_logp.clone() if batch.old_logp is not None else torch.zeros_like(batch.response_mask)
            old[fresh] = self.logprobs(self.actor.module, batch.select(fresh))
            out["old_logp"] = old
        if self.ref is not None and (actor or kl_in_reward):
            out["ref_logp"] = self.reference_logprobs(batch)
        if self.critic is not None:
            out["values"] = out["adv_values"] = self.values(self.critic.module, batch)
            if self.v_pretrained is not None:  # option: V_aug = w(t) V_pre + (1 - w(t)) V
                c = self.cfg.critic
                v_pre = self.values(self.v_pretrained, batch)
                out["adv_values"] = augmented_values(out["values"], v_pre, step, self.cfg.steps, c.aug_w0,
                                                     c.aug_kappa) * batch.response_mask
        return out

    # ------------------------------------------------------------------ stage 5
    def token_rewards(self, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        """-> (rewards [N, T]: the shaped outcome reward on each response's last token, minus β·KL_t per
        token when the KL penalty is in the reward (PPO, RLOO, REINFORCE++); that KL_t [N, T] or None)."""
        a = self.cfg.algo
        n, t = batch.response_mask.shape
        last = (batch.lengths - 1).clamp(min=0)  # [N] index of the last response token
        rewards = torch.zeros(n, t)  # [N, T]
        rewards[torch.arange(n), last] = batch.scores
        if self.ref is None or not a.kl_in_reward:
            return rewards, None
        kl = kl_estimate(batch.old_logp, batch.ref_logp, a.kl_estimator) * batch.response_mask  # [N, T]
        return rewards - self.kl_ctl.value * kl, kl

    def advantages(self, batch: RolloutBatch, rewards: Tensor, step: int, algo: Any = None) -> tuple[Tensor, Tensor]:
        """-> (advantages [N, T], returns [N, T]) of `algo` (default: the run's), over the loss mask."""
        inp = AdvantageInputs(
            scores=batch.scores, token_rewards=rewards, mask=batch.loss_mask, group_index=batch.group_index,
            lengths=batch.lengths, values=batch.adv_values, step=step, total_steps=self.cfg.steps,
            reduce=all_reduce if self.world > 1 else None,
        )
        return compute_advantages(inp, algo or self.cfg.algo)

    def update_kl_controller(self, batch: RolloutBatch, kl: Tensor | None) -> dict[str, float]:
        """Feed the in-reward KL (mean per token over all ranks) and the global trajectory count to the
        β controller (adaptive: Ziegler et al. 2019). -> its metrics"""
        if kl is None:
            return {}
        kl_sum, n_tokens, n_traj = all_reduce(torch.stack([kl.sum(), batch.response_mask.sum(),
                                                           torch.tensor(float(len(batch)))])).tolist()
        reward_kl = kl_sum / max(n_tokens, 1.0)
        self.kl_ctl.update(reward_kl, int(n_traj))
        return {"actor/reward_kl": reward_kl, "actor/kl_coef": self.kl_ctl.value}

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """Advantage (and critic) statistics over the step's valid loss tokens on all ranks."""
        valid = batch.loss_mask.bool()
        stats = global_stats({"adv": batch.advantages[valid]})["adv"]
        out = {"adv/mean": stats["mean"], "adv/std": stats["std"]}
        if self.critic is not None:  # before the update, over the whole step (verl's definition)
            out["critic/explained_var"] = self.explained_variance(batch)
            out["critic/returns_mean"] = global_stats({"ret": batch.returns[valid]})["ret"]["mean"]
        return out

    def explained_variance(self, batch: RolloutBatch) -> float:
        """1 - Var(ret - V)/(Var(ret) + 1e-8) over valid loss tokens on all ranks; 0 if returns are constant."""
        valid = batch.loss_mask.bool()
        s = global_stats({"ret": batch.returns[valid], "err": (batch.returns - batch.values)[valid]})
        var_ret = s["ret"]["std"] ** 2
        return 1.0 - s["err"]["std"] ** 2 / (var_ret + 1e-8) if var_ret > 1e-8 else 0.0

    # ------------------------------------------------------------------ stage 6
    def update(self, batch: RolloutBatch, actor: bool = True) -> dict[str, float]:
        """ppo_epochs x mini_batches optimizer steps of the actor (unless `actor` is False, as in value
        pretraining) and of the critic when there is one, over the same mini-batches. -> metrics, means
        over the optimizer steps (the `_max` ones: maxima)."""
        a = self.cfg.algo
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.actor.ds.global_steps)
        groups = batch.groups
        sums: dict[str, float] = defaultdict(float)
        n_updates, slots, real = 0, 0, 0.0  # token slots of the micro-batches, and real tokens among them
        self.actor.train()
        for _ in range(a.ppo_epochs):
            order = groups[torch.randperm(len(groups), generator=gen)] if a.mini_batches > 1 else groups
            # Exactly mini_batches parts on every rank; ranks hold equal group counts, so an empty part
            # (fewer groups than mini-batches, algo.train_on_partial) is empty on all ranks alike.
            for mb_groups in order.tensor_split(a.mini_batches):
                if not len(mb_groups):
                    continue
                mb = batch.select_groups(mb_groups)
                norms = self.normalizers(mb)
                micro = self.micro_batches(mb)
                mb_sums: dict[str, float] = defaultdict(float)
                for i, idx in enumerate(micro):
                    mbi, last = mb.select(idx).trimmed(), i == len(micro) - 1
                    slots += mbi.prompt_ids.numel() + mbi.response_ids.numel()
                    real += float(mbi.prompt_mask.sum() + mbi.response_mask.sum())
                    m: dict[str, float] = {}
                    if actor:
                        loss, m = self.micro_loss(mbi, norms)
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
                    for k, v in zip(keys, totals.tolist()):
                        sums[k] = max(sums.get(k, -math.inf), v) if op == "max" else sums[k] + v
                for name, engine in (("actor", self.actor if actor else None), ("critic", self.critic)):
                    if engine is not None:
                        res = engine.step()
                        sums[f"{name}/grad_norm"] += res.grad_norm if math.isfinite(res.grad_norm) else 0.0
                        sums[f"{name}/skipped_steps"] += 0.0 if res.applied else 1.0
                n_updates += 1
        metrics = {k: v if k.endswith(("_max", "skipped_steps")) else v / max(n_updates, 1) for k, v in sums.items()}
        slots_all, real_all = all_reduce(torch.tensor([float(slots), real], dtype=torch.float64)).tolist()
        metrics["perf/padding_frac"] = 1.0 - real_all / max(slots_all, 1.0)
        if actor:
            metrics["actor/lr"] = self.actor.lr()
        if self.critic is not None:
            metrics["critic/lr"] = self.critic.lr()
        return metrics

    def micro_value_loss(self, mb: RolloutBatch, norms: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
        """The clipped value loss of one micro-batch, normalised by the mini-batch's token count."""
        mask = mb.loss_mask.to(self.device)
        head = response_head_outputs(self.critic.module, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                     mb.response_mask)  # [n, T, K]
        loss, cm = critic_loss(head, mb.values.to(self.device), mb.returns.to(self.device), mask,
                               self.critic.module.spec, self.cfg.algo.value_clip, norms["num_tokens"])
        share = mask.sum().item() / norms["num_tokens"]
        out = {"critic/vf_loss": float(cm.pop("vf_loss"))}
        cm.pop("explained_var", None)  # not additive over micro-batches: logged per step instead
        out.update({f"critic/{k}": float(v) * share for k, v in cm.items()})
        return loss, out

    def normalizers(self, mb: RolloutBatch) -> dict[str, float]:
        """Loss normalizers over the whole optimizer mini-batch: all micro-batches and all ranks."""
        num_tokens, num_seqs = aggregation_counts(mb.loss_mask)
        correct_tokens = (mb.loss_mask * (mb.acc > 0.5)[:, None]).sum()
        tot = all_reduce(torch.stack([num_tokens, num_seqs, correct_tokens.to(num_tokens.dtype)]))
        return {
            "num_tokens": max(tot[0].item(), 1.0),
            "num_seqs": max(tot[1].item(), 1.0),
            "num_correct_tokens": max(tot[2].item(), 1.0),
        }

    def micro_loss(self, mb: RolloutBatch, norms: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
        """The loss of one micro-batch, already divided by the mini-batch normalizers, so summing
        micro-batch gradients over micro-batches and ranks gives the mini-batch gradient."""
        a = self.cfg.algo
        mask = mb.loss_mask.to(self.device)  # [n, T]
        logp, entropy = response_logprobs(
            self.actor.module, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
            self.cfg.rollout.temperature, with_entropy=True, entropy_grad=a.entropy_coef != 0,
            chunk=self.cfg.hw.logits_chunk,
        )  # [n, T] each
        old = logp.detach()  # on-policy: the ratio is exactly 1 and its gradient is ∇log π
        if not self.on_policy or mb.stale.any():  # carried rows always bring their sampling-time log-probs
            recorded = mb.old_logp.to(self.device)
            old = recorded if not self.on_policy else torch.where(mb.stale[:, None].to(self.device), recorded, old)
        loss_mat, pm = POLICY_LOSSES[a.policy_loss](logp, old, mb.advantages.to(self.device), mask, a)  # [n, T]
        share = mask.sum().item() / norms["num_tokens"]  # this micro-batch's share of mini-batch tokens
        metrics = {f"actor/{k}": float(v) * share for k, v in pm.items()}
        if mb.rollout_logp is not None:  # the sampler/trainer gap on the sampled tokens
            sampler_logp = mb.rollout_logp.to(self.device)
            gap = (old - sampler_logp).abs() * mask
            metrics["rollout_corr/logp_diff_mean"] = float(gap.sum()) / norms["num_tokens"]
            metrics["rollout_corr/logp_diff_max"] = float(gap.max()) if gap.numel() else 0.0
            metrics["rollout_corr/kl"] = float((kl_estimate(sampler_logp, old, "k3") * mask).sum()) / norms["num_tokens"]
        if a.rollout_correction != "none":  # π_trainer / π_sampler on the sampling policy's tokens
            w, wm = rollout_correction_weights(
                old - mb.rollout_logp.to(self.device), mask, level=a.rollout_correction,
                upper=a.rollout_correction_upper, lower=a.rollout_correction_lower,
            )
            loss_mat = loss_mat * w
            metrics.update({"rollout_corr/weight_mean": float(wm["weight_mean"]) * share,
                            "rollout_corr/clipped_frac": float(wm["clipped_frac"]) * share,
                            "rollout_corr/weight_max": float(wm["weight_max"])})
        agg = dict(num_tokens=norms["num_tokens"], num_seqs=norms["num_seqs"], max_len=self.cfg.rollout.max_new_tokens)
        loss = pg_loss = aggregate(loss_mat, mask, a.loss_agg, **agg)
        metrics["actor/pg_loss"] = pg_loss.item()
        metrics["actor/entropy"] = aggregate(entropy, mask, "token_mean", num_tokens=norms["num_tokens"]).item()
        if a.entropy_coef:
            loss = loss - a.entropy_coef * aggregate(entropy, mask, a.loss_agg, **agg)
        if self.ref is not None and not a.kl_in_reward:
            kl_loss = aggregate(kl_estimate(logp, mb.ref_logp.to(self.device), a.kl_estimator), mask, a.loss_agg, **agg)
            loss = loss + self.kl_ctl.value * kl_loss
            metrics["actor/kl_loss"] = kl_loss.item()
        if a.nll_coef:  # VAPO positive-example LM loss: NLL over tokens of correct responses
            nll = positive_example_nll(logp, mask, (mb.acc > 0.5).to(self.device), norms["num_correct_tokens"])
            loss = loss + a.nll_coef * nll
            metrics["actor/nll_loss"] = nll.item()
        return loss, metrics

    def micro_batches(self, b: RolloutBatch) -> list[Tensor]:
        """Row indices of `b` split into micro-batches of at most hw.micro_batch rows and, if set,
        hw.max_tokens_per_micro_batch token slots (rows x (longest prompt + longest response) in the
        micro-batch, after RolloutBatch.trimmed). Rows go longest first, so a micro-batch holds rows of
        similar length and little padding (perf/padding_frac). Memory only: the math does not depend on it."""
        hw = self.cfg.hw
        tp, t = b.prompt_mask.sum(-1).long().tolist(), b.response_mask.sum(-1).long().tolist()
        order = sorted(range(len(b)), key=lambda i: -(tp[i] + t[i]))  # stable: ties keep their order
        parts: list[list[int]] = []
        width = (0, 0)  # longest prompt and response of the micro-batch being filled
        for i in order:
            wider = (max(width[0], tp[i]), max(width[1], t[i]))
            full = parts and (len(parts[-1]) == hw.micro_batch or (
                hw.max_tokens_per_micro_batch and (len(parts[-1]) + 1) * sum(wider) > hw.max_tokens_per_micro_batch))
            if not parts or full:
                parts.append([])
                wider = (tp[i], t[i])
            parts[-1].append(i)
            width = wider
        if self.lockstep:  # every rank runs as many forward passes as the rank that needs most
            parts = split_to(parts, agree_max(len(parts)))
        return [torch.tensor(p, dtype=torch.long) for p in parts]

    # ------------------------------------------------------------------ evaluation & reporting
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (greedy accuracy by default) with the code of `rlcli eval`, sharded over ranks."""
        from rlcli.eval import metrics, sample_and_verify

        shard = self.eval_examples[self.rank :: self.world]
        pad = 0
        if self.lockstep:  # equal shards, so every rank runs the same generation calls; padding is dropped
            pad = -(-len(self.eval_examples) // self.world) - len(shard)
            shard = shard + self.eval_examples[:1] * pad
        # Seeded and on a forked RNG: the numbers do not depend on when evaluation runs, and evaluation
        # never moves the RNG training samples from (so eval.* may change on resume).
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.cfg.seed)
            rows = sample_and_verify(self.rollout, shard, self.cfg.eval, self.cfg.rollout, self.rewards)
        rows = rows[: len(rows) - pad]
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            torch.distributed.all_gather_object(gathered, rows)
            rows = [r for part in gathered for r in part]
        return metrics(rows, self.cfg.eval)

    def print(self, msg: str) -> None:
        if self.main:
            tqdm.write(msg)
