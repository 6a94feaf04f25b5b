"""Read finished runs and draw their training curves: `rlcli plot <run or sweep dirs...> [--out fig.png]`.

A run directory is one that holds the frozen `config.yaml` written by `rlcli train` (plus, when it got
that far, `metrics.jsonl` and `result.json`); a sweep directory is searched recursively for them
(Hydra's own `.hydra/config.yaml` copies are skipped).

Runs whose frozen configs are equal except `seed` and `run_dir` are one *group*: the figure shows the
mean over the group's seeds at each step, with a ±1 std band. A group is labelled by `ladder.rung`
when the runs are ladder rungs, else by the run directory name with Hydra's `_seed<N>` removed.
`rlcli ladder` draws its figure with the same code (rlcli/commands/ladder.py).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcli.loop.metrics import read_jsonl

# Panels always drawn, then the critic panels when any run logged them (PPO, VAPO).
PANELS = {
    "reward/mean": "reward (reward/mean)",
    "acc/mean": "training accuracy (acc/mean)",
    "actor/entropy": "entropy (actor/entropy)",
    "response_length/mean": "response length, tokens (response_length/mean)",
}
# Held-out accuracy during training, drawn when runs evaluated periodically (eval.every): one curve of the
# accuracy before training (step 0), every eval.every steps, and after training (last step), unsmoothed.
HELD_OUT = ("eval/acc_before", "eval/acc", "eval/acc_after")
HELD_OUT_PANEL = "eval/acc"
CRITIC_PANELS = {
    "critic/explained_var": "critic explained variance",
    "critic/vf_loss": "critic value loss (critic/vf_loss)",
}
IGNORED_KEYS = ("seed", "run_dir")  # keys that may differ between the seeds of one group


def held_out_title(runs: list[Run]) -> str:
    """The held-out panel's title, saying how the runs evaluated: greedy, or avg@k at a temperature."""
    hows = sorted({"greedy" if not (e := r.config.get("eval") or {}).get("temperature")
                   else f"avg@{e.get('k', 1)} at temperature {e['temperature']:g}" for r in runs})
    return f"held-out accuracy, {' / '.join(hows)} (eval/acc)"


@dataclass
class Run:
    """One finished (or failed) `rlcli train` run directory."""

    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, float]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    """result.json; None when the run did not finish."""

    @property
    def ladder(self) -> dict[str, Any]:
        return self.config.get("ladder") or {}

    @property
    def seed(self) -> int | None:
        return self.config.get("seed")

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a metric over training; rows without it (eval rows) are skipped. "eval/acc"
        joins the accuracy before, during and after training (HELD_OUT)."""
        keys = HELD_OUT if key == "eval/acc" else (key,)
        rows = [(int(r["step"]), float(r[k])) for r in self.metrics for k in keys if k in r]
        return [s for s, _ in rows], [v for _, v in rows]


@dataclass
class Group:
    """Runs that differ only in their seed."""

    label: str
    runs: list[Run]

    @property
    def ladder(self) -> dict[str, Any]:
        return self.runs[0].ladder

    @property
    def display(self) -> str:
        index = self.ladder.get("index")
        return self.label if index is None else f"{index}: {self.label}"

    @property
    def sort_key(self) -> tuple[int, str]:
        index = self.ladder.get("index")
        return (index if index is not None else 10**6, self.label)


def load_run(path: Path) -> Run:
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"), resolve=False)
    metrics = read_jsonl(str(path / "metrics.jsonl")) if (path / "metrics.jsonl").exists() else []
    result = json.loads((path / "result.json").read_text()) if (path / "result.json").exists() else None
    return Run(path=path, config=config, metrics=metrics, result=result)  # type: ignore[arg-type]


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Every run directory at or under `paths`, in path order; fails if there is none. A run's
    checkpoints (run/checkpoints/step_N/config.yaml) and Hydra's .hydra/ are not runs."""
    dirs: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise SystemExit(f"{p}: no such directory")
        if (p / "config.yaml").exists():
            dirs.append(p)
        else:
            dirs += sorted(c.parent for c in p.rglob("config.yaml")
                           if not {".hydra", "checkpoints"} & set(c.relative_to(p).parts))
    dirs = sorted(set(dirs), key=lambda d: str(d))
    if not dirs:
        raise SystemExit(f"no run directories (holding config.yaml) under: {' '.join(map(str, paths))}")
    return [load_run(d) for d in dirs]


