"""reasoning-gym's procedural tasks as prompts (data.source=reasoning_gym; docs/environments.md, "reasoning-gym").

reasoning-gym (`pip install 'rlcli[reasoning-gym]'`) generates verifiable problems offline: `create_dataset(name,
size=, seed=, **config)` gives entries `{"question", "answer", "metadata"}` and the dataset's own
`score_answer(answer, entry)` in [0, 1]. Here:

- `data.reasoning_gym.tasks` lists the tasks: a name, or `{name, weight, config}` (weight: the task's share of the
  rows, default 1; config: its own keyword arguments for create_dataset, never `seed` or `size`, which the split
  sets). Each task gets round(size x weight / total weight) rows of a split, by largest remainder (the counts add up
  to the size exactly), and the rows of all tasks are then shuffled together (seeded).
- Training rows are generated with the run's `seed`; held-out rows with EVAL_SEED = 2^31, whatever the run's seed, so
  every run of a seed sweep is scored on the same questions, far from the training seeds (most tasks draw entry i
  from Random(seed + i)). A training row whose question is also a held-out question is dropped and counted: no
  held-out question is ever trained on, and the held-out set depends only on the tasks and data.eval_size (with a
  curriculum or without, the same rows when the configs are equal).
- The prompt is the question through data.template (the preset's `answer_tag`: reasoning-gym's convention of the
  final answer between <answer> and </answer> tags) and data.chat, like every prompt; over-long ones are dropped and
  counted (data.max_prompt_len).
- The answer column is the ground-truth payload the reward `reasoning_gym` reads (rlcli/rewards/reasoning_gym.py):
  JSON `{"task": name, "config": config, "entry": entry}`; `task_of` reads the task back (per-task metrics).

With data.curriculum (rlcli/data/curriculum.py) each task moves through the levels of reasoning-gym's own curriculum
of it: the rows of a task at level L are generated from `level_config(task, L)` (the curriculum's configuration at
global level L over the task's config). The held-out rows are then generated at data.curriculum.eval_levels, and the
training rows of each level drop the held-out questions (`level_rows`).

reasoning_gym is imported only when rows are generated or the tasks are checked (about a second).
"""

from __future__ import annotations

import difflib
import functools
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcli.core.schema import ConfigError

INSTALL = "pip install 'rlcli[reasoning-gym]'"
EVAL_SEED = 2**31
"""The seed of every run's held-out rows: most tasks draw entry i from Random(seed + i), so the held-out generator is
2^31 entries from the small training seeds people use."""
KEY = "data.reasoning_gym.tasks"
RESERVED_CONFIG = ("seed", "size")
"""create_dataset keywords the split sets (train/eval seed, row count); a task's config may not set them."""


@dataclass
class ReasoningGymConfig:
    """data.reasoning_gym.*: the tasks of data.source=reasoning_gym (docs/environments.md, "reasoning-gym")."""

    tasks: list[Any] = field(default_factory=list)
    """reasoning-gym task names, or mappings {name, weight (share of the rows, default 1), config (the task's
    keyword arguments for create_dataset)}, e.g. [chain_sum, {name: gcd, weight: 2}]."""


@dataclass(frozen=True)
class Task:
    """One entry of data.reasoning_gym.tasks, normalised."""

    name: str
    weight: float
    config: dict[str, Any]

    @property
    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True)


