"""Multi-turn rollout with tools (rlcli/envs): tools and their failures, the chat templates, the token contract of
a multi-turn row, the masks every loss path honours, and the calculator recipe end to end.

The vLLM side of the token contract (both engines give the same rows) is in tests/test_vllm.py.
"""

import json
import re

import pytest
import torch
from conftest import compose, metric_rows, rlcli, stable

from rlcli.config import validate
from rlcli.core.batch import RolloutBatch
from rlcli.core.schema import ConfigError
from rlcli.envs.calculator import calc, demonstration
from rlcli.envs.chat import PLAIN, ChatFormat, TemplateError
from rlcli.envs.env import Toolbox
from rlcli.envs.tools import Call, parse_compact, parse_hermes, schema
from rlcli.models.tiny import load_tiny_tokenizer

# ------------------------------------------------------------------------------------------------ tools


def test_a_tools_schema_comes_from_its_type_hints_and_docstring():
    assert schema(calc)["function"] == {
        "name": "calc", "description": "Evaluate an integer arithmetic expression with +, -, * and parentheses.",
        "parameters": {"type": "object", "required": ["expression"], "properties": {
            "expression": {"type": "string", "description": "The expression, e.g. 347+85"}}},
        "return": {"type": "string"},
    }


def test_the_calculator_computes_integers_and_refuses_the_rest():
    assert calc("347+85") == "432" and calc(" (3+4)*-5 ") == "-35" and calc("7-80") == "-73"
    for bad in ["2**8", "__import__('os')", "1/2", "x+1", "9" * 40 + "*" + "9" * 40, "1+"]:
        with pytest.raises(ValueError):
            calc(bad)


def test_calls_are_parsed_in_both_formats():
    from rlcli.core import names as declared
    from rlcli.envs.tools import TOOL_FORMATS

    assert tuple(TOOL_FORMATS) == declared.TOOL_FORMATS  # what validation accepts is what runs
    names = {"calc"}
    assert parse_compact(" calc(34+85)", names) == [Call("calc", ["34+85"], {})]
    assert parse_compact("7+5=12\ncalc((1+2)*3)\n\\boxed{9}", names) == [Call("calc", ["(1+2)*3"], {})]
    assert parse_compact("sqrt(4)\n\\boxed{12}", names) == []  # unknown names and answers are not calls
    hermes = '<tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call> <tool_call>{oops</tool_call>'
    assert parse_hermes(hermes, names) == [Call("calc", [], {"expression": "1+2"}), Call("", [], {})]


def test_a_failing_or_stuck_tool_becomes_an_observation_and_a_count():
    cfg = compose("env=calculator", "env.tools=[rlcli.envs.calculator.calc,env_fixtures.boom,env_fixtures.sleepy]",
                  "env.tool_timeout_s=0.5", "env.max_observation_chars=24").env
    box = Toolbox(cfg)
    try:
        messages, counts = box.run("calc(2+3)\nboom(x)\nsleepy(x)\ncalc(2**3)")
        assert [m["content"] for m in messages] == [
            "5", "error: RuntimeError: too", "error: interrupted after", "error: ValueError: only "]
        assert counts == {"tool_calls": 4.0, "tool_errors": 2.0, "tool_timeouts": 1.0}
        assert box.run("\\boxed{5}") == ([], {})  # no call: no observation, the trajectory ends
    finally:
        box.close()


# ------------------------------------------------------------------------------------------------ templates

STRIPS_EARLIER_THINKING = (  # as templates that drop the reasoning of earlier turns do
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}"
    "{%- if loop.last -%}{{ m['content'] }}{%- else -%}{{ m['content'].split('</think>')[-1] }}{%- endif -%}"
    "{{ eos_token }}{%- else -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}"
)
STRIPS_ALL_THINKING = PLAIN.replace("m['content'] + eos_token", "m['content'].split('</think>')[-1] + eos_token")
NO_EOS = PLAIN.replace(" + eos_token", "")


def test_the_observation_is_what_the_template_adds_boundary_text_included():
    chat = ChatFormat(load_tiny_tokenizer(), "plain")
    history = [{"role": "user", "content": "Q: 34+85=?\nA:"}, {"role": "assistant", "content": " calc(34+85)"}]
    assert chat.render(history, False) == "Q: 34+85=?\nA: calc(34+85)</s>"
    assert chat.observation_text(history, [{"role": "tool", "content": "119"}]) == "\n119\n"


