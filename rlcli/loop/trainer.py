"""The one orchestrating loop. Each training step reads as the papers' pseudo-code, one stage per line of
`Trainer.train_step`, each stage returning what it makes:

    1 rollout    P prompts -> G responses each (whole groups per rank)          collect
    2 reward     responses -> task reward `score` and correctness `acc`          collect
    3 shape      soft overlong punishment, overlong filter; dynamic sampling     collect (rlcli.rollout)
    4 score      old log-probs (skipped on-policy), reference log-probs (only with KL), values (critic)
    5 advantage  token rewards (minus the in-reward KL), then ADVANTAGES[algo.adv_estimator]
    6 update     ppo_epochs x mini_batches optimizer steps, each over micro-batches, with loss
                 normalizers reduced over the whole mini-batch (all micro-batches, all ranks)
      sync       the rollout engine samples from the new weights from then on
    7 log/eval/checkpoint (rlcli.loop.checkpoint: every checkpoint.every steps, and on SIGTERM/SIGINT)

Stages 4 and 6 are the learner's (rlcli/loop/learner.py); what the loop carries from step to step is one LoopState
(rlcli/loop/state.py). Algorithms never fork this loop: they are a config plus registered functions. VAPO value
pretraining is the same step in another phase (the critic alone learns, on Monte-Carlo returns).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from rlcli.algos.advantages import AdvantageInputs, compute_advantages, outcome_token_rewards
from rlcli.algos.functional import distill_advantages, kl_estimate
from rlcli.algos.kl import build_kl_controller
from rlcli.core.batch import RolloutBatch
from rlcli.core.units import units
from rlcli.data import load_split, prompt_stream
from rlcli.data.reasoning_gym import episodes, task_names
from rlcli.engine.collectives import all_reduce, gather_objects
from rlcli.loop.eval import eval_subset
from rlcli.loop.job import Job
from rlcli.loop.learner import Learner, Phase, rl_phase, value_pretrain_phase
from rlcli.loop.metrics import Timer, dump_rollouts, headline, memory_metrics
from rlcli.loop.plot import log_curves
from rlcli.loop.remote import rollout_source
from rlcli.loop.state import NO_SIGNAL_STEPS, LoopState
from rlcli.loop.summary import eval_command, no_signal_warning, startup_summary
from rlcli.plan.budget import budget_pending, fix_budget
from rlcli.plan.inputs import arith_bound, longest_prompt
from rlcli.rewards import RewardManager
from rlcli.rollout import build_engine
from rlcli.rollout.replay import ReplayBuffer
from rlcli.rollout.sampler import DynamicSamplingExhausted, GroupSampler, sampling_metrics

__all__ = ["DynamicSamplingExhausted", "Trainer"]

class Trainer(Job):
    """`rlcli train` (a Job: rlcli.loop.job runs its skeleton): the RL step, its evaluation and what it saves."""

    def __init__(self, cfg: Any, channel: Any = None):
        """`channel`: to this job's rollout ranks (asynchronous rollout, rlcli.loop.remote); None: generate here."""
        super().__init__(cfg)
        self.units = units(cfg)
        self.world, self.eval_every, a = self.units.world, cfg.eval.every, cfg.algo
        self.learner = Learner(cfg, self.model_path, self.units)
        self.tokenizer = self.learner.tokenizer
        self.rewards = RewardManager.for_run(cfg, self.tokenizer, with_model=channel is None)  # else rollout ranks score
        train, self.train_report = load_split(cfg.data, "train", cfg.seed, tokenizer=self.tokenizer, env_cfg=cfg.env)
        self.tasks = task_names(cfg.data)  # a mix of tasks (data=reasoning_gym): acc/<task>, reward/<task>
        evals, _ = load_split(cfg.data, "eval", cfg.seed, tokenizer=self.tokenizer, env_cfg=cfg.env)
        if budget_pending(cfg):  # `rlcli train` fixes them; a Trainer built in code does here, from the same
            # prompt length (the embedded task's exact bound, else the data's longest prompt)
            fix_budget(cfg, arith_bound(cfg) or longest_prompt(self.tokenizer, train + evals, cfg.env))
        self.eval_examples, self.eval_which = eval_subset(evals, cfg.eval)
        engine = "hf" if channel else cfg.rollout.engine  # with rollout ranks: evaluation only
        self.rollout = build_engine(engine, self.learner.actor.module, self.tokenizer, self.model_path, cfg)
        prompts, curriculum = prompt_stream(cfg.data, train, cfg.seed, self.rank, self.units.world, self.tokenizer)
        rp = cfg.rollout.replay
        replay = ReplayBuffer(rp.size, rp.max_age) if rp.size else None  # rollout.replay: empty groups replaced
        self.state = LoopState(
            prompts=prompts, curriculum=curriculum,  # data.curriculum: the prompts are drawn at its levels
            sampler=GroupSampler(self.units.p_local, a.dynamic_sampling, a.filter_metric, a.max_gen_batches,
                                 a.train_on_partial, lockstep=self.learner.lockstep, max_carry=self.units.p_local - 1
                                 if channel else None, replay=replay),
            replay=replay,
            kl_ctl=build_kl_controller(a), next_group=self.rank * 10**9,  # group ids unique across ranks
            entropy_ctl=self.learner.entropy_ctl,  # α of the entropy bonus (algo.entropy_control=adaptive: it moves)
            rollout=rollout_source(cfg, channel, self.rollout, self.rewards),
        )
        self.timer = Timer()  # the current step's stage timer (its last stage is named in errors)
        self.resume()

    # ------------------------------------------------------------------ the job's protocol (rlcli.loop.job)
    def summary(self) -> str:
        return startup_summary(self)

    def before_training(self) -> None:
        if self.cfg.eval.before:
            self.evaluate_before()
        if self.units.pretrain_steps:
            self.state.result["value_pretrain"] = self.pretrain_critic()

    def end_step(self, step: int, metrics: dict[str, float]) -> None:
        a = self.cfg.algo
        self.state.end_step(step, metrics, a.mini_batches * a.ppo_epochs, self.cfg.optim.max_skipped_steps)

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"acc": f"{metrics['acc/mean']:.2f}", "len": f"{metrics['response_length/mean']:.0f}"}

    def step_line(self, metrics: dict[str, float], step: int) -> str:
        return headline(metrics, step)

    def notes(self, metrics: dict[str, float]) -> list[str]:
        s = self.state
        return [no_signal_warning(metrics, s.no_signal_in_a_row)] if s.no_signal_in_a_row == NO_SIGNAL_STEPS else []

    def after_checkpoint(self, step: int) -> None:
        if self.cfg.save and self.cfg.checkpoint.hf_every and step % self.cfg.checkpoint.hf_every == 0:
            self.save_hf(step)

    def end_training(self) -> None:
        self.state.rollout.close()  # the rollout ranks are done: none waits on its request timeout through evaluation

    def save_final(self) -> tuple[str, str, str]:
        return "policy_path", self.learner.save_final(self.cfg.run_dir), "AutoModelForCausalLM.from_pretrained loads it"

    def after_fit(self) -> None:
        log_curves(self.logger, self.state.result, self.cfg.steps)  # to the logger backends, as `rlcli plot` draws them

    def stage(self) -> str | None:
        return self.timer.stage

    def train_step(self, step: int, phase: Phase | None = None) -> dict[str, float]:
        phase = phase or rl_phase(self.cfg)
        timer = self.timer = Timer()
        t0 = time.perf_counter()
        batch, sampled = self.collect(timer, step)  # 1-3 rollout, reward, shape (+ dynamic sampling)
        if self.cfg.logger.rollouts and phase.trains_actor:
            dump_rollouts(self.cfg.run_dir, step, batch, self.tokenizer)
        with timer("score"):  # 4
            batch = batch.replace(**self.learner.score(batch, step, phase))
        with timer("advantage"):  # 5
            batch, kl_metrics = self.advantage(batch, step, phase)
        batch_metrics = self.learner.batch_metrics(batch)
        with timer("update"):  # 6
            updated = self.learner.update(batch, phase)
        if phase.trains_actor:
            with timer("sync"):  # the rollout engine samples from the new weights from now on
                self.state.rollout.after_update()
        n_tokens = all_reduce(batch.response_mask.sum()).item()
        rollout_s = timer.seconds.get("rollout", 0.0)  # 0 when carried groups filled the step
        self.state.train_seconds += time.perf_counter() - t0
        return {
            **sampled, **batch_metrics, **kl_metrics, **updated, **timer.metrics(),
            "timing_s/step": time.perf_counter() - t0, **memory_metrics(),
        } | ({"perf/tokens_per_s": n_tokens / rollout_s} if rollout_s > 0 else {})

    def pretrain_critic(self) -> dict[str, float]:
        """VAPO value pretraining (arXiv:2504.05118 §4.1, "value network warmup for 50 steps"): training steps
        of the value_pretrain phase on rollouts of the frozen initial policy, critic.pretrain_steps of them
        or until the explained variance of a fresh batch, measured before its update, reaches
        critic.pretrain_ev_threshold."""
        c, phase = self.cfg.critic, value_pretrain_phase(self.cfg)
        out: dict[str, float] = {"steps": 0}
        bar = tqdm(range(1, self.units.pretrain_steps + 1), desc="value pretraining", disable=not self.main)
        for k in bar:
            m = self.train_step(0, phase)  # the actor has taken no step yet
            self.logger.log({f"{phase.prefix}{key}": v for key, v in m.items()} | {f"{phase.prefix}step": k}, step=0)
            ev = m["critic/explained_var"]
            bar.set_postfix(ev=f"{ev:.3f}", vf_loss=f"{m['critic/vf_loss']:.4f}")
            out.update(steps=k, explained_var=ev, vf_loss=m["critic/vf_loss"])
            if c.pretrain_ev_threshold is not None and ev >= c.pretrain_ev_threshold:
                break
        if c.aug_w0 is not None:
            self.learner.freeze_pretrained_critic()
        self.state.sampler.carry = None  # groups sampled for pretraining never reach the actor
        return out

    # ------------------------------------------------------------------ stages 1-3
    def collect(self, timer: Timer, step: int = 0) -> tuple[RolloutBatch, dict[str, float]]:
        """Take generation batches (made here, or by a rollout rank) until this rank holds P/world groups (one
        batch without dynamic sampling). -> (the step's batch, its sampling metrics over all ranks)"""
        s = self.state
        per_trajectory: dict[str, list[Tensor]] = defaultdict(list)
        counts: dict[str, float] = defaultdict(float)
        timer.stage = "rollout"  # from the first agreement on held groups (a collective) on

        def sample() -> RolloutBatch:
            made = s.rollout.next(lambda v: s.request(self.units.gen_p_local, v), s.step, self.cfg.steps - step)
            for into, part in ((timer.seconds, made.seconds), (counts, made.counts)):
                for k, v in part.items():
                    into[k] += v
            for k, v in made.per_trajectory.items():
                per_trajectory[k].append(v)
            return made.batch

        batch, pool, sampling = s.sampler.collect(sample, self.learner.logprobs, s.step)
        metrics = sampling_metrics(batch, pool, per_trajectory, {**counts, **sampling}, self.tasks)
        if s.curriculum is not None:  # the levels the step drew at; then every episode generated (all ranks) moves them
            metrics |= s.curriculum.metrics()
            for note in s.curriculum.observe(e for part in gather_objects(episodes(pool)) for e in part):
                self.print(note)
        return batch, metrics | s.rollout.metrics(batch, s.step)

    # ------------------------------------------------------------------ stage 5
    def advantage(self, batch: RolloutBatch, step: int, phase: Phase) -> tuple[RolloutBatch, dict[str, float]]:
        """Token rewards (the shaped outcome reward on each response's last token, minus β·KL_t per token when
        the KL penalty is in the reward: PPO, RLOO, REINFORCE++), then ADVANTAGES[algo.adv_estimator] over
        the loss mask. The RL phase feeds the in-reward KL (mean per token, all ranks) to β's controller
        (adaptive: Ziegler et al. 2019). -> (`batch` with advantages and returns [N, T], KL metrics)"""
        a, kl_ctl = phase.algo, self.state.kl_ctl
        rewards = outcome_token_rewards(batch.scores, batch.response_mask)  # [N, T]
        metrics: dict[str, float] = {}
        if self.learner.ref is not None and a.kl_in_reward:
            kl = kl_estimate(batch.old_logp, batch.ref_logp, a.kl_estimator) * batch.response_mask  # [N, T]
            rewards = rewards - kl_ctl.value * kl
            if phase.trains_actor:
                kl_sum, n_tokens, n_traj = all_reduce(torch.stack([
                    kl.sum(), batch.response_mask.sum(), torch.tensor(float(len(batch)))])).tolist()
                kl_ctl.update(kl_sum / max(n_tokens, 1.0), int(n_traj))
                metrics = {"actor/reward_kl": kl_sum / max(n_tokens, 1.0), "actor/kl_coef": kl_ctl.value}
        inp = AdvantageInputs(
            scores=batch.scores, token_rewards=rewards, mask=batch.loss_mask, group_index=batch.group_index,
            lengths=batch.lengths, values=batch.adv_values, step=step, total_steps=self.cfg.steps,
            reduce=all_reduce if self.units.world > 1 else None,
        )
        advantages, returns = compute_advantages(inp, a)
        if batch.teacher_logp is not None:  # on-policy distillation joins any algorithm's advantage, per token
            d = self.cfg.distill
            advantages = advantages + distill_advantages(batch.old_logp, batch.teacher_logp, batch.loss_mask, d.coef,
                                                         d.discount)
            metrics |= distill_metrics(batch, d.unlikely_p)
        return batch.replace(advantages=advantages, returns=returns), metrics

    # ------------------------------------------------------------------ 7: evaluation, checkpoints
    def evaluate(self, when: str = "") -> dict[str, float]:
        """Held-out metrics (greedy accuracy by default) with the code of `rlcli eval`, sharded over ranks; rank 0
        shows a progress bar named `held-out <when>`."""
        from rlcli.loop.eval import metrics, sample_and_verify

        world, examples = self.units.world, self.eval_examples
        shard = examples[self.rank :: world]
        pad = 0
        if self.rollout.collective:  # equal shards, so every rank runs the same generation calls; padding is dropped
            pad = -(-len(examples) // world) - len(shard)
            shard = shard + examples[:1] * pad
        # Seeded and on a forked RNG: the numbers do not depend on when evaluation runs, and evaluation
        # never moves the RNG training samples from (so eval.* may change on resume).
        device = self.learner.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.cfg.seed)
            rows = sample_and_verify(self.rollout, shard, self.cfg.eval, self.cfg.rollout, self.rewards,
                                     progress=self.main, desc=f"held-out {when}".strip())
        rows = [r for part in gather_objects(rows[: len(rows) - pad]) for r in part]
        return metrics(rows, self.cfg.eval)

    def save_weights(self, path: str) -> None:
        self.learner.save(path)

    def load_weights(self, path: str) -> None:
        self.learner.load(path)

    def restore(self, path: str) -> dict[str, Any]:
        meta = super().restore(path)
        self.rollout.update_weights()  # the engine was built from the initial weights
        return meta

    def save_hf(self, step: int) -> None:
        """run_dir/hf/step_<step>: the policy as the final one is saved (checkpoint.hf_every). All ranks call it."""
        t0 = time.perf_counter()
        path = self.learner.save_policy(os.path.join(self.cfg.run_dir, "hf", f"step_{step}"))
        self.print(f"saved {path} ({time.perf_counter() - t0:.1f} s; AutoModelForCausalLM.from_pretrained loads it)")

    def outputs(self) -> list[str]:
        run, lines = self.cfg.run_dir, []
        if self.state.result.get("policy_path"):
            lines.append("  policy/         the trained policy (AutoModelForCausalLM.from_pretrained loads it)")
        if os.path.isdir(hf := os.path.join(run, "hf")):
            lines.append(f"  hf/             {' '.join(sorted(os.listdir(hf), key=lambda n: (len(n), n)))} "
                         "(checkpoint.hf_every)")
        if not self.cfg.save:
            lines.append("  save=false: no policy and no checkpoint written")
        return lines

    def closing(self) -> list[str]:
        s, policy = self.state, self.state.result.get("policy_path")
        lines = [f"warning: {s.no_signal_steps} of the run's {s.step} steps had every advantage 0 (every group's "
                 "rewards equal): nothing was learned from them"] if s.no_signal_steps else []
        return lines + ["next:", *([f"  {eval_command(self.cfg.run_dir, policy)}"] if policy else []),
                        f"  rlcli plot {self.cfg.run_dir}"]

    def close(self) -> None:
        self.state.rollout.close()
        self.rollout.close()  # a multi-turn engine's tool workers
        self.rewards.close()
        super().close()


def distill_metrics(batch: RolloutBatch, unlikely_p: float) -> dict[str, float]:
    """distill/* over the loss mask's tokens of all ranks: the sampled reverse KL log π_student − log π_teacher (mean
    per token), the teacher's log-prob of the sampled tokens, and the fraction it gives a probability below
    `unlikely_p` (distill.unlikely_p)."""
    m = batch.loss_mask.bool()  # [N, T]
    student, teacher = batch.old_logp[m], batch.teacher_logp[m]  # [n_tokens] each
    rkl, t_logp, unlikely, n = all_reduce(torch.stack([
        (student - teacher).sum(), teacher.sum(), (teacher < math.log(unlikely_p)).float().sum(),
        m.sum().float()])).tolist()
    n = max(n, 1.0)
    return {"distill/reverse_kl": rkl / n, "distill/teacher_logp": t_logp / n, "distill/unlikely_frac": unlikely / n}
