"""reward=code (rlcli/rewards/code.py): programs run against tests in a sandbox that holds. Correct programs pass and
wrong ones fail with the right counts in both test styles; a hostile battery is contained, scores 0 and is counted,
and the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcli.core.schema import ConfigError
from rlcli.rewards import RewardManager
from rlcli.rewards.code import code_reward, execute, execute_stdio, extract_program, interpreter
from rlcli.rewards.config import RewardConfig

ROOT = Path(__file__).resolve().parents[1]
SQUARE = "def f(x):\n    return x * x\n"
TESTS = "import math\nassert f(2) == 4\nassert f(3) == 9\nassert f(-1) == 1\nassert f(0) == 1\n"


def test_correct_programs_pass_and_wrong_ones_fail_with_the_right_counts_in_both_styles():
    r = execute(SQUARE, TESTS)
    assert (r.passed, r.total, r.status) == (3, 4, "failed") and r.message == "5: AssertionError"  # f(0) == 1 is wrong
    r = execute(SQUARE, TESTS.replace("f(0) == 1", "f(0) == 0"))
    assert (r.passed, r.total, r.status) == (4, 4, "ok")
    r = execute("def f(x):\n    return x + x\n", TESTS)
    assert (r.passed, r.total, r.status) == (1, 4, "failed")  # only f(2) == 4
    r = execute("def f(x):\n    return 1 / 0 if x else 1\n", TESTS)
    assert (r.passed, r.total, r.status) == (1, 4, "failed") and "ZeroDivisionError" in r.message
    r = execute("def f(x) return x\n", TESTS)
    assert (r.passed, r.total, r.status) == (0, 4, "crashed") and "SyntaxError" in r.message
    add = "a, b = map(int, input().split())\nprint(a + b)\n"
    r = execute_stdio(add, [("1 2\n", "3\n"), ("5 5", "10"), ("1 1", "3"), ("-4 4", "0  \n")])
    assert (r.passed, r.total, r.status, r.message) == (3, 4, "failed", "cases 1 1 0 1")
    assert execute_stdio(add, [("2 2", "4")]).status == "ok"
    assert execute_stdio("import sys\nsys.exit(3)\n", [("", "")]).passed == 0  # a non-zero exit fails its case
    assert execute(SQUARE, "assert (").status == "refused"


def test_the_reward_reads_the_last_fenced_block_and_the_ground_truth_json():
    reply = "Here:\n```python\ndef f(x):\n    return 0\n```\nBetter:\n```python\n" + SQUARE + "```\n"
    assert extract_program(reply) == SQUARE and extract_program("no code here") is None
    assert extract_program("def f(x): pass", "whole") == "def f(x): pass"
    truth = json.dumps({"assert": TESTS.replace("f(0) == 1", "f(0) == 0")})
    assert code_reward(reply, truth)[0] == 1.0
    value, counts = code_reward(reply.replace("x * x", "x + x"), truth, code_partial_credit=True)
    assert value == 0.5 and counts["code_failed"] == 1  # f(2) == 4 and f(0) == 0 of 4 and sum(counts.values()) == 1
    assert code_reward(reply.replace("x * x", "x + x"), truth)[0] == 0.0  # all-or-nothing by default
    assert code_reward("no code", truth) == (0.0, {**dict.fromkeys(counts, 0.0), "code_no_program": 1.0})
    # HumanEval style: a completion of the prompt's signature gets the prompt prepended
    he = json.dumps({"assert": "def check(c):\n    assert c(3) == 9\ncheck(f)\n", "prefix": "def f(x):\n",
                     "entry_point": "f"})
    assert code_reward("```python\n    return x * x\n```", he)[0] == 1.0
    assert code_reward("```python\n" + SQUARE + "```", he)[0] == 1.0  # a whole function is left as it is
    typed = json.dumps({"assert": "assert f([1, 2]) == 3\n", "entry_point": "f",
                        "prefix": "from typing import List\n\n\ndef f(xs: List[int]) -> int:\n"})
    assert code_reward("```python\ndef f(xs: List[int]) -> int:\n    return sum(xs)\n```", typed)[0] == 1.0  # its imports
    stdio = json.dumps({"stdio": [["3\n", "9\n"], ["4", "16"]]})
    assert code_reward("```python\nprint(int(input()) ** 2)\n```", stdio)[0] == 1.0
    with pytest.raises(ValueError, match="neither 'assert' nor 'stdio'"):
        code_reward(reply, json.dumps({"tests": "x"}))


@pytest.fixture(scope="module")
def battery():
    """tests/helpers/code_battery.py, run inside a PID namespace of its own (root: no user namespace, so the
    sandbox still drops to nobody, where RLIMIT_NPROC binds): whatever a failing sandbox left behind dies with it."""
    ns = ["unshare", "--pid", "--fork", "--mount-proc"] if os.geteuid() == 0 else ["unshare", "-r", "--pid", "--fork",
                                                                                  "--mount-proc"]
    out = subprocess.run([*ns, sys.executable, "-m", "tests.helpers.code_battery"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_a_hostile_battery_is_contained_and_scores_nothing(battery):
    cases = battery["cases"]
    assert len(cases) == 19
    for name, r in cases.items():
        assert r["status"] != "ok" and r["passed"] < max(r["total"], 1), (name, r)  # scores 0
        assert not r["secret_seen"], name  # the trainer's environment never reaches the program
        assert r["output_len"] <= 64 * 1024, name
    expected = {"fork bomb": "timeout", "memory bomb": "memory", "infinite loop": "timeout", "sleep": "timeout",
                "print gigabytes": "output_limit", "segfault": "crashed", "os._exit(0)": "crashed",
                "sys.exit(0) early": "crashed", "unbounded recursion": "crashed", "network": "crashed",
                "change the working directory": "crashed"}
    assert {n: cases[n]["status"] for n in expected} == expected
    assert "Network is unreachable" in cases["network"]["message"] and battery["accepted"] == 0
    assert "Read-only file system" in cases["change the working directory"]["message"]
    assert battery["planted"] == "keep me" and battery["created"] == ["planted"] and not battery["escape_file"]
    assert battery["grandchildren_alive"] == []  # the daemonised grandchild died with its PID namespace
    assert cases["always-equal object"]["status"] == "failed" and cases["patch builtins"]["status"] == "failed"


@pytest.mark.slow
def test_the_reward_manager_counts_each_ending_and_the_run_goes_on():
    cfg = RewardConfig(weights={"code": 1.0}, timeout_s=8.0)
    cfg.code.timeout_s = 2.0
    truth = json.dumps({"assert": "assert repr(f(2)) == repr(4)\n"})
    replies = ["```python\n" + p + "```" for p in (SQUARE, "while True:\n    pass\n", "import os\nos._exit(0)\n",
                                                   "x = bytearray(1 << 34)\n", "print('x' * 10**6)\n",
                                                   "def f(x):\n    return 5\n")] + ["no code", "```python\n" + SQUARE + "```"]
    with RewardManager(cfg) as m:
        out = m(replies, [truth] * len(replies))
    assert out.score.tolist() == [1, 0, 0, 0, 0, 0, 0, 1] and out.acc.tolist() == out.score.tolist()
    counts = {k.removeprefix("reward/code_"): v for k, v in out.metrics.items() if k.startswith("reward/code_")}
    assert counts == {"ok": 2, "failed": 1, "timeout": 1, "crashed": 1, "memory": 1, "output_limit": 1,
                      "no_program": 1}
    assert out.metrics["reward/errors"] == 0 and out.metrics["reward/timeouts"] == 0


def test_no_sandbox_means_a_refusal_with_the_fix_never_an_open_run(monkeypatch):
    import rlcli.rewards.code as code

    interpreter.cache_clear()
    monkeypatch.setattr(code.shutil, "which", lambda name: None)
    try:
        r = execute(SQUARE, TESTS)
        assert r.status == "refused" and "unshare" in r.message and "reward.code.url" in r.message
        with pytest.raises(code.SandboxUnavailable, match="unshare"):
            code_reward("```python\n" + SQUARE + "```", json.dumps({"assert": TESTS}))
    finally:
        interpreter.cache_clear()


def test_reward_code_config_is_checked_before_anything_runs():
    from rlcli.rewards.config import validate

    with pytest.raises(ConfigError, match=r"reward.timeout_s=5 must exceed reward.code.timeout_s=5"):
        validate(RewardConfig(weights={"code": 1.0}))
    cfg = RewardConfig(weights={"code": 1.0}, timeout_s=10.0)
    cfg.code.memory_mb = 4096
    with pytest.raises(ConfigError, match="reward.code.memory_mb=4096 exceeds reward.memory_mb=2048"):
        validate(cfg)
    cfg.code.memory_mb = 512
    cfg.code.url = "localhost:8080"
    with pytest.raises(ConfigError, match="not an http"):
        validate(cfg)
