"""`make bench`: speed and memory of the training step on this machine, printed as a table.

Runs the real trainer (tiny model, default GRPO, hw=cpu) for a few steps after one warm-up step and
reports the median seconds per stage, generated tokens per second, reward-verifier throughput and
peak memory. Extra arguments are Hydra overrides, e.g. `make bench ARGS="algo=vapo hw.num_threads=1"`.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time


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


if __name__ == "__main__":
    main()
