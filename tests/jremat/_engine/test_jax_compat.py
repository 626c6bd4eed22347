"""jremat's only contact with JAX's private modules: every symbol it needs is present."""

import os
import pathlib

import pytest

from jremat._engine import jax_compat as _jax_compat

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("module", "name"), sorted(_jax_compat.PRIVATE_SYMBOLS), ids=lambda v: v.replace("jax._src.", "")
)
def test_private_symbol_present(module, name):
    """Fails with MissingJaxInternal (symbol, purpose, JAX version) when a JAX release drops it."""
    assert _jax_compat.private(module, name) is not None


def test_missing_private_symbol_error_names_symbol_purpose_and_version(monkeypatch):
    key = ("jax._src.ad_checkpoint", "no_such_symbol_for_jremat")
    monkeypatch.setitem(_jax_compat.PRIVATE_SYMBOLS, key, "a test of the error message")
    with pytest.raises(
        _jax_compat.MissingJaxInternal,
        match=r"jax\._src\.ad_checkpoint\.no_such_symbol_for_jremat "
        r"for a test of the error message, but JAX \d",
    ):
        _jax_compat.private(*key)
    with pytest.raises(KeyError):  # an unlisted private symbol cannot be loaded
        _jax_compat.private("jax._src.core", "Tracer")


def test_jax_src_imported_only_by_the_compat_module():
    offenders = []
    for folder in ("jremat", "policies", "train", "models", "tests"):
        for dirpath, _, files in os.walk(ROOT / folder):
            for file in files:
                path = pathlib.Path(dirpath) / file
                exempt = path == ROOT / "jremat" / "_engine" / "jax_compat.py" or path.name == "test_jax_compat.py"
                if file.endswith(".py") and not exempt and "jax._src" in path.read_text():
                    offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"jax._src used outside jremat/_engine/jax_compat.py: {offenders}"


def test_remat3_primitives_build():
    """jremat's remat3 tag and offload are built on JAX's hijax interface; a JAX that changes it fails here."""
    import jax
    import jax.numpy as jnp

    x = jnp.arange(3.0)
    assert jnp.array_equal(_jax_compat.remat3_name_tag(x, "n"), x)
    assert jnp.array_equal(_jax_compat.remat3_offload(x, jax.memory.Space.Device, jax.memory.Space.Host), x)
    assert _jax_compat.classic_name_primitive().name == "name"


def test_scan_counts_split_constants_and_carry():
    import jax
    import jax.numpy as jnp

    def loop(w, c, xs):
        return jax.lax.scan(lambda c, x: ((c[0] * w + x, c[1] - x), jnp.sin(c[0])), c, xs)

    jaxpr = jax.make_jaxpr(loop)(2.0, (1.0, 3.0), jnp.ones(4))
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert _jax_compat.scan_counts(scan) == (1, 2)


def test_scan_without_either_form_is_named():
    class Eqn:
        params = {"length": 3}

    with pytest.raises(_jax_compat.MissingJaxInternal, match="neither num_consts/num_carry nor ft_in"):
        _jax_compat.scan_counts(Eqn())
