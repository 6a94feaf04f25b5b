"""End-to-end: the real CLI, real DeepSpeed engine, real math-verify workers, tiny model on CPU.

The policy is the tiny model at random init (no warm-start, to keep the suite fast) and the reward
adds a user function (count of '7' characters) so every group has reward variance and the policy
gradient is not zero from step 1.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT, cli_env, compose, metric_rows, rlcli
from omegaconf import OmegaConf

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    run = tmp / "run"
    out = rlcli(tmp, "train", "steps=2", "logger=wandb", "eval.every=1", "checkpoint.hf_every=1", f"hydra.run.dir={run}",
                *FAST)
    return tmp, run, out


def test_two_steps_change_every_parameter_and_log_finite_metrics(two_step_run):
    tmp, run, out = two_step_run
    from transformers import AutoModelForCausalLM

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "reward/mean", "acc/mean",
                  "response_length/mean", "timing_s/rollout", "timing_s/update", "adv/std"):
            assert k in r and r[k] == r[k] and abs(r[k]) != float("inf"), (k, r)
        assert r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0
        assert r["reward/sevens"] >= 0
    # Every parameter tensor moved away from the initial (cached random-init) weights.
    init_dir = next((tmp / "cache" / "warm_start").iterdir())
    before = AutoModelForCausalLM.from_pretrained(init_dir)
    after = AutoModelForCausalLM.from_pretrained(run / "policy")
    b, a = dict(before.named_parameters()), dict(after.named_parameters())
    assert b.keys() == a.keys()
    unchanged = [n for n in b if torch.equal(b[n], a[n])]
    assert not unchanged, unchanged
    # Every logged key is defined in the metrics glossary.
    from metric_names import undocumented

    assert not undocumented({k for r in rows for k in r}, reward_parts=("sevens", "math_verify")), rows[-1].keys()
    # The start-up summary states the units and what was loaded.
    for text in ("trajectories N=P*G   16", "reference model=yes", "old-logprob pass     skipped (on-policy: one mini-batch, one epoch)",
                 "prompts              each group's prompt once per micro-batch (sdpa attention, a block mask; checked"):
        assert text in out.stdout


def test_run_dir_holds_resolved_config_and_wandb_offline_files(two_step_run):
    _, run, _ = two_step_run
    cfg = OmegaConf.load(run / "config.yaml")
    assert cfg.run_dir == str(run) and cfg.steps == 2 and cfg.reward.weights.sevens == 1.0
    assert list((run / "wandb").glob("offline-run-*")), "wandb offline run directory missing"
    result = json.loads((run / "result.json").read_text())
    logged = next(r for r in metric_rows(run) if "eval/acc_after" in r)
    assert result["eval_after"]["eval/acc"] == logged["eval/acc_after"]  # one evaluation, reported twice


def test_saved_policy_reloads_and_generates(two_step_run):
    _, run, _ = two_step_run
    from transformers import AutoModelForCausalLM

    from rlcli.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "policy")
    tok = load_tokenizer(str(run / "policy"))
    ids = tok("Q: 12+7=?\nA:", return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]
    assert tok.decode(out[0]).startswith("Q: 12+7=?\nA:")  # the prompt, then what the policy wrote


def test_hf_every_saves_policies_that_from_pretrained_loads(two_step_run):
    """checkpoint.hf_every=1: run_dir/hf/step_1 and step_2, each a Hugging Face model with its tokenizer; step_2 is
    the final policy, step_1 the policy after one update (not a copy of the final one)."""
    _, run, _ = two_step_run
    from transformers import AutoModelForCausalLM

    from rlcli.models import load_tokenizer

    final = AutoModelForCausalLM.from_pretrained(run / "policy").state_dict()
    steps = {n: AutoModelForCausalLM.from_pretrained(run / "hf" / f"step_{n}").state_dict() for n in (1, 2)}
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_1", "step_2"]
    assert steps[2].keys() == final.keys() and all(torch.equal(steps[2][k], final[k]) for k in final)
    assert any(not torch.equal(steps[1][k], final[k]) for k in final)
    assert load_tokenizer(str(run / "hf" / "step_1"))("Q: 1+2=?")["input_ids"]


def test_the_run_log_holds_what_the_terminal_showed_and_nothing_is_noise(two_step_run):
    """run_dir/cli.log holds the start-up summary, the step lines (with KL, lr, tokens/s, memory), the held-out
    accuracy and the end summary (where the results are, the offline wandb run and how to sync it, what to run
    next), in the order the terminal showed them. None of the noise of every run: DeepSpeed's accelerator probe
    warning and its op probe's gcc command lines, transformers' generate deprecation."""
    _, run, out = two_step_run
    log = (run / "cli.log").read_text()
    story = ["memory plan", "trajectories N=P*G   16", "step 1  acc=", "step 2  acc=", f"saved {run / 'hf' / 'step_2'}",
             "held-out accuracy after training: ", f"saved policy to {run / 'policy'}",
             "done: 2 steps, ", f"results in {run}", "  hf/             step_1 step_2", "wandb sync ", "next:",
             "rlcli eval ", f"model.path={run / 'policy'}", f"rlcli plot {run}"]
    at = [log.find(text) for text in story]
    assert -1 not in at and at == sorted(at), dict(zip(story, at))
    assert all(text in out.stdout for text in story)
    step2 = next(line for line in log.splitlines() if "step 2  acc=" in line)
    for field in ("kl=", "lr=0.001", "tok/s=", "mem=", "grad_norm="):
        assert field in step2, step2
    synced = log.split("wandb sync ")[1].split()[0]
    assert (run / "wandb").resolve() in Path(synced).resolve().parents and Path(synced).is_dir(), synced
    for noise in ("gcc ", "Setting accelerator to CPU", "generation_config` together with generation-related"):
        assert noise not in out.stdout + out.stderr, noise


def test_periodic_eval_uses_the_eval_code(two_step_run):
    _, run, _ = two_step_run
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step1 = next(r for r in rows if r["step"] == 1 and "actor/pg_loss" in r)
    assert {"eval/acc", "eval/acc_avg@1", "eval/pass@1", "eval/maj@1", "eval/response_length"} <= step1.keys()


def test_rlcli_eval_samples_k_and_writes_summary(two_step_run):
    tmp, run, _ = two_step_run
    out_dir = tmp / "eval"
    out = rlcli(tmp, "eval", f"model.path={run / 'policy'}", "eval.k=4", "eval.temperature=1.0", "eval.top_p=0.7",
                "eval.pass_ks=[1,2,4]", "data.eval_size=6", "rollout.max_new_tokens=24", f"hydra.run.dir={out_dir}")
    summary = json.loads((out_dir / "eval_summary.json").read_text())
    for k in ("eval/acc_avg@4", "eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/maj@4", "eval/response_length",
              "eval/truncated_frac"):
        assert 0.0 <= summary[k] <= (24 if "length" in k else 1.0), k
    assert summary["eval/prompts"] == 6 and summary["eval/pass@1"] == pytest.approx(summary["eval/acc_avg@4"])
    assert summary["eval/pass@1"] <= summary["eval/pass@2"] <= summary["eval/pass@4"]
    rows = [json.loads(x) for x in (out_dir / "eval_per_prompt.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(len(r["responses"]) == 4 and len(r["correct"]) == 4 for r in rows)
    assert "eval/acc_avg@4" in out.stdout


def test_the_printed_next_eval_command_evaluates_the_runs_own_task(two_step_run):
    """The end summary's `rlcli eval` line carries the run's task (its data, reward and eval overrides, here FAST's
    four held-out prompts and its custom reward), not the defaults (the built-in task's held-out set)."""
    import shlex

    tmp, run, out = two_step_run
    for when in ("before training", "at step 1", "after training"):  # evaluation inside the run shows its progress
        assert f"held-out {when}" in out.stderr, out.stderr[-2000:]
    line = next(x.strip() for x in out.stdout.splitlines() if x.strip().startswith("rlcli eval "))
    args = shlex.split(line)[2:]
    assert f"model.path={run / 'policy'}" in args and not any(a.startswith(("steps=", "logger=", "hydra.")) for a in args)
    rlcli(tmp, "eval", *args, f"hydra.run.dir={tmp / 'next_eval'}")
    summary = json.loads((tmp / "next_eval" / "eval_summary.json").read_text())
    assert summary["eval/prompts"] == 4  # data.eval_size=4 of the run; the default would be the built-in task's


def test_multirun_makes_one_run_per_seed_and_save_false_saves_nothing(tmp_path):
    """Two runs of one step each; save=false: no policy, no checkpoint (not even at the last step, which
    checkpoint.every's schedule includes), no Hugging Face snapshot, whatever checkpoint.* says."""
    sweep = tmp_path / "sweep"
    out = rlcli(tmp_path, "train", "-m", "seed=1,2", "steps=1", "eval.before=false", "save=false",
                "checkpoint.every=1", "checkpoint.hf_every=1", f"hydra.sweep.dir={sweep}", *FAST)
    runs = sorted(p for p in sweep.iterdir() if (p / "config.yaml").exists())
    assert [p.name for p in runs] == ["0_seed=1", "1_seed=2"]  # folders named by the swept values
    assert sorted(OmegaConf.load(p / "config.yaml").seed for p in runs) == [1, 2]
    assert all((p / "metrics.jsonl").exists() and (p / "result.json").exists() for p in runs)
    for p in runs:
        assert not {"policy", "checkpoints", "hf", "critic"} & {q.name for q in p.iterdir()}, sorted(p.iterdir())
    assert out.stdout.count("save=false: no policy and no checkpoint written") == 2
    assert out.stdout.count("checkpoints    none: save=false writes no weights") == 2  # the summary says so first
    assert "saved policy" not in out.stdout and "rlcli eval model.path" not in out.stdout


def test_cpu_x2_is_launched_by_rlcli_train(tmp_path):
    run = tmp_path / "run"
    out = rlcli(tmp_path, "train", "hw=cpu_x2", "steps=1", "save=false",
                f"hydra.run.dir={run}", *FAST)
    assert "world size 2" in out.stdout + out.stderr
    assert "launching:" in out.stdout and "launching:" in (run / "cli.log").read_text()
    assert "step 1  acc=" in (run / "cli.log").read_text()  # rank 0 of the workers writes it too
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("actor/pg_loss" in r for r in rows)


def one_update(tmp_path, nproc, configs: dict[str, list[str]]) -> dict[str, dict]:
    """The trainer's update on one fixed batch for each of `configs` (name -> overrides of FAST), all in one run of
    tests/helpers/one_update.py in `nproc` processes (torchrun for 2): each one's metrics and gradients, by name."""
    from rlcli.core.topology import free_port

    frozen = []
    for name, extra in configs.items():
        cfg = compose(*FAST, f"hw.nproc={nproc}", *extra, run_dir=str(tmp_path / name))
        os.makedirs(cfg.run_dir, exist_ok=True)
        frozen.append(str(tmp_path / f"{name}.yaml"))
        OmegaConf.save(cfg, frozen[-1], resolve=True)
    script = str(ROOT / "tests" / "helpers" / "one_update.py")
    cmd = [sys.executable, script] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}", script]
    out = subprocess.run([*cmd, str(tmp_path / "updates.pt"), *frozen], capture_output=True, text=True,
                         timeout=900, env=cli_env(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return torch.load(tmp_path / "updates.pt")


LOSS_CASES = [("token_mean", "grpo"), ("seq_mean_token_mean", "grpo"), ("seq_mean_token_sum", "grpo"),
              ("seq_sum_const", "grpo"), ("token_mean", "reinforce_pp")]


SHARED_CASES = {
    **{algo: [f"algo={algo}", "data.min_digits=1", "data.max_digits=3", "hw.micro_batch=6"]
       for algo in ("grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "cispo", "ppo", "vapo")},
    "lora": ["model.lora.r=4", "data.min_digits=1", "data.max_digits=3"],
}


def loss_case(agg, algo):
    # 1- to 3-digit operands: prompts of different lengths, so micro-batches trim prompt padding too.
    return [f"algo={algo}", f"algo.loss_agg={agg}", "data.min_digits=1", "data.max_digits=3"]


def auto_budget_memory() -> float:
    """A device memory (GiB) with room for the activations of 4 of the longest FAST rows (one group) but not 5 (the
    plan's own numbers), so that hw.max_tokens_per_micro_batch=auto splits the update."""
    from rlcli.plan.estimate import BUDGET, estimate, micro_slots, with_overrides
    from rlcli.plan.inputs import measure_prompts
    from rlcli.plan.states import GIB

    cfg = compose(*FAST)
    prompt = measure_prompts(cfg)
    at = [estimate(with_overrides(cfg, {BUDGET: micro_slots(cfg, prompt[0], rows)}), prompt).peak for rows in (4, 5)]
    assert at[0] < at[1]  # the update's activations set the peak
    return (at[0] + at[1]) / 2 / GIB


SP = ["hw.share_prompts=false", "hw.sp_size=2"]
"""Sequence parallelism over the two ranks of the torchrun (each row's positions in two slices; no shared prompt)."""
SP_CASES = {name: SHARED_CASES[name] for name in ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "ppo", "vapo", "lora")}
SP_CASES["checkpointing"] = [*SHARED_CASES["grpo"], "model.gradient_checkpointing=true"]  # backward recomputes
ALST = ["model.gradient_checkpointing=true", "hw.offload_checkpoints=true", "hw.tiled_mlp=true",
        "hw.tiled_mlp_positions=8"]
"""ALST's savings beside Ulysses (rlcli/engine/alst.py): checkpoints in host memory, the MLP in tiles of 8 positions."""
SP_BASE = {"gspo": "gspo-rows-two", "cispo": "cispo-rows-two", "zero3": "zero3-rows-two"}
"""The sequence-parallel updates' baselines where a single process is not one: GSPO's and CISPO's 4 mini-batches are
each rank's own groups, so their baseline is the two ranks' data-parallel update; the others' is one process's."""


@pytest.fixture(scope="module")
def updates(tmp_path_factory, calculator_cache):
    """Every update this file compares, on one fixed batch: those of one process in one helper process, those of
    two in one torchrun (one start-up each, not one per update)."""
    one = {f"{agg}-{algo}": loss_case(agg, algo) for agg, algo in LOSS_CASES}
    # Micro-batches of at most 3 rows and 100 token slots, packed longest first and trimmed of padding.
    micro = {f"{name}-micro": [*extra, "hw.micro_batch=3", "hw.max_tokens_per_micro_batch=100"]
             for name, extra in one.items()}
    zero = {"zero0": [], "auto": [f"hw.device_memory_gb={auto_budget_memory()}"],
            **{f"zero{stage}-micro": [f"hw.zero_stage={stage}", "hw.micro_batch=3"] for stage in (1, 2, 3)}}
    # Each group's prompt once (hw.share_prompts, the default) against a forward per row, for every algorithm.
    shared = {f"{name}-{kind}": [*extra, f"hw.share_prompts={kind == 'shared'}"]
              for name, extra in SHARED_CASES.items() for kind in ("shared", "rows")}
    # A multi-turn batch (the calculator's warm start calls the tool in half its rows): observation tokens in rows.
    turns = ["env=calculator", f"model.path={calculator_cache[1]}", "model.name=hf", "hw.micro_batch=6",
             "rollout.max_new_tokens=48"]
    checkpointing = {"checkpointing-rows": [*SP_CASES["checkpointing"], "hw.share_prompts=false"]}
    single = one_update(tmp_path_factory.mktemp("one"), 1, {**one, **micro, **zero, **shared, **checkpointing,
                                                            "multiturn-rows": [*turns, "hw.share_prompts=false"],
                                                            "lora-alst": [*SHARED_CASES["lora"], *ALST, "hw.share_prompts=false"]})
    two = one_update(tmp_path_factory.mktemp("two"), 2, {**one, **{f"zero3-{kind}": [
        "hw.zero_stage=3", "hw.micro_batch=3", f"hw.share_prompts={kind == 'shared'}"] for kind in ("shared", "rows")},
        **{f"{name}-rows": [*SHARED_CASES[name], "hw.share_prompts=false"] for name in ("gspo", "cispo")},
        **{f"{name}-sp": [*extra, *SP] for name, extra in SP_CASES.items()},
        "zero3-sp": ["hw.zero_stage=3", "hw.micro_batch=3", *SP], "multiturn-sp": [*turns, *SP],
        "zero3-alst": ["hw.zero_stage=3", "hw.micro_batch=3", "hw.share_prompts=false", *ALST],
        "zero3-per_layer": ["hw.zero_stage=3", "hw.micro_batch=3", "hw.share_prompts=false",
                            "rollout.zero3_generation=per_layer"],
        "ppo-sp-alst": [*SHARED_CASES["ppo"], "hw.zero_stage=2", *ALST, *SP]})
    return single | {f"{name}-two": result for name, result in two.items()}


@pytest.mark.parametrize("agg,algo", LOSS_CASES)
def test_two_processes_and_micro_batches_give_the_same_step(updates, agg, algo):
    """Same batch: 1 process with one micro-batch, 1 process with micro-batches of 3, and 2 processes
    must give the same step-1 loss and the same gradient (all-reduced, accumulated, before clipping), and
    log the same batch statistics (reward, accuracy, lengths, advantages: reduced over ranks, not rank 0's).

    Parameters are not compared: Adam's first step is lr·g/(|g|+eps), which turns rounding noise in
    near-zero gradient entries into differences of order lr·1e-2. Tolerances: 1e-5 relative on
    metrics, and on gradients 1e-5 of each tensor's largest entry, cover float32 summation
    order (gloo all-reduce, accumulation over backward calls); a per-micro-batch or per-rank
    normalizer would be off by a factor of 2 or more. REINFORCE++ whitens its returns over the batch: with
    per-rank statistics its advantages (and adv/mean, adv/std) would differ. With the sequence-level modes the step-1 GRPO
    loss is a sum of group-centred advantages, zero up to rounding, hence the absolute 1e-7.
    """
    base, micro, dist = (updates[f"{agg}-{algo}{kind}"] for kind in ("", "-micro", "-two"))
    assert base["metrics"]["actor/grad_norm"] > 0
    assert len(base["prompt_lengths"]) > 1, base["prompt_lengths"]  # micro-batches do trim prompts
    if (agg, algo) == ("token_mean", "grpo"):  # whitened REINFORCE++ advantages have mean 0: so has its loss
        assert abs(base["metrics"]["actor/pg_loss"]) > 1e-4  # a loss worth comparing
    for other in (micro, dist):
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "reward/mean", "reward/std",
                  "reward/sevens", "acc/mean", "acc/pool_mean", "response_length/mean", "response_length/max",
                  "prompt_length/mean", "response_length/clip_ratio", "adv/mean", "adv/std", "actor/reward_kl", "actor/kl_coef"):
            if k in ("actor/kl_loss", "actor/reward_kl", "actor/kl_coef") and k not in base["metrics"]:
                continue  # the KL sits in the loss (grpo) or in the reward (reinforce_pp)
            assert other["metrics"][k] == pytest.approx(base["metrics"][k], rel=1e-5, abs=1e-7), k
        assert other["grads"].keys() == base["grads"].keys() and len(base["grads"]) > 10
        for n, g in base["grads"].items():
            scale = g.abs().max().item()
            assert (other["grads"][n] - g).abs().max().item() <= 1e-5 * scale + 1e-12, n


def test_the_auto_token_budget_splits_the_update_and_changes_nothing_else(updates):
    """hw.max_tokens_per_micro_batch=auto (the default) on a device with room for the activations of 4 of the
    longest rows but not 5 (the plan's own numbers): the update runs in several micro-batches, where this
    machine's 24 GiB take the whole batch in one, and its loss, entropy and gradient equal the one micro-batch's."""
    base, auto = updates["zero0"], updates["auto"]
    assert base["metrics"]["perf/micro_batches"] == 1 and auto["metrics"]["perf/micro_batches"] > 1
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert auto["metrics"][k] == pytest.approx(base["metrics"][k], rel=1e-5, abs=1e-7), k
    for n, g in base["grads"].items():
        assert (auto["grads"][n] - g).abs().max().item() <= 1e-5 * g.abs().max().item() + 1e-12, n


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_stages_accumulate_micro_batches(updates, zero_stage):
    """The loop runs forward passes on the module, not through DeepSpeed's engine.forward, where ZeRO's
    optimizers close a micro-step; without that each ZeRO-3 backward overwrote the gradient partitions and
    only the last micro-batch's gradient was applied (grad norm 1.54 instead of 2.95 here). One micro-batch
    at ZeRO-0 and micro-batches of 3 rows at ZeRO-1/2/3 must give the same gradient norm (1e-5 relative:
    summation order)."""
    base, micro = updates["zero0"], updates[f"zero{zero_stage}-micro"]
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert micro["metrics"][k] == pytest.approx(base["metrics"][k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("case", [*SHARED_CASES, "zero3"])
def test_each_groups_prompt_once_gives_the_update_of_a_forward_per_row(updates, case):
    """hw.share_prompts (the default: each group's prompt computed once per micro-batch, its responses attending to
    that copy) against a forward per row, on the same batch, for every algorithm (PPO and VAPO: the critic's values,
    value loss and gradient too), LoRA, and ZeRO-3 over two ranks: the same losses and statistics to 1e-6 relative
    (1e-7 absolute for the zero-mean ones), and the same gradient to 1e-6 in relative L2 norm (measured 4-5e-7; each
    tensor within 1e-5 of its largest entry, as the tests above: a prompt's gradient now sums its rows' contributions
    inside one attention backward, in another order). Micro-batches of 6 rows (3 with ZeRO-3) hold one group of 4
    whole and split another, so partial groups share too."""
    suffix = "-two" if case == "zero3" else ""
    same_update(updates[f"{case}-shared{suffix}"], updates[f"{case}-rows{suffix}"], case)


def same_update(other: dict, base: dict, case: str) -> None:
    """`other`'s update equals `base`'s: the per-token log-probs of the batch to 1e-6 (fp32), every actor, critic and
    advantage statistic to 1e-6 relative (1e-7 absolute), the gradients (the critic's too, for ppo and vapo) to 1e-6
    in relative L2 norm, each tensor within 1e-5 of its largest entry."""
    assert base["metrics"]["actor/grad_norm"] > 0
    assert (other["logprobs"] - base["logprobs"]).abs().max() <= 1e-6 and base["logprobs"].abs().max() > 1
    keys = [k for k in base["metrics"] if k.startswith(("actor/", "critic/", "adv/")) and not k.endswith("lr")]
    assert {"actor/pg_loss", "actor/entropy"} <= set(keys) and (case not in ("ppo", "vapo") or "critic/vf_loss" in keys)
    for k in keys:
        assert other["metrics"][k] == pytest.approx(base["metrics"][k], rel=1e-6, abs=1e-7), k
    for which in ("grads", "critic_grads"):
        a, b = base[which], other[which]
        assert a.keys() == b.keys() and (which == "grads" or case not in ("ppo", "vapo") or a)
        if not a:
            continue
        gap = torch.cat([(b[n] - g).flatten() for n, g in a.items()]).norm()
        assert gap <= 1e-6 * torch.cat([g.flatten() for g in a.values()]).norm(), which
        for n, g in a.items():
            assert (b[n] - g).abs().max().item() <= 1e-5 * g.abs().max().item() + 1e-12, n


@pytest.mark.parametrize("case", [*SP_CASES, "zero3", "multiturn"])
def test_sequence_parallel_over_two_ranks_gives_the_update_of_whole_sequences(updates, case):
    """hw.sp_size=2 on two ranks (each row's positions split in two slices, attention through DeepSpeed's Ulysses
    all-to-all, the per-position outputs gathered) against the same batch without sequence parallelism (SP_BASE), for
    grpo, dapo, dr_grpo, gspo, cispo, ppo and vapo (the critic's values and value loss too), LoRA, ZeRO-3, activation
    checkpointing (the backward recomputes sliced forwards) and a multi-turn batch (observation tokens inside rows):
    `same_update`. Prompts of 1-3 digit operands: rows of different lengths, padded. A gradient handed back as the
    group's sum instead of each rank's slice, a normalizer counting the group's pooled rows twice, or a rank reducing
    over its own slice only moves these by factors (each tried, docs/sequence_parallel.md)."""
    base = updates[SP_BASE.get(case, f"{case}-rows")]
    assert case not in SP_CASES or case in SP_BASE or len(base["prompt_lengths"]) > 1  # padded prompts
    if case == "multiturn":
        assert base["metrics"]["observed_rows"] > 0  # rows with tool output between their turns
    same_update(updates[f"{case}-sp-two"], base, case)


@pytest.mark.parametrize("case", ["lora", "zero3", "ppo-sp"])
def test_long_sequence_savings_give_the_same_update(updates, case):
    """hw.tiled_mlp (tiles of 8 positions) with hw.offload_checkpoints (and gradient checkpointing) against the
    plain update of the same batch: LoRA in one process, ZeRO-3 over two ranks (each tile fetches the MLP's
    parameters: the ranks agree on a tile count), and PPO (the critic too) at ZeRO-2 with sequence parallelism over
    two ranks against one process. ZeRO-2 keeps no full gradients to compare (its partitions), so there the log-probs,
    losses and both gradient norms are compared; without the MLP's parameters handed to TiledMLP, ZeRO-2 reduces a
    gradient after the first tile and stops with "already been reduced" (tried)."""
    if case == "ppo-sp":
        base, other = updates["ppo-rows"], updates["ppo-sp-alst-two"]
        assert (other["logprobs"] - base["logprobs"]).abs().max() <= 1e-6
        for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
            assert other["metrics"][k] == pytest.approx(base["metrics"][k], rel=1e-6, abs=1e-7), k
        return
    base, other = (updates["lora-rows"], updates["lora-alst"]) if case == "lora" else (
        updates["zero3-rows-two"], updates["zero3-alst-two"])
    same_update(other, base, case)


def test_zero3_generation_with_the_model_gathered_once_samples_what_layer_by_layer_does(updates):
    """rollout.zero3_generation over two ZeRO-3 ranks: auto (gathered here: the plan fits the whole model) generates
    the same batch as per_layer (each layer gathered at every decoding step, every rank stepping until all are done),
    so the same update follows (`same_update`); the rollout engine ran gathered in the first and not in the second;
    inside rlcli.engine.generation_weights every parameter is whole, and after it the parameters are partitioned again
    (a no-op context, or one that never releases, fails this)."""
    gathered, per_layer = updates["zero3-rows-two"], updates["zero3-per_layer-two"]
    same_update(gathered, per_layer, "zero3")
    assert gathered["engine_gathered"] is True and per_layer["engine_gathered"] is False
    assert updates["zero0"]["engine_gathered"] is None
    assert gathered["generation_weights"] == (True, True)
    assert updates["zero0"]["generation_weights"] is None


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_cpu_x2_dynamic_sampling_with_train_on_partial_never_deadlocks(tmp_path, zero_stage):
    """Two ranks keep different numbers of informative groups when the generation cap is hit. They must
    agree on one count (the minimum) and so run the same optimizer steps and collectives: the run
    finishes (the subprocess timeout turns a deadlock into a failure) and rank 0 logs global counts.
    Under ZeRO-3 every forward pass is a collective too: ranks carrying different numbers of groups still
    run the same old-log-prob passes."""
    run = tmp_path / "run"
    out = rlcli(tmp_path, "train", *FAST, "hw=cpu_x2", f"hw.zero_stage={zero_stage}", "hw.collective_timeout_s=120",
          "algo=dapo", "steps=2", "save=false", "eval.before=false", "algo.filter_metric=score",
          "rollout.overlong_buffer_len=4", "algo.max_gen_batches=1", "algo.train_on_partial=true",
          "rollout.prompts_per_step=16", "rollout.gen_prompts_per_step=16", "rollout.n=2", "algo.mini_batches=2",
          "rollout.max_new_tokens=24",  # groups of two: the count of 7s ties in some, not in others
          f"hydra.run.dir={run}", timeout=900)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["dynamic_sampling/gen_batches"] == 1 and 0 < r["dynamic_sampling/kept_fraction"] < 1
        assert r["actor/grad_norm"] > 0
    # The tiny model's cache entry (a warm start takes minutes on a cold cache) is made by the launcher before the
    # workers start: both ranks find it cached, so neither waits for the other under hw.collective_timeout_s.
    assert (out.stdout + out.stderr).count("warm start: cache hit") >= 2, out.stderr[-3000:]


COMMON_X2 = ["steps=3", "eval.before=false", "hw.num_threads=1", "hw.micro_batch=64", *FAST,
             "rollout.max_new_tokens=24"]  # rows long enough that ZeRO-3's token budget packs tighter (tested)


def train_steps(run):
    return [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]


@pytest.fixture(scope="module")
def x2_run(tmp_path_factory):
    """3 GRPO steps (with its KL reference) of hw=cpu_x2 at ZeRO-0: the baseline of the launch and ZeRO tests."""
    tmp = tmp_path_factory.mktemp("x2")
    rlcli(tmp, "train", "hw=cpu_x2", f"hydra.run.dir={tmp / 'run'}", *COMMON_X2)
    return tmp / "run"


def test_two_nodes_on_localhost_train_like_cpu_x2(tmp_path, x2_run):
    """Multi-node launch: two `rlcli train` commands, one per "node" (hw.nnodes=2, hw.node_rank=0|1, one
    process each, rendezvous at 127.0.0.1), train 3 steps as one world of 2 ranks, with the same step-1
    loss and statistics as hw=cpu_x2 (the same two ranks launched on one node)."""
    from rlcli.core.topology import free_port

    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "rlcli.commands.cli", "train", "hw.nnodes=2", f"hw.node_rank={r}", "hw.master_addr=127.0.0.1",
         f"hw.master_port={port}", f"hydra.run.dir={tmp_path / 'nodes'}", "save=false", *COMMON_X2],
        cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "world size 2" in outs[0] and "--nnodes=2 --node_rank=1" in outs[1]
    x2, two_nodes = train_steps(x2_run), train_steps(tmp_path / "nodes")
    assert [r["step"] for r in two_nodes] == [1, 2, 3]
    for k in ("actor/pg_loss", "actor/grad_norm", "reward/mean", "acc/mean", "response_length/mean"):
        assert two_nodes[0][k] == pytest.approx(x2[0][k], rel=1e-6, abs=1e-9), k


def test_sequence_parallel_over_two_ranks_trains_like_data_parallel(tmp_path, x2_run):
    """hw=cpu_x2 hw.sp_size=2: the two ranks form one sequence-parallel group (each row's positions in two slices,
    Ulysses attention, the KL reference sliced too) and train the same 3 steps as the two data-parallel ranks: every
    step's loss, gradient norm, KL and batch statistics to 1e-5 relative (no shared prompts here: rounding)."""
    run = tmp_path / "sp"
    out = rlcli(tmp_path, "train", "hw=cpu_x2", "hw.sp_size=2", "hw.collective_timeout_s=120", "save=false",
                f"hydra.run.dir={run}", *COMMON_X2)
    assert "sequence parallel: groups of 2 ranks (Ulysses attention), data-parallel size 1" in out.stdout + out.stderr
    x2, sp = train_steps(x2_run), train_steps(run)
    assert [r["step"] for r in sp] == [1, 2, 3]
    for a, b in zip(x2, sp):
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "reward/mean", "acc/mean",
                  "response_length/mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (a["step"], k)


def test_zero3_over_two_ranks_trains_like_zero0(tmp_path, x2_run):
    """hw=cpu_x2 hw.zero_stage=3: the policy and the KL reference are built partitioned (each rank loads its
    share), generation runs with synchronised ranks, and token-budget micro-batches (different counts on
    each rank before they agree) keep every forward pass a matched collective. It must train the same 3
    steps as ZeRO-0 and save the same full policy.

    Tolerances: step metrics 1e-5 relative (float32 summation order: ZeRO-3 reduce-scatters gradients in
    buckets, and micro-batches split the sums differently); a wrong normalizer or a rank's missing share
    moves actor/grad_norm by a factor, a wrong reference moves actor/kl_loss. Final weights: 3 Adam steps at
    lr 1e-3 move each entry by about 3e-3, and near-zero gradient entries turn rounding noise into update
    differences well below lr: measured at most 1.3e-5 on an entry after 3 steps, asserted 1e-4; a policy
    saved from one rank's partition, or not saved after training, is off by the whole update (3e-3)."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "z3"
    out = rlcli(tmp_path, "train", "hw=cpu_x2", "hw.zero_stage=3", "hw.collective_timeout_s=120",
                "hw.max_tokens_per_micro_batch=200", "checkpoint.hf_every=3", f"hydra.run.dir={run}", *COMMON_X2)
    assert "ZeRO-3" in out.stdout and "parameters     0.00M" not in out.stdout
    z0, z3 = train_steps(x2_run), train_steps(run)
    assert [r["step"] for r in z3] == [1, 2, 3]
    for r0, r3 in zip(z0, z3):
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "reward/mean", "acc/mean",
                  "response_length/mean", "adv/std"):
            assert r3[k] == pytest.approx(r0[k], rel=1e-5, abs=1e-7), (r0["step"], k)
    assert z3[1]["actor/kl_loss"] > 0  # the reference differs from the policy after step 1
    assert max(r["perf/padding_frac"] for r in z3) < max(r["perf/padding_frac"] for r in z0)  # packed tighter
    a = AutoModelForCausalLM.from_pretrained(x2_run / "policy").state_dict()
    b = AutoModelForCausalLM.from_pretrained(run / "policy").state_dict()
    init_path = out.stdout.split("model          tiny: ")[1].split(" ")[0]
    init = AutoModelForCausalLM.from_pretrained(init_path).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - init[k]).abs().max().item() > 2e-3, k  # trained
        assert (a[k] - b[k]).abs().max().item() <= 1e-4, k
    # checkpoint.hf_every=3 gathers the same full policy from the partitions at step 3 (the last: the final one)
    hf = AutoModelForCausalLM.from_pretrained(run / "hf" / "step_3").state_dict()
    assert hf.keys() == b.keys() and all(torch.equal(hf[k], b[k]) for k in b)


def test_a_run_without_any_advantage_warns_and_names_a_small_held_out_set(make_trainer, capsys):
    """Every reward 0 (a reward weighted 0), so every group's rewards are equal and every advantage is 0: after
    NO_SIGNAL_STEPS steps in a row the step lines say so once, with what to try, and the end summary counts the
    steps; the start-up summary names a held-out set of 4 prompts."""
    from rlcli.loop.state import NO_SIGNAL_STEPS

    t = make_trainer("reward.weights.sevens=0.0", f"steps={NO_SIGNAL_STEPS + 1}", "save=false")
    t.fit()
    out = capsys.readouterr().out
    assert out.count("warning: 3 steps in a row with every advantage 0 (adv/std=0)") == 1, out[-3000:]
    assert "no reply was right" in out and "larger rollout.n" in out
    assert f"warning: {NO_SIGNAL_STEPS + 1} of the run's {NO_SIGNAL_STEPS + 1} steps had every advantage 0" in out
    assert "held-out accuracy will rest on 4 prompts (one prompt moves it 25 points)" in out
