"""Bytes per parameter of the model states (weights, gradients, optimizer states) by precision, and their share per
device at each ZeRO stage (Rajbhandari et al. 2020, arXiv:1910.02054) or offloaded to the host. Units: bytes; GIB for
the tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30


# DeepSpeed's defaults for the buffers we do not set (https://www.deepspeed.ai/docs/config-json/):
# zero_optimization.reduce_bucket_size (gradient bucket of stages 2 and 3), in elements.
REDUCE_BUCKET = 500_000_000


@dataclass(frozen=True)
class StateBytes:
    """Per-parameter bytes of model states under rlcli's DeepSpeed config (rlcli/engine ds_config)."""

    weight: int
    grad: int
    optim: int


def state_bytes(precision: str, zero_stage: int) -> StateBytes:
    """fp32: 4-byte weights (the master copy) and gradients, Adam m and v (8); ZeRO >= 1 also keeps an fp32 copy
    of its weight partition (12). bf16 at ZeRO >= 1: the paper's mixed precision, 2 + 2 + K=12 (fp32 master,
    m, v). bf16 at ZeRO-0 is rlcli's autocast over fp32 weights (rlcli.core.precision.mixed_precision): the states of
    fp32, 4 + 4 + 8, and model_states adds autocast's bf16 copy of the weights."""
    if precision == "fp32" or zero_stage == 0:
        return StateBytes(4, 4, 12 if zero_stage else 8)
    return StateBytes(2, 2, 12)


def compute_bytes(precision: str) -> int:
    """Bytes per element of the HF KV cache, an inference engine's weights and the logits: 2 under bf16 (at every
    ZeRO stage), 4 in fp32."""
    return 2 if precision == "bf16" else 4


def activation_element_bytes(hw: Any) -> int:
    """Bytes per element of activation_elements_per_token that the update keeps for backward: 2 under DeepSpeed's
    bf16 (ZeRO >= 1: the module itself is bf16), 4 in fp32, and 4 under autocast (bf16 at ZeRO-0,
    config.mixed_precision), which keeps fp32 tensors (the residual stream's RMSNorms, SDPA's log-sum-exp) beside a
    bf16 copy of each matmul's input. Measured with torch's saved-tensor hooks on one block (2026-11-26, seq 16):
    autocast keeps 0.81 of fp32's bytes at SmolLM2-135M's block shape and 0.67 at Qwen2.5-0.5B's, against the 0.5
    that 2 bytes would claim; the plan counts 4 (a bound: planned at 2, a SmolLM2 run the plan passed at 99% of
    RAM was killed for memory)."""
    from rlcli.core.precision import mixed_precision

    return 4 if mixed_precision(hw) else compute_bytes(hw.precision)


@dataclass
class ModelStates:
    weights: float
    grads: float
    optim: float
    host: float  # bytes moved to host memory by offload (per rank)


def model_states(psi: int, trainable: int, precision: str, stage: int, world: int, offload_optimizer: bool,
                 offload_params: bool, layer: int = 0, embed: int = 0) -> ModelStates:
    """Per-device bytes of weights (Ψ of them), gradients and optimizer states (`trainable` of them) at a ZeRO
    stage over `world` data-parallel ranks (ZeRO paper §5.1: P_os at 1, P_os+g at 2, P_os+g+p at 3).

    Beyond the paper: stages 2-3 hold one gradient bucket (DeepSpeed's reduce_bucket_size) besides their
    partition; stage 3 gathers the parameters of about two blocks (the one computing and the one prefetched,
    `layer` parameters each) or the embedding (`embed`); offload keeps the optimizer states (and at stages 2-3
    the gradient partition: ZeRO-Offload, arXiv:2101.06840) or the parameter partition in host memory."""
    b = state_bytes(precision, stage)
    weights = psi * b.weight
    if precision == "bf16" and stage == 0:  # autocast's bf16 copy of each weight, kept from forward to backward
        weights += psi * 2
    grads = trainable * b.grad
    optim = trainable * b.optim
    host = 0.0
    if stage >= 1:
        if offload_optimizer:
            host += optim / world
            optim = 0.0
        else:
            optim = optim / world
    if stage >= 2:
        bucket = min(trainable, REDUCE_BUCKET) * b.grad
        if offload_optimizer:
            host += grads / world
            grads = bucket
        else:
            grads = grads / world + bucket
    if stage == 3:
        gathered = max(2 * layer, embed) * b.weight
        if offload_params:
            host += weights / world
            weights = gathered
        else:
            weights = weights / world + gathered
    return ModelStates(weights, grads, optim, host)
