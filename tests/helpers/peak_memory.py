"""Measure a few training steps' peak memory in a fresh process, next to `rlcli plan`'s estimate of it.

    python tests/helpers/peak_memory.py STEPS OVERRIDE ... -> one JSON line on stdout:
    {"baseline_gib": RSS after importing everything, "peak_gib": the peak RSS after the steps,
     "estimate_gib": the plan's peak (`rlcli train`'s: the data's longest prompt measured),
     "runtime_gib": the plan's runtime row, "rows": the plan's rows in GiB, "prompt": the longest prompt}

Peak RSS (VmHWM, rlcli.loop.metrics.peak_mem_gb) is a high-water mark of the whole process, so each measurement
needs its own process. (getrusage's ru_maxrss would not do: Linux carries it over from the parent, so a pytest
process that had grown — it held a vLLM engine — raised every later measurement by 1.3-4 GiB.)
The baseline (python + torch + transformers + DeepSpeed + hydra, imported and idle) is measured here, before
any model is built, so a test can compare the job's own memory: peak - baseline vs estimate - runtime row.
"""

import json
import os
import sys
import tempfile

import deepspeed  # noqa: F401  (the runtime, imported before the baseline: torch, transformers, DeepSpeed and
import psutil
from transformers import LlamaForCausalLM  # noqa: F401  the modules rlcli imports on first use, which would

import rlcli.loop.trainer  # noqa: F401
import rlcli.models.sft  # noqa: F401
import rlcli.models.tiny  # noqa: F401  otherwise count as the job's memory)
import rlcli.models.value  # noqa: F401
from rlcli.commands.launch import offline_environment
from rlcli.config import CONF_DIR, register_configs, validate
from rlcli.loop.metrics import peak_mem_gb
from rlcli.plan.budget import fix_budget
from rlcli.plan.inputs import measure_prompts
from rlcli.plan.states import GIB


def main() -> None:
    from hydra import compose, initialize_config_dir

    from rlcli.loop.trainer import Trainer

    steps, overrides = int(sys.argv[1]), sys.argv[2:]
    offline_environment()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=overrides)
    cfg.run_dir = tempfile.mkdtemp(prefix="rlcli-peak-")
    validate(cfg)
    plan = fix_budget(cfg, measure_prompts(cfg))  # as `rlcli train` plans: the data's longest prompt
    baseline = psutil.Process().memory_info().rss / GIB
    trainer = Trainer(cfg)
    try:
        for step in range(1, steps + 1):
            trainer.train_step(step)
    finally:
        trainer.rewards.close()
    peak = peak_mem_gb()
    print(json.dumps({"baseline_gib": baseline, "peak_gib": peak, "estimate_gib": plan.peak / GIB,
                      "runtime_gib": plan.rows.get("runtime", 0.0) / GIB,
                      "rows": {k: v / GIB for k, v in plan.rows.items()}, "prompt": plan.shape["prompt"],
                      "pid": os.getpid()}))


if __name__ == "__main__":
    main()
