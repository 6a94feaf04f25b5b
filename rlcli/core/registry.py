"""Name -> function registries: the way algorithms plug into the one loop (docs/design.md#registries).

Every kind (advantage estimators, policy losses, aggregations, KL estimators, reward functions,
reward shapers) is a :class:`Registry`. Adding an algorithm is one decorated function; an unknown
name fails with the list of valid names so the config error says how to fix itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry(dict[str, Callable[..., Any]]):
    """A dict of named functions of one kind with a decorator and a helpful lookup error.

    `kind` is a plain name, or a `rlcli.core.names.Names` catalogue: then only its names may be registered, so
    config validation can check names without importing the functions (and torch)."""

    def __init__(self, kind: str | tuple[str, ...]):
        super().__init__()
        self.declared = kind if not isinstance(kind, str) else None
        self.kind = kind if isinstance(kind, str) else kind.kind

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if self.declared is not None and name not in self.declared:
                raise ValueError(f"{self.kind} {name!r} is not declared in rlcli/core/names.py: add it there")
            self[name] = fn
            return fn

        return deco

    def __missing__(self, name: str) -> Callable[..., Any]:
        raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self))}")

    def check(self, name: str, key: str) -> None:
        """Raise a config error naming `key` unless `name` is registered."""
        if name not in self:
            raise ValueError(
                f"{key}={name!r} is not a known {self.kind}; valid names: {', '.join(sorted(self))}"
            )


def import_dotted(path: str) -> Any:
    """Import ``"pkg.module.attr"`` and return the attribute."""
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"{path!r} is not a dotted path like 'pkg.module.function'")
    return getattr(importlib.import_module(module), attr)
