"""Checkpoints for exact resume: layout, atomic commit, resolution of `resume=`, the config check, signals.

A checkpoint holds everything the next step depends on, so a resumed run on CPU is bit-identical to a
straight one (tests/test_checkpoint.py):

    run_dir/checkpoints/
      latest              "step_N": written last, so it always names a complete checkpoint
      step_N/
        manifest.json     every other file's size and SHA-256, written by `commit` after all ranks wrote theirs;
                          resume verifies it before loading (a truncated or bit-flipped file is named)
        meta.json         step, world size, the logger backends' run ids, what resume needs to know
        config.yaml       the frozen config of the run that wrote it (checked on resume)
        metrics.jsonl     the run's metric rows up to step N (a resumed run continues from exactly these)
        actor/ critic/    DeepSpeed checkpoints: weights, optimizer moments, step counters, LR schedule
        v_pretrained.pt   the frozen pretrained critic (VAPO's V_aug option), if the run has one
        judge_cache/      a copy of run_dir/judge_cache/ (reward=judge's replies, rlcli.rewards.judge), if the run has
                          one: a run resumed from this checkpoint into another run directory starts with it, or with the
                          origin's whole run_dir/judge_cache/ where that still exists (`adopt`)
        rank_<r>.pt       per rank: RNG states (python, numpy, torch), the prompt stream's position, the
                          dynamic-sampling carry with its recorded old log-probs, the KL controller's β,
                          the group-id counter, results so far (held-out accuracy before training, ...)

The reference policy is not saved: it is the initial policy, rebuilt from the model path. A checkpoint is
written to `.step_N.tmp/` by all ranks and renamed by rank 0 once every rank has finished; `latest` is
replaced after the rename and older checkpoints beyond `keep_last` are deleted after that, so a crash or
SIGKILL at any moment leaves the previous checkpoint usable. Multi-node runs need `run_dir` on a shared
file system (DeepSpeed's requirement too).

Damage after the fact (a failed copy, a bad disk, a full quota) is caught by the manifest: `resume=auto` skips a
damaged checkpoint with a warning naming the file and takes the newest intact one; an explicit `resume=<dir>`
that is damaged fails naming the file; `keep_last` never deletes the newest intact checkpoint. A disk that fills
up while saving (ENOSPC) leaves the previous checkpoint and `latest` as they were, removes the partial
`.step_N.tmp`, and stops the run with the space a checkpoint needs (`stop_on_disk_full`): continuing without
checkpoints would risk hours of training that no later failure could get back.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rlcli.core.schema import ConfigError, flatten

LATEST = "latest"
MANIFEST = "manifest.json"

# Keys a resumed run may change (exact keys, and groups by prefix); every other key must equal the
# checkpoint's. They do not change the math of the steps that follow, with one exception: `steps` may grow
# to extend a run, and what is scheduled over the run's length (a decaying optim.scheduler, the hybrid
# estimator's α(t), V_aug's w(t)) then follows the new total. Memory-only keys and hw.shm_comm change the
# order of floating-point sums, so results then agree in distribution, not bit for bit.
MAY_CHANGE = frozenset({
    "steps", "run_dir", "resume", "save", "data.report_bad_rows",
    "hw.micro_batch", "hw.max_tokens_per_micro_batch", "hw.logits_chunk", "hw.share_prompts", "hw.num_threads", "hw.shm_comm", "hw.master_port",
    "hw.collective_timeout_s", "hw.shutdown_timeout_s", "rollout.gen_batch_size", "reward.num_workers", "reward.rm.batch_size",
    "hw.device_memory_gb", "hw.check_memory",  # the memory check before training, not the run
    "hw.keep_freed_memory",  # where freed memory goes (glibc's malloc), not what is computed
    # where and how patiently the judge is asked, not what it answers (its replies are cached by request, never by URL)
    "reward.judge.url", "reward.judge.api_key_env", "reward.judge.concurrency", "reward.judge.timeout_s",
    "reward.judge.retries", "reward.judge.backoff_s", "reward.judge.batch_size", "reward.judge.on_error",
    "hw.peak_tflops", "hw.memory_bandwidth_gbs", "hw.host_link_gbs",  # the plan's step-time estimate
    # how the vLLM engine holds memory and shards the model, not what it samples
    "rollout.gpu_memory_utilization", "rollout.sleep_mode", "rollout.enforce_eager", "rollout.cpu_kv_cache_gb",
    "rollout.max_model_len", "rollout.tensor_parallel_size",
    "hw.node_rank", "hw.master_addr",  # each node of a multi-node run checks the config node 0 wrote
})
MAY_CHANGE_GROUPS = ("checkpoint.", "logger.", "eval.", "ladder.", "sweep.")
STEP_DIR = re.compile(r"step_(\d+)")
CARRIED = ("judge_cache",)
"""Run-directory folders a checkpoint carries a copy of (`write_run_files`) and a branch into another run directory
adopts (`adopt`): what the run has learnt from outside the model, which no later step may have to ask for again."""


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
    """The checkpoint directory `resume=` names, verified against its manifest: auto -> run_dir's newest intact
    checkpoint (from `latest` down; a damaged one is skipped with a warning naming the file), else the checkpoint
    the run itself was resumed from (its config.yaml says), else None (start fresh); a checkpoint directory, or a
    run directory (its latest), which must be intact. Raises ConfigError naming the damaged file."""
    if resume is None:
        return None
    if resume == "auto":
        frozen = os.path.join(run_dir, "config.yaml")
        if not done_steps(run_dir) and os.path.exists(frozen):  # a branch killed before its first save
            from omegaconf import OmegaConf

            origin = OmegaConf.load(frozen).get("resume")
            if not origin or not os.path.exists(os.path.join(origin, "meta.json")):
                return None
            return _intact(origin, f"resume=auto (the checkpoint {run_dir} was started from)")
        return newest_intact(run_dir)
    path = os.path.abspath(resume)
    if os.path.exists(os.path.join(path, "meta.json")):
        return _intact(path, f"resume={resume}")
    found = latest(path)
    if found is None:
        raise ConfigError(
            f"resume={resume}: neither a checkpoint (a directory run/checkpoints/step_N with meta.json) nor a run "
            "directory with checkpoints/latest; use resume=auto with hydra.run.dir=<the run> to continue a run"
        )
    return _intact(found, f"resume={resume}")


def _intact(path: str, what: str) -> str:
    problem = damage(path)
    if problem:
        raise ConfigError(f"{what}: the checkpoint {path} is damaged: {problem}. Resume from an earlier checkpoint "
                          f"(resume=<run>/checkpoints/step_N), or use resume=auto, which skips damaged ones")
    return path


def newest_intact(run_dir: str) -> str | None:
    """The newest intact checkpoint of run_dir, from the one `latest` names down; None if it has none. Warns on
    stderr about each damaged one it skips; raises ConfigError if every checkpoint is damaged."""
    steps = done_steps(run_dir)
    pointed = latest(run_dir)
    if pointed is not None:  # later ones are left over from before a resume from an earlier step
        top = int(STEP_DIR.fullmatch(os.path.basename(pointed)).group(1))  # type: ignore[union-attr]
        steps = [s for s in steps if s <= top]
    skipped = []
    for step in reversed(steps):
        path = os.path.join(root(run_dir), f"step_{step}")
        problem = damage(path)
        if problem is None:
            for bad in skipped:
                to_stderr(f"rlcli: warning: {bad}; resuming from step_{step}, the newest intact checkpoint")
            return path
        skipped.append(f"checkpoint step_{step} is damaged, skipped: {problem}")
    if skipped:
        raise ConfigError(f"no intact checkpoint in {root(run_dir)}: {'; '.join(skipped)}. Move the run directory "
                          "aside and start a new run, or resume=<another run>")
    return None


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: str) -> None:
    """directory/manifest.json: size and SHA-256 of every file below it, written to a temp name and synced."""
    files = {}
    for top, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(top, name)
            rel = os.path.relpath(full, directory)
            if rel not in (MANIFEST, MANIFEST + ".tmp"):
                files[rel] = {"size": os.path.getsize(full), "sha256": file_digest(full)}
    target = os.path.join(directory, MANIFEST)
    with open(target + ".tmp", "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(target + ".tmp", target)


def damage(path: str, deep: bool = True) -> str | None:
    """None if the checkpoint at `path` matches its manifest, else what is wrong, naming the file. deep=False
    compares sizes only (no reading). A checkpoint without a manifest (written before rlcli had them) passes
    with a warning: nothing can be checked."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        if os.path.exists(os.path.join(path, "meta.json")):
            if deep:
                to_stderr(f"rlcli: warning: {path} has no {MANIFEST} (written before rlcli verified checkpoints): "
                          "loading it unverified")
            return None
        return f"{os.path.join(path, 'meta.json')} is missing"
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{manifest} is unreadable ({e})"
    for rel, want in files.items():
        full = os.path.join(path, rel)
        if not os.path.exists(full):
            return f"{full} is missing"
        size = os.path.getsize(full)
        if size != want["size"]:
            return f"{full} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if deep and file_digest(full) != want["sha256"]:
            return f"{full} does not match its SHA-256 in the manifest (its bytes changed since it was written)"
    return None


