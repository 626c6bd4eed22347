"""Equinox models under jremat: ``jremat.filter_checkpoint`` and ``@jremat.policy`` on an ``eqx.Module``.

The blocks are written as Equinox's own examples write them: ``eqx.nn.Linear``,
``eqx.nn.LayerNorm`` and ``eqx.nn.Dropout(p=...)``, called with
``key=`` and ``inference=``; the stack either unrolled (a Python loop over a list of blocks) or
scanned (blocks stacked by ``eqx.filter_vmap`` of the constructor, ``eqx.partition`` /
``eqx.combine`` inside ``jax.lax.scan``). Gradients are compared with the stack without remat,
under both remat engines.
"""

from __future__ import annotations

import functools
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from tests.jremat.test_testing import FreshKeyOnRecompute

DIM, SEQ, LAYERS = 8, 4, 2
POLICIES = ["none", "full", "dots", "every_k:k=2", "skip_cheap"]
LAYOUTS = ["unrolled", "scanned"]


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, dim, dropout_rate, *, key):
        fc1_key, fc2_key = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(dim)
        self.fc1 = eqx.nn.Linear(dim, 4 * dim, key=fc1_key)
        self.fc2 = eqx.nn.Linear(4 * dim, dim, key=fc2_key)
        self.dropout = eqx.nn.Dropout(p=dropout_rate)

    def __call__(self, x, *, key=None, inference=False):
        h = jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.norm)(x)))
        return x + self.dropout(jax.vmap(self.fc2)(h), key=key, inference=inference)


def make_model(layout: str):
    keys = jax.random.split(jax.random.key(0), LAYERS)
    if layout == "unrolled":
        return [Block(DIM, 0.3, key=k) for k in keys]
    return eqx.filter_vmap(lambda k: Block(DIM, 0.3, key=k))(keys)


def run(layout: str, call, model, x, key, inference: bool):
    """The stack's output: ``call(block, x, key=..., inference=...)`` per layer."""
    keys = jax.random.split(key, LAYERS)
    if layout == "unrolled":
        for block, layer_key in zip(model, keys):
            x = call(block, x, key=None if inference else layer_key, inference=inference)
        return x
    params, static = eqx.partition(model, eqx.is_array)

    def step(x, layer):
        layer_params, layer_key = layer
        block = eqx.combine(layer_params, static)
        return call(block, x, key=None if inference else layer_key, inference=inference), None

    return jax.lax.scan(step, x, (params, keys))[0]


def gradients(layout: str, call, inference: bool) -> list:
    """The loss's gradients with respect to the model and the input (their arrays)."""
    x = jnp.linspace(-1.0, 1.0, SEQ * DIM, dtype=jnp.float32).reshape(SEQ, DIM)

    def loss(model_and_x):
        model, x = model_and_x
        return jnp.sum(run(layout, call, model, x, jax.random.key(1), inference) ** 2)

    return jax.tree.leaves(eqx.filter(eqx.filter_grad(loss)((make_model(layout), x)), eqx.is_array))


@functools.cache
def no_remat_gradients(layout: str, inference: bool) -> list:
    return gradients(layout, Block.__call__, inference)


def assert_close(got: list, expected: list):
    """Equal up to float rounding: a policy that saves other values rounds differently (a few ulps)."""
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def checkpointed(layout: str, spec):
    # Inside a scan of more than one step the tie is not needed (prevent_cse=False, as jax.checkpoint).
    return jremat.filter_checkpoint(Block.__call__, spec, prevent_cse=layout == "unrolled")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.heavy
def test_unrolled_gradients_equal_no_remat(remat_engine, policy):
    for inference in (False, True):  # dropout on, then off
        got = gradients("unrolled", checkpointed("unrolled", policy), inference)
        assert_close(got, no_remat_gradients("unrolled", inference))


# Each scanned case compiles its scan: one dropout setting per policy keeps the file fast (and
# `none`, which returns the block itself, is the unrolled test's).
SCANNED = [("full", False), ("dots", True), ("every_k:k=2", False), ("skip_cheap", False)]


