"""The checkout's layout rules: no module over 550 lines, ``train/``, ``policies/`` and ``models/``
on the public API only, the library's rooms importing one way, and no import cycle among the
library's modules."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: The folders of the library and its reference model and tools.
PACKAGES = ("jremat", "policies", "models", "train")
MAX_LINES = 550
#: The folders whose modules import one another in layers, by the package each installs as.
LAYERED_PACKAGES = {"jremat": "jremat", "policies": "jremat.policies", "models": "jremat.models"}


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
    assert _private_jremat_imports("from jremat._plan.fit import largest_fitting") == [
        "jremat._plan.fit",
        "jremat._plan.fit.largest_fitting",
    ]
    assert _private_jremat_imports("from jremat import _memory") == ["jremat._memory"]
    assert _private_jremat_imports("def f():\n    import jremat._measure.compile") == ["jremat._measure.compile"]
    assert _private_jremat_imports("from jremat.fit import largest_fitting\nimport jremat.diagnosis") == []


def _imports(source: str, *, in_functions: bool = False) -> list[str]:
    """The modules ``source`` imports: every import outside an ``if TYPE_CHECKING:`` block, and
    outside a function body unless ``in_functions``, as ``module`` and ``module.name`` for each
    ``from module import name``."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not in_functions:
            return
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _module_level_imports(source: str) -> list[str]:
    """The modules ``source`` imports when it is imported (:func:`_imports` outside function bodies)."""
    return _imports(source)


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph`` (module -> modules it imports): each strongly connected component
    of more than one module, or of one module importing itself, sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in order:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in order:
            connect(v)
    return sorted(cycles)


def _layered_import_graph() -> dict[str, set[str]]:
    files = {
        ".".join([package, *path.relative_to(ROOT / folder).with_suffix("").parts]).removesuffix(".__init__"): path
        for folder, package in LAYERED_PACKAGES.items()
        for path in _python_files(folder)
    }
    return {m: {i for i in _module_level_imports(f.read_text()) if i in files and i != m} for m, f in files.items()}


def test_no_import_cycle_among_library_modules():
    graph = _layered_import_graph()
    assert len(graph) > 40 and graph["jremat._program.program"], "the scan sees the library's modules and their imports"
    assert _import_cycles(graph) == []
    # The scan sees each form of a module-level import, and no import in a function or a TYPE_CHECKING block.
    source = (
        "import jremat._a\nfrom jremat import _b\nfrom jremat._c import f\ntry:\n    import jremat._d\n"
        "except ImportError:\n    pass\nif TYPE_CHECKING:\n    import jremat._e\nelse:\n    import jremat._f\n"
        "def g():\n    import jremat._h\n"
    )
    imported = set(_module_level_imports(source))
    assert {"jremat._a", "jremat._b", "jremat._c", "jremat._d", "jremat._f"} <= imported
    assert not {"jremat._e", "jremat._h"} & imported
    assert _import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _import_cycles({"a": {"b"}, "b": set()}) == []


#: The library's rooms (``jremat/_<room>/``), lowest first: a room's modules import only modules of
#: its own room and the rooms before it, never a top-level module (the public namespaces import the
#: rooms, not the other way). The map: docs/architecture.md.
ROOMS = ("_spec", "_engine", "_program", "_attention", "_measure", "_apply", "_explain", "_plan")


def _all_imports(source: str) -> list[str]:
    """Every module ``source`` imports, at module level or in a function body (:func:`_imports`)."""
    return _imports(source, in_functions=True)


def _room_of(module: str) -> str | None:
    """The room of ``jremat._<room>[.x]`` (``None`` for any other module)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "jremat" and len(parts) > 1 and parts[1] in ROOMS else None


def _wrong_way_imports(room: str, imports: list[str]) -> list[str]:
    """The imports in ``imports`` that a module of ``room`` may not make: a later room, or a
    top-level ``jremat`` module."""
    allowed = set(ROOMS[: ROOMS.index(room) + 1])
    wrong = []
    for module in imports:
        if module.split(".")[0] != "jremat" or module == "jremat":
            continue
        target = _room_of(module)
        if target is None and module.count(".") == 1 and module.split(".")[1] not in ROOMS:
            wrong.append(module)  # a top-level module: jremat.names, jremat._version, ...
        elif target is not None and target not in allowed:
            wrong.append(module)
    return wrong


def test_the_rooms_import_one_way():
    rooms = sorted(p.name for p in (ROOT / "jremat").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == sorted(ROOMS), "every room is in ROOMS, in its order"
    found = {}
    for room in ROOMS:
        for path in _python_files(f"jremat/{room}"):
            if wrong := _wrong_way_imports(room, _all_imports(path.read_text())):
                found[str(path.relative_to(ROOT))] = wrong
    assert not found, f"imports against the rooms' order {ROOMS}: {found}"
    # Only the top-level modules of the library sit beside the rooms: no flat private module.
    flat = sorted(p.name for p in (ROOT / "jremat").glob("_*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert flat == ["_checkout.py", "_extras.py", "_version.py"], flat
    # The scan sees each way of going the wrong way, and lets the right ways through.
    source = "from jremat import names\ndef f():\n    from jremat._plan import fit\nimport jremat._engine.jaxpr\n"
    assert _wrong_way_imports("_measure", _all_imports(source)) == ["jremat.names", "jremat._plan", "jremat._plan.fit"]
    assert _wrong_way_imports("_plan", _all_imports("from jremat._spec.text import parse_spec")) == []
    assert _all_imports("if TYPE_CHECKING:\n    import jremat._plan\n") == []


@pytest.mark.parametrize("folder", ["policies", "models"])
def test_policies_and_models_import_no_private_jremat_module(folder):
    found = {
        str(p.relative_to(ROOT)): imports
        for p in _python_files(folder)
        if (imports := _private_jremat_imports(p.read_text()))
    }
    assert not found, found
