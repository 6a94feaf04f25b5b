"""Reward models: `rlcli rm` trains a Bradley-Terry reward model from preference pairs (docs/reward_models.md).

    config.py   the `rm` group's schema and its validation (torch-free: a typo fails in a second)
    pairs.py    preference pairs: the embedded arith pairs, or JSONL / Parquet / `datasets` files
    samples.py  pairs of the policy's own samples, ranked by the task's reward (rm.source=samples)
    train.py    the `rlcli rm` job's trainer: setup -> train -> save, through rlcli's DeepSpeed engine and checkpoints

The model (a causal LM as a scalar-head `*ForSequenceClassification`, and `score`, the one function that turns
(prompt, response) texts into rewards, which a reward=rm in the RL loop calls) is rlcli.models.reward; the command
is rlcli.commands.rm (its memory plan rlcli.commands.rm_plan). The loss is a pure function beside the other
objectives: rlcli.algos.functional.bradley_terry_loss.
"""