@pytest.mark.parametrize(("policy", "inference"), SCANNED)
@pytest.mark.heavy
def test_scanned_gradients_equal_no_remat(remat_engine, policy, inference):
    got = gradients("scanned", checkpointed("scanned", policy), inference)
    assert_close(got, no_remat_gradients("scanned", inference))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.heavy
def test_a_fresh_dropout_key_on_recompute_is_caught(layout):
    broken = gradients(layout, checkpointed(layout, FreshKeyOnRecompute()), inference=False)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_close(broken, no_remat_gradients(layout, False))


def test_the_broken_remat_is_exact_without_dropout():
    """The control of the test above: its mismatch is the dropout key's, not the broken policy's otherwise."""
    assert_close(
        gradients("unrolled", checkpointed("unrolled", FreshKeyOnRecompute()), True),
        no_remat_gradients("unrolled", True),
    )


def test_the_unfiltered_form_traces_module_fields_as_jax_checkpoint_does(remat_engine):
    """``jremat.checkpoint`` keeps ``jax.checkpoint``'s semantics: the module's bool and float
    fields and ``inference=`` are traced, so Dropout's branch on them is JAX's error; the note
    names the traced leaves and the filtered form."""
    block, x = make_model("unrolled")[0], jnp.ones((SEQ, DIM))
    for call in (jax.checkpoint(Block.__call__), jremat.checkpoint(Block.__call__, "full")):
        with pytest.raises(jax.errors.TracerBoolConversionError) as caught:
            call(block, x, key=jax.random.key(1), inference=False)
    if sys.version_info >= (3, 11):
        note = "\n".join(caught.value.__notes__)
        assert "args[0].dropout.p" in note and "kwargs['inference']" in note
        assert "jremat.filter_checkpoint(fn, policy)" in note


def test_a_traced_array_branch_gets_no_note():
    """The note is for Python scalars that were traced; an error with none among the arguments is JAX's alone."""
    with pytest.raises(jax.errors.TracerBoolConversionError) as caught:
        jremat.checkpoint(lambda x: x if x > 0 else -x, "full")(jnp.float32(1.0))
    assert not any("filter_checkpoint" in note for note in getattr(caught.value, "__notes__", []))


def test_static_leaves_trace_again_when_they_change():
    """One checkpointed function called with inference=False, then True, then False: each result is
    its own (the trace cache keys on the static values, by type and value)."""
    call = jremat.filter_checkpoint(Block.__call__, "full")
    block, x, key = make_model("unrolled")[0], jnp.ones((SEQ, DIM)), jax.random.key(1)
    for inference in (False, True, False):
        np.testing.assert_array_equal(
            call(block, x, key=key, inference=inference), block(x, key=key, inference=inference)
        )
    as_array = jremat.filter_checkpoint(lambda x, scale: (x, jnp.asarray(scale)), "full")
    assert as_array(jnp.ones(2), 1)[1].dtype == jnp.int32
    assert as_array(jnp.ones(2), 1.0)[1].dtype == jnp.float32  # 1.0 == 1, yet another program


def test_a_checkpointed_module_is_a_pytree_over_its_arrays():
    """``filter_checkpoint(block, ...)`` wraps the module itself: stored in a model, ``eqx.filter_grad``
    sees its arrays, and its gradients equal the undecorated module's."""
    block, x = make_model("unrolled")[0], jnp.linspace(0.0, 1.0, SEQ * DIM).reshape(SEQ, DIM)
    wrapped = jremat.filter_checkpoint(block, "every_k:k=2")
    assert len(eqx.filter(jax.tree.leaves(wrapped), eqx.is_array)) == len(
        eqx.filter(jax.tree.leaves(block), eqx.is_array)
    )
    loss = lambda m: jnp.sum(m(x, inference=True) ** 2)
    got = eqx.filter_jit(eqx.filter_grad(loss))(wrapped)
    assert_close(
        jax.tree.leaves(eqx.filter(got.fn, eqx.is_array)),
        jax.tree.leaves(eqx.filter(eqx.filter_jit(eqx.filter_grad(loss))(block), eqx.is_array)),
    )


