"""The embedded tiny model, its shipped tokenizer, and the cached supervised warm start."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from rlcli.data.arith import arith_examples
from rlcli.models.cache import task_args, warm_start_key
from rlcli.models.config import CHARS, SPECIAL_TOKENS, TinyModelConfig, WarmStartConfig
from rlcli.models.sft import demonstrations, sft_optimizer, sft_step, warm_start
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
    optimizer, scheduler = sft_optimizer(model, WarmStartConfig(steps=12, lr=1e-2, warmup=0))
    losses = [sft_step(model, tok, optimizer, scheduler, examples[i % 4 * 16 : i % 4 * 16 + 16])["loss"]
              for i in range(12)]
    assert losses[-1] < losses[0]


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
    other = WarmStartConfig(steps=3, batch_size=4, eval_size=4, cache_dir=str(tmp_path / "elsewhere"))
    assert warm_start_key(SMALL, other, task_args(max_digits=1)) != Path(path).name
    assert warm_start_key(SMALL, replace(other, steps=2), task_args(max_digits=1)) == Path(path).name
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


def test_a_build_that_fails_says_why_and_leaves_no_entry(tmp_path):
    """The `rlcli sft` child refuses a bad value before training: warm_start raises with the child's own message."""
    ws = WarmStartConfig(steps=1, batch_size=2, eval_size=2, warmup=-1, cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"exited with 2; its output ended:\n(.|\n)*model.warm_start.warmup=-1"):
        warm_start(SMALL, ws, progress=False, max_digits=1)
    assert not (tmp_path / "warm_start").exists()


def test_a_task_argument_without_a_config_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'ops': '-'. has no config key"):
        warm_start(SMALL, WarmStartConfig(steps=1, cache_dir=str(tmp_path)), progress=False, ops="-")


def test_warm_start_trains_on_slipped_demonstrations():
    from rlcli.core.answers import extract_final_answer

    train, evals = demonstrations(WarmStartConfig(steps=1, batch_size=64, eval_size=2, carry_slip=1.0),
                                  task_args(min_digits=2, max_digits=2))
    assert len(train) == 64 and len(evals) == 2
    wrong = [extract_final_answer(ex["solution"]) != ex["answer"] for ex in train]
    assert 0 < sum(wrong) < len(wrong)  # every carried demonstration slips; carry-free ones stay right


def _sft(tmp_path, run: str, *overrides: str):
    """`rlcli sft`'s config for a SMALL warm start of 6 steps (as rlcli.commands.sft sets it: steps = its steps), with
    its own cache and run directory."""
    from conftest import compose
    from omegaconf import open_dict

    small = [f"model.tiny.{k}={v}" for k, v in vars(SMALL).items() if k in ("hidden_size", "num_layers", "num_heads",
                                                                             "intermediate_size")]
    cfg = compose(*small, "model.warm_start.steps=6", "model.warm_start.batch_size=5", "model.warm_start.eval_size=3",
                  "model.warm_start.warmup=2", "data.max_digits=1", "data.min_digits=1", "checkpoint.every=4",
                  f"model.warm_start.cache_dir={tmp_path / run / 'cache'}", *overrides, run_dir=str(tmp_path / run))
    with open_dict(cfg):
        cfg.steps = cfg.model.warm_start.steps
    return cfg


