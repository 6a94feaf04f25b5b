"""The rollout batch: the tensors of one step with named shapes, and group helpers.

Letters as in docs/design.md#units: N trajectories (P prompts x G responses), Tp padded prompt length
(left-padded), T padded response length (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor


def _pad_to(x: Tensor, length: int, value: float, left: bool) -> Tensor:
    extra = length - x.shape[1]
    if extra <= 0:
        return x
    return F.pad(x, (extra, 0) if left else (0, extra), value=value)


@dataclass
class RolloutBatch:
    prompt_ids: Tensor  # [N, Tp] left-padded
    prompt_mask: Tensor  # [N, Tp] 1 on prompt tokens
    response_ids: Tensor  # [N, T] right-padded
    response_mask: Tensor  # [N, T] 1 on generated tokens incl. EOS: the tokens every loss trains (docs/design.md#masks)
    truncated: Tensor  # [N] bool: hit max_new_tokens without EOS (multi-turn: also no room left for an observation)
    group_index: Tensor  # [N] int: responses of one prompt share an index
    answers: list[str]  # [N] ground truth per trajectory
    texts: list[str]  # [N] decoded responses
    # Filled by later stages.
    scores: Tensor | None = None  # [N] shaped outcome reward
    acc: Tensor | None = None  # [N] 1 if verified correct
    loss_mask: Tensor | None = None  # [N, T] response_mask minus overlong-filtered rows
    old_logp: Tensor | None = None  # [N, T] the trainer's log-probs of the sampling policy (temperature-scaled)
    rollout_logp: Tensor | None = None  # [N, T] the sampler's own log-probs of its tokens (rollout correction)
    ref_logp: Tensor | None = None  # [N, T] reference policy log-probs (only with KL)
    teacher_logp: Tensor | None = None  # [N, T] the distillation teacher's log-probs (only with distill.teacher)
    values: Tensor | None = None  # [N, T] critic values at sampling time (value-clip centre)
    adv_values: Tensor | None = None  # [N, T] values GAE uses: V_aug with the seed option, else `values`
    advantages: Tensor | None = None  # [N, T]
    returns: Tensor | None = None  # [N, T]
    stale: Tensor | None = None  # [N] bool: carried over from an earlier step (dynamic sampling)
    version: Tensor | None = None  # [N] long: the policy version (training steps done) that generated the row
    extras: dict[str, Tensor] = field(default_factory=dict)  # per-trajectory [N] reward parts etc.
    # [N, T] 1 on every real response token: the generated ones and, in a multi-turn row, the observations
    # between turns (tool output, template turns; rlcli.envs), which the model reads but no loss trains.
    # What the forward pass attends to. None on construction = response_mask (a single-turn row).
    token_mask: Tensor | None = None

    def __post_init__(self) -> None:
        if self.token_mask is None:
            self.token_mask = self.response_mask

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def lengths(self) -> Tensor:  # [N] generated tokens (observation tokens of a multi-turn row not counted)
        return self.response_mask.sum(-1).long()

    @property
    def groups(self) -> Tensor:  # [P] unique group ids in order of first appearance
        return self.first_appearance(self.group_index)

    @staticmethod
    def first_appearance(group_index: Tensor) -> Tensor:
        """[P] the distinct values of `group_index` [N] in order of first appearance."""
        return torch.tensor(list(dict.fromkeys(group_index.tolist())), dtype=torch.long)

    def replace(self, **changes: object) -> RolloutBatch:
        """A copy with some fields replaced (the stages return new tensors; batches are not edited)."""
        return replace(self, **changes)

    def select(self, idx: Tensor) -> RolloutBatch:
        """Rows `idx` (a [M] long tensor); tensors of every field are indexed alike."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                out[f.name] = v[idx]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in idx.tolist()]
            elif isinstance(v, dict):
                out[f.name] = {k: t[idx] for k, t in v.items()}
            else:
                out[f.name] = v
        return replace(self, **out)

    def trimmed(self) -> RolloutBatch:
        """The same rows without the columns that are padding in every row (leading prompt columns,
        trailing response columns): [n, Tp] -> [n, Tp'], [n, T] -> [n, T']. Position ids count real
        tokens only (rlcli.models.joint_inputs), so no output on a real token changes."""
        tp = max(int(self.prompt_mask.sum(-1).max()), 1) if len(self) else 1
        t = max(int(self.token_mask.sum(-1).max()), 1) if len(self) else 1
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, v in out.items():
            if isinstance(v, Tensor) and v.dim() == 2:
                out[name] = v[:, -tp:] if name.startswith("prompt") else v[:, :t]
        return replace(self, **out)

    def select_groups(self, group_ids: Tensor) -> RolloutBatch:
        keep = torch.isin(self.group_index, group_ids)
        return self.select(keep.nonzero().squeeze(-1))

    @staticmethod
    def cat(parts: list[RolloutBatch]) -> RolloutBatch:
        """Concatenate batches with different Tp/T: prompts re-padded left, responses right."""
        if len(parts) == 1:
            return parts[0]
        tp = max(p.prompt_ids.shape[1] for p in parts)
        t = max(p.response_ids.shape[1] for p in parts)
        out = {}
        for f in fields(RolloutBatch):
            vals = [getattr(p, f.name) for p in parts]
            if all(v is None for v in vals):
                out[f.name] = None
                continue
            if any(v is None for v in vals):  # e.g. old_logp on carried rows only: zeros elsewhere
                like = next(v for v in vals if v is not None)
                vals = [
                    v if v is not None
                    else like.new_zeros((len(p), p.response_ids.shape[1]) if like.dim() == 2 else (len(p),))
                    for v, p in zip(vals, parts)
                ]
            if isinstance(vals[0], list):
                out[f.name] = [x for v in vals for x in v]
            elif isinstance(vals[0], dict):
                out[f.name] = {k: torch.cat([v[k] for v in vals]) for k in vals[0]}
            elif vals[0].dim() == 2:
                left = f.name.startswith("prompt")
                out[f.name] = torch.cat([_pad_to(v, tp if left else t, 0, left) for v in vals])
            else:
                out[f.name] = torch.cat(vals)
        return RolloutBatch(**out)
