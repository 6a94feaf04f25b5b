"""Checkpoints and resume: a run killed at any moment continues as if nothing happened.

End-to-end tests run the real CLI (DeepSpeed engines, torchrun for hw=cpu_x2) on the tiny model and kill
real processes with real signals. "Identical" means every logged metric except wall-clock timings and
peak memory is equal bit for bit, and so is every weight of the final policy.
"""

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import FAST, ROOT, compose, metric_rows, policy_tensors, stable
from omegaconf import OmegaConf

from rlcli.loop import checkpoint as ckpt


# ---------------------------------------------------------------------------------------------- units
def test_commit_is_atomic_and_keeps_the_newest(tmp_path):
    run = str(tmp_path)
    for step in (1, 2, 3):
        ckpt.staging(run, step, 0, lambda: None)
        (tmp_path / "checkpoints" / f".step_{step}.tmp" / "meta.json").write_text(json.dumps({"step": step}))
        assert ckpt.latest(run) == (None if step == 1 else str(tmp_path / "checkpoints" / f"step_{step - 1}"))
        ckpt.commit(run, step, keep_last=2, rank=0, barrier=lambda: None)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_2", "step_3"]
    # A save killed midway leaves only a .tmp directory: latest still names step 3, the next save clears it.
    ckpt.staging(run, 4, 0, lambda: None)
    assert ckpt.resolve("auto", run) == str(tmp_path / "checkpoints" / "step_3")
    assert ckpt.resolve(run, "/elsewhere") == str(tmp_path / "checkpoints" / "step_3")  # a run directory
    ckpt.staging(run, 5, 0, lambda: None)
    assert not (tmp_path / "checkpoints" / ".step_4.tmp").exists()
    (tmp_path / "checkpoints" / "step_3.bak").mkdir()  # not a checkpoint: never parsed, never deleted
    # Resumed from an earlier checkpoint into the same directory: the new step is kept, later ones go.
    ckpt.staging(run, 1, 0, lambda: None)
    ckpt.commit(run, 1, keep_last=2, rank=0, barrier=lambda: None)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_1", "step_3.bak"]
    assert ckpt.latest(run) == str(tmp_path / "checkpoints" / "step_1")


def test_resume_auto_of_a_branch_killed_before_its_first_save_goes_back_to_its_origin(tmp_path):
    origin = tmp_path / "a" / "checkpoints" / "step_4"
    origin.mkdir(parents=True)
    (origin / "meta.json").write_text("{}")
    branch = tmp_path / "b"
    branch.mkdir()
    (branch / "config.yaml").write_text(f"resume: {origin}\n")
    assert ckpt.resolve("auto", str(branch)) == str(origin)


def test_resolve_auto_without_a_checkpoint_starts_fresh_and_a_bad_path_fails(tmp_path):
    assert ckpt.resolve("auto", str(tmp_path)) is None
    assert ckpt.resolve(None, str(tmp_path)) is None
    with pytest.raises(ValueError, match="neither a checkpoint"):
        ckpt.resolve(str(tmp_path / "nope"), str(tmp_path))


def test_a_resume_that_changes_the_math_fails_naming_the_keys(tmp_path):
    saved = compose("steps=10", run_dir="/runs/a")
    OmegaConf.save(saved, tmp_path / "config.yaml", resolve=True)
    (tmp_path / "meta.json").write_text(json.dumps({"step": 4, "world_size": 1}))
    # Keys that do not change the math may change.
    ckpt.check_compatible(str(tmp_path), compose("steps=20", "logger=wandb", "eval.every=5", "hw.micro_batch=8",
                                                 "checkpoint.every=3", "resume=auto", run_dir="/runs/a"))
    with pytest.raises(ValueError, match=r"algo\.clip_high \(0\.2 in the checkpoint, 0\.28 now\).*optim\.lr"):
        ckpt.check_compatible(str(tmp_path), compose("steps=10", "algo.clip_high=0.28", "optim.lr=1e-3", run_dir="/runs/a"))
    with pytest.raises(ValueError, match="hw.nproc"):
        ckpt.check_compatible(str(tmp_path), compose("steps=10", "hw=cpu_x2", run_dir="/runs/a"))
    with pytest.raises(ValueError, match="steps=3 is below the checkpoint's step 4"):
        ckpt.check_compatible(str(tmp_path), compose("steps=3", run_dir="/runs/a"))


