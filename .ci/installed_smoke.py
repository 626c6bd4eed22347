"""Smoke test of an installed jremat wheel, run by .ci/package from a folder of decoy modules.

``python smoke.py core``: the core install (JAX and NumPy only): every built-in policy on a small
model with tagged tensors, gradients equal to ``jax.grad`` without remat, ``memory_report`` and
``explain``; no training dependency installed or imported, no decoy imported; every console script
and ``python -m jremat.train.X`` (even with ``--help``) prints one ``error:`` line naming the
``[train]`` extra and exits 2, and ``import jremat.models`` raises an ImportError naming it.
``python smoke.py train``: with the ``[train]`` extra: the reference model and the CLIs import by
their ``jremat.`` names.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

TRAIN_EXTRA = ("flax", "optax", "orbax", "matplotlib", "pooch", "tqdm")
DECOYS = ("policies", "models", "train")
CLIS = ("ptb", "memory", "bench", "launch")
INSTALL_TRAIN = 'pip install "jremat[train]"'


def model(params, x):
    """Two tagged attention-and-MLP layers, the names the name-based policies select."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    for w in params:
        q, k, v = (checkpoint_name(x @ w, name) for name in ("q", "k", "v"))
        probs = jax.nn.softmax(q @ k.T / jnp.sqrt(x.shape[-1]), axis=-1)
        context = checkpoint_name(probs @ v, "attn_context")
        x = x + checkpoint_name(jnp.tanh(context), "mlp_in") @ w
    return jnp.sum(x**2)


def check_core() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jremat
    from jremat import testing

    assert jremat.__version__ == importlib.metadata.version("jremat"), jremat.__version__
    params = [jnp.eye(8) * 0.3 + 0.01 * i for i in range(2)]
    x = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
    expected = jax.grad(model)(params, x)
    examples = testing.policy_examples(tags=["q", "k", "v", "attn_context", "mlp_in"])
    assert {e.name for e in examples} == set(jremat.available()), "a registered policy has no example"
    checked = []
    for example in examples:
        if example.skip_reason:
            print(f"  {example.name}: skipped ({example.skip_reason})")
            continue
        remat = jremat.checkpoint(model, example.spec)
        got = jax.grad(remat)(params, x)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-7, err_msg=example.spec)
        testing.assert_remat_exact(model, example.spec, params, x, rtol=1e-5, atol=1e-6)
        checked.append(example.spec)
    assert len(checked) >= 8, checked
    report = jremat.memory_report(jax.grad(jremat.checkpoint(model, "full")), params, x)
    assert report.temp_bytes > 0 and report.peak_bytes > 0, report
    assert "q" in str(jremat.explain(model, "names:save=q", params, x))
    for name in TRAIN_EXTRA:
        assert importlib.util.find_spec(name) is None, f"{name} is installed: the core install must not need it"
    print(f"core: {len(checked)} policies exact ({', '.join(checked)}); temp {report.temp_bytes} B")
    check_core_tools()


def check_core_tools() -> None:
    """Without the [train] extra, each tool says in one line what to install; jremat.models raises saying it."""
    bin_dir = os.path.dirname(sys.executable)
    commands = [[os.path.join(bin_dir, f"jremat-{cli}"), "--help"] for cli in CLIS]
    commands += [[sys.executable, "-m", f"jremat.train.{cli}", "--help"] for cli in CLIS]
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        lines = done.stderr.splitlines()
        ok = done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and INSTALL_TRAIN in lines[0]
        assert ok and not done.stdout, (
            f"{command}: exit {done.returncode}, stdout {done.stdout!r}, stderr:\n{done.stderr}"
        )
    try:
        import jremat.models  # noqa: F401
    except ImportError as err:
        assert INSTALL_TRAIN in str(err), err
    else:
        raise AssertionError("import jremat.models succeeded without the [train] extra")
    print(
        f"core: {len(commands)} tools each print one error line naming {INSTALL_TRAIN} and exit 2; "
        "import jremat.models raises ImportError naming it"
    )


def check_train() -> None:
    import jremat.models
    import jremat.train.memory
    import jremat.train.ptb

    assert jremat.models.preset("tiny").n_layers > 0
    print("train: jremat.models, jremat.train.ptb, jremat.train.memory import")


if __name__ == "__main__":
    {"core": check_core, "train": check_train}[sys.argv[1]]()
    imported = sorted(name for name in DECOYS if name in sys.modules)
    assert not imported, f"imported top-level names a user's file can shadow: {imported}"
    if sys.argv[1] == "core":
        assert "flax" not in sys.modules, "flax was imported"
