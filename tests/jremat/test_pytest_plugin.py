"""The pytest11 plugin: a user's test file using only ``remat_exact`` runs with plain pytest after install."""

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]

USER_TESTS = """
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


def test_broken_model_fails(remat_exact):
    def redraws(w, x):  # a fresh random draw on every trace: the recomputation sees other values
        import numpy as np
        return jnp.sum(jnp.tanh(x @ w) * jnp.asarray(np.random.rand(2, 3), jnp.float32))
    if remat_exact.policy == "none":
        pytest.skip("nothing is recomputed")
    remat_exact(redraws, jnp.eye(3) * 0.5, jnp.ones((2, 3)))
"""


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
    # The broken model fails under every policy that recomputes; everything else passes or is skipped
    # with its reason (name-based policies need tags, nested cannot wrap one function).
    assert run.returncode == 1, out
    assert "FAILED test_user.py::test_broken_model_fails[full]" in out and "RematMismatch" in out
    assert "test_exact_with_tags" not in out.split("short test summary")[-1].replace("SKIPPED", ""), out
    assert "needs tensor names" in out and "cannot wrap a single function" in out
    assert " passed" in summary and " failed" in summary and " skipped" in summary, summary
