"""The checkout's layout rules: no module over 550 lines, and ``train/`` on the public API only."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: The folders of the library and its reference model and tools.
PACKAGES = ("jremat", "policies", "models", "train")
MAX_LINES = 550


def _python_files(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _private_jremat_imports(source: str) -> list[str]:
    """The private ``jremat`` modules (``jremat._x``, or ``_x`` from ``jremat``) that ``source`` imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [
            m for m in modules if m.split(".")[0] == "jremat" and any(p.startswith("_") for p in m.split(".")[1:])
        ]
    return found


@pytest.mark.parametrize("folder", PACKAGES)
def test_no_module_is_over_550_lines(folder):
    long = {
        str(p.relative_to(ROOT)): n for p in _python_files(folder) if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_train_imports_no_private_jremat_module():
    found = {
        str(p.relative_to(ROOT)): imports
        for p in _python_files("train")
        if (imports := _private_jremat_imports(p.read_text()))
    }
    assert not found, found
    # The scan sees each form of a private import.
    assert _private_jremat_imports("from jremat._fit import largest_fitting") == [
        "jremat._fit",
        "jremat._fit.largest_fitting",
    ]
    assert _private_jremat_imports("from jremat import _memory") == ["jremat._memory"]
    assert _private_jremat_imports("def f():\n    import jremat._compile") == ["jremat._compile"]
    assert _private_jremat_imports("from jremat.fit import largest_fitting\nimport jremat.diagnosis") == []
