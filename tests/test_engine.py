"""The DeepSpeed-backed Engine: LR warmup/schedule via transformers.get_scheduler, global grad-norm
clipping, and a step with a non-finite grad norm skipped (counted, never applied)."""

import math

import pytest
import torch

from rlcli import engine as eng
from rlcli.config import HWConfig, OptimConfig
from rlcli.models.tiny import TinyModelConfig, build_tiny_model, load_tiny_tokenizer


def make_engine(**optim):
    hw = HWConfig(num_threads=1)
    eng.init_distributed(hw)
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                             load_tiny_tokenizer(), seed=0)
    return eng.Engine(model, hw, OptimConfig(**optim), total_steps=10)


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
