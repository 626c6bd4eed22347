"""jremat._engine.lowering: each policy keeps the same values under JAX's classic engine and jax_remat3."""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import Offloadable, checkpoint_name

import jremat
from jremat._engine import active as _active_engine
from jremat._engine import lowering as engine
from tests.conftest import live_runs, saved_residuals


def under(engine_name, fn):
    """``fn()`` with the ``jax_remat3`` flag set for ``engine_name``, the flag restored after."""
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", engine_name == _active_engine.REMAT3)
    try:
        return fn()
    finally:
        jax.config.update("jax_remat3", before)


def chain(w, x):
    for _ in range(3):
        x = jnp.sin(x @ w)
    return jnp.sum(x)


def named(x):
    a = checkpoint_name(jnp.sin(x), "q")
    b = checkpoint_name(jnp.sin(a), "k")
    return jnp.sum(jnp.sin(checkpoint_name(jnp.sin(b), "v")))


def shapes_kept(fn, *args):
    """Sorted ``(shape, dtype, memory space)`` of every residual (descriptions differ by engine)."""
    return sorted(str(aval) for aval, _ in saved_residuals(fn, *args))


def test_active_engine_follows_the_flag(remat_engine):
    assert engine.active_engine() == remat_engine


def test_jit_cache_does_not_leak_between_engines():
    step = jax.jit(jax.grad(engine.lower_checkpoint(jnp.sin)))
    prims = {
        name: under(name, lambda: {e.primitive.name for e in jax.make_jaxpr(step)(1.0).eqns[0].params["jaxpr"].eqns})
        for name in _active_engine.ENGINES
    }
    assert prims[_active_engine.CLASSIC] != prims[_active_engine.REMAT3]
    assert "remat2" not in prims[_active_engine.REMAT3] and "remat2" in prims[_active_engine.CLASSIC] | {"remat2"}


def test_decorated_at_import_follows_the_engine_at_call_time():
    from jremat import ops

    kinds = {
        name: under(name, lambda: [e.primitive.name for e in jax.make_jaxpr(ops.gelu)(jnp.ones(3)).eqns])
        for name in _active_engine.ENGINES
    }
    assert kinds[_active_engine.CLASSIC] == ["remat2"]
    assert kinds[_active_engine.REMAT3] != ["remat2"]


def test_user_callback_decides_under_both_engines(remat_engine):
    """remat3 never calls a callback; jremat asks it per equation and saves what it keeps."""

    def keep_sin(prim, *avals, **params):
        return prim.name == "sin"

    w, x = jnp.eye(3) * 0.5, jnp.ones((2, 3))
    kept = shapes_kept(lambda w: engine.lower_checkpoint(chain, callback=keep_sin)(w, x), w)
    nothing = shapes_kept(lambda w: engine.lower_checkpoint(chain)(w, x), w)
    assert len(kept) == len(nothing) + 2  # the two sines feeding matmuls
    grad = jax.grad(engine.lower_checkpoint(chain, callback=keep_sin))(w, x)
    assert float(jnp.max(jnp.abs(grad - jax.grad(chain)(w, x)))) < 1e-6


@pytest.mark.parametrize(
    "callback",
    [
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.save_only_these_names("k"),
        jax.checkpoint_policies.save_any_names_but_these("k"),
    ],
    ids=["dots", "dots_no_batch", "nothing", "only_k", "all_names_but_k"],
)
def test_jax_policies_keep_the_same_values_under_both_engines(callback):
    w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))

    def fn(w):
        return chain(w, named(x @ w) * x)

    kept = {
        name: under(name, lambda: shapes_kept(engine.lower_checkpoint(fn, callback=callback), w))
        for name in _active_engine.ENGINES
    }
    assert kept[_active_engine.CLASSIC] == kept[_active_engine.REMAT3]
    grads = {
        name: under(name, lambda: jax.grad(engine.lower_checkpoint(fn, callback=callback))(w))
        for name in _active_engine.ENGINES
    }
    assert jnp.array_equal(grads[_active_engine.CLASSIC], grads[_active_engine.REMAT3])


def test_everything_saveable_is_not_a_full_remat_under_remat3():
    """remat3 itself saves nothing but names under everything_saveable; jremat tags every
    equation. The classic engine keeps the linearized values (cos) where remat3 keeps the primal
    ones (sin), so the sets have the same activations, not the same producers."""
    w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))
    callback = jax.checkpoint_policies.everything_saveable

    def activations(name):
        kept = under(name, lambda: shapes_kept(lambda w: engine.lower_checkpoint(chain, callback=callback)(w, x), w))
        return [k for k in kept if k == "float32[2,4]"]

    assert len(activations(_active_engine.REMAT3)) == len(activations(_active_engine.CLASSIC)) >= 3
    native = under(
        _active_engine.REMAT3, lambda: shapes_kept(lambda w: jax.checkpoint(chain, policy=callback)(w, x), w)
    )
    assert len([k for k in native if k == "float32[2,4]"]) < len(activations(_active_engine.REMAT3))


