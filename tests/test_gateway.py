"""Agents written against the OpenAI API as training episodes (rollout.agent): the gateway's routes and refusals,
the token contract of its rows (the tokens the policy sampled, verbatim, trained; everything else masked), the rows
equal to multi-turn rollout's for the same conversation, faults as scored episodes, config errors, and a trainer
step. The agents are in tests/agent_fixtures.py; vLLM's side is in tests/test_vllm.py."""

import json
import urllib.error
import urllib.request

import pytest
import torch
from conftest import compose

from rlcli.config import validate
from rlcli.core.schema import ConfigError
from rlcli.rollout import Sampling

AGENT = ["recipe=tools/calculator_agent", "env.episode_workers=2", "env.episodes_per_worker=16"]
"""The calculator as an agent (rlcli.envs.calculator:agent), 32 episodes at once."""


def prompts_of(k, seed=3):
    from rlcli.data.arith import arith_examples

    ex = arith_examples("train", k, seed=seed, min_digits=2, max_digits=2)
    return [e["prompt"] for e in ex], [e["answer"] for e in ex]


@pytest.fixture(scope="module")
def policy(calculator_cache):
    """The calculator recipe's warm-started policy, its tokenizer, and its HF engine (multi-turn, env=calculator)."""
    from rlcli.models.policy import load_policy
    from rlcli.rollout import build_engine

    _, path = calculator_cache
    cfg = compose("recipe=tools/calculator", f"model.path={path}", "model.name=hf", run_dir="/tmp/unused")
    model, tok = load_policy(cfg.model, path)
    multi_turn = build_engine("hf", model, tok, path, cfg)
    yield model, tok, multi_turn, path
    multi_turn.close()


def agent_rollout(policy, agent, *overrides):
    from rlcli.rollout.agent import AgentRollout

    _, tok, multi_turn, path = policy
    cfg = compose(*AGENT, f"model.path={path}", "model.name=hf", f"rollout.agent={agent}", *overrides,
                  run_dir="/tmp/unused")
    validate(cfg)
    return AgentRollout(multi_turn.engine, tok, cfg)


def release(rollout):
    """Stop an AgentRollout's workers and server, not the engine it shares."""
    rollout.pool.close()
    rollout.gateway.shutdown()


@pytest.fixture(scope="module")
def calculator_agent(policy):
    rollout = agent_rollout(policy, "rlcli.envs.calculator:agent")
    yield rollout
    release(rollout)


# ------------------------------------------------------------------------------------------------ the rows


