"""Reward models: `rlcli rm` trains a Bradley-Terry reward model from preference pairs (docs/reward_models.md).

    config.py   the `rm` group's schema and its validation (torch-free: a typo fails in a second)
    pairs.py    preference pairs: the embedded arith pairs, or JSONL / Parquet / `datasets` files
    model.py    loading a causal LM as a scalar-head `*ForSequenceClassification`, and `score`, the one function
                that turns (prompt, response) texts into rewards (what a reward=rm in the RL loop calls)
    train.py    the `rlcli rm` job: setup -> train -> save, through rlcli's DeepSpeed engine and checkpoints

The loss is a pure function beside the other objectives: rlcli.algos.functional.bradley_terry_loss.
"""

from rlcli.core.lazy import exports

__all__ = ["load_reward_model", "score"]
__getattr__ = exports(__name__, dict.fromkeys(__all__, "model"))
