"""Whole-group sampling with DAPO dynamic sampling and the carry of surplus groups.

DAPO (Yu et al. 2025, arXiv:2503.14476, §3.2 and Algorithm 1) drops every group whose accuracy has no
variance (all right or all wrong: zero advantage, zero gradient) and samples further batches until
the step holds P informative groups. Groups found beyond P are carried to the next step instead of
being discarded (verl discards them). A carried group was sampled by the policy before this step's
update, so its old log-probs are recorded once, under that policy, when it is first carried, and never
recomputed: the PPO ratio of a carried row is then π_now / π_sampler, as importance sampling needs.

Everything here works on `RolloutBatch` objects of plain tensors: the model enters only through the
two callables `GroupSampler.collect` receives, so the logic is tested without one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from rlcli.core.batch import RolloutBatch
from rlcli.engine.collectives import agree_min, all_reduce, global_stats
from rlcli.rollout.replay import ReplayBuffer


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling hit algo.max_gen_batches before it found P informative groups."""


def informative_groups(values: Tensor, group_index: Tensor) -> Tensor:
    """Ids of the groups whose `values` vary inside the group (0 < #correct < G for accuracy).

    Shapes: values [N], group_index [N] -> [P'] group ids in order of first appearance. A group of one
    response has no variance to lose and is kept.
    """
    ids, inv = torch.unique(group_index, return_inverse=True)
    v = values.to(torch.float64)
    empty = torch.zeros(len(ids), dtype=v.dtype)
    spread = empty.scatter_reduce(0, inv, v, "amax", include_self=False) - empty.scatter_reduce(
        0, inv, v, "amin", include_self=False
    )  # [P]
    size = torch.bincount(inv, minlength=len(ids))  # [P]
    keep = set(ids[(spread > 0) | (size == 1)].tolist())
    order = RolloutBatch.first_appearance(group_index)
    return torch.tensor([g for g in order.tolist() if g in keep], dtype=torch.long)


class GroupSampler:
    """Fills a step with `need` groups per rank, refilling under dynamic sampling and carrying the surplus.

    `agree(k)` returns the minimum of `k` over all ranks (default: a collective; identity in one process). Every rank runs the
    same number of generation batches and keeps the same number of groups, so all ranks then run the
    same optimizer steps and collectives (with `train_on_partial` too).
    """

    def __init__(
        self, need: int, dynamic: bool, filter_metric: str, max_gen_batches: int, train_on_partial: bool,
        agree: Callable[[int], int] = agree_min, lockstep: bool = False, max_carry: int | None = None,
        replay: ReplayBuffer | None = None,
    ):
        self.need, self.dynamic, self.filter_metric = need, dynamic, filter_metric
        self.max_gen_batches, self.train_on_partial, self.agree = max_gen_batches, train_on_partial, agree
        self.lockstep = lockstep  # ZeRO-3 over ranks: each forward pass is a collective (rlcli.engine.lockstep)
        self.carry: RolloutBatch | None = None
        # Asynchronous rollout: at most need - 1 groups are carried, so every carried group fits the next step (trained
        # at exactly one version older) and every step takes a fresh batch (the staleness bound relies on both).
        self.max_carry = max_carry
        self.replay = replay  # rollout.replay: earlier informative groups in place of this step's empty ones

    def filter_values(self, b: RolloutBatch) -> Tensor:
        """[N] the per-trajectory metric whose within-group variance decides (acc, or score)."""
        return b.acc if self.filter_metric == "acc" else b.scores

    def collect(
        self, sample: Callable[[], RolloutBatch], record_old_logp: Callable[[RolloutBatch], Tensor], step: int = 0,
    ) -> tuple[RolloutBatch, list[RolloutBatch], dict[str, float]]:
        """-> (the step's batch of `need` groups, the generation batches sampled for it (the pool), counts).

        `sample()` returns one generated, rewarded and shaped batch of fresh rows (`stale` all False).
        `record_old_logp(b)` returns [n, T] log-probs of `b` under the current (sampling) policy; it is
        called only for fresh rows about to be carried or admitted to the replay buffer. `step`: training steps
        done (the replay buffer's clock).
        """
        parts = [self.carry] if self.carry is not None else []
        carried = len(self.carry.groups) if self.carry is not None else 0
        self.carry = None
        pool: list[RolloutBatch] = []
        kept = carried
        while (held := self.agree(kept)) < self.need:
            if len(pool) == self.max_gen_batches:
                if self.train_on_partial and held > 0:
                    break
                raise DynamicSamplingExhausted(
                    f"dynamic sampling found only {held} informative groups of the {self.need} needed per rank "
                    + (f"(on the rank with fewest; this rank: {kept}) " if held != kept else "")
                    + f"after algo.max_gen_batches={self.max_gen_batches} generation batches of "
                    f"{len(pool[0].groups) if pool else 0} prompts: raise algo.max_gen_batches or "
                    "rollout.gen_prompts_per_step, or set algo.train_on_partial=true"
                )
            b = sample()
            pool.append(b)
            if self.dynamic:
                b = b.select_groups(informative_groups(self.filter_values(b), b.group_index))
            kept += len(b.groups)
            parts.append(b)
        take = min(held, self.need)
        batch = RolloutBatch.cat([p for p in parts if len(p)])
        groups = batch.groups
        dropped = 0
        if len(groups) > take or self.lockstep:  # lockstep: ranks without a surplus join the forward passes
            keep = groups[take:] if self.max_carry is None else groups[take : take + self.max_carry]
            dropped = len(groups) - take - len(keep)
            surplus = self.stale_copy(batch.select_groups(keep), record_old_logp)
            self.carry = surplus if len(surplus) else None
            batch = batch.select_groups(groups[:take])
        replayed = 0
        if self.replay is not None:  # the empty groups out, earlier informative ones in; then this step's offered
            informative = informative_groups(self.filter_values(batch), batch.group_index).tolist()
            empty = [g for g in batch.groups.tolist() if g not in set(informative)]
            fresh = batch
            batch, replayed = self.replay.replay(batch, step, empty)
            self.replay.admit(fresh, step, informative, record_old_logp, self.lockstep)
        generated = sum(len(p.groups) for p in pool)
        counts = {
            "dynamic_sampling/gen_batches": float(len(pool)),
            "dynamic_sampling/generated_groups": float(generated),
            "dynamic_sampling/kept_groups": float(kept - carried),
            "dynamic_sampling/carried": float(carried),
        } | ({"dynamic_sampling/dropped": float(dropped)} if self.dynamic and self.max_carry is not None else {}) | (
            {"replay/replayed": float(replayed), "replay/buffered": float(len(self.replay))} if self.replay is not None else {})
        return batch, pool, counts

    @staticmethod
    def stale_copy(b: RolloutBatch, record_old_logp: Callable[[RolloutBatch], Tensor]) -> RolloutBatch:
        """`b` marked stale, with old log-probs recorded for its fresh rows only: a row carried before
        keeps the log-probs of the policy that sampled it."""
        old = b.old_logp.clone() if b.old_logp is not None else torch.zeros_like(b.response_mask)
        fresh = (~b.stale).nonzero().squeeze(-1)  # [n_fresh]
        old[fresh] = record_old_logp(b.select(fresh))
        return b.replace(old_logp=old, stale=torch.ones(len(b), dtype=torch.bool))