@pytest.mark.parametrize("template, message", [
    (STRIPS_EARLIER_THINKING, "renders earlier turns differently"),
    (STRIPS_ALL_THINKING, "does not render an assistant turn as it was generated"),
    (NO_EOS, "does not end an assistant turn with EOS"),
])
def test_a_template_that_breaks_the_token_contract_is_refused_at_start(template, message):
    with pytest.raises(TemplateError, match=message):
        ChatFormat(load_tiny_tokenizer(), template)


def test_a_tokenizer_without_a_chat_template_needs_one_named():
    with pytest.raises(TemplateError, match="env.template=plain"):
        ChatFormat(load_tiny_tokenizer(), None)


@pytest.mark.parametrize("overrides, message", [
    (["env.tools=[rlcli.envs.calculator.calc]"], "env.name=null"),
    (["env.name=tools"], "with no env.tools"),
    (["env=calculator", "hw=cpu_x2", "hw.zero_stage=3"], "generate together"),
    (["env=calculator", "rollout.engine=vllm", "hw=cpu_x2", "rollout.tensor_parallel_size=2"], "generate together"),
    (["env=calculator", "data=gsm8k"], "data.chat=never"),
    (["env=calculator", "hw=cpu_x2", "hw.nproc=3", "hw.zero_stage=3", "rollout.engine=vllm",
      "rollout.async.max_staleness=1", "rollout.async.rollout_ranks=1"], "without rollout ranks"),
    (["model.warm_start.tool_demos=0.5"], "env.name=null runs no tool"),
    (["env=calculator", "env.tools=[rlcli.envs.calculator.nothing]"], "env.tools="),
    (["env.name=env_fixtures.boom"], "has no reset"),
])
def test_multi_turn_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides, run_dir="/tmp/unused"))


# ------------------------------------------------------------------------------------------------ token contract


def spy_on(monkeypatch, engine, tok):
    """Record each `continue_tokens` call of `engine` as (contexts, outputs) and each text `tok` encodes; tokenising
    with `tok(...)` fails the test. -> (the calls, the texts), filled as the rollout runs"""
    turns, encoded = [], []
    continue_tokens, encode = engine.continue_tokens, tok.encode

    def spy_engine(contexts, budgets, sampling, with_logprobs=False):
        out = continue_tokens(contexts, budgets, sampling, with_logprobs)
        turns.append((contexts, out))
        return out

    def spy_encode(text, **kw):
        encoded.append(text)
        return encode(text, **kw)

    monkeypatch.setattr(engine, "continue_tokens", spy_engine)
    monkeypatch.setattr(tok, "encode", spy_encode)
    monkeypatch.setattr(type(tok), "__call__", lambda *a, **k: pytest.fail("the rollout tokenised with __call__"))
    return turns, encoded


def assert_token_contract(mt, prompts, answers, n, sampling, monkeypatch, with_logprobs=False):
    """Run `mt.generate` with spies on the engine and the tokenizer, and check each row is prompt ⊕ generated₁ ⊕
    observation₁ ⊕ ... exactly: the engine's tokens verbatim, each observation the template's suffix (plain:
    '\\n' + result + '\\n'), each turn's context the row so far, and nothing generated ever encoded. -> the batch"""
    tok = mt.tokenizer
    turns, encoded = spy_on(monkeypatch, mt.engine, tok)
    b = mt.generate(prompts, answers, n, sampling, with_logprobs=with_logprobs)
    monkeypatch.undo()
    rows = [list(p[m.bool()].tolist()) for p, m in zip(b.prompt_ids, b.prompt_mask)]
    expected: list[list[int]] = [[] for _ in rows]
    trained: list[list[float]] = [[] for _ in rows]
    open_rows = list(range(len(rows)))
    for k, (contexts, outs) in enumerate(turns, 1):
        assert len(contexts) == len(open_rows)
        nxt = []
        for i, context, (new, _) in zip(open_rows, contexts, outs):
            assert context == rows[i] + expected[i]  # the model reads exactly the row so far
            expected[i] += new
            trained[i] += [1.0] * len(new)
            text = tok.decode(new, skip_special_tokens=True)
            calls = parse_compact(text, {"calc"})
            if new and new[-1] == tok.eos_token_id and calls and k < mt.cfg.max_turns:
                try:
                    result = calc(*calls[0].args)
                except ValueError as e:
                    result = f"error: ValueError: {e}"
                observation = tok.encode("\n" + result[: mt.cfg.max_observation_chars] + "\n", add_special_tokens=False)
                if len(expected[i]) + len(observation) < sampling.max_new_tokens:
                    expected[i] += observation
                    trained[i] += [0.0] * len(observation)
                    nxt.append(i)
        open_rows = nxt
    for i in range(len(rows)):
        t = len(expected[i])
        assert b.response_ids[i, :t].tolist() == expected[i]
        assert b.token_mask[i].tolist() == [1.0] * t + [0.0] * (b.token_mask.shape[1] - t)
        assert b.response_mask[i, :t].tolist() == trained[i] and b.response_mask[i, t:].sum() == 0
        if with_logprobs:
            assert (b.rollout_logp[i] * (1 - b.response_mask[i])).abs().sum() == 0
        generated = [x for x, m in zip(expected[i], trained[i]) if m]  # what the reward reads: no observation
        assert b.texts[i] == tok.decode(generated, skip_special_tokens=True)
    generated = [tok.decode(new, skip_special_tokens=True) for _, outs in turns for new, _ in outs]
    assert all(text in prompts or (text.startswith("\n") and text.endswith("\n")) for text in encoded), encoded
    assert not any(g.strip() and g in text for g in generated for text in encoded if text not in prompts)
    return b


