"""`rlcli rm`: train a Bradley-Terry reward model from preference pairs, in the skeleton of every rlcli job:

    setup   the model as a scalar-head sequence classifier (rlcli.models.reward), a DeepSpeed engine (rlcli.engine:
            ZeRO 0-3, bf16, LoRA as for the policy), the pairs (rlcli.rm.pairs), a resumed checkpoint
    train   per step: rm.batch_size pairs, each micro-batch one forward of its chosen and rejected sequences,
            bradley_terry_loss normalised over the whole batch, one optimizer step; held-out pair accuracy before,
            every rm.eval_every steps, and after; checkpoints (rlcli.loop.checkpoint) every checkpoint.every steps and on
            SIGTERM/SIGINT
    save    run_dir/reward_model (AutoModelForSequenceClassification.from_pretrained loads it), result.json
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlcli import engine as eng
from rlcli.algos.functional import bradley_terry_loss, preference_metrics
from rlcli.core.precision import trained_model
from rlcli.data import PromptStream
from rlcli.engine.collectives import all_reduce
from rlcli.loop.job import Job
from rlcli.loop.metrics import _fixed, _significant, memory_metrics
from rlcli.loop.state import Carried, NonFiniteTraining
from rlcli.models import autocast
from rlcli.models.reward import encode, load_reward_model, rewards, score
from rlcli.rm.pairs import Pair, load_pairs

TAG = "reward_model"
"""The engine's DeepSpeed checkpoint tag, and the final model's directory under run_dir."""

STEP_LINE = (
    ("rm/loss", "loss", _fixed(4)), ("rm/accuracy", "acc", _fixed(3)), ("rm/margin", "margin", _fixed(3)),
    ("rm/grad_norm", "grad_norm", _significant(spec="#.3g")), ("rm/lr", "lr", _significant()),
    ("timing_s/step", "s/step", _fixed(2)),
)


def step_line(metrics: dict[str, float], step: int) -> str:
    """`step 3  loss=0.6931  acc=0.500  margin=0.000  ...`: the metrics a step line shows."""
    return "  ".join([f"step {step}"] + [f"{label}={fmt(metrics[k])}" for k, label, fmt in STEP_LINE if k in metrics])


@dataclass
class Progress(Carried):
    """What the job carries from step to step, saved and restored whole by its fields (rlcli.loop.state.Carried)."""

    CARRIED = {"pairs": ("pairs", lambda p: p.state_dict(), lambda p, d: p.load_state_dict(d))}

    pairs: PromptStream
    """This rank's position in the seeded, epoch-shuffled order of the training pairs."""
    step: int = 0
    """Optimizer steps done."""
    train_seconds: float = 0.0
    """Seconds spent in training steps (not evaluation)."""
    skipped_in_a_row: int = 0
    """Steps in a row whose optimizer step was skipped (non-finite gradient norm)."""
    result: dict[str, Any] = field(default_factory=dict)
    """What the run reports at the end (held-out pair accuracy before training, ...)."""