def test_a_checkpoint_of_an_older_config_schema_resumes_with_a_note_but_a_dropped_reward_part_is_refused(tmp_path, capfd):
    """A key the checkpoint's config lacks (added to the schema since, e.g. eval.subset_seed) is named in a note; a
    key of an open dict (a reward part given with +reward.weights.<name>) on one side only still changes the math."""
    saved = OmegaConf.to_container(compose("steps=10", "+reward.weights.format=0.5", run_dir="/runs/a"), resolve=True)
    del saved["eval"]["subset_seed"]
    OmegaConf.save(OmegaConf.create(saved), tmp_path / "config.yaml")
    (tmp_path / "meta.json").write_text(json.dumps({"step": 4, "world_size": 1}))
    ckpt.check_compatible(str(tmp_path), compose("steps=10", "+reward.weights.format=0.5", run_dir="/runs/a"))
    assert "keys on one side only, taken as configured now: eval.subset_seed" in capfd.readouterr().err
    with pytest.raises(ValueError, match=r"reward\.weights\.format \(0\.5 in the checkpoint, None now\)"):
        ckpt.check_compatible(str(tmp_path), compose("steps=10", run_dir="/runs/a"))


def test_first_signal_raises_a_flag_and_a_second_ctrl_c_aborts():
    said = []
    before = signal.getsignal(signal.SIGTERM)
    with ckpt.StopSignals(announce=said.append) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # Slurm and torchrun may both deliver it: still one stop
        assert signals.signum == signal.SIGTERM and len(said) == 1 and "Ctrl-C again" in said[0]
        assert "then writing a checkpoint" in said[0]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) is before
    with ckpt.StopSignals(announce=said.append, saves=False):  # save=false promises no checkpoint, even on a signal
        os.kill(os.getpid(), signal.SIGTERM)
    assert "then stopping without a checkpoint (save=false)" in said[1] and "writing" not in said[1]


