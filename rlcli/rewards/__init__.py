"""Task rewards (docs/rewards.md): weighted reward functions, run in reward worker processes.

    manager = RewardManager(cfg.reward)          # starts the workers (non-blocking), once per run
    out = manager(responses, ground_truths)      # out.score [N], out.acc [N], out.parts, out.metrics
    manager.close()

    manager = RewardManager.for_run(cfg, tokenizer)   # the loop's: also loads reward.rm / reward.judge when used
    batch, counts = manager.reward_batch(batch)       # stage 2 on a RolloutBatch: every part, the models' too

The formula and the failure rules are in rlcli/rewards/config.py and docs/rewards.md. The reward functions
run on the response text in the reward workers (rlcli/core/workers.py: a clock and a memory cap, no isolation;
reward=code's programs run in a sandbox of their own, rlcli/rewards/sandbox/); the model parts (`rm`, a reward
model, rlcli/rewards/model.py; `judge`, a generative judge, rlcli/rewards/judge.py; one interface,
rlcli/rewards/scorer.py) read the prompt as well, so `reward_batch` adds them in this process, into the same score.

This package does not import torch at module level: every reward worker imports this package (for
the reward functions) and must stay small and quick to start. torch is imported where the score
tensors are built, and a model part's module only when it is used.
"""

from rlcli.core.lazy import exports

__all__ = ["COUNTS", "MODEL_PARTS", "REWARDS", "RewardConfig", "RewardManager", "RewardOutput", "WorkerPool",
           "TaskResult", "extract_final_answer", "group_base", "store_group_schema", "validate"]
__getattr__ = exports(__name__, {
    "COUNTS": "code", "MODEL_PARTS": "config", "RewardConfig": "config", "group_base": "config",
    "store_group_schema": "config", "validate": "config", "REWARDS": "functions", "extract_final_answer": "functions",
    "WorkerPool": "pool", "TaskResult": "pool", "RewardManager": "manager", "RewardOutput": "manager",
})
