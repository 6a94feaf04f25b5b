"""Run one update of the trainer on a fixed batch for each of several configs, in 1 or N processes (torchrun), and
dump each config's step-1 metrics, the gradient of its update, and the log-probs of the whole batch. Every rank generates the same full batch of P
groups from the same seed, then keeps its own share of groups: the 1- and 2-process runs see the same data. The
configs run one after another in the same processes (one start-up for all of them).

usage: [torchrun --nproc_per_node=2] one_update.py <out.pt> <frozen config.yaml> [<frozen config.yaml> ...]
       -> out.pt: {config file stem: {"metrics", "grads", "critic_grads", "prompt_lengths", "logprobs",
                                      "generation_weights", "engine_gathered"}}
"""

import gc
import sys
from pathlib import Path

import torch

from rlcli.config import load_frozen
from rlcli.loop.learner import rl_phase
from rlcli.loop.trainer import Trainer
from rlcli.rollout import Sampling
from rlcli.rollout.sampler import sampling_metrics
from rlcli.rollout.shaping import shape


def one_update(frozen: str) -> tuple[dict, int]:
    cfg = load_frozen(frozen)
    t = Trainer(cfg)
    r = cfg.rollout
    torch.manual_seed(1234)
    prompts = t.state.prompts.examples[: r.prompts_per_step]
    b = t.rollout.generate([p["prompt"] for p in prompts], [p["answer"] for p in prompts], r.n, Sampling.of_rollout(r))
    b, reward_counts = t.rewards.reward_batch(b)
    b, _ = shape(b, cfg.algo, r)
    logprobs = t.learner.logprobs(b)  # [N, T] the whole batch's, scored on every rank (sequence parallel: sliced)
    b = b.select_groups(b.groups[t.rank :: t.units.world])  # this rank's share of whole groups
    phase = rl_phase(cfg)
    b = b.replace(**t.learner.score(b, 1, phase))
    grads: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "critic_grads": {}}
    for key, engine in (("grads", t.learner.actor), ("critic_grads", t.learner.critic)):
        if engine is None:
            continue

        def step(engine=engine, apply=engine.step, into=grads[key]):  # the all-reduced, accumulated gradient,
            into.update({n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None})
            return apply()  # as the optimizer is about to see it

        engine.step = step
    b, kl_metrics = t.advantage(b, 1, phase)
    counts = {f"dynamic_sampling/{k}": 0.0 for k in ("gen_batches", "generated_groups", "kept_groups", "carried")}
    metrics = {**sampling_metrics(b, [b], {}, counts | reward_counts), **t.learner.batch_metrics(b), **kl_metrics,
               **t.learner.update(b, phase)}
    prompt_lengths = sorted(set(b.prompt_mask.sum(-1).long().tolist()))
    metrics["observed_rows"] = float((b.token_mask != b.response_mask).any(-1).sum())  # multi-turn rows (this rank)
    t.rewards.close()
    return {"metrics": metrics, **grads, "prompt_lengths": prompt_lengths, "logprobs": logprobs,
            "generation_weights": generation_weights_states(t.learner.actor.module),
            "engine_gathered": getattr(t.rollout, "gathered", None)}, t.rank


def generation_weights_states(module: torch.nn.Module) -> tuple[bool, bool] | None:
    """Under ZeRO-3: (every parameter whole inside rlcli.engine.generation_weights, some partitioned again after it);
    None otherwise."""
    from rlcli.engine import generation_weights, is_partitioned

    if not is_partitioned(module):
        return None
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    with generation_weights(module, True) as gathered:
        inside = gathered and all(p.ds_status == ZeroParamStatus.AVAILABLE for p in module.parameters())
    return inside, any(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in module.parameters())


def main() -> None:
    results = {}
    for frozen in sys.argv[2:]:
        results[Path(frozen).stem], rank = one_update(frozen)
        gc.collect()  # the previous trainer's engines, before the next one's
    if rank == 0:
        torch.save(results, sys.argv[1])


if __name__ == "__main__":
    main()
