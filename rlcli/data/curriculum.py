"""data.curriculum: each task's difficulty level follows the policy's recent accuracy on it (docs/environments.md,
"Curriculum").

A task that declares levels (data=reasoning_gym: reasoning-gym's own curriculum of the task; level L =
`set_global_level(L)`, rlcli.data.reasoning_gym.level_config) starts at `start_level`. After every training step the
step's episodes (every generated response, all ranks, in rank order) join their task's window of recent episodes.
Once a task's window holds `window` episodes its accuracy (acc: a full score) decides:

    accuracy >= raise_at      -> one level up (not past the task's highest)
    accuracy <  lower_below   -> one level down (not below 0)
    otherwise                 -> the same level

and a change empties the window (the next decision reads only episodes of the new level). The levels and the
windows are the run's `Curriculum`, carried in LoopState (a checkpoint saves them; resume continues bit for bit);
the training prompts are drawn at the current levels (rlcli.data.CurriculumStream); the held-out set is generated
once, at `eval_levels`, so that every evaluation of the run measures the same questions.

Torch-free and reasoning-gym-free: the rule, the state and the config; rlcli.data.reasoning_gym supplies the levels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlcli.core.schema import ConfigError, rng

KEY = "data.curriculum"


@dataclass
class CurriculumConfig:
    """data.curriculum.*: task levels that follow the recent accuracy (docs/environments.md, "Curriculum")."""

    enabled: bool = False
    """Move each task's level with its recent accuracy (data=reasoning_gym: every task needs a reasoning-gym
    curriculum; its config may not set the fields the curriculum sets)."""
    window: int = rng(64, ge=1)
    """Recent episodes (responses) of a task whose accuracy decides its level; a decision waits until this many
    were seen at the current level."""
    raise_at: float = rng(0.7, ge=0, le=1, why="0 = up one level every `window` episodes whatever the accuracy")
    """A task goes one level up when its accuracy over the window reaches this."""
    lower_below: float = rng(0.3, ge=0, le=1, why="0 = never down")
    """A task goes one level down when its accuracy over the window is below this (must be below raise_at)."""
    start_level: int = rng(0, ge=0, why="clamped to each task's highest level")
    """The level every task starts training at."""
    eval_levels: Any = rng(None, ge=0, why="null = start_level")
    """The levels of the held-out set, fixed for the whole run: one level for every task (clamped to each task's
    highest), or a mapping {task: level} (the tasks it leaves out at start_level)."""


def check(cfg: Any, source: str, tasks: list[str]) -> None:
    """The rules between data.curriculum's fields and the data (ranges are checked with the schema's); ConfigError
    naming the key and the fix. `tasks`: the task names of the data (reasoning_gym), [] for other sources."""
    defaults = CurriculumConfig()
    if not cfg.enabled:
        for f in dataclasses.fields(CurriculumConfig):
            if getattr(cfg, f.name) != getattr(defaults, f.name):
                raise ConfigError(f"{KEY}.{f.name}={getattr(cfg, f.name)} is read only with {KEY}.enabled=true: set "
                                  "it, or drop the key")
        return
    if source != "reasoning_gym":
        raise ConfigError(f"{KEY}.enabled=true needs tasks that declare levels, and data.source={source} has none: "
                          "use data=reasoning_gym (reasoning-gym's curricula)")
    if cfg.lower_below > 0 and cfg.lower_below >= cfg.raise_at:
        raise ConfigError(f"{KEY}.lower_below={cfg.lower_below} must be below {KEY}.raise_at={cfg.raise_at}: "
                          "accuracies between them keep the level (lower_below=0 never lowers)")
    spec = plain(cfg.eval_levels)
    items = spec.items() if isinstance(spec, Mapping) else [] if spec is None else [(None, spec)]
    for task, level in items:
        key = f"{KEY}.eval_levels" + (f".{task}" if task is not None else "")
        if task is not None and task not in tasks:
            raise ConfigError(f"{key}: {task!r} is not a task of data.reasoning_gym.tasks ({', '.join(tasks)})")
        if isinstance(level, bool) or not isinstance(level, int):
            raise ConfigError(f"{key}={level!r} must be a whole level (0, 1, ...)"
                              + ("" if task is not None else ", or a mapping {task: level}"))


def plain(value: Any) -> Any:
    """`value` as plain Python (a DictConfig or ListConfig converted)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def levels(spec: Any, start: int, tops: Mapping[str, int], key: str = f"{KEY}.eval_levels") -> dict[str, int]:
    """Each task's level: `spec` null -> `start`; one number -> that level; either clamped to the task's highest
    (`tops`), as reasoning-gym's set_global_level clamps. A mapping {task: level} sets the tasks it names (a level above
    the task's highest is a ConfigError), the others at `start`."""
    spec = plain(spec)
    out = {task: min(spec if isinstance(spec, int) else start, top) for task, top in tops.items()}
    for task, level in (spec.items() if isinstance(spec, Mapping) else ()):
        if level > tops[task]:
            raise ConfigError(f"{key}.{task}={level} is above {task}'s highest level, {tops[task]}")
        out[task] = level
    return out


