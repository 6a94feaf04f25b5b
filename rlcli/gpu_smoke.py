"""`make gpu-smoke`: GRPO steps of a Qwen2-shaped model of about 0.5B parameters on one CUDA GPU.

The model is built from Qwen2.5-0.5B's published shape (24 layers, hidden 896, 14 query / 2 key-value
heads, vocabulary 151,936, tied embeddings) with random weights, so nothing is downloaded; it reads the
embedded character tokenizer (its ids are a subset of the vocabulary) and the embedded arithmetic task.
It runs `hw=1xgpu` (bf16, ZeRO-0) and prints, per step, seconds, rollout tokens/s and peak GPU memory.
Rewards are near zero (random weights): the numbers measure the machine, not learning.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

QWEN25_05B = {
    "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "rope_theta": 1000000.0,
}


def smoke(shape: dict[str, Any], overrides: list[str], steps: int) -> list[dict[str, float]]:
    """Build a random Qwen2 model of `shape`, then run `steps` training steps with the default config plus
    `overrides`. -> each step's metrics"""
    import torch
    from hydra import compose, initialize_config_dir
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcli.cli import CONF_DIR, _environment
    from rlcli.config import register_configs, validate
    from rlcli.models.tiny import TOKENIZER_DIR
    from rlcli.trainer import Trainer

    _environment()
    register_configs()
    model_dir = tempfile.mkdtemp(prefix="rlcli-gpu-smoke-model-")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**shape)).to(torch.bfloat16).save_pretrained(model_dir)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[
            "model=hf", f"model.path={model_dir}", f"model.tokenizer_path={TOKENIZER_DIR}", "model.dtype=bfloat16",
            "eval.before=false", "save=false", "data.eval_size=8", "checkpoint.every=0", *overrides,
        ])
    cfg.run_dir = tempfile.mkdtemp(prefix="rlcli-gpu-smoke-run-")
    validate(cfg)
    trainer = Trainer(cfg)
    try:
        return [trainer.train_step(step) for step in range(1, steps + 1)]
    finally:
        trainer.rewards.close()


def main(argv: list[str] | None = None) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("make gpu-smoke needs a CUDA GPU, and torch.cuda.is_available() is False here (no GPU, or "
                         "the CPU build of torch: install the CUDA build of torch 2.13.0). Nothing was run.")
    argv = list(sys.argv[1:] if argv is None else argv)
    steps = 5
    rows = smoke(QWEN25_05B, ["hw=1xgpu", "rollout.max_new_tokens=256", *argv], steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"\nrlcli gpu-smoke: Qwen2.5-0.5B shape (random weights), hw=1xgpu, {torch.cuda.get_device_name()}")
    print(f"{'step':>4}{'seconds':>10}{'rollout tokens/s':>18}")
    for i, r in enumerate(rows, 1):
        print(f"{i:>4}{r['timing_s/step']:>10.2f}{r.get('perf/tokens_per_s', 0.0):>18.0f}")
    print(f"peak GPU memory allocated: {peak:.2f} GiB")


if __name__ == "__main__":
    main()