def attention_like(x):
    q, k, v = (checkpoint_name(jnp.sin(x * c), n) for c, n in ((1.0, "q"), (2.0, "k"), (3.0, "v")))
    probs = jnp.exp(jnp.sin(q * k))
    return jnp.sum(jnp.sin(checkpoint_name(probs * v, "attn_context")))


def test_offload_goes_to_host_under_both_engines(remat_engine):
    x = jnp.linspace(0.1, 1.0, 24).reshape(4, 6)
    fn = engine.lower_checkpoint(named, save_names=["v"], offload_names=["q"])
    host = [aval for aval, _ in saved_residuals(fn, x) if "host" in str(aval)]
    assert [a.shape for a in host] == [(4, 6)]
    assert jnp.array_equal(jax.grad(fn)(x), jax.grad(named)(x))


def test_offload_decision_of_a_callback_goes_to_host(remat_engine):
    def offload_sin(prim, *avals, **params):
        return Offloadable("device", "pinned_host") if prim.name == "sin" else False

    x = jnp.linspace(0.1, 1.0, 6)
    fn = engine.lower_checkpoint(lambda x: jnp.sum(jnp.sin(jnp.sin(x))), callback=offload_sin)
    assert [a.shape for a, _ in saved_residuals(fn, x) if "host" in str(a)] == [(6,)]


def test_offload_to_an_unknown_memory_kind_under_remat3_is_an_error():
    fn = engine.lower_checkpoint(named, offload_names=["q"], offload_dst="unpinned_host")
    with pytest.raises(ValueError, match="under jax_remat3.*'unpinned_host'.*valid: device, pinned_host"):
        under(_active_engine.REMAT3, lambda: jax.grad(fn)(jnp.ones(3)))


def test_checkpoint_argument_errors():
    with pytest.raises(ValueError, match="not both"):
        engine.lower_checkpoint(named, save_names=["q"], callback=jax.checkpoint_policies.nothing_saveable)
    with pytest.raises(ValueError, match="both to save and to offload"):
        engine.lower_checkpoint(named, save_names=["q"], offload_names=["q"])


@pytest.mark.parametrize(
    "spec", ["selective", "every_k:k=2", "names_except:exclude=k", "names:save=q+v", "offload:names=q,save=v"]
)
def test_policies_keep_the_same_values_under_both_engines(spec):
    x = jnp.linspace(0.1, 1.0, 24).reshape(4, 6)
    kept = {
        name: under(name, lambda: shapes_kept(jremat.checkpoint(attention_like, spec), x))
        for name in _active_engine.ENGINES
    }
    # names_except keeps the exp's output: remat3 runs the exp again for its derivative and keeps
    # its input too (test_a_saved_exp_output_is_the_one_its_derivative_reads). Otherwise the
    # engines keep the same values.
    classic, remat3 = kept[_active_engine.CLASSIC], kept[_active_engine.REMAT3]
    assert remat3 == sorted(classic + (["float32[4,6]"] if spec == "names_except:exclude=k" else []))
    assert len(kept[_active_engine.CLASSIC]) > 1  # more than the input: the comparison can fail
    grads = {
        name: under(name, lambda: jax.grad(jremat.checkpoint(attention_like, spec))(x))
        for name in _active_engine.ENGINES
    }
    assert jnp.array_equal(grads[_active_engine.CLASSIC], grads[_active_engine.REMAT3])


def test_a_saved_exp_output_is_the_one_its_derivative_reads(remat_engine):
    """A plan that saves an ``exp``'s output (every compute op here): under the classic engine the
    backward pass runs no ``exp`` and keeps no input of one; remat3 differentiates the recomputation
    it records, which runs the ``exp`` again (jremat._engine.interpreter.bind_named)."""
    x = jnp.linspace(0.1, 1.0, 24).reshape(4, 6)
    softmax_like = lambda x: jnp.sum(jnp.exp(x - 0.5) / jnp.sum(jnp.exp(x - 0.5), axis=-1, keepdims=True) * x)
    fn = jremat.checkpoint(softmax_like, "every_k:k=1")
    exps = live_runs(jax.make_jaxpr(jax.grad(fn))(x), ("exp",))
    none_exps = live_runs(jax.make_jaxpr(jax.grad(softmax_like))(x), ("exp",))
    assert exps == none_exps if remat_engine == _active_engine.CLASSIC else exps > none_exps, (exps, none_exps)
    assert jnp.array_equal(jax.grad(fn)(x), jax.grad(softmax_like)(x))


