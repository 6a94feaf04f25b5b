"""Paper ladders: every rung changes exactly its declared keys relative to its base (the rung rules
of docs/ladders.md) at any model scale and composes into a valid config; `algo=dapo` is the top
DAPO rung minus overlong filtering and `algo=vapo` is the full VAPO rung (docs/ladders.md);
`rlcli ladder` builds the right multirun and collects runs into exact tables and a figure;
`rlcli plot` draws arbitrary runs."""

import csv
import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONF, ROOT, compose
from omegaconf import OmegaConf

from rlcli.commands import ladder
from rlcli.commands.ladder import LadderDefaults, base_index, build_command, collect, rungs
from rlcli.config import validate
from rlcli.loop.plot import figure, find_runs, group_runs

RECIPES = CONF / "recipe"
IGNORED = ("ladder.", "algo.name")  # rung metadata and run names are not knobs
ALL_RUNGS = [(paper, i) for paper in ladder.ladders(RECIPES) for i in range(len(rungs(paper, recipes_dir=RECIPES)))]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make(overrides=()):
    return _compose(tuple(overrides))


@functools.cache  # the rung tests compose the same configs many times; they only read them
def _compose(overrides: tuple[str, ...]):
    cfg = compose(*overrides)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def flat(cfg) -> dict:
    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, f"{prefix}{k}.")
        else:
            yield prefix[:-1], node

    # Unresolved: a rung's knobs, not what follows from them (the 32B preset's generation batch follows
    # algo.dynamic_sampling through an interpolation).
    tree = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    return {k: v for k, v in walk(tree, "") if not k.startswith(IGNORED)}


def diff(a: dict, b: dict) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k, "<absent>") != b.get(k, "<absent>")}


def covered(diffs: set[str], declared: list[str]) -> tuple[set[str], set[str]]:
    """(changed keys no declaration covers, declarations that cover no changed key); a declared key
    covers itself and, for a dict like reward.weights, its sub-keys."""
    hits = {d: {k for k in diffs if k == d or k.startswith(d + ".")} for d in declared}
    undeclared = diffs - set().union(*hits.values()) if hits else diffs
    return undeclared, {d for d, h in hits.items() if not h}


def reference(names: list[str], index: int, base: str | None) -> str | None:
    """The recipe a rung's `changes` are relative to: `ladder.base` when set (VAPO's leave-one-out rows
    name the full method), else the previous rung; None for rung 0 (the plain defaults, no recipe)."""
    return base or (names[index - 1] if index else None)


SCALES = pytest.mark.parametrize("scale", [[], ["model=qwen2.5-32b"]], ids=["tiny", "qwen2.5-32b"])


@pytest.mark.parametrize("paper,index", ALL_RUNGS)
@SCALES
def test_rung_changes_exactly_its_declared_keys(paper, index, scale):
    names = rungs(paper, recipes_dir=RECIPES)
    cfg = make([f"recipe={names[index]}", *scale])
    lad = cfg.ladder
    ref = reference(names, index, lad.base)
    if lad.base:  # an earlier rung of the same ladder
        assert lad.base in names[:index], f"{names[index]}: ladder.base={lad.base} is not an earlier rung of {paper}"
    prev = make([f"recipe={ref}", *scale] if ref else scale)
    assert (lad.paper, lad.index) == (paper, index), f"{names[index]}: ladder.paper/index do not match the file"
    assert names[index].split("/")[1].startswith(f"{index:02d}_")
    assert lad.rung and lad.paper_score is not None
    d = diff(flat(cfg), flat(prev))
    undeclared, unused = covered(d, list(lad.changes))
    assert not undeclared, f"{names[index]} changes {sorted(undeclared)} without declaring them in ladder.changes"
    assert not unused, f"{names[index]} declares {sorted(unused)} in ladder.changes but does not change them"


