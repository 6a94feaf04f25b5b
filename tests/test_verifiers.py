"""verifiers environments (env=verifiers): a taskset's tasks as rows, its harness driving the policy through the
gateway, its rubric as the reward (weights honoured and replaceable, each reward and metric logged), faults as scored
episodes, config errors before any model loads, and a trainer step. The environments are tests/vf_envs/arith.py
(single-turn, two rewards and a metric) and tests/vf_envs/calc.py (multi-turn, an MCP tool: the calculator recipe's
conversation, so its rows must equal recipe=tools/calculator_agent's token for token). vLLM's side is in
tests/test_vllm.py."""

import json
import os

import pytest
import test_gateway
import torch
from conftest import ROOT, compose

from rlcli.config import validate
from rlcli.core.answers import extract_final_answer_or_none
from rlcli.core.schema import ConfigError
from rlcli.rollout import Sampling

pytest.importorskip("verifiers.v1", reason="env=verifiers needs verifiers (make install has it)")

VF = ["env=verifiers", "env.template=plain", "env.tool_format=compact", "env.max_turns=2", "env.episode_workers=2",
      "env.episodes_per_worker=16", "data.eval_size=8"]
"""recipe=tools/calculator_agent's conversation (template, tool format, turns), its agent a verifiers environment."""


