"""Valid ranges and choices of config fields, declared beside their defaults, and the one checker that reads them.

A schema field that can take a wrong value declares what is right where its default is (`rng`):

    prompts_per_step: int = rng(16, ge=1)
    clip_low: float = rng(0.2, ge=0, le=1, why="1 = no lower bound")
    engine: str = rng("hf", choices=ROLLOUT_ENGINES)

`check_ranges` walks the dataclass schema beside a composed config and raises `ConfigError` naming the first
key out of range, before anything is loaded (rlcli.config.validate); `rlcli explain` and `--help` print the
same ranges (rlcli.schema_doc). Rules that relate two fields (divisibility, lower < upper) stay in the
`validate` functions. Torch-free: `rlcli train <typo>` must answer in a second.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any


class ConfigError(ValueError):
    """A mistake in the user's config or command line: `rlcli` prints it as one line (`rlcli: error: ...`) and
    exits with status 2, without a traceback (rlcli.commands.cli). A ValueError, so callers catching ValueError still do;
    a plain ValueError from deeper code stays an internal error with its traceback."""


@dataclasses.dataclass(frozen=True)
class Range:
    """Valid values of one field. Bounds apply to numbers (also to each element of a list or each value of a
    dict); a number must also be finite. `choices` lists the valid values of a choice field. `why` is shown
    after the rule in errors and in `explain` (what the bound means, how to turn the knob off)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None
    why: str = ""
    kind: str = ""
    """What the choices are, for a registry's names (rlcli.core.names.Names.kind): 'rollout engine'."""
    also: tuple[str, ...] = ()
    """Words a numeric field accepts besides its numbers: ('auto',)."""

    def ok(self, value: Any) -> bool:
        if value in self.also:
            return True
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        return (
            math.isfinite(value)
            and (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def error(self, key: str, value: Any, single: bool = True) -> str:
        """The config error for `key=value` out of range: the key, the value and the rule (the fix)."""
        shown = repr(value if single else _plain(value))
        why = f" ({self.why})" if self.why else ""
        if self.kind:
            return f"{key}={shown} is not a known {self.kind}; valid names: {', '.join(sorted(map(str, self.choices or ())))}{why}"
        return f"{key}={shown}{'' if single else ': each value'} must be {self.text()}{why}"

    def text(self) -> str:
        """The rule in words: 'one of: a, b', '>= 1', 'in [0, 1)', 'a finite number'."""
        if self.choices is not None:
            return "one of: " + ", ".join(str(c) for c in self.choices)
        low = (f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}") if (
            self.ge is not None or self.gt is not None) else None
        high = (f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})") if (
            self.le is not None or self.lt is not None) else None
        words = "".join(f", or {w}" for w in self.also)
        if low and high:
            return f"in {low}, {high}{words}"
        if low:
            return f"{'>=' if self.ge is not None else '>'} {low[1:]}{words}"
        if high:
            return f"{'<=' if self.le is not None else '<'} {high[:-1]}{words}"
        return "a finite number" + words


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def rng(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, ge: float | None = None,
        gt: float | None = None, le: float | None = None, lt: float | None = None,
        choices: Iterable[Any] | None = None, why: str = "", also: tuple[str, ...] = ()) -> Any:
    """A dataclass field with its default (or default `factory`) and its valid range or choices (`also`: words a
    numeric field accepts besides numbers)."""
    spec = Range(ge=ge, gt=gt, le=le, lt=lt, choices=tuple(choices) if choices is not None else None, why=why,
                 kind=getattr(choices, "kind", ""), also=also)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"range": spec})
    return dataclasses.field(default=default, metadata={"range": spec})


def keyword_field(cls: type, attr: str, key: str) -> None:
    """Rename dataclass field `attr` of `cls` to `key`, a Python keyword (`async`): the config key users type,
    reached in code as cfg.<group>["async"]. OmegaConf reads the field's name and its annotation."""
    f = cls.__dataclass_fields__.pop(attr)  # type: ignore[attr-defined]
    f.name = key
    cls.__dataclass_fields__[key] = f  # type: ignore[attr-defined]
    cls.__annotations__[key] = cls.__annotations__.pop(attr)
    setattr(cls, key, property(lambda self: getattr(self, attr)))  # an instance (built by __init__) has `attr`


def range_of(f: dataclasses.Field) -> Range | None:
    return f.metadata.get("range")


def nested_schema(f: dataclasses.Field) -> type | None:
    """The dataclass a field holds (a config subgroup), read from its default: annotations are strings here."""
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        value = f.default
    return type(value) if dataclasses.is_dataclass(value) else None


def _get(cfg: Any, name: str) -> Any:
    """cfg.<name>, or None for a value Hydra still has to set (`???`): nothing to check yet."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig) and OmegaConf.is_missing(cfg, name):
        return None
    return getattr(cfg, name)


def check_ranges(cfg: Any, schema: type, prefix: str = "") -> None:
    """Raise ConfigError naming the first field of `cfg` (a DictConfig or a schema instance) outside the range
    its `schema` dataclass declares. null passes: a field that may be null says what null means."""
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        sub = nested_schema(f)
        if sub is not None:
            check_ranges(_get(cfg, f.name), sub, key + ".")
            continue
        spec = range_of(f)
        if spec is None:
            continue
        value = _get(cfg, f.name)
        if value is None:
            continue
        items = list(value.values()) if isinstance(value, Mapping) else (
            list(value) if isinstance(value, Iterable) and not isinstance(value, str) else [value])
        bad = [v for v in items if v is not None and not spec.ok(v)]
        if bad:
            raise ConfigError(spec.error(key, value, single=len(items) == 1 and items[0] is value))


def check_known_keys(cfg: Any, schema: type, prefix: str = "") -> None:
    """Raise ConfigError naming the first key of `cfg` (a DictConfig) that its `schema` dataclass does not declare,
    with the closest declared key. Hydra's struct mode refuses a misspelled `key=value`, but `+key=value` adds the key
    anyway: without this check `+algo.clip_hihg=0.3` would train with clip_high unchanged. A field holding a dict
    (reward.weights, reward.custom) is open on purpose: its keys are names the user chooses."""
    import difflib

    from omegaconf import DictConfig

    if not isinstance(cfg, DictConfig):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for name in cfg:
        key = f"{prefix}{name}"
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f"did you mean {prefix}{close[0]}? " if close else ""
            raise ConfigError(f"{key} is not a config key (added with +{key}=...?): {hint}`rlcli explain"
                              f"{' ' + prefix.split('.')[0] if prefix else ''}` lists the keys")
        sub = nested_schema(fields[name])
        if sub is not None:
            check_known_keys(_get(cfg, name), sub, key + ".")


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"algo.clip_high": 0.28, ...} of a nested dict (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}."))
    return out