@pytest.fixture
def calculator_engine(calculator_cache):
    from rlcli.models.policy import load_policy
    from rlcli.rollout import build_engine

    _, path = calculator_cache
    cfg = compose("recipe=tools/calculator", f"model.path={path}", "model.name=hf", run_dir="/tmp/unused")
    model, tok = load_policy(cfg.model, path)
    mt = build_engine("hf", model, tok, path, cfg)
    yield mt
    mt.close()


@pytest.mark.slow
def test_hf_multi_turn_rows_keep_the_token_contract(calculator_engine, monkeypatch):
    from rlcli.data.arith import arith_examples
    from rlcli.rollout import Sampling

    ex = arith_examples("train", 12, seed=3, min_digits=2, max_digits=2)
    b = assert_token_contract(calculator_engine, [e["prompt"] for e in ex], [e["answer"] for e in ex], 4,
                              Sampling(48, 1.0), monkeypatch, with_logprobs=True)
    used = b.extras["env/used_tool"].bool()
    assert 0 < used.sum() < len(b) and (b.token_mask.sum(-1) > b.response_mask.sum(-1)).eq(used).all()
    assert torch.equal(b.extras["env/turns"][used], torch.full((int(used.sum()),), 2.0))
    obs = b.extras["env/observation_tokens"]
    assert torch.equal(obs, b.token_mask.sum(-1) - b.response_mask.sum(-1))
    assert all("calc(" in t for t, u in zip(b.texts, used) if u)


# ------------------------------------------------------------------------------------------------ masks

OBS = [3, 4, 5, 8]
"""Response positions that are observation tokens in every row of `multi_turn_batch` (inside each row's length)."""


def multi_turn_batch(pad_id: int) -> RolloutBatch:
    """8 rows in 2 groups of 4, prompts of 5 tokens, responses of 9-12 tokens with observations at OBS; the
    sampler's log-probs 0 there. Scores vary within each group."""
    g = torch.Generator().manual_seed(0)
    n, tp, t = 8, 5, 12
    lengths = [12, 12, 10, 9, 12, 11, 12, 10]
    token_mask = torch.tensor([[1.0] * k + [0.0] * (t - k) for k in lengths])  # [N, T]
    response_mask = token_mask.clone()
    response_mask[:, OBS] = 0.0
    response_ids = torch.where(token_mask.bool(), torch.randint(4, 40, (n, t), generator=g), pad_id)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    return RolloutBatch(
        prompt_ids=torch.randint(4, 40, (n, tp), generator=g), prompt_mask=torch.ones(n, tp, dtype=torch.long),
        response_ids=response_ids, response_mask=response_mask, token_mask=token_mask,
        truncated=torch.zeros(n, dtype=torch.bool), group_index=torch.tensor([0] * 4 + [1] * 4),
        answers=["1"] * n, texts=[""] * n, scores=scores, acc=scores,
        rollout_logp=-torch.rand(n, t, generator=g) * response_mask, stale=torch.zeros(n, dtype=torch.bool),
    )