def parse_tasks(tasks: Any) -> list[Task]:
    """data.reasoning_gym.tasks -> [Task]; a ConfigError names the item and the fix (the names are not checked here:
    `check_tasks` imports reasoning-gym for that)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(tasks, DictConfig | ListConfig):
        tasks = OmegaConf.to_container(tasks, resolve=True)
    if not tasks:
        raise ConfigError(f"data.source=reasoning_gym needs {KEY}: a list of task names, e.g. {KEY}=[chain_sum]")
    out = []
    for i, item in enumerate(tasks):
        where = f"{KEY}[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ConfigError(f"{where}={item!r}: give a task name or a mapping {{name, weight, config}}")
        extra = sorted(set(item) - {"name", "weight", "config"})
        if extra:
            raise ConfigError(f"{where}.{extra[0]} is not a task key: a task is {{name, weight, config}} (the task's "
                              f"own arguments go under {where}.config)")
        weight = item.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < float("inf"):
            raise ConfigError(f"{where}.weight={weight!r} must be a number > 0 (the task's share of the rows)")
        config = item.get("config") or {}
        if not isinstance(config, Mapping):
            raise ConfigError(f"{where}.config={config!r} must be a mapping of the task's keyword arguments")
        for key in RESERVED_CONFIG:
            if key in config:
                raise ConfigError(f"{where}.config.{key} is set by the split (data.train_size / data.eval_size, and "
                                  f"the run's seed): drop it")
        out.append(Task(item["name"], float(weight), dict(config)))
    return out


def task_names(data_cfg: Any) -> list[str]:
    """The distinct task names of a reasoning_gym run, in config order (per-task metrics); [] for other sources."""
    if data_cfg.source != "reasoning_gym":
        return []
    return list(dict.fromkeys(t.name for t in parse_tasks(data_cfg.reasoning_gym.tasks)))


def _import() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"data.source=reasoning_gym needs the reasoning-gym package, which is not installed: "
                          f"{INSTALL}") from None
    return reasoning_gym


def check_tasks(tasks: list[Task]) -> None:
    """Each task name is a reasoning-gym dataset and its config builds one; else a one-line ConfigError naming the
    close names or the rejected argument. Imports reasoning-gym (about a second)."""
    rg = _import()
    from reasoning_gym.factory import DATASETS

    for i, t in enumerate(tasks):
        if t.name not in DATASETS:
            close = difflib.get_close_matches(t.name, list(DATASETS), n=3)
            hint = f"did you mean {' or '.join(close)}?" if close else "no close name"
            raise ConfigError(f"{KEY}[{i}]: {t.name!r} is not a reasoning-gym task ({hint}); reasoning_gym.factory."
                              f"DATASETS lists all {len(DATASETS)}")
        try:
            rg.create_dataset(t.name, size=1, seed=0, **t.config)
        except Exception as e:  # TypeError (an unknown argument), AssertionError (its validate), ValueError
            raise ConfigError(f"{KEY}[{i}].config={t.config}: reasoning-gym's {t.name} rejects it "
                              f"({type(e).__name__}: {e})") from None


def shares(size: int, weights: list[float]) -> list[int]:
    """`size` rows split by `weights`, largest remainder first (ties to the earlier task): the counts sum to size."""
    total = sum(weights)
    exact = [size * w / total for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: size - sum(counts)]:
        counts[i] += 1
    return counts


def ground_truth(task: Task, entry: Mapping[str, Any]) -> str:
    """The answer column: what the reward needs to call the task's own scorer (rlcli/rewards/reasoning_gym.py)."""
    try:
        return json.dumps({"task": task.name, "config": task.config, "entry": dict(entry)}, sort_keys=True)
    except TypeError as e:
        raise ConfigError(f"{KEY}: reasoning-gym's {task.name} makes entries that are not JSON ({e}); this task "
                          "cannot be carried to the reward workers") from None


def task_of(answer: str) -> str | None:
    """The task of a row from its answer column (the ground-truth payload), or None if it is not one."""
    if not isinstance(answer, str) or not answer.startswith("{"):
        return None
    try:
        payload = json.loads(answer)
    except json.JSONDecodeError:
        return None
    task = payload.get("task") if isinstance(payload, dict) else None
    return task if isinstance(task, str) else None


@functools.lru_cache(maxsize=8)  # the training split needs the held-out questions: generate them once
def _generate(tasks_json: str, size: int, seed: int) -> tuple[tuple[str, str], ...]:
    """(question, ground truth) rows of one split: each task's share, then shuffled together (seeded)."""
    rg = _import()
    tasks = [Task(t["name"], t["weight"], t["config"]) for t in json.loads(tasks_json)]
    rows: list[tuple[str, str]] = []
    for task, n in zip(tasks, shares(size, [t.weight for t in tasks])):
        if n:
            rows += [(e["question"], ground_truth(task, e)) for e in rg.create_dataset(task.name, size=n, seed=seed,
                                                                                        **task.config)]
    random.Random(f"reasoning_gym/{seed}").shuffle(rows)
    return tuple(rows)


def _tasks_json(tasks: list[Task]) -> str:
    return json.dumps([{"name": t.name, "weight": t.weight, "config": t.config} for t in tasks], sort_keys=True)


def drop_questions(rows: tuple[tuple[str, str], ...], questions: set[str]) -> tuple[list[tuple[str, str]], int]:
    """`rows` without those whose question is in `questions`; -> (rows, how many were dropped)."""
    kept = [r for r in rows if r[0] not in questions]
    return kept, len(rows) - len(kept)


def generate_eval(tasks: list[Task], size: int) -> list[tuple[str, str]]:
    """The held-out (question, ground truth) rows: seed EVAL_SEED."""
    return list(_generate(_tasks_json(tasks), size, EVAL_SEED))


