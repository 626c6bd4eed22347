"""``jremat.checkpoint`` as a drop-in for ``jax.checkpoint``, under both remat engines.

Each test runs the same code with ``jax.checkpoint`` and ``jremat.checkpoint`` in its place and
compares what code can see: values, gradients under every composition of transforms, the errors
raised, how often the function is traced, the remat equations and inner ``jit``\\ s kept.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jremat
from jremat._engine import jaxpr as _jaxpr
from tests.conftest import saved_residuals

X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
W = jnp.linspace(0.5, -0.5, 16).reshape(4, 4)


def block(w, x):
    h = checkpoint_name(jnp.tanh(x @ w), "hidden")
    return jnp.sin(h @ w.T) * 2.0


def untagged_block(w, x):
    """``block`` without its name tag: JAX's own remat3 name tag cannot ``vmap`` (jremat's can)."""
    return jnp.sin(jnp.tanh(x @ w) @ w.T) * 2.0


def both(fn, **options):
    """``fn`` under ``jax.checkpoint`` and under ``jremat.checkpoint`` with the same options."""
    policy = options.pop("policy", None)
    return jax.checkpoint(fn, policy=policy, **options), jremat.checkpoint(fn, policy, **options)


def assert_same(a, b, rtol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)


POLICIES = {
    "none (= full)": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "save_only_these_names": jax.checkpoint_policies.save_only_these_names("hidden"),
    "a user callable": lambda prim, *avals, **params: prim.name == "tanh",
}


#: Values each of :data:`POLICIES` keeps besides the arguments ``w`` and ``x``: both dots, the
#: named ``hidden``, the ``tanh``.
KEPT_BEYOND_THE_ARGUMENTS = dict(zip(POLICIES.values(), (0, 2, 0, 1, 1)))


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_jax_policies_and_callables_are_taken_as_jax_takes_them(request, remat_engine, policy):
    if remat_engine == "remat3" and policy is POLICIES["a user callable"]:
        # Found when the residuals below were first compared: jax.checkpoint under remat3 keeps
        # nothing for this callable (only the arguments), jremat keeps the tanh. Strict: the
        # day they agree, this fails and the mark goes.
        request.applymarker(
            pytest.mark.xfail(strict=True, reason="remat3: jax.checkpoint keeps no tanh for the callable, jremat does")
        )
    ref, got = both(block, policy=policy)
    loss = lambda f: lambda w, x: jnp.sum(f(w, x) ** 2)
    assert_same(got(W, X), ref(W, X))
    assert_same(jax.grad(loss(got), argnums=(0, 1))(W, X), jax.grad(loss(ref), argnums=(0, 1))(W, X))
    # What the policy changes: the values kept for the backward pass, each named as JAX names it.
    # Each by its shape and the source line and column that computes it (the arguments by shape
    # only): under remat3, jremat's wrapper names the arguments args[0], args[1], and a value a
    # callable keeps is kept through jremat's own name tag ('jremat0/1').
    kept = lambda f: sorted(
        (aval.str_short(), " ".join(re.findall(r"\S+\.py:\d+:\d+", where)) or "an argument")
        for aval, where in saved_residuals(f, W, X)
    )
    assert kept(got) == kept(ref)
    assert len(kept(ref)) == 2 + KEPT_BEYOND_THE_ARGUMENTS[policy]  # each policy's own choice, not full's


def test_policy_none_is_full_and_bad_policies_are_clear():
    assert jremat.checkpoint(block).__wrapped__ is block
    with pytest.raises(ValueError, match="policy must be a spec string.*JAX policy callable.*None"):
        jremat.checkpoint(block, 3)
    with pytest.raises(ValueError, match="keys belong to spec strings"):
        jremat.checkpoint(block, jax.checkpoint_policies.dots_saveable, k=2)


TRANSFORMS = {
    "grad": lambda f: jax.grad(lambda w: jnp.sum(f(w, X))),
    "jit(grad)": lambda f: jax.jit(jax.grad(lambda w: jnp.sum(f(w, X)))),
    "grad(jit)": lambda f: jax.grad(lambda w: jnp.sum(jax.jit(f)(w, X))),
    "vmap(grad)": lambda f: jax.vmap(jax.grad(lambda w, x: jnp.sum(f(w, x))), in_axes=(None, 0)),
    "grad(vmap)": lambda f: jax.grad(lambda w, xs: jnp.sum(jax.vmap(f, in_axes=(None, 0))(w, xs))),
    "jit(vmap(grad))": lambda f: jax.jit(jax.vmap(jax.grad(lambda w, x: jnp.sum(f(w, x))), in_axes=(None, 0))),
    "grad(grad)": lambda f: jax.grad(lambda w: jnp.sum(jax.grad(lambda v: jnp.sum(f(v, X) ** 2))(w))),
    "linearize": lambda f: lambda w: jax.linearize(lambda v: f(v, X), w)[1](jnp.ones_like(w)),
}
BATCHED = {"vmap(grad)", "grad(vmap)", "jit(vmap(grad))"}


@pytest.mark.parametrize("spec", [None, "dots", "every_k:k=2"])
@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
@pytest.mark.heavy
def test_gradients_under_every_composition_of_transforms(remat_engine, spec, transform):
    name = next(k for k, v in TRANSFORMS.items() if v is transform)
    args = (W, jnp.stack([X, 2 * X])) if name in BATCHED else (W,)
    expected = transform(untagged_block)(*args)
    assert_same(transform(jremat.checkpoint(block, spec))(*args), expected, rtol=1e-5)


def test_a_branch_on_a_traced_scalar_raises_as_in_jax(remat_engine):
    branchy = lambda x, flag: x if flag else -x
    for checkpointed in both(branchy):
        with pytest.raises(jax.errors.TracerBoolConversionError):
            checkpointed(X, True)
    for checkpointed in both(branchy, static_argnums=1):
        assert_same(checkpointed(X, False), -X)


def test_a_string_argument_is_a_type_error_as_in_jax():
    for checkpointed in both(lambda x, activation: getattr(jnp, activation)(x)):
        with pytest.raises(TypeError, match="not a valid JAX type"):
            checkpointed(X, "tanh")


def _counted(fn):
    calls = []

    def counted(*args):
        calls.append(1)
        return fn(*args)

    return counted, calls


@pytest.mark.parametrize("spec", [None, "dots", "every_k:k=2", "names:save=hidden", "names_except:exclude=hidden"])
def test_repeated_calls_trace_once(remat_engine, spec):
    """Five eager calls and a jitted gradient called twice: one trace, as ``jax.checkpoint``
    (whose cache is keyed on avals, so the jit's tracers reuse the eager trace)."""
    counts = []
    for make in (jax.checkpoint, lambda f: jremat.checkpoint(f, spec)):
        counted, calls = _counted(block)
        checkpointed = make(counted)
        for _ in range(5):
            checkpointed(W, X)
        grad = jax.jit(jax.grad(lambda w, f=checkpointed: jnp.sum(f(w, X))))
        grad(W), grad(W)
        counts.append(len(calls))
    assert counts == [1, 1]


def test_static_arguments_retrace_only_on_a_new_value(remat_engine):
    def scaled(x, n):
        calls.append(n)
        return jnp.sin(x) * n

    calls: list = []
    checkpointed = jremat.checkpoint(scaled, "full", static_argnums=(1,))
    for n in (2, 2, 3, 2):
        assert_same(checkpointed(X, n), jnp.sin(X) * n)
    assert calls == [2, 3]
    unhashable = jremat.checkpoint(lambda x, table: x * table["scale"], static_argnums=1)
    assert_same(unhashable(X, {"scale": 2.0}), X * 2.0)


def test_static_argnames_close_over_keyword_arguments(remat_engine):
    calls: list = []

    def scaled(x, *, activation, n):
        calls.append((activation, n))
        return getattr(jnp, activation)(x) * n

    checkpointed = jremat.checkpoint(scaled, "every_k:k=2", static_argnames=("activation",))
    for n in (2.0, 3.0):  # n is traced: one trace for both values
        assert_same(checkpointed(X, activation="tanh", n=n), jnp.tanh(X) * n)
    assert_same(jax.grad(lambda x: jnp.sum(checkpointed(x, activation="sin", n=1.0)))(X), jnp.cos(X))
    assert [a for a, _ in calls] == ["tanh", "sin"]


def test_static_argnums_errors_are_jaxs(classic_engine):
    for checkpointed in both(block, static_argnums=(5,)):
        with pytest.raises(ValueError, match="can only take integer values greater than or equal to `-len"):
            checkpointed(W, X)
    with pytest.raises(TypeError, match="must be an int, tuple of ints"):
        jremat.checkpoint(block, static_argnums="1")


PREVENT_CSE = {
    "bool": False,
    "flat tuple": (False, True),
    "nested": ({"a": False, "b": True}, True),
    "list": [True, False],
}


@pytest.mark.parametrize("prevent_cse", PREVENT_CSE.values(), ids=PREVENT_CSE.keys())
def test_prevent_cse_as_a_bool_or_a_pytree_prefix(remat_engine, prevent_cse):
    def fsdp_block(weights, x):
        return jnp.tanh(x @ weights["a"]) @ weights["b"]

    weights = {"a": W, "b": W.T}
    ref, got = both(fsdp_block, prevent_cse=prevent_cse)
    loss = lambda f: lambda w: jnp.sum(f(w, X) ** 2)
    assert_same(jax.grad(loss(got))(weights), jax.grad(loss(ref))(weights))
    assert_same(jax.jit(jax.grad(loss(got)))(weights), jax.grad(loss(ref))(weights))


def test_prevent_cse_per_argument_reaches_the_remat_equation(classic_engine):
    got = jremat.checkpoint(lambda a, b: jnp.sin(a) * b, prevent_cse=(False, True))
    jaxpr = jax.make_jaxpr(got)(X, X)
    remat = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name in _jaxpr.CLASSIC_CHECKPOINT_PRIMITIVES]
    assert [e.params["prevent_cse"] for e in remat] == [(False, True)]