@pytest.mark.parametrize("paper,index", ALL_RUNGS)
def test_rung_inherits_its_base(paper, index):
    """The first recipe in a rung's defaults list is what its `changes` are relative to (rule 2)."""
    names = rungs(paper, recipes_dir=RECIPES)
    defaults = OmegaConf.to_container(OmegaConf.load(RECIPES / f"{names[index]}.yaml")).get("defaults", [])
    parents = [d.removeprefix("/recipe/") for d in defaults if isinstance(d, str) and d.startswith("/recipe/")]
    ref = reference(names, index, make([f"recipe={names[index]}"]).ladder.base)
    assert parents[:1] == ([ref] if ref else []), f"{names[index]} inherits {parents}, its changes are relative to {ref}"


@pytest.mark.parametrize("paper,index", ALL_RUNGS)
@SCALES
def test_rung_composes_and_validates(paper, index, scale):
    validate(make([f"recipe={rungs(paper, recipes_dir=RECIPES)[index]}", *scale]))


@pytest.mark.parametrize("paper,index", ALL_RUNGS)
def test_rung_is_scale_free(paper, index):
    """A rung's total change from the plain defaults is the same at two model scales: a rung never
    sets lr, lengths, P or G (if it did, the tiny preset's equal value would hide it at one scale)."""
    rung = f"recipe={rungs(paper, recipes_dir=RECIPES)[index]}"
    tiny = diff(flat(make([rung])), flat(make()))
    big = diff(flat(make([rung, "model=qwen2.5-32b"])), flat(make(["model=qwen2.5-32b"])))
    assert tiny == big
    assert not [k for k in tiny if k.startswith(("optim.", "rollout.", "model.", "hw.", "data.")) or k == "steps"]


def test_dapo_ladder_is_the_papers_table():
    names = rungs("dapo", recipes_dir=RECIPES)
    got = [(make([f"recipe={n}"]).ladder.paper_score, list(make([f"recipe={n}"]).ladder.changes)) for n in names]
    assert got == [
        (30.0, ["algo.kl_coef", "reward.incorrect_score"]),
        (36.0, ["algo.overlong_filter"]),
        (38.0, ["algo.clip_high"]),
        (41.0, ["algo.soft_overlong"]),
        (42.0, ["algo.loss_agg"]),
        (50.0, ["algo.dynamic_sampling"]),
    ]
    top = make([f"recipe={names[-1]}"])
    assert top.algo.clip_high == 0.28 and top.algo.loss_agg == "token_mean" and top.algo.kl_coef == 0.0
    assert (top.reward.correct_score, top.reward.incorrect_score) == (1.0, -1.0)


@pytest.mark.skipif(not (CONF / "algo" / "dapo.yaml").exists(), reason="conf/algo/dapo.yaml not written yet")
def test_algo_dapo_is_the_top_rung_without_overlong_filtering():
    """docs/ladders.md, the DAPO ladder: the paper's best DAPO run did not use overlong filtering."""
    top = make([f"recipe={rungs('dapo', recipes_dir=RECIPES)[-1]}"])
    dapo = make(["algo=dapo", "reward=dapo"])
    a, b = (OmegaConf.to_container(c.algo, resolve=True) for c in (top, dapo))
    assert {k for k in a if a[k] != b[k]} - {"name"} == {"overlong_filter"}
    assert a["overlong_filter"] is True and b["overlong_filter"] is False


VAPO_LEAVE_ONE_OUT = {  # rung -> (Table 1 row, paper score, the one key it flips, its value without the technique)
    "vapo/03_no_value_pretrain": ("w/o value pretraining", 11.0, "algo.value_pretrain", False),
    "vapo/04_no_decoupled_gae": ("w/o decoupled GAE", 33.0, "algo.lam_critic", 0.95),
    "vapo/05_no_length_adaptive_gae": ("w/o length-adaptive GAE", 45.0, "algo.length_adaptive_gae", False),
    "vapo/06_no_clip_higher": ("w/o clip-higher", 46.0, "algo.clip_high", 0.2),
    "vapo/07_no_token_level_loss": ("w/o token-level loss", 53.0, "algo.loss_agg", "seq_mean_token_mean"),
    "vapo/08_no_positive_lm_loss": ("w/o positive-example LM loss", 54.0, "algo.nll_coef", 0.0),
    "vapo/09_no_group_sampling": ("w/o group sampling", 55.0, "algo.group_sampling", False),
}


