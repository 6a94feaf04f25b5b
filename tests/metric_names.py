"""The metrics glossary check: every key a run logs is defined in docs/metrics.md."""

import re

from conftest import ROOT


def undocumented(keys, reward_parts=(), tasks=()):
    """Keys of `keys` that docs/metrics.md does not define (suffixes, `@k`, reward parts and the `tasks` of a mix,
    data=reasoning_gym, normalised)."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    missing = []
    for key in keys:
        if key == "step":
            continue
        name = re.sub(r"_(before|after)$", "", key)
        name = name.removeprefix("pretrain/") if name != "pretrain/step" else name
        name = re.sub(r"@\d+$", "@k", name)
        if name.removeprefix("reward/") in reward_parts:
            name = "reward/<name>"
        head, _, task = name.rpartition("/")
        if task in tasks and head in ("acc", "reward", "eval/acc"):
            name = f"{head}/<task>"
        group, _, rest = name.partition("/")
        if group == "curriculum" and rest.split("/")[0] in tasks:  # data.curriculum: curriculum/<task>/level
            name = f"curriculum/<task>/{rest.split('/', 1)[-1]}"
        if name.startswith("agent/"):  # env.agent_metrics: the user's names
            name = "agent/<name>"
        if f"`{name}`" not in text:
            missing.append(key)
    return missing
