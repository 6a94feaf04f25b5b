"""Held-out evaluation: sample k responses per prompt, verify them, report acc_avg@k, pass@k, maj@k.

The same code serves `rlcli eval` and the trainer's before/after and periodic evaluation: it uses
the rollout engine and the reward workers of training, so the numbers are comparable.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tqdm.auto import tqdm

from rlcli.core.answers import extract_final_answer_or_none
from rlcli.loop.eval_metrics import summarize
from rlcli.rollout import Sampling, build_engine


def sample_and_verify(
    engine: Any, examples: list[dict[str, str]], eval_cfg: Any, rollout_cfg: Any, rewards: Any,
    progress: bool = False, desc: str = "eval",
) -> list[dict[str, Any]]:
    """Per prompt: its k responses (from the rollout `engine`), verdicts, extracted answers, lengths and
    truncation flags; with `progress`, a bar named `desc`."""
    k, chunk = eval_cfg.k, max(1, eval_cfg.batch_prompts)
    sampling = Sampling.of_eval(eval_cfg, rollout_cfg)
    # maj@k votes on final answers as math_verify reads them; code has none, reasoning_gym's scorers judge more
    # than an answer's equality (partial credit, several right answers), and an agent (rollout.agent) judges itself:
    # no maj@k for any of them
    votes = not {"code", "reasoning_gym"} & set(rewards.functions) and rollout_cfg.agent is None
    results: list[dict[str, Any]] = []
    bar = tqdm(total=len(examples), desc=desc, unit="prompt", disable=not progress, leave=False)
    for s in range(0, len(examples), chunk):
        part = examples[s : s + chunk]
        b = engine.generate([e["prompt"] for e in part], [e["answer"] for e in part], k, sampling)
        acc = b.extras["env/acc"] if "env/acc" in b.extras else rewards(b.texts, b.answers).acc  # [N] (an agent's own)
        if "env/errors" in b.extras:  # an episode that failed or timed out solved nothing, as in training
            acc = acc * ((b.extras["env/errors"] + b.extras["env/timeouts"]) == 0)
        lengths, truncated = b.lengths.tolist(), b.truncated.tolist()
        for i, e in enumerate(part):
            rows = range(i * k, (i + 1) * k)
            results.append({
                "prompt": e["prompt"],
                "answer": e["answer"],
                "responses": [b.texts[j] for j in rows],
                # as the reward read them; code has no final answer to vote on (None: no maj@k)
                "answers": None if not votes else [extract_final_answer_or_none(b.texts[j], rewards.cfg.answer_format)
                                                        for j in rows],
                "correct": [bool(acc[j] > 0.5) for j in rows],
                "response_length": [lengths[j] for j in rows],
                "truncated": [bool(truncated[j]) for j in rows],
            } | ({"tool_calls": [int(b.extras["env/tool_calls"][j]) for j in rows]} if "env/tool_calls" in b.extras else {}))
        bar.update(len(part))
    bar.close()
    return results


def metrics(per_prompt: list[dict[str, Any]], eval_cfg: Any) -> dict[str, float]:
    """summarize's metrics, with multi-turn rollout eval/tool_use (the share of responses that called a tool), and with
    a mix of tasks (data=reasoning_gym) eval/acc/<task>: the held-out accuracy of each task's prompts."""
    from rlcli.data.reasoning_gym import task_of

    out = summarize(per_prompt, pass_ks=list(eval_cfg.pass_ks) or None)
    calls = [c for row in per_prompt for c in row.get("tool_calls", [])]
    by_task: dict[str, list[float]] = {}
    for row in per_prompt:
        if (task := task_of(row["answer"])) is not None:
            by_task.setdefault(task, []).append(sum(row["correct"]) / len(row["correct"]))
    return out | ({"eval/tool_use": sum(c > 0 for c in calls) / len(calls)} if calls else {}) | {
        f"eval/acc/{task}": sum(v) / len(v) for task, v in sorted(by_task.items())}


def eval_subset(examples: list[dict[str, str]], e: Any) -> tuple[list[dict[str, str]], str]:
    """The held-out rows to evaluate: eval.size of them drawn at random with eval.subset_seed (kept in split order),
    or all of them. -> (rows, what they are, for the start-up summary)"""
    import random

    if not e.size or e.size >= len(examples):
        return examples, f"all {len(examples)} eval prompts"
    keep = sorted(random.Random(e.subset_seed).sample(range(len(examples)), e.size))
    return [examples[i] for i in keep], (f"{e.size} of {len(examples)} eval prompts (random subset, "
                                         f"eval.subset_seed={e.subset_seed})")


def run_eval(cfg: Any) -> dict[str, float]:
    """`rlcli eval`: evaluate cfg.model on cfg.data's eval split; write a summary and per-prompt results."""
    import torch

    from rlcli.data import load_split
    from rlcli.models import load_policy, resolve_model_path
    from rlcli.rewards import RewardManager

    if cfg.rollout.tensor_parallel_size > 1:
        from rlcli.core.schema import ConfigError

        raise ConfigError(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} shards an engine over the "
                          "ranks of a training job; rlcli eval is one process: add rollout.tensor_parallel_size=1")
    if cfg.hw.num_threads:
        torch.set_num_threads(cfg.hw.num_threads)
    torch.manual_seed(cfg.seed)
    path, source = resolve_model_path(cfg.model, cfg.data)
    model, tokenizer = load_policy(cfg.model, path)
    examples, report = load_split(cfg.data, "eval", cfg.seed, tokenizer=tokenizer, env_cfg=cfg.env)
    examples, which = eval_subset(examples, cfg.eval)
    e = cfg.eval
    print(
        f"rlcli eval\n  model     {path} ({source})\n  data      {cfg.data.name}: {which}; "
        f"{report.summary()}\n  sampling  k={e.k} temperature={e.temperature} top_p={e.top_p} "
        f"max_new_tokens={e.max_new_tokens or cfg.rollout.max_new_tokens}\n  output    {cfg.run_dir}",
        flush=True,
    )
    with RewardManager(cfg.reward) as rewards:
        engine = build_engine(cfg.rollout.engine, model, tokenizer, path, cfg)
        try:
            per_prompt = sample_and_verify(engine, examples, e, cfg.rollout, rewards, progress=True)
        finally:
            engine.close()  # a multi-turn engine's tool workers
    summary = metrics(per_prompt, e)
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "eval_summary.json"), "w") as f:
        json.dump({"model": path, "data": cfg.data.name, **summary}, f, indent=2)
    with open(os.path.join(cfg.run_dir, "eval_per_prompt.jsonl"), "w") as f:
        for row in per_prompt:
            f.write(json.dumps(row) + "\n")
    for name, value in summary.items():
        print(f"  {name:<24} {value:.4f}")
    return summary
