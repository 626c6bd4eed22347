"""The pytest11 plugin: a user's test file using only ``remat_exact`` runs with plain pytest after install."""

import inspect
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from tests.jremat.test_testing import FreshKeyOnRecompute

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: The user's conftest registers a remat that is broken on purpose: its backward pass recomputes
#: with another PRNG key than the forward pass (a dropout mask the backward pass does not see). It
#: is tests/jremat/test_testing.py's, pasted as source: the project outside this checkout imports
#: nothing from it.
USER_CONFTEST = (
    "import jax\nimport jax.numpy as jnp\n\nimport jremat\nfrom jremat import Policy\n\n\n"
    + inspect.getsource(FreshKeyOnRecompute)
    + """

@jremat.register("fresh_key_on_recompute", doc="broken on purpose: another dropout key on recompute")
def fresh_key_on_recompute():
    return FreshKeyOnRecompute()
"""
)

USER_TESTS = """
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jremat


def loss(w, x):
    return jnp.sum(checkpoint_name(jnp.tanh(x @ w), "mlp_in") ** 2)


def test_installed_copy_is_used():
    assert jremat.__file__.startswith({target!r}), jremat.__file__


def test_exact(remat_exact):
    remat_exact(loss, jnp.eye(3) * 0.5, jnp.ones((2, 3)))


@pytest.mark.remat_policies(tags=["mlp_in"])
def test_exact_with_tags(remat_exact):
    remat_exact(loss, jnp.eye(3) * 0.5, jnp.ones((2, 3)))


def dropout_loss(w, x, key):
    return jnp.sum(jremat.dropout(jnp.sin(x @ w), 0.5, key, 0) ** 2)


@pytest.mark.parametrize("remat_exact", ["none", "full", "dots", "fresh_key_on_recompute"], indirect=True)
def test_broken_remat_fails(remat_exact):
    w, x = jnp.eye(4) * 0.7 + 0.1, jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    remat_exact(dropout_loss, w, x, jax.random.key(0))


@pytest.mark.parametrize("remat_exact", ["none", "full"], indirect=True)
def test_nondeterministic_model_fails_even_under_none(remat_exact):
    def redraws(w, x):  # a fresh random draw on every trace: no run of it equals another, remat or not
        import numpy as np
        return jnp.sum(jnp.tanh(x @ w) * jnp.asarray(np.random.rand(2, 3), jnp.float32))
    remat_exact(redraws, jnp.eye(3) * 0.5, jnp.ones((2, 3)))
"""


@pytest.mark.heavy
def test_user_project_runs_with_plain_pytest_after_pip_install(tmp_path):
    target, project = tmp_path / "site", tmp_path / "project"
    project.mkdir()
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (project / "test_user.py").write_text(textwrap.dedent(USER_TESTS.format(target=str(target))))
    (project / "conftest.py").write_text(USER_CONFTEST)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(target)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    out = run.stdout + run.stderr
    summary = out.strip().splitlines()[-1]
    # The broken remat fails, and only it: the same model passes under none, full and dots. A model
    # that is no function of its inputs fails under none too.
    # Everything else passes or is skipped with its reason (name-based policies need tags, nested
    # cannot wrap one function).
    assert run.returncode == 1, out
    failures = [line for line in out.splitlines() if line.startswith("FAILED")]
    broken = [line for line in failures if "test_broken_remat_fails" in line]
    assert len(broken) == 1 and "test_broken_remat_fails[fresh_key_on_recompute]" in broken[0], failures
    assert "RematMismatch: remat under fresh_key_on_recompute changed gradient" in out, out
    for policy in ("none", "full"):
        assert any(f"test_nondeterministic_model_fails_even_under_none[{policy}]" in line for line in failures), out
    assert "test_exact_with_tags" not in out.split("short test summary")[-1].replace("SKIPPED", ""), out
    assert "needs tensor names" in out and "cannot wrap a single function" in out
    assert " passed" in summary and " failed" in summary and " skipped" in summary, summary
