"""The architecture (pyproject.toml [tool.importlinter]; docs/design.md, "Layers"): rlcli's packages stand on named
floors, each importing only the floors below it (one named exception), checked by import-linter; the import graph
has no circle, checked on grimp's graph (import-linter's)."""

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest
from conftest import ROOT

pytest.importorskip("importlinter", reason="pip install 'rlcli[dev]' (import-linter)")

LINT = Path(sys.executable).parent / "lint-imports"


def lint(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package under `root` with root/pyproject.toml's contracts."""
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_the_layers_contract_is_kept():
    out = lint(ROOT)
    assert out.returncode == 0 and "1 kept, 0 broken" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


def test_an_upward_import_breaks_the_contract(tmp_path):
    """A copy of the package whose base (rlcli.core.schema) imports a command (rlcli.commands.cli), inside a function as rlcli's
    lazy imports are: the contract names the import and fails."""
    shutil.copytree(ROOT / "rlcli", tmp_path / "rlcli", ignore=shutil.ignore_patterns("conf", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "rlcli" / "core" / "schema.py", "a") as f:
        f.write("\n\ndef _upward():\n    from rlcli.commands import cli  # noqa: F401\n")
    out = lint(tmp_path)
    assert out.returncode == 1 and "0 kept, 1 broken" in out.stdout, out.stdout[-3000:]
    assert "rlcli.core is not allowed to import rlcli.commands" in out.stdout
    assert "- rlcli.core.schema -> rlcli.commands.cli" in out.stdout


def test_the_import_graph_has_no_circle():
    """No module reaches itself through imports (function-level imports included): for every import a -> b, no
    chain leads from b back to a."""
    graph = grimp.build_graph("rlcli")
    back = [(a, b) for a in sorted(graph.modules) for b in sorted(graph.find_modules_directly_imported_by(a))
            if graph.find_shortest_chain(importer=b, imported=a) is not None]
    assert back == [], f"imports on a circle: {back[:10]}"


def test_every_package_stands_on_one_floor_and_one_import_goes_up():
    """The floors are whole packages (and the two top-level modules), so each module's floor is its folder's: every
    module of rlcli is inside one entry of the layers, the root package's face (its __init__.py defines no function
    or class) excepted. One import only may run from a lower floor to a higher one: the root schema composing the
    `rm` group's schema."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    floors = [name.strip() for layer in contract["layers"] for name in layer.replace("|", ":").split(":")]
    assert all(f.count(".") == 1 for f in floors), floors  # rlcli.<package or top-level module>, never deeper
    graph = grimp.build_graph("rlcli")
    homeless = [m for m in sorted(graph.modules) if not any(m == f or m.startswith(f + ".") for f in floors)]
    assert homeless == ["rlcli"], f"{homeless} stand on no floor of pyproject.toml's layers: add their package to one"
    defined = [n for n in ast.parse((ROOT / "rlcli" / "__init__.py").read_text()).body
               if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    assert not defined
    assert contract["ignore_imports"] == ["rlcli.config -> rlcli.rm.config"]