def retain_output(module, into: list):
    """Keep `module`'s forward outputs (with their gradients once backward runs)."""

    def hook(_, __, out):
        out = out.logits if hasattr(out, "logits") else out
        out.retain_grad()
        into.append(out)

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("algo", ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo", "vapo"])
def test_no_gradient_reaches_an_observation_token_and_normalisers_count_trained_tokens(make_trainer, algo):
    """Every loss term of the algorithm (policy loss with its aggregation and Dr.GRPO's constant, KL, entropy
    bonus, VAPO's NLL, rollout correction; the critic's value loss) gives exactly 0 gradient to the logits and value
    head outputs at observation positions, and nonzero ones elsewhere; advantages and returns are 0 there, and the
    loss normaliser counts generated tokens only."""
    from rlcli.loop.learner import rl_phase
    from rlcli.rollout.shaping import shape

    t = make_trainer(f"algo={algo}", "hw.logits_chunk=0", "algo.entropy_coef=0.01", "algo.rollout_correction=token")
    learner, phase = t.learner, rl_phase(t.cfg)
    b, _ = shape(multi_turn_batch(t.tokenizer.pad_token_id), t.cfg.algo, t.cfg.rollout)  # stage 3: the loss mask
    b = b.replace(**learner.score(b, 1, phase))
    b, _ = t.advantage(b, 1, phase)
    assert b.advantages[:, OBS].abs().sum() == 0 and b.returns[:, OBS].abs().sum() == 0
    assert b.advantages[b.response_mask.bool()].abs().sum() > 0
    norms = learner.normalizers(b)
    assert norms["num_tokens"] == b.response_mask.sum() == sum([12, 12, 10, 9, 12, 11, 12, 10]) - 8 * len(OBS)
    heads = [learner.actor.module.get_output_embeddings()] + ([learner.critic.module] if learner.critic else [])
    for head in heads:
        outs: list = []
        handle = retain_output(head, outs)
        try:
            loss, _ = learner.micro_loss(b, norms) if head is heads[0] else learner.micro_value_loss(b, norms)
            loss.backward()
        finally:
            handle.remove()
        grad = outs[0].grad[:, 5 - 1 : -1].abs().sum(-1)  # [N, T] at the state before each response token
        assert grad[:, OBS].sum() == 0, f"{algo}: {type(head).__name__} trains observation tokens"
        # elsewhere: every trained token (the critic: those whose return differs from its value, e.g. not 0 = 0
        # on a zero-reward row under the fresh head)
        trained = b.response_mask.bool() & (b.returns != b.values if head is not heads[0] else True)
        assert trained.sum() > 20 and (grad[trained] > 0).float().mean() > 0.9


def test_the_outcome_reward_sits_on_the_last_generated_token():
    from rlcli.algos.advantages import outcome_token_rewards

    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 0, 1, 1, 1]])  # 0s inside: observations
    expected = torch.zeros(3, 6)
    expected[0, 4], expected[1, 0], expected[2, 5] = 2.0, 3.0, 5.0
    assert torch.equal(outcome_token_rewards(torch.tensor([2.0, 3.0, 5.0]), mask), expected)


