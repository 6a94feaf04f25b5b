"""Package attributes imported on first use (PEP 562), so that importing a package's torch-free parts
(its config schema) does not import torch: `rlcli train` with a typo answers before torch would load."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `table[name]` (a submodule, relative to `package`)
    the first time `name` is asked for, and returns its attribute `name`."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{table[name]}"), name)

    return __getattr__
