"""`rlcli sft`: the embedded tiny model's supervised warm start, a job of the harness (rlcli.loop.job):

    setup   the tiny model at random init (seeded by model.warm_start.seed), its demonstrations and held-out problems
            (rlcli.models.sft.demonstrations), AdamW with warmup and cosine decay, a resumed checkpoint
    train   per step: model.warm_start.batch_size demonstrations in a seeded epoch-shuffled order, one optimizer step
            of cross-entropy on their responses (rlcli.models.sft.sft_step); checkpoints every checkpoint.every steps
            and on SIGTERM/SIGINT
    save    held-out greedy and sampled accuracy after training, then the model into the warm-start cache
            (rlcli.models.sft.save_warm_start): every later run with these settings starts from it

One process on the CPU (the model has 4M parameters): the optimizer is torch's AdamW, not a DeepSpeed engine, so a
warm start built here is the one the cache held before the harness ran it (bit for bit: the default's weights
compared by hand when the build moved onto the harness, 2026-11-29).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rlcli.loop.job import Job
from rlcli.loop.metrics import _fixed, _significant
from rlcli.loop.state import Carried
from rlcli.models import as_objects, warm_start_data
from rlcli.models.cache import task_args, warm_start_dir
from rlcli.models.sft import (
    demonstrations,
    greedy_accuracy,
    max_response_tokens,
    sampled_accuracy,
    save_warm_start,
    sft_optimizer,
    sft_step,
)
from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer

WEIGHTS = "sft.pt"
"""A checkpoint's model, optimizer and schedule (torch.save of their state dicts)."""

STEP_LINE = (("sft/loss", "loss", _fixed(4)), ("sft/grad_norm", "grad_norm", _significant(spec="#.3g")),
             ("sft/lr", "lr", _significant()), ("timing_s/step", "s/step", _fixed(2)))


@dataclass
class SFTProgress(Carried):
    """What the warm start carries from step to step, saved and restored whole by its fields (Carried)."""

    CARRIED = {"draws": ("draws", lambda r: r.getstate(), lambda r, d: r.setstate(d))}

    draws: random.Random
    """The stream that shuffles the demonstrations, epoch by epoch (seeded by model.warm_start.seed)."""
    order: list[int] = field(default_factory=list)
    """Demonstrations of the current shuffled epoch not trained on yet (indices)."""
    step: int = 0
    """Optimizer steps done."""
    train_seconds: float = 0.0
    """Seconds spent in training steps (not evaluation)."""
    losses: list[float] = field(default_factory=list)
    """Every step's loss (warm_start.json reports the mean of the last 10)."""
    tokens: int = 0
    """Response tokens trained on."""
    result: dict[str, Any] = field(default_factory=dict)
    """What the run reports at the end."""