def test_vapo_ladder_is_the_papers_table():
    """VAPO (arXiv:2504.05118) Table 1: vanilla PPO, the DAPO reference row, full VAPO, then the seven
    leave-one-out rows, each one technique away from full VAPO."""
    names = rungs("vapo", recipes_dir=RECIPES)
    head = [(make([f"recipe={n}"]).ladder.rung, make([f"recipe={n}"]).ladder.paper_score,
             make([f"recipe={n}"]).ladder.base) for n in names[:3]]
    assert names[:3] == ["vapo/00_vanilla_ppo", "vapo/01_dapo", "vapo/02_vapo"]
    assert head == [("vanilla PPO", 5.0, None), ("DAPO", 50.0, None), ("VAPO", 60.4, "vapo/00_vanilla_ppo")]
    assert names[3:] == list(VAPO_LEAVE_ONE_OUT)
    for name, (row, score, key, value) in VAPO_LEAVE_ONE_OUT.items():
        lad = make([f"recipe={name}"]).ladder
        assert (lad.rung, lad.paper_score, lad.base, list(lad.changes)) == (row, score, "vapo/02_vapo", [key])
        assert OmegaConf.select(make([f"recipe={name}"]), key) == value, name
    ppo = make(["recipe=vapo/00_vanilla_ppo"])
    assert (ppo.algo.adv_estimator, ppo.algo.lam_actor, ppo.algo.lam_critic, ppo.algo.kl_coef) == ("gae", 0.95, 0.95, 0.0)
    assert not ppo.algo.value_pretrain and ppo.reward.incorrect_score == -1.0
    assert make(["recipe=vapo/01_dapo"]).algo.adv_estimator == "grpo"


@SCALES
def test_algo_vapo_is_the_full_vapo_rung(scale):
    """Rung 2 is `algo=vapo` (its reward=dapo included), nothing more: the leave-one-out rows are
    one switch away from the preset users run."""
    rung = make(["recipe=vapo/02_vapo", *scale])
    vapo = make(["algo=vapo", *scale])
    a, b = (OmegaConf.to_container(c.algo, resolve=True) for c in (rung, vapo))
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} - {"name"} == set()
    assert diff(flat(rung), flat(vapo)) == set()


def test_base_index():
    assert (base_index("vapo/02_vapo"), base_index(None), base_index("")) == (2, None, None)
    with pytest.raises(ValueError, match="ladder.base"):
        base_index("vapo/full")


# ---------------------------------------------------------------------------------------- command
def test_build_command_default_seeds_and_override_order(tmp_path):
    defaults = LadderDefaults(seeds=[1, 2, 3], overrides=["steps=40", "data.eval_size=64"])
    names = rungs("dapo", recipes_dir=RECIPES)
    cmd = build_command(names, tmp_path / "out", ["algo.clip_low=0.1"], defaults, python="PY")
    assert cmd == [
        "PY", "-m", "rlcli.commands.cli", "train", "-m", "recipe=" + ",".join(names), "seed=1,2,3",
        "steps=40", "data.eval_size=64", "algo.clip_low=0.1", f"hydra.sweep.dir={(tmp_path / 'out').resolve()}",
    ]
    assert names[0] == "dapo/00_naive_grpo" and names[-1] == "dapo/05_dynamic_sampling" and len(names) == 6


