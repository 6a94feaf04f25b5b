"""Schemas of the model groups (the embedded tiny model, its warm start, the critic) and the tiny
vocabulary, importable without torch: composing and validating a config never imports torch (rlcli.config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Printable ASCII plus newline: enough for math prompts, worked steps and `\boxed{}`.
CHARS = tuple(chr(i) for i in range(32, 127)) + ("\n",)

HEADS = ("scalar", "multi", "distributional")
"""Value heads (rlcli/models/value.py)."""


@dataclass
class TinyModelConfig:
    """Shape of the embedded Llama (defaults give 4.2M parameters, docs/design.md#tiny-model)."""

    hidden_size: int = 256
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block (head dim = hidden_size / num_heads)."""
    intermediate_size: int = 1024
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = 512
    """Longest prompt + response the model is built for, in tokens (= characters)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the LM head (saves vocab*hidden parameters)."""
    attn_implementation: str = "sdpa"
    """'sdpa' or 'eager' (no clear speed difference measured on 2 loaded CPU threads)."""


@dataclass
class WarmStartConfig:
    """Supervised warm-start of the tiny model before RL (cached; see rlcli/sft.py)."""

    enabled: bool = True
    """Train before RL; if false the cached 'checkpoint' is the random initialisation."""
    steps: int = 200
    """Optimizer steps of supervised training (calibrated: 47.5% held-out greedy acc by default, module doc)."""
    batch_size: int = 32
    """Examples per optimizer step; every example is new (steps * batch_size problems)."""
    lr: float = 1e-3
    """Peak AdamW learning rate (2e-3 learned slower and 3e-3 stalled: module docstring)."""
    warmup: int = 10
    """Linear warmup steps, then cosine decay to 0."""
    seed: int = 0
    """Seed of model init, training order and the sampled-accuracy probe."""
    carry_slip: float = 0.6
    """Chance that a demonstration forgets each carry it should take (imperfect SFT data; module doc)."""
    eval_size: int = 200
    """Held-out problems used to measure greedy and sampled accuracy after training."""
    cache_dir: str | None = None
    """Cache root; None means $RLCLI_CACHE, else ~/.cache/rlcli. Not part of the cache key."""


@dataclass
class CriticConfig:
    """The value model: where it starts, its head, its optimiser, VAPO pretraining (docs/algorithms.md)."""

    path: str | None = None
    """null = initialise the backbone from the policy's weights; else a saved rlcli critic (a folder with value_head.json: head loaded too) or any HF model folder (backbone only, fresh head; e.g. a reward model, as in VAPO)."""
    lr: float = 1e-4
    """Critic AdamW learning rate (tiny-model scale; the VAPO paper's 2e-6 belongs in model presets)."""
    warmup_steps: int = 0
    """Linear LR warmup of the critic, in critic optimizer steps."""
    head: str = "scalar"
    """Value head: scalar | multi (mean of num_heads heads) | distributional (categorical over num_bins atoms); multi and distributional are rlcli options, not from a paper."""
    num_heads: int = 4
    """multi: K heads, each trained on the same target with its own clipped loss; V = their mean (uniform weights, no learned gates; see rlcli/models/value.py)."""
    num_bins: int = 51
    """distributional: atoms of the fixed support linspace(v_min, v_max)."""
    v_min: float = -1.0
    """distributional: lowest atom; returns below it are clamped (set the support to cover reward range incl. penalties)."""
    v_max: float = 1.0
    """distributional: highest atom; returns above it are clamped."""
    pretrain_steps: int = 50
    """VAPO value pretraining K, when algo.value_pretrain is on: critic-only steps on rollouts of the frozen initial policy with Monte-Carlo returns (λ = 1) before any actor update (VAPO §5.1: "value network warmup for 50 steps")."""
    pretrain_ev_threshold: float | None = None
    """rlcli option: stop value pretraining early once the explained variance of a fresh batch reaches this (e.g. 0.8); null = run all pretrain_steps."""
    aug_w0: float | None = None
    """rlcli option (not from a paper), value augmentation: advantages use V_aug = w(t)·V_pretrained + (1 - w(t))·V_critic, w(t) = w0·exp(-κ t/T), V_pretrained frozen after pretraining; null = off."""
    aug_kappa: float = 5.0
    """κ: decay rate of the augmentation weight w(t) = w0·exp(-κ t/T)."""


def validate_critic(cfg: Any) -> None:
    """Range checks of a CriticConfig (or the composed `critic` node); raise ValueError naming the key."""

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ValueError(f"critic.{key}={getattr(cfg, key)!r} is invalid: must be {what}")

    if cfg.head not in HEADS:
        raise ValueError(f"critic.head={cfg.head!r} is not a known value head; valid names: {', '.join(HEADS)}")
    need(cfg.lr > 0, "lr", "> 0")
    need(cfg.warmup_steps >= 0, "warmup_steps", ">= 0")
    need(cfg.num_heads >= 1, "num_heads", ">= 1 (2 or more for an ensemble)")
    need(cfg.num_bins >= 2, "num_bins", ">= 2")
    if not cfg.v_min < cfg.v_max:
        raise ValueError(f"critic.v_min={cfg.v_min} must be < critic.v_max={cfg.v_max}")
    need(cfg.pretrain_steps >= 1, "pretrain_steps", ">= 1 (algo.value_pretrain=false turns value pretraining off)")
    need(
        cfg.pretrain_ev_threshold is None or cfg.pretrain_ev_threshold <= 1.0,
        "pretrain_ev_threshold", "<= 1 (explained variance never exceeds 1) or null",
    )
    need(cfg.aug_w0 is None or 0.0 <= cfg.aug_w0 <= 1.0, "aug_w0", "in [0, 1] or null (off)")
    need(cfg.aug_kappa >= 0.0, "aug_kappa", ">= 0")
