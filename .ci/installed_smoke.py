"""Smoke test of an installed jremat wheel, run by .ci/package from a folder of decoy modules.

``python smoke.py core``: the core install (JAX and NumPy only): every built-in policy on a small
model with tagged tensors, gradients equal to ``jax.grad`` without remat, ``memory_report`` and
``explain``; no training dependency installed or imported, no decoy imported.
``python smoke.py train``: with the ``[train]`` extra: the reference model and the CLIs import by
their ``jremat.`` names.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

TRAIN_EXTRA = ("flax", "optax", "orbax", "matplotlib", "pooch", "tqdm")
DECOYS = ("policies", "models", "train")


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