def test_a_fresh_run_refuses_a_run_dir_that_holds_checkpoints(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_2\n")
    out = subprocess.run([sys.executable, "-m", "rlcli.commands.cli", "train", f"hydra.run.dir={run}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "pass resume=auto to continue it" in out.stderr, out.stderr[-2000:]


def test_prompt_stream_continues_from_its_state():
    from rlcli.data import PromptStream

    data = [{"prompt": str(i), "answer": str(i)} for i in range(7)]
    straight = PromptStream(data, seed=3, shuffle=True, rank=0, world=1)
    first = straight.take(5)
    resumed = PromptStream(data, seed=3, shuffle=True, rank=0, world=1)
    resumed.load_state_dict(straight.state_dict())
    assert first and straight.take(9) == resumed.take(9)  # crosses an epoch boundary


# ---------------------------------------------------------------------------------------------- end to end
SCENARIOS = {
    "grpo": [],  # and wandb on the killed and resumed runs: it continues the same run
    # Dynamic sampling on the score, 2 x P prompts per generation batch: every step carries surplus groups.
    "dapo": ["algo=dapo", "algo.filter_metric=score", "rollout.gen_prompts_per_step=8",
             "rollout.overlong_buffer_len=4"],
    # Critic, value pretraining and the frozen pretrained critic mixed into the advantages (V_aug).
    "vapo": ["algo=vapo", "critic.pretrain_steps=2", "critic.aug_w0=0.5"],
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, cache):
    """straight_run(*args) -> the directory of `rlcli train <args> checkpoint.every=0`, run once per argument list
    for the whole module (the tests that interrupt a run compare it with the same straight run)."""
    runs = {}

    def run(*args: str) -> Path:
        if args not in runs:
            root = tmp_path_factory.mktemp("straight")
            train(root, cache, *args, "checkpoint.every=0", f"hydra.run.dir={root / 'run'}")
            runs[args] = root / "run"
        return runs[args]

    return run


def environment(cache):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
            "RLCLI_CACHE": str(cache), "OMP_NUM_THREADS": "1"}


def start(tmp_path, cache, *args):
    return subprocess.Popen([sys.executable, "-m", "rlcli.commands.cli", "train", *args], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment(cache))


def finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def train(tmp_path, cache, *args):
    code, out = finish(start(tmp_path, cache, *args))
    assert code == 0, out[-6000:]
    return out


def wait_for(predicate, proc, timeout=300):
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, f"the run ended before the moment to interrupt it:\n{proc.communicate()[0][-4000:]}"
        assert time.time() - t0 < timeout, "timed out waiting for the run"
        time.sleep(0.02)


def kill_tree(proc, sig=signal.SIGKILL):
    """`sig` to the run and everything it started (torchrun and its workers run in their own sessions)."""
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def logged_step(run, step):
    def seen():
        path = run / "metrics.jsonl"
        return path.exists() and any(f'"step": {step},' in line and "actor/pg_loss" in line
                                     for line in path.read_text().splitlines())
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("hw", ["cpu", "cpu_x2"])
@pytest.mark.parametrize("algo", list(SCENARIOS))
def test_sigkill_then_resume_auto_is_bit_identical_to_a_straight_run(tmp_path, cache, straight_run, algo, hw):
    """SIGKILL in step 4 (after the step-2 checkpoint, after step 3's metrics were written), then the same
    command with resume=auto: metrics of every step and the final weights equal a straight run's without
    checkpoints, and the row the killed run wrote for step 3 is replaced, not duplicated."""
    args = ["steps=5", f"hw={hw}", *FAST, *SCENARIOS[algo]]
    straight = straight_run(*args)
    args += ["logger=wandb"] if algo == "grpo" else []

    run = tmp_path / "killed"
    proc = start(tmp_path, cache, *args, "checkpoint.every=2", f"hydra.run.dir={run}")
    wait_for(logged_step(run, 3), proc)
    kill_tree(proc)
    finish(proc)
    assert ckpt.latest(str(run)) == str(run / "checkpoints" / "step_2")
    out = train(tmp_path, cache, *args, "checkpoint.every=2", f"hydra.run.dir={run}", "resume=auto")
    assert "resumed from" in out and "2 of 5 steps done" in out

    assert stable(metric_rows(run)) == stable(metric_rows(straight))
    a, b = policy_tensors(straight), policy_tensors(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if algo == "dapo":  # a carry was in flight at the checkpoint
        assert [r for r in metric_rows(straight) if r["step"] == 3][0]["dynamic_sampling/carried"] > 0
    if algo == "grpo":  # wandb continues the same run
        meta = ckpt.read_meta(str(run / "checkpoints" / "step_4"))
        offline = [d for d in os.listdir(run / "wandb") if d.startswith("offline-run-")]
        wandb_id = meta["logger_ids"]["wandb"]
        assert wandb_id and len(offline) == 2 and all(d.endswith(wandb_id) for d in offline)


@pytest.mark.slow
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path, cache, straight_run):
    """SIGKILL while step 4's checkpoint is half written (the actor's files are on disk, nothing else):
    `latest` still names step 2, and resume=auto continues from it to the straight run's numbers."""
    args = ["steps=5", "hw=cpu", *FAST]
    straight = straight_run(*args)  # the grpo scenario's of the SIGKILL test
    run = tmp_path / "run"
    code, out = finish(subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "helpers" / "kill_during_save.py"), "4", "train", *args,
         "checkpoint.every=2", f"hydra.run.dir={run}"],
        cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment(cache)))
    assert code == -signal.SIGKILL, out[-4000:]
    assert (run / "checkpoints" / ".step_4.tmp" / "actor").is_dir()  # the save really was cut midway
    assert ckpt.latest(str(run)) == str(run / "checkpoints" / "step_2")
    train(tmp_path, cache, *args, "checkpoint.every=2", f"hydra.run.dir={run}", "resume=auto")
    assert stable(metric_rows(run)) == stable(metric_rows(straight))
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_4", "step_5"]  # every 2 and the last