@pytest.mark.slow
def test_an_agents_rows_are_the_rows_multi_turn_rollout_makes_of_the_same_conversation(policy, calculator_agent):
    """env=calculator's environment and the same conversation written as an OpenAI agent (tool calls parsed by the
    gateway, run by the agent, sent back as tool messages): greedy rows equal token for token, masks, truncation,
    turns and observation counts included."""
    prompts, answers = prompts_of(12)
    a = policy[2].generate(prompts, answers, 1, Sampling(48, 0.0))
    b = calculator_agent.generate(prompts, answers, 1, Sampling(48, 0.0))
    for k in ("prompt_ids", "prompt_mask", "response_ids", "token_mask", "response_mask", "truncated", "group_index"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert a.texts == b.texts
    for k in ("turns", "observation_tokens"):
        assert torch.equal(a.extras[f"env/{k}"], b.extras[f"env/{k}"]), k
    assert torch.equal(a.extras["env/tool_calls"], b.extras["agent/calls"])
    assert a.extras["env/used_tool"].sum() >= 3 and b.extras["env/errors"].sum() == 0  # multi-turn rows among them


@pytest.mark.slow
def test_sampled_agent_rows_hold_the_sampled_tokens_verbatim_and_mask_the_rest(policy, calculator_agent, monkeypatch):
    """At T=1, with spies on the engine and the tokenizer: each row is prompt ⊕ sampled₁ ⊕ observation₁ ⊕ ...: every
    engine call's context is its row so far, its tokens follow verbatim with their log-probs (response_mask 1),
    every other response token is masked with log-prob 0, and no generated text is ever encoded again."""
    from test_envs import spy_on

    tok = policy[1]
    turns, encoded = spy_on(monkeypatch, policy[2].engine, tok)
    prompts, answers = prompts_of(6, seed=5)
    b = calculator_agent.generate(prompts, answers, 4, Sampling(48, 1.0), with_logprobs=True)
    monkeypatch.undo()
    calls = [(context, out) for contexts, outs in turns for context, out in zip(contexts, outs)]
    rows = [(p[m.bool()].tolist(), r[t.bool()].tolist()) for p, m, r, t in
            zip(b.prompt_ids, b.prompt_mask, b.response_ids, b.token_mask)]
    sampled = torch.zeros_like(b.response_mask)
    for context, (new, logp) in calls:  # each sampled turn: in a row of its own, right after its context, verbatim
        hits = [i for i, (p, r) in enumerate(rows) if context[: len(p)] == p and context[len(p):] == r[: len(context) - len(p)]
                and r[len(context) - len(p) : len(context) - len(p) + len(new)] == new
                and not sampled[i, len(context) - len(p)]
                and torch.equal(b.rollout_logp[i, len(context) - len(p) :][: len(new)], torch.tensor(logp))]
        assert hits, "a sampled turn (tokens and log-probs) is not verbatim in any row after its context"
        s = len(context) - len(rows[hits[0]][0])
        sampled[hits[0], s : s + len(new)] = 1.0
    assert torch.equal(b.response_mask, sampled)  # trained = sampled, nothing else
    assert (b.rollout_logp * (1 - b.response_mask)).abs().sum() == 0
    observed = b.token_mask - b.response_mask
    assert observed.sum() > 0 and torch.equal(observed.sum(-1), b.extras["env/observation_tokens"])
    generated = [tok.decode(new, skip_special_tokens=True) for _, (new, _) in calls]
    # (a text of a few characters may occur in an observation by chance: those only may not be encoded as they are)
    assert not any(g.strip() and (g == text or len(g.strip()) >= 8 and g in text)
                   for g in generated for text in encoded if text not in prompts)
    for i, (_, r) in enumerate(rows):  # the reward reads what the policy wrote, no observation
        assert b.texts[i] == tok.decode([x for x, m in zip(r, b.response_mask[i].tolist()) if m], skip_special_tokens=True)


@pytest.mark.slow
def test_text_completions_extend_the_episode_and_group_sampling_makes_whole_groups(policy):
    """/v1/completions: the second prompt is the first ⊕ the completion as returned ⊕ a suffix, recorded as an
    observation; G episodes per row in whole groups; the agent's reward is the row's env/reward."""
    rollout = agent_rollout(policy, "agent_fixtures:text_turns", "env.agent_metrics=[]")
    try:
        prompts, answers = prompts_of(3)
        b = rollout.generate(prompts, answers, 2, Sampling(64, 1.0), group_offset=5)
    finally:
        release(rollout)
    assert b.group_index.tolist() == [5, 5, 6, 6, 7, 7]
    assert torch.equal(b.extras["env/reward"], torch.full((6,), 0.5)) and b.extras["env/errors"].sum() == 0
    tok = policy[1]
    two = b.extras["env/turns"] == 2
    assert two.any()
    for i in two.nonzero().flatten().tolist():
        ids, trained = b.response_ids[i][b.token_mask[i].bool()].tolist(), b.response_mask[i].tolist()
        observation = [x for x, m in zip(ids, trained) if not m]
        assert observation == tok.encode("\ncheck:", add_special_tokens=False)


@pytest.mark.slow
def test_a_streamed_completion_is_the_recorded_one_and_a_turn_may_come_back_without_its_content(policy):
    """stream=true (verifiers streams every request): the events carry the completion the row records and its
    usage; a second request may send the assistant turn back with empty content (tool-calling clients do)."""
    rollout = agent_rollout(policy, "agent_fixtures:streaming", "env.agent_metrics=[chars]")
    try:
        b = rollout.generate(*prompts_of(4), 2, Sampling(64, 1.0))
    finally:
        release(rollout)
    tok = policy[1]
    assert b.extras["env/errors"].sum() == 0 and (b.extras["env/turns"] == 2).any()
    for i in range(len(b)):
        trained = b.response_mask[i].bool()
        first = b.response_ids[i][: int(b.extras["env/reward"][i])].tolist()  # the usage's completion tokens
        assert trained[: len(first)].all() and (b.extras["env/turns"][i] == 1 or not trained[len(first)])
        assert b.extras["agent/chars"][i] == len(tok.decode(first, skip_special_tokens=True))


# ------------------------------------------------------------------------------------------------ faults


@pytest.mark.slow
def test_faults_are_scored_episodes_and_the_rollout_goes_on(policy):
    """An agent that raises, hangs past env.episode_timeout_s, returns no number, rewrites the conversation it got
    back, or asks for two completions at once: its episode scores 0 and is counted (env/errors, env/timeouts); the
    others keep their rewards, and the next rollout runs."""
    rollout = agent_rollout(policy, "agent_fixtures:faulty", "env.episode_timeout_s=10", "env.episodes_per_worker=2",
                            "env.agent_metrics=[]")
    try:
        kinds = ["raises", "hangs", "garbage", "rewrites", "two", "fine"]
        b = rollout.generate(kinds, ["0"] * 6, 1, Sampling(16, 1.0))
        assert b.extras["env/errors"].tolist() == [1, 0, 1, 1, 1, 0]
        assert b.extras["env/timeouts"].tolist() == [0, 1, 0, 0, 0, 0]
        assert b.extras["env/reward"].tolist() == [0, 0, 0, 0, 0, 0.75]
        assert b.extras["env/acc"].sum() == 0 and b.extras["env/turns"].tolist() == [1, 1, 1, 1, 1, 1]
        again = rollout.generate(["fine"] * 2, ["0"] * 2, 2, Sampling(16, 1.0))
        assert again.extras["env/reward"].tolist() == [0.75] * 4
        assert rollout.pool.restarts == 1  # the worker whose thread hung, gone after its reply
    finally:
        release(rollout)


def test_a_worker_that_asks_to_retire_is_replaced_once_its_result_is_back():
    """What an agent's chunk does when a thread outlives its deadline (rlcli.envs.agent.run_episodes): the result
    counts, the rest of the worker's chunk goes to its replacement, and nothing more runs in it."""
    from rlcli.core.workers import WorkerPool

    with WorkerPool("agent_fixtures.pid_or_retire", num_workers=1) as pool:
        first, retiring, after = (r.value for r in pool.map(["a", "retire", "b"]))
        assert first == retiring != after and pool.restarts == 1
        assert pool.map(["c"])[0].value == after


def test_a_request_no_engine_answers_fails_within_the_episode_timeout():
    """Nobody serves the queue (the engine's thread is gone): the agent's request fails with 504 after
    env.episode_timeout_s instead of waiting forever."""
    import time

    from rlcli.models.tiny import load_tiny_tokenizer
    from rlcli.rollout.gateway import Gateway

    gateway = Gateway(load_tiny_tokenizer(), compose(*AGENT, "env.episode_timeout_s=1").env, max_batch=4)
    try:
        [(_, url)] = gateway.open(1, 16)
        request = urllib.request.Request(url + "/chat/completions", method="POST", data=json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": "Q: 1+1=?"}]}).encode())
        start = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 504 and time.monotonic() - start < 10
    finally:
        gateway.shutdown()


@pytest.mark.slow
def test_the_gateway_serves_models_and_refuses_what_it_cannot_record(calculator_agent):
    gateway = calculator_agent.gateway

    def call(method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(gateway.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, body = call("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["policy"]
    assert call("GET", "/e/0/v1/models")[0] == 200
    [(episode, url)] = gateway.open(1, 16)
    path = url.removeprefix(gateway.url)
    chat = {"model": "policy", "messages": [{"role": "user", "content": "Q: 1+1=?"}]}
    assert call("POST", path + "/chat/completions", chat | {"n": 2})[0] == 400
    assert call("POST", path + "/chat/completions", chat | {"max_tokens": 0})[0] == 400
    assert call("POST", path + "/chat/completions", {"model": "policy", "messages": []})[0] == 400
    assert call("POST", path + "/completions", {"prompt": []})[0] == 400
    assert call("POST", "/v1/chat/completions", chat)[0] == 404  # no episode named
    gateway.close([episode])
    status, body = call("POST", path + "/chat/completions", chat)
    assert status == 410 and "over" in body["error"]["message"]
    assert call("POST", "/e/999/v1/completions", {"prompt": "x"})[0] == 410


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("overrides, message", [
    (["rollout.agent=agent_fixtures:nothing"], "cannot be imported"),
    (["rollout.agent=no_such_module:run"], "cannot be imported"),
    (["recipe=tools/calculator_agent", "env=calculator"], "sets another"),
    (["env.agent_metrics=[calls]"], "rollout.agent is null"),
    (["recipe=tools/calculator_agent", "env.agent_metrics=[acc]"], "cannot be a name"),
    (["recipe=tools/calculator_agent", "hw=cpu_x2", "hw.zero_stage=3"], "generate together"),
    (["recipe=tools/calculator_agent", "data=gsm8k"], "data.chat=never"),
])
def test_agent_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides, run_dir="/tmp/unused"))


def test_the_calculator_agents_tool_schema_is_the_tools_own():
    from rlcli.envs.calculator import CALC_SCHEMA, calc
    from rlcli.envs.tools import schema

    assert schema(calc) == CALC_SCHEMA


def test_an_agents_return_value_becomes_reward_acc_and_metrics():
    from rlcli.envs.agent import outcome

    assert outcome(1, []) == {"reward": 1.0, "acc": 1.0}
    assert outcome(0.5, ["calls"]) == {"reward": 0.5, "acc": 0.0, "calls": 0.0}
    assert outcome({"reward": 0.2, "acc": 1, "calls": 3}, ["calls"]) == {"reward": 0.2, "acc": 1.0, "calls": 3.0}
    for bad in ("yes", True, {"acc": 1}, float("nan"), {"reward": 1, "calls": float("inf")}):
        with pytest.raises(ValueError):
            outcome(bad, ["calls"])


# ------------------------------------------------------------------------------------------------ training


@pytest.mark.slow
def test_an_agent_trains_a_step_and_evaluates_with_its_own_acc(make_trainer, calculator_cache):
    """`recipe=tools/calculator_agent` in the trainer: the agent's reward is in the score, its acc the row's acc, its
    named metrics logged and documented; held-out evaluation runs the agent too."""
    from metric_names import undocumented

    from rlcli.loop.eval import sample_and_verify

    t = make_trainer(*AGENT, "rollout.max_new_tokens=48", f"model.path={calculator_cache[1]}")
    b, _ = t.collect(t.timer, 1)  # (the fast runs' scripted reward, reward/sevens, adds to the agent's)
    assert torch.allclose(b.scores, b.extras["reward/sevens"] + b.extras["env/reward"])
    assert torch.equal(b.acc, b.extras["env/acc"])
    assert b.acc.sum() > 0 and b.extras["agent/calls"].sum() > 0
    metrics = t.train_step(1)
    assert {"env/reward", "env/acc", "env/errors", "env/timeouts", "agent/calls"} <= set(metrics)
    assert not undocumented(set(metrics), reward_parts=("sevens",))
    results = sample_and_verify(t.rollout, [{"prompt": p, "answer": a} for p, a in zip(*prompts_of(4))],
                                t.cfg.eval, t.cfg.rollout, t.rewards)
    assert all(r["answers"] is None for r in results)  # no maj@k: the agent judges
