"""Starting a job: the offline environment, the run directory Hydra chose, the frozen config, and the torchrun workers
that train from it (rlcli.commands.worker). Shared by the commands that launch jobs (rlcli.commands.cli: train, eval, sft; rlcli.commands.rm:
rm) and by the workers themselves."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, NoReturn


def offline_environment() -> None:
    """Offline by default: nothing may download weights or datasets at run time."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")
    # User code named by a dotted path (reward.custom, env.name, env.tools) imports from the working folder, as
    # under `python -m`; appended, so a file there never shadows an installed module. Reward workers inherit
    # sys.path (rlcli/core/workers.py), torchrun workers run under `python -m`.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def exit_now(code: int | str | None, join_timeout_s: float = 60.0) -> NoReturn:
    """End this process as the interpreter would, less its teardown of every loaded module: 1.3-1.7 s with torch,
    transformers and DeepSpeed loaded (measured on 2 cores), paid by each launcher and each worker. First what a
    normal exit does that matters: the other non-daemon threads are joined, the atexit handlers run (logging's
    shutdown, which flushes the log files; weakref finalizers, such as the reward workers' and the vLLM engine's
    shutdown; the logger backends'), stdout and stderr are flushed; a str `code` is printed and ends with status 1,
    as SystemExit's does. Where the interpreter would wait forever, threads still running after `join_timeout_s` are
    named in an error and left behind (status 1 if it was 0). For `rlcli` and the torchrun workers only: `main()`
    returns, for callers that go on.
    A process that loaded vLLM exits the usual way: its CPU backend unlinks its shared-memory segments (/dev/shm) in
    destructors that only the teardown runs, and a leaked one makes the next engine of that layout fail (EEXIST)."""
    import atexit
    import threading
    import time

    if "vllm" in sys.modules:
        raise SystemExit(code)

    deadline = time.monotonic() + join_timeout_s
    stuck = []
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
            stuck += [thread.name] if thread.is_alive() else []
    atexit._run_exitfuncs()  # what the interpreter runs at exit (no public name)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    if stuck:  # where the interpreter would wait forever
        print(f"rlcli: error: threads still running {join_timeout_s:g} s after the end, left behind: "
              f"{', '.join(stuck)}", file=sys.stderr)
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)


def run_dir(cfg: Any) -> str:
    """Hydra's output directory as cfg.run_dir (which the command line may not set)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    if not OmegaConf.is_missing(cfg, "run_dir"):
        raise SystemExit(
            f"run_dir={cfg.run_dir} is set by Hydra, not on the command line: pass "
            f"hydra.run.dir={cfg.run_dir} (a single run) or hydra.sweep.dir={cfg.run_dir} (with -m)"
        )
    out = HydraConfig.get().runtime.output_dir
    with open_dict(cfg):
        cfg.run_dir = out
    return out


def freeze(cfg: Any) -> str:
    """run_dir/config.yaml (node 0), or config.node<r>.yaml for the other nodes of a multi-node run that
    share the run directory; written to a temp name and renamed, so a worker never reads half of it."""
    from omegaconf import OmegaConf

    name = "config.yaml" if cfg.hw.node_rank == 0 else f"config.node{cfg.hw.node_rank}.yaml"
    path = os.path.join(cfg.run_dir, name)
    OmegaConf.save(cfg, path + ".tmp", resolve=True)
    os.replace(path + ".tmp", path)
    return path


def launch(frozen_config: str, hw: Any, job: str = "train") -> None:
    """Run `hw.nproc` workers of `job` (rlcli.commands.worker.WORKERS: train | rm) under torchrun. The first
    SIGTERM/SIGINT/SIGHUP reaches the workers once, through torchrun, which gives them hw.shutdown_timeout_s to
    checkpoint; later ones are not passed on (a second signal would cut torchrun's wait short), except that a
    second SIGINT kills them all at once.
    If this process dies, torchrun gets SIGTERM (Linux), so no worker outlives it."""
    import contextlib
    import signal

    import psutil

    from rlcli.core.topology import free_port

    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={hw.nproc}",
        f"--nnodes={hw.nnodes}", f"--node_rank={hw.node_rank}", f"--master_addr={hw.master_addr}",
        f"--master_port={hw.master_port or free_port()}", f"--shutdown-timeout={hw.shutdown_timeout_s}",
        "-m", "rlcli.commands.worker", frozen_config, job,
    ]
    from rlcli.loop.metrics import RunLog

    RunLog(os.path.dirname(frozen_config))("launching: " + " ".join(cmd))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Own session: a terminal's Ctrl-C reaches this process only, and is forwarded exactly once.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        if received and signum == signal.SIGINT:
            with contextlib.suppress(psutil.NoSuchProcess):
                for p in [*psutil.Process(proc.pid).children(recursive=True), proc]:
                    p.kill()
        if not received:
            proc.send_signal(signum)
        received.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        print(f"workers stopped by {signal.Signals(received[0]).name}; see the log above", file=sys.stderr)
        raise SystemExit(128 + received[0])
    if code:  # not the user's mistake: the workers printed their tracebacks above
        print(f"rlcli: workers failed with exit code {code}; see the log above", file=sys.stderr, flush=True)
        raise SystemExit(1)


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to send it SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
