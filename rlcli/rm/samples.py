"""On-policy preference pairs (`rm.source=samples`, `rm=arith_samples`): the policy's own samples on the run's task,
graded by the verifier, a correct and an incorrect reply to the same prompt.

    prompts   the first rm.sample_prompts distinct prompts of the task's train split (data.*: the embedded arith task
              by default, any data= the RL run reads), and every distinct prompt of its eval split (data.eval_size)
              for the held-out pairs: held out by prompt, as the RL run holds out its evaluation
    samples   rm.samples_per_prompt responses per prompt from the model the reward model starts from (model=..., the
              warm-started tiny model by default), sampled as the RL rollout samples (rollout.temperature, top_p,
              top_k, max_new_tokens; rlcli.rollout.hf.generate), from torch's RNG seeded with rm.sample_seed
    grading   the verifier of the RL loop: a RewardManager with math_verify alone (reward.answer_format and the
              sandbox settings of reward.*), whose `acc` is the loop's acc
    pairs     per prompt, each distinct incorrect response as `rejected`, with the prompt's distinct correct
              responses as `chosen` in turn; prompts whose samples are all correct or all incorrect give none
              (counted), as do repeated incorrect responses (counted)

Response texts are what the loop's reward model reads (rlcli.rewards.model): the decoded response without special
tokens, plus the chat template's end-of-turn text when the prompt is chat-rendered and the response ended.

Built once and cached (both splits) under <cache>/rm_samples/<key>, <cache> as for the warm start ($RLCLI_CACHE,
model.warm_start.cache_dir, ~/.cache/rlcli), keyed by everything that shapes the pairs: the model directory's files
(names, sizes, mtimes), the prompts and answers, the sampling settings, the seed and the verifier's answer format.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SAMPLES_VERSION = 1
"""Bump when the code here changes what it produces: it invalidates every cache entry."""

SPLITS = ("train", "eval")


def pair_samples(prompt: str, texts: list[str], correct: list[bool], counts: Counter) -> list[dict[str, Any]]:
    """Pairs of one prompt's graded samples: each distinct incorrect text (first-seen order) as `rejected`, the
    distinct correct texts as `chosen` in turn. `counts` gets the prompt's outcome and the incorrect texts dropped as
    repeats of one already paired."""
    good = list(dict.fromkeys(t for t, ok in zip(texts, correct) if ok))
    bad = list(dict.fromkeys(t for t, ok in zip(texts, correct) if not ok))
    if not good or not bad:
        counts["prompts all incorrect" if not good else "prompts all correct"] += 1
        return []
    counts["prompts with both"] += 1
    counts["incorrect repeats dropped"] += sum(not ok for ok in correct) - len(bad)
    return [{"prompt": prompt, "chosen": good[i % len(good)], "rejected": r, "margin": 0.0} for i, r in enumerate(bad)]


def _prompts(cfg: Any, split: str, tokenizer: Any) -> list[tuple[str, str]]:
    """(prompt, answer) of the task's `split`, distinct prompts in order; train: the first rm.sample_prompts."""
    from rlcli.data import load_examples

    seen: dict[str, str] = {}
    for ex in load_examples(cfg.data, split, seed=0, tokenizer=tokenizer):
        seen.setdefault(ex["prompt"], ex["answer"])
        if split == "train" and len(seen) >= cfg.rm.sample_prompts:
            break
    return list(seen.items())


def _model_fingerprint(path: str) -> list[Any]:
    root = Path(path)
    if not root.is_dir():  # a hub id: its name stands for it
        return [path]
    return [str(root.resolve())] + sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                          for p in root.iterdir() if p.is_file())