def per_task(batch: RolloutBatch, tasks: Sequence[str]) -> dict[str, Tensor]:
    """acc/<task> and reward/<task> of a mix of tasks (data=reasoning_gym: each row's task is in its ground truth,
    rlcli.data.reasoning_gym.task_of): the acc and score of that task's rows. `tasks` comes from the config, so every
    rank has the same names whatever its rows (a task no rank drew this step is left out after the reduction)."""
    from rlcli.data.reasoning_gym import task_of

    if not tasks:
        return {}
    rows = [task_of(a) for a in batch.answers]
    out = {}
    for task in tasks:
        idx = torch.tensor([r == task for r in rows], dtype=torch.bool)  # [N]
        out[f"acc/{task}"], out[f"reward/{task}"] = batch.acc[idx], batch.scores[idx]
    return out


def sampling_metrics(batch: RolloutBatch, pool: list[RolloutBatch], per_trajectory: dict[str, list[Tensor]],
                     counts: dict[str, float], tasks: Sequence[str] = ()) -> dict[str, float]:
    """Reward, accuracy, length and dynamic-sampling metrics of a step over all ranks: means over the
    trained batch (per task too, given the run's `tasks`), `pool_mean`s over every trajectory generated, counts
    summed."""
    stats = global_stats({
        **per_task(batch, tasks),
        "reward": batch.scores, "acc": batch.acc, "response_length": batch.lengths.float(),
        "prompt_length/mean": batch.prompt_mask.sum(-1).float(),
        "response_length/clip_ratio": batch.truncated.float(),
        "reward/pool_mean": torch.cat([p.scores for p in pool] or [torch.zeros(0)]),
        "acc/pool_mean": torch.cat([p.acc for p in pool] or [torch.zeros(0)]),
        **batch.extras, **{k: torch.cat(v) for k, v in per_trajectory.items()},
    })
    keys = sorted(counts)
    total = dict(zip(keys, all_reduce(torch.tensor([counts[k] for k in keys], dtype=torch.float64)).tolist()))
    metrics = {k: v["mean"] for k, v in stats.items() if k not in ("reward", "acc", "response_length") and v["n"]}
    metrics.update({k: total[k] for k in keys if k.startswith(("reward/", "replay/"))})
    if "reward/rm" in stats:  # the reward model's raw spread: whitening (reward.rm.normalize) hides it from the reward
        metrics["reward/rm_std"] = stats["reward/rm"]["std"]
    return metrics | {
        "reward/mean": stats["reward"]["mean"], "reward/std": stats["reward"]["std"],
        "acc/mean": stats["acc"]["mean"],
        "response_length/mean": stats["response_length"]["mean"],
        "response_length/max": stats["response_length"]["max"],
        "dynamic_sampling/gen_batches": counts["dynamic_sampling/gen_batches"],
        "dynamic_sampling/kept_fraction": total["dynamic_sampling/kept_groups"]
        / max(total["dynamic_sampling/generated_groups"], 1.0),
        "dynamic_sampling/carried": total["dynamic_sampling/carried"],
    } | {k: total[k] for k in ("dynamic_sampling/dropped",) if k in total}
