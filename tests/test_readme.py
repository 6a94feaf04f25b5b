"""The README is the user's manual: its commands table matches `rlcli --help`, its links and figure
resolve, and its text speaks of the project, not of how it was built."""

import re

from conftest import ROOT

from rlcli.commands.cli import COMMANDS, _usage

README = (ROOT / "README.md").read_text()


def test_commands_table_lists_exactly_the_commands_of_rlcli_help():
    table = README[README.index("## Commands"):]
    table = table[: table.index("\n## ")]
    in_readme = set(re.findall(r"^\| `rlcli ([a-z]+)", table, re.M))
    in_help = set(re.findall(r"^  ([a-z]+) ", _usage(), re.M))
    assert in_help == set(COMMANDS)
    assert in_readme == in_help, (in_readme ^ in_help)


def test_every_relative_link_and_image_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert "docs/figures/default_run.png" in local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_no_process_words_in_the_user_facing_text():
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    process = re.compile(r"\bsessions?\b|\bissues?\b|#\d+\b", re.I)
    hits = [f"{p.name}:{i}: {line.strip()}" for p in pages
            for i, line in enumerate(p.read_text().splitlines(), 1) if process.search(line)]
    assert not hits, "\n".join(hits)


def test_the_resume_may_change_list_is_the_codes():
    """docs/checkpoints.md lists exactly checkpoint.MAY_CHANGE and MAY_CHANGE_GROUPS."""
    from rlcli.loop.checkpoint import MAY_CHANGE, MAY_CHANGE_GROUPS

    checkpoints = (ROOT / "docs" / "checkpoints.md").read_text()
    section = checkpoints[checkpoints.index("- Keys that may change"):]
    section = section[: section.index("- `hw.nproc` and `hw.zero_stage` may not change")]
    listed = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)*(?:\.\*)?)`", section)) - {"optim.scheduler"}
    code = set(MAY_CHANGE) | {g + "*" for g in MAY_CHANGE_GROUPS}
    assert listed == code, listed ^ code


def test_the_group_order_and_the_stages_are_the_codes():
    """The group order docs/config.md states is conf/config.yaml's; the stages the design page lists are the
    loop's timed stages."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.load(ROOT / "conf" / "config.yaml").defaults
    groups = [next(iter(d)).removeprefix("optional ") for d in defaults if not isinstance(d, str)]
    config = (ROOT / "docs" / "config.md").read_text()
    stated = re.search(r"Group order in `conf/config.yaml` is `([^`]+)`", config).group(1).split(", ")
    assert stated == groups
    loop = (ROOT / "rlcli" / "loop" / "trainer.py").read_text()
    made = (ROOT / "rlcli" / "loop" / "remote.py").read_text()  # stages 1-3 time themselves where they run
    timed = re.findall(r'timer\("(\w+)"\)', loop) + re.findall(r'seconds\["(\w+)"\] =', made)
    design = (ROOT / "docs" / "design.md").read_text()
    assert set(timed) == {"rollout", "reward", "shape", "score", "advantage", "update", "sync"}
    missing = [stage for stage in timed if f"**{stage}**" not in design]
    assert not missing, missing


def test_the_readme_headline_is_the_latest_default_run_of_the_results_page():
    """README's held-out numbers of the default run come from docs/results.md: the latest measurement there (the last
    "(**mean ± std**), from a warm start at <before>" of "The default run")."""
    results = (ROOT / "docs" / "results.md").read_text()
    section = results.split("## The default run", 1)[1].split("\n## ", 1)[0]
    *_, (after, before) = re.findall(r"\(\*\*(\d+\.\d ± \d+\.\d)\*\*\), from a warm start at (\d+\.\d)", section)
    assert f"goes from {before} % to {after} % over 3 seeds" in README
