"""OpenEnv environments (env=openenv, rlcli/envs/openenv.py): the policy's text as actions and observations as text,
config errors before any model loads, an app served on 127.0.0.1 for the run whose step rewards add up and whose
observations are never trained, faults (a step that raises, hangs, gets a malformed action; a server that dies) as
episodes that score 0 and are counted while the rollout goes on, and one training step through the trainer.

Everything talks to 127.0.0.1 only: the test server is tests/openenv_fixtures.py, served by rlcli itself.
"""

import subprocess
import sys
import time

import pytest
import torch
from conftest import FAST, compose

pytest.importorskip("openenv", reason="env=openenv needs openenv-core: pip install 'rlcli[openenv]'")

from rlcli.config import validate  # noqa: E402
from rlcli.core.schema import ConfigError  # noqa: E402
from rlcli.envs import openenv as oe  # noqa: E402
from rlcli.models.tiny import load_tiny_tokenizer  # noqa: E402
from rlcli.rollout import Sampling  # noqa: E402

TEXT = {"properties": {"metadata": {"type": "object"}, "message": {"type": "string"}}, "required": ["message"]}
MOVE = {"properties": {"row": {"type": "integer"}, "col": {"type": "integer"}}, "required": ["row", "col"]}
OPENENV = ["env=openenv", "env.openenv.app=openenv_fixtures:app", "env.template=plain", "env.max_turns=3"]

# ------------------------------------------------------------------------------------------------ text <-> env


def test_the_policys_text_becomes_an_action_by_the_action_schema():
    assert oe.parse_action(" banana \n", TEXT) == {"message": "banana"}  # text into the one required string field
    assert oe.parse_action('{"message": "hi"}', TEXT) == {"message": "hi"}  # a JSON action that fits
    assert oe.parse_action('```json\n{"row": 1, "col": 2}\n```', MOVE) == {"row": 1, "col": 2}  # fenced
    assert oe.parse_action('{"msg": "hi"}', TEXT) == {"message": '{"msg": "hi"}'}  # JSON that does not fit: text
    assert oe.parse_action("[1, 2]", TEXT) == {"message": "[1, 2]"}
    with pytest.raises(oe.BadAction, match="no one required string field"):
        oe.parse_action("row 1, col 2", MOVE)  # a malformed action: no JSON, and no field for text
    with pytest.raises(oe.BadAction):
        oe.parse_action('{"row": 1}', MOVE)  # a required field missing
    assert oe.parse_action("e4", MOVE, key="row") == {"row": "e4"}  # env.openenv.action_key (the server judges it)


def test_an_observation_is_its_text_or_its_fields_as_json():
    assert oe.observation_text({"text": "Guess.", "hint": None, "legal": []}) == "Guess."
    assert oe.observation_text({"text": "Guess.", "tries": 3}) == '{"text": "Guess.", "tries": 3}'
    assert oe.observation_text({"board": [[0, 1]], "text": "x"}, key="board") == "[[0, 1]]"
    assert oe.observation_text({}) == ""
    with pytest.raises(KeyError, match="no field 'board'"):
        oe.observation_text({"text": "x"}, key="board")


# ------------------------------------------------------------------------------------------------ config


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("overrides, message", [
    (["env=openenv"], "env=openenv needs its server: env.openenv.app=module:app"),
    (["env=openenv", "env.openenv.app=no_such_module:app"], "env.openenv.app=no_such_module:app cannot be imported "
                                                            r"\(ModuleNotFoundError"),
    (["env=openenv", "env.openenv.app=openenv_fixtures:nothing"], "openenv_fixtures:nothing cannot be imported"),
    (["env=openenv", "env.openenv.app=openenv_fixtures"], "module:attribute"),
    (["env=openenv", f"env.openenv.url=http://127.0.0.1:{closed_port()}"], "does not answer as an OpenEnv server"),
    (["env=openenv", "env.openenv.url=127.0.0.1:8000"], "must be http://HOST:PORT"),
    (["env=openenv", "env.openenv.url=http://127.0.0.1:1", "env.openenv.app=openenv_fixtures:app"], "keep one"),
    (["env.openenv.app=openenv_fixtures:app"], "read by env=openenv only"),
    (["env=calculator", "env.openenv.url=http://127.0.0.1:1"], "read by env=openenv only"),
])  # fmt: skip
def test_config_errors_name_the_fix_before_any_model_loads(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose(*overrides, run_dir="/tmp/unused"))
    assert "\n" not in str(e.value)


def test_a_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)  # as if openenv-core were not installed
    with pytest.raises(ConfigError, match=r"env=openenv needs openenv-core: pip install 'rlcli\[openenv\]'"):
        validate(compose(*OPENENV, run_dir="/tmp/unused"))


def test_the_cli_refuses_an_app_that_does_not_import_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlcli.commands.cli", "train", "env=openenv",
                          "env.openenv.app=no_such_module:app"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("rlcli: error: env.openenv.app=no_such_module:app cannot")


# ------------------------------------------------------------------------------------------------ served episodes


