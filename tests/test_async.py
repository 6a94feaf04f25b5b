"""Asynchronous rollout (docs/async.md): rollout ranks of their own, a bounded staleness.

The end-to-end tests run the real CLI: torchrun with one training rank and one rollout rank (hw=cpu_x2), real
DeepSpeed, real HF and vLLM engines, weights pushed over gloo, processes killed with real signals.
"""

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import psutil
import pytest
import torch
from conftest import FAST, ROOT, compose, metric_rows, policy_tensors, stable
from test_checkpoint import finish, kill_tree, logged_step, start, train, wait_for

from rlcli.algos.config import off_policy
from rlcli.config import validate
from rlcli.core.schema import ConfigError
from rlcli.core.units import units
from rlcli.engine import checksum


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.async.max_staleness=1"], r"at least two ranks .* use hw=cpu_x2"),
    (["hw=cpu_x2", "rollout.async.max_staleness=1", "algo.off_policy=recompute"], r"corrects none of the lag"),
    (["hw=cpu_x2", "rollout.async.max_staleness=0", "algo=dapo"], r"max_staleness >= 1"),
    (["hw=cpu_x2", "algo.off_policy=bypass", "algo.rollout_correction=token"], r"weigh every token by 1"),
    (["hw=cpu_x2", "rollout.async.rollout_ranks=1"], r"asynchronous rollout, which is off"),
    (["hw=cpu_x2", "hw.nproc=3", "rollout.async.max_staleness=1", "rollout.async.rollout_ranks=2"],
     r"rollout_ranks=2 must divide the 1 training ranks"),
    (["hw=cpu_x2", "rollout.async.max_staleness=1", "rollout.async.max_staleness=-1"], r"max_staleness=-1 must be >= 0"),
])
def test_asynchronous_rollout_refuses_what_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides, run_dir="/tmp/unused"))


def test_defaults_place_one_rollout_rank_and_correct_the_lag():
    cfg = compose("hw=cpu_x2", "rollout.async.max_staleness=1", run_dir="/tmp/unused")
    validate(cfg)
    u = units(cfg)
    assert (u.world, u.p_local) == (1, 16)  # one training rank takes all P prompts; rank 1 generates
    assert off_policy(cfg) == "decoupled"
    assert off_policy(compose("hw=cpu_x2", "rollout.async.max_staleness=0", run_dir="/tmp/u")) == "recompute"


def test_checksum_is_exact_and_independent_of_layout():
    """The same elements give the same checksum however they are split into tensors (a fused qkv projection,
    vocabulary rows padded with zeros); one flipped bit or one stale tensor changes it."""
    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    fused = torch.cat([q, k, v])
    assert checksum([q, k, v]) == checksum([fused]) == checksum([torch.cat([fused, torch.zeros(3, 4)])])
    assert checksum([v, q, k]) == checksum([q, k, v])
    flipped = q.clone()
    flipped.view(torch.int32)[0, 0] ^= 1  # the lowest mantissa bit
    assert checksum([flipped, k, v]) != checksum([q, k, v])
    assert checksum([q + 1e-3, k, v]) != checksum([q, k, v])
    assert checksum([q.bfloat16()]) != checksum([q])  # bf16 is summed as 16-bit patterns


@pytest.mark.slow
def test_a_weight_push_arrives_bit_for_bit_and_one_the_engine_missed_is_an_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          str(ROOT / "tests" / "helpers" / "push_weights.py")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "equal: True" in out.stdout
    assert re.search(r"refused: .*after push 2 .*the weight sync did not arrive", out.stdout)


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


ASYNC_ONLY = ("async/",)


