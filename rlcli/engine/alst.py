"""The two memory savings of Arctic Long Sequence Training beside Ulysses (Bekman et al. 2025, arXiv:2506.13996,
§3.2-3.3), for the trained models (the policy and the critic): what a long sequence keeps per position.

- `tile_mlps` (hw.tiled_mlp): every decoder layer's MLP runs over tiles of the positions through DeepSpeed's
  `TiledMLP` (`deepspeed.runtime.sequence_parallel.ulysses_sp`): its forward keeps only its input, and its backward
  recomputes the MLP one tile at a time, so the [positions, intermediate] tensors alive at once are one tile's.
  Per position the MLP is the same function, so the outputs and gradients are those of the whole MLP up to
  rounding. Only where autograd records (the update); scoring and generation keep the model's own MLP.
- `offload_checkpoints` (hw.offload_checkpoints, with model.gradient_checkpointing): each checkpointed decoder
  layer's input, the one tensor per position and layer that gradient checkpointing keeps, waits in host memory
  (pinned on a GPU) instead of on the device until the backward recomputes the layer.

Both recompute in a nested backward (`torch.autograd.backward` inside the outer one), which accumulates the
parameters' gradients directly: DeepSpeed's ZeRO-1/2 reduce a parameter's gradient once it is marked ready
(`ds_grad_is_ready`, set by TiledMLP on its last tile), ZeRO-3 fetches a layer's parameters for each recompute.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import Tensor

from rlcli.core.schema import ConfigError


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding a self-attention and an MLP (a transformer block), in order; for a peft or value-head
    wrapper the blocks of the model inside."""
    return [m for m in model.modules() if isinstance(getattr(m, "mlp", None), torch.nn.Module)
            and hasattr(m, "self_attn")]


def refuse_dropout(model: torch.nn.Module, role: str, knob: str) -> None:
    """The recomputes here do not replay the random state: a model that drops out in training mode is refused."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rates = {k: v for k, v in config.to_dict().items() if "dropout" in k and isinstance(v, float) and v > 0}
    if rates:
        raise ConfigError(f"{knob}: the {role}'s config drops out in training ({rates}), and the backward's recompute "
                          f"would draw other masks than the forward: set {knob}=false")


def tile_mlps(model: torch.nn.Module, role: str, positions: int | None, agree: Any = None) -> None:
    """hw.tiled_mlp: every block's MLP computed over tiles of `positions` positions (None: the model's hidden size,
    ALST's choice) while autograd records. `agree(k)` -> the largest k over the ranks, where every forward is a
    collective (ZeRO-3 over ranks: each tile fetches the MLP's parameters, so every rank runs as many tiles): asked
    once per forward of the model (every block sees the same positions), and the recompute of a checkpointed block
    reuses the answer."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = decoder_layers(model)
    if any(getattr(config, key, None) for key in MOE_KEYS) or any(hasattr(layer.mlp, "experts") for layer in layers):
        raise ConfigError(f"hw.tiled_mlp: the {role}'s model type {config.model_type!r} routes tokens to experts "
                          "(its MLP returns the router's outputs too), which rlcli does not tile: set "
                          "hw.tiled_mlp=false")
    refuse_dropout(model, role, "hw.tiled_mlp")
    if not layers:
        raise ConfigError(f"hw.tiled_mlp: the {role} ({type(model).__name__}) has no blocks with an `mlp` module "
                          "to tile: set hw.tiled_mlp=false")
    tile = positions or config.hidden_size
    agreed: dict[str, int] = {}  # this forward's agreed tile count, forgotten as the next forward enters the blocks'
    if agree is not None:  # parent (the decoder: the causal LM's forward and rlcli's chunked log-probs both run it)
        trunk = next(m for m in model.modules() if any(
            isinstance(c, torch.nn.ModuleList) and any(b is layers[0] for b in c) for c in m.children()))
        trunk.register_forward_pre_hook(lambda *_: agreed.clear())
    for layer in layers:
        layer.mlp.forward = partial(_tiled_forward, layer.mlp, type(layer.mlp).forward, tile, agree, agreed)


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config keys of the mixture-of-experts models (Qwen-MoE, Mixtral, DeepSeek-V2/V3, ...) with their expert count."""


def _tiled_forward(mlp: torch.nn.Module, plain: Any, tile: int, agree: Any, agreed: dict[str, int], x: Tensor) -> Tensor:
    """`plain(mlp, x)` over tiles of `tile` positions of x [..., positions, hidden] (TiledMLP), under autograd."""
    if not torch.is_grad_enabled():
        return plain(mlp, x)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    tiles = max(1, math.ceil(x.shape[-2] / tile))
    if agree is not None:
        if "tiles" not in agreed:
            agreed["tiles"] = agree(tiles)
        tiles = agreed["tiles"]
    # every parameter of the MLP (LoRA's adapters too): DeepSpeed reduces their gradients after the last tile only
    return TiledMLP.apply(plain, mlp, x, tiles, list(mlp.parameters()))


def offload_checkpoints(model: torch.nn.Module, role: str) -> None:
    """hw.offload_checkpoints: each gradient-checkpointed block keeps its input in host memory until its recompute."""
    refuse_dropout(model, role, "hw.offload_checkpoints")
    layers = [m for m in decoder_layers(model) if getattr(m, "gradient_checkpointing", False)]
    if not layers:
        raise ConfigError(f"hw.offload_checkpoints: the {role} has no gradient-checkpointed blocks: set "
                          "model.gradient_checkpointing=true")
    for layer in layers:
        layer._gradient_checkpointing_func = _offloaded


def _offloaded(run: Any, hidden: Tensor, *rest: Any) -> Any:
    """HF's `_gradient_checkpointing_func(run, hidden_states, ...)`, with the input kept on the host. (Under LoRA peft
    makes the embeddings' output require a gradient for checkpointing, so every block's input does.)"""
    if not torch.is_grad_enabled():
        return run(hidden, *rest)
    return _OffloadedCheckpoint.apply(run, hidden, *rest)


class _OffloadedCheckpoint(torch.autograd.Function):
    """forward: the block without autograd, its input copied to the host; backward: the input brought back, the block
    recomputed with autograd and differentiated (its parameters' gradients accumulate there)."""

    @staticmethod
    def forward(ctx: Any, run: Any, hidden: Tensor, *rest: Any) -> Any:
        ctx.run, ctx.rest, ctx.device = run, rest, hidden.device
        ctx.host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=hidden.is_cuda).copy_(hidden.detach())
        with torch.no_grad():
            return run(hidden, *ctx.rest)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        hidden = ctx.host.to(ctx.device, non_blocking=True).requires_grad_(ctx.needs_input_grad[1])
        ctx.host = None
        with torch.enable_grad():
            out = ctx.run(hidden, *ctx.rest)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and isinstance(o, Tensor) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, hidden.grad, *[None] * len(ctx.rest))