@pytest.mark.slow
@pytest.mark.parametrize("hw", ["cpu", "cpu_x2"])
def test_sigterm_finishes_the_step_writes_a_checkpoint_and_says_how_to_resume(tmp_path, cache, hw):
    run = tmp_path / "run"
    proc = start(tmp_path, cache, "steps=50", f"hw={hw}", "checkpoint.every=0", f"hydra.run.dir={run}", *FAST)
    wait_for(logged_step(run, 1), proc)
    os.kill(proc.pid, signal.SIGTERM)  # as Slurm's preemption: the launching process gets it
    code, out = finish(proc, timeout=300)
    assert code == 128 + signal.SIGTERM, out[-4000:]
    latest = ckpt.latest(str(run))
    assert latest is not None, out[-4000:]
    step = ckpt.read_meta(latest)["step"]
    assert 1 <= step < 50 and f"stopped by SIGTERM after step {step}" in out
    assert f"hydra.run.dir={run} resume=auto" in out and f"hw={hw}" in out
    assert max(r["step"] for r in metric_rows(run)) == step  # nothing logged after the checkpoint


def two_rank_run(tmp_path, cache, collective_timeout_s, shutdown_timeout_s):
    """A long hw=cpu_x2 run, once it has logged step 1. -> (the launcher process, its two workers by rank)"""
    run = tmp_path / "run"
    proc = start(tmp_path, cache, "steps=200", "hw=cpu_x2", f"hw.collective_timeout_s={collective_timeout_s}",
                 f"hw.shutdown_timeout_s={shutdown_timeout_s}", f"hydra.run.dir={run}", *FAST)
    wait_for(logged_step(run, 1), proc)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "rlcli.commands.worker" in p.cmdline() and "torch.distributed.run" not in p.cmdline()]
    assert len(workers) == 2
    return proc, sorted(workers, key=lambda p: p.environ()["RANK"])


@pytest.mark.slow
def test_killing_one_of_two_ranks_stops_the_other_with_an_error(tmp_path, cache):
    """SIGKILL rank 1 during training: the run exits with an error within the timeouts (30 s each) and
    no worker is left behind."""
    proc, workers = two_rank_run(tmp_path, cache, 30, 30)
    t0 = time.time()
    workers[1].kill()
    code, out = finish(proc, timeout=180)
    assert code != 0 and time.time() - t0 < 90, out[-4000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)


def test_a_collective_failing_before_the_first_sample_names_the_rollout_stage(make_trainer):
    """The step's first collective is the agreement on held groups, before any sampling: a timeout there is
    reported "in or after stage rollout" (it read "stage None" when rank 1 stopped between steps, CI 2026-11-26)."""
    trainer = make_trainer("steps=2")

    def times_out(kept: int) -> int:
        raise RuntimeError("Timed out waiting 15000ms for send operation to complete")

    trainer.state.sampler.agree = times_out
    with pytest.raises(RuntimeError) as caught:
        trainer.fit()
    assert "rank 0 of 1: training step 1, in or after stage rollout" in caught.value.__notes__


@pytest.mark.slow
def test_a_stuck_rank_becomes_an_error_naming_rank_step_and_stage(tmp_path, cache):
    """SIGSTOP rank 1 (alive, never reaching its next collective): rank 0's collective fails after
    hw.collective_timeout_s with an error that names the rank, the step and the stage, and the run exits."""
    proc, workers = two_rank_run(tmp_path, cache, 15, 5)
    t0 = time.time()
    workers[1].suspend()
    code, out = finish(proc, timeout=180)
    assert code != 0 and time.time() - t0 < 90, out[-4000:]
    assert re.search(r"rank 0 of 2: training step \d+, in or after stage (rollout|reward|shape|score|advantage|update)",
                     out), out[-4000:]