class RewardModelTrainer(Job):
    """`rlcli rm` (a Job: rlcli.loop.job runs its skeleton): the Bradley-Terry step, pair accuracy, the reward model."""

    NAME = "rm"
    EVAL = ("eval/pair_accuracy", "held-out pair accuracy")

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.world, self.eval_every = eng.world_size(), cfg.rm.eval_every
        with eng.sharded_construction(cfg.hw, cfg.optim):  # ZeRO-3: each rank loads only its partition
            model, self.tokenizer, self.new_head = load_reward_model(trained_model(cfg), self.model_path, cfg.seed)
        if not eng.is_partitioned(model):
            model.to(eng.device(cfg.hw))
        self.engine = eng.Engine(model, cfg.hw, cfg.optim, cfg.steps, lr=cfg.rm.lr or cfg.optim.lr)
        self.train_pairs, self.train_report = load_pairs(cfg, "train", self.tokenizer)
        self.eval_pairs, self.eval_report = load_pairs(cfg, "eval", self.tokenizer)
        self.state = Progress(PromptStream(self.train_pairs, cfg.seed, True, self.rank, self.world))
        self.resume()

    # ------------------------------------------------------------------ the job's protocol (rlcli.loop.job)
    def end_step(self, step: int, metrics: dict[str, float]) -> None:
        self.state.step = step
        self.check_finite(metrics)

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics['rm/loss']:.3f}", "acc": f"{metrics['rm/accuracy']:.2f}"}

    def step_line(self, metrics: dict[str, float], step: int) -> str:
        return step_line(metrics, step)

    def save_final(self) -> tuple[str, str, str]:
        path = os.path.join(self.cfg.run_dir, TAG)
        eng.save_policy(self.engine.module, self.tokenizer, path)  # LoRA merged, the head as trained
        return "reward_model_path", path, "AutoModelForSequenceClassification.from_pretrained loads it"

    def outputs(self) -> list[str]:
        return [f"  {TAG}/   the reward model (AutoModelForSequenceClassification.from_pretrained loads it)"
                ] if "reward_model_path" in self.state.result else []

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step on rm.batch_size pairs (this rank's share), in micro-batches of hw.micro_batch
        sequences; the loss of every micro-batch is divided by the pairs of the whole batch, so accumulating them
        gives the gradient of the batch mean however it is split."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch = self.state.pairs.take(cfg.rm.batch_size // self.world)
        per_micro = max(1, cfg.hw.micro_batch // 2)
        parts = [batch[i : i + per_micro] for i in range(0, len(batch), per_micro)]
        self.engine.train()
        chosen, rejected, loss_sum = [], [], 0.0
        for i, part in enumerate(parts):
            r_c, r_r = self.pair_rewards(part)  # [n] each, in the graph
            margin = torch.tensor([p["margin"] for p in part], dtype=r_c.dtype, device=r_c.device)  # [n]
            loss = bradley_terry_loss(r_c, r_r, margin if cfg.rm.margin_key else None, cfg.rm.center_coef,
                                      num_pairs=cfg.rm.batch_size)
            self.engine.backward(loss, last=i == len(parts) - 1)
            loss_sum += loss.item()
            chosen.append(r_c.detach().cpu())
            rejected.append(r_r.detach().cpu())
        result = self.engine.step()
        metrics = self.reduced(torch.cat(chosen), torch.cat(rejected))
        self.state.train_seconds += time.perf_counter() - t0
        return {
            "rm/loss": float(all_reduce(torch.tensor(loss_sum))), **metrics, "rm/grad_norm": result.grad_norm,
            "rm/lr": self.engine.lr(), "rm/skipped_steps": float(not result.applied),
            "timing_s/step": time.perf_counter() - t0, **memory_metrics(),
        }

    def pair_rewards(self, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
        """(r_chosen [n], r_rejected [n]) of `pairs` from one forward over their 2n sequences, as `score` reads them."""
        prompts = [p["prompt"] for p in pairs]
        enc = encode(self.tokenizer, prompts * 2, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs])
        with autocast(self.cfg.hw):
            r = rewards(self.engine.module, enc["input_ids"], enc["attention_mask"])  # [2n]
        return r[: len(pairs)], r[len(pairs) :]

    @staticmethod
    def reduced(r_chosen: torch.Tensor, r_rejected: torch.Tensor, prefix: str = "rm/") -> dict[str, float]:
        """preference_metrics over every rank's pairs (a weighted mean of the ranks' means)."""
        n = torch.tensor(float(len(r_chosen)))
        local = preference_metrics(r_chosen, r_rejected)
        names = sorted(local)
        sums = all_reduce(torch.stack([local[k] * n for k in names] + [n]))
        return {f"{prefix}{k}": float(v / sums[-1].clamp(min=1)) for k, v in zip(names, sums[:-1])}

    def check_finite(self, metrics: dict[str, float]) -> None:
        s, limit = self.state, self.cfg.optim.max_skipped_steps
        s.skipped_in_a_row = s.skipped_in_a_row + 1 if metrics["rm/skipped_steps"] else 0
        if s.skipped_in_a_row >= limit:
            raise NonFiniteTraining(
                f"step {s.step}: {s.skipped_in_a_row} steps in a row had a non-finite gradient norm "
                f"(optim.max_skipped_steps={limit}), so nothing was trained. Lower rm.lr (or optim.lr), check "
                "rm.margin_key's values, or try hw.precision=fp32")

    # ------------------------------------------------------------------ evaluation, checkpoints
    def evaluate(self, when: str = "") -> dict[str, float]:
        """Held-out pair accuracy (r_c > r_r; a tie is wrong) and margin, scored with `score`, each rank its shard.
        Every rank scores ceil(pairs / ranks) pairs, the last shard topped up with the first pair, whose scores are
        dropped: under ZeRO-3 each forward gathers the layers from every rank, so all ranks run the same forwards."""
        per = -(-len(self.eval_pairs) // self.world)
        shard = self.eval_pairs[self.rank * per : (self.rank + 1) * per]
        real = len(shard)
        shard = shard + self.eval_pairs[:1] * (per - real)
        batch = max(1, self.cfg.hw.micro_batch)
        prompts = [p["prompt"] for p in shard]
        with autocast(self.cfg.hw):
            r_c = score(self.engine.module, self.tokenizer, prompts, [p["chosen"] for p in shard], batch)
            r_r = score(self.engine.module, self.tokenizer, prompts, [p["rejected"] for p in shard], batch)
        m = self.reduced(r_c[:real], r_r[:real], prefix="eval/pair_")
        return {"eval/pair_accuracy": m["eval/pair_accuracy"], "eval/pair_margin": m["eval/pair_margin"]}

    def save_weights(self, path: str) -> None:
        """The engine: weights, optimizer moments, LR schedule."""
        self.engine.save(path, TAG)

    def load_weights(self, path: str) -> None:
        self.engine.load(path, TAG)

    # ------------------------------------------------------------------ what it prints
    def summary(self) -> str:
        cfg, rm, hw = self.cfg, self.cfg.rm, self.cfg.hw
        module = self.engine.module
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
        n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)
        per_micro = 2 * max(1, hw.micro_batch // 2)
        d = cfg.data
        digits = f"{d.min_digits}" + (f"-{d.max_digits}" if d.max_digits != d.min_digits else "")
        loss = "-log sigmoid(r_c - r_r" + (f" - margin[{rm.margin_key}]" if rm.margin_key else "") + ")" + (
            f" + {rm.center_coef} (r_c + r_r)^2" if rm.center_coef else "")
        lines = [
            "rlcli rm",
            f"  run dir        {cfg.run_dir}",
            f"  model          {cfg.model.name}: {self.model_path} ({self.model_source}) as "
            f"{type(getattr(module, 'get_base_model', lambda: module)()).__name__}, "
            + ("a new scalar head (seeded by `seed`)" if self.new_head else "its trained scalar head"),
            f"  parameters     {n_params / 1e6:.2f}M, {n_trainable / 1e6:.2f}M trainable"
            + (f" (LoRA r={cfg.model.lora.r} + the head)" if cfg.model.lora.r else "")
            + f", dtype {cfg.model.dtype}, precision {hw.precision}",
            f"  hardware       {hw.name}: device {hw.device}, world size {self.world}, ZeRO-{hw.zero_stage}",
            f"  objective      Bradley-Terry {loss}, reward read at the last non-padding token",
            f"  pairs          {rm.name}: {len(self.train_pairs)} train, {len(self.eval_pairs)} held out"
            + (f" ({digits}-digit arith)" if rm.source == "arith" else "")
            + f"; {self.train_report.summary()}; {self.eval_report.summary()}",
            f"  batch          {rm.batch_size} pairs per step ({rm.batch_size // self.world} per rank) = "
            f"{2 * rm.batch_size} sequences, micro-batches of <= {per_micro} sequences (hw.micro_batch)",
            f"  schedule       {cfg.steps} steps ({cfg.steps * rm.batch_size / max(len(self.train_pairs), 1):.2f} "
            f"epochs), lr {rm.lr or cfg.optim.lr} ({cfg.optim.scheduler}, warmup {cfg.optim.warmup_steps})",
            "  evaluation     held-out pair accuracy before and after training"
            + (f", every {rm.eval_every} steps" if rm.eval_every else ""),
            f"  writes         {cfg.run_dir}/{TAG}" + (" (save=false: nothing)" if not cfg.save else "")
            + ", result.json, metrics.jsonl"
            + (f"; checkpoints every {cfg.checkpoint.every} steps" if cfg.save and cfg.checkpoint.every else "")
            + (f"; resuming from {self.resumed_from} (step {self.state.step})" if self.resumed_from else ""),
        ]
        return "\n".join(lines)
