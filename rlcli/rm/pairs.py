"""Preference pairs `{"prompt", "chosen", "rejected", "margin"}` for `rlcli rm`: texts the reward model reads as
`prompt + chosen` and `prompt + rejected` (rlcli.models.reward.encode), and a LoadReport of what was dropped and why.

Three sources (`rm.source`):
  arith  the embedded task (rlcli/data/arith.py): each problem's correct worked solution is `chosen`; `rejected`
         is the same problem worked with a carry slip and computed on from it, so its \\boxed{} answer is wrong:
         a forgotten carry or borrow (the slip the tiny policy's warm start demonstrates and RL must unlearn:
         rlcli/models/sft.py's carry_slip), for half the problems that have one, or a carry taken where none is due
         (the opposite slip, so that "more +1 is better" is no shortcut). The problems split as the task's do (a
         hash of the problem text), so no held-out pair's problem is ever trained on.
  samples  the policy's own samples on the run's task graded by the verifier: a correct and an incorrect reply to the
         same prompt, built once and cached (rlcli/rm/samples.py).
  file   JSONL / Parquet / `datasets` directories read by rlcli.data.loaders (the same readers, formats,
         `pkg://` paths, hash hold-out and bad-row accounting as data.*), one pair a row: rm.prompt_key,
         rm.chosen_key, rm.rejected_key (dotted paths, `a|b` alternatives) and optionally rm.margin_key. A prompt is a
         string or chat messages; a response is a string, or chat messages whose turns after the last user turn are
         the response. With the tokenizer's chat template (rm.chat) the prompt is rendered with the generation prompt
         and the response is the rest of the rendered conversation.
Bad rows are skipped and counted by reason, the first rm.report_bad_rows by row number; pairs whose longer side
exceeds rm.max_len tokens are dropped and counted, never cut.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Iterator, Mapping
from typing import Any

from rlcli.core.schema import ConfigError
from rlcli.data.adapters import ABSENT, BadRow, get_path, take_prompt
from rlcli.data.loaders import CHECK_ROWS, LoadReport, hold_out, keyed_rows, resolve_path, usable_rows
from rlcli.data.templates import Prompt, last_user_index, render_prompt, use_chat_template

Pair = dict[str, Any]
"""{"prompt": str, "chosen": str, "rejected": str, "margin": float}: rendered texts."""

SPLITS = ("train", "eval")


# ---------------------------------------------------------------------------- the embedded arith pairs
def arith_pairs(split: str, size: int, min_digits: int, max_digits: int) -> list[Pair]:
    """`size` pairs on problems of the arith task's `split` (rlcli.data.arith.arith_examples, seed 0), deterministic
    in the arguments. `rejected` is the problem worked with a carry slip and computed on from it (module docstring):
    for half of the problems with a carry, one or more forgotten carries (each with probability 1/2, at least one);
    otherwise a carry taken into a column that receives none (the tens column or higher where there is one)."""
    from rlcli.data.arith import arith_examples, carry_columns, make_example

    problems = arith_examples(split, size, seed=0, min_digits=min_digits, max_digits=max_digits)
    rng = random.Random(f"rm/arith_pairs/{split}")
    pairs = []
    for ex in problems:
        a, op, b = re.fullmatch(r"Q: (\d+)([+-])(\d+)=\?\nA:", ex["prompt"]).groups()  # type: ignore[union-attr]
        a, b = int(a), int(b)
        carries = carry_columns(a, b, op)
        free = [c for c in range(max(len(str(a)), len(str(b)))) if c not in carries]
        if carries and (not free or rng.random() < 0.5):
            forget = frozenset(c for c in carries if rng.random() < 0.5) or frozenset([rng.choice(carries)])
            rejected = make_example(a, b, op, forget=forget)["solution"]
        else:
            column = rng.choice([c for c in free if c > 0] or free)
            rejected = make_example(a, b, op, invent=frozenset([column]))["solution"]
        assert rejected != ex["solution"], (ex["prompt"], rejected)
        pairs.append({"prompt": ex["prompt"], "chosen": ex["solution"], "rejected": rejected, "margin": 0.0})
    return pairs


# ---------------------------------------------------------------------------- files
def take_response(row: Mapping[str, Any], key: str, what: str) -> str | list[dict[str, str]]:
    """The response at `key`: a non-empty string, or chat messages (the turns after the last user turn, if any)."""
    value = get_path(row, key)
    if value is ABSENT:
        raise BadRow(f"missing {what}", f"no {what} response in column {key!r}")
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(f"empty {what}", f"{what} response in column {key!r} is empty")
        return value
    if isinstance(value, list | tuple) and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        if any(m["role"] == "user" for m in messages):  # a whole conversation: its reply
            messages = messages[last_user_index(messages) + 1 :]
        if not messages or not any(m["content"].strip() for m in messages):
            raise BadRow(f"empty {what}", f"{what} conversation in column {key!r} has no reply after the prompt")
        return messages
    raise BadRow("wrong type", f"{what} response in column {key!r} is {type(value).__name__}, expected a string "
                               "or chat messages")


def take_margin(row: Mapping[str, Any], key: str | None) -> float:
    if key is None:
        return 0.0
    value = get_path(row, key)
    if value is ABSENT or isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        shown = "missing" if value is ABSENT else repr(value)
        raise BadRow("bad margin", f"margin in column {key!r} is {shown}, expected a finite number")
    return float(value)


def pair_columns(row: Mapping[str, Any], rm: Any) -> tuple[Prompt, Any, Any, float]:
    """One row -> (prompt, chosen, rejected, margin), unrendered; BadRow if it cannot be a pair."""
    prompt = take_prompt(row, rm.prompt_key)
    chosen = take_response(row, rm.chosen_key, "chosen")
    rejected = take_response(row, rm.rejected_key, "rejected")
    if chosen == rejected:
        raise BadRow("identical responses", "chosen and rejected are the same: the pair states no preference")
    return prompt, chosen, rejected, take_margin(row, rm.margin_key)


def render_pair(prompt: Prompt, chosen: Any, rejected: Any, chat: bool, tokenizer: Any) -> tuple[str, str, str]:
    """(prompt text, chosen text, rejected text): with the chat template, the prompt with the generation prompt and
    each response as the rest of its rendered conversation; without it, the texts (message contents joined by blank
    lines, as rlcli.data.templates.render_prompt joins a prompt's)."""
    text = render_prompt(prompt, "question", chat, tokenizer)
    if not chat:
        def plain(r: Any) -> str:
            return r if isinstance(r, str) else "\n\n".join(m["content"] for m in r)

        return text, plain(chosen), plain(rejected)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def reply(r: Any) -> str:
        turns = [{"role": "assistant", "content": r}] if isinstance(r, str) else r
        full = tokenizer.apply_chat_template(messages + turns, tokenize=False)
        if not full.startswith(text):
            raise BadRow("chat template", "the rendered conversation does not start with the rendered prompt")
        return full[len(text) :]

    return text, reply(chosen), reply(rejected)


def _rows(rm: Any, report: LoadReport, rows: Iterator[Any]) -> tuple[list[tuple[int, Prompt, Any]], list[str] | None]:
    """Usable rows (row number, prompt, (chosen, rejected, margin)) and the first row's columns; bad rows counted."""
    def parse(row: Mapping) -> tuple[Prompt, Any]:
        prompt, *pair = pair_columns(row, rm)
        return prompt, tuple(pair)

    return usable_rows(rows, parse, report, rm.report_bad_rows)


def _key(rm: Any, split: str) -> str:
    return "rm.eval_path" if split == "eval" and rm.eval_path is not None else "rm.train_path"


def _no_pair(rm: Any, key: str, path: Any, report: LoadReport, columns: list[str] | None) -> ConfigError:
    reasons = ", ".join(f"{kind} {n}" for kind, n in report.skipped.most_common()) or "the file has no rows"
    first = "; ".join(f"row {row}: {reason}" for row, reason in report.first_skipped)
    seen = f"; its rows have columns {columns}" if columns else ""
    if columns:
        import difflib

        for name in ("prompt_key", "chosen_key", "rejected_key", "margin_key"):
            value = getattr(rm, name)
            close = difflib.get_close_matches(value, [c for c in columns if c != value], n=1) if value else []
            if value and value not in columns and "." not in value and "|" not in value and close:
                seen += f" (did you mean rm.{name}={close[0]}?)"
    return ConfigError(
        f"{key}={path}: no usable preference pair among {report.rows} rows: each needs a prompt in column "
        f"{rm.prompt_key!r}, responses in {rm.chosen_key!r} and {rm.rejected_key!r}"
        + (f" and a margin in {rm.margin_key!r}" if rm.margin_key else "") + f"{seen}. Skipped: {reasons}"
        + (f" (first: {first})" if first else "") + ". Set rm.prompt_key / rm.chosen_key / rm.rejected_key to the "
        "file's columns (dotted paths reach nested fields)"
    )


def check_pairs(rm: Any) -> None:
    """Before anything loads: each pair file exists, has its suffix's format, and one of its first rows is a pair.
    Raises the ConfigError the full load would, naming the key, in a fraction of a second."""
    if rm.source != "file":
        return
    for key in dict.fromkeys(_key(rm, split) for split in SPLITS):
        path = resolve_path(getattr(rm, key.removeprefix("rm.")), key)
        report = LoadReport(split="check", source=str(path))
        usable, columns = _rows(rm, report, itertools.islice(keyed_rows(path, key), CHECK_ROWS))
        if not usable:
            raise _no_pair(rm, key, path, report, columns)


def load_pairs(cfg: Any, split: str, tokenizer: Any) -> tuple[list[Pair], LoadReport]:
    """The pairs of `split` ("train" | "eval") and the report of the load (its summary line is the start-up
    summary's). Lengths are measured as the reward model reads a pair: tokenizer(prompt + response)."""
    rm = cfg.rm
    size = rm.train_size if split == "train" else rm.eval_size
    if rm.source in ("arith", "samples"):
        if rm.source == "arith":
            pairs, source = arith_pairs(split, size, cfg.data.min_digits, cfg.data.max_digits), "the embedded arith pairs"
        else:
            from rlcli.models import resolve_model_path
            from rlcli.rm.samples import load_sample_pairs

            pairs, source = load_sample_pairs(cfg, split, resolve_model_path(cfg.model, cfg.data)[0])
        report = LoadReport(split=f"rm {split}", source=source, generated=True)
        rows = [(i + 1, p["prompt"], p) for i, p in enumerate(pairs)]
    else:
        key = _key(rm, split)
        path = resolve_path(getattr(rm, key.removeprefix("rm.")), key)
        report = LoadReport(split=f"rm {split}", source=str(path))
        rows, columns = _rows(rm, report, keyed_rows(path, key))
        if not rows:
            raise _no_pair(rm, key, path, report, columns)
        if rm.eval_path is None:
            rows, report.held_out = hold_out(rows, split, rm.eval_fraction, path)
        chat = use_chat_template(rm.chat, tokenizer)
        rendered = []
        for row_no, prompt, (chosen, rejected, margin) in rows:
            try:
                text, c, r = render_pair(prompt, chosen, rejected, chat, tokenizer)
            except BadRow as bad:
                report.skip(row_no, bad, rm.report_bad_rows)
                continue
            rendered.append((row_no, text, {"prompt": text, "chosen": c, "rejected": r, "margin": margin}))
        rows = rendered
    report.max_prompt_len = rm.max_len
    pairs: list[Pair] = []
    for row_no, _, pair in rows:
        if size is not None and len(pairs) >= size:
            report.over_size += 1
            continue
        longest = max(len(ids) for ids in tokenizer([pair["prompt"] + pair["chosen"], pair["prompt"] + pair["rejected"]],
                                                      add_special_tokens=False)["input_ids"])
        if longest > rm.max_len:
            report.too_long += 1
            if len(report.first_too_long) < rm.report_bad_rows:
                report.first_too_long.append((row_no, longest))
            continue
        pairs.append(pair)
    report.kept = len(pairs)
    if not pairs:
        raise ConfigError(f"rm: no {split} pair is at most rm.max_len={rm.max_len} tokens long ({report.too_long} "
                          "longer): raise rm.max_len (pairs are dropped, never cut)")
    return pairs, report