def test_build_command_user_seed_and_keys_win(tmp_path):
    defaults = LadderDefaults(seeds=[1, 2, 3], overrides=["steps=40", "data.eval_size=64"])
    cmd = build_command(["dapo/00_naive_grpo", "dapo/01_overlong_filter"], tmp_path, ["seed=7,8", "steps=2"],
                        defaults, python="PY")
    assert cmd[5:] == ["recipe=dapo/00_naive_grpo,dapo/01_overlong_filter", "data.eval_size=64",
                       "seed=7,8", "steps=2", f"hydra.sweep.dir={tmp_path.resolve()}"]
    with pytest.raises(SystemExit, match="--rungs"):
        build_command(["dapo/00_naive_grpo"], tmp_path, ["recipe=dapo/01_overlong_filter"], defaults)


def test_rung_selection_and_ladder_defaults_file():
    assert rungs("dapo", [0, 1], recipes_dir=RECIPES) == ["dapo/00_naive_grpo", "dapo/01_overlong_filter"]
    with pytest.raises(SystemExit, match="has rungs"):
        rungs("dapo", [9], recipes_dir=RECIPES)
    with pytest.raises(SystemExit, match="dapo"):  # lists the ladders there are
        rungs("no_such_paper", recipes_dir=RECIPES)
    d = ladder.load_defaults("dapo", RECIPES)
    assert d.seeds == [1, 2, 3] and any(o.startswith("steps=") for o in d.overrides) and d.title


# ---------------------------------------------------------------------------------------- collect
RUNG_META = [("naive GRPO", 0, 30.0, "dapo_00_naive_grpo"), ("+ overlong filtering", 1, 36.0, "dapo_01_overlong_filter")]
# rung -> seed -> (eval acc before, eval acc after, train seconds); entropy and length follow below.
RESULTS = {0: {1: (0.25, 0.40, 10.0), 2: (0.25, 0.50, 20.0), 3: (0.25, 0.60, 30.0)},
           1: {1: (0.25, 0.70, 12.0), 2: (0.25, 0.80, 14.0)}}


