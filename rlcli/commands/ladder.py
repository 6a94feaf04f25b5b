"""`rlcli ladder <paper> [overrides...]`: rerun a paper's ablation ladder and tabulate it beside the paper.

A ladder is a directory `recipes/<paper>/` of rungs `NN_<name>.yaml` (Hydra group `recipe`, see
docs/ladders.md): rung k inherits its base, `ladder.base` (a leave-one-out row such as VAPO's names the
full method) or else rung k-1, and changes exactly the keys in its `ladder.changes` relative to it
(tests/test_ladder.py checks it). `rlcli ladder dapo` runs every rung x every seed as ONE Hydra
multirun of `rlcli train` in a subprocess:

    python -m rlcli.commands.cli train -m recipe=dapo/00_naive_grpo,dapo/01_overlong_filter,... seed=1,2,3 \
        [recipes/dapo/ladder.yaml overrides] [user overrides] hydra.sweep.dir=<out>

then collects the run directories under <out> into results.csv, results.md and figure.png.
`--collect <out>` redoes only the collection. Later overrides win, so the user's beat ladder.yaml's;
ladder.yaml entries whose key the user sets are dropped from the command so it reads unambiguously.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rlcli.config import CONF_DIR
from rlcli.loop.plot import Group, figure, find_runs, group_runs, mean, std

RECIPES_DIR = CONF_DIR / "recipe"  # the shipped recipes/
RUNG_FILE = re.compile(r"^(\d+)_\w+\.yaml$")
DEFAULTS_FILE = "ladder.yaml"
META_FILE = "ladder.json"
TAIL_FRACTION = 0.1  # response length is averaged over the last 10% of training steps


@dataclass
class LadderDefaults:
    """Schema of recipes/<paper>/ladder.yaml: plain YAML read by `rlcli ladder`, not a Hydra config."""

    title: str = ""
    """Heading of results.md, e.g. the paper and its table."""
    paper_metric: str = ""
    """What the paper's numbers measure (e.g. "AIME24 avg@32, Qwen2.5-32B"), printed under the table."""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """Seeds every rung runs with, unless the user passes seed=..."""
    overrides: list[str] = field(default_factory=list)
    """Hydra overrides applied before the user's (the CPU budget for model=tiny, e.g. steps=40)."""


