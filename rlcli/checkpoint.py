"""Checkpoints for exact resume: layout, atomic commit, resolution of `resume=`, the config check, signals.

A checkpoint holds everything the next step depends on, so a resumed run on CPU is bit-identical to a
straight one (tests/test_checkpoint.py):

    run_dir/checkpoints/
      latest              "step_N": written last, so it always names a complete checkpoint
      step_N/
        meta.json         step, world size, wandb run id, what resume needs to know
        config.yaml       the frozen config of the run that wrote it (checked on resume)
        metrics.jsonl     the run's metric rows up to step N (a resumed run continues from exactly these)
        actor/ critic/    DeepSpeed checkpoints: weights, optimizer moments, step counters, LR schedule
        v_pretrained.pt   the frozen pretrained critic (VAPO's V_aug option), if the run has one
        rank_<r>.pt       per rank: RNG states (python, numpy, torch), the prompt stream's position, the
                          dynamic-sampling carry with its recorded old log-probs, the KL controller's β,
                          the group-id counter, results so far (held-out accuracy before training, ...)

The reference policy is not saved: it is the initial policy, rebuilt from the model path. A checkpoint is
written to `.step_N.tmp/` by all ranks and renamed by rank 0 once every rank has finished; `latest` is
replaced after the rename and older checkpoints beyond `keep_last` are deleted after that, so a crash or
SIGKILL at any moment leaves the previous checkpoint usable. Multi-node runs need `run_dir` on a shared
file system (DeepSpeed's requirement too).
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlcli.schema import rng

LATEST = "latest"

# Keys a resumed run may change (exact keys, and groups by prefix); every other key must equal the
# checkpoint's. They do not change the math of the steps that follow, with one exception: `steps` may grow
# to extend a run, and what is scheduled over the run's length (a decaying optim.scheduler, the hybrid
# estimator's α(t), V_aug's w(t)) then follows the new total. Memory-only keys and hw.shm_comm change the
# order of floating-point sums, so results then agree in distribution, not bit for bit.
MAY_CHANGE = frozenset({
    "steps", "run_dir", "resume", "save", "data.report_bad_rows",
    "hw.micro_batch", "hw.max_tokens_per_micro_batch", "hw.logits_chunk", "hw.num_threads", "hw.shm_comm", "hw.master_port",
    "hw.collective_timeout_s", "hw.shutdown_timeout_s", "rollout.gen_batch_size", "reward.num_workers",
    "hw.device_memory_gb", "hw.check_memory",  # the memory check before training, not the run
    # how the vLLM engine holds memory, not what it samples
    "rollout.gpu_memory_utilization", "rollout.sleep_mode", "rollout.enforce_eager", "rollout.cpu_kv_cache_gb",
    "rollout.max_model_len",
    "hw.node_rank", "hw.master_addr",  # each node of a multi-node run checks the config node 0 wrote
})
MAY_CHANGE_GROUPS = ("checkpoint.", "logger.", "eval.", "ladder.")
STEP_DIR = re.compile(r"step_(\d+)")


@dataclass
class CheckpointConfig:
    every: int = rng(20, ge=0, why="0 = only when stopped by a signal")
    """Write a checkpoint every this many training steps and at the last one (0 = only when stopped by
    SIGTERM/SIGINT). 20 suits models up to ~1B, whose checkpoint costs seconds; model=qwen2.5-32b sets 5
    (README, "Checkpoints and resume")."""
    keep_last: int = rng(2, ge=1)
    """Checkpoints kept in run_dir/checkpoints; an older one is deleted only after a newer one is complete."""


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def latest(run_dir: str) -> str | None:
    """The checkpoint `run_dir/checkpoints/latest` names, or None if the run has none."""
    pointer = os.path.join(root(run_dir), LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(root(run_dir), f.read().strip())
    return path if os.path.isdir(path) else None


def done_steps(run_dir: str) -> list[int]:
    """Steps of the complete checkpoints in run_dir (their directories step_N), ascending."""
    names = os.listdir(root(run_dir)) if os.path.isdir(root(run_dir)) else []
    return sorted(int(m.group(1)) for n in names if (m := STEP_DIR.fullmatch(n)))


def resolve(resume: str | None, run_dir: str) -> str | None:
    """The checkpoint directory `resume=` names: auto -> run_dir's latest, else the checkpoint the run
    itself was resumed from (its config.yaml says), else None (start fresh); a checkpoint directory; or a
    run directory (its latest)."""
    if resume is None:
        return None
    if resume == "auto":
        frozen = os.path.join(run_dir, "config.yaml")
        if latest(run_dir) is None and os.path.exists(frozen):  # a branch killed before its first save
            from omegaconf import OmegaConf

            origin = OmegaConf.load(frozen).get("resume")
            return origin if origin and os.path.exists(os.path.join(origin, "meta.json")) else None
        return latest(run_dir)
    path = os.path.abspath(resume)
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    found = latest(path)
    if found is None:
        raise ValueError(
            f"resume={resume}: neither a checkpoint (a directory run/checkpoints/step_N with meta.json) nor a run "
            "directory with checkpoints/latest; use resume=auto with hydra.run.dir=<the run> to continue a run"
        )
    return found


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"algo.clip_high": 0.28, ...} of a nested dict (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def check_compatible(path: str, cfg: Any) -> None:
    """Raise ValueError naming every key whose value differs from the checkpoint's and changes the math."""
    from omegaconf import OmegaConf

    saved = flatten(OmegaConf.to_container(OmegaConf.load(os.path.join(path, "config.yaml")), resolve=True))
    now = flatten(OmegaConf.to_container(cfg, resolve=True))
    differ = sorted(
        k for k in saved.keys() | now.keys()
        if saved.get(k) != now.get(k) and k not in MAY_CHANGE and not k.startswith(MAY_CHANGE_GROUPS)
    )
    if differ:
        shown = ", ".join(f"{k} ({saved.get(k)!r} in the checkpoint, {now.get(k)!r} now)" for k in differ)
        raise ValueError(
            f"resume={path} was written by a run with a different config: {shown}. These keys change the math of "
            "the steps that follow: set them back to the checkpoint's values, or start a new run. Keys that may "
            f"change on resume: {', '.join(sorted(MAY_CHANGE))}, {', '.join(g + '*' for g in MAY_CHANGE_GROUPS)}"
        )
    step = read_meta(path)["step"]
    if cfg.steps < step:
        raise ValueError(f"steps={cfg.steps} is below the checkpoint's step {step}: set steps >= {step}")


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def staging(run_dir: str, step: int, rank: int, barrier: Any) -> str:
    """A fresh temporary directory for step `step`'s checkpoint (stale ones from a killed save removed).
    All ranks call it."""
    tmp = os.path.join(root(run_dir), f".step_{step}.tmp")
    if rank == 0:
        os.makedirs(root(run_dir), exist_ok=True)
        for name in os.listdir(root(run_dir)):
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root(run_dir), name), ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    return tmp