def resume_point(cfg: Any, check: Any = None) -> str | None:
    """The checkpoint `cfg.resume` names (resolve), checked against this run's config (`check`(path, cfg), by default
    check_compatible), before anything loads; a run directory holding an earlier run's checkpoints is refused without
    resume=."""
    resume = resolve(cfg.resume, cfg.run_dir)
    if resume is not None:
        (check or check_compatible)(resume, cfg)
    elif cfg.resume is None and latest(cfg.run_dir) is not None:
        raise SystemExit(f"{cfg.run_dir} holds checkpoints of an earlier run: pass resume=auto to continue it, "
                         "or choose another hydra.run.dir for a new run")
    return resume


def check_compatible(path: str, cfg: Any) -> None:
    """`rlcli train`'s check of a resumed run before anything loads: the same number of training ranks, no key
    that changes the math differs from the checkpoint's, and `steps` reaches the checkpoint's step. Raises
    ConfigError naming the keys and the fix."""
    from omegaconf import OmegaConf

    from rlcli.config import Config
    from rlcli.core.units import units
    from rlcli.schema_doc import knobs

    saved = flatten(OmegaConf.to_container(OmegaConf.load(os.path.join(path, "config.yaml")), resolve=True))
    now = flatten(OmegaConf.to_container(cfg, resolve=True))
    meta = read_meta(path)
    world = units(cfg).world
    if meta["world_size"] != world:  # the data order, the optimizer's shards and each rank's RNG state depend on it
        layout = " ".join(f"{k}={saved[k]}" for k in ("hw.nproc", "hw.nnodes", "rollout.async.rollout_ranks")
                          if k in saved and saved[k] != now.get(k))
        raise ConfigError(
            f"resume={path} was written by {meta['world_size']} training rank(s), this run has {world}: resume with "
            f"the checkpoint's {layout or 'hw.nproc'} (a checkpoint is not resharded), or start a new run"
        )
    # A schema key on one side only was added or removed by an rlcli version between the two runs: said, not refused
    # (the run continues with the key as configured now). Keys of open dicts (reward.weights.<name>) are the user's.
    open_dicts = tuple(f"{k}." for k, _, default, _ in knobs(Config) if isinstance(default, dict))
    versioned = sorted(k for k in saved.keys() ^ now.keys() if not k.startswith(open_dicts))
    if versioned:
        print(f"rlcli: note: resume={path} was written by another version of rlcli's config; keys on one side only, "
              f"taken as configured now: {', '.join(versioned)}", file=sys.stderr, flush=True)
    differ = sorted(
        k for k in saved.keys() | now.keys()
        if saved.get(k) != now.get(k) and k not in MAY_CHANGE and not k.startswith(MAY_CHANGE_GROUPS)
        and k not in versioned
    )
    if differ:
        shown = ", ".join(f"{k} ({saved.get(k)!r} in the checkpoint, {now.get(k)!r} now)" for k in differ)
        raise ConfigError(
            f"resume={path} was written by a run with a different config: {shown}. These keys change the math of "
            "the steps that follow: set them back to the checkpoint's values, or start a new run. Keys that may "
            f"change on resume: {', '.join(sorted(MAY_CHANGE))}, {', '.join(g + '*' for g in MAY_CHANGE_GROUPS)}"
        )
    step = meta["step"]
    if cfg.steps < step:
        raise ConfigError(f"steps={cfg.steps} is below the checkpoint's step {step} (resume={path}): set steps >= "
                          f"{step}; steps counts the whole run, not the steps still to go")


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if "logger_ids" not in meta:  # written before logger backends: {"wandb_id": id or null}
        meta["logger_ids"] = {"wandb": meta["wandb_id"]} if meta.get("wandb_id") else {}
    return meta


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
        write_manifest(os.path.join(root(run_dir), f".step_{step}.tmp"))  # every rank's files are in it now
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
        if not any(damage(os.path.join(root(run_dir), f"step_{s}"), deep=False) is None for s in keep):
            # The kept ones are damaged (e.g. this one, cut by a full disk after its manifest): keep the newest
            # intact older one too.
            older = [s for s in done if s < keep[0]]
            keep += [s for s in reversed(older) if damage(os.path.join(root(run_dir), f"step_{s}"), deep=False)
                     is None][:1]
        for old in set(done) - set(keep):
            shutil.rmtree(os.path.join(root(run_dir), f"step_{old}"), ignore_errors=True)
    barrier()
    return final