# ---------------------------------------------------------------------------------------- rungs
def ladders(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """Paper names that have at least one rung file."""
    return sorted(d.name for d in recipes_dir.iterdir() if d.is_dir() and any(_rung_files(d)))


def _rung_files(d: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in d.glob("*.yaml") if (m := RUNG_FILE.match(p.name)))


def rungs(paper: str, select: list[int] | None = None, recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """The ladder's rungs as recipe names ("dapo/00_naive_grpo"), in index order; `select` keeps
    only the given indices."""
    d = recipes_dir / paper
    files = _rung_files(d) if d.is_dir() else []
    if not files:
        raise SystemExit(f"no ladder {paper!r}: no {d}/NN_<name>.yaml files; ladders: {', '.join(ladders(recipes_dir))}")
    indices = [i for i, _ in files]
    if len(set(indices)) != len(indices):
        raise SystemExit(f"{d}: two rung files share an index: {[p.name for _, p in files]}")
    if select is not None:
        unknown = sorted(set(select) - set(indices))
        if unknown:
            raise SystemExit(f"--rungs {unknown}: ladder {paper!r} has rungs {indices}")
        files = [(i, p) for i, p in files if i in select]
    return [f"{paper}/{p.stem}" for _, p in files]


def base_index(base: str | None) -> int | None:
    """Rung index of a `ladder.base` recipe name ("vapo/02_vapo" -> 2); None when there is no base."""
    if not base:
        return None
    m = RUNG_FILE.match(Path(base).name + ".yaml")
    if not m:
        from rlcli.core.schema import ConfigError

        raise ConfigError(f"ladder.base={base!r} is not a rung name like <paper>/NN_<name>")
    return int(m.group(1))


def load_defaults(paper: str, recipes_dir: Path = RECIPES_DIR) -> LadderDefaults:
    """recipes/<paper>/ladder.yaml checked against LadderDefaults (a typo fails), or the defaults."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(LadderDefaults)
    path = recipes_dir / paper / DEFAULTS_FILE
    if path.exists():
        try:
            schema = OmegaConf.merge(schema, OmegaConf.load(path))
        except Exception as e:  # omegaconf's message names the bad key
            raise SystemExit(f"{path}: {e}") from e
    return LadderDefaults(**OmegaConf.to_container(schema))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- command
def override_key(override: str) -> str:
    """`+a.b=1` / `~a.b` / `a.b=1,2` -> `a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


def _quote(value: str) -> str:
    """Hydra override value: quoted unless it is plainly safe (paths with spaces, commas, ...)."""
    return value if re.fullmatch(r"[\w./:@+-]+", value) else "'" + value.replace("'", "\\'") + "'"


def build_command(
    rung_names: list[str],
    out: str | Path,
    user_overrides: Sequence[str] = (),
    defaults: LadderDefaults | None = None,
    python: str = sys.executable,
    config_dir: str | None = None,
) -> list[str]:
    """The one multirun: every rung x every seed. Order: recipe, seeds, ladder.yaml overrides, user
    overrides, sweep dir. The user's `seed=...` replaces the default seeds; a ladder.yaml override
    whose key the user also sets is dropped. `config_dir`: the user's config directory (Hydra's
    --config-dir), which holds the rungs of a user's own ladder."""
    defaults = defaults or LadderDefaults()
    user = list(user_overrides)
    keys = {override_key(o) for o in user}
    if "recipe" in keys:
        raise SystemExit("rlcli ladder picks the recipes itself: drop recipe=...; use --rungs 0,1 to run a subset")
    if "hydra.sweep.dir" in keys:
        raise SystemExit("set the output directory with --out DIR, not hydra.sweep.dir=...")
    cmd = [python, "-m", "rlcli.commands.cli", "train", "-m", "recipe=" + ",".join(rung_names)]
    if "seed" not in keys:
        cmd.append("seed=" + ",".join(str(s) for s in defaults.seeds))
    cmd += [o for o in defaults.overrides if override_key(o) not in keys]
    cmd += user
    cmd.append("hydra.sweep.dir=" + _quote(str(Path(out).resolve())))
    if config_dir:
        cmd += ["--config-dir", str(Path(config_dir).resolve())]
    return cmd


# ---------------------------------------------------------------------------------------- collect
def _last(values: list[float]) -> float:
    return values[-1] if values else math.nan


def _tail_mean(values: list[float]) -> float:
    k = max(1, math.ceil(TAIL_FRACTION * len(values)))
    return mean(values[-k:]) if values else math.nan


def summarize(group: Group) -> dict[str, Any]:
    """One table row: held-out accuracy after training as mean and sample std over seeds (in %),
    accuracy before training, final entropy, late response length and wall time."""
    done = [r for r in group.runs if r.result is not None]
    acc = [100 * r.result["eval_after"]["eval/acc"] for r in done]  # type: ignore[index]
    before = [100 * r.result["eval_before"]["eval/acc"] for r in done if "eval_before" in r.result]  # type: ignore[operator,index]
    secs = [r.result["train_seconds"] for r in done]  # type: ignore[index]
    lad = group.ladder
    return {
        "index": lad.get("index"),
        "rung": group.label,
        "paper_score": lad.get("paper_score"),
        "base": lad.get("base"),
        "acc_mean": mean(acc),
        "acc_std": std(acc),
        "acc_before": mean(before),
        "entropy_final": mean([_last(r.series("actor/entropy")[1]) for r in done]),
        "response_length": mean([_tail_mean(r.series("response_length/mean")[1]) for r in done]),
        "train_seconds_mean": mean(secs),
        "train_seconds_total": sum(secs) if secs else math.nan,
        "seeds": " ".join(str(r.seed) for r in done),
        "runs": len(group.runs),
        "finished": len(done),
        "acc_delta": math.nan,  # filled by add_deltas
        "paper_delta": math.nan,
    }


def add_deltas(rows: list[dict[str, Any]]) -> None:
    """For rungs with a `ladder.base` (VAPO's leave-one-out rows: full VAPO), the difference from the
    base rung's row: ours (acc_mean) and the paper's. nan when the base rung did not run or has no number."""
    by_index = {r["index"]: r for r in rows}
    for r in rows:
        b = by_index.get(base_index(r["base"]))
        if b is None:
            continue
        r["acc_delta"] = r["acc_mean"] - b["acc_mean"]
        if r["paper_score"] is not None and b["paper_score"] is not None:
            r["paper_delta"] = r["paper_score"] - b["paper_score"]


CSV_FORMAT = {  # column -> decimals (None: as is); nan is written as an empty cell
    "index": None, "rung": None, "paper_score": 1, "acc_mean": 2, "acc_std": 2, "acc_before": 2,
    "entropy_final": 4, "response_length": 2, "train_seconds_mean": 1, "train_seconds_total": 1,
    "seeds": None, "runs": None, "finished": None, "base": None, "acc_delta": 2, "paper_delta": 1,
}


def _fmt(value: Any, decimals: int | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value) if decimals is None else f"{value:.{decimals}f}"


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FORMAT)
        for row in rows:
            w.writerow([_fmt(row[k], d) for k, d in CSV_FORMAT.items()])


def _acc_cell(row: dict[str, Any]) -> str:
    if not row["finished"]:
        return "failed"
    cell = _fmt(row["acc_mean"], 1)
    if not math.isnan(row["acc_std"]):
        cell += " ± " + _fmt(row["acc_std"], 1)
    return cell + f" (n={row['finished']})"


def _delta_cell(row: dict[str, Any]) -> str:
    """"-3.0 / -5.4 (vs 2)": ours and the paper's change from the base rung; empty without a base."""
    i = base_index(row["base"])
    if i is None:
        return ""
    ours = "–" if math.isnan(row["acc_delta"]) else f"{row['acc_delta']:+.1f}"
    paper = "–" if math.isnan(row["paper_delta"]) else f"{row['paper_delta']:+.1f}"
    return f"{ours} / {paper} (vs {i})"


def write_markdown(rows: list[dict[str, Any]], groups: list[Group], path: Path, meta: dict[str, Any],
                   defaults: LadderDefaults) -> None:
    cfg = groups[0].runs[0].config
    data, ev = cfg.get("data", {}), cfg.get("eval", {})
    eval_size = (f"a random {ev['size']} (eval.subset_seed={ev.get('subset_seed')}) of the" if ev.get("size")
                 else f"the first {data.get('eval_size')}" if data.get("eval_size") else "all the")
    lines = [f"# {defaults.title or 'Ladder ' + str(meta.get('paper', ''))}", ""]
    if meta.get("argv"):
        lines += ["Command:", "", "```bash", meta["argv"], "```", ""]
    if meta.get("command"):
        lines += ["Multirun it launched:", "", "```bash", meta["command"], "```", ""]
    # Only ladders with based rungs (VAPO's leave-one-out rows) get the Δ column, beside ours.
    deltas = any(r["base"] for r in rows)
    lines += [
        f"Model `{cfg.get('model', {}).get('name')}`, data `{data.get('name')}`, `steps={cfg.get('steps')}`, "
        f"P={cfg.get('rollout', {}).get('prompts_per_step')} prompts x G={cfg.get('rollout', {}).get('n')} responses.",
        "",
        "| # | rung | paper | ours: held-out acc % (mean ± std) |" + (" Δ vs base rung: ours / paper |" if deltas else "")
        + " before % | final entropy | response length | s / run | s total |",
        "|---:|---|---:|---|" + ("---:|" if deltas else "") + "---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {_fmt(r['index'], None)} | {r['rung']} | {_fmt(r['paper_score'], 1)} | {_acc_cell(r)} "
            + (f"| {_delta_cell(r)} " if deltas else "")
            + f"| {_fmt(r['acc_before'], 1)} | {_fmt(r['entropy_final'], 3)} | {_fmt(r['response_length'], 1)} "
            f"| {_fmt(r['train_seconds_mean'], 0)} | {_fmt(r['train_seconds_total'], 0)} |"
        )
    total = sum(r["train_seconds_total"] for r in rows if r["finished"])
    lines += [
        "",
        f"- paper: {defaults.paper_metric or 'the number in the rung file (ladder.paper_score)'}.",
    ]
    if deltas:
        lines.append(
            "- Δ vs base rung: the row's accuracy minus that of the rung its `ladder.base` names (for a "
            "leave-one-out row, the full method), ours and the paper's, in points; rows without a base are blank."
        )
    lines += [
        f"- ours: held-out accuracy after training on {eval_size} eval problems of `{data.get('name')}`, "
        f"k={ev.get('k')} response(s) per problem at temperature {ev.get('temperature')}; mean ± sample std "
        "(n-1) over seeds; `before` is the same evaluation of the initial policy.",
        f"- final entropy: `actor/entropy` at the last step; response length: `response_length/mean` over the "
        f"last {int(TAIL_FRACTION * 100)}% of steps, in tokens; both averaged over seeds.",
        f"- wall time: training seconds per run (mean) and summed over the rung's runs; all runs: {total:.0f} s"
        + (f"; the whole ladder command: {meta['wall_seconds']:.0f} s." if meta.get("wall_seconds") else "."),
    ]
    failed = [str(r.path) for g in groups for r in g.runs if r.result is None]
    if failed:
        lines += ["", f"Unfinished runs (no result.json; see their logs): {len(failed)}", ""]
        lines += [f"- `{p}`" for p in failed]
    lines += ["", "![training curves](figure.png)", ""]
    path.write_text("\n".join(lines))


def collect(out: str | Path, recipes_dir: Path = RECIPES_DIR) -> list[dict[str, Any]]:
    """Read every run under `out`; write out/results.csv, out/results.md and out/figure.png."""
    out = Path(out)
    meta_path = out / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    groups = group_runs(find_runs([out]))
    paper = meta.get("paper") or groups[0].ladder.get("paper")
    defaults = load_defaults(paper, recipes_dir) if paper and (recipes_dir / paper).is_dir() else LadderDefaults()
    meta.setdefault("paper", paper)
    rows = [summarize(g) for g in groups]
    add_deltas(rows)
    write_csv(rows, out / "results.csv")
    write_markdown(rows, groups, out / "results.md", meta, defaults)
    figure(groups, out / "figure.png", defaults.title or None)
    return rows


# ---------------------------------------------------------------------------------------- CLI
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlcli ladder",
        description="Run a paper's ablation ladder (recipes/<paper>/NN_*.yaml) as one Hydra multirun "
        "(every rung x every seed), then write results.csv, results.md and figure.png.",
        epilog="example: rlcli ladder dapo --rungs 0,1 steps=10   |   rlcli ladder --collect runs/ladder/dapo/<time>",
    )
    p.add_argument("paper", nargs="?", help="ladder name, a directory under recipes/ (omit to list them)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (key=value), applied last")
    p.add_argument("--out", help="output directory (default: runs/ladder/<paper>/<date>_<time>)")
    p.add_argument("--rungs", help="comma-separated rung indices to run, e.g. 0,1 (default: all)")
    p.add_argument("--collect", metavar="DIR", help="only (re)collect the runs under DIR into tables and figure")
    p.add_argument("--no-defaults", action="store_true",
                   help="ignore recipes/<paper>/ladder.yaml's overrides (its CPU budget), e.g. on GPUs")
    p.add_argument("--config-dir", metavar="DIR",
                   help="your config directory: ladders in DIR/recipe/<paper>/NN_<rung>.yaml (a ladder.yaml "
                   "optional), composed over the shipped groups like `rlcli train --config-dir DIR`")
    p.add_argument("--dry-run", action="store_true", help="print the multirun command and exit")
    return p


def _report(rows: list[dict[str, Any]], out: Path) -> None:
    for r in rows:
        delta = f"  Δ {_delta_cell(r)}" if r["base"] else ""
        print(f"  {_fmt(r['index'], None):>2} {r['rung']:<32} paper {_fmt(r['paper_score'], 1):>5}  ours {_acc_cell(r)}{delta}")
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}, {out / 'figure.png'}")


def main(argv: list[str]) -> int:
    args = parser().parse_intermixed_args(argv)
    if args.collect:
        out = Path(args.collect)
        _report(collect(out), out)
        return 0
    user_dir = Path(args.config_dir) / "recipe" if args.config_dir else None
    if not args.paper:
        found = sorted({*ladders(), *(ladders(user_dir) if user_dir and user_dir.is_dir() else [])})
        print("ladders: " + ", ".join(found) + "\nusage: rlcli ladder <paper> [overrides...]  (--help)")
        return 0
    recipes_dir = user_dir if user_dir and (user_dir / args.paper).is_dir() else RECIPES_DIR
    select = [int(i) for i in args.rungs.split(",")] if args.rungs else None
    names = rungs(args.paper, select, recipes_dir)
    defaults = load_defaults(args.paper, recipes_dir)
    if args.no_defaults:
        defaults.overrides = []
    out = Path(args.out or f"runs/ladder/{args.paper}/{datetime.now():%Y-%m-%d_%H-%M-%S}")
    cmd = build_command(names, out, args.overrides, defaults, config_dir=args.config_dir)
    argv_line = shlex.join(["rlcli", "ladder", *argv])
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    seeds = next((o.split("=", 1)[1] for o in cmd if o.startswith("seed=")), "")
    runs = f" = {len(names) * len(seeds.split(','))} runs" if re.fullmatch(r"[\d,]+", seeds) else ""
    print(f"ladder {args.paper}: {len(names)} rungs x seeds {seeds}{runs} -> {out}")
    print("running:", shlex.join(cmd), flush=True)
    meta = {"paper": args.paper, "argv": argv_line, "command": shlex.join(cmd), "started": datetime.now().isoformat()}
    (out / META_FILE).write_text(json.dumps(meta, indent=2))
    t0 = time.perf_counter()
    code = subprocess.run(cmd).returncode
    meta.update(wall_seconds=time.perf_counter() - t0, returncode=code)
    (out / META_FILE).write_text(json.dumps(meta, indent=2))
    print(f"ladder wall time: {meta['wall_seconds']:.0f} s" + (f" (multirun exit code {code})" if code else ""))
    try:
        rows = collect(out, recipes_dir)
    except SystemExit as e:  # nothing ran at all
        raise SystemExit(f"the multirun failed (exit code {code}) before any run started: {e}") from e
    _report(rows, out)
    if code or any(r["finished"] < r["runs"] for r in rows):
        print(f"some runs failed: see the table's 'failed'/n= cells and the logs under {out}", file=sys.stderr)
        return code or 1
    return 0