def same_training(a, b) -> bool:
    """Every logged metric but timings, memory and the async/* ones (absent from a synchronous run) is equal."""
    strip = [{k: v for k, v in r.items() if not k.startswith(ASYNC_ONLY)} for r in stable(metric_rows(a))]
    return strip == [{k: v for k, v in r.items() if not k.startswith(ASYNC_ONLY)} for r in stable(metric_rows(b))]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_staleness_zero_is_the_synchronous_run_bit_for_bit(tmp_path, cache, engine):
    """4 GRPO steps with one training rank and one rollout rank at max_staleness=0 against the synchronous run of
    the same preset in one process (hw=cpu_x2 hw.nproc=1: the same micro-batches and one thread, so the same
    arithmetic): the trainer sees the same batches, sampled from bit-identical weights with the same per-batch
    seeds, so every metric and every final weight is equal."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    args = ["steps=4", *FAST, f"rollout.engine={engine}", "checkpoint.every=0", "eval.before=false"]
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    train(tmp_path, cache, *args, "hw=cpu_x2", "hw.nproc=1", f"hydra.run.dir={sync}")
    train(tmp_path, cache, *args, "hw=cpu_x2", "rollout.async.max_staleness=0", f"hydra.run.dir={asyn}")
    assert same_training(sync, asyn)
    rows = [r for r in metric_rows(asyn) if "async/staleness_max" in r]
    assert len(rows) == 4 and all(r["async/staleness_max"] == 0 for r in rows)
    a, b = policy_tensors(sync), policy_tensors(asyn)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trained_groups(run, steps):
    """{step: Counter of (group id, prompt)} of the trajectories trained at each step (logger.rollouts)."""
    out = {}
    for step in range(1, steps + 1):
        rows = [json.loads(x) for x in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        out[step] = Counter((r["group"], r["prompt"]) for r in rows)
    return out


LONG_TAIL = ["reward.weights.sevens=0.0", "+reward.weights.tail=1.0", "+reward.custom.tail=reward_fixtures.slow_tail"]


@pytest.mark.slow
@pytest.mark.parametrize(("s", "algo"), [(1, []), (2, ["algo=dapo", "algo.filter_metric=score",
                                                        "rollout.gen_prompts_per_step=8"])])
def test_the_bound_holds_and_no_prompt_is_lost_or_trained_twice_across_a_kill(tmp_path, cache, s, algo):
    """max_staleness S with a long tail (one prompt in ten is scored 0.3 s per response): every trained row is at
    most S versions old (exactly S once the pipeline is full, without dynamic sampling), the prompts trained over the
    run are the planned ones, each once, and a SIGKILL after the step-2 checkpoint with resume=auto changes nothing
    (the batches in flight at the checkpoint were saved with it). DAPO: refills come through the same pipeline
    (generation S - 1 ahead), its carried groups stay within S."""
    steps = 6
    args = [f"steps={steps}", "hw=cpu_x2", f"rollout.async.max_staleness={s}", *FAST, *LONG_TAIL, *algo,
            "logger.rollouts=true", "eval.before=false"]
    straight = tmp_path / "straight"
    out = train(tmp_path, cache, *args, "checkpoint.every=0", f"hydra.run.dir={straight}")
    # The start-up summary tells the truth about the ranks and the lag (it once said "world size 1", "on-policy").
    assert "world size 2 (1 training, 1 rollout rank(s))" in out
    assert f"old-logprob pass     skipped: the current policy is the proximal one (decoupled PPO); rows lag up to {s} " in out
    rows = [r for r in metric_rows(straight) if "async/staleness_max" in r]
    assert len(rows) == steps and all(r["async/staleness_max"] <= s for r in rows)
    if not algo:
        assert [r["async/staleness_max"] for r in rows] == [min(k - 1, s) for k in range(1, steps + 1)]
    groups = trained_groups(straight, steps)
    total = sum(groups.values(), Counter())
    assert all(n == 4 for n in total.values())  # G rows of each trained group, in one step only
    ids = sorted(g for g, _ in total)
    if not algo:  # every prompt of the stream, in order, once: P=4 per step
        assert ids == list(range(4 * steps))
    else:  # informative groups among those generated; none twice (carried ones trained once)
        assert len(ids) == len(set(ids)) == 4 * steps

    run = tmp_path / "killed"
    proc = start(tmp_path, cache, *args, "checkpoint.every=2", f"hydra.run.dir={run}")
    wait_for(logged_step(run, 3), proc)
    kill_tree(proc)
    finish(proc)
    out = train(tmp_path, cache, *args, "checkpoint.every=2", f"hydra.run.dir={run}", "resume=auto")
    assert "2 of 6 steps done" in out
    volatile = ("async/trainer_idle_s", "async/rollout_idle_s", "async/sync_s")
    clean = [{k: v for k, v in r.items() if k not in volatile} for r in stable(metric_rows(run))]
    assert clean == [{k: v for k, v in r.items() if k not in volatile} for r in stable(metric_rows(straight))]
    assert trained_groups(run, steps) == groups
    a, b = policy_tensors(straight), policy_tensors(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigterm_checkpoints_with_the_batch_in_flight_and_resumes(tmp_path, cache):
    """SIGTERM (Ctrl-C, Slurm) reaches every rank through torchrun: the rollout rank keeps serving until the training
    rank has finished its step and saved the checkpoint, with the batch generated ahead in it; the run resumes."""
    from rlcli.loop import checkpoint as ckpt

    args = ["steps=6", "hw=cpu_x2", "rollout.async.max_staleness=1", *FAST, "eval.before=false",
            "checkpoint.every=0"]
    run = tmp_path / "run"
    proc = start(tmp_path, cache, *args, f"hydra.run.dir={run}")
    wait_for(logged_step(run, 2), proc)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 128 + signal.SIGTERM and "continue with" in out, out[-4000:]
    path = ckpt.latest(str(run))
    assert path is not None
    queue = torch.load(f"{path}/rank_0.pt", weights_only=False)["rollout"]["queue"]
    assert len(queue) == 1  # the batch asked ahead (S = 1) was received and saved
    out = train(tmp_path, cache, *args, f"hydra.run.dir={run}", "resume=auto")
    assert "resumed from" in out
    assert [r["step"] for r in metric_rows(run) if "async/staleness_max" in r] == list(range(1, 7))


def rollout_worker(proc):
    """The torchrun worker with RANK=1 (the rollout rank) under the run `proc`."""
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == "1" and "rlcli.commands.worker" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stuck", "dead"])
def test_a_stuck_or_dead_rollout_rank_ends_the_job_with_an_error(tmp_path, cache, how):
    """SIGSTOP (stuck) or SIGKILL (dead) the rollout rank after step 1: the job ends with an error within
    hw.collective_timeout_s (20 s here), never hangs."""
    run = tmp_path / "run"
    proc = start(tmp_path, cache, "steps=50", "hw=cpu_x2", "rollout.async.max_staleness=1", *FAST,
                 "hw.collective_timeout_s=20", "hw.shutdown_timeout_s=5", "eval.before=false", f"hydra.run.dir={run}")
    wait_for(logged_step(run, 1), proc)
    worker = rollout_worker(proc)
    assert worker is not None
    t0 = time.time()
    worker.send_signal(signal.SIGSTOP if how == "stuck" else signal.SIGKILL)
    try:
        code, out = finish(proc, timeout=120)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):  # already gone, as it should be
            kill_tree(proc)
    assert code != 0 and time.time() - t0 < 90
    if how == "stuck":
        assert "asynchronous rollout: waited 20 s" in out
