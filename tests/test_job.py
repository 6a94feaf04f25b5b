"""The job harness (rlcli/loop/job.py), checked once on a job of a few lines: a resumed run continues bit for bit
(the state saved whole by its fields, the RNGs, the trainer's weights), SIGTERM finishes the step, writes a checkpoint
and says how to continue, and the end of a run writes result.json and the end summary. `rlcli train` and `rlcli rm`
run on it; their own states and steps are checked in tests/test_checkpoint.py and tests/test_rm.py."""

import json
import os
import signal
from dataclasses import dataclass, field, fields

import pytest
import torch
from conftest import FAST, compose

from rlcli.loop import checkpoint as ckpt
from rlcli.loop.job import Job
from rlcli.loop.state import Carried


@dataclass
class Tally(Carried):
    step: int = 0
    train_seconds: float = 0.0
    result: dict = field(default_factory=dict)
    total: float = 0.0
    """A plain field: saved because it is a field, with no line of code naming it."""


class Toy(Job):
    """Each step draws 3 numbers from torch's RNG and adds them to its weights `w`."""

    NAME = "toy"
    EVAL = ("eval/w", "the weights' sum")

    def __init__(self, cfg, stop_at: int | None = None):
        super().__init__(cfg)
        self.world, self.eval_every, self.stop_at = 1, 2, stop_at
        self.w = torch.zeros(3)
        self.state = Tally()
        self.resume()

    def train_step(self, step):
        draw = torch.rand(3)
        self.w += draw
        self.state.total += float(draw.sum())
        if step == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)  # as Slurm's preemption, during the step
        return {"draw": float(draw.sum()), "total": self.state.total}

    def end_step(self, step, metrics):
        self.state.step = step

    def evaluate(self, when=""):
        return {"eval/w": float(self.w.sum())}

    def summary(self):
        return "toy job"

    def step_line(self, metrics, step):
        return f"step {step}  draw={metrics['draw']:.6f}"

    def postfix(self, metrics):
        return {}

    def save_weights(self, path):
        torch.save(self.w, os.path.join(path, "w.pt"))

    def load_weights(self, path):
        self.w = torch.load(os.path.join(path, "w.pt"))

    def save_final(self):
        path = os.path.join(self.cfg.run_dir, "w.pt")
        torch.save(self.w, path)
        return "toy_path", path, "torch.load loads it"

    def outputs(self):
        return ["  w.pt            the weights"] if "toy_path" in self.state.result else []


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """toy(run, steps, **kw) -> a Toy on FAST (the tiny model at random init: its path is resolved, never loaded)."""
    monkeypatch.setenv("RLCLI_CACHE", str(tmp_path / "cache"))

    def make(run: str, steps: int, *overrides: str, **kw):
        cfg = compose(*FAST, "hw.num_threads=1", f"steps={steps}", "checkpoint.every=2", *overrides,
                      run_dir=str(tmp_path / run))
        os.makedirs(cfg.run_dir, exist_ok=True)
        return Toy(cfg, **kw)

    return make


def rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_job_resumed_continues_bit_for_bit_and_sigterm_stops_it_after_a_checkpoint(toy, tmp_path, capfd):
    """A straight run of 5 steps against one stopped by SIGTERM during step 3 (the step finishes, step_3 is written,
    the resume command named) and resumed with resume=auto: the same draws at every step (the RNG), the same weights
    and tally (the trainer's weights, a plain field of the state), one evaluation before training and every 2 steps;
    result.json and the end summary say what the run left."""
    straight = toy("straight", 5)
    straight.fit()
    with pytest.raises(ckpt.Stopped) as stop:
        toy("stopped", 5, stop_at=3).fit()
    assert stop.value.code == 128 + signal.SIGTERM
    said = capfd.readouterr().out
    assert "stopped by SIGTERM after step 3; checkpoint:" in said and "rlcli toy" in said and "resume=auto" in said
    assert ckpt.done_steps(str(tmp_path / "stopped")) == [2, 3]
    resumed = toy("stopped", 5, "resume=auto")
    assert resumed.state.step == 3 and resumed.state.total == pytest.approx(rows(tmp_path / "stopped")[-1]["total"])
    result = resumed.fit()
    assert torch.equal(resumed.w, straight.w) and resumed.state.total == straight.state.total
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "stopped")
    draws = lambda rs: {r["step"]: r["draw"] for r in rs if "draw" in r}  # noqa: E731
    assert draws(a) == draws(b) and sorted(draws(a)) == [1, 2, 3, 4, 5]
    assert [r["step"] for r in a if "eval/w" in r] == [2, 4]  # every 2 steps, not at the last (after training is)
    assert result["eval_after"]["eval/w"] == float(straight.w.sum()) and result["toy_path"].endswith("w.pt")
    on_disk = json.loads((tmp_path / "stopped" / "result.json").read_text())
    assert on_disk["eval_before"] == {"eval/w": 0.0} and "rlcli_version" in on_disk
    said = capfd.readouterr().out
    assert "resumed from" in said and "the weights' sum after training" in said and "w.pt            the weights" in said


def test_a_state_is_saved_whole_by_its_fields():
    """Carried.state_dict holds every field (no list to forget one) and the RNGs; load_state_dict restores each."""
    s = Tally(step=4, train_seconds=1.5, result={"a": 1}, total=2.25)
    saved = s.state_dict()
    assert set(saved) == {f.name for f in fields(Tally)} | {"rng"}
    back = Tally()
    back.load_state_dict(saved)
    assert back == s