class SFTTrainer(Job):
    """`rlcli sft` (a Job): the warm start's step, its accuracy probes, the cache entry as its final model."""

    NAME = "sft"
    STEPS_KEY = None  # model.warm_start.steps is part of the cache key: a longer run is another warm start
    EVAL = ("eval/greedy_acc", "held-out greedy accuracy")

    def __init__(self, cfg: Any):
        """`cfg.steps` is model.warm_start.steps (rlcli.commands.sft sets it)."""
        self.tiny, self.ws = as_objects(cfg.model.tiny, cfg.model.warm_start)
        self.data = task_args(**warm_start_data(cfg.data))
        super().__init__(cfg)
        self.world = 1
        self.tokenizer = load_tiny_tokenizer()
        self.model = build_tiny_model(self.tiny, self.tokenizer, seed=self.ws.seed)
        self.train_examples, self.eval_examples = demonstrations(self.ws, self.data)
        self.optimizer, self.scheduler = sft_optimizer(self.model, self.ws)
        self.state = SFTProgress(random.Random(self.ws.seed))
        self.resume()

    # ------------------------------------------------------------------ the job's protocol (rlcli.loop.job)
    def source(self) -> tuple[str, str]:
        return "", f"the embedded tiny model at random init (seed {self.ws.seed})"

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step on the next model.warm_start.batch_size demonstrations of the shuffled order (a new
        epoch's order drawn when fewer are left)."""
        s, n, t0 = self.state, self.ws.batch_size, time.perf_counter()
        if len(s.order) < n:
            s.order += s.draws.sample(range(len(self.train_examples)), len(self.train_examples))
        batch = [self.train_examples[i] for i in s.order[:n]]
        del s.order[:n]
        out = sft_step(self.model, self.tokenizer, self.optimizer, self.scheduler, batch)
        s.losses.append(out["loss"])
        s.tokens += int(out["tokens"])
        s.train_seconds += time.perf_counter() - t0
        return {**{f"sft/{k}": v for k, v in out.items()}, "timing_s/step": time.perf_counter() - t0}

    def end_step(self, step: int, metrics: dict[str, float]) -> None:
        self.state.step = step

    def before_training(self) -> None:
        """No evaluation before training: a random init answers ~nothing, and greedy decoding of it costs seconds."""

    def evaluate(self, when: str = "") -> dict[str, float]:
        """Held-out greedy and sampled (T=1, a seeded stream of its own) accuracy, HF generate with a KV cache."""
        t0, evals = time.perf_counter(), self.eval_examples
        max_new = max_response_tokens(self.tokenizer, evals) + 8
        out = {"eval/greedy_acc": greedy_accuracy(self.model, self.tokenizer, evals, max_new),
               "eval/sampled_acc": sampled_accuracy(self.model, self.tokenizer, evals, max_new, seed=self.ws.seed)}
        self.state.result["eval_seconds"] = round(time.perf_counter() - t0, 2)
        return out

    def save_weights(self, path: str) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict()}, os.path.join(path, WEIGHTS))

    def load_weights(self, path: str) -> None:
        saved = torch.load(os.path.join(path, WEIGHTS), weights_only=True)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])

    def save_final(self) -> tuple[str, str, str]:
        """The warm start into the cache, with warm_start.json (the accuracies, steps, loss and seconds)."""
        s, after = self.state, self.state.result["eval_after"]
        tail = s.losses[-10:]
        path = save_warm_start(self.model, self.tokenizer, self.tiny, self.ws, self.data, {
            "greedy_acc": after["eval/greedy_acc"], "sampled_acc": after["eval/sampled_acc"],
            "eval_size": len(self.eval_examples), "train_steps": s.step,
            "train_loss": sum(tail) / len(tail) if tail else None, "train_seconds": round(s.train_seconds, 2),
            "eval_seconds": s.result.get("eval_seconds", 0.0),
            "wall_seconds": round(time.perf_counter() - self.started, 2)})
        return "model_path", path, f"model.path={path} loads it; runs with these settings find it in the cache"

    def outputs(self) -> list[str]:
        path = self.state.result.get("model_path")
        return [f"  {path}\n                  the warm start (warm_start.json: its accuracies)"] if path else []

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics['sft/loss']:.3f}"}

    def step_line(self, metrics: dict[str, float], step: int) -> str:
        return "  ".join([f"step {step}"] + [f"{label}={fmt(metrics[k])}" for k, label, fmt in STEP_LINE])

    def summary(self) -> str:
        cfg, ws, d = self.cfg, self.ws, self.data
        n_params = sum(p.numel() for p in self.model.parameters())
        tiny = ", ".join(f"{k} {v}" for k, v in asdict(self.tiny).items() if k != "attn_implementation")
        digits = f"{d['min_digits']}" + (f"-{d['max_digits']}" if d["max_digits"] != d["min_digits"] else "")
        tools = f", {ws.tool_demos:.0%} of them solved with the calculator" if ws.tool_demos else ""
        return "\n".join([
            "rlcli sft",
            f"  run dir        {cfg.run_dir}",
            f"  model          {self.model_source}: {n_params / 1e6:.2f}M parameters ({tiny})",
            f"  demonstrations {len(self.train_examples)} worked {digits}-digit additions, each carry forgotten with "
            f"probability {ws.carry_slip} (model.warm_start.carry_slip){tools}",
            f"  schedule       {ws.steps} steps of {ws.batch_size}, AdamW lr {ws.lr} (warmup {ws.warmup}, cosine to 0), "
            "loss on the response tokens",
            f"  evaluation     greedy and sampled accuracy on {len(self.eval_examples)} held-out problems after training",
            f"  writes         {warm_start_dir(self.tiny, ws, d)}" + (" (save=false: nothing)" if not cfg.save else "")
            + ", result.json, metrics.jsonl"
            + (f"; checkpoints every {cfg.checkpoint.every} steps" if cfg.save and cfg.checkpoint.every else "")
            + (f"; resuming from {self.resumed_from} (step {self.state.step})" if self.resumed_from else ""),
        ])