def generate_train(tasks: list[Task], size: int, seed: int, held_out: list[tuple[str, str]]
                   ) -> tuple[list[tuple[str, str]], int]:
    """The training rows (seed `seed`) without any question of `held_out`; -> (rows, how many were dropped)."""
    return drop_questions(_generate(_tasks_json(tasks), size, seed), {q for q, _ in held_out})


def split_rows(data_cfg: Any, split: str, seed: int) -> tuple[list[tuple[str, str]], int, str]:
    """(question, ground truth) rows of `split`, how many rows were dropped as the other split's questions, and what
    made them (the load report's source); rlcli.data.loaders.load_reasoning_gym_split renders them."""
    tasks = parse_tasks(data_cfg.reasoning_gym.tasks)
    check_tasks(tasks)
    if data_cfg.curriculum.enabled:
        return curriculum_split_rows(data_cfg, tasks, split, seed)
    held_out = generate_eval(tasks, data_cfg.eval_size)
    if split == "train":
        rows, dropped = generate_train(tasks, data_cfg.train_size, seed, held_out)
    elif split == "eval":
        rows, dropped = held_out, 0
    else:
        raise ValueError(f"split={split!r}; valid splits: ('train', 'eval')")
    mix = ", ".join(f"{t.name} x{t.weight:g}" for t in tasks)
    return rows, dropped, f"reasoning-gym ({mix}; seed {seed if split == 'train' else EVAL_SEED})"


def check_inputs(data_cfg: Any, readable: Any = None, unreadable: str = "") -> None:
    """`rlcli train` / `rlcli eval` before anything loads (rlcli.data.loaders.check_files): the package imports,
    every task name and config builds a dataset, and (with `readable`, a model that reads only some prompts) one of
    the first generated questions passes it, else ConfigError(`unreadable`)."""
    tasks = parse_tasks(data_cfg.reasoning_gym.tasks)
    check_tasks(tasks)
    if data_cfg.curriculum.enabled:
        check_curriculum(tasks, data_cfg.curriculum)
    if readable is not None:
        questions = [q for q, _ in _generate(_tasks_json(tasks), min(data_cfg.train_size, 100), 0)]
        if not any(readable(q) for q in questions):
            raise ConfigError(f"{KEY}: {unreadable} (its first prompt: {questions[0][:80]!r})")


# ---------------------------------------------------------------------------- data.curriculum: reasoning-gym's levels
def _curriculum(name: str) -> Any:
    """A fresh reasoning-gym curriculum of task `name` (it holds its levels: never shared)."""
    from reasoning_gym.factory import create_curriculum

    return create_curriculum(name)


def curriculum_fields(curriculum: Any) -> list[str]:
    """The config fields a reasoning-gym curriculum sets: each range attribute's lower and upper field, each scalar
    attribute's field."""
    out: list[str] = []
    for attr in curriculum.attributes.values():
        out += [attr.lower_field_name, attr.upper_field_name] if hasattr(attr, "lower_field_name") else [attr.field_name]
    return out


def top_level(name: str) -> int:
    """Task `name`'s highest level: its curriculum's longest attribute list, less one (reasoning-gym's
    set_global_level holds a shorter attribute at its own highest level)."""
    return max((len(a.levels) for a in _curriculum(name).attributes.values()), default=1) - 1


def level_config(task: Task, level: int) -> dict[str, Any]:
    """Task's create_dataset arguments at curriculum `level`: reasoning-gym's own `set_global_level(level)` then
    `generate_configuration()` (a range attribute spans its levels 0..level, reasoning-gym's default context), over
    the task's config (which may not set the curriculum's fields: check_curriculum)."""
    curriculum = _curriculum(task.name)
    curriculum.set_global_level(level)
    made = curriculum.generate_configuration(defaults=dict(task.config))
    return {**task.config, **{f: getattr(made, f) for f in curriculum_fields(curriculum)}}


def tasks_at(tasks: list[Task], levels: dict[str, int]) -> list[Task]:
    """The tasks with their config at their level (`levels`: a level per task name)."""
    return [Task(t.name, t.weight, level_config(t, levels[t.name])) for t in tasks]


