"""Build the trainer of a frozen config (under torchrun for several ranks), let its rollout engine generate once
greedily and once sampled for fixed prompts, and save every rank's rows on rank 0: what a test compares between
engine layouts (rollout.tensor_parallel_size, hw.zero_stage).

usage: torchrun --nproc_per_node=N generate_once.py <frozen config.yaml> <out.pt>
"""

import sys

import torch

from rlcli.config import load_frozen
from rlcli.engine.collectives import gather_objects
from rlcli.loop.trainer import Trainer
from rlcli.rollout import Sampling


def main() -> None:
    cfg = load_frozen(sys.argv[1])
    t = Trainer(cfg)
    prompts = [p["prompt"] for p in t.eval_examples][t.rank :: t.units.world]  # this rank's share, like evaluation
    torch.manual_seed(1234 + t.rank)  # the per-trajectory seeds: the same on a rank whatever the engine layout
    rows = {}
    for name, sampling in (("greedy", Sampling(cfg.rollout.max_new_tokens, 0.0)), ("sampled", Sampling.of_rollout(cfg.rollout))):
        b = t.rollout.generate(prompts, ["0"] * len(prompts), 2, sampling, with_logprobs=True)
        rows[name] = (b.response_ids, b.response_mask, b.rollout_logp)
    every = gather_objects(rows)
    if t.rank == 0:
        torch.save(every, sys.argv[2])
    t.rewards.close()


if __name__ == "__main__":
    main()