GIB = 2**30


def estimated_bytes(cfg: Any) -> int:
    """Bytes of one checkpoint, from the model and the optimizer (docs/memory.md's counts): each trained model's
    DeepSpeed states, i.e. its weights in the training precision plus AdamW's fp32 moments (and fp32 master
    weights under bf16); a frozen LoRA base is not saved; the frozen pretrained critic of V_aug in fp32. RNG
    states, the carry and the metrics are small beside them."""
    from rlcli.core.names import NEEDS_VALUES
    from rlcli.plan.shapes import arch_of, critic_param_count, lora_param_count, param_count

    arch = arch_of(cfg.model)
    per_param = 4 + 8 if cfg.hw.precision == "fp32" else 2 + 4 + 8  # weights, Adam m and v (, fp32 master)
    trained = lora_param_count(arch, cfg.model.lora) if cfg.model.lora.r else param_count(arch)
    total = trained * per_param
    if cfg.algo.adv_estimator in NEEDS_VALUES:
        critic = critic_param_count(arch, cfg.critic)
        total += critic * per_param + (critic * 4 if cfg.critic.aug_w0 is not None else 0)
    return total


def needed_bytes(cfg: Any) -> tuple[int, str]:
    """(bytes one checkpoint of this run takes, how it is known): the newest checkpoint's manifest if the run has
    one, else the estimate."""
    path = latest(cfg.run_dir) if os.path.isdir(root(cfg.run_dir)) else None
    if path and os.path.exists(os.path.join(path, MANIFEST)):
        with open(os.path.join(path, MANIFEST)) as f:
            return sum(v["size"] for v in json.load(f)["files"].values()), f"the size of {os.path.basename(path)}"
    return estimated_bytes(cfg), "estimated from the model and the optimizer"