@pytest.mark.slow
def test_zero3_saves_the_trained_policy_gathered(tmp_path, cache):
    """The policy a ZeRO-3 engine saves is the whole trained model, not its empty partitions: after one step
    from the same samples, its update (saved - initial) equals the ZeRO-0 run's update. Adam's first step is
    lr * g / (|g| + eps), about ±lr per entry, so the two updates differ only where rounding flips the sign
    of a near-zero gradient entry: the relative L2 difference stays below 1e-3 (measured: 2e-5), where
    saving the initial or partial weights would give 1. The same holds with ZeRO-3's parameters and the
    optimizer offloaded to CPU memory (hw.offload_params, hw.offload_optimizer: DeepSpeed's CPU Adam)."""
    from safetensors.torch import load_file

    base = ["steps=1", "eval.before=false", *FAST]
    z0 = tmp_path / "z0"
    train(tmp_path, cache, *base, f"hydra.run.dir={z0}")
    a = policy_tensors(z0)
    init = load_file(str(next((cache / "warm_start").iterdir()) / "model.safetensors"))
    moved = torch.cat([(a[k] - init[k]).flatten() for k in a])
    for name, extra in [("z3", []), ("z3_offload", ["hw.offload_params=true", "hw.offload_optimizer=true"])]:
        train(tmp_path, cache, *base, "hw.zero_stage=3", *extra, f"hydra.run.dir={tmp_path / name}")
        b = policy_tensors(tmp_path / name)
        assert a.keys() == b.keys()
        for k in a:
            assert b[k].shape == a[k].shape and b[k].numel() > 0, k
        gap = torch.cat([(b[k] - a[k]).flatten() for k in a])
        assert moved.norm() > 0 and gap.norm() / moved.norm() < 1e-3, name