class Scripted:
    """A rollout engine that writes ` go` at the first turn, then the prompt's word (`ok`, `raise`, `hang`, `die`;
    `bad`: an action the server refuses), each turn ended with EOS."""

    logprobs_are_free, collective, model = False, False, None

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def continue_tokens(self, contexts, budgets, sampling, with_logprobs=False):
        out = []
        for context in contexts:
            text = self.tok.decode(context)
            turn, word = text.count(self.tok.eos_token) + 1, text.split()[0]
            reply = "go" if turn == 1 else '{"message": 5}' if word == "bad" else word
            out.append((self.tok.encode(" " + reply, add_special_tokens=False) + [self.tok.eos_token_id], None))
        return out

    def rest(self):
        pass

    def close(self):
        pass


def multi_turn(*overrides):
    from rlcli.rollout.multiturn import MultiTurn

    cfg = compose(*OPENENV, *overrides, run_dir="/tmp/unused")
    validate(cfg)
    tok = load_tiny_tokenizer()
    return MultiTurn(Scripted(tok), tok, cfg.env)


@pytest.fixture(scope="module")
def served():
    """A multi-turn rollout on openenv_fixtures:app (served for the module), steps timed out after 1 s."""
    mt = multi_turn("env.openenv.step_timeout_s=1")
    yield mt
    mt.close()


SAMPLING = Sampling(64, 1.0)


def test_step_rewards_add_up_and_observations_are_read_not_trained(served):
    """Three turns (the server ends the episode at its third step), 0.25 a step: env/reward 0.75 each; the server's
    observations are in the rows with response_mask 0 and not in the text the reward reads."""
    tok = served.tokenizer
    b = served.generate(["ok", "ok"], ["1", "2"], 2, SAMPLING)
    assert b.extras["env/reward"].tolist() == [0.75] * 4 and b.extras["env/turns"].tolist() == [3] * 4
    assert b.extras["env/errors"].sum() == 0 and b.extras["env/timeouts"].sum() == 0 and not b.truncated.any()
    for i in range(4):
        assert tok.decode(b.prompt_ids[i][b.prompt_mask[i].bool()]) == "ok"  # the reset's observation
        assert tok.decode(b.response_ids[i][b.token_mask[i].bool()]) == " go</s>\nt1\n ok</s>\nt2\n ok</s>"
        assert tok.decode(b.response_ids[i][b.response_mask[i].bool()]) == " go</s> ok</s> ok</s>"
        assert b.texts[i] == " go ok ok"


def test_faults_score_zero_are_counted_and_the_rollout_goes_on(served):
    """At the second step: a step that raises and an action the server refuses count in env/errors, a step that
    hangs past env.openenv.step_timeout_s in env/timeouts; each episode ends there and its whole score is 0 (its first
    step's 0.25 and its text's reward included), the healthy one keeps 0.75, and the next rollout runs."""
    from rlcli.rewards.manager import RewardManager

    start = time.monotonic()
    b = served.generate(["raise", "hang", "bad", "ok"], ["0"] * 4, 1, SAMPLING)
    assert time.monotonic() - start < 10  # the hung step was abandoned after 1 s
    assert b.extras["env/errors"].tolist() == [1, 0, 1, 0]
    assert b.extras["env/timeouts"].tolist() == [0, 1, 0, 0]
    assert b.extras["env/reward"].tolist() == [0.25, 0.25, 0.25, 0.75]  # what the server paid before it failed
    assert b.extras["env/turns"].tolist() == [2, 2, 2, 3]
    with RewardManager(compose(*FAST).reward) as rewards:
        b = b.replace(texts=["\\boxed{77}"] * 4, answers=["77"] * 4)  # right, and 2 from the scripted reward
        scored, _ = rewards.reward_batch(b)
        assert scored.scores.tolist() == [0.0, 0.0, 0.0, 2.75] and scored.acc.tolist() == [0.0, 0.0, 0.0, 1.0]
        # held-out evaluation reads them the same way (the rollout above replayed as the engine's)
        from rlcli.loop.eval import sample_and_verify

        cfg = compose(*FAST, "eval.k=1", "eval.batch_prompts=4")
        replay = type("Replay", (), {"generate": lambda self, *args, **kwargs: b})()
        rows = sample_and_verify(replay, [{"prompt": p, "answer": "77"} for p in "abcd"], cfg.eval, cfg.rollout, rewards)
    assert [r["correct"] for r in rows] == [[False], [False], [False], [True]]
    again = served.generate(["ok"], ["0"], 2, SAMPLING)
    assert again.extras["env/reward"].tolist() == [0.75, 0.75] and again.extras["env/errors"].sum() == 0


