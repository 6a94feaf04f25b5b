"""Replay of informative groups in place of empty ones (rollout.replay; docs/algorithms.md, "Replay").

A group whose responses all earn the same accuracy (all right or all wrong) has zero group-relative advantage: it
teaches nothing. DAPO samples again until the step is full of informative groups (algo.dynamic_sampling); TRL's
GRPOWithReplayBuffer instead puts in its place a group seen at an earlier step that did teach. Here:

- **Admission**: after a step's batch is formed, its fresh informative groups are candidates; the buffer keeps the
  `size` groups of largest within-group standard deviation of the score (ties: the newer), and only the groups it
  admits have their old log-probs recorded (one forward pass over them, under the policy that sampled them: this
  step's, before its update).
- **Replay**: each empty group of the batch is replaced by the buffered group of largest standard deviation, which
  leaves the buffer (a group is replayed at most once). A group admitted at step s is replayed at step s + 1 at the
  earliest, and never after step s + max_age: older groups leave the buffer unreplayed.
- **Off-policy correction**: a replayed group's rows are stale, with the log-probs recorded at admission as their old
  log-probs, so the PPO ratio of its tokens is π_now / π_sampler, exactly as for DAPO's carried groups.

The buffer is loop state: a checkpoint saves it, a resumed run replays what the straight run would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlcli.core.batch import RolloutBatch


def group_std(values: Tensor, group_index: Tensor) -> dict[int, float]:
    """{group id: the population standard deviation of `values` [N] within the group}."""
    out = {}
    for g in RolloutBatch.first_appearance(group_index).tolist():
        v = values[group_index == g].to(torch.float64)
        out[g] = float(v.std(unbiased=False))
    return out


class ReplayBuffer:
    """At most `size` informative groups of earlier steps (module doc), their rows stale with recorded old log-probs."""

    def __init__(self, size: int, max_age: int):
        self.size, self.max_age = size, max_age
        self.groups: list[tuple[int, float, RolloutBatch]] = []  # (step admitted, score std, the group's rows)

    def __len__(self) -> int:
        return len(self.groups)

    def replay(self, batch: RolloutBatch, step: int, empty: list[int]) -> tuple[RolloutBatch, int]:
        """`batch` of step `step` with its `empty` groups (ids) replaced, in order, by buffered groups of largest std;
        groups older than max_age dropped first. -> (the batch, groups replayed)"""
        self.groups = sorted((g for g in self.groups if step - g[0] <= self.max_age), key=lambda g: (-g[1], -g[0]))
        k = min(len(empty), len(self.groups))
        taken, self.groups = self.groups[:k], self.groups[k:]
        if k:
            out = set(empty[:k])
            keep = [g for g in RolloutBatch.first_appearance(batch.group_index).tolist() if g not in out]
            batch = RolloutBatch.cat([batch.select_groups(torch.tensor(keep, dtype=torch.long)),
                                      *(rows for _, _, rows in taken)])
        return batch, k

    def admit(self, batch: RolloutBatch, step: int, informative: list[int],
              record_old_logp: Callable[[RolloutBatch], Tensor], lockstep: bool = False) -> None:
        """Offer `batch`'s fresh `informative` groups: the buffer keeps the `size` of largest score std (ties: the
        newer); the old log-probs of those it takes are recorded now. `lockstep`: the recording pass runs even with
        nothing to record (ZeRO-3 over ranks: a forward pass is a collective every rank joins)."""
        stale = batch.stale if batch.stale is not None else torch.zeros(len(batch), dtype=torch.bool)
        fresh = set(batch.group_index[~stale].tolist())
        std = group_std(batch.scores, batch.group_index)
        offers = [(step, std[g], g) for g in informative if g in fresh and std[g] > 0]
        ranked = sorted([(s, v, None, i) for i, (s, v, _) in enumerate(self.groups)]
                        + [(s, v, g, None) for s, v, g in offers], key=lambda x: (-x[1], -x[0]))[: self.size]
        admitted = [(s, v, g) for s, v, g, _ in ranked if g is not None]
        kept = [self.groups[i] for _, _, _, i in ranked if i is not None]
        if admitted:
            rows = batch.select_groups(torch.tensor([g for _, _, g in admitted], dtype=torch.long))
            rows = rows.replace(old_logp=record_old_logp(rows), stale=torch.ones(len(rows), dtype=torch.bool))
            kept += [(s, v, rows.select_groups(torch.tensor([g], dtype=torch.long))) for s, v, g in admitted]
        elif lockstep:
            record_old_logp(batch.select(torch.zeros(0, dtype=torch.long)))  # joins the pass with no rows of its own
        self.groups = kept

    def state_dict(self) -> dict[str, Any]:
        return {"groups": list(self.groups)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = list(state["groups"])