def fake_run(root: Path, job: int, rung: int, seed: int, finished=True, critic=False, paper="dapo", meta=None,
             result=None) -> Path:
    """A run directory as `rlcli train` leaves it; `meta` (rung, index, paper_score, algo.name, base) and
    `result` (acc before, acc after, seconds) replace RUNG_META[rung] and RESULTS[rung][seed]."""
    name, index, score, algo, base = meta or (*RUNG_META[rung], None)
    d = root / f"{job}_{algo}_seed{seed}"
    (d / ".hydra").mkdir(parents=True)
    cfg = {"algo": {"name": algo, "clip_high": 0.2}, "model": {"name": "tiny"},
           "data": {"name": "arith", "eval_size": 4}, "eval": {"size": None, "k": 1, "temperature": 0.0},
           "rollout": {"prompts_per_step": 2, "n": 2}, "steps": 20, "seed": seed, "run_dir": str(d),
           "ladder": {"paper": paper, "rung": name, "index": index, "paper_score": score, "changes": [],
                      "base": base}}
    (d / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (d / ".hydra" / "config.yaml").write_text("decoy: hydra's own unresolved copy\n")
    before, after, secs = result or RESULTS[rung].get(seed, (0.0, 0.0, 0.0))
    rows = [{"step": 0, "eval/acc_before": before}]
    for s in range(1, 21):
        row = {"step": s, "acc/mean": 0.1 * rung + s / 40, "actor/entropy": 1.0 + rung + seed / 10 - s / 100,
               "response_length/mean": 10.0 * (rung + 1) + (seed if s > 18 else 0)}
        if critic:
            row |= {"critic/explained_var": s / 20, "critic/vf_loss": 1 / s}
        rows.append(row)
    rows.append({"step": 20, "eval/acc_after": after})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        result = {"eval_before": {"eval/acc": before}, "eval_after": {"eval/acc": after}, "train_seconds": secs}
        (d / "result.json").write_text(json.dumps(result))
    return d


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    job = 0
    for rung, seeds in RESULTS.items():
        for seed in seeds:
            fake_run(root, job, rung, seed)
            job += 1
    fake_run(root, job, 1, 3, finished=False)  # a crashed run: counted, listed, not averaged
    (root / "multirun.yaml").write_text("hydra: {}\n")
    (root / "ladder.json").write_text(json.dumps({"paper": "dapo", "argv": "rlcli ladder dapo steps=20",
                                                  "command": "python -m rlcli.commands.cli train -m ...", "wall_seconds": 99.0}))
    return root


def test_collect_writes_exact_table(sweep):
    collect(sweep, RECIPES)
    with open(sweep / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["index"], r["rung"], r["paper_score"]) for r in rows] == [
        ("0", "naive GRPO", "30.0"), ("1", "+ overlong filtering", "36.0")]
    r0, r1 = rows
    # rung 0: acc 40/50/60 -> 50 ± 10 (sample std); rung 1: 70/80 -> 75 ± 7.07; the crashed run is left out
    assert (r0["acc_mean"], r0["acc_std"], r0["acc_before"]) == ("50.00", "10.00", "25.00")
    assert (r1["acc_mean"], r1["acc_std"]) == ("75.00", f"{math.sqrt(50):.2f}")
    assert (r0["runs"], r0["finished"], r0["seeds"], r1["runs"], r1["finished"]) == ("3", "3", "1 2 3", "3", "2")
    # final entropy: last step 1 + rung + seed/10 - 0.2 -> rung 0 seeds 1, 2, 3: 1.0; rung 1 seeds 1, 2: 1.95
    assert (r0["entropy_final"], r1["entropy_final"]) == ("1.0000", "1.9500")
    # response length over the last 10% (2 of 20) steps: 10 + seed -> 12.00; rung 1: 20 + seed -> 21.50
    assert (r0["response_length"], r1["response_length"]) == ("12.00", "21.50")
    assert (r0["train_seconds_mean"], r0["train_seconds_total"], r1["train_seconds_total"]) == ("20.0", "60.0", "26.0")

    md = (sweep / "results.md").read_text()
    assert "rlcli ladder dapo steps=20" in md.split("|")[0]  # the command line, above the table
    assert "| 0 | naive GRPO | 30.0 | 50.0 ± 10.0 (n=3) | 25.0 |" in md
    assert "| 1 | + overlong filtering | 36.0 | 75.0 ± 7.1 (n=2) |" in md
    assert "5_dapo_01_overlong_filter_seed3" in md  # the unfinished run is listed
    assert "AIME24 avg@32" in md and "figure.png" in md
    assert (sweep / "figure.png").read_bytes()[:8] == PNG_MAGIC


