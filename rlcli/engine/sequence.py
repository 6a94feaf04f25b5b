"""Sequence parallelism (hw.sp_size = N): each sequence of scoring and the update split over N ranks along its length.

DeepSpeed's Ulysses attention for Hugging Face models (`deepspeed.runtime.sequence_parallel.ulysses_sp`, ALST: Bekman
et al. 2025, arXiv:2506.13996) runs inside the model: each rank holds a contiguous slice of every sequence's positions,
and each attention layer exchanges (all-to-all) its slice of all heads for all positions of N-th of the heads, attends
causally, and exchanges back. Everything else in a layer is per position, so a rank's activations are those of L/N
positions. The ranks 0..N-1, N..2N-1, ... form the sequence-parallel groups; each group is one data-parallel member.

What the learner does with it (docs/sequence_parallel.md):

- `union`: the ranks of a group pool their rows (rollout is unchanged: each rank generated its own), so that every
  rank of the group runs the same micro-batches, each rank its slice of the positions.
- `sharding()`: while it is open (scoring, and each micro-batch's forward and backward, where activation
  checkpointing recomputes the forward), the model's attention implementation is DeepSpeed's Ulysses; outside it (HF
  generation, evaluation) the model's own.
- `gather`: per-position outputs (log-probs, entropies, value-head outputs: a few numbers per position, never the
  logits) are gathered from the group along the sequence, so every loss reduction over a sequence or a batch (token
  means, GSPO's sequence ratio, the value loss) sees whole sequences. Its backward hands each rank the gradient of its
  own positions: every rank of a group computes the same loss from the same gathered tensors, so the parameter
  gradients summed over the group's ranks (the engine's reduction) are the gradient of that loss once.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlcli.core.batch import RolloutBatch
from rlcli.core.schema import ConfigError
from rlcli.core.topology import splits_heads

COVERED = ("llama", "qwen2", "qwen3", "mistral")
"""Model types whose attention layers call transformers' attention interface with position ids and a plain causal
mask: what DeepSpeed's Ulysses adapter reproduces exactly. Sliding-window attention is not covered (the adapter
attends causally over the whole sequence)."""
ATTENTIONS = ("sdpa", "flash_attention_2", "flash_attention_3")
"""Attention implementations the adapter wraps (eager needs a 4D mask, which the adapter drops)."""

_ACTIVE: SequenceParallel | None = None
"""The group whose `sharding()` is open in this process: the wrapped attention runs Ulysses only then."""


class _GatherPositions(torch.autograd.Function):
    """[n, l, ...] on each rank of the group -> [n, N·l, ...] on every rank, rank order; backward: each rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, rank: int, size: int) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.lo, ctx.hi = rank * x.shape[1], (rank + 1) * x.shape[1]
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return grad[:, ctx.lo : ctx.hi].contiguous(), None, None, None


