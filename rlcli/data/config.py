"""`data` config group schema (docs/data.md explains every key with examples)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcli.core.schema import ConfigError, check_ranges, rng
from rlcli.data.adapters import ADAPTERS
from rlcli.data.curriculum import CurriculumConfig
from rlcli.data.curriculum import check as check_curriculum
from rlcli.data.reasoning_gym import ReasoningGymConfig

SOURCES = ("arith", "file", "reasoning_gym", "verifiers")
CHAT_MODES = ("auto", "always", "never")


@dataclass
class DataConfig:
    name: str = "arith"
    """Preset name."""
    source: str = rng("arith", choices=SOURCES)
    """Where prompts come from: `arith` (the embedded synthetic task) | `file` (train_path / eval_path) | `reasoning_gym`
    (reasoning-gym's procedural tasks, data.reasoning_gym.tasks; docs/environments.md) | `verifiers` (the tasks of
    env=verifiers' taskset, which sets it)."""
    train_path: str | None = None
    """source=file: JSONL (.jsonl/.json, .jsonl.gz), Parquet (.parquet) or a `datasets.save_to_disk` directory; `pkg://rlcli/...` = a file shipped in the package."""
    eval_path: str | None = None
    """source=file: held-out file in the same schema; null = hold out `eval_fraction` of train_path."""
    eval_fraction: float = rng(0.1, gt=0, lt=1)
    """source=file without eval_path: share of distinct prompts held out for eval (chosen by a hash of the prompt: seed- and order-independent)."""
    adapter: str = rng("columns", choices=ADAPTERS)
    """Row schema adapter (rlcli.data.adapters.ADAPTERS): columns | dapo_math | gsm8k | math | aime | code."""
    prompt_key: str = "prompt"
    """Column holding the problem (a string or a chat-message list); dotted paths reach nested fields, `a|b` = first present."""
    answer_key: str = "answer"
    """Column holding the ground-truth answer, e.g. `reward_model.ground_truth`; same path syntax as prompt_key."""
    solution_key: str = "solution"
    """math adapter: column whose last \\boxed{} is the answer when the answer column is absent or empty."""
    template: str = "question"
    """Prompt template: question (passthrough) | dapo (DAPO's `Answer:` instruction) | boxed | answer_tag (the answer between <answer> tags, reasoning-gym's), or a literal text containing {question}."""
    chat: str = rng("auto", choices=CHAT_MODES)
    """Apply the tokenizer's chat template: auto (when tokenizer.chat_template is set) | always (fail without one) | never."""
    dedupe: bool = False
    """source=file: drop rows whose (prompt, answer) repeats an earlier row (counted)."""
    train_size: int | None = rng(20000, ge=1, why="null = all rows")
    """Training prompts: arith and reasoning_gym generate this many; files keep at most this many usable rows, in file order (null = all)."""
    eval_size: int | None = rng(200, ge=1, why="null = all rows")
    """Held-out prompts: arith and reasoning_gym generate this many (reasoning_gym then drops those that are training questions); files keep at most this many (null = all)."""
    min_digits: int = rng(2, ge=1)
    """arith: smallest operand length (difficulty floor)."""
    max_digits: int = rng(2, ge=1)
    """arith: largest operand length (difficulty ceiling)."""
    max_prompt_len: int = rng(256, ge=1)
    """Prompts longer than this many tokens (after template and chat template) are dropped and counted, never cut."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded)."""
    report_bad_rows: int = rng(5, ge=0)
    """How many skipped rows to report by row number and reason (all are counted)."""
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """source=reasoning_gym: its tasks (rlcli/data/reasoning_gym.py)."""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Task levels that follow the recent accuracy, and the levels of the held-out set (rlcli/data/curriculum.py)."""


def validate(data_cfg: Any) -> None:
    """Every field against its declared range or choices, then the rules that relate fields; raise ConfigError
    naming the key and the fix."""
    from rlcli.data.templates import check_template

    check_ranges(data_cfg, DataConfig, "data.")
    if data_cfg.source in ("arith", "reasoning_gym", "verifiers"):
        if data_cfg.train_path is not None or data_cfg.eval_path is not None:
            raise ConfigError(f"data.train_path/eval_path are set but data.source={data_cfg.source}: set "
                              "data.source=file")
        for key in ("train_size", "eval_size"):
            if getattr(data_cfg, key) is None and data_cfg.source != "verifiers":
                raise ConfigError(
                    f"data.{key}=null: the {data_cfg.source} task generates a fixed number of prompts; give one"
                )
    names: list[str] = []
    if data_cfg.source == "reasoning_gym":
        from rlcli.data.reasoning_gym import parse_tasks

        names = [t.name for t in parse_tasks(data_cfg.reasoning_gym.tasks)]
    elif data_cfg.reasoning_gym.tasks:
        raise ConfigError(f"data.reasoning_gym.tasks is set but data.source={data_cfg.source}: use "
                          "data=reasoning_gym, or drop the tasks")
    if data_cfg.source == "arith":
        if data_cfg.min_digits > data_cfg.max_digits:
            raise ConfigError(f"data.min_digits={data_cfg.min_digits} must be <= data.max_digits={data_cfg.max_digits}")
    elif data_cfg.source == "file" and not data_cfg.train_path:
        raise ConfigError(
            "data.source=file needs data.train_path (a .jsonl, .parquet or datasets directory)"
        )
    check_curriculum(data_cfg.curriculum, data_cfg.source, names)
    check_template(data_cfg.template)