def cache_key(cfg: Any, model_path: str, prompts: dict[str, list[tuple[str, str]]]) -> str:
    r, rm = cfg.rollout, cfg.rm
    blob = json.dumps({
        "version": SAMPLES_VERSION, "model": _model_fingerprint(model_path), "dtype": cfg.model.dtype,
        "tokenizer": cfg.model.tokenizer_path, "prompts": prompts, "n": rm.samples_per_prompt, "seed": rm.sample_seed,
        "sampling": [r.temperature, r.top_p, r.top_k, r.max_new_tokens, r.gen_batch_size],
        "answer_format": cfg.reward.answer_format, "chat": cfg.data.chat,
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_dir(cfg: Any) -> Path:
    root = cfg.model.warm_start.cache_dir or os.environ.get("RLCLI_CACHE") or "~/.cache/rlcli"
    return Path(root).expanduser() / "rm_samples"


def sample_pairs(cfg: Any, model_path: str) -> tuple[Path, dict[str, Any]]:
    """The cache entry of the run's sample pairs (built now if missing) and its stats.json: -> (directory holding
    train.jsonl and eval.jsonl, stats). The model is `model_path` (the reward model's starting point)."""
    import torch

    from rlcli.data.templates import use_chat_template
    from rlcli.models import load_tokenizer
    from rlcli.models.cache import publish
    from rlcli.models.policy import DTYPES
    from rlcli.rewards import RewardConfig, RewardManager
    from rlcli.rewards.model import end_of_turn
    from rlcli.rollout.hf import generate

    tokenizer = load_tokenizer(cfg.model.tokenizer_path or model_path, cfg.model.trust_remote_code)
    prompts = {split: _prompts(cfg, split, tokenizer) for split in SPLITS}
    key = cache_key(cfg, model_path, {s: [list(p) for p in v] for s, v in prompts.items()})
    final = cache_dir(cfg) / key
    if (final / "stats.json").exists():
        log.info("rm sample pairs: cache hit %s", final)
        return final, json.loads((final / "stats.json").read_text())
    from transformers import AutoModelForCausalLM

    rm, r = cfg.rm, cfg.rollout
    n = rm.samples_per_prompt
    total = sum(len(v) for v in prompts.values())
    log.info("building the reward model's sample pairs (once: cached under %s): %d prompts x %d samples of %s, "
             "graded by math_verify", final, total, n, model_path)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[cfg.model.dtype],
                                                 trust_remote_code=cfg.model.trust_remote_code)
    chat = use_chat_template(cfg.data.chat, tokenizer)
    eot = end_of_turn(tokenizer) if chat else ""
    verifier = RewardManager(RewardConfig(
        weights={"math_verify": 1.0}, answer_format=cfg.reward.answer_format, timeout_s=cfg.reward.timeout_s,
        num_workers=cfg.reward.num_workers, memory_mb=cfg.reward.memory_mb))
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=final.parent))
    stats: dict[str, Any] = {"key": key, "model": model_path, "samples_per_prompt": n, "seed": rm.sample_seed,
                             "sampling": {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                                          "max_new_tokens": r.max_new_tokens}}
    try:
        with torch.random.fork_rng(devices=[]), verifier:
            torch.manual_seed(rm.sample_seed)
            for split in SPLITS:
                counts: Counter = Counter()
                pairs: list[dict[str, Any]] = []
                chunk = max(1, 1024 // n)  # prompts per call: bounds the texts held at once
                for s in range(0, len(prompts[split]), chunk):
                    part = prompts[split][s : s + chunk]
                    b = generate(model, tokenizer, [p for p, _ in part], [a for _, a in part], n, r.max_new_tokens,
                                 r.temperature, r.top_p, r.top_k, r.gen_batch_size)
                    out = verifier(b.texts, b.answers)
                    counts["samples"] += len(b.texts)
                    counts["correct"] += int(out.acc.sum())
                    counts["truncated"] += int(b.truncated.sum())
                    counts["verifier timeouts"] += int(out.metrics["reward/timeouts"])
                    counts["verifier errors"] += int(out.metrics["reward/errors"])
                    texts = [t + (eot if eot and not cut else "") for t, cut in zip(b.texts, b.truncated.tolist())]
                    for i, (prompt, _) in enumerate(part):
                        rows = slice(i * n, (i + 1) * n)
                        pairs += pair_samples(prompt, texts[rows], [bool(a) for a in out.acc[rows].tolist()], counts)
                counts["prompts"] = len(prompts[split])
                counts["pairs"] = len(pairs)
                stats[split] = dict(counts)
                with open(tmp / f"{split}.jsonl", "w") as f:
                    f.writelines(json.dumps(p) + "\n" for p in pairs)
        stats["seconds"] = round(time.perf_counter() - start, 1)
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")  # last: marks a complete entry
        publish(tmp, final, "stats.json")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("rm sample pairs built in %.0f s: %s", stats["seconds"], describe(stats))
    return final, stats


def describe(stats: dict[str, Any], split: str | None = None) -> str:
    """`train: 1000 prompts x 8 samples, 46% correct; 612 with both, 300 all correct, 88 all incorrect; 1830 pairs
    (420 incorrect repeats dropped, 12 truncated, 0 verifier timeouts/errors)`, for one split or both."""
    parts = []
    for s in [split] if split else SPLITS:
        c = Counter(stats[s])
        parts.append(
            f"{s}: {c['prompts']} prompts x {stats['samples_per_prompt']} samples, "
            f"{c['correct'] / max(c['samples'], 1):.0%} correct; {c['prompts with both']} with both, "
            f"{c['prompts all correct']} all correct, {c['prompts all incorrect']} all incorrect; {c['pairs']} pairs "
            f"({c['incorrect repeats dropped']} incorrect repeats dropped, {c['truncated']} truncated samples, "
            f"{c['verifier timeouts'] + c['verifier errors']} verifier timeouts/errors)")
    return "; ".join(parts)


def load_sample_pairs(cfg: Any, split: str, model_path: str) -> tuple[list[dict[str, Any]], str]:
    """(the pairs of `split`, a description for the start-up summary)."""
    where, stats = sample_pairs(cfg, model_path)
    with open(where / f"{split}.jsonl") as f:
        pairs = [json.loads(line) for line in f]
    return pairs, f"the policy's samples graded by math_verify ({describe(stats, split)}; cached in {where})"


def longest_prompt(cfg: Any, tokenizer: Any) -> int:
    """The longest prompt the sample pairs can hold, in tokens (for the memory plan, before anything is sampled)."""
    texts = [p for split in SPLITS for p, _ in _prompts(cfg, split, tokenizer)]
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
