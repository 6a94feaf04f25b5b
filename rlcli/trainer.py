"""The one orchestrating loop (DESIGN.md §3). Each training step reads as the paper pseudo-code:

    1 rollout    P prompts -> G responses each (whole groups per rank)
    2 reward     responses -> task reward `score` and correctness `acc`
    3 shape      soft overlong punishment, overlong filter; dynamic sampling drops groups whose `acc`
                 has no variance and refills (surplus groups are carried to the next step)
    4 score      old log-probs (skipped on-policy), reference log-probs (only with KL)
    5 advantage  ADVANTAGES[algo.adv_estimator]
    6 update     ppo_epochs x mini_batches optimizer steps, each over micro-batches, with loss
                 normalizers reduced over the whole mini-batch (all micro-batches, all ranks)
    7 log/eval/save

Algorithms never fork this loop: they are a config plus registered functions.
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

from rlcli import engine as eng
from rlcli.algos.advantages import NEEDS_VALUES, AdvantageInputs, compute_advantages
from rlcli.algos.functional import aggregate, aggregation_counts, gae, kl_estimate, positive_example_nll
from rlcli.algos.kl import build_kl_controller
from rlcli.algos.losses import POLICY_LOSSES
from rlcli.batch import RolloutBatch
from rlcli.config import batch_units
from rlcli.data import PromptStream, load_split
from rlcli.metrics import MetricsLogger, Timer, peak_mem_gb
from rlcli.models import DTYPES, load_policy, resolve_model_path, response_logprobs
from rlcli.models.value import (
    augmented_values,
    critic_loss,
    explained_variance,
    load_critic,
    response_head_outputs,
    response_values,
)
from rlcli.rewards import RewardManager
from rlcli.rollout.hf import generate
from rlcli.rollout.shaping import shape


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


COUNTS = ("timeouts", "errors", "restarts")  # reward metrics that are counts: summed, not averaged


class DynamicSamplingExhausted(RuntimeError):
    pass


class Trainer:
    def __init__(self, cfg: Any):
        self.cfg = cfg
        eng.init_distributed(cfg.hw)
        self.rank, self.world = eng.rank(), eng.world_size()
        self.main = self.rank == 0
        seed_everything(cfg.seed)
        a, r = cfg.algo, cfg.rollout
        self.P, self.G = batch_units(cfg)  # after VAPO group sampling
        self.p_local = self.P // self.world  # prompts (groups) per rank per step
        self.gen_p_local = (r.gen_prompts_per_step or self.P) // self.world
        self.on_policy = a.mini_batches == 1 and a.ppo_epochs == 1 and not (a.kl_coef > 0 and a.kl_in_reward)

        # Model, reference, engine. The tiny default is warm-started once (rank 0 first, then cached).
        if self.main:
            self.model_path, self.model_source = resolve_model_path(cfg.model, cfg.data)
        if self.world > 1:
            torch.distributed.barrier()
            if not self.main:
                self.model_path, self.model_source = resolve_model_path(cfg.model, cfg.data)
        model, self.tokenizer = load_policy(cfg.model, self.model_path)
        self.device = eng.device(cfg.hw)
        model.to(self.device)
        self.ref = eng.frozen_copy(model) if a.kl_coef > 0 else None  # never built when beta = 0
        self.optimizer_steps = cfg.steps * a.mini_batches * a.ppo_epochs
        self.actor = eng.Engine(model, cfg.hw, cfg.optim, self.optimizer_steps)
        self.kl_ctl = build_kl_controller(a)
        # The critic exists only for estimators that need values; VAPO pretrains it first.
        self.critic: eng.Engine | None = None
        self.v_pretrained: torch.nn.Module | None = None  # frozen pretrained critic (V_aug option)
        self.pretrain_steps = cfg.critic.pretrain_steps if a.value_pretrain else 0
        if a.adv_estimator in NEEDS_VALUES:
            critic = load_critic(cfg.critic, self.model_path, DTYPES[cfg.model.dtype]).to(self.device)
            self.critic = eng.Engine(
                critic, cfg.hw, cfg.optim, self.optimizer_steps + self.pretrain_steps * a.mini_batches,
                lr=cfg.critic.lr, warmup_steps=cfg.critic.warmup_steps,
            )

        self.rewards = RewardManager(cfg.reward)
        train, self.train_report = load_split(cfg.data, "train", cfg.seed, tokenizer=self.tokenizer)
        self.train_prompts = PromptStream(train, cfg.seed, cfg.data.shuffle, self.rank, self.world)
        evals, _ = load_split(cfg.data, "eval", cfg.seed, tokenizer=self.tokenizer)
        self.eval_examples = evals[: cfg.eval.size] if cfg.eval.size else evals
        self.carry: RolloutBatch | None = None  # surplus informative groups (dynamic sampling)
        self.next_group = self.rank * 10**9  # group ids unique across ranks and steps
        self.logger = MetricsLogger(
            cfg.logger, cfg.run_dir, OmegaConf.to_container(cfg, resolve=True), enabled=self.main
        )

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        self.print(self.summary())
        result: dict[str, Any] = {}
        if cfg.eval.before:
            result["eval_before"] = self.evaluate()
            self.print(f"held-out accuracy before training: {result['eval_before']['eval/acc']:.3f}")
            self.logger.log({f"{k}_before": v for k, v in result["eval_before"].items()}, step=0)
        t_start = time.perf_counter()
        if self.pretrain_steps:
            result["value_pretrain"] = self.pretrain_critic()
        bar = tqdm(range(1, cfg.steps + 1), desc="train", disable=not self.main, dynamic_ncols=True)
        for step in bar:
            metrics = self.train_step(step)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
                metrics.update(self.evaluate())
            self.logger.log(metrics, step)
            bar.set_postfix(acc=f"{metrics['acc/mean']:.2f}", len=f"{metrics['response_length/mean']:.0f}")
            if self.main and step % cfg.logger.log_every == 0:
                tqdm.write(self.logger.headline(metrics, step))
        result["train_seconds"] = time.perf_counter() - t_start
        result["eval_after"] = self.evaluate()
        self.logger.log({f"{k}_after": v for k, v in result["eval_after"].items()}, step=cfg.steps)
        self.print(
            f"held-out accuracy after training: {result['eval_after']['eval/acc']:.3f}"
            + (f" (before: {result['eval_before']['eval/acc']:.3f})" if "eval_before" in result else "")
        )
        if cfg.save and self.main:
            path = os.path.join(cfg.run_dir, "policy")
            eng.save_policy(self.actor.module, self.tokenizer, path)
            result["policy_path"] = path
            self.print(f"saved policy to {path} (AutoModelForCausalLM.from_pretrained loads it)")
            if self.critic is not None:
                self.critic.module.save_pretrained(os.path.join(cfg.run_dir, "critic"))
        if self.main:
            with open(os.path.join(cfg.run_dir, "result.json"), "w") as f:
                json.dump(result, f, indent=2)
        self.logger.close()
        self.rewards.close()
        return result

    def pretrain_critic(self) -> dict[str, float]:
        """VAPO value pretraining (arXiv:2504.05118 §3.1): roll out the frozen initial policy and train
        only the critic on Monte-Carlo (λ = 1) returns, for critic.pretrain_steps steps or until the
        explained variance of a fresh batch, measured before its update, reaches the threshold."""
        c, a = self.cfg.critic, self.cfg.algo
        out: dict[str, float] = {"steps": 0}
        bar = tqdm(range(1, self.pretrain_steps + 1), desc="value pretraining", disable=not self.main)
        for k in bar:
            timer, m = Timer(), {}
            batch = self.collect(timer, m)
            with timer("score"):
                batch.values = batch.adv_values = self.values(self.critic.module, batch)
            batch.returns = gae(self.token_rewards(batch, m), batch.values, batch.response_mask, a.gamma, 1.0)[1]
            ev = explained_variance(batch.values, batch.returns, batch.loss_mask).item()
            with timer("update"):
                self.update(batch, m, actor=False)
            m.update(timer.metrics())
            m["critic/explained_var"] = ev
            self.logger.log({f"pretrain/{key}": v for key, v in m.items()} | {"pretrain/step": k}, step=0)
            bar.set_postfix(ev=f"{ev:.3f}", vf_loss=f"{m['critic/vf_loss']:.4f}")
            out.update(steps=k, explained_var=ev, vf_loss=m["critic/vf_loss"])
            if c.pretrain_ev_threshold is not None and ev >= c.pretrain_ev_threshold:
                break
        if c.aug_w0 is not None:
            self.v_pretrained = eng.frozen_copy(self.critic.module)
        self.carry = None  # groups sampled for pretraining never reach the actor
        return out

    def train_step(self, step: int) -> dict[str, float]:
        timer, metrics = Timer(), {}
        t0 = time.perf_counter()
        # 1-3. rollout -> reward -> shape, refilled until P informative groups per step.
        batch = self.collect(timer, metrics)
        # 4. score: log-probs of the sampling policy and of the reference.
        with timer("score"):
            self.score(batch, step)
        # 5. advantage.
        with timer("advantage"):
            self.advantage(batch, step, metrics)
        # 6. update.
        with timer("update"):
            self.update(batch, metrics)
        metrics.update(timer.metrics())
        metrics["timing_s/step"] = time.perf_counter() - t0
        n_tokens = eng.all_reduce_sum(batch.response_mask.sum()).item()
        metrics["perf/tokens_per_s"] = n_tokens / max(timer.seconds["rollout"], 1e-9)
        metrics["perf/peak_mem_gb"] = peak_mem_gb()
        return metrics

    # ------------------------------------------------------------------ stages 1-3
    def collect(self, timer: Timer, metrics: dict[str, float]) -> RolloutBatch:
        """Generate, reward and shape batches of prompts until this rank holds P/world groups.

        Without dynamic sampling that is exactly one generation batch. With it, groups whose filter
        metric has zero variance are dropped and new batches are generated, at most
        `algo.max_gen_batches`; surplus kept groups are carried to the next step with their
        sampling-time log-probs (DESIGN.md §5.1).
        """
        a, r = self.cfg.algo, self.cfg.rollout
        parts = [self.carry] if self.carry is not None else []
        self.carry = None
        kept = len(parts[0].groups) if parts else 0
        carried = kept
        pool_acc, pool_rewards, pool_n, gen_batches, shaped = 0.0, [], 0, 0, defaultdict(list)
        generated_groups = 0
        while kept < self.p_local:
            if gen_batches == a.max_gen_batches:
                if a.train_on_partial and kept > 0:
                    break
                raise DynamicSamplingExhausted(
                    f"dynamic sampling found only {kept} informative groups of the {self.p_local} needed "
                    f"per rank after algo.max_gen_batches={a.max_gen_batches} generation batches of "
                    f"{self.gen_p_local} prompts: raise algo.max_gen_batches or "
                    "rollout.gen_prompts_per_step, or set algo.train_on_partial=true"
                )
            n_prompts = self.gen_p_local if a.dynamic_sampling else self.p_local
            prompts = self.train_prompts.take(n_prompts)
            with timer("rollout"):
                b = generate(
                    self.actor.module, self.tokenizer, [p["prompt"] for p in prompts],
                    [p["answer"] for p in prompts], self.G, r.max_new_tokens, r.temperature, r.top_p,
                    r.top_k, r.gen_batch_size, group_offset=self.next_group,
                )
            self.next_group += n_prompts
            gen_batches += 1
            generated_groups += n_prompts
            with timer("reward"):
                out = self.rewards(b.texts, b.answers)
                b.scores, b.acc = out.score.clone(), out.acc
                b.extras = {f"reward/{k}": v for k, v in out.parts.items()}
                for k, v in out.metrics.items():
                    if k.startswith("reward/") and not k.endswith(COUNTS):
                        continue  # part means are recomputed below over the kept batch
                    shaped[k].append(v)
            with timer("shape"):
                for k, v in shape(b, a, r).items():
                    shaped[k].append(v)
            pool_acc += b.acc.sum().item()
            pool_rewards.append(b.scores)
            pool_n += len(b)
            b.stale = torch.zeros(len(b), dtype=torch.bool)
            if a.dynamic_sampling:
                b = b.select_groups(informative_groups(b, a.filter_metric))
            kept += len(b.groups)
            parts.append(b)
        batch = RolloutBatch.cat([p for p in parts if len(p)])
        groups = batch.groups
        if len(groups) > self.p_local:  # carry the surplus, scored now by the policy that sampled it
            surplus = batch.select_groups(groups[self.p_local :])
            surplus.old_logp = self.logprobs(self.actor.module, surplus)
            surplus.stale = torch.ones(len(surplus), dtype=torch.bool)
            self.carry = surplus
            batch = batch.select_groups(groups[: self.p_local])
        for k, v in shaped.items():
            metrics[k] = float(np.sum(v) if k.endswith(COUNTS) else np.mean(v))
        for k, v in batch.extras.items():
            metrics[f"{k}"] = v.float().mean().item()
        lengths = batch.lengths.float()
        metrics.update({
            "reward/mean": batch.scores.mean().item(),
            "reward/std": batch.scores.std().item() if len(batch) > 1 else 0.0,
            "acc/mean": batch.acc.mean().item(),
            "acc/pool_mean": pool_acc / max(pool_n, 1),
            "reward/pool_mean": torch.cat(pool_rewards).mean().item() if pool_rewards else float("nan"),
            "response_length/mean": lengths.mean().item(),
            "response_length/max": lengths.max().item(),
            "response_length/clip_ratio": batch.truncated.float().mean().item(),
            "dynamic_sampling/gen_batches": gen_batches,
            "dynamic_sampling/kept_fraction": (kept - carried) / max(generated_groups, 1),
            "dynamic_sampling/carried": carried,
        })
        return batch

    # ------------------------------------------------------------------ stage 4
    def per_token(self, fn: Any, b: RolloutBatch) -> Tensor:
        """fn(prompt_ids, prompt_mask, response_ids, response_mask) -> [n, T] over micro-batches of
        `b`, without grad, zero on padding. -> [N, T]"""
        out = []
        with torch.no_grad():
            for idx in self.micro_batches(b, torch.arange(len(b))):
                out.append(fn(b.prompt_ids[idx], b.prompt_mask[idx], b.response_ids[idx], b.response_mask[idx]).cpu())
        return torch.cat(out) * b.response_mask

    def logprobs(self, model: torch.nn.Module, b: RolloutBatch) -> Tensor:
        """Log-probs of `b`'s responses under `model` (temperature-scaled). -> [N, T]"""
        return self.per_token(lambda *x: response_logprobs(model, *x, self.cfg.rollout.temperature)[0], b)

    def values(self, critic: torch.nn.Module, b: RolloutBatch) -> Tensor:
        """Critic values at `b`'s response positions. -> [N, T]"""
        return self.per_token(lambda *x: response_values(critic, *x), b)

    def score(self, batch: RolloutBatch, step: int = 0) -> None:
        fresh = ~batch.stale  # [N] rows sampled this step (carried rows bring their own old_logp)
        if not self.on_policy and fresh.any():
            if batch.old_logp is None:
                batch.old_logp = torch.zeros_like(batch.response_mask)
            idx = fresh.nonzero().squeeze(-1)
            batch.old_logp[idx] = self.logprobs(self.actor.module, batch.select(idx))
        if self.ref is not None:
            batch.ref_logp = self.logprobs(self.ref, batch)
        if self.critic is not None:
            batch.values = batch.adv_values = self.values(self.critic.module, batch)
            if self.v_pretrained is not None:  # seed-001 option: V_aug = w(t) V_pre + (1 - w(t)) V
                c = self.cfg.critic
                batch.adv_values = augmented_values(
                    batch.values, self.values(self.v_pretrained, batch), step, self.cfg.steps, c.aug_w0, c.aug_kappa
                ) * batch.response_mask

    # ------------------------------------------------------------------ stage 5
    def token_rewards(self, batch: RolloutBatch, metrics: dict[str, float]) -> Tensor:
        """[N, T]: the shaped outcome reward on each response's last token, minus β·KL per token
        when the KL penalty is in the reward (PPO, RLOO, REINFORCE++)."""
        a = self.cfg.algo
        n, t = batch.response_mask.shape
        last = (batch.lengths - 1).clamp(min=0)  # [N] index of the last response token
        rewards = torch.zeros(n, t)  # [N, T]
        rewards[torch.arange(n), last] = batch.scores
        if self.ref is not None and a.kl_in_reward:
            kl = kl_estimate(batch.old_logp, batch.ref_logp, a.kl_estimator) * batch.response_mask  # [N, T]
            rewards = rewards - self.kl_ctl.value * kl
            tot = eng.all_reduce_sum(torch.stack([kl.sum(), batch.response_mask.sum()]))
            metrics["actor/reward_kl"] = (tot[0] / tot[1]).item()
            self.kl_ctl.update(metrics["actor/reward_kl"], n)
            metrics["actor/kl_coef"] = self.kl_ctl.value
        return rewards

    def advantage(self, batch: RolloutBatch, step: int, metrics: dict[str, float]) -> None:
        a = self.cfg.algo
        inp = AdvantageInputs(
            scores=batch.scores, token_rewards=self.token_rewards(batch, metrics), mask=batch.response_mask,
            group_index=batch.group_index, lengths=batch.lengths, values=batch.adv_values,
            step=step, total_steps=self.cfg.steps,
        )
        batch.advantages, batch.returns = compute_advantages(inp, a)  # [N, T] each
        valid = batch.response_mask.bool()
        metrics["adv/mean"] = batch.advantages[valid].mean().item()
        metrics["adv/std"] = batch.advantages[valid].std().item() if valid.sum() > 1 else 0.0
        if self.critic is not None:  # before the update, over the whole step (verl's definition)
            metrics["critic/explained_var"] = explained_variance(batch.values, batch.returns, batch.loss_mask).item()
            metrics["critic/returns_mean"] = batch.returns[valid].mean().item()

    # ------------------------------------------------------------------ stage 6
    def update(self, batch: RolloutBatch, metrics: dict[str, float], actor: bool = True) -> None:
        """ppo_epochs x mini_batches optimizer steps of the actor (unless `actor` is False, as in
        value pretraining) and of the critic when there is one, over the same mini-batches."""
        a = self.cfg.algo
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.actor.ds.global_steps)
        groups = batch.groups
        sums: dict[str, float] = defaultdict(float)
        n_updates = 0
        self.actor.train()
        for _ in range(a.ppo_epochs):
            order = groups[torch.randperm(len(groups), generator=gen)] if a.mini_batches > 1 else groups
            for mb_groups in order.chunk(a.mini_batches):
                mb = batch.select_groups(mb_groups)
                norms = self.normalizers(mb)
                micro = list(self.micro_batches(mb, torch.arange(len(mb))))
                mb_sums: dict[str, float] = defaultdict(float)
                for i, idx in enumerate(micro):
                    mbi, last = mb.select(idx), i == len(micro) - 1
                    m: dict[str, float] = {}
                    if actor:
                        loss, m = self.micro_loss(mbi, norms)
                        self.actor.backward(loss, last=last)
                    if self.critic is not None:
                        vf_loss, cm = self.micro_value_loss(mbi, norms)
                        self.critic.backward(vf_loss, last=last)
                        m.update(cm)
                    for k, v in m.items():
                        mb_sums[k] += v
                if self.critic is not None:
                    cres = self.critic.step()
                    sums["critic/grad_norm"] += cres.grad_norm if math.isfinite(cres.grad_norm) else 0.0
                # Micro-batch metrics are shares of mini-batch means: they add up over ranks too.
                keys = sorted(mb_sums)
                totals = eng.all_reduce_sum(torch.tensor([mb_sums[k] for k in keys], dtype=torch.float64))
                for k, v in zip(keys, totals.tolist()):
                    sums[k] += v
                if actor:
                    res = self.actor.step()
                    sums["actor/grad_norm"] += res.grad_norm if math.isfinite(res.grad_norm) else 0.0
                    sums["actor/skipped_steps"] += 0.0 if res.applied else 1.0
                n_updates += 1
        for k, v in sums.items():
            metrics[k] = v if k == "actor/skipped_steps" else v / n_updates
        if actor:
            metrics["actor/lr"] = self.actor.lr()
        if self.critic is not None:
            metrics["critic/lr"] = self.critic.lr()

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
        tot = eng.all_reduce_sum(torch.stack([num_tokens, num_seqs, correct_tokens.to(num_tokens.dtype)]))
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
        )  # [n, T] each
        if self.on_policy:  # DESIGN.md §5.3: ratio is exactly 1, its gradient is grad log pi
            old = torch.where(mb.stale[:, None].to(self.device), mb.old_logp.to(self.device), logp.detach()) \
                if mb.stale.any() else logp.detach()
        else:
            old = mb.old_logp.to(self.device)
        adv = mb.advantages.to(self.device)
        loss_mat, pm = POLICY_LOSSES[a.policy_loss](logp, old, adv, mask, a)  # [n, T]
        agg = dict(num_tokens=norms["num_tokens"], num_seqs=norms["num_seqs"], max_len=self.cfg.rollout.max_new_tokens)
        pg_loss = aggregate(loss_mat, mask, a.loss_agg, **agg)
        loss = pg_loss
        share = mask.sum().item() / norms["num_tokens"]  # this micro-batch's share of mini-batch tokens
        metrics = {"actor/pg_loss": pg_loss.item()}
        for k, v in pm.items():
            metrics[f"actor/{k}"] = float(v) * share
        ent = aggregate(entropy, mask, "token_mean", num_tokens=norms["num_tokens"])
        metrics["actor/entropy"] = ent.item()
        if a.entropy_coef:
            loss = loss - a.entropy_coef * aggregate(entropy, mask, a.loss_agg, **agg)
        if self.ref is not None and not a.kl_in_reward:
            kl = kl_estimate(logp, mb.ref_logp.to(self.device), a.kl_estimator)  # [n, T]
            kl_loss = aggregate(kl, mask, a.loss_agg, **agg)
            loss = loss + self.kl_ctl.value * kl_loss
            metrics["actor/kl_loss"] = kl_loss.item()
        if a.nll_coef:  # VAPO positive-example LM loss: NLL over tokens of correct responses
            nll = positive_example_nll(logp, mask, (mb.acc > 0.5).to(self.device), norms["num_correct_tokens"])
            loss = loss + a.nll_coef * nll
            metrics["actor/nll_loss"] = nll.item()
        return loss, metrics

    def micro_batches(self, b: RolloutBatch, idx: Tensor):
        """Split row indices into micro-batches of at most hw.micro_batch rows and, if set,
        hw.max_tokens_per_micro_batch padded tokens. Memory only: the math does not depend on it."""
        hw = self.cfg.hw
        seq_len = b.prompt_ids.shape[1] + b.response_ids.shape[1]
        rows = hw.micro_batch
        if hw.max_tokens_per_micro_batch:
            rows = max(1, min(rows, hw.max_tokens_per_micro_batch // seq_len))
        yield from idx.split(rows)

    # ------------------------------------------------------------------ evaluation & reporting
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (greedy accuracy by default) with the code of `rlcli eval`, sharded over ranks."""
        from rlcli.eval import metrics, sample_and_verify

        shard = self.eval_examples[self.rank :: self.world]
        rows = sample_and_verify(self.actor.module, self.tokenizer, shard, self.cfg.eval, self.cfg.rollout, self.rewards)
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            torch.distributed.all_gather_object(gathered, rows)
            rows = [r for part in gathered for r in part]
        return metrics(rows, self.cfg.eval)

    def summary(self) -> str:
        cfg, a, r, hw = self.cfg, self.cfg.algo, self.cfg.rollout, self.cfg.hw
        n_params = sum(p.numel() for p in self.actor.module.parameters())
        p, g = self.P, self.G
        mb_traj = p * g // a.mini_batches
        d = cfg.data
        digits = f"{d.min_digits}" + (f"-{d.max_digits}" if d.max_digits != d.min_digits else "")
        lines = [
            "rlcli train",
            f"  run dir        {cfg.run_dir}",
            f"  model          {cfg.model.name}: {self.model_path} ({self.model_source})",
            f"  parameters     {n_params / 1e6:.2f}M, dtype {cfg.model.dtype}, precision {hw.precision}",
            f"  hardware       {hw.name}: device {hw.device}, world size {self.world}, ZeRO-{hw.zero_stage}",
            f"  algorithm      {a.name}: advantage={a.adv_estimator} loss={a.policy_loss} "
            f"clip=({a.clip_low}, {a.clip_high}) agg={a.loss_agg} kl_coef={a.kl_coef}"
            f"{' (in reward)' if a.kl_in_reward else ''} reference model={'yes' if self.ref is not None else 'no'}",
            f"  shaping        overlong_filter={a.overlong_filter} soft_overlong={a.soft_overlong} "
            f"(buffer {r.overlong_buffer_len} of {r.max_new_tokens} tokens) "
            f"dynamic_sampling={a.dynamic_sampling}",
            f"  reward         {dict(cfg.reward.weights)}",
            "  critic         "
            + (f"{cfg.critic.head} head from {cfg.critic.path or 'the policy'}, lr {cfg.critic.lr}, "
               f"value pretraining {self.pretrain_steps} steps" if self.critic is not None else "none"),
            "  batch units per step",
            f"    prompts P            {p} ({self.p_local} per rank)"
            + (f", group sampling x{r.group_sampling_factor}" if a.group_sampling else ""),
            f"    responses/prompt G   {g}",
            f"    trajectories N=P*G   {p * g}",
            f"    mini-batches         {a.mini_batches} x {a.ppo_epochs} epoch(s) = "
            f"{a.mini_batches * a.ppo_epochs} optimizer steps/step, {mb_traj} trajectories each",
            f"    micro-batch          {hw.micro_batch} trajectories"
            + (f", <= {hw.max_tokens_per_micro_batch} tokens" if hw.max_tokens_per_micro_batch else ""),
            f"    old-logprob pass     {'skipped (on-policy)' if self.on_policy else 'yes'}",
            f"  schedule       {cfg.steps} steps = {self.optimizer_steps} optimizer steps, lr {cfg.optim.lr} "
            f"({cfg.optim.scheduler}, warmup {cfg.optim.warmup_steps})",
            f"  lengths        max_new_tokens {r.max_new_tokens}, temperature {r.temperature}, "
            f"top_p {r.top_p}, top_k {r.top_k}",
            f"  data           {cfg.data.name}"
            + (f" ({digits}-digit operands)" if d.source == "arith" else "")
            + f": {len(self.train_prompts.examples)} train, "
            f"{len(self.eval_examples)} eval prompts; {self.train_report.summary()}",
        ]
        return "\n".join(lines)

    def print(self, msg: str) -> None:
        if self.main:
            tqdm.write(msg)


def informative_groups(b: RolloutBatch, metric: str) -> Tensor:
    """Group ids whose `metric` varies inside the group (0 < #correct < G); singletons are kept."""
    values = b.acc if metric == "acc" else b.scores
    keep = []
    for g in b.groups.tolist():
        v = values[b.group_index == g]
        if len(v) == 1 or (v.max() - v.min()).abs().item() > 0:
            keep.append(g)
    return torch.tensor(keep, dtype=torch.long)