def next_level(level: int, top: int, accuracy: float, raise_at: float, lower_below: float) -> int:
    """The level after a full window of accuracy `accuracy`: one up when it reaches `raise_at` (not past `top`), one
    down when it is below `lower_below` (not below 0), else the same."""
    if accuracy >= raise_at and level < top:
        return level + 1
    if accuracy < lower_below and level > 0:
        return level - 1
    return level


class Curriculum:
    """The run's task levels and each task's window of recent episode accuracies (the same on every rank: every rank
    observes every rank's episodes). Saved and restored whole by LoopState (its `curriculum` field)."""

    def __init__(self, tops: Mapping[str, int], cfg: Any):
        self.tops = dict(tops)
        """Each task's highest level."""
        self.window, self.raise_at, self.lower_below = cfg.window, cfg.raise_at, cfg.lower_below
        self.levels = levels(None, cfg.start_level, self.tops)
        """Each task's current level: the training prompts are drawn at it."""
        self.recent: dict[str, list[float]] = {task: [] for task in self.tops}
        """Each task's last (at most `window`) episode accuracies at its current level, oldest first."""

    def observe(self, episodes: Iterable[tuple[str | None, float]]) -> list[str]:
        """Add a step's episodes (task, acc) in order, then move the level of each task whose window is full (and
        empty that window). -> one line per change, to print"""
        for task, acc in episodes:
            if task in self.recent:
                self.recent[task].append(float(acc))
        notes = []
        for task, recent in self.recent.items():
            del recent[: -self.window]
            if len(recent) < self.window:
                continue
            accuracy = sum(recent) / len(recent)
            level = next_level(self.levels[task], self.tops[task], accuracy, self.raise_at, self.lower_below)
            if level != self.levels[task]:
                notes.append(f"curriculum: {task} level {self.levels[task]} -> {level} (accuracy {accuracy:.3f} over "
                             f"its last {len(recent)} episodes; {KEY}.raise_at={self.raise_at}, "
                             f"lower_below={self.lower_below})")
                self.levels[task] = level
                recent.clear()
        return notes

    def metrics(self) -> dict[str, float]:
        """curriculum/<task>/level of every task."""
        return {f"curriculum/{task}/level": float(level) for task, level in self.levels.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"levels": dict(self.levels), "recent": {task: list(r) for task, r in self.recent.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["levels"]) != set(self.levels):
            raise ValueError(f"the checkpoint's curriculum moved the tasks {sorted(state['levels'])}, this run has "
                             f"{sorted(self.levels)}: resume with the same data.reasoning_gym.tasks")
        self.levels = dict(state["levels"])
        self.recent = {task: list(r) for task, r in state["recent"].items()}