def test_the_decorator_on_an_equinox_class_takes_the_filtered_path():
    """``@jremat.policy`` on an ``eqx.Module`` class: its ``__call__`` runs rematerialized with the
    module's non-array fields static, and the parameters and gradients are the undecorated class's."""
    decorated = jremat.policy("every_k:k=2")(Block)
    assert issubclass(decorated, Block) and decorated.__name__ == "Block"
    block, plain = decorated(DIM, 0.3, key=jax.random.key(0)), Block(DIM, 0.3, key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, SEQ * DIM).reshape(SEQ, DIM)
    loss = lambda m: jnp.sum(m(x, key=jax.random.key(1), inference=False) ** 2)
    got = eqx.filter_jit(eqx.filter_grad(loss))(block)

    def lowered(module) -> str:
        params, static = eqx.partition(module, eqx.is_array)
        grad = jax.grad(lambda p: loss(eqx.combine(p, static)))
        return jax.jit(grad).lower(params).as_text(debug_info=True)

    assert "rematted_computation" in lowered(block) and "rematted_computation" not in lowered(plain)
    assert_close(
        jax.tree.leaves(eqx.filter(got, eqx.is_array)),
        jax.tree.leaves(eqx.filter(eqx.filter_jit(eqx.filter_grad(loss))(plain), eqx.is_array)),
    )
    with pytest.raises(ValueError, match="has no method 'forward'"):
        jremat.policy("full", methods=("forward",))(Block)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="needs a callable"):
        jremat.filter_checkpoint(3, "full")
    with pytest.raises(TypeError, match="prevent_cse as a bool"):
        jremat.filter_checkpoint(Block.__call__, "full", prevent_cse=(True,))
    with pytest.raises(ValueError, match="unknown policy"):
        jremat.filter_checkpoint(Block.__call__, "no_such_policy")


def scale_and_kind(x):
    """A block returning arrays next to non-array values: a Python int, a string, a function."""
    return {"y": jnp.sin(x) * 2, "kind": "mlp", "act": jax.nn.relu, "width": 3}


@pytest.mark.parametrize("spec", ["full", "every_k:k=2"])
def test_non_array_outputs_are_returned_unchanged(remat_engine, spec):
    """As ``eqx.filter_checkpoint``: only array outputs leave the checkpoint; a Python int, a string
    and a function come back as they were returned, on the first call, a cached trace's call, and
    under ``jit`` and ``grad``; ``jremat.checkpoint`` keeps ``jax.checkpoint``'s outputs."""
    x = jnp.linspace(-1.0, 1.0, 4)
    pair = lambda x: (x * 2, 3)
    expected = eqx.filter_checkpoint(pair)(x)
    checkpointed = jremat.filter_checkpoint(pair, spec)
    for _ in range(2):  # the second call reuses the first one's trace
        got = checkpointed(x)
        assert type(got[1]) is int and got[1] == expected[1] == 3
        np.testing.assert_array_equal(got[0], expected[0])
    block = jremat.filter_checkpoint(scale_and_kind, spec)
    for _ in range(2):
        out = block(x)
        assert (out["kind"], out["act"], out["width"]) == ("mlp", jax.nn.relu, 3) and type(out["width"]) is int
        np.testing.assert_allclose(out["y"], jnp.sin(x) * 2, rtol=1e-6)

    def loss(x):
        out = block(x)
        assert out["act"] is jax.nn.relu and out["kind"] == "mlp"  # static inside jit's trace too
        return jnp.sum(out["act"](out["y"]) ** 2) * out["width"]

    plain_loss = lambda x: jnp.sum(jax.nn.relu(jnp.sin(x) * 2) ** 2) * 3
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), jax.grad(plain_loss)(x), rtol=1e-6)
    # jremat.checkpoint traces the output as jax.checkpoint does: the int comes back a JAX value.
    traced_int = jax.checkpoint(pair)(x)[1]
    assert type(traced_int) is not int and type(jremat.checkpoint(pair, spec)(x)[1]) is type(traced_int)
