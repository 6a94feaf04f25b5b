"""Sweeps: what a `rlcli train -m` job returns to Hydra's sweeper, how a failed job is recorded, and the summary.

Each job of a multirun is a trial. It returns the number `sweep.objective` names, read back from its run's
metrics.jsonl (written by rank 0, so a multi-rank job that trained under torchrun reports the same way), and leaves
run_dir/trial.json: {"objective", "direction", "value"} or, for a failed trial, {"error"}. A trial that fails (a bad
value, a crash) prints one line `rlcli: trial <folder> failed: <why>` and raises TrialFailed, which Hydra records
as a failed job: Optuna marks the trial FAIL and samples the next one; the basic sweeper runs every other job and
then ends the sweep with that error. A job may not return nan instead: hydra-optuna-sweeper 1.3.0 then crashes the
whole search (it tells Optuna a FAIL state together with the nan value, which Optuna refuses). At the end of a
multirun SweepSummary (conf/config.yaml, hydra.callbacks) prints every trial's value and the best one.

Nothing here imports Optuna or submitit: the plugins load them when a sweep uses them (docs/sweeps.md).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from rlcli.core.schema import ConfigError

TRIAL_FILE = "trial.json"
OBJECTIVE = re.compile(r"^(?P<name>[^@\s]+)(@(?:(?P<step>\d+)|last(?P<last>\d+)))?$")


@dataclass(frozen=True)
class Objective:
    """A parsed sweep.objective: metric `name` of metrics.jsonl, at training step `step`, or the mean of its last
    `last` logged values; neither = its last logged value."""

    name: str
    step: int | None = None
    last: int | None = None


def parse_objective(spec: str, steps: int | None = None) -> Objective:
    """`NAME`, `NAME@STEP` or `NAME@lastK` (checked against `steps`, the run's training steps, when given)."""
    m = OBJECTIVE.match(spec)
    if m is None:
        raise ConfigError(f"sweep.objective={spec!r}: expected a metric name of metrics.jsonl, optionally at a step or "
                          "over the last K values: eval/acc_after, reward/mean@20 or reward/mean@last5")
    step, last = (int(m["step"]) if m["step"] else None), (int(m["last"]) if m["last"] else None)
    if step is not None and steps is not None and not 1 <= step <= steps:
        raise ConfigError(f"sweep.objective={spec}: step {step} is outside the run's steps 1..{steps}: choose a step "
                          f"in that range, or drop @{step} for the last value")
    if last == 0:
        raise ConfigError(f"sweep.objective={spec}: @last0 averages nothing: use @last1 or more")
    return Objective(m["name"], step, last)


def objective_value(run_dir: str | Path, spec: str) -> float:
    """The value `spec` names, read from run_dir/metrics.jsonl; ConfigError (listing the names logged) if the metric
    or its step is not there."""
    obj = parse_objective(spec)
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    found = [(row["step"], row[obj.name]) for row in rows if row.get(obj.name) is not None]
    if not found:
        import difflib

        names = sorted({k for row in rows for k in row if k != "step"})
        close = difflib.get_close_matches(obj.name, names, n=3)
        raise ConfigError(f"sweep.objective={spec}: {path} has no metric {obj.name!r}"
                          + (f"; did you mean {', '.join(close)}?" if close else f" ({len(names)} names logged)"))
    if obj.step is not None:
        at = [v for s, v in found if s == obj.step]
        if not at:
            raise ConfigError(f"sweep.objective={spec}: {obj.name} was logged at steps {[s for s, _ in found][:20]}, "
                              f"not at step {obj.step}")
        return float(at[-1])
    if obj.last is not None:
        tail = [v for _, v in found[-obj.last:]]
        return sum(tail) / len(tail)
    return float(found[-1][1])


class TrialFailed(Exception):
    """A multirun job that failed, as Hydra's sweeper sees it (a failed job): its folder and why, in one line;
    `sweep_dir` is the sweep's directory (pickled with it when the job ran in another process)."""

    sweep_dir: str | None = None


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _job_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _record(entry: dict[str, Any]) -> None:
    from hydra.core.hydra_config import HydraConfig

    out = _job_dir()
    out.mkdir(parents=True, exist_ok=True)
    entry = {"overrides": list(HydraConfig.get().overrides.task), **entry}
    (out / TRIAL_FILE).write_text(json.dumps(entry, indent=2) + "\n")


def finished(cfg: Any) -> float:
    """A trial that trained: its objective, recorded in trial.json and printed; a missing metric or a non-finite
    value fails the trial (Optuna cannot rank nan)."""
    value = objective_value(cfg.run_dir, cfg.sweep.objective)
    if not math.isfinite(value):
        raise ConfigError(f"sweep.objective={cfg.sweep.objective} is {value} in this run (a diverged run?)")
    _record({"objective": cfg.sweep.objective, "direction": cfg.sweep.direction, "value": value})
    print(f"trial {_job_dir().name}: {cfg.sweep.objective} = {value:.4g}", flush=True)
    return value


def failed(message: str) -> TrialFailed:
    """Record and print a failed trial; -> the exception for the task function to raise."""
    line = f"trial {_job_dir().name} failed: {message}"
    try:
        _record({"error": message})
    except OSError as e:  # the run directory itself is what failed: the printed line still says so
        line += f" (and its {TRIAL_FILE} could not be written: {e})"
    print(f"rlcli: {line}", file=sys.stderr, flush=True)
    error = TrialFailed(line)
    error.sweep_dir = str(_job_dir().parent)
    return error


def stopped_by_signal(e: SystemExit) -> bool:
    """The launcher's exit after SIGTERM/SIGINT/SIGHUP (128 + signal): the user stops the sweep, not one trial."""
    return isinstance(e.code, int) and e.code >= 128


def all_failed(e: BaseException) -> bool:
    """hydra-optuna-sweeper 1.3.0 asks Optuna for the best trial after the last batch; with no completed trial
    Optuna raises this ValueError."""
    return isinstance(e, ValueError) and "No trials are completed yet" in str(e)


PLUGINS = {"hydra/sweeper=optuna": ("hydra_optuna_sweeper", "optuna"),
           "hydra/launcher=submitit_local": ("hydra_submitit_launcher", "slurm"),
           "hydra/launcher=submitit_slurm": ("hydra_submitit_launcher", "slurm")}


def check_plugins(argv: list[str]) -> None:
    """A sweeper or launcher named on the command line whose Hydra plugin is not installed: the extra to install
    (Hydra alone would only list the options it found). Looks for the package without importing it."""
    from importlib.util import find_spec

    for arg in argv:
        if arg in PLUGINS and find_spec(f"hydra_plugins.{PLUGINS[arg][0]}") is None:
            raise ConfigError(f"{arg} needs Hydra's {PLUGINS[arg][0].replace('_', '-')} plugin: "
                              f"pip install 'rlcli[{PLUGINS[arg][1]}]'")


def optuna_overrides(argv: list[str]) -> list[str]:
    """With hydra/sweeper=optuna on the command line: the sweeper's direction is sweep.direction (one place to set it),
    and failed trials do not stop the search (max_failure_rate 1.0; the plugin's default 0.0 ends the sweep at the
    first failure), unless hydra.sweeper.max_failure_rate is given."""
    keys = {a.partition("=")[0] for a in argv}
    if "hydra.sweeper.direction" in keys:
        raise ConfigError("set the direction of the search with sweep.direction=maximize|minimize, not "
                          "hydra.sweeper.direction: rlcli passes sweep.direction to the Optuna sweeper")
    extra = ["hydra.sweeper.direction=${sweep.direction}"]
    if "hydra.sweeper.max_failure_rate" not in keys:
        extra.append("hydra.sweeper.max_failure_rate=1.0")
    return [*argv, *extra]


# --------------------------------------------------------------------------------------------- the summary
def trials(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """The trial.json of every job folder of a sweep directory, with its folder, in job order."""
    found = []
    for path in Path(sweep_dir).glob(f"*/{TRIAL_FILE}"):
        entry = json.loads(path.read_text())
        num = path.parent.name.split("_", 1)[0]
        found.append({**entry, "dir": path.parent.name, "num": int(num) if num.isdigit() else -1})
    return sorted(found, key=lambda t: (t["num"], t["dir"]))


def best(found: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The completed trial with the best value in its direction (the first of equals), or None."""
    done = [t for t in found if "value" in t]
    if not done:
        return None
    sign = -1.0 if done[0]["direction"] == "minimize" else 1.0
    return max(done, key=lambda t: sign * t["value"])


def swept(found: list[dict[str, Any]]) -> list[list[str]]:
    """Each trial's overrides whose values differ between trials (none if no value differs)."""
    values: dict[str, set[str]] = {}
    for t in found:
        for o in t["overrides"]:
            values.setdefault(o.partition("=")[0], set()).add(o)
    varying = {k for k, v in values.items() if len(v) > 1 or any(k not in _keys(t) for t in found)}
    return [[o for o in t["overrides"] if o.partition("=")[0] in varying] for t in found]


def _keys(t: dict[str, Any]) -> set[str]:
    return {o.partition("=")[0] for o in t["overrides"]}


def summary(sweep_dir: str | Path) -> str:
    """The table of trials and the `best trial: <overrides> -> <value>` line; for a sweep of seeds alone, the
    objective's mean ± std over them instead."""
    found = trials(sweep_dir)
    if not found:
        return f"sweep {sweep_dir}: no trial recorded a {TRIAL_FILE}"
    shown = [",".join(o) or t["dir"] for t, o in zip(found, swept(found))]
    width = min(max(len(s) for s in shown), 90)
    lines = [f"sweep {sweep_dir}: {len(found)} trial" + ("s" if len(found) != 1 else "")]
    for t, s in zip(found, shown):
        result = f"{t['value']:.4g}" if "value" in t else f"FAILED: {t['error']}"
        lines.append(f"  #{t['num']:<3} {s:<{width}}  {result}")
    top = best(found)
    failures = sum("value" not in t for t in found)
    values = [t["value"] for t in found if "value" in t]
    if top is not None and {o.partition("=")[0] for o in sum(swept(found), [])} == {"seed"}:
        # only the seed varies: no trial is better than another, together they measure one configuration's spread
        import statistics

        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        lines.append(f"over {len(values)} seed{'s' * (len(values) != 1)}: {statistics.mean(values):.4g} ± {sd:.2g} "
                     f"({top['objective']}, mean ± std)")
    elif top is None:
        lines.append("best trial: none: every trial failed")
    else:
        lines.append(f"best trial: {','.join(swept(found)[found.index(top)]) or top['dir']} -> {top['value']:.4g} "
                     f"({top['objective']}, {top['direction']}; {Path(sweep_dir) / top['dir']})")
    if failures:
        lines.append(f"{failures} of {len(found)} trials failed (their {TRIAL_FILE} holds the error)")
    return "\n".join(lines)


class SweepSummary(Callback):
    """Hydra callback (conf/config.yaml): at the end of a multirun, the summary of its trials."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        print(summary(config.hydra.sweep.dir), flush=True)
