"""Documentation of every config knob, read from the schema's field docstrings.

The dataclass schema (rlcli/config/ and the group schemas it composes) is the one place defaults and
their meanings live; `rlcli train --help` and `rlcli explain` print them from there.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from pathlib import Path
from typing import Any


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right under a field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "???"


def knobs(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every leaf field, recursing into nested dataclasses; the doc ends with the
    field's valid range or choices where the schema declares them (rlcli.core.schema)."""
    from rlcli.core.schema import range_of

    rows = []
    docs = field_docs(cls)
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        value = _default(f)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            rows.extend(knobs(type(value), key + "."))
        else:
            doc = docs.get(f.name, "")
            spec = range_of(f)
            if spec is not None:
                doc += f" Valid: {spec.text()}" + (" or null." if "None" in str(hints[f.name]) else ".")
            if isinstance(value, dict):  # rlcli.core.schema.check_known_keys leaves these keys to the user
                doc += f" Open: add keys with +{key}.<name>=<value>."
            rows.append((key, str(hints[f.name]).replace("typing.", ""), value, doc))
    return rows


def group_options(conf_dir: Path) -> dict[str, list[str]]:
    """Options of every config group; recipes are listed as <paper>/<rung> (their ladder.yaml is not one)."""
    return {
        d.name: sorted(
            p.relative_to(d).with_suffix("").as_posix()
            for p in d.rglob("*.yaml")
            if p.name != "ladder.yaml"
        )
        for d in sorted(conf_dir.iterdir())
        if d.is_dir() and not d.name.startswith(("_", "hydra"))
    }


def explain(group: str | None, conf_dir: Path) -> str:
    from rlcli.config import Config

    rows = knobs(Config)
    if group:
        rows = [r for r in rows if r[0] == group or r[0].startswith(group + ".")]
        if not rows:
            raise SystemExit(f"no config keys under {group!r}; groups: {', '.join(group_options(conf_dir))}")
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{width}}  {d}  [{t} = {v!r}]" for k, t, v, d in rows)


def explain_command(group: str | None, conf_dir: Path) -> str:
    """`rlcli explain [group]`: what the defaults shown are, the group's presets, then `explain`."""
    top = (group or "").split(".")[0]
    presets = group_options(conf_dir).get(top)
    lines = ["key  meaning  [type = the schema's default]: a preset sets its own values, which the run's config shows "
             "(rlcli train <overrides> --cfg job)"]
    if presets:
        lines.append(f"{top} presets (conf/{top}/): {', '.join(presets)}")
    return "\n".join([*lines, "", explain(group, conf_dir)])


def help_text(command: str, what: str, conf_dir: Path) -> str:
    lines = [f"rlcli {command}: {what}", "", "usage: rlcli " + command + " [group=option ...] [key=value ...]",
             "", "options:",
             "  -m, --multirun   sweep: rlcli train -m seed=1,2,3 algo.clip_high=0.2,0.28",
             "  --cfg job        print the composed config and exit",
             "  --hydra-help     Hydra's own flags",
             "", "config groups (group=option):"]
    for g, opts in group_options(conf_dir).items():
        lines.append(f"  {g:<8} {', '.join(opts)}")
    lines += ["", "knobs (key  meaning  [type = schema default]; presets may set other values):",
              explain(None, conf_dir)]
    return "\n".join(lines)
