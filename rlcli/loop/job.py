"""The skeleton of every training job, once: `rlcli train` (rlcli.loop.trainer.Trainer), `rlcli rm`
(rlcli.rm.train.RewardModelTrainer) and `rlcli sft` (rlcli.loop.sft.SFTTrainer) are `Job`s and keep only their own step.

    setup     distributed init, rank 0's run log (run_dir/cli.log), seeding, the model path resolved on rank 0 first
              (the others read its cache); then the trainer builds its engines and its `state`, and calls
              `resume()`: the checkpoint of `resume` (rlcli.loop.checkpoint: verified, the world size checked)
              restored, and the metrics logger opened (continuing the run's logger runs)
    fit       the start-up summary; evaluation before training; per step `train_step` -> metrics, `end_step`, the
              periodic evaluation, the logger, the progress bar and the step line, a checkpoint every
              checkpoint.every steps and on SIGTERM/SIGINT (any rank's signal stops all after the step); then the
              evaluation after training, the final model, result.json, the end summary

The protocol a trainer implements (docs/design.md, "A new job"): `train_step(step)`, `end_step(step, metrics)`,
`evaluate(when)`, `summary()`, `step_line(metrics, step)`, `postfix(metrics)`, `save_weights(dir)` /
`load_weights(dir)`, `save_final()`, `outputs()`, and the attributes `state` (a rlcli.loop.state.Carried: saved
whole by its fields), `world`, `NAME`, `EVAL` and `eval_every`. Hooks with a default: `source` (the model's path),
`STEPS_KEY`, `before_training`,
`after_checkpoint`, `end_training`, `after_fit`, `closing`, `stage`, `close`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from rlcli import __version__
from rlcli import engine as eng
from rlcli.core.units import duration
from rlcli.engine.collectives import all_reduce, barrier, rank_zero_first
from rlcli.loop import checkpoint as ckpt
from rlcli.loop.metrics import MetricsLogger, RunLog
from rlcli.loop.state import seed_everything
from rlcli.models import resolve_model_path


class Job:
    NAME = "train"
    """The command (`rlcli <NAME>`): the progress bar's label and the resume command's."""
    STEPS_KEY: str | None = "steps"
    """The key that lengthens a run resumed from its last checkpoint (None: a run's length is fixed)."""
    EVAL = ("eval/acc", "held-out accuracy")
    """The headline held-out metric and how the run names it before and after training."""
    eval_every = 0
    """Evaluate every this many steps (0: before and after training only)."""
    world: int
    """Ranks that train (a checkpoint is resumed by as many)."""
    state: Any
    """What the job carries from step to step (rlcli.loop.state.Carried), with `step`, `train_seconds`, `result`."""

    def __init__(self, cfg: Any):
        self.cfg, self.started = cfg, time.perf_counter()
        eng.init_distributed(cfg.hw)
        self.rank = eng.rank()
        self.main = self.rank == 0
        self.say = RunLog(cfg.run_dir) if self.main else None  # the terminal, and run_dir/cli.log
        seed_everything(cfg.seed)
        # Rank 0 first, the others read its cache (all hit it under a launcher: it resolved it first)
        self.model_path, self.model_source = rank_zero_first(self.source)

    def source(self) -> tuple[str, str]:
        """(the model's path, how it was obtained): the model the run starts from."""
        return resolve_model_path(self.cfg.model, self.cfg.data)

    def resume(self) -> None:
        """The last step of a trainer's setup: its checkpoint to continue from restored, and the logger opened."""
        self.resumed_from = ckpt.resolve(self.cfg.resume, self.cfg.run_dir)
        meta = self.restore(self.resumed_from) if self.resumed_from else {}
        self.logger = MetricsLogger.of_run(self.cfg, self.resumed_from, meta, enabled=self.main)

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, Any]:
        cfg, s = self.cfg, self.state
        first = s.step
        self.print(self.summary())
        with ckpt.StopSignals(announce=ckpt.to_stderr if self.main else None, saves=cfg.save) as signals:
            if s.step:
                self.print(f"resumed from {self.resumed_from}: {s.step} of {cfg.steps} steps done")
            else:
                self.before_training()
            bar = tqdm(range(s.step + 1, cfg.steps + 1), desc=self.NAME, initial=s.step, total=cfg.steps,
                       disable=not self.main, dynamic_ncols=True)
            for step in bar:
                try:
                    metrics = self.train_step(step)
                except Exception as e:  # e.g. a collective timed out: say which rank was where
                    stage = self.stage()
                    e.add_note(f"rank {self.rank} of {self.world}: training step {step}"
                               + (f", in or after stage {stage}" if stage else ""))
                    raise
                self.end_step(step, metrics)
                if self.eval_every and step % self.eval_every == 0 and step < cfg.steps:
                    metrics.update(self.evaluate(f"at step {step}"))
                self.logger.log(metrics, step)
                bar.set_postfix(self.postfix(metrics))
                if step % cfg.logger.log_every == 0:
                    self.print(self.step_line(metrics, step))
                for note in self.notes(metrics):
                    self.print(note)
                signum = int(all_reduce(torch.tensor(signals.signum), "max").item())  # any rank signalled
                every, path = cfg.checkpoint.every, None
                if cfg.save and (signum or (every and (step % every == 0 or step == cfg.steps))):
                    path = self.save_checkpoint()
                self.after_checkpoint(step)
                if signum:
                    self.stop(signum, path)
        self.end_training()
        s.result["train_seconds"] = s.train_seconds
        s.result["eval_after"] = self.evaluate("after training")
        self.logger.log({f"{k}_after": v for k, v in s.result["eval_after"].items()}, step=cfg.steps)
        key, label = self.EVAL
        self.print(f"{label} after training: {s.result['eval_after'][key]:.3f}"
                   + (f" (before: {s.result['eval_before'][key]:.3f})" if "eval_before" in s.result else ""))
        if cfg.save:  # all ranks: under ZeRO-3 the weights are gathered from every rank's partition
            name, path, loads = self.save_final()
            s.result[name] = path
            self.print(f"saved {name.removesuffix('_path').replace('_', ' ')} to {path} ({loads})")
        if self.main:
            with open(os.path.join(cfg.run_dir, "result.json"), "w") as f:
                json.dump({**s.result, "rlcli_version": __version__}, f, indent=2)
        self.after_fit()
        self.print(self.end_summary(cfg.steps - first))
        self.close()
        return s.result

    def evaluate_before(self) -> None:
        """The held-out evaluation before training, logged at step 0 (`_before`) and kept in the result."""
        s, (key, label) = self.state, self.EVAL
        s.result["eval_before"] = self.evaluate("before training")
        self.print(f"{label} before training: {s.result['eval_before'][key]:.3f}")
        self.logger.log({f"{k}_before": v for k, v in s.result["eval_before"].items()}, step=0)

    # ------------------------------------------------------------------ checkpoints (layout: rlcli.loop.checkpoint)
    def save_checkpoint(self) -> str:
        """Write everything the next step depends on: the trainer's weights and optimizer (`save_weights`), every
        rank's state, the metrics so far, the frozen config. All ranks call it. -> the checkpoint directory"""
        cfg, step, t0 = self.cfg, self.state.step, time.perf_counter()
        tmp = ckpt.staging(cfg.run_dir, step, self.rank, barrier)
        self.save_weights(tmp)
        torch.save(self.state.state_dict(), os.path.join(tmp, f"rank_{self.rank}.pt"))
        if self.main:
            self.logger.snapshot(os.path.join(tmp, "metrics.jsonl"))
            ckpt.write_run_files(tmp, cfg, step, self.world, self.logger.run_ids)
        path = ckpt.commit(cfg.run_dir, step, cfg.checkpoint.keep_last, self.rank, barrier)
        self.print(f"checkpoint {path} ({time.perf_counter() - t0:.1f} s)")
        return path

    def restore(self, path: str) -> dict[str, Any]:
        """Load the checkpoint at `path` into this freshly built trainer. -> its meta.json"""
        meta = ckpt.read_meta(path)
        if meta["world_size"] != self.world:
            raise ValueError(f"{path} was written by {meta['world_size']} ranks, this run has {self.world}: "
                             f"resume with hw.nproc={meta['world_size']}")
        self.load_weights(path)
        self.state.load_state_dict(torch.load(os.path.join(path, f"rank_{self.rank}.pt"), weights_only=False))
        # The same run continues its logger backends' runs; a branch into another run directory starts new ones.
        return meta if meta["run_dir"] == self.cfg.run_dir else {**meta, "logger_ids": {}}

    def stop(self, signum: int, path: str | None) -> None:
        """Exit after the checkpoint a SIGTERM/SIGINT asked for (none with save=false), saying how to continue."""
        import signal

        name = signal.Signals(signum).name
        if path is None:
            self.print(f"stopped by {name} after step {self.state.step}; save=false: no checkpoint written")
        else:
            self.print(f"stopped by {name} after step {self.state.step}; checkpoint: {path}\n"
                       f"continue with:\n  {ckpt.resume_command(self.cfg.run_dir, self.NAME)}")
        self.close()
        raise ckpt.Stopped(128 + signum)

    # ------------------------------------------------------------------ what it prints
    def end_summary(self, steps: int) -> str:
        """What the run took and left behind (`outputs`: the trainer's own files), and what to run next (after
        training `steps` steps here)."""
        run, label = self.cfg.run_dir, self.EVAL[1]
        lines = [f"done: {steps} steps, {duration(time.perf_counter() - self.started)} from loading the model to "
                 f"the end ({duration(self.state.train_seconds)} in training steps); results in {run}",
                 f"  result.json     {label} " + ("before and " if "eval_before" in self.state.result else "")
                 + "after training",
                 "  metrics.jsonl   every metric of every step (docs/metrics.md)",
                 "  cli.log         what this run printed", *self.outputs()]
        if done := ckpt.done_steps(run):
            more = f"a larger {self.STEPS_KEY}=, " if self.STEPS_KEY else ""
            lines.append(f"  checkpoints/    step_{done[-1]} (the same command with {more}resume=auto and "
                         f"hydra.run.dir={run} trains on from it)")
        return "\n".join(lines + [f"  {note}" for note in self.logger.notes] + self.closing())

    def print(self, msg: str) -> None:
        """To the terminal and run_dir/cli.log (rank 0)."""
        if self.say is not None:
            self.say(msg)

    def close(self) -> None:
        self.logger.close()
        if self.say is not None:
            self.say.close()

    # ------------------------------------------------------------------ hooks with a default
    def before_training(self) -> None:
        """What a fresh run does before its first step: the held-out evaluation."""
        self.evaluate_before()

    def notes(self, metrics: dict[str, float]) -> list[str]:
        """Lines to print after a step's (warnings)."""
        return []

    def after_checkpoint(self, step: int) -> None:
        """After a step's checkpoint (or none)."""

    def end_training(self) -> None:
        """After the last step, before the evaluation after training."""

    def after_fit(self) -> None:
        """After result.json is written."""

    def closing(self) -> list[str]:
        """The end summary's last lines (warnings, the commands to run next)."""
        return []

    def stage(self) -> str | None:
        """The stage of the step that is running (named when it raises)."""
        return None