def test_gae_and_returns_skip_observations_as_if_they_were_not_there():
    """Value targets chain from one generated token to the next over the observations between them: GAE on a
    row with observations equals GAE on the same row with them cut out (γ = 0.9, λ = 0.8)."""
    from rlcli.algos import functional as F

    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0]])
    adv, ret = F.gae(rewards, values, mask, 0.9, 0.8)
    for i in range(2):
        keep = mask[i].bool()
        a, r = F.gae(rewards[i, keep][None], values[i, keep][None], torch.ones(1, int(keep.sum())), 0.9, 0.8)
        torch.testing.assert_close(adv[i, keep], a[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ret[i, keep], r[0], rtol=0, atol=1e-6)
        assert adv[i, ~keep].abs().sum() == 0 and ret[i, ~keep].abs().sum() == 0


def test_trimming_keeps_observation_tokens():
    """A row whose last tokens are ... ⊕ observation ⊕ generated keeps its full width when padding is trimmed."""
    b = multi_turn_batch(0)
    b = b.replace(response_ids=torch.nn.functional.pad(b.response_ids, (0, 3)),
                  response_mask=torch.nn.functional.pad(b.response_mask, (0, 3)),
                  token_mask=torch.nn.functional.pad(b.token_mask, (0, 3)))
    trimmed = b.trimmed()
    assert trimmed.response_ids.shape[1] == 12 and torch.equal(trimmed.token_mask, b.token_mask[:, :12])


@pytest.mark.slow
def test_the_calculator_recipe_trains_logs_its_glossary_metrics_and_resumes_bit_identically(calculator_cache):
    """`rlcli train recipe=tools/calculator` on a small budget: the env metrics are logged and documented, evaluation
    reports tool use, the logged rollouts hold tool calls and results, and a branch resumed from the step-2
    checkpoint (tool workers, environments and all) logs step 3 exactly as the straight run."""
    from metric_names import undocumented

    root, _ = calculator_cache
    args = ["recipe=tools/calculator", "steps=3", "rollout.prompts_per_step=4", "eval.size=16", "hw.num_threads=1"]
    rlcli(root, "train", *args, "checkpoint.every=2", "logger.rollouts=true", "hydra.run.dir=straight")
    rows = metric_rows(root / "straight")
    steps = [r for r in rows if "env/turns" in r]
    assert len(steps) == 3 and not undocumented({k for r in rows for k in r})
    assert all(1 <= r["env/turns"] <= 2 and r["env/observation_tokens"] > 0 for r in steps)
    assert "eval/tool_use_before" in rows[0] and "eval/tool_use_after" in rows[-1]
    logged = [json.loads(x) for x in (root / "straight" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    # the whole conversation: a call, the tool's result on its own line, the box
    assert len(logged) == 32 and any(re.search(r"calc\((\d+)\+(\d+)\)\n(\d+)\n\\boxed\{\3\}", r["response"]) for r in logged)
    rlcli(root, "train", *args, "resume=straight/checkpoints/step_2", "hydra.run.dir=branch")
    step3 = [[r for r in metric_rows(root / run) if r.get("step") == 3 and "env/turns" in r] for run in ("straight", "branch")]
    assert stable(step3[0]) == stable(step3[1])


def test_a_tool_demonstration_is_rendered_as_rollout_renders_it_and_its_observation_is_not_learned():
    from rlcli.data.arith import make_example
    from rlcli.models.sft import _encode_examples

    tok = load_tiny_tokenizer()
    ids, mask, labels = _encode_examples(tok, [demonstration(make_example(34, 85, "+"))])
    assert tok.decode(ids[0][mask[0].bool()]) == "Q: 34+85=?\nA: calc(34+85)</s>\n119\n\\boxed{119}</s>"
    assert tok.decode(ids[0][labels[0] != -100]) == " calc(34+85)</s>\\boxed{119}</s>"


@pytest.mark.slow
def test_a_user_environment_trains_its_step_rewards_add_to_the_score(make_trainer, calculator_cache):
    """env.name=<dotted path>: a user class drives the conversation (three turns, observations t1 and t2), and its
    step rewards (0.25 a turn) add to the task reward."""
    t = make_trainer("env.name=env_fixtures.Countdown", "env.template=plain", "env.max_turns=3",
                     "rollout.max_new_tokens=48", f"model.path={calculator_cache[1]}")
    b, _ = t.collect(t.timer, 1)
    finished = (b.extras["env/turns"] == 3) & ~b.truncated
    # Two budget ends: a turn cut inside (its last token is not EOS) reaches no step and earns nothing; a turn that
    # ended with EOS but left no room for the observation reached its step and keeps its 0.25. (The test once
    # counted every truncated row as the first kind; which kinds occur depends on the session's warm start, whose
    # floating-point sums follow the thread count earlier tests set, so it failed in full runs only.)
    last = b.response_ids.gather(1, b.token_mask.sum(1).long()[:, None] - 1).squeeze(1)  # [N]
    cut_inside = b.truncated & (last != t.tokenizer.eos_token_id)
    assert finished.any() and cut_inside.any()
    assert torch.equal(b.extras["env/reward"], 0.25 * (b.extras["env/turns"] - cut_inside.float()))
    assert torch.allclose(b.scores, b.extras["reward/sevens"] + b.extras["env/reward"])
    i = int(finished.nonzero()[0])
    text = t.tokenizer.decode(b.response_ids[i][b.token_mask[i].bool()])
    assert text.count("</s>\nt1\n") == 1 and text.count("</s>\nt2\n") == 1 and text.endswith("</s>")
    t.train_step(1)


@pytest.mark.slow
def test_multi_turn_rows_come_from_a_rollout_rank_under_asynchronous_rollout(calculator_cache):
    """hw=cpu_x2 rollout.async.max_staleness=1: the rollout rank runs the environments and the tools, the training
    rank trains on their rows one version old and evaluates with its own multi-turn engine."""
    root, _ = calculator_cache
    out = rlcli(root, "train", "recipe=tools/calculator", "hw=cpu_x2", "rollout.async.max_staleness=1", "steps=2",
                "rollout.prompts_per_step=4", "eval.size=8", "save=false", "hydra.run.dir=async")
    assert "environment    tools: ['rlcli.envs.calculator.calc'] (compact calls), template plain" in out.stdout
    rows = metric_rows(root / "async")
    steps = [r for r in rows if "env/turns" in r]
    assert [r["async/staleness_max"] for r in steps] == [0.0, 1.0]
    assert all(r["env/used_tool"] > 0 and r["env/observation_tokens"] > 0 for r in steps)
    assert "eval/tool_use_before" in rows[0] and "eval/tool_use_after" in rows[-1]