TRANSFORMS = {
    "call": lambda f, xs: f(xs[0]),
    "jit": lambda f, xs: jax.jit(f)(xs[0]),
    "vmap": lambda f, xs: jax.vmap(f)(xs),
    "vmap_of_grad": lambda f, xs: jax.vmap(jax.grad(f))(xs),
    "grad_of_vmap": lambda f, xs: jax.grad(lambda xs: jnp.sum(jax.vmap(f)(xs)))(xs),
    "jacfwd": lambda f, xs: jax.jacfwd(f)(xs[0]),
    "hessian": lambda f, xs: jax.hessian(f)(xs[0, 0]),
    "linearize": lambda f, xs: jax.linearize(f, xs[0])[1](xs[1]),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("spec", ["every_k:k=2", "names:save=q+v", "offload:names=q,save=v"])
@pytest.mark.heavy
def test_jax_transforms_pass_through_under_both_engines(remat_engine, spec, transform):
    """vmap, jacfwd and a call that is not differentiated (a Linen init) work under remat3 too,
    although JAX 0.10.2's own remat3 checkpoint_name has no batching rule and its custom_remat
    cannot run outside differentiation. (The reference runs under the classic engine: the
    undecorated function's own checkpoint_name cannot vmap under remat3.)"""
    xs = jnp.linspace(0.1, 1.0, 48).reshape(2, 4, 6)
    got = TRANSFORMS[transform](jremat.checkpoint(attention_like, spec), xs)
    expected = under(_active_engine.CLASSIC, lambda: TRANSFORMS[transform](attention_like, xs))
    assert jnp.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_jax_remat3_checkpoint_name_alone_cannot_vmap():
    """Why jremat re-emits name tags under remat3: JAX's own fail under vmap (when JAX adds the
    rule, this test fails and jremat's tag can go)."""
    with pytest.raises(NotImplementedError, match="vmap"):
        under(_active_engine.REMAT3, lambda: jax.vmap(attention_like)(jnp.ones((2, 4, 6))))


def test_offload_under_vmap_still_goes_to_host(remat_engine):
    xs = jnp.linspace(0.1, 1.0, 48).reshape(2, 4, 6)
    fn = jremat.checkpoint(attention_like, "offload:names=q,save=v")
    kept = shapes_kept(lambda xs: jnp.sum(jax.vmap(fn)(xs)), xs)
    assert [k for k in kept if "host" in k] == ["float32<host>[2,4,6]"]
    assert len(kept) > 2  # the input, v and more: not a silent full remat


def _primitive_names(jaxpr, found=None) -> set:
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for sub in jax.tree.leaves(list(eqn.params.values()), is_leaf=lambda p: isinstance(p, jax.extend.core.Jaxpr)):
            inner = getattr(sub, "jaxpr", sub)
            if isinstance(inner, jax.extend.core.Jaxpr):
                _primitive_names(inner, found)
    return found


@pytest.mark.parametrize("spec", [None, "dots", "names:save=q", "every_k:k=2"])
@pytest.mark.parametrize("decorated_under", _active_engine.ENGINES)
def test_the_engine_is_chosen_at_each_call_not_when_decorated(spec, decorated_under):
    """A function decorated (and called once) under one engine runs the other engine's
    checkpoint once the flag changes: ``remat2`` appears exactly under the classic engine."""
    checkpointed = under(decorated_under, lambda: jremat.checkpoint(named, spec))
    grad = jax.grad(checkpointed)
    for called_under in (decorated_under, *(e for e in _active_engine.ENGINES if e != decorated_under)):
        found = under(called_under, lambda: _primitive_names(jax.make_jaxpr(grad)(1.0).jaxpr))
        assert ("remat2" in found) == (called_under == _active_engine.CLASSIC), (called_under, sorted(found))


def test_traces_are_kept_per_x64_setting(remat_engine):
    """A trace made with 32-bit types is not reused once ``jax_enable_x64`` is on (nor back)."""
    checkpointed = jremat.checkpoint(lambda x: (jnp.sum(x), jnp.arange(3)), "every_k:k=1")
    x = jnp.ones(2, jnp.float32)
    assert checkpointed(x)[1].dtype == jnp.int32
    with jax.enable_x64(True):
        assert checkpointed(x)[1].dtype == jnp.int64
    assert checkpointed(x)[1].dtype == jnp.int32
