"""The embedded tiny model, its shipped tokenizer, and the cached supervised warm start."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from rlcli.data.arith import arith_examples
from rlcli.models.cache import task_args, warm_start_key
from rlcli.models.config import CHARS, SPECIAL_TOKENS, TinyModelConfig, WarmStartConfig
from rlcli.models.sft import sft_train, warm_start
from rlcli.models.tiny import (
    build_tiny_model,
    build_tiny_tokenizer,
    load_tiny_tokenizer,
)

SMALL = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


def test_tokenizer_round_trips_whitespace_and_braces(tok):
    text = "Q: 347+85=?\nA: 7+5=12\n  4+8+1=13 \n\n\\boxed{432}  ~`|()[]*:'\"!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one character, one token
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    # Adds nothing by itself; an explicit </s> decodes as itself and is skipped on request.
    assert tok(text)["input_ids"] == ids
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_tokenizer_vocab_and_special_ids(tok):
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARS) == 100
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == SPECIAL_TOKENS
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert tok.decode(tok("\t", add_special_tokens=False)["input_ids"]) == "<unk>"
    left = tok(["ab", "abcd"], padding=True, padding_side="left")["input_ids"]
    assert left[0][:2] == [tok.pad_token_id] * 2


def test_shipped_tokenizer_matches_builder(tok):
    """If this fails, rebuild the files: python -m rlcli.models.tiny"""
    assert build_tiny_tokenizer().get_vocab() == tok.get_vocab()


def test_default_model_size_and_ids(tok):
    with torch.device("meta"):
        model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    assert 4.0e6 < sum(p.numel() for p in model.parameters()) < 4.5e6
    assert model.config.vocab_size == len(tok)
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.config.eos_token_id == tok.eos_token_id


def test_model_is_seeded_and_generates(tok):
    a = build_tiny_model(SMALL, tok, seed=1)
    b = build_tiny_model(SMALL, tok, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    enc = tok(["Q: 1+2=?\nA:", "Q: 10+20=?\nA:"], padding=True, padding_side="left", return_tensors="pt")
    out = a.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    prompt_len = enc["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 5


def test_sft_targets_are_response_plus_eos(tok):
    from rlcli.models.sft import _encode_examples

    examples = arith_examples("train", 3, seed=0)
    ids, mask, labels = _encode_examples(tok, examples)  # [3, L] each
    for i, ex in enumerate(examples):
        n, p = int(mask[i].sum()), len(ex["prompt"])
        assert tok.decode(ids[i, :n]) == ex["prompt"] + ex["solution"] + tok.eos_token
        assert (labels[i, :p] == -100).all() and (labels[i, n:] == -100).all()
        assert tok.decode(labels[i, p:n]) == ex["solution"] + tok.eos_token


def test_sft_lowers_loss(tok):
    model = build_tiny_model(SMALL, tok, seed=0)
    examples = arith_examples("train", 64, seed=0, max_digits=1)
    stats = sft_train(model, tok, examples, steps=12, batch_size=16, lr=1e-2, seed=0, progress=False)
    assert stats["losses"][-1] < stats["losses"][0]


def test_warm_start_is_cached_and_loadable(tmp_path, tok, caplog):
    ws = WarmStartConfig(steps=2, batch_size=4, eval_size=4, cache_dir=str(tmp_path))
    with caplog.at_level("INFO", logger="rlcli.models.sft"):
        path = warm_start(SMALL, ws, progress=False, max_digits=1)
    report = json.loads((Path(path) / "warm_start.json").read_text())
    assert report["train_steps"] == 2 and {"greedy_acc", "sampled_acc"} <= report.keys()
    # A build is announced before it starts (minutes on a loaded machine, before any other output) and timed after.
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith(f"building the tiny model's warm start (once: cached under {path} for later runs): "
                              "2 steps of 4 demonstrations") and " s on 2 idle cores" in said[0], said
    assert said[-1].startswith("warm start built in ") and f"greedy acc {report['greedy_acc']:.3f}" in said[-1], said
    assert report["acc_without_tools"] is False and "without the calculator" not in said[-1]
    mtime = (Path(path) / "warm_start.json").stat().st_mtime_ns
    assert warm_start(SMALL, ws, progress=False, max_digits=1) == path
    assert warm_start(SMALL, ws, progress=False, min_digits=1, max_digits=1, ops="+") == path
    assert (Path(path) / "warm_start.json").stat().st_mtime_ns == mtime  # not retrained
    # Only the finished entry is left in the cache: no temp dirs.
    assert [p.name for p in Path(path).parent.iterdir()] == [Path(path).name]
    # A different config is a different entry; cache_dir is not part of the key.
    other = warm_start(SMALL, WarmStartConfig(steps=3, batch_size=4, eval_size=4, cache_dir=str(tmp_path)),
                       progress=False, max_digits=1)
    assert other != path
    keys = {warm_start_key(SMALL, WarmStartConfig(carry_slip=slip), task_args()) for slip in (0.0, 0.5)}
    assert len(keys) == 2  # imperfect demonstrations are a different warm start

    model = AutoModelForCausalLM.from_pretrained(path)
    loaded = PreTrainedTokenizerFast.from_pretrained(path)
    assert loaded.get_vocab() == tok.get_vocab()
    text = "Q: 3+4=?\nA: 4+3=7\n\\boxed{7}"
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert model.config.eos_token_id == loaded.eos_token_id
    model.generate(**loaded(["Q: 3+4=?\nA:"], return_tensors="pt"), max_new_tokens=3)


def test_a_warm_start_with_tool_demonstrations_says_its_accuracy_is_without_the_tool(tmp_path, caplog):
    """recipe=tools/calculator's warm start calls the calculator, which its single-turn accuracy check does not run:
    that number (0.205 greedy for the recipe's model) is not the run's held-out accuracy with the environment (0.770
    before training), and the log and warm_start.json say so."""
    ws = WarmStartConfig(steps=1, batch_size=4, eval_size=2, tool_demos=0.5, cache_dir=str(tmp_path))
    with caplog.at_level("INFO", logger="rlcli.models.sft"):
        path = warm_start(SMALL, ws, progress=False, max_digits=1)
    assert json.loads((Path(path) / "warm_start.json").read_text())["acc_without_tools"] is True
    assert "on 2 held-out problems answered without the calculator" in caplog.records[-1].getMessage()


def test_warm_start_rejects_unknown_task_args(tmp_path):
    with pytest.raises(TypeError, match="digits"):
        warm_start(SMALL, WarmStartConfig(cache_dir=str(tmp_path)), progress=False, digits=3)


def test_warm_start_crash_leaves_no_entry(tmp_path, monkeypatch):
    import rlcli.models.sft as sft

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(sft, "greedy_accuracy", boom)
    ws = WarmStartConfig(steps=1, batch_size=2, eval_size=2, cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="boom"):
        sft.warm_start(SMALL, ws, progress=False, max_digits=1)
    assert list((tmp_path / "warm_start").iterdir()) == []


def test_warm_start_trains_on_slipped_demonstrations(tmp_path, monkeypatch):
    import rlcli.models.sft as sft
    from rlcli.core.answers import extract_final_answer

    seen = {}
    real = sft.sft_train

    def capture(model, tokenizer, examples, *args, **kwargs):
        seen["examples"] = examples
        return real(model, tokenizer, examples, *args, **kwargs)

    monkeypatch.setattr(sft, "sft_train", capture)
    ws = WarmStartConfig(steps=1, batch_size=64, eval_size=2, carry_slip=1.0, cache_dir=str(tmp_path))
    sft.warm_start(SMALL, ws, progress=False, min_digits=2, max_digits=2)
    wrong = [extract_final_answer(ex["solution"]) != ex["answer"] for ex in seen["examples"]]
    assert 0 < sum(wrong) < len(wrong)  # every carried demonstration slips; carry-free ones stay right