@pytest.mark.slow
def test_a_server_that_dies_mid_rollout_is_counted_and_served_again(monkeypatch):
    """The server's process exits during a step: that episode and every later call to it fail (env/errors: the
    other two episodes fail at their next step), and the rollout returns; the next rollout serves the app again;
    closing the rollout stops it."""
    monkeypatch.setattr(oe, "_RESTART_GAP_S", 0.0)
    mt = multi_turn("env.openenv.app=openenv_fixtures:mortal", "env.openenv.step_timeout_s=15")  # loaded CI cores
    try:
        b = mt.generate(["ok", "die", "ok"], ["0"] * 3, 1, SAMPLING)
        assert b.extras["env/errors"].tolist() == [1, 1, 1] and b.extras["env/timeouts"].sum() == 0
        assert b.extras["env/reward"].tolist() == [0.5, 0.25, 0.25] and b.extras["env/turns"].tolist() == [3, 2, 2]
        server = oe._SERVERS["openenv_fixtures:mortal"]
        assert server.proc.wait(timeout=30) == 3  # os._exit(3) in the step (the client may see the socket close first)
        again = mt.generate(["ok", "ok"], ["0"] * 2, 1, SAMPLING)
        assert again.extras["env/reward"].tolist() == [0.75, 0.75] and again.extras["env/errors"].sum() == 0
        proc = server.proc
    finally:
        mt.close()
    assert proc.poll() is not None and "openenv_fixtures:mortal" not in oe._SERVERS


# ------------------------------------------------------------------------------------------------ training


@pytest.mark.slow
def test_an_openenv_environment_served_in_the_test_trains_a_step(make_trainer, calculator_cache):
    """`env=openenv env.openenv.app=openenv_fixtures:app` in the trainer on the calculator's warm-started tiny model:
    the server's step rewards (0.25 a step) are summed into env/reward and added to the task reward, its observations
    sit between the turns, the metrics are logged and documented, and a step trains."""
    from metric_names import undocumented

    t = make_trainer(*OPENENV, "rollout.max_new_tokens=48", f"model.path={calculator_cache[1]}")
    try:
        b, _ = t.collect(t.timer, 1)
        finished = (b.extras["env/turns"] == 3) & ~b.truncated
        last = b.response_ids.gather(1, b.token_mask.sum(1).long()[:, None] - 1).squeeze(1)  # [N]
        cut_inside = b.truncated & (last != t.tokenizer.eos_token_id)  # no step for a turn the budget cut
        assert finished.any() and b.extras["env/errors"].sum() == 0 and b.extras["env/timeouts"].sum() == 0
        assert torch.equal(b.extras["env/reward"], 0.25 * (b.extras["env/turns"] - cut_inside.float()))
        assert torch.allclose(b.scores, b.extras["reward/sevens"] + b.extras["env/reward"])
        i = int(finished.nonzero()[0])
        text = t.tokenizer.decode(b.response_ids[i][b.token_mask[i].bool()])
        assert text.count("</s>\nt1\n") == 1 and text.count("</s>\nt2\n") == 1 and text.endswith("</s>")
        assert t.tokenizer.decode(b.prompt_ids[i][b.prompt_mask[i].bool()]).startswith("Q: ")  # the row's prompt
        metrics = t.train_step(1)
        assert {"env/reward", "env/errors", "env/timeouts", "env/turns"} <= set(metrics)
        assert not undocumented(set(metrics), reward_parts=("sevens",))
    finally:
        t.rollout.close()
    assert "openenv_fixtures:app" not in oe._SERVERS  # the run's server stopped with its rollout


@pytest.mark.slow
def test_a_server_with_too_few_connections_refuses_episodes_and_the_log_names_the_fix(caplog):
    """A server that takes one connection at once: the second episode is refused (env/errors, the log says which
    knob of the app to raise); the first one's connection is closed when its trajectory ends at env.max_turns
    (the server never said done), so the next rollout's episode gets in."""
    mt = multi_turn("env.openenv.app=openenv_fixtures:narrow", "env.max_turns=2")
    try:
        b = mt.generate(["ok", "ok"], ["0"] * 2, 1, SAMPLING)
        again = mt.generate(["ok"], ["0"], 1, SAMPLING)
    finally:
        mt.close()
    assert b.extras["env/errors"].tolist() == [0, 1] and b.extras["env/reward"].tolist() == [0.5, 0]
    assert "create its app with a larger max_concurrent_envs" in caplog.text
    assert again.extras["env/errors"].tolist() == [0] and again.extras["env/reward"].tolist() == [0.5]


def test_the_shipped_example_pays_for_the_right_answer_and_lets_a_wrong_one_try_again():
    """rlcli/envs/openenv_example.py, which docs/environments.md trains on."""
    cfg = compose("env=openenv", "env.openenv.app=rlcli.envs.openenv_example:app", run_dir="/tmp/unused")
    validate(cfg)
    env = oe.OpenEnvEnvironment(cfg.env)
    try:
        assert env.reset({"prompt": "Q: 2+3=?\nA:", "answer": "5"}) == [{"role": "user", "content": "Q: 2+3=?\nA:"}]
        wrong = env.step(" 2+3\n\\boxed{4}")
        assert (wrong.reward, wrong.done, wrong.info) == (0.0, False, {})
        assert wrong.observations == [{"role": "user", "content": "\n4 is wrong. Try again.\nA:"}]
        right = env.step(" \\boxed{5}")
        assert (right.reward, right.done) == (1.0, True)
    finally:
        env.close()
        oe.shutdown()
