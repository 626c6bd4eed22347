"""The public surface of ``jremat``: the names of ``__all__`` and a few public submodules, no module
shadowing a public name."""

import ast
import importlib
import pathlib
import pkgutil
import types

import pytest

import jremat
from jremat import diagnosis, fit

#: Submodules users import by name; every other module of the package is private (``jremat._...``).
PUBLIC_SUBMODULES = {
    "names",
    "ops",
    "attention",
    "kernels",
    "registry",
    "testing",
    "pytest_plugin",
    "diagnosis",
    "fit",
    "internal",
}
#: Packages that a checkout keeps in folders of their own (policies/, models/, train/).
MAPPED_PACKAGES = {"policies", "models", "train"}


def test_every_name_in_all_resolves():
    assert len(jremat.__all__) == len(set(jremat.__all__))
    for name in jremat.__all__:
        assert hasattr(jremat, name), name


def test_no_public_attribute_is_a_private_module():
    for name in PUBLIC_SUBMODULES | MAPPED_PACKAGES:
        importlib.import_module(f"jremat.{name}")
    public = [name for name in dir(jremat) if name.isidentifier() and not name.startswith("_")]
    modules = {name for name in public if isinstance(getattr(jremat, name), types.ModuleType)}
    assert modules <= PUBLIC_SUBMODULES | MAPPED_PACKAGES


def test_every_other_module_is_private():
    found = {info.name for info in pkgutil.iter_modules(jremat.__path__)}
    assert PUBLIC_SUBMODULES <= found
    assert {name for name in found - PUBLIC_SUBMODULES if not name.startswith("_")} == set()


def test_decorator_and_explain_are_the_functions():
    assert callable(jremat.policy) and not isinstance(jremat.policy, types.ModuleType)
    assert callable(jremat.explain) and not isinstance(jremat.explain, types.ModuleType)
    found = {info.name for info in pkgutil.iter_modules(jremat.__path__)}
    assert not found & {"policy", "explain"}


def _type_checking_imports(source: str) -> set[tuple[str, str]]:
    """``(module, name)`` of every ``from module import name as name`` in the ``if TYPE_CHECKING:`` block."""
    block = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    found = set()
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.dump(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name} is not re-exported as itself"
            found.add((node.module, alias.name))
    return found


def _export_table_imports(exports: dict[str, tuple[str, ...]]) -> set[tuple[str, str]]:
    pairs = {(module, name) for module, names in exports.items() for name in names}
    return pairs | {module.rpartition(".")[::2] for module in exports if not module.startswith("jremat._")}


def test_the_static_reexports_are_the_export_table():
    """What a type checker sees (the TYPE_CHECKING block) is what ``__getattr__`` loads (``_EXPORTS``)."""
    source = pathlib.Path(jremat.__file__).read_text()
    static = _type_checking_imports(source)
    assert static == _export_table_imports(jremat._EXPORTS)
    assert {name for _, name in static} == set(jremat.__all__)
    # The comparison catches a name added to one side only.
    missing = source.replace("    from jremat._apply.rng import dropout as dropout\n", "")
    assert missing != source
    assert _type_checking_imports(missing) != _export_table_imports(jremat._EXPORTS)


def test_the_namespaces_hold_the_top_level_objects():
    for namespace in (diagnosis, fit):
        assert sorted(namespace.__all__) == sorted(set(namespace.__all__))
        for name in namespace.__all__:
            value = getattr(namespace, name)
            if name in jremat.__all__:
                assert getattr(jremat, name) is value, f"jremat.{name} is not jremat.{namespace.__name__}.{name}"
    assert jremat.fit is fit and jremat.diagnosis is diagnosis
    assert {"fit_search", "largest_fitting", "Budget", "parse_budget"} <= set(fit.__all__)
    assert {"explain", "memory_report", "saved_residuals_report", "collectives_report", "memory_timeline"} <= set(
        diagnosis.__all__
    )


@pytest.mark.slow  # one mypy run; .ci/run runs it beside `mypy jremat`
def test_a_type_checker_resolves_every_public_name(tmp_path):
    """mypy sees each name of ``__all__`` (and of the namespaces) with its type: none is ``Any``."""
    import mypy.api as api  # the test extra declares mypy

    names = [f"jremat.{n}" for n in jremat.__all__]
    names += [f"jremat.{ns.__name__.rpartition('.')[2]}.{n}" for ns in (diagnosis, fit) for n in ns.__all__]
    lines = ["import jremat", "import jremat.diagnosis", "import jremat.fit"]
    lines += [f"reveal_type({name})" for name in names]
    lines.append("reveal_type(jremat.not_a_public_name)")  # the control: what __getattr__ gives a checker
    checked = tmp_path / "reveal.py"
    checked.write_text("\n".join(lines) + "\n")
    root = pathlib.Path(jremat.__file__).parent.parent
    out, err, _ = api.run(
        [
            str(checked),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--follow-imports=silent",
            "--config-file",
            str(root / "pyproject.toml"),
        ]
    )
    revealed = [line for line in out.splitlines() if "Revealed type is" in line]
    assert len(revealed) == len(names) + 1, out + err
    assert revealed.pop().endswith('"Any"'), out
    for name, line in zip(names, revealed):
        kind = line.split("Revealed type is", 1)[1].strip()
        assert kind != '"Any"', f"{name}: {line}"
    assert " error: " not in out, out