def test_prevent_cse_errors():
    with pytest.raises(TypeError, match="prevent_cse must be a bool or tuple of bools"):
        jremat.checkpoint(block, prevent_cse="yes")
    with pytest.raises(ValueError, match="prevent_cse=.*not a prefix of the arguments"):
        jremat.checkpoint(block, prevent_cse=(True, True, True))(W, X)


def test_a_python_scalar_cotangent(remat_engine):
    for spec in (None, "every_k:k=2"):
        f = lambda x, spec=spec: jnp.sum(jremat.checkpoint(jnp.sin, spec)(x))
        out, pullback = jax.vjp(f, X)
        assert_same(pullback(1.0), jax.vjp(lambda x: jnp.sum(jnp.sin(x)), X)[1](1.0))


def _all_eqns(jaxpr):
    return _jaxpr.equations(jaxpr)


def test_the_jaxpr_holds_one_remat_equation_and_the_inner_jit(classic_engine):
    """Classic engine: the same one ``remat2`` equation with the inner ``jit`` inside; jremat's
    tie adds the ``custom_vjp_call`` around it (docs/policies.md)."""
    inner = jax.jit(lambda x: jnp.sin(x) * 2.0)
    fn = lambda x: jnp.cos(inner(x))
    for checkpointed in both(fn):
        eqns = list(_all_eqns(jax.make_jaxpr(checkpointed)(X).jaxpr))
        remat = [e for e in eqns if e.primitive.name in _jaxpr.CLASSIC_CHECKPOINT_PRIMITIVES]
        assert len(remat) == 1
        assert "jit" in {e.primitive.name for e in _all_eqns(remat[0].params["jaxpr"])}


def _lowered_names(fn):
    text = jax.jit(jax.grad(lambda x: jnp.sum(fn(x)))).lower(X).as_text(debug_info=True)
    functions = set(re.findall(r'func\.func (?:private|public) @("[^"]+"|\w+)', text))
    scopes = [name.count("rematted_computation") for name in re.findall(r'loc\("([^"]*sin[^"]*)"', text)]
    return functions, max(scopes)


def test_inner_jit_and_one_remat_scope_survive_lowering(remat_engine):
    inner = jax.jit(lambda x: jnp.sin(x) * 2.0)
    fn = lambda x: jnp.cos(inner(x))
    ref, got = both(fn)
    ref_functions, ref_scopes = _lowered_names(ref)
    got_functions, got_scopes = _lowered_names(got)
    assert len(ref_functions) > 1 and got_functions == ref_functions  # the inner jit is a function of its own
    assert got_scopes == ref_scopes == 1
