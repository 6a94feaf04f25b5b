"""`data` config group schema (docs/data.md explains every key with examples)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SOURCES = ("arith", "file")
CHAT_MODES = ("auto", "always", "never")


@dataclass
class DataConfig:
    name: str = "arith"
    """Preset name."""
    source: str = "arith"
    """Where prompts come from: `arith` (the embedded synthetic task) | `file` (train_path / eval_path)."""
    train_path: str | None = None
    """source=file: JSONL (.jsonl/.json), Parquet (.parquet) or a `datasets.save_to_disk` directory; `pkg://rlcli/...` = a file shipped in the package."""
    eval_path: str | None = None
    """source=file: held-out file in the same schema; null = hold out `eval_fraction` of train_path."""
    eval_fraction: float = 0.1
    """source=file without eval_path: share of distinct prompts held out for eval (chosen by a hash of the prompt: seed- and order-independent)."""
    adapter: str = "columns"
    """Row schema adapter (rlcli.data.adapters.ADAPTERS): columns | dapo_math | gsm8k | math | aime."""
    prompt_key: str = "prompt"
    """Column holding the problem (a string or a chat-message list); dotted paths reach nested fields, `a|b` = first present."""
    answer_key: str = "answer"
    """Column holding the ground-truth answer, e.g. `reward_model.ground_truth`; same path syntax as prompt_key."""
    solution_key: str = "solution"
    """math adapter: column whose last \\boxed{} is the answer when the answer column is absent or empty."""
    template: str = "question"
    """Prompt template: question (passthrough) | dapo (DAPO's `Answer:` instruction) | boxed, or a literal text containing {question}."""
    chat: str = "auto"
    """Apply the tokenizer's chat template: auto (when tokenizer.chat_template is set) | always (fail without one) | never."""
    dedupe: bool = False
    """source=file: drop rows whose (prompt, answer) repeats an earlier row (counted)."""
    train_size: int | None = 20000
    """Training prompts: arith generates this many; files keep at most this many usable rows, in file order (null = all)."""
    eval_size: int | None = 200
    """Held-out prompts: arith generates this many; files keep at most this many (null = all)."""
    min_digits: int = 2
    """arith: smallest operand length (difficulty floor)."""
    max_digits: int = 2
    """arith: largest operand length (difficulty ceiling)."""
    max_prompt_len: int = 256
    """Prompts longer than this many tokens (after template and chat template) are dropped and counted, never cut."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded)."""
    report_bad_rows: int = 5
    """How many skipped rows to report by row number and reason (all are counted)."""


def validate(data_cfg: Any) -> None:
    """Cross-field checks for the `data` group; raise ValueError naming the key and the fix."""
    from rlcli.data.adapters import ADAPTERS
    from rlcli.data.templates import check_template

    if data_cfg.source not in SOURCES:
        raise ValueError(f"data.source={data_cfg.source!r}: choose one of {', '.join(SOURCES)}")
    if data_cfg.source == "arith":
        if data_cfg.train_path is not None or data_cfg.eval_path is not None:
            raise ValueError("data.train_path/eval_path are set but data.source=arith: set data.source=file")
        for key in ("train_size", "eval_size"):
            if getattr(data_cfg, key) is None:
                raise ValueError(
                    f"data.{key}=null: the arith task generates a fixed number of prompts; give one"
                )
    else:
        if not data_cfg.train_path:
            raise ValueError(
                "data.source=file needs data.train_path (a .jsonl, .parquet or datasets directory)"
            )
        if data_cfg.eval_path is None and not 0.0 < data_cfg.eval_fraction < 1.0:
            raise ValueError(
                f"data.eval_fraction={data_cfg.eval_fraction} must lie in (0, 1) when data.eval_path is "
                "null (the eval split is held out of train_path); or give data.eval_path"
            )
    ADAPTERS.check(data_cfg.adapter, "data.adapter")
    check_template(data_cfg.template)
    if data_cfg.chat not in CHAT_MODES:
        raise ValueError(f"data.chat={data_cfg.chat!r}: choose one of {', '.join(CHAT_MODES)}")
    for key in ("train_size", "eval_size"):
        value = getattr(data_cfg, key)
        if value is not None and value < 1:
            raise ValueError(f"data.{key}={value} must be >= 1 (or null = all rows)")
    if data_cfg.max_prompt_len < 1:
        raise ValueError(f"data.max_prompt_len={data_cfg.max_prompt_len} must be >= 1")
    if data_cfg.report_bad_rows < 0:
        raise ValueError(f"data.report_bad_rows={data_cfg.report_bad_rows} must be >= 0")