def group_runs(runs: list[Run]) -> list[Group]:
    """Group runs whose configs are equal except `seed`/`run_dir`; ladder groups come in rung order."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        cfg = {k: v for k, v in run.config.items() if k not in IGNORED_KEYS}
        groups.setdefault(json.dumps(cfg, sort_keys=True), []).append(run)
    from rlcli.core.schema import flatten

    differ = differing_keys([m[0].config for m in groups.values()])
    out = []
    for members in groups.values():
        members.sort(key=lambda r: (r.seed is None, r.seed or 0, str(r.path)))
        flat = flatten(members[0].config)
        swept = ", ".join(f"{k}={flat.get(k)}" for k in differ)
        label = members[0].ladder.get("rung") or swept or seed_label(members)
        out.append(Group(label=label, runs=members))
    return sorted(out, key=lambda g: g.sort_key)


def seed_label(members: list[Run]) -> str:
    """A lone group's label: its folder's name (less a sweep's job number and seed: `0_seed=1`, `run_seed3`), and the
    seeds it averages when it holds several runs (`seeds 1, 2, 3`)."""
    name = members[0].path.name
    if len(members) == 1:
        return name
    base = re.sub(r"^\d+_|[_,]?seed=?\d+$", "", name).strip("_,")
    seeds = ", ".join(str(r.seed) for r in members if r.seed is not None)
    return ", ".join(part for part in (base, f"seeds {seeds}" if seeds else "") if part) or name


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """The config keys whose values differ between `configs` (one per group; seed, run_dir and resume ignored):
    what a sweep varied, which labels its groups (optim.lr=0.0001) whatever their folders are called."""
    from rlcli.core.schema import flatten

    flats = [flatten({k: v for k, v in c.items() if k not in IGNORED_KEYS}) for c in configs]
    keys = sorted(set().union(*flats)) if flats else []
    return [k for k in keys if k != "resume" and len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]


# ---------------------------------------------------------------------------------------- statistics
def finite(values: list[float]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def mean(values: list[float]) -> float:
    v = finite(values)
    return sum(v) / len(v) if v else math.nan


def std(values: list[float]) -> float:
    """Sample standard deviation (n-1) over seeds; nan for fewer than two values."""
    v = finite(values)
    if len(v) < 2:
        return math.nan
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


def seed_curve(group: Group, key: str) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean over seeds, std over seeds) of a metric at each training step."""
    by_step: dict[int, list[float]] = {}
    for run in group.runs:
        for s, v in zip(*run.series(key)):
            by_step.setdefault(s, []).append(v)
    steps = sorted(by_step)
    return steps, [mean(by_step[s]) for s in steps], [std(by_step[s]) for s in steps]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (non-finite points skipped)."""
    return [mean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


# ---------------------------------------------------------------------------------------- the figure
def figure(groups: list[Group], out: str | Path, title: str | None = None, metrics: tuple[str, ...] = ()) -> Path:
    """Training curves, one panel per metric, one line per group (mean over seeds, smoothed over ~10%
    of the steps, ±1 std band); `metrics`: more panels, one per logged metric named (e.g. reward/rm, a reward
    part); a last panel compares held-out accuracy after training (and the paper's number for ladder rungs,
    and a black tick at the accuracy before training) when result.json files exist. Written with the Agg
    backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    panels = dict(PANELS)
    if any("eval/acc" in row for g in groups for r in g.runs for row in r.metrics):
        panels[HELD_OUT_PANEL] = held_out_title([r for g in groups for r in g.runs])
    panels.update({k: t for k, t in CRITIC_PANELS.items() if any(r.series(k)[0] for g in groups for r in g.runs)})
    for key in metrics:
        if not any(r.series(key)[0] for g in groups for r in g.runs):
            raise SystemExit(f"--metrics {key}: no run logged it (metrics.jsonl; names in docs/metrics.md)")
        panels.setdefault(key, key)
    with_eval = any(r.result for g in groups for r in g.runs)
    n = len(panels) + with_eval
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    flat_axes = list(axes.flat)
    colors = plt.get_cmap("tab10")

    for ax, (key, name) in zip(flat_axes, panels.items()):
        for i, g in enumerate(groups):
            steps, m, s = seed_curve(g, key)
            if not steps:
                continue
            w = 1 if key == HELD_OUT_PANEL else max(1, round(len(steps) / 10))
            m, s = smooth(m, w), smooth(s, w)
            ax.plot(steps, m, color=colors(i % 10), label=g.label, lw=1.6)
            if len(g.runs) > 1:
                lo = [a - (b if math.isfinite(b) else 0.0) for a, b in zip(m, s)]
                hi = [a + (b if math.isfinite(b) else 0.0) for a, b in zip(m, s)]
                ax.fill_between(steps, lo, hi, color=colors(i % 10), alpha=0.15, lw=0)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at step 1.25
        ax.grid(alpha=0.3)

    if with_eval:
        ax = flat_axes[len(panels)]
        xs = range(len(groups))
        ours = [[100 * r.result["eval_after"]["eval/acc"] for r in g.runs if r.result] for g in groups]
        ax.bar([x - 0.2 for x in xs], [mean(v) for v in ours],
               yerr=[0.0 if math.isnan(std(v)) else std(v) for v in ours], width=0.4,
               color=[colors(i % 10) for i in xs], label="ours: held-out acc after training", capsize=3)
        before = [mean([100 * r.result["eval_before"]["eval/acc"] for r in g.runs
                        if r.result and "eval_before" in r.result]) for g in groups]
        if any(math.isfinite(b) for b in before):
            ax.scatter([x - 0.2 for x in xs], before, marker="_", s=300, color="black", zorder=3,
                       label="ours: before training")
        paper = [g.ladder.get("paper_score") for g in groups]
        if any(p is not None for p in paper):
            ax.bar([x + 0.2 for x in xs], [p if p is not None else 0.0 for p in paper], width=0.4,
                   color="lightgray", edgecolor="gray", label="paper's number (its own benchmark)")
        ax.set_xticks(list(xs), [str(i if g.ladder.get("index") is None else g.ladder["index"])
                                 for i, g in enumerate(groups)])
        ax.set_title("held-out accuracy, % (error bar: std over seeds)", fontsize=10)
        ax.set_xlabel("rung" if any(p is not None for p in paper) else "run group")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3, axis="y")

    for ax in flat_axes[n:]:
        ax.set_visible(False)
    # One legend for all panels, built from the groups (a failed group may have no curve at all).
    handles = [Line2D([], [], color=colors(i % 10), lw=2) for i in range(len(groups))]
    fig.legend(handles, [g.display for g in groups], loc="lower center", ncol=min(len(groups), 3),
               fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    legend_rows = math.ceil(len(groups) / 3)
    fig.tight_layout(rect=(0, 0.05 * legend_rows / rows, 1, 0.96 if title else 1))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------- CLI
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlcli plot",
        description="Training curves (reward, accuracy, entropy, response length; held-out accuracy when runs "
        "evaluated every eval.every steps; critic panels when logged; --metrics adds any logged metric) of run "
        "directories or sweep directories; "
        "seeds of the same config are averaged.",
    )
    p.add_argument("paths", nargs="+", help="run directories (holding config.yaml) or directories above them")
    p.add_argument("--out", default=None, help="output PNG (default: figure.png in the first path)")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--metrics", nargs="+", default=[], metavar="KEY",
                   help="more panels: logged metrics by name, e.g. reward/rm reward/rm_std (docs/metrics.md)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    groups = group_runs(find_runs(args.paths))
    path = figure(groups, args.out or Path(args.paths[0]) / "figure.png", args.title, tuple(args.metrics))
    runs = sum(len(g.runs) for g in groups)
    print(f"{runs} runs in {len(groups)} groups: {', '.join(g.label for g in groups)}")
    print(f"wrote {path}")
    return 0


def log_curves(logger: Any, result: dict[str, Any], step: int) -> None:
    """The end of a run: draw its training curves as `rlcli plot` does (run_dir/curves.png) and attach them to every
    backend of `logger` (rlcli.loop.metrics.MetricsLogger) at `step`. Nothing without a backend."""
    if not logger.enabled or not logger.backends:
        return
    logger.file.flush()
    run = Run(path=Path(logger.run_dir), config=logger.config, metrics=read_jsonl(logger.path), result=result)
    logger.attach(str(figure(group_runs([run]), str(Path(logger.run_dir) / "curves.png"))), step)