def test_sft_stopped_by_sigterm_and_resumed_builds_the_same_warm_start(tmp_path, capfd, monkeypatch):
    """`rlcli sft` on the job harness: a build stopped by SIGTERM during step 3 (a checkpoint written, the resume command
    named) and resumed equals the straight build: each step's loss, the shuffled order and its stream, the optimizer
    and the schedule (the lr of every step), and the published warm start, weights and accuracies; 12 demonstrations
    per epoch in steps of 5 so that an epoch ends mid-batch and the order is carried across the checkpoint."""
    import os
    import signal

    from safetensors.torch import load_file

    import rlcli.loop.sft as sft
    from rlcli.loop import checkpoint as ckpt

    class StopAt3(sft.SFTTrainer):
        def train_step(self, step):
            out = super().train_step(step)
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # as a preemption, during the step
            return out

    def twelve(ws, data):
        train, evals = demonstrations(ws, data)
        return train[:12], evals

    monkeypatch.setattr(sft, "demonstrations", twelve)
    straight = sft.SFTTrainer(_sft(tmp_path, "straight"))
    a = straight.fit()
    with pytest.raises(ckpt.Stopped):
        StopAt3(_sft(tmp_path, "stopped")).fit()
    said = capfd.readouterr().out
    assert "stopped by SIGTERM after step 3" in said and "rlcli sft" in said and "resume=auto" in said
    resumed = sft.SFTTrainer(_sft(tmp_path, "stopped", "resume=auto"))
    assert resumed.state.step == 3 and len(resumed.state.losses) == 3
    b = resumed.fit()
    rows = lambda run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    per_step = lambda run: [(r["step"], r["sft/loss"], r["sft/lr"]) for r in rows(run) if "sft/loss" in r]  # noqa: E731
    assert per_step("stopped") == per_step("straight") and len(per_step("straight")) == 6
    assert resumed.state.losses == straight.state.losses and resumed.state.order == straight.state.order
    assert resumed.state.draws.getstate() == straight.state.draws.getstate()
    wa, wb = (load_file(os.path.join(r["model_path"], "model.safetensors")) for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = (json.loads((Path(r["model_path"]) / "warm_start.json").read_text()) for r in (a, b))
    assert (ra["greedy_acc"], ra["sampled_acc"], ra["train_loss"], ra["train_steps"]) == (
        rb["greedy_acc"], rb["sampled_acc"], rb["train_loss"], rb["train_steps"]) and ra["train_steps"] == 6
    assert ra["key"] == Path(a["model_path"]).name and a["eval_after"] == {
        "eval/greedy_acc": ra["greedy_acc"], "eval/sampled_acc": ra["sampled_acc"]}


def test_a_build_stopped_midway_resumes_when_the_next_run_needs_it(tmp_path):
    """A run that needs a warm start builds it with `rlcli sft` in a fixed directory beside the cache: a build stopped
    after step 3 (SIGTERM, its checkpoint written) is resumed there by the next warm_start call, which publishes the
    same weights as a straight build."""
    import os
    import signal

    from omegaconf import OmegaConf, open_dict
    from safetensors.torch import load_file

    from rlcli.loop import checkpoint as ckpt
    from rlcli.loop.sft import SFTTrainer
    from rlcli.models.cache import build_dir

    class StopAt3(SFTTrainer):
        def train_step(self, step):
            out = super().train_step(step)
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

    cfg = _sft(tmp_path, "straight")
    straight = SFTTrainer(cfg).fit()["model_path"]
    tiny, ws = (OmegaConf.to_object(n) for n in (cfg.model.tiny, cfg.model.warm_start))
    ws = replace(ws, cache_dir=str(tmp_path / "needed"))
    data = task_args(min_digits=1, max_digits=1)
    stopped = _sft(tmp_path, "unused", f"model.warm_start.cache_dir={ws.cache_dir}")
    with open_dict(stopped):
        stopped.run_dir = build_dir(tiny, ws, data)
    with pytest.raises(ckpt.Stopped):
        StopAt3(stopped).fit()
    path = warm_start(tiny, ws, progress=False, **data)
    assert "resumed from" in (Path(stopped.run_dir) / "cli.log").read_text()
    assert not (Path(stopped.run_dir) / "checkpoints").exists()  # dropped once published; the logs stay
    wa, wb = (load_file(os.path.join(p, "model.safetensors")) for p in (straight, path))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_stopped_build_resumes_whatever_else_the_config_says_but_not_another_warm_start(tmp_path):
    """`rlcli sft` resumes a checkpoint of the same warm start (its cache key) whatever else differs (an rlcli
    upgrade that moved an unrelated default, another cache root): nothing else shapes its steps; a checkpoint of
    another warm start is refused with both keys. And an int in a float field is the same warm start as the float."""
    from conftest import compose
    from omegaconf import OmegaConf

    from rlcli.commands.sft import same_warm_start
    from rlcli.core.schema import ConfigError

    OmegaConf.save(compose("model.warm_start.steps=7", "model.warm_start.cache_dir=/elsewhere", "optim.lr=0.5",
                           run_dir=str(tmp_path)), tmp_path / "config.yaml")
    same_warm_start(str(tmp_path), compose("model.warm_start.steps=7", "logger=stdout", run_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"trained another warm start \(key \w{16}; this config's is \w{16}\)"):
        same_warm_start(str(tmp_path), compose("model.warm_start.steps=8", run_dir=str(tmp_path)))
    assert warm_start_key(SMALL, WarmStartConfig(carry_slip=0), task_args()) == warm_start_key(
        SMALL, WarmStartConfig(carry_slip=0.0), task_args())


def test_a_run_waits_for_its_warm_start_at_most_twenty_times_the_estimate_and_an_hour_at_least():
    from rlcli.models.sft import build_timeout

    assert build_timeout(WarmStartConfig(steps=2, batch_size=4, eval_size=4)) == 3600.0
    assert build_timeout(WarmStartConfig(steps=2000, batch_size=320, eval_size=200)) == pytest.approx(
        20 * (2000 * 320 * 0.012 + 200 * 0.05))
