"""Packaging: one top-level name (``jremat``), nothing a user's file can shadow, a JAX-only core.

The built wheel itself is checked by ``.ci/package`` (a fresh virtual environment with the core
dependencies only, run from a folder of decoy modules); these tests hold the same promises in
the checkout, in subprocesses where the interpreter's import state matters.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest

import jremat
from tests.conftest import REPO

#: The checkout folders installed as ``jremat.<name>``: never to be imported by their folder name.
SHADOWABLE = ("policies", "models", "train")
TRAIN_EXTRA = ("flax", "optax", "orbax", "matplotlib", "pooch", "tqdm")


def _run(code: str, cwd: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _project_files():
    for folder in ("jremat", *SHADOWABLE, "tests"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            yield from (os.path.join(root, f) for f in files if f.endswith(".py"))
    yield from (os.path.join(REPO, ".ci", f) for f in os.listdir(os.path.join(REPO, ".ci")) if f.endswith(".py"))


@pytest.mark.heavy
def test_no_project_file_imports_a_shadowable_top_level_name():
    offenders = []
    for path in _project_files():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            offenders += [
                f"{os.path.relpath(path, REPO)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] in SHADOWABLE
            ]
    assert not offenders, offenders


def test_version_is_single_sourced_and_printed():
    assert jremat.__version__ == importlib.metadata.version("jremat")
    out = subprocess.run(
        [sys.executable, "-m", "jremat", "--version"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == f"jremat {jremat.__version__}"


def test_dependencies_core_is_jax_and_numpy_and_the_training_stack_is_an_extra():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    core = {dep.split(">")[0].split("=")[0].split("[")[0] for dep in project["dependencies"]}
    assert core == {"jax", "numpy"}
    extra = {dep.split(">")[0].split("=")[0] for dep in project["optional-dependencies"]["train"]}
    assert extra == {"flax", "optax", "orbax-checkpoint", "matplotlib", "pooch", "tqdm"}
    assert all(target.startswith("jremat.") for target in project["scripts"].values())


@pytest.mark.heavy
def test_decoy_files_in_the_working_folder_change_nothing_and_the_core_loads_no_training_stack(tmp_path):
    for name in SHADOWABLE:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('decoy {name}.py imported')\n")
    code = f"""
import sys, json
import jremat.pytest_plugin
before = sorted(m for m in ("jax", "flax") if m in sys.modules)   # the plugin alone: no JAX
import jax, jax.numpy as jnp, jremat
from jremat.testing import assert_remat_exact
f = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)
w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))
for spec in ("every_k:k=2", "full", "dots", "skip_cheap"):
    assert_remat_exact(f, spec, w, x)
temp = jremat.memory_report(jax.grad(jremat.checkpoint(f, "full")), w, x).temp_bytes
loaded = sorted(m for m in (*{SHADOWABLE!r}, *{TRAIN_EXTRA!r}) if m in sys.modules)
print(json.dumps([before, loaded, temp]))
"""
    env_cwd = str(tmp_path)
    before, loaded, temp = json.loads(_run(code, env_cwd))
    assert before == [] and loaded == [] and temp > 0


@pytest.mark.heavy
def test_a_checkouts_cli_loads_every_file_under_one_name():
    code = """
import collections, json, os, runpy, sys
for module in ("train.ptb", "train.bench"):
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
by_file = collections.defaultdict(set)
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if path and name != "__main__":
        by_file[os.path.realpath(path)].add(id(module))
root = os.path.realpath(".")
twice = sorted(os.path.relpath(p, root) for p, ids in by_file.items() if len(ids) > 1 and p.startswith(root))
ours = sorted(n for n in sys.modules if n.split(".")[0] in ("train", "models", "policies"))
print(json.dumps([twice, ours, sys.modules["train"] is sys.modules["jremat.train"]]))
"""
    twice, aliases, same = json.loads(_run(code, REPO))
    assert twice == [] and same
    assert aliases == ["train", "train.bench"]  # the two checkout names runpy needs, both the installed packages


#: A ``sitecustomize`` that hides Flax from the path finder, as on a core install (no ``[train]``
#: extra): ``find_spec("flax")`` is None and ``import flax`` raises ``No module named 'flax'``.
_HIDE_FLAX = """
import importlib.machinery, sys

class _HidingPathFinder(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] == "flax":
            return None
        return super().find_spec(fullname, path, target)

sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = _HidingPathFinder
"""
CONSOLE_SCRIPTS = ("jremat-ptb", "jremat-memory", "jremat-bench", "jremat-launch")


def test_the_extras_module_list_is_the_train_extra():
    tomllib = pytest.importorskip("tomllib")
    from jremat._extras import TRAIN_EXTRA_MODULES

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["train"]
    distributions = {dep.split(">")[0].split("=")[0] for dep in extra}
    assert {m.replace(".", "-") for m in TRAIN_EXTRA_MODULES} == distributions


def test_without_the_train_extra_every_cli_prints_one_line_naming_it_and_models_raises(tmp_path):
    hider = tmp_path / "hide"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text(_HIDE_FLAX)
    env = dict(os.environ, PYTHONPATH=str(hider))

    def run(*argv):
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)

    probe = run(sys.executable, "-c", "import importlib.util as u; print(u.find_spec('flax')); import flax")
    assert probe.stdout.strip() == "None" and "No module named 'flax'" in probe.stderr  # the simulation holds
    bin_dir = os.path.dirname(sys.executable)
    commands = [(os.path.join(bin_dir, script), "--help") for script in CONSOLE_SCRIPTS]
    commands += [
        (sys.executable, "-m", f"jremat.train.{cli}", "--help") for cli in ("ptb", "memory", "bench", "launch")
    ]
    for command in commands:
        done = run(*command)
        lines = done.stderr.splitlines()
        assert (done.returncode, len(lines), done.stdout) == (2, 1, ""), (command, done.stderr[-2000:])
        assert lines[0].startswith("error: ") and "not installed: flax)" in lines[0], lines
        assert lines[0].endswith('pip install "jremat[train]"'), lines
    models = run(sys.executable, "-c", "import jremat.models")
    assert models.returncode == 1 and models.stderr.splitlines()[-1] == (
        'ImportError: jremat.models needs the [train] extra (not installed: flax); install it with pip install "jremat[train]"'
    ), models.stderr[-2000:]


#: README.md's size limit: what the README holds beyond it goes to a page of docs/.
README_MAX_BYTES = 12_288


def test_readme_sets_up_first_and_reads_right_on_a_package_index():
    """README.md starts with the checkout's two set-up commands (the main job, then the test command
    .ci/run runs), then the installed commands; it keeps to README_MAX_BYTES and links only absolutely,
    since it is also the wheel's long description."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.encode("utf-8")) <= README_MAX_BYTES
    set_up, installed = [block.split("```", 1)[0] for block in readme.split("```bash\n")[1:3]]
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read().split("# README test command (keep identical):\n", 1)[1].splitlines()[0]
    main_job, tests = [line for line in set_up.splitlines() if line and not line.startswith("#")]
    assert 'pip install -e ".[train]"' in main_job and "python -m train.ptb --policy" in main_job
    assert tests.endswith(ci), (tests, ci)
    assert "pip install jremat " in installed and 'pip install "jremat[train]"' in installed
    assert "jremat-ptb --policy" in installed and "-e ." not in installed
    targets = re.findall(r"\]\(([^)]+)\)", readme)
    assert targets and [t for t in targets if not t.startswith("https://")] == []