# ---------------------------------------------------------------------------------------------- damage and full disks
def committed(run, step, keep_last=3, payload=b"weights" * 100):
    tmp = ckpt.staging(str(run), step, 0, lambda: None)
    os.makedirs(os.path.join(tmp, "actor"))
    with open(os.path.join(tmp, "actor", "model_states.pt"), "wb") as f:
        f.write(payload + bytes([step]))
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"step": step}, f)
    return ckpt.commit(str(run), step, keep_last=keep_last, rank=0, barrier=lambda: None)


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_a_bit(path):
    with open(path, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("harm", [truncate, flip_a_bit])
def test_resume_auto_skips_a_damaged_latest_checkpoint_naming_the_file(tmp_path, capfd, harm):
    for step in (2, 4):
        committed(tmp_path, step)
    manifest = json.loads((tmp_path / "checkpoints" / "step_4" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"actor/model_states.pt", "meta.json"}
    bad = tmp_path / "checkpoints" / "step_4" / "actor" / "model_states.pt"
    harm(bad)
    assert ckpt.resolve("auto", str(tmp_path)) == str(tmp_path / "checkpoints" / "step_2")
    err = capfd.readouterr().err
    assert "rlcli: warning: checkpoint step_4 is damaged" in err and str(bad) in err and "resuming from step_2" in err
    for explicit in (str(tmp_path / "checkpoints" / "step_4"), str(tmp_path)):  # a checkpoint, a run directory
        with pytest.raises(ckpt.ConfigError, match=re.escape(str(bad))):
            ckpt.resolve(explicit, "/elsewhere")
    harm(tmp_path / "checkpoints" / "step_2" / "meta.json")
    with pytest.raises(ckpt.ConfigError, match="no intact checkpoint"):
        ckpt.resolve("auto", str(tmp_path))


def test_keep_last_never_deletes_the_newest_intact_checkpoint(tmp_path, monkeypatch):
    committed(tmp_path, 1, keep_last=1)
    write = ckpt.write_manifest

    def write_then_lose_a_file(directory):  # the new checkpoint is damaged right after its manifest
        write(directory)
        truncate(os.path.join(directory, "actor", "model_states.pt"))

    monkeypatch.setattr(ckpt, "write_manifest", write_then_lose_a_file)
    committed(tmp_path, 2, keep_last=1)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_1", "step_2"]
    assert ckpt.resolve("auto", str(tmp_path)) == str(tmp_path / "checkpoints" / "step_1")


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint_and_says_what_a_checkpoint_needs(tmp_path):
    cfg = compose()
    cfg.run_dir = str(tmp_path)
    committed(tmp_path, 2)
    with pytest.raises(ckpt.DiskFull) as e, ckpt.stop_on_disk_full(cfg):
        tmp = ckpt.staging(str(tmp_path), 4, 0, lambda: None)
        with open(os.path.join(tmp, "rank_0.pt"), "wb") as f:
            f.write(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_2"]  # no partial .step_4.tmp
    assert ckpt.resolve("auto", str(tmp_path)) == str(tmp_path / "checkpoints" / "step_2")
    msg = str(e.value)
    assert "no space left" in msg and "rank_0.pt" in msg and "GiB (the size of step_2)" in msg
    assert "step_2 is intact" in msg and "resume=auto" in msg
    with pytest.raises(ZeroDivisionError), ckpt.stop_on_disk_full(cfg):  # other errors pass through
        raise ZeroDivisionError


def test_train_refuses_a_run_dir_without_room_for_a_checkpoint_before_loading(tmp_path):
    """shutil.disk_usage reports 1 MiB free: `rlcli train` stops before the warm start, naming what it needs."""
    code = ("import collections, shutil, sys\n"
            "shutil.disk_usage = lambda p: collections.namedtuple('U', 'total used free')(2**30, 2**30 - 2**20, 2**20)\n"
            "from rlcli.commands.cli import main\nmain(sys.argv[1:])\n")
    out = subprocess.run([sys.executable, "-c", code, "train", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert re.search(r"rlcli: error: hydra\.run\.dir=.* 0\.00 GiB free, but one checkpoint of this run needs "
                     r"0\.05 GiB \(estimated from the model and the optimizer\)", out.stderr), out.stderr
    assert "checkpoint.check_space=false" in out.stderr and "warm" not in out.stdout.lower()


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_falls_back_and_the_resume_equals_the_straight_run(tmp_path, cache):
    """A run with checkpoints at steps 2 and 4; step 4's model states are then truncated. resume=auto warns, naming
    the file, resumes from step 2, and steps 3-4 (metrics and final weights) equal the undamaged run's; an explicit
    resume= of the damaged checkpoint fails in one line naming the file. Then a disk that fills up while step 4's
    checkpoint is written again (ENOSPC at rank_0.pt) stops the run with exit 2, leaving step 2 and `latest`
    intact and no partial directory; the estimate of a checkpoint's size is within 2x of the real one."""
    args = ["steps=4", *FAST, "checkpoint.every=2"]
    run = tmp_path / "run"
    train(tmp_path, cache, *args, f"hydra.run.dir={run}")
    straight_rows, straight_weights = stable(metric_rows(run)), policy_tensors(run)
    states = [p for p in (run / "checkpoints" / "step_4" / "actor").rglob("*model_states.pt")]
    assert states
    truncate(states[0])

    refused = subprocess.run([sys.executable, "-m", "rlcli.commands.cli", "train", *args, f"hydra.run.dir={tmp_path / 'b'}",
                              f"resume={run / 'checkpoints' / 'step_4'}"], cwd=tmp_path, capture_output=True,
                             text=True, env=environment(cache), timeout=120)
    assert refused.returncode == 2 and f"rlcli: error: resume={run / 'checkpoints' / 'step_4'}" in refused.stderr
    assert str(states[0]) in refused.stderr and "Traceback" not in refused.stderr

    out = train(tmp_path, cache, *args, f"hydra.run.dir={run}", "resume=auto")
    assert f"checkpoint step_4 is damaged, skipped: {states[0]}" in out and "resuming from step_2" in out
    assert "2 of 4 steps done" in out
    assert stable(metric_rows(run)) == straight_rows
    b = policy_tensors(run)
    assert straight_weights.keys() == b.keys() and all(torch.equal(straight_weights[k], b[k]) for k in b)
    assert ckpt.damage(str(run / "checkpoints" / "step_4")) is None  # rewritten whole

    # The disk fills up while step 4 is written again (a resume from step 2, into the same run directory).
    full = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "helpers" / "disk_full_during_save.py"), "4", "train", *args,
         f"hydra.run.dir={run}", f"resume={run / 'checkpoints' / 'step_2'}"],
        cwd=tmp_path, capture_output=True, text=True, env=environment(cache), timeout=600)
    assert full.returncode == 2, full.stdout[-3000:] + full.stderr[-3000:]
    assert "rlcli: error: no space left on the device while writing .step_4.tmp" in full.stderr
    assert "Traceback" not in full.stderr
    assert not [n for n in os.listdir(run / "checkpoints") if n.endswith(".tmp")]
    assert ckpt.resolve("auto", str(run)) == str(run / "checkpoints" / "step_4")  # untouched: resumed from 2
    assert ckpt.damage(str(run / "checkpoints" / "step_2")) is None
    size = sum(v["size"] for v in json.loads((run / "checkpoints" / "step_2" / "manifest.json").read_text())["files"]
               .values())
    cfg = compose(*args)
    assert 0.5 < ckpt.estimated_bytes(cfg) / size < 2, (ckpt.estimated_bytes(cfg), size)


def test_every_loop_state_field_survives_a_save_and_a_load():
    """LoopState.state_dict walks the dataclass's fields: a new field is saved without anyone listing it. Each field is
    set away from its default here, saved through torch.save, and loaded into a fresh state; a field this test does
    not know fails it, so whoever adds one says what it holds (data, or an object with an entry in CARRIED)."""
    import dataclasses
    import io

    import torch

    from rlcli.algos.kl import AdaptiveKLController
    from rlcli.data import PromptStream
    from rlcli.loop.state import CARRIED, LoopState
    from rlcli.rollout.sampler import GroupSampler

    def fresh():
        return LoopState(prompts=PromptStream([{"prompt": f"q{i}", "answer": str(i)} for i in range(10)], 0, True, 0, 1),
                         sampler=GroupSampler(2, True, "acc", 3, False), kl_ctl=AdaptiveKLController(0.1, 6.0, 10000),
                         next_group=0)

    data = {"next_group": 17, "step": 5, "train_seconds": 12.5, "result": {"eval/acc_before": 0.25},
            "skipped_in_a_row": 2, "last_finite": {"step": 3, "acc/mean": 0.5}, "no_signal_in_a_row": 1,
            "no_signal_steps": 4}
    names = {f.name for f in dataclasses.fields(LoopState)}
    assert names == set(data) | set(CARRIED), f"a LoopState field this test does not set: {names - set(data) - set(CARRIED)}"
    s = fresh()
    for name, value in data.items():
        setattr(s, name, value)
    s.prompts.take(13)  # into the second epoch
    s.sampler.carry = ["a surplus group"]
    s.kl_ctl.value = 0.37
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    t = fresh()
    t.load_state_dict(torch.load(buf, weights_only=False))
    for name in data:
        assert getattr(t, name) == data[name], name
    assert t.prompts.state_dict() == s.prompts.state_dict() and t.prompts.take(4) == s.prompts.take(4)
    assert t.sampler.carry == ["a surplus group"] and t.kl_ctl.value == 0.37
    # a checkpoint from before the keys added later resumes with those fields as built; any other key is required
    from rlcli.loop.state import ADDED_LATER

    old = {k: v for k, v in s.state_dict().items() if k not in ADDED_LATER}
    u = fresh()
    u.load_state_dict(old)
    assert u.step == 5 and u.entropy_ctl is None and u.curriculum is None
    with pytest.raises(KeyError):
        fresh().load_state_dict({k: v for k, v in old.items() if k != "next_group"})
