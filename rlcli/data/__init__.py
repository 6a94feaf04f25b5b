"""Prompt sources and the per-rank prompt stream.

`load_split` / `load_examples` give the examples `{"prompt", "answer"}` of one split: the embedded
arith task (data.source=arith), a local file read through a schema adapter and a prompt template
(data.source=file; rlcli.data.loaders, docs/data.md), or reasoning-gym's procedural tasks (data.source=reasoning_gym;
rlcli.data.reasoning_gym, docs/environments.md). `prompt_stream` walks the training prompts; with data.curriculum
(rlcli.data.curriculum) a `CurriculumStream` draws them at the tasks' current levels.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcli.data.loaders import LoadReport

log = logging.getLogger(__name__)


def load_split(
    data_cfg: Any, split: str, seed: int, *, tokenizer: Any = None, env_cfg: Any = None
) -> tuple[list[dict[str, str]], LoadReport]:
    """Examples `{"prompt", "answer"}` of `split` ("train" | "eval") and the report of the load.

    `tokenizer` renders chat templates (data.chat) and measures prompts for data.max_prompt_len;
    without one, prompts are plain templated text and lengths are not checked. The report is also
    logged: a summary line, and the first bad / over-long rows with row numbers and reasons.
    arith prompts are generated already formatted (template, chat and length limit do not apply).
    data.source=verifiers reads the tasks of `env_cfg`'s env.verifiers (rlcli.envs.verifiers.load_rows).
    """
    from rlcli.data.config import validate
    from rlcli.data.loaders import LoadReport, load_file_split

    validate(data_cfg)
    if data_cfg.source == "arith":
        from rlcli.data.arith import arith_examples

        size = data_cfg.train_size if split == "train" else data_cfg.eval_size
        examples = arith_examples(
            split, size, seed=0, min_digits=data_cfg.min_digits, max_digits=data_cfg.max_digits
        )
        report = LoadReport(split=split, source="the embedded arith task", kept=len(examples), generated=True)
    elif data_cfg.source == "reasoning_gym":
        from rlcli.data.loaders import load_reasoning_gym_split

        examples, report = load_reasoning_gym_split(data_cfg, split, seed, tokenizer)
    elif data_cfg.source == "verifiers":
        from rlcli.data.loaders import load_verifiers_split

        examples, report = load_verifiers_split(data_cfg, env_cfg, split, tokenizer)
    else:
        examples, report = load_file_split(data_cfg, split, tokenizer)
    log.info(report.summary())
    for line in report.details():
        log.warning("data[%s] %s", split, line.strip())
    return examples, report


def load_examples(data_cfg: Any, split: str, seed: int, *, tokenizer: Any = None,
                  env_cfg: Any = None) -> list[dict[str, str]]:
    """Examples of `split`; `load_split` without the report (which is logged either way)."""
    return load_split(data_cfg, split, seed, tokenizer=tokenizer, env_cfg=env_cfg)[0]


class PromptStream:
    """Endless, seeded, epoch-shuffled prompts. Every rank walks the same global order and takes
    its own slice of each global draw, so ranks never see the same prompt in one step."""

    def __init__(self, examples: list[dict[str, str]], seed: int, shuffle: bool, rank: int, world: int):
        if not examples:
            raise ValueError("the training split has no usable prompt")
        self.examples, self.shuffle = examples, shuffle
        self.rng = random.Random(seed)
        self.rank, self.world = rank, world
        self.order: list[int] = []
        self.epoch = 0

    def _next_index(self) -> int:
        if not self.order:
            self.order = list(range(len(self.examples)))
            if self.shuffle:
                self.rng.shuffle(self.order)
            self.order.reverse()
            self.epoch += 1
        return self.order.pop()

    def state_dict(self) -> dict[str, Any]:
        """The stream's position: epoch, the rest of this epoch's order, the shuffling RNG."""
        return {"epoch": self.epoch, "order": list(self.order), "rng": self.rng.getstate(), "size": len(self.examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != len(self.examples):
            raise ValueError(f"the checkpoint's prompt stream walked {state['size']} training prompts, this run "
                             f"loaded {len(self.examples)}: resume with the same data")
        self.epoch, self.order = state["epoch"], list(state["order"])
        self.rng.setstate(state["rng"])

    def take(self, k: int) -> list[dict[str, str]]:
        """k prompts for this rank (the global draw is k * world)."""
        draw = [self._next_index() for _ in range(k * self.world)]
        return [self.examples[i] for i in draw[self.rank * k : (self.rank + 1) * k]]


class CurriculumStream(PromptStream):
    """The prompt stream of data.curriculum: a PromptStream over slots (task entry, row), walked exactly as a prompt
    list is (seeded, epoch-shuffled, a slice per rank), each slot read when drawn from its task's rows at the task's
    current level (`pools(entry, level)`, rlcli.data.loaders.LevelPools; the row modulo the rows that level kept).
    A position in the stream and the levels decide the prompt: a resumed run draws what the straight run drew."""

    def __init__(self, pools: Any, curriculum: Any, seed: int, shuffle: bool, rank: int, world: int):
        slots = [(i, row) for i, n in enumerate(pools.sizes) for row in range(n)]
        random.Random(f"curriculum/{seed}").shuffle(slots)  # the tasks mixed even with data.shuffle=false
        super().__init__(slots, seed, shuffle, rank, world)
        self.pools, self.curriculum = pools, curriculum

    def take(self, k: int) -> list[dict[str, str]]:
        out = []
        for i, row in super().take(k):  # the slots drawn
            rows = self.pools(i, self.curriculum.levels[self.pools.names[i]])
            out.append(rows[row % len(rows)])
        return out


def prompt_stream(data_cfg: Any, examples: list[dict[str, str]], seed: int, rank: int, world: int,
                  tokenizer: Any = None) -> tuple[PromptStream, Any]:
    """The run's training prompt stream over `examples` (load_split's), and its curriculum (None without
    data.curriculum.enabled; with it, the stream draws at the curriculum's levels and `examples` are not read)."""
    if not data_cfg.curriculum.enabled:
        return PromptStream(examples, seed, data_cfg.shuffle, rank, world), None
    from rlcli.data.loaders import LevelPools
    from rlcli.data.reasoning_gym import curriculum_for

    curriculum = curriculum_for(data_cfg)
    pools = LevelPools(data_cfg, seed, tokenizer)
    return CurriculumStream(pools, curriculum, seed, data_cfg.shuffle, rank, world), curriculum