@functools.lru_cache(maxsize=8)  # every load and every rank checks the same tasks
def _check_curriculum(tasks_json: str, eval_levels_json: str) -> None:
    rg = _import()
    from reasoning_gym.factory import CURRICULA

    tasks = [Task(t["name"], t["weight"], t["config"]) for t in json.loads(tasks_json)]
    for i, t in enumerate(tasks):
        if t.name not in CURRICULA:
            raise ConfigError(f"{KEY}[{i}]: reasoning-gym has no curriculum for {t.name!r}, and data.curriculum.enabled"
                              f"=true needs one for every task: drop the task, or the curriculum")
        set_here = sorted(set(t.config) & set(curriculum_fields(_curriculum(t.name))))
        if set_here:
            raise ConfigError(f"{KEY}[{i}].config.{set_here[0]} is set by {t.name}'s curriculum at each level "
                              "(data.curriculum.enabled=true): drop it")
        for level in range(top_level(t.name) + 1):
            try:
                rg.create_dataset(t.name, size=1, seed=0, **level_config(t, level))
            except Exception as e:  # reasoning-gym's own curriculum can make a config its dataset refuses
                raise ConfigError(f"{KEY}[{i}]: reasoning-gym's {t.name} curriculum makes at level {level} a config "
                                  f"its dataset rejects ({type(e).__name__}: {e}); drop the task, or the curriculum") from None
    from rlcli.data.curriculum import levels

    levels(json.loads(eval_levels_json), 0, {t.name: top_level(t.name) for t in tasks})


def check_curriculum(tasks: list[Task], cfg: Any) -> None:
    """With data.curriculum: every task has a reasoning-gym curriculum, its config leaves the curriculum's fields
    alone, the configuration of each level builds the dataset, and no eval level is above its task's highest; else
    a one-line ConfigError naming the task. Imports reasoning-gym."""
    from rlcli.data.curriculum import plain

    _check_curriculum(_tasks_json(tasks), json.dumps(plain(cfg.eval_levels), sort_keys=True))


def tops(tasks: list[Task]) -> dict[str, int]:
    """Each task name's highest level."""
    return {t.name: top_level(t.name) for t in tasks}


def split_levels(cfg: Any, tasks: list[Task], split: str) -> dict[str, int]:
    """Each task's level in `split`: training starts at data.curriculum.start_level, the held-out rows are at
    data.curriculum.eval_levels (null: the start level)."""
    from rlcli.data.curriculum import levels

    spec = cfg.eval_levels if split == "eval" else None
    return levels(spec, cfg.start_level, tops(tasks))


def _eval_rows_at(data_cfg: Any, tasks: list[Task]) -> list[tuple[str, str]]:
    return generate_eval(tasks_at(tasks, split_levels(data_cfg.curriculum, tasks, "eval")), data_cfg.eval_size)


def level_rows(data_cfg: Any, tasks: list[Task], i: int, level: int, size: int, seed: int
               ) -> tuple[list[tuple[str, str]], int]:
    """`size` training rows of task `tasks[i]` at curriculum `level` (seed `seed`) without the held-out questions
    (data.curriculum.eval_levels). -> (rows, how many were held-out questions)"""
    return generate_train(tasks_at([tasks[i]], {tasks[i].name: level}), size, seed, _eval_rows_at(data_cfg, tasks))


def curriculum_split_rows(data_cfg: Any, tasks: list[Task], split: str, seed: int
                          ) -> tuple[list[tuple[str, str]], int, str]:
    """split_rows with data.curriculum: the held-out rows at the eval levels; the training rows at the start levels
    (each task's share, its held-out questions dropped, all shuffled together), as the run's first draws see them."""
    check_curriculum(tasks, data_cfg.curriculum)
    at = split_levels(data_cfg.curriculum, tasks, split)
    mix = ", ".join(f"{t.name} x{t.weight:g} at level {at[t.name]}" for t in tasks)
    if split == "eval":
        return _eval_rows_at(data_cfg, tasks), 0, f"reasoning-gym ({mix}; seed {EVAL_SEED})"
    if split != "train":
        raise ValueError(f"split={split!r}; valid splits: ('train', 'eval')")
    rows, dropped = [], 0
    for i, (t, n) in enumerate(zip(tasks, shares(data_cfg.train_size, [t.weight for t in tasks]))):
        kept, held = level_rows(data_cfg, tasks, i, at[t.name], n, seed) if n else ([], 0)
        rows, dropped = rows + kept, dropped + held
    random.Random(f"reasoning_gym/{seed}").shuffle(rows)
    return rows, dropped, f"reasoning-gym ({mix}; seed {seed})"


def curriculum_for(data_cfg: Any) -> Any:
    """The run's Curriculum (rlcli.data.curriculum) over the tasks' reasoning-gym levels, at the start level."""
    from rlcli.data.curriculum import Curriculum

    tasks = parse_tasks(data_cfg.reasoning_gym.tasks)
    check_curriculum(tasks, data_cfg.curriculum)
    return Curriculum(tops(tasks), data_cfg.curriculum)


def episodes(batches: list[Any]) -> list[tuple[str | None, float]]:
    """(task, acc) of every trajectory of `batches` (rollout batches), in order: what a curriculum observes."""
    return [(task_of(a), acc) for b in batches for a, acc in zip(b.answers, b.acc.tolist())]