def test_collect_shows_delta_vs_base_rung(tmp_path):
    """VAPO's leave-one-out rows: accuracy change from the rung `ladder.base` names, ours and the paper's;
    a row whose base did not run gets no number of ours; ladders without bases get no such column."""
    runs = [  # meta (rung, index, paper_score, algo.name, base), accuracy after training per seed
        (("vanilla PPO", 0, 5.0, "vapo_00_vanilla_ppo", None), [0.10, 0.20]),
        (("VAPO", 2, 60.4, "vapo_02_vapo", "vapo/00_vanilla_ppo"), [0.60, 0.70]),
        (("w/o value pretraining", 3, 11.0, "vapo_03_no_value_pretrain", "vapo/02_vapo"), [0.50, 0.55]),
        (("w/o group sampling", 9, 55.0, "vapo_09_no_group_sampling", "vapo/08_absent"), [0.40, 0.40]),
    ]
    job = 0
    for meta, accs in runs:
        for seed, acc in enumerate(accs, 1):
            fake_run(tmp_path, job, 0, seed, critic=True, paper="vapo", meta=meta, result=(0.1, acc, 5.0))
            job += 1
    rows = collect(tmp_path, RECIPES)
    assert [r["index"] for r in rows] == [0, 2, 3, 9]
    with open(tmp_path / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    # VAPO 65 vs PPO 15 -> +50.00 (paper 60.4 - 5 = +55.4); w/o VP 52.5 vs 65 -> -12.50 (paper 11 - 60.4 = -49.4)
    assert [(r["base"], r["acc_delta"], r["paper_delta"]) for r in csv_rows] == [
        ("", "", ""), ("vapo/00_vanilla_ppo", "50.00", "55.4"), ("vapo/02_vapo", "-12.50", "-49.4"),
        ("vapo/08_absent", "", "")]
    md = (tmp_path / "results.md").read_text()
    assert "| 3 | w/o value pretraining | 11.0 | 52.5 ± 3.5 (n=2) | -12.5 / -49.4 (vs 2) | 10.0 |" in md
    assert "| 9 | w/o group sampling | 55.0 | 40.0 ± 0.0 (n=2) | – / – (vs 8) | 10.0 |" in md
    assert "| 0 | vanilla PPO | 5.0 | 15.0 ± 7.1 (n=2) |  | 10.0 |" in md
    assert "Δ vs base rung" in md
    fake_run(tmp_path / "dapo", 0, 0, 1)  # a ladder without bases: the table keeps its plain columns
    collect(tmp_path / "dapo", RECIPES)
    dapo_md = (tmp_path / "dapo" / "results.md").read_text()
    assert "Δ vs base rung" not in dapo_md and "| 0 | naive GRPO | 30.0 | 40.0 (n=1) | 25.0 |" in dapo_md


def test_collect_cli_recollects(sweep, capsys):
    assert ladder.main(["--collect", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "50.0 ± 10.0 (n=3)" in out and (sweep / "results.md").exists()


def test_plot_arbitrary_runs_with_critic_panels(tmp_path):
    a = fake_run(tmp_path / "x", 0, 0, 1, critic=True)
    b = fake_run(tmp_path / "y", 1, 0, 2, critic=True)
    c = fake_run(tmp_path / "z", 2, 1, 1)
    groups = group_runs(find_runs([a, b, c]))
    assert [(g.label, len(g.runs)) for g in groups] == [("naive GRPO", 2), ("+ overlong filtering", 1)]
    out = figure(groups, tmp_path / "fig.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    res = subprocess.run([sys.executable, "-m", "rlcli.commands.cli", "plot", str(tmp_path), "--out", str(tmp_path / "p.png")],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC and "3 runs in 2 groups" in res.stdout


def test_plot_draws_a_panel_for_each_metric_asked_for(tmp_path, monkeypatch):
    """--metrics adds a panel per logged metric (reward/rm beside acc/mean); a metric no run logged is refused."""
    import rlcli.loop.plot as plot

    d = fake_run(tmp_path, 0, 0, 1)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r | ({"reward/rm": 0.1 * r["step"]} if "acc/mean" in r
                                                              else {})) + "\n" for r in rows))
    titles = []
    real = plot.figure

    def spy(groups, out, title=None, metrics=()):
        titles.extend(metrics)
        return real(groups, out, title, metrics)

    monkeypatch.setattr(plot, "figure", spy)
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "f.png"), "--metrics", "reward/rm"]) == 0
    assert titles == ["reward/rm"] and (tmp_path / "f.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SystemExit, match="reward/judge: no run logged it"):
        plot.main([str(tmp_path), "--out", str(tmp_path / "g.png"), "--metrics", "reward/judge"])


def test_the_held_out_panel_says_how_the_runs_evaluated():
    """The held-out panel's title names greedy or avg@k at a temperature (the GPU curve, sampled avg@4, was titled
    greedy)."""
    from rlcli.loop.plot import Run, held_out_title

    greedy, sampled = Run(Path("a"), {"eval": {"temperature": 0.0, "k": 1}}), Run(Path("b"), {"eval": {"temperature": 1.0, "k": 4}})
    assert held_out_title([greedy]) == "held-out accuracy, greedy (eval/acc)"
    assert held_out_title([sampled]) == "held-out accuracy, avg@4 at temperature 1 (eval/acc)"
    assert held_out_title([greedy, sampled]) == "held-out accuracy, avg@4 at temperature 1 / greedy (eval/acc)"


def test_plot_labels_plain_runs_by_dir_name(tmp_path, monkeypatch):
    for seed in (1, 2):
        d = fake_run(tmp_path, seed, 0, seed)
        cfg = OmegaConf.load(d / "config.yaml")
        cfg.ladder = {"paper": None, "rung": None, "index": None, "paper_score": None, "changes": []}
        OmegaConf.save(cfg, d / "config.yaml")
    (groups,) = group_runs(find_runs([tmp_path]))
    assert groups.label == "dapo_00_naive_grpo, seeds 1, 2" and len(groups.runs) == 2  # a sweep's job number dropped
    for seed in (1, 2):  # a seed sweep's folders (hydra.sweep.subdir): 0_seed=1, 1_seed=2
        (tmp_path / f"{seed}_dapo_00_naive_grpo_seed{seed}").rename(tmp_path / f"{seed - 1}_seed={seed}")
    (groups,) = group_runs(find_runs([tmp_path]))
    assert groups.label == "seeds 1, 2"
    from rlcli.loop.plot import main

    monkeypatch.chdir(tmp_path / "0_seed=1")  # not where the figure goes: beside the runs it draws
    assert main([str(tmp_path)]) == 0 and (tmp_path / "figure.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_labels_a_sweep_by_the_values_it_varied(tmp_path):
    """Groups of a sweep are labelled by the keys whose values differ between them, not by their folders' names."""
    for job, (lr, seed) in enumerate([(1e-4, 1), (1e-4, 2), (1e-3, 1)]):
        d = fake_run(tmp_path, job, 0, seed)
        cfg = OmegaConf.load(d / "config.yaml")
        cfg.ladder = {"paper": None, "rung": None, "index": None, "paper_score": None, "changes": []}
        cfg.optim = {"lr": lr}
        OmegaConf.save(cfg, d / "config.yaml")
    groups = group_runs(find_runs([tmp_path]))
    assert sorted((g.label, len(g.runs)) for g in groups) == [("optim.lr=0.0001", 2), ("optim.lr=0.001", 1)]


def test_a_sweep_folder_is_named_by_the_values_it_sweeps():
    from rlcli.config import sweep_subdir

    argv = ["optim.lr=1e-4,1e-3", "seed=range(1,3)", "steps=20", "recipe=dapo/01_x", "hydra.sweep.dir=out"]
    overrides = ["optim.lr=1e-4", "seed=2", "steps=20", "recipe=dapo/01_x"]
    assert sweep_subdir(3, overrides, argv) == "3_optim.lr=1e-4,seed=2"
    assert sweep_subdir(0, ["recipe=dapo/01_x", "steps=2"], ["recipe=dapo/01_x", "steps=2"]) == "0_recipe=dapo-01_x,steps=2"
    assert sweep_subdir(1, [], []) == "1" and len(sweep_subdir(1, ["k=" + "v" * 300], [])) == 102


# ---------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_ladder_smoke_two_rungs(tmp_path):
    """P=4 so that ladder.yaml's algo.mini_batches=4 divides it (the run then takes the off-policy path)."""
    out = tmp_path / "ladder"
    cmd = [sys.executable, "-m", "rlcli.commands.cli", "ladder", "dapo", "--rungs", "0,1", "--out", str(out),
           "steps=1", "model.warm_start.enabled=false", "rollout.prompts_per_step=4", "rollout.n=2",
           "data.eval_size=4", "eval.before=false", "save=false", "seed=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["index"], r["paper_score"], r["finished"], r["seeds"]) for r in rows] == [
        ("0", "30.0", "1", "1"), ("1", "36.0", "1", "1")]
    assert all(r["acc_mean"] != "" and r["acc_before"] == "" for r in rows)
    assert (out / "figure.png").read_bytes()[:8] == PNG_MAGIC
    md = (out / "results.md").read_text()
    assert "rlcli ladder dapo --rungs 0,1" in md and "recipe=dapo/00_naive_grpo,dapo/01_overlong_filter" in md
