"""What a run prints: the step line's fields and formats (golden strings), and the run log (run_dir/cli.log) that
holds what the terminal showed. The end-to-end checks (a real run's cli.log, its end summary, no noise) are in
tests/test_train.py::test_the_run_log_holds_what_the_terminal_showed_and_nothing_is_noise."""

import logging
import subprocess
import sys

from rlcli.loop.metrics import RunLog, headline, peak_mem_gb


def test_the_step_line_shows_kl_lr_throughput_and_memory_and_prints_rounding_noise_as_zero():
    """Losses in fixed point (a vf_loss of -1.1e-08 would read 0.0000, no minus sign), a pg_loss below 1e-6 left out
    (GRPO's on-policy value: sum_i A_i / N = 0 by construction, docs/metrics.md), a KL with three
    significant digits (its scale is the point) and below 1e-6 as 0, the KL to the reference whether it sits in the
    loss (actor/kl_loss) or in the reward (actor/reward_kl), tokens/s, peak memory; a metric the step did not log, or
    a non-finite one, is left out."""
    grpo = {"acc/mean": 0.25, "reward/mean": -0.4375, "response_length/mean": 15.0625, "actor/pg_loss": -1.1e-08,
            "actor/kl_loss": 0.000123456, "actor/ppo_kl": -3e-10, "actor/entropy": 4.4991, "actor/grad_norm": 0.99968,
            "actor/lr": 1e-3, "perf/tokens_per_s": 1808.6, "perf/peak_mem_gb": 0.6597, "timing_s/step": 0.3849,
            "adv/std": 0.6}
    assert headline(grpo, 2) == ("step 2  acc=0.250  reward=-0.438  len=15.1  kl=0.000123  ppo_kl=0  "
                                 "entropy=4.499  grad_norm=1.00  lr=0.001  tok/s=1809  mem=0.66GiB  s/step=0.38")
    ppo = {"acc/mean": 1.0, "reward/mean": 0.5, "response_length/mean": 120.0, "actor/pg_loss": -0.01234,
           "critic/vf_loss": 0.25, "actor/reward_kl": 0.0213, "actor/ppo_kl": 0.00042, "actor/entropy": 0.51,
           "actor/grad_norm": float("nan"), "actor/lr": 5e-7, "perf/peak_mem_gb": 12.345, "timing_s/step": 61.5}
    assert headline(ppo, 40) == ("step 40  acc=1.000  reward=0.500  len=120.0  pg_loss=-0.0123  vf_loss=0.2500  "
                                 "kl=0.0213  ppo_kl=0.00042  entropy=0.510  lr=5e-07  mem=12.35GiB  s/step=61.50")
    assert headline({"critic/vf_loss": -1.1e-08}, 1) == "step 1  vf_loss=0.0000"
    assert headline({"reward/mean": 0.0, "reward/rm": 1.234}, 3) == "step 3  reward=0.000  rm=1.234"  # raw, normalised


def test_the_run_log_writes_through_hydras_job_log_once_or_its_own(tmp_path):
    """Under `rlcli train` Hydra's root file handler writes run_dir/cli.log: the run log goes through it (one copy
    of each line, in order with rlcli's log messages, never echoed a second time on the console); without it (a
    torchrun worker, a Trainer built in code) the run log appends to run_dir/cli.log itself."""
    hydra_run, own_run = tmp_path / "hydra", tmp_path / "own"
    hydra_run.mkdir()
    job_log = logging.FileHandler(hydra_run / "cli.log")
    job_log.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    root = logging.getLogger()
    root.addHandler(job_log)
    try:
        logging.getLogger("rlcli.data").warning("data[train] 20 examples")
        say = RunLog(str(hydra_run))
        say("step 1  acc=0.250\nsecond line")
        say.close()
    finally:
        root.removeHandler(job_log)
        job_log.close()
    assert (hydra_run / "cli.log").read_text() == ("[rlcli.data] data[train] 20 examples\n"
                                                    "[rlcli.loop.trainer] step 1  acc=0.250\nsecond line\n")
    say = RunLog(str(own_run))
    say("held-out accuracy after training: 0.500")
    say.close()
    assert (own_run / "cli.log").read_text().endswith("][rlcli.loop.trainer] held-out accuracy after training: 0.500\n")


def test_a_process_started_by_a_larger_one_reports_its_own_peak_memory():
    """perf/peak_mem_gb is the process's own high-water mark: a child of a process holding 512 MiB more reports
    tens of MiB (getrusage's ru_maxrss, carried over fork and exec by Linux, reported the parent's peak: the
    peak-memory test read 1.3-4 GiB high after the pytest process had held a vLLM engine)."""
    held = bytearray(512 * 2**20)
    held[::4096] = b"\1" * len(held[::4096])  # touch every page: resident
    code = "from rlcli.loop.metrics import peak_mem_gb; print(peak_mem_gb())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert peak_mem_gb() > 0.5 and float(out.stdout) < 0.2, (peak_mem_gb(), out.stdout)


def test_a_set_up_shared_by_the_workers_is_built_once(tmp_path_factory, monkeypatch):
    """conftest.once_per_run: the first call builds, a later call (another xdist worker) reuses what it built."""
    from conftest import once_per_run

    monkeypatch.delenv("RLCLI_TEST_SHARED", raising=False)  # this run's folder, not a developer's kept one

    built = []

    def build(root):
        built.append(root)
        (root / "made").write_text("x")
        return str(root / "made")

    first, second = (once_per_run(tmp_path_factory, "shared-probe", build) for _ in range(2))
    assert first == second and len(built) == 1 and (first[0] / "made").read_text() == "x"
