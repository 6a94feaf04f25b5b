"""`make bench`: speed and memory of the training step on this machine, printed as tables.

1. Runs the real trainer (tiny model, default GRPO, hw=cpu) for a few steps after one warm-up step and
   reports the median seconds per stage, generated tokens per second, reward-verifier throughput and
   peak memory. Extra arguments are Hydra overrides, e.g. `make bench ARGS="algo=vapo hw.num_threads=1"`.
2. Measures the peak memory of one log-prob + entropy scoring pass at Qwen2.5's vocabulary (152,064)
   for each `hw.logits_chunk`, each in a fresh process (peak RSS above the process's RSS after the
   model is built): the whole-sequence pass holds fp32 [rows, prompt+response, vocab] logits.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import tempfile
import time

SCORING_SHAPE = {"rows": 1, "prompt": 64, "response": 2048, "vocab": 152064, "hidden": 256}
SCORING_CHUNKS = (0, 1024, 256)  # 256 is hw.logits_chunk's default


def scoring_pass(chunk: int) -> None:
    """One no-grad log-prob + entropy pass of a 1-layer Llama at SCORING_SHAPE; prints peak RSS growth
    (GiB) and seconds. Run in a fresh process per chunk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlcli.models import response_logprobs

    s = SCORING_SHAPE
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=4 * s["hidden"],
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)).eval()
    prompt = torch.randint(0, s["vocab"], (s["rows"], s["prompt"]))
    response = torch.randint(0, s["vocab"], (s["rows"], s["response"]))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with torch.no_grad():
        response_logprobs(model, prompt, torch.ones_like(prompt), response, torch.ones_like(response), 1.0,
                          with_entropy=True, chunk=chunk)
    seconds = time.perf_counter() - t0
    print(f"{(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20:.3f} {seconds:.2f}")


def main(argv: list[str] | None = None) -> None:
    from hydra import compose, initialize_config_dir

    from rlcli.cli import CONF_DIR, _environment
    from rlcli.config import register_configs, validate
    from rlcli.trainer import Trainer

    argv = list(sys.argv[1:] if argv is None else argv)
    _environment()
    register_configs()
    steps = 5
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["eval.before=false", "save=false", "data.eval_size=16", *argv])
    cfg.run_dir = tempfile.mkdtemp(prefix="rlcli-bench-")
    validate(cfg)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    setup = time.perf_counter() - t0
    rows = []
    try:
        trainer.train_step(1)  # warm-up: first-call allocations
        for step in range(2, steps + 2):
            rows.append(trainer.train_step(step))
        texts = ["A: 1+1=2\n\\boxed{2}"] * 256
        t1 = time.perf_counter()
        trainer.rewards(texts, ["2"] * 256)
        verifier = 256 / (time.perf_counter() - t1)
    finally:
        trainer.rewards.close()

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    p, g = trainer.P, trainer.G
    print(f"\nrlcli bench: {cfg.model.name} ({sum(x.numel() for x in trainer.actor.module.parameters()) / 1e6:.2f}M), "
          f"algo={cfg.algo.name}, hw={cfg.hw.name}, P={p} G={g} N={p * g}, max_new_tokens={cfg.rollout.max_new_tokens}")
    print(f"{'measure':<32}{'median of ' + str(steps) + ' steps':>20}")
    print(f"{'setup (load, engines, workers) s':<32}{setup:>20.2f}")
    for stage in ("rollout", "reward", "shape", "score", "advantage", "update", "step"):
        print(f"{'timing_s/' + stage:<32}{med('timing_s/' + stage):>20.3f}")
    print(f"{'rollout tokens/s':<32}{med('perf/tokens_per_s'):>20.1f}")
    print(f"{'trajectories/s (whole step)':<32}{p * g / med('timing_s/step'):>20.1f}")
    print(f"{'verifier responses/s (256)':<32}{verifier:>20.1f}")
    print(f"{'peak memory GiB (this process)':<32}{max(r['perf/peak_mem_gb'] for r in rows):>20.2f}")
    scoring_memory()


def scoring_memory() -> None:
    s = SCORING_SHAPE
    full_gib = s["rows"] * (s["prompt"] + s["response"]) * s["vocab"] * 4 / 2**30
    print(f"\nscoring pass (log-probs + entropy, no grad): {s['rows']} row x ({s['prompt']} prompt + {s['response']} "
          f"response) tokens, vocabulary {s['vocab']}; one fp32 [rows, prompt+response, vocab] tensor = {full_gib:.2f} GiB")
    print(f"{'hw.logits_chunk':<20}{'peak RSS growth GiB':>22}{'seconds':>10}")
    for chunk in SCORING_CHUNKS:
        out = subprocess.run([sys.executable, "-m", "rlcli.bench", "--scoring-pass", str(chunk)],
                             capture_output=True, text=True, check=True, timeout=600).stdout.split()
        print(f"{chunk if chunk else '0 (whole sequence)':<20}{float(out[-2]):>22.2f}{float(out[-1]):>10.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--scoring-pass"]:
        scoring_pass(int(sys.argv[2]))
    else:
        main()