def commit(run_dir: str, step: int, keep_last: int, rank: int, barrier: Any) -> str:
    """Publish the staged checkpoint once every rank has written its part: rename it to step_N, point
    `latest` at it, then delete checkpoints beyond the newest `keep_last` up to step N, and any of a later
    step (left by the run this one resumed from an earlier checkpoint of). All ranks call it."""
    os.sync()  # every rank's files are on disk before the rename makes them a checkpoint
    barrier()
    final = os.path.join(root(run_dir), f"step_{step}")
    if rank == 0:
        if os.path.exists(final):  # re-saving a step (e.g. after a resume from it): replace it whole
            shutil.rmtree(final)
        os.replace(os.path.join(root(run_dir), f".step_{step}.tmp"), final)
        pointer = os.path.join(root(run_dir), LATEST)
        with open(pointer + ".tmp", "w") as f:
            f.write(f"step_{step}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)
        done = done_steps(run_dir)
        keep = [s for s in done if s <= step][-keep_last:]
        for old in set(done) - set(keep):
            shutil.rmtree(os.path.join(root(run_dir), f"step_{old}"), ignore_errors=True)
    barrier()
    return final


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,  # this rank's device
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])


def resume_command(run_dir: str) -> str:
    """The command that continues this run: its Hydra overrides (run_dir/.hydra/overrides.yaml), in
    the same run directory, with resume=auto."""
    from omegaconf import OmegaConf

    overrides_file = os.path.join(run_dir, ".hydra", "overrides.yaml")
    given = list(OmegaConf.load(overrides_file)) if os.path.exists(overrides_file) else []
    kept = [o for o in given if not o.startswith(("resume=", "hydra.run.dir=", "hydra.sweep.dir="))]
    return shlex.join(["rlcli", "train", *kept, f"hydra.run.dir={run_dir}", "resume=auto"])


def to_stderr(msg: str) -> None:
    os.write(sys.stderr.fileno(), (msg + "\n").encode())


class Stopped(SystemExit):
    """Training stopped on SIGTERM/SIGINT after a checkpoint; the exit status is 128 + the signal number."""


class StopSignals:
    """While active, the first SIGTERM, SIGINT or SIGHUP only raises a flag: the loop finishes its step, writes a
    checkpoint and exits (Slurm preemption sends SIGTERM). A second SIGINT aborts at once. The announcement
    goes straight to stderr's file descriptor: a signal can arrive in the middle of another print."""

    def __init__(self, announce: Callable[[str], Any] | None = to_stderr):
        self.signum = 0
        self.announce = announce
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: the terminal went away
            self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum: int, frame: Any) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.signum:
            self.signum = signum
            if self.announce is not None:
                self.announce(f"received {signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
                              "(press Ctrl-C again to abort at once)")