class SequenceParallel:
    """This rank's sequence-parallel group (consecutive ranks), made collectively by every rank."""

    def __init__(self, size: int, timeout_s: int):
        world, me = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ConfigError(f"hw.sp_size={size} must divide the {world} training ranks")
        self.size = size
        self.group: Any = None
        for start in range(0, world, size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(start, start + size)), timeout=timedelta(seconds=timeout_s))
            if start <= me < start + size:
                self.group = group
        self.rank = dist.get_rank(self.group)
        """This rank's place in its group: which slice of the positions it holds."""
        self.dp_rank = me // size
        """Its group's place among the data-parallel members."""
        self._ulysses: dict[tuple[int, ...], Any] = {}

    # ------------------------------------------------------------------ models
    def check(self, model: torch.nn.Module, role: str) -> None:
        """A model the adapter covers, with heads that split over the group; else a one-line ConfigError naming it."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        kind, attention = getattr(config, "model_type", type(model).__name__), getattr(config, "_attn_implementation", None)
        if kind not in COVERED or getattr(config, "use_sliding_window", False) or (
                kind == "mistral" and getattr(config, "sliding_window", None)):
            raise ConfigError(f"hw.sp_size={self.size}: the {role}'s model type {kind!r} is not covered by rlcli's "
                              f"Ulysses attention ({', '.join(COVERED)}, without sliding windows): set hw.sp_size=1")
        if attention not in ATTENTIONS:
            raise ConfigError(f"hw.sp_size={self.size}: the {role} runs attention {attention!r}; Ulysses wraps "
                              f"{', '.join(ATTENTIONS)}: set model.attn_implementation=sdpa")
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if not splits_heads(heads, kv, self.size):
            raise ConfigError(f"hw.sp_size={self.size} must divide the {role}'s {heads} attention heads, and its {kv} "
                              "key-value heads must divide it or be divisible by it: each rank attends with a share "
                              "of the heads")
        _wrap(attention)

    def ulysses(self, module: torch.nn.Module, attention: Any, batch: int) -> Any:
        """DeepSpeed's UlyssesSPAttentionHF for `module`'s layer shape and this micro-batch's rows (built once each)."""
        c = module.config
        heads, kv = c.num_attention_heads, c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        key = (id(attention), batch, heads, kv, head_dim, c.num_hidden_layers)
        if key not in self._ulysses:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            self._ulysses[key] = UlyssesSPAttentionHF(
                attn=attention, batch_size=batch, attn_head_count=heads, attn_head_size=head_dim, kv_head_count=kv,
                num_hidden_layers=c.num_hidden_layers, process_group=self.group, seq_length_is_variable=True)
        return self._ulysses[key]

    @contextmanager
    def sharding(self) -> Iterator[None]:
        """Ulysses attention for the block (forward and backward of sliced sequences)."""
        global _ACTIVE
        before, _ACTIVE = _ACTIVE, self
        try:
            yield
        finally:
            _ACTIVE = before

    # ------------------------------------------------------------------ tensors and rows
    def gather(self, x: Tensor) -> Tensor:
        """[n, l, ...] per-position outputs of this rank's slice -> [n, N·l, ...] of whole sequences (differentiable)."""
        return _GatherPositions.apply(x, self.group, self.rank, self.size)

    def union(self, batch: RolloutBatch) -> tuple[RolloutBatch, slice]:
        """The rows of every rank of the group, in rank order, and where this rank's own rows sit among them."""
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, batch, group=self.group)
        start = sum(len(p) for p in parts[: self.rank])
        return RolloutBatch.cat(parts), slice(start, start + len(batch))


def sharding_active() -> bool:
    """Whether a group's `sharding()` is open in this process (attention runs through Ulysses)."""
    return _ACTIVE is not None


def _wrap(attention: str) -> None:
    """Route transformers' `attention` implementation through Ulysses while a group's `sharding()` is open (once per
    process). The mask a model builds for its slice is dropped: the slice's rows are laid out without left padding
    (rlcli.models.policy.Slices), so causal attention over the gathered positions is the whole mask."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS[attention]
    if getattr(original, "rlcli_sequence_parallel", False):
        return

    @functools.wraps(original)  # carries the marks of the wrappers below it (rlcli.models.policy's fp32 attention)
    def routed(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Any, *args: Any,
               **kwargs: Any) -> Any:
        if _ACTIVE is None:
            return original(module, query, key, value, mask, *args, **kwargs)
        return _ACTIVE.ulysses(module, original, query.shape[0])(module, query, key, value, None, *args, **kwargs)

    routed.rlcli_sequence_parallel = True  # type: ignore[attr-defined]
    ALL_ATTENTION_FUNCTIONS[attention] = routed


def sequence_parallel(hw: Any) -> SequenceParallel | None:
    """The run's groups (hw.sp_size > 1), made by every rank at the same point; None otherwise."""
    return SequenceParallel(hw.sp_size, hw.collective_timeout_s) if hw.sp_size > 1 else None
