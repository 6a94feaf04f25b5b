"""A model's shape (`Arch`) read from its config before any weights load, and the parameter counts the plan charges:
the policy, LoRA adapters, the critic, a reward model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Arch:
    """A decoder-only Llama/Qwen2-style transformer, as far as memory is concerned."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    source: str = ""

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def arch_of(model_cfg: Any) -> Arch:
    """The architecture of `model_cfg`'s policy, read without loading weights: a local model.path's config.json,
    else model.arch (hub ids; presets ship it), else model.tiny (model.path null)."""
    if model_cfg.path is None and model_cfg.gguf_file is None:
        from rlcli.models.config import CHARS, SPECIAL_TOKENS

        t = model_cfg.tiny
        return Arch(t.hidden_size, t.num_layers, t.intermediate_size, len(SPECIAL_TOKENS) + len(CHARS), t.num_heads,
                    t.num_heads, t.hidden_size // t.num_heads, t.tie_word_embeddings, False, "model.tiny")
    config_file = os.path.join(model_cfg.path, "config.json") if model_cfg.path else ""
    if os.path.isfile(config_file):
        with open(config_file) as f:
            c = json.load(f)
        c = c.get("text_config", c)  # multimodal wrappers nest the language model's config
        heads = c["num_attention_heads"]
        return Arch(c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"], heads,
                    c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads,
                    bool(c.get("tie_word_embeddings", False)),
                    c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False)), config_file)
    from rlcli.models.config import HUB_ID, download_hint

    a = model_cfg.arch
    required = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads")
    missing = [k for k in required if a[k] is None]
    if missing:
        raise SystemExit(
            f"model.path={model_cfg.path} is not a local directory with a config.json, and model.arch lacks "
            f"{', '.join('model.arch.' + k for k in missing)}: copy them from the model's config.json (e.g. "
            "model.arch.hidden_size=896 ...), or point model.path at a local copy of the model"
            + (f" (rlcli downloads nothing: {download_hint(model_cfg.path)})" if HUB_ID.fullmatch(model_cfg.path or "")
               else "")
        )
    heads = a.num_attention_heads
    return Arch(a.hidden_size, a.num_hidden_layers, a.intermediate_size, a.vocab_size, heads,
                a.num_key_value_heads or heads, a.head_dim or a.hidden_size // heads, a.tie_word_embeddings,
                a.attention_bias, "model.arch")


def layer_params(arch: Arch) -> int:
    """One block: q, k, v (with biases if any), o, SwiGLU gate/up/down, two RMSNorm weights."""
    h, q, kv, i = arch.hidden, arch.heads * arch.head_dim, arch.kv_width, arch.intermediate
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if arch.qkv_bias else 0)
    return attn + 3 * h * i + 2 * h


def param_count(arch: Arch) -> int:
    """Ψ of the causal LM: embedding, blocks, final norm, and the output projection unless tied."""
    embed = arch.vocab * arch.hidden
    return embed + arch.layers * layer_params(arch) + arch.hidden + (0 if arch.tied else embed)


def lora_param_count(arch: Arch, lora: Any) -> int:
    """Adapter parameters: r x (d_in + d_out) for each targeted projection of each block (Hu et al. 2021)."""
    h, q, kv, i = arch.hidden, arch.heads * arch.head_dim, arch.kv_width, arch.intermediate
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    per_layer = sum(lora.r * sum(shapes[m]) for m in lora.target_modules if m in shapes)
    return arch.layers * per_layer


def rm_param_count(arch: Any) -> int:
    """Ψ of the reward model: the causal LM's minus an untied output projection, plus the bias-free score head."""
    return param_count(arch) - (0 if arch.tied else arch.vocab * arch.hidden) + arch.hidden


def critic_param_count(arch: Arch, critic_cfg: Any) -> int:
    """The critic: the policy's backbone (no output projection; a tied one is the embedding, kept) plus its head,
    a linear map from the last hidden state to K outputs (rlcli/models/value.py)."""
    k = {"scalar": 1, "multi": critic_cfg.num_heads, "distributional": critic_cfg.num_bins}[critic_cfg.head]
    backbone = param_count(arch) - (0 if arch.tied else arch.vocab * arch.hidden)
    return backbone + arch.hidden * k + k
