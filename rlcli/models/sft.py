"""Supervised warm-start of the embedded tiny model: its data, its step, cheap accuracy probes, and the cache entry.
`rlcli sft` (rlcli.loop.sft.SFTTrainer, a job of the harness) runs the step; `warm_start` finds the entry a run needs
or builds it with that command.

RL needs a policy that is already *partly* right: from random init the tiny model never samples
a correct `\\boxed{}` answer, so every group has zero reward variance and nothing is learned.
:func:`warm_start` trains the tiny model briefly on worked arithmetic solutions, so that held-out
greedy accuracy lands well inside (20%, 70%): competent enough for RL to get signal, far enough from
the ceiling that an RL run can show a gain within minutes on a CPU. The result is cached on disk,
keyed by every config value that shapes it, so each RL run after the first starts in a second.

The default, measured 2026-11-22 on 2 idle threads (200 held-out problems): 2-digit additions
(`data.min_digits=data.max_digits=2`), `carry_slip` 0.6, 200 steps of 32 at lr 1e-3 (cosine, warmup
10) reach 47.5% greedy / 46% sampled in 65 s. Reproduce with `rlcli sft`.

`carry_slip` makes the demonstrations imperfect: each carry a solution should take is forgotten
with that probability, and the solution is computed on from the slip, so the box matches the
flawed steps (`rlcli.data.arith.worked_steps`). The RL stage's ground truth is never flawed. Why
the default uses it: with exact demonstrations the tiny model's errors are capability errors
(misread digits) that 60 RL steps do not fix, while a forgotten carry is a systematic error a
verifier-trained policy can unlearn. Without the slip, 1-2-digit problems start at 87% greedy (too
close to the ceiling); with it, every 2-digit problem with a carry fails under greedy decoding
until RL raises the carry above 50%. docs/experiments/2026-11-22-default-task.md has the RL runs.

Earlier calibration on 1-3-digit additions with exact demonstrations (`carry_slip=0`), seed 0, 2
threads of the 2-core machine shared with other jobs (load 3-6, so wall times are 2-4x the idle
ones). Reproduce with `rlcli sft data.min_digits=1 data.max_digits=3 model.warm_start.carry_slip=0
model.warm_start.steps=S model.warm_start.batch_size=B model.warm_start.lr=LR`.

    steps x batch   lr     greedy  sampled(T=1)  greedy by digits 1/2/3   train s (contended)
    120 x 64        3e-3    6%      3%           19 / 3 / 0                139
    150 x 32        2e-3   22%     10%           61 / 12 / 2               412
    150 x 32        1e-3   32%     22%           80 / 26 / 0               280
    200 x 32        1e-3   42%     33%           100 / 35 / 2              312
    200 x 32, seed 1       58%     43%                                     844   (seed spread)
    300 x 16        1e-3   45%     35%           100 / 44 / 0              1215

Idle-machine step time: 0.44 s at batch 32, 0.90 s at batch 64 (compute-bound, linear in
tokens). At constant lr 1e-3, batch 32, greedy accuracy went 1% / 12% / 38% / 49% / 66% at steps
50 / 100 / 150 / 200 / 300: the model first learns the format, then to fetch the right column
digits (the slow part), and 3-digit problems come last. lr 3e-3 stayed under 8% for 300 steps.
On 1-3 digits with slip 0.6, 200 x 32 gives 39.5% greedy / 32% sampled (1 thread).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, get_scheduler

from rlcli.data.arith import arith_examples, is_correct
from rlcli.models.cache import (
    WARM_START_VERSION,
    build_dir,
    cache_root,
    cached_warm_start,
    publish,
    task_args,
    warm_start_dir,
    warm_start_key,
)
from rlcli.models.config import WarmStartConfig
from rlcli.models.tiny import (
    TinyModelConfig,
    build_tiny_model,
    load_tiny_tokenizer,
    save_tiny_tokenizer,
)

log = logging.getLogger(__name__)

SECONDS_PER_DEMO = 0.012
"""Wall seconds per demonstration of supervised training on 2 idle cores (200 x 32 took 65-90 s, module doc;
453 s with tool demonstrations on a machine shared by three jobs): the estimate announced before a build."""


def _encode_examples(
    tokenizer: PreTrainedTokenizerBase, examples: list[dict]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + solution + </s>` ids, attention mask, and labels (-100 off-response)."""
    rows = []
    chat = None
    for ex in examples:
        prompt = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
        if "turns" in ex:  # a tool demonstration: observations are rendered as in rollout and get no loss
            from rlcli.envs.chat import ChatFormat

            chat = chat or ChatFormat(tokenizer, "plain")
            target, labels = _encode_turns(tokenizer, chat, ex)
        else:
            target = tokenizer(ex["solution"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            labels = target
        rows.append((prompt, target, labels))
    width = max(len(p) + len(t) for p, t, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # [B, L]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, L]
    for i, (p, t, y) in enumerate(rows):
        n = len(p) + len(t)
        ids[i, :n] = torch.tensor(p + t)
        labels[i, len(p) : n] = torch.tensor(y)
        mask[i, :n] = 1
    return ids, mask, labels


def _encode_turns(tokenizer: PreTrainedTokenizerBase, chat: Any, ex: dict) -> tuple[list[int], list[int]]:
    """A demonstration's turns after the prompt -> (token ids, labels: -100 on observation tokens), with the
    observations cut from `chat` (rlcli.envs.chat.ChatFormat, the plain template) as multi-turn rollout cuts them."""
    history: list[dict[str, str]] = [{"role": "user", "content": ex["prompt"]}]
    ids: list[int] = []
    labels: list[int] = []
    for message in ex["turns"]:
        if message["role"] == "assistant":
            part = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            labels += part
        else:
            part = chat.observation_ids(history, [message])
            labels += [-100] * len(part)
        ids += part
        history.append(message)
    return ids, labels


def demonstrations(ws: WarmStartConfig, data: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """(train, held-out) problems of a warm start: ws.steps * ws.batch_size demonstrations (each carry forgotten with
    probability ws.carry_slip; a ws.tool_demos share of them solved with the calculator, drawn from their own
    stream) and ws.eval_size held-out problems, on the arith task `data` (rlcli.models.cache.task_args)."""
    train = arith_examples("train", ws.steps * ws.batch_size, ws.seed, carry_slip=ws.carry_slip, **data)
    if ws.tool_demos:  # the same problems; a share of them solved with the calculator (own random stream)
        from rlcli.envs.calculator import demonstration

        coin = random.Random(f"tool_demos/{ws.seed}")
        train = [demonstration(ex) if coin.random() < ws.tool_demos else ex for ex in train]
    return train, arith_examples("eval", ws.eval_size, ws.seed, **data)


def sft_optimizer(model: torch.nn.Module, ws: WarmStartConfig, weight_decay: float = 0.0) -> tuple[Any, Any]:
    """(AdamW at ws.lr, its schedule: ws.warmup steps of linear warmup, then cosine decay to 0 at ws.steps)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=weight_decay)
    return optimizer, get_scheduler("cosine", optimizer, num_warmup_steps=ws.warmup,
                                    num_training_steps=max(ws.steps, 1))


def sft_step(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, optimizer: Any, scheduler: Any,
             batch: list[dict], max_grad_norm: float = 1.0) -> dict[str, float]:
    """One optimizer step of cross-entropy on the response tokens of `batch` (prompt masked, `</s>` appended to each
    target; tool observations masked), gradient norm clipped. -> {"loss", "grad_norm", "lr" (the step's), "tokens"}"""
    model.train()
    ids, mask, labels = _encode_examples(tokenizer, batch)  # [B, L] each
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss.item(), "grad_norm": float(grad_norm), "lr": lr, "tokens": float((labels != -100).sum())}


@torch.inference_mode()
def _generate_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[dict],
    max_new_tokens: int,
    batch_size: int,
    sample_kwargs: dict[str, Any],
) -> float:
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        enc = tokenizer(
            [ex["prompt"] for ex in chunk],
            add_special_tokens=False,
            padding=True,
            padding_side="left",
            return_tensors="pt",
        )
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
            **sample_kwargs,
        )  # [B, prompt_len + <=max_new_tokens]
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(is_correct(text, ex["answer"]) for text, ex in zip(texts, chunk))
    model.train(was_training)
    return correct / max(len(examples), 1)


def greedy_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[dict],
    max_new_tokens: int,
    batch_size: int = 64,
) -> float:
    """Share of `examples` whose greedy response boxes exactly `answer` (HF generate, KV cache)."""
    return _generate_accuracy(
        model, tokenizer, examples, max_new_tokens, batch_size, {"do_sample": False}
    )


def sampled_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[dict],
    max_new_tokens: int,
    batch_size: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Like greedy_accuracy with one pure sample per problem (no top-k/top-p), as RL rolls out."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _generate_accuracy(
            model,
            tokenizer,
            examples,
            max_new_tokens,
            batch_size,
            {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0},
        )


def max_response_tokens(tokenizer: PreTrainedTokenizerBase, examples: list[dict]) -> int:
    """Longest target response in `examples`, in tokens, counting the closing `</s>`."""
    return 1 + max(
        len(tokenizer(ex["solution"], add_special_tokens=False)["input_ids"]) for ex in examples
    )


def warm_start(tiny_cfg: TinyModelConfig, ws_cfg: WarmStartConfig, progress: bool = True, **data_kwargs: Any) -> str:
    """Directory of the warm-started tiny model + tokenizer: from the cache, else built once and cached.

    A warm start that trains is an `rlcli sft` run (rlcli.loop.sft, on the job harness: checkpoints, resume, the
    end summary) in a child process, in the run directory rlcli.models.cache.build_dir names, resumed there if an
    earlier build was stopped; `progress=False` keeps its output unless it fails. The random init
    (model.warm_start.enabled=false) is saved here directly. `data_kwargs` go to `arith_examples` (min_digits,
    max_digits; other task arguments at their defaults). The directory loads with `from_pretrained` and holds
    `warm_start.json` with the measured accuracies and times, written last (rlcli.models.cache.publish).
    """
    hit = cached_warm_start(tiny_cfg, ws_cfg, data_kwargs)
    if hit is not None:
        return hit
    data = task_args(**data_kwargs)
    if not ws_cfg.enabled:
        tokenizer = load_tiny_tokenizer()
        return save_warm_start(build_tiny_model(tiny_cfg, tokenizer, seed=ws_cfg.seed), tokenizer, tiny_cfg, ws_cfg,
                               data, {})
    if odd := {k: v for k, v in data.items() if k not in ("min_digits", "max_digits") and v != task_args()[k]}:
        raise ValueError(f"a warm start trains on data.min_digits..data.max_digits of the default arith task; "
                         f"{odd} has no config key")
    final = warm_start_dir(tiny_cfg, ws_cfg, data)
    run_dir = build_dir(tiny_cfg, ws_cfg, data)
    # minutes on a loaded machine, before any other output of the run: say what is happening
    log.info("building the tiny model's warm start (once: cached under %s for later runs): %d steps of %d "
             "demonstrations and an accuracy check on %d held-out problems, about %.0f s on 2 idle cores, longer "
             "under load; `rlcli sft` in %s", final, ws_cfg.steps, ws_cfg.batch_size, ws_cfg.eval_size,
             ws_cfg.steps * ws_cfg.batch_size * SECONDS_PER_DEMO + ws_cfg.eval_size * 0.05, run_dir)
    command = sft_command(tiny_cfg, ws_cfg, data)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    # The paths go by the environment and the working directory, not as Hydra overrides (no quoting of any path)
    env = {**os.environ, "RLCLI_CACHE": str(cache_root(ws_cfg).parent)}
    with subprocess.Popen(command, stdout=None if progress else subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, cwd=run_dir, env=env) as child:
        try:
            out, _ = child.communicate(timeout=build_timeout(ws_cfg))
        except BaseException:  # Ctrl-C reached the child too; a timeout or anything else: let it checkpoint and stop
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
                child.wait(timeout=120)
            raise
    if child.returncode or not (final / "warm_start.json").exists():
        raise RuntimeError(f"building the warm start failed: `{shlex.join(command)}` exited with {child.returncode}"
                           + (f"; its output ended:\n{out[-4000:]}" if out else f"; its log: {run_dir}/cli.log"))
    shutil.rmtree(Path(run_dir) / "checkpoints", ignore_errors=True)  # the run's logs stay, beside the lock
    report = json.loads((final / "warm_start.json").read_text())
    # With tool demonstrations the model calls the calculator, which this single-turn check does not run: its
    # accuracy is the model's without the tool, below the run's held-out accuracy (with the environment).
    without = " answered without the calculator (its calls get no result here)" if ws_cfg.tool_demos else ""
    log.info("warm start built in %.0f s: %s; greedy acc %.3f, sampled acc %.3f on %d held-out problems%s",
             report["wall_seconds"], final, report["greedy_acc"], report["sampled_acc"], report["eval_size"], without)
    return str(final)


def build_timeout(ws_cfg: WarmStartConfig) -> float:
    """Seconds a run waits for its warm start's `rlcli sft` before it stops the build (it resumes from its checkpoint
    next time) and fails: 20x the estimate on 2 idle cores, at least an hour (a loaded machine took 7x, module doc)."""
    return max(3600.0, 20 * (ws_cfg.steps * ws_cfg.batch_size * SECONDS_PER_DEMO + ws_cfg.eval_size * 0.05))


def sft_command(tiny_cfg: TinyModelConfig, ws_cfg: WarmStartConfig, data: dict[str, Any]) -> list[str]:
    """`python -m rlcli sft` with every value that shapes this warm start, run in the working directory (its run
    directory, resuming what is there), the cache root from $RLCLI_CACHE (model.warm_start.cache_dir null)."""
    def value(key: str, v: Any) -> str:
        if isinstance(v, str) and not re.fullmatch(r"[\w.-]+", v):
            raise ValueError(f"{key}={v!r}: a warm start's string values are plain names")
        return f"{key}={v}"

    return [sys.executable, "-m", "rlcli", "sft",
            *[value(f"model.tiny.{k}", v) for k, v in asdict(tiny_cfg).items()],
            *[value(f"model.warm_start.{k}", v) for k, v in asdict(ws_cfg).items() if k != "cache_dir"],
            "model.warm_start.cache_dir=null", f"data.min_digits={data['min_digits']}",
            f"data.max_digits={data['max_digits']}", "hydra.run.dir=.", "resume=auto"]


def warm_start_report(tiny_cfg: TinyModelConfig, ws_cfg: WarmStartConfig, data: dict[str, Any],
                      measured: dict[str, Any]) -> dict[str, Any]:
    """warm_start.json: what shaped the warm start (its key's parts) and `measured` (accuracies, steps, loss,
    seconds)."""
    return {
        "key": warm_start_key(tiny_cfg, ws_cfg, data),
        "greedy_acc": None,  # not measured for a random init: it is ~0 and costs seconds
        "sampled_acc": None,
        "acc_without_tools": bool(ws_cfg.tool_demos),  # single-turn check: a tool call gets no result
        "eval_size": ws_cfg.eval_size,
        "train_steps": 0,
        "train_loss": None,
        "train_seconds": 0.0,
        "eval_seconds": 0.0,
        "wall_seconds": 0.0,
        **measured,
        "torch_threads": torch.get_num_threads(),
        "tiny": asdict(tiny_cfg),
        "warm_start": {k: v for k, v in asdict(ws_cfg).items() if k != "cache_dir"},
        "data": data,
        "version": WARM_START_VERSION,
    }


def save_warm_start(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, tiny_cfg: TinyModelConfig,
                    ws_cfg: WarmStartConfig, data: dict[str, Any], measured: dict[str, Any]) -> str:
    """Write the model, its tokenizer and warm_start.json (last) into a temp directory of the cache and rename it into
    place (rlcli.models.cache.publish): a crash never leaves a half-written entry. -> the entry's directory"""
    final = warm_start_dir(tiny_cfg, ws_cfg, data)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        model.save_pretrained(str(tmp))
        save_tiny_tokenizer(tmp, tokenizer)
        report = warm_start_report(tiny_cfg, ws_cfg, data, measured)
        (tmp / "warm_start.json").write_text(json.dumps(report, indent=2) + "\n")  # written last: a complete entry
        publish(tmp, final, "warm_start.json")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not ws_cfg.enabled:
        log.info("tiny model at random init (model.warm_start.enabled=false): %s", final)
    return str(final)