@pytest.fixture(autouse=True)
def _tool_servers_import_the_tests(monkeypatch, tmp_path):
    """verifiers starts a taskset's tool server as `python -m <module>`: tests/ on its path; its runtime's scratch
    under the test's HOME."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HOME", str(tmp_path))


def vf_cfg(path, *overrides):
    cfg = compose(*VF, f"model.path={path}", "model.name=hf", *overrides, run_dir="/tmp/unused")
    validate(cfg)
    return cfg


policy = test_gateway.policy  # the fixture: the calculator recipe's warm-started policy, its tokenizer and HF engine


def rollout_of(policy, *overrides):
    from rlcli.rollout.agent import AgentRollout

    _, tok, multi_turn, path = policy
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
        cfg = vf_cfg(path, *overrides)
        return AgentRollout(multi_turn.engine, tok, cfg), cfg


def release(rollout):
    rollout.pool.close()
    rollout.gateway.shutdown()


def rows_of(cfg, split="train", k=12):
    from rlcli.data import load_examples

    ex = load_examples(cfg.data, split, cfg.seed, env_cfg=cfg.env)[:k]
    return [e["prompt"] for e in ex], [e["answer"] for e in ex]


def gold(answers):
    return [json.loads(a)["answer"] for a in answers]


# ------------------------------------------------------------------------------------------------ rows and rubric


def test_the_held_out_tasks_are_chosen_by_id_and_never_trained_on(policy):
    cfg = vf_cfg(policy[3], "env.verifiers.id=vf_envs.arith", "data.eval_size=10", "data.train_size=40")
    train, _ = rows_of(cfg, "train", 1000)
    evals, _ = rows_of(cfg, "eval", 1000)
    assert len(train) == 40 and len(evals) == 10
    ids = lambda rows: {json.loads(a)["id"] for a in rows_of(cfg, rows, 1000)[1]}  # noqa: E731
    assert ids("train").isdisjoint(ids("eval"))
    again = vf_cfg(policy[3], "env.verifiers.id=vf_envs.arith", "data.eval_size=10", "data.train_size=40", "seed=7")
    assert rows_of(again, "eval", 1000) == rows_of(cfg, "eval", 1000)  # seed-independent


@pytest.mark.slow
def test_a_verifiers_episode_is_the_calculator_agents_episode_token_for_token(policy):
    """vf_envs.calc through verifiers (its interception server, its MCP tool server, rlcli's in-process chat harness)
    asks the policy exactly what recipe=tools/calculator_agent's agent asks: greedy rows equal token for token,
    masks, truncation and turns included; its rubric's reward is weight x score of what the policy wrote."""
    from rlcli.rollout.agent import AgentRollout

    _, tok, multi_turn, path = policy
    vf, cfg = rollout_of(policy, "env.verifiers.id=vf_envs.calc")
    plain = compose("recipe=tools/calculator_agent", f"model.path={path}", "model.name=hf", "env.episode_workers=2",
                    "env.episodes_per_worker=16", run_dir="/tmp/unused")
    validate(plain)
    agent = AgentRollout(multi_turn.engine, tok, plain)
    try:
        prompts, answers = rows_of(cfg)
        a = agent.generate(prompts, gold(answers), 1, Sampling(48, 0.0))
        b = vf.generate(prompts, answers, 1, Sampling(48, 0.0))
    finally:
        release(agent)
        release(vf)
    for k in ("prompt_ids", "prompt_mask", "response_ids", "token_mask", "response_mask", "truncated"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert torch.equal(a.extras["env/turns"], b.extras["env/turns"])
    assert b.extras["env/errors"].sum() == 0 and b.extras["env/timeouts"].sum() == 0
    used = (b.extras["env/turns"] > 1).float()
    assert torch.equal(b.extras["agent/used_tool"], used) and used.sum() > 0
    assert torch.equal(b.extras["agent/correct"], a.extras["env/reward"])  # the calculator agent's own verdict
    assert torch.allclose(b.extras["env/reward"], 1.0 * b.extras["agent/correct"] + 0.1 * used)
    assert torch.equal(b.extras["env/acc"], b.extras["agent/correct"])


def test_the_rubric_is_the_reward_its_weights_replaceable_and_each_part_logged(policy):
    """vf_envs.arith (single-turn): env/reward = 1 x correct + 0.25 x brief, each computed here from the text the policy
    wrote; env.verifiers.weights replaces a weight; env.verifiers.acc names the reward that is the acc; the metric
    is logged."""
    sampled = Sampling(24, 1.0)
    for weights, acc, w_brief in (([], "correct", 0.25), (["env.verifiers.weights={brief:2.0}",
                                                         "env.verifiers.acc=brief"], "brief", 2.0)):
        rollout, cfg = rollout_of(policy, "env.verifiers.id=vf_envs.arith", *weights)
        try:
            prompts, answers = rows_of(cfg, k=8)
            b = rollout.generate(prompts, answers, 2, sampled)
        finally:
            release(rollout)
        assert b.extras["env/errors"].sum() == 0
        correct = torch.tensor([float(extract_final_answer_or_none(t) == g) for t, g in
                                zip(b.texts, [g for g in gold(answers) for _ in range(2)])])
        reply = [t.strip() for t in b.texts]  # verifiers' Trace.last_reply: the reply stripped
        brief = torch.tensor([float(len(t) <= 12) for t in reply])
        chars = torch.tensor([float(len(t)) for t in reply])
        assert torch.equal(b.extras["agent/correct"], correct) and torch.equal(b.extras["agent/brief"], brief)
        assert torch.equal(b.extras["agent/reply_chars"], chars)
        assert torch.allclose(b.extras["env/reward"], correct + w_brief * brief)
        assert torch.equal(b.extras["env/acc"], {"correct": correct, "brief": brief}[acc])
        assert 0 < brief.sum() < len(brief) or 0 < correct.sum() < len(correct)  # the rubric tells rows apart


def test_an_episode_verifiers_marks_failed_scores_zero_and_is_counted(policy):
    """A reward that raises (vf_envs.arith's poisoned answers) fails its episode in verifiers: env/errors 1 there, and the
    trainer's reward stage scores it 0; the other episodes are untouched."""
    from rlcli.rewards import RewardManager

    cfg = vf_cfg(policy[3], "env.verifiers.id=vf_envs.arith")
    prompts, answers = rows_of(cfg, k=6)
    poison = gold(answers)[:2]
    rollout, cfg = rollout_of(policy, "env.verifiers.id=vf_envs.arith", f"env.verifiers.args={{task:{{poison:{poison}}}}}")
    try:
        b = rollout.generate(prompts, answers, 1, Sampling(24, 0.0))
    finally:
        release(rollout)
    failed = torch.tensor([float(g in poison) for g in gold(answers)])
    assert torch.equal(b.extras["env/errors"], failed)
    with RewardManager.for_run(cfg, policy[1]) as rewards:
        scored, _ = rewards.reward_batch(b)
    assert (scored.scores[failed.bool()] == 0).all() and (scored.acc[failed.bool()] == 0).all()
    assert torch.equal(scored.scores[~failed.bool()], b.extras["env/reward"][~failed.bool()])


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("overrides, message", [
    (["env.verifiers.id=no_such_taskset"], "cannot be loaded"),
    (["env.verifiers.id=vf_envs.arith", "env.verifiers.weights={style:1.0}"], "'style' is no reward"),
    (["env.verifiers.id=vf_envs.arith", "env.verifiers.acc=style"], "'style' is no reward"),
    (["env.verifiers.id=null"], "needs its taskset"),
    (["env.verifiers.id=vf_envs.arith", "data.source=arith", "data.train_size=100"], "data.source=arith"),
    (["env.verifiers.id=vf_envs.arith", "rollout.agent=rlcli.envs.calculator:agent"], "add env=verifiers"),
])
def test_config_errors_name_the_fix_before_any_model_loads(overrides, message):
    cfg = compose(*VF, *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_reward_none_is_for_agents_only():
    with pytest.raises(ConfigError, match="reward=none only with rollout.agent"):
        validate(compose("reward=none"))


# ------------------------------------------------------------------------------------------------ the trainer


@pytest.mark.slow
def test_a_verifiers_environment_trains_a_step_and_evaluates(tmp_path, monkeypatch, calculator_cache):
    """env=verifiers with vf_envs.calc in the trainer: the rubric's reward is the score (reward=none adds nothing), its acc
    the row's; its parts logged and documented; held-out evaluation runs the environment too."""
    from metric_names import undocumented

    from rlcli.envs.verifiers import _inspected
    from rlcli.loop.trainer import Trainer

    monkeypatch.setenv("RLCLI_CACHE", str(tmp_path / "cache"))
    cfg = compose(*VF, "env.verifiers.id=vf_envs.calc", "rollout.max_new_tokens=48", f"model.path={calculator_cache[1]}",
                  "model.name=hf", "rollout.prompts_per_step=4", "rollout.n=4", "data.eval_size=4",
                  "reward.num_workers=1", "hw.num_threads=1", "eval.before=false", run_dir=str(tmp_path / "run"))
    _inspected.cache_clear()
    validate(cfg)
    t = Trainer(cfg)
    try:
        assert _inspected.cache_info().misses == 1  # the checks, the metric names and both splits read one Env
        b, _ = t.collect(t.timer, 1)
        assert torch.equal(b.scores, b.extras["env/reward"]) and torch.equal(b.acc, b.extras["env/acc"])
        assert b.acc.sum() > 0
        metrics = t.train_step(1)
        assert {"env/reward", "env/acc", "env/errors", "agent/correct", "agent/used_tool"} <= set(metrics)
        assert not undocumented(set(metrics))
        assert 0 < t.evaluate()["eval/acc"] <= 1
    finally:
        t.rewards.close()
        t.rollout.close()


def test_a_missing_extra_names_it(monkeypatch):
    import sys

    from rlcli.envs.verifiers import _inspected

    _inspected.cache_clear()  # an earlier test's loaded environment would answer without importing anything
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if verifiers were not installed
    with pytest.raises(ConfigError, match=r"env=verifiers needs verifiers .*pip install 'rlcli\[verifiers\]'"):
        validate(compose(*VF, "env.verifiers.id=vf_envs.arith"))


def test_verifiers_is_imported_only_by_env_verifiers():
    """The schema, validation and a run without env=verifiers never import verifiers (3-12 s and ~5,000 modules)."""
    import subprocess
    import sys

    code = ("import sys\nfrom conftest import compose\nfrom rlcli.config import validate\n"
            "validate(compose('env=openenv', 'env.openenv.app=rlcli.envs.openenv_example:app'))\n"
            "validate(compose())\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'verifiers'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_cli_refuses_a_taskset_that_does_not_load_in_one_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rlcli.commands.cli", "train", "env=verifiers",
                          "env.verifiers.id=no_such_taskset"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = [x for x in out.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "env.verifiers.id=no_such_taskset cannot be loaded" in lines[0], out.stderr[-2000:]
