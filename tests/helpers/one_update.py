"""Run one update of the trainer on a fixed batch, in 1 or N processes (torchrun), and dump the
step-1 metrics and the gradient of the update. Every rank generates the same full batch of P groups
from the same seed, then keeps its own share of groups: the 1- and 2-process runs see the same data.

usage: [torchrun --nproc_per_node=2] one_update.py <frozen config.yaml> <out.pt>
"""

import sys

import torch

from rlcli.config import load_frozen
from rlcli.rollout import Sampling
from rlcli.rollout.shaping import shape
from rlcli.trainer import Trainer


def main() -> None:
    cfg = load_frozen(sys.argv[1])
    t = Trainer(cfg)
    r = cfg.rollout
    torch.manual_seed(1234)
    prompts = t.train_prompts.examples[: r.prompts_per_step]
    b = t.rollout.generate([p["prompt"] for p in prompts], [p["answer"] for p in prompts], r.n, Sampling.of_rollout(r))
    b, reward_counts = t.reward(b)
    b, _ = shape(b, cfg.algo, r)
    b = b.select_groups(b.groups[t.rank :: t.world])  # this rank's share of whole groups
    b = b.replace(**t.score(b, 1))
    grads: dict[str, torch.Tensor] = {}
    apply = t.actor.step

    def step():  # the all-reduced, accumulated gradient, as the optimizer is about to see it
        grads.update({n: p.grad.clone() for n, p in t.actor.module.named_parameters() if p.grad is not None})
        return apply()

    t.actor.step = step
    rewards, kl = t.token_rewards(b)
    advantages, returns = t.advantages(b, rewards, 1)
    b = b.replace(advantages=advantages, returns=returns)
    counts = {f"dynamic_sampling/{k}": 0.0 for k in ("gen_batches", "generated_groups", "kept_groups", "carried")}
    metrics = {**t.sampling_metrics(b, [b], {}, counts | reward_counts), **t.batch_metrics(b), **t.update_kl_controller(b, kl),
               **t.update(b)}
    if t.rank == 0:
        torch.save({"metrics": metrics, "grads": grads}, sys.argv[2])
    t.rewards.close()


if __name__ == "__main__":
    main()
