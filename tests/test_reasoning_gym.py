"""reasoning-gym as data and reward (data=reasoning_gym; docs/environments.md): rows and their ground-truth payload,
the reward of right, wrong, partial and malformed answers (acc = a full score), the held-out split (one seed for
every run, never trained on), task weights, the one-line errors, per-task metrics, and `rlcli train` through the real CLI on
the tiny model and on SmolLM2. Offline; the fast tests need no model."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import compose, metric_rows, rlcli
from omegaconf import OmegaConf

from rlcli.core.schema import ConfigError
from rlcli.data import load_split
from rlcli.data.config import DataConfig, validate
from rlcli.data.reasoning_gym import EVAL_SEED, shares, task_names, task_of

rg = pytest.importorskip("reasoning_gym", reason="pip install 'rlcli[reasoning-gym]'")

INSTRUCTION = ("\n\nThink step by step, then give your final answer between <answer> and </answer> tags, with nothing "
               "else inside them.")


def data_cfg(tasks, **overrides):
    cfg = OmegaConf.structured(DataConfig(source="reasoning_gym", template="answer_tag", train_size=40, eval_size=10))
    cfg.reasoning_gym.tasks = tasks
    for key, value in overrides.items():
        setattr(cfg, key, value)
    validate(cfg)
    return cfg


def questions(rows):
    return [json.loads(r["answer"])["entry"]["question"] for r in rows]


# ---------------------------------------------------------------------------- rows and rewards, by hand
def test_a_chain_sum_row_carries_its_task_config_and_entry_and_the_prompt_asks_for_an_answer_tag():
    train, report = load_split(data_cfg(["chain_sum"], train_size=3), "train", seed=0)
    first = rg.create_dataset("chain_sum", size=3, seed=0)  # the rows are the task's own entries, seed 0
    payload = json.loads(train[0]["answer"])
    assert set(payload) == {"task", "config", "entry"} and payload["task"] == "chain_sum" and payload["config"] == {}
    # the entry as reasoning-gym made it, through JSON (tuples read back as lists), shuffled among the task's rows
    assert payload["entry"] in [json.loads(json.dumps(e)) for e in first]
    assert train[0]["prompt"] == payload["entry"]["question"] + INSTRUCTION  # no tokenizer: the templated text
    assert task_of(train[0]["answer"]) == "chain_sum" and task_of("42") is None and task_of('{"tests": []}') is None
    assert report.kept == 3 and "reasoning-gym (chain_sum x1; seed 0)" in report.summary()


def test_the_reward_is_the_tasks_own_score_of_the_last_answer_tag_and_acc_a_full_score():
    from rlcli.rewards.functions import score_item, setup_worker
    from rlcli.rewards.reasoning_gym import reasoning_gym_reward

    entry = {"question": "State the final answer to the following arithmetic problem: 40 + 2 =", "answer": "42",
             "metadata": {"source_dataset": "chain_sum"}}
    truth = json.dumps({"task": "chain_sum", "config": {}, "entry": entry})
    cases = {
        "So 40 + 2 = 42.\n<answer>42</answer>": 1.0,
        "<answer>41</answer> no, <answer> 42 </answer>": 1.0,  # the last tag, stripped (reasoning-gym's extract_answer)
        "<answer>43</answer>": 0.0,
        "<answer>= 42</answer>": 0.5,  # chain_sum's partial credit: len("42") / len("= 42")
        "The answer is 42.": 0.0,  # no tag: no answer
        "<answer>42": 0.0,  # an unclosed tag: no answer
    }
    for response, want in cases.items():
        assert reasoning_gym_reward(response, truth) == pytest.approx(want), response
    setup_worker({"parts": ["reasoning_gym"], "custom": {}, "options": {}, "max_response_chars": 10_000})
    full, partial = (score_item((r, truth)) for r in ("<answer>42</answer>", "<answer>= 42</answer>"))
    assert (full["acc"], full["parts"]["reasoning_gym"]) == (1.0, 1.0)
    assert (partial["acc"], partial["parts"]["reasoning_gym"]) == (0.0, 0.5)  # partial credit is no acc


def test_a_scorer_that_raises_scores_zero_and_counts_as_an_error():
    from rlcli.rewards import RewardManager
    from rlcli.rewards.config import RewardConfig

    good = json.dumps({"task": "chain_sum", "config": {}, "entry": {"question": "1 + 1 =", "answer": "2"}})
    broken = json.dumps({"task": "chain_sum", "config": {}, "entry": {"question": "1 + 1 ="}})  # no answer: KeyError
    with RewardManager(RewardConfig(weights={"reasoning_gym": 1.0}, num_workers=1)) as rewards:
        out = rewards(["<answer>2</answer>", "<answer>2</answer>", "<answer>2</answer>"], [good, broken, "2"])
    assert out.parts["reasoning_gym"].tolist() == [1.0, 0.0, 0.0] and out.acc.tolist() == [1.0, 0.0, 0.0]
    assert out.metrics["reward/errors"] == 2.0  # the scorer's KeyError, a ground truth that is no payload


# ---------------------------------------------------------------------------- the split and the weights
def test_training_rows_use_the_run_seed_and_held_out_rows_one_seed_for_every_run():
    cfg = data_cfg(["chain_sum"], train_size=30, eval_size=20)
    train, _ = load_split(cfg, "train", seed=7)
    evals, report = load_split(cfg, "eval", seed=7)
    assert EVAL_SEED == 2**31 and f"seed {2**31}" in report.summary()
    assert sorted(questions(train)) == sorted(e["question"] for e in rg.create_dataset("chain_sum", size=30, seed=7))
    assert sorted(questions(evals)) == sorted(e["question"] for e in rg.create_dataset("chain_sum", size=20,
                                                                                      seed=2**31))
    assert load_split(cfg, "eval", seed=8)[0] == evals  # a seed sweep is scored on the same questions
    assert questions(load_split(cfg, "train", seed=8)[0]) != questions(train)


def test_a_training_question_that_is_a_held_out_question_is_dropped_and_counted():
    """One-digit sums of two terms: 200 distinct questions, so 300 training rows hold most of the 50 held-out ones."""
    cfg = data_cfg([{"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}],
                   train_size=300, eval_size=50)
    evals, report = load_split(cfg, "eval", seed=0)
    assert report.kept == 50 and report.held_out == 0  # the held-out set whole, whatever the training size
    train, report = load_split(cfg, "train", seed=0)
    assert not set(questions(train)) & set(questions(evals))
    assert report.held_out == 300 - len(train) > 0 and report.rows == 300
    assert f"{report.held_out} that are held-out questions dropped" in report.summary()


def test_weights_are_the_tasks_shares_of_the_rows():
    assert shares(10, [1, 1, 1]) == [4, 3, 3] and shares(100, [1, 3]) == [25, 75] and shares(7, [2, 0.5]) == [6, 1]
    cfg = data_cfg(["chain_sum", {"name": "count_bits", "weight": 3}], train_size=100, eval_size=20)
    for split, size in (("train", 100), ("eval", 20)):
        rows, _ = load_split(cfg, split, seed=0)
        counts = {t: sum(task_of(r["answer"]) == t for r in rows) for t in ("chain_sum", "count_bits")}
        assert counts == {"chain_sum": size // 4, "count_bits": 3 * size // 4}, split
        first = [task_of(r["answer"]) for r in rows[: size // 4]]
        assert set(first) == {"chain_sum", "count_bits"}, split  # shuffled together, not one task's block first
    assert task_names(cfg) == ["chain_sum", "count_bits"]


def test_a_tasks_config_reaches_create_dataset():
    cfg = data_cfg([{"name": "chain_sum", "config": {"min_terms": 3, "max_terms": 3, "max_digits": 1}}], train_size=10)
    rows, _ = load_split(cfg, "train", seed=0)
    assert all(q.count(" + ") + q.count(" - ") == 2 for q in questions(rows))
    assert {json.dumps(json.loads(r["answer"])["config"], sort_keys=True) for r in rows} == {
        '{"max_digits": 1, "max_terms": 3, "min_terms": 3}'}


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("tasks,needle", [
    ([], "needs data.reasoning_gym.tasks"),
    ([{"name": "chain_sum", "weight": 0}], "tasks[0].weight=0 must be a number > 0"),
    ([{"name": "chain_sum", "config": {"seed": 3}}], "tasks[0].config.seed is set by the split"),
    ([{"name": "chain_sum", "wieght": 2}], "tasks[0].wieght is not a task key"),
    ([3], "give a task name or a mapping"),
])  # fmt: skip
def test_a_malformed_task_list_fails_validation(tasks, needle):
    with pytest.raises(ConfigError) as e:
        data_cfg(tasks)
    assert needle in str(e.value)


def test_an_unknown_task_names_the_close_ones_and_a_bad_config_the_argument():
    with pytest.raises(ConfigError, match=r"tasks\[1\]: 'chain_summ' is not a reasoning-gym task \(did you mean "
                                          r"chain_sum"):
        load_split(data_cfg(["gcd", "chain_summ"]), "train", seed=0)
    with pytest.raises(ConfigError, match=r"reasoning-gym's chain_sum rejects it \(TypeError"):
        load_split(data_cfg([{"name": "chain_sum", "config": {"max_digitz": 2}}]), "train", seed=0)


def test_a_missing_package_names_the_install_command(monkeypatch):
    from rlcli.data.loaders import check_files

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'rlcli\[reasoning-gym\]'"):
        check_files(data_cfg(["chain_sum"]))


def test_the_reward_and_the_data_come_together():
    from rlcli.config import validate as validate_run

    with pytest.raises(ConfigError, match="use data=reasoning_gym, which selects reward=reasoning_gym"):
        validate_run(compose("data=reasoning_gym", "reward=math_verify"))
    with pytest.raises(ConfigError, match="reward.weights.reasoning_gym scores reasoning-gym's ground truths"):
        validate_run(compose("reward=reasoning_gym"))
    cfg = compose("data=reasoning_gym")
    validate_run(cfg)
    assert dict(cfg.reward.weights) == {"reasoning_gym": 1.0} and cfg.data.template == "answer_tag"


def one_line_error(tmp_path, *argv, code=None):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "rlcli.commands.cli"]
    out = subprocess.run([*cmd, "train", *argv, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**env, "RLCLI_CACHE": str(tmp_path / "cache")})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("rlcli: error: "), out.stderr[-3000:]
    assert not (tmp_path / "cache").exists()  # refused before any model was built or loaded
    return lines[0]


@pytest.mark.slow
def test_the_cli_refuses_an_unknown_task_a_missing_package_and_the_warm_started_tiny_model_in_one_line(tmp_path):
    line = one_line_error(tmp_path, "data=reasoning_gym", "model.warm_start.enabled=false",
                          "data.reasoning_gym.tasks=[spell_backwards]")
    assert "'spell_backwards' is not a reasoning-gym task (did you mean spell_backward" in line
    code = ("import sys; sys.modules['reasoning_gym'] = None\n"
            "from rlcli.commands.cli import main\nmain(sys.argv[1:])\n")
    line = one_line_error(tmp_path, "data=reasoning_gym", "model.warm_start.enabled=false", code=code)
    assert "pip install 'rlcli[reasoning-gym]'" in line
    line = one_line_error(tmp_path, "data=reasoning_gym")  # model=tiny warm-started: reads only 'Q: a+b=?\nA:'
    assert "data.reasoning_gym.tasks: the embedded tiny model (model=tiny, the default) reads only" in line


# ---------------------------------------------------------------------------- per-task metrics
def test_step_metrics_have_acc_and_reward_per_task():
    from metric_names import undocumented

    from rlcli.core.batch import RolloutBatch
    from rlcli.rollout.sampler import sampling_metrics

    def truth(task):
        return json.dumps({"task": task, "config": {}, "entry": {}})

    n = 6
    tasks = ["chain_sum", "chain_sum", "chain_sum", "gcd", "gcd", "gcd"]
    ones, zeros = torch.ones(n, 2, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
    b = RolloutBatch(prompt_ids=ones, prompt_mask=ones, response_ids=ones, response_mask=ones.float(),
                     truncated=zeros, group_index=torch.tensor([0, 0, 0, 1, 1, 1]), answers=[truth(t) for t in tasks],
                     texts=[""] * n, scores=torch.tensor([1.0, 0.5, 0.0, 1.0, 1.0, 0.25]),
                     acc=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]))
    counts = {"dynamic_sampling/gen_batches": 1.0, "dynamic_sampling/generated_groups": 2.0,
              "dynamic_sampling/kept_groups": 2.0, "dynamic_sampling/carried": 0.0}
    m = sampling_metrics(b, [b], {}, counts, tasks=["chain_sum", "gcd", "count_bits"])
    assert m["acc/chain_sum"] == pytest.approx(1 / 3) and m["reward/chain_sum"] == pytest.approx(0.5)
    assert m["acc/gcd"] == pytest.approx(2 / 3) and m["reward/gcd"] == pytest.approx(0.75)
    assert "acc/count_bits" not in m and m["acc/mean"] == pytest.approx(0.5)  # a task no row drew: left out
    assert "acc/chain_sum" not in sampling_metrics(b, [b], {}, counts)  # no tasks (other data): no per-task keys
    assert not undocumented(m, tasks=("chain_sum", "gcd"))


def test_held_out_metrics_have_acc_per_task():
    from metric_names import undocumented

    from rlcli.loop.eval import metrics

    def row(task, correct):
        return {"answer": json.dumps({"task": task, "config": {}, "entry": {}}), "correct": correct, "answers": None}

    m = metrics([row("chain_sum", [True, False]), row("chain_sum", [True, True]), row("gcd", [False, False])],
                OmegaConf.create({"pass_ks": []}))
    assert m["eval/acc/chain_sum"] == 0.75 and m["eval/acc/gcd"] == 0.0 and m["eval/acc"] == pytest.approx(0.5)
    assert not undocumented(m, tasks=("chain_sum", "gcd"))


# ---------------------------------------------------------------------------- through the real CLI
def step_and_after(run):
    """The training step's metrics row and the after-training evaluation's (eval.before adds a row at step 0)."""
    rows = metric_rows(run)
    return next(r for r in rows if "acc/mean" in r), next(r for r in rows if "eval/acc_after" in r)


def per_task_keys(row):
    return {k for k in row if k.startswith(("acc/", "reward/")) and k.split("/", 1)[1] in ("chain_sum", "count_bits")}


@pytest.mark.slow
def test_one_training_step_on_the_tiny_model_logs_per_task_metrics(tmp_path):
    """The tiny model at random init (the warm-started one reads only its arithmetic prompts): its character
    vocabulary covers chain_sum's and count_bits' ASCII prompts; a random model scores 0, the metrics are what counts."""
    from metric_names import undocumented

    run = tmp_path / "run"
    rlcli(tmp_path, "train", "data=reasoning_gym", "model.warm_start.enabled=false",
          "data.reasoning_gym.tasks=[chain_sum,count_bits]", "data.train_size=16", "data.eval_size=4",
          "data.max_prompt_len=256", "steps=1", "rollout.prompts_per_step=4", "rollout.n=2",
          "rollout.max_new_tokens=8", "reward.num_workers=1", "save=false", "hw.num_threads=1",
          f"hydra.run.dir={run}")
    step, after = step_and_after(run)
    assert step["step"] == 1 and per_task_keys(step) and {k.split("/")[0] for k in per_task_keys(step)} == {"acc", "reward"}
    assert any(k.startswith("eval/acc/") and k.endswith("_after") for k in after)
    assert not undocumented({**step, **after}, reward_parts=("reasoning_gym",), tasks=("chain_sum", "count_bits"))


@pytest.mark.slow
def test_one_training_step_on_smollm2_logs_per_task_metrics(converted, tmp_path):
    from metric_names import undocumented

    cache, _ = converted
    os.symlink(cache / "cache", tmp_path / "cache")  # the conversion made once for the session
    run = tmp_path / "run"
    rlcli(tmp_path, "train", "model=smollm2-135m", "data=reasoning_gym",
          "data.reasoning_gym.tasks=[chain_sum,count_bits]", "data.train_size=16", "data.eval_size=2", "steps=1",
          "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=16", "reward.num_workers=1",
          "eval.before=false", "save=false", f"hydra.run.dir={run}")
    step, after = step_and_after(run)
    assert per_task_keys(step) and "acc/mean" in step and "reward/reasoning_gym" in step
    assert any(k.startswith("eval/acc/") and k.endswith("_after") for k in after)
    assert not undocumented({**step, **after}, reward_parts=("reasoning_gym",), tasks=("chain_sum", "count_bits"))