def free_bytes(path: str) -> int:
    """Free bytes of the file system `path` is (or will be) on: its nearest existing ancestor's."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_space(cfg: Any) -> None:
    """`rlcli train`'s check before loading anything: refuse a run directory without room for one checkpoint (a
    new one is complete before the oldest kept one is deleted)."""
    if not cfg.checkpoint.check_space or not cfg.save:  # save=false writes no checkpoint
        return
    need, how = needed_bytes(cfg)
    free = free_bytes(cfg.run_dir)
    if free < need:
        raise ConfigError(
            f"hydra.run.dir={cfg.run_dir} is on a file system with {free / GIB:.2f} GiB free, but one checkpoint of "
            f"this run needs {need / GIB:.2f} GiB ({how}): free space, choose a run directory on a larger disk, or "
            "set checkpoint.check_space=false to train anyway"
        )


class DiskFull(ConfigError):
    """The disk filled up while a checkpoint was written; the previous checkpoint is intact (a one-line error)."""


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC as Python raises it, or as torch.save's zip writer reports it (a RuntimeError without errno)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, RuntimeError) and ("file write failed" in str(e) or "No space left" in str(e))


@contextmanager
def stop_on_disk_full(cfg: Any) -> Iterator[None]:
    """Around a training run: a full disk (ENOSPC, or a quota: EDQUOT) stops the run with DiskFull, after
    removing the partial `.step_N.tmp` it left; `latest` and the previous checkpoint were never touched."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        where = root(cfg.run_dir)
        partial = sorted(n for n in os.listdir(where) if n.endswith(".tmp")) if os.path.isdir(where) else []
        for name in partial:
            shutil.rmtree(os.path.join(where, name), ignore_errors=True)
        need, how = needed_bytes(cfg)
        previous = latest(cfg.run_dir)
        file = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
        raise DiskFull(
            f"no space left on the device while writing {', '.join(partial) or 'the run directory'}{file}; removed "
            f"the partial checkpoint. One checkpoint of this run needs {need / GIB:.2f} GiB ({how}), "
            f"{free_bytes(cfg.run_dir) / GIB:.2f} GiB are free now. "
            + (f"The previous checkpoint {os.path.basename(previous)} is intact: free space, then continue with: "
               f"{resume_command(cfg.run_dir)}" if previous else "No checkpoint was written yet: free space, or "
               "choose a run directory on a larger disk, and start again")
        ) from e


