"""The run's precision, derived from its config (root config `cfg`, or its `hw` group) and answered here only: whether
bf16 is native on the device, what hw.precision=auto becomes, which models load in float32 and which dtype the
models that only infer use. Torch-free (torch only to ask CUDA); every module that asks imports it from here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


def native_bf16(device: str) -> str | None:
    """What computes bf16 natively on `device` (cpu: AMX-BF16 or AVX512-BF16 from /proc/cpuinfo's flags; cuda:
    torch's is_bf16_supported), or None where bf16 would be emulated (slower than fp32)."""
    if device == "cuda":
        import torch

        return "CUDA bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux
        return None
    return next((name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in flags), None)

def resolve_precision(hw: Any) -> None:
    """hw.precision=auto made bf16 or fp32 for this machine (native_bf16), in place: the one rewrite validation
    makes, so the frozen config and every worker read a decided precision."""
    if hw.precision == "auto":
        hw.precision = "bf16" if native_bf16(hw.device) else "fp32"

def mixed_precision(hw: Any) -> bool:
    """Whether `hw` trains in bf16 mixed precision by autocast: fp32 weights (the master copy) and fp32 optimizer
    states, every matmul in bf16 (rlcli.models.autocast). That is hw.precision=bf16 at ZeRO-0, where DeepSpeed's
    own bf16 path (DDP_BFLOAT16) would step the optimizer on the bf16 weights, with no fp32 master; at ZeRO >= 1
    DeepSpeed holds bf16 weights and an fp32 master partition itself."""
    return hw.precision == "bf16" and hw.zero_stage == 0


def trained_model(cfg: Any) -> Any:
    """cfg.model as the trained models (policy, critic, reward model under `rlcli rm`) load it: in float32 under
    mixed_precision (the weights are the fp32 master), else as it is (DeepSpeed casts to bf16 at ZeRO >= 1)."""
    return OmegaConf.merge(cfg.model, {"dtype": "float32"}) if mixed_precision(cfg.hw) else cfg.model

def inference_dtype(cfg: Any) -> str:
    """The dtype of the models that only infer, in the trainer's precision (root config `cfg`): bfloat16 under
    hw.precision=bf16, else model.dtype. The vLLM sampler, reward.rm's model and the memory plan read it here."""
    return "bfloat16" if cfg.hw.precision == "bf16" else cfg.model.dtype