def write_run_files(directory: str, cfg: Any, step: int, world: int, logger_ids: dict[str, str]) -> None:
    """The frozen config.yaml, meta.json and copies of the CARRIED folders of a checkpoint being staged in `directory`
    (rank 0). `logger_ids`: each
    logger backend's run id ({"wandb": ..., "mlflow": ...}), which a resumed run continues (rlcli.core.loggers)."""
    from omegaconf import OmegaConf

    OmegaConf.save(cfg, os.path.join(directory, "config.yaml"), resolve=True)
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump({"step": step, "world_size": world, "run_dir": cfg.run_dir, "logger_ids": logger_ids}, f, indent=2)
    for name in CARRIED:  # append-only files: a line being written by a rollout rank is skipped when read back
        if os.path.isdir(src := os.path.join(cfg.run_dir, name)):
            shutil.copytree(src, os.path.join(directory, name))


def adopt(checkpoint: str | None, run_dir: str) -> None:
    """Before a run resumed from `checkpoint` starts: each CARRIED file that `run_dir` lacks is copied there from the
    checkpoint's own run directory if it still holds it (a superset: what that run learnt after the checkpoint too),
    else from the checkpoint's copy. A no-op in the checkpoint's own run directory. Torch-free."""
    if checkpoint is None:
        return
    origin = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))  # <run>/checkpoints/step_N
    for name in CARRIED:
        dst = os.path.join(run_dir, name)
        for src in (os.path.join(origin, name), os.path.join(checkpoint, name)):
            if not os.path.isdir(src) or os.path.abspath(src) == os.path.abspath(dst):
                continue
            os.makedirs(dst, exist_ok=True)
            for file in os.listdir(src):
                if not os.path.exists(os.path.join(dst, file)):
                    shutil.copy2(os.path.join(src, file), os.path.join(dst, file))


def resume_command(run_dir: str, command: str = "train") -> str:
    """The command that continues this run (`rlcli <command>`): its Hydra overrides (run_dir/.hydra/overrides.yaml),
    in the same run directory, with resume=auto."""
    from omegaconf import OmegaConf

    overrides_file = os.path.join(run_dir, ".hydra", "overrides.yaml")
    given = list(OmegaConf.load(overrides_file)) if os.path.exists(overrides_file) else []
    kept = [o for o in given if not o.startswith(("resume=", "hydra.run.dir=", "hydra.sweep.dir="))]
    return shlex.join(["rlcli", command, *kept, f"hydra.run.dir={run_dir}", "resume=auto"])


def to_stderr(msg: str) -> None:
    os.write(sys.stderr.fileno(), (msg + "\n").encode())


class Stopped(SystemExit):
    """Training stopped on SIGTERM/SIGINT after a checkpoint; the exit status is 128 + the signal number."""


class StopSignals:
    """While active, the first SIGTERM, SIGINT or SIGHUP only raises a flag: the loop finishes its step, writes a
    checkpoint and exits (Slurm preemption sends SIGTERM). A second SIGINT aborts at once. The announcement
    goes straight to stderr's file descriptor: a signal can arrive in the middle of another print."""

    def __init__(self, announce: Callable[[str], Any] | None = to_stderr, saves: bool = True):
        self.signum = 0
        self.announce = announce
        self.then = "then writing a checkpoint" if saves else "then stopping without a checkpoint (save=false)"
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
                self.announce(f"received {signal.Signals(signum).name}: finishing this step, {self.then} (press "
                              "Ctrl-C again to abort at once)")
