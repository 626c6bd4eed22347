"""``@jremat.policy`` on functions, NNX and Linen modules, and ``@jremat.custom_policy``."""

import re
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jremat
from jremat import registry
from tests.conftest import saved_residuals

#: Names jremat._engine.lowering gives the values a callback keeps under jax_remat3 (equation index in group 1).
CALLBACK_TAG_RE = re.compile(r"^named 'jremat\d+/(\d+)'")


def max_abs_diff(a, b):
    """max |a - b| over all leaves, relative to max |b| (float noise of jit vs eager is ~1e-7)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return diff / max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))


def chain(w, x, deterministic=False):
    for _ in range(4):
        x = jnp.sin(x @ w)
    return jnp.sum(x) if deterministic else jnp.sum(x * 2.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jremat.policy("every_k", k=2, static_argnums=2),
        lambda: jremat.policy("every_k:k=2", static_argnums=(2,)),
        lambda: jremat.policy(jremat.resolve("full"), static_argnums=[2]),
    ],
)
def test_plain_function(make):
    w, x = jnp.eye(3) * 0.5, jnp.ones((2, 3))
    decorated = make()(chain)
    assert decorated.__name__ == "chain"
    for det in (True, False):  # a Python bool argument, static as in jax.checkpoint
        assert max_abs_diff(jax.grad(decorated)(w, x, det), jax.grad(chain)(w, x, det)) <= 1e-6
    kept = saved_residuals(lambda w: decorated(w, x, False), w)
    assert len(kept) < len(saved_residuals(lambda w: chain(w, x), w))


def test_bad_spec_fails_at_decoration():
    with pytest.raises(ValueError, match="k must be >= 1"):
        jremat.policy("every_k:k=0")


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(4, 16, rngs=rngs)
        self.fc2 = nnx.Linear(16, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, deterministic=False):
        h = checkpoint_name(jnp.tanh(self.fc1(x)), "hidden")
        return x + self.fc2(self.drop(h, deterministic=deterministic))


class NnxBlockMethod(NnxBlock):
    @jremat.policy("every_k:k=3")
    def __call__(self, x, deterministic=False):
        return x + self.fc2(self.drop(jnp.tanh(self.fc1(x)), deterministic=deterministic))


def nnx_grads(cls):
    model = cls(nnx.Rngs(0, dropout=1))
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)

    def loss(m):
        return jnp.sum(m(m(x)) ** 2)  # two calls: the dropout stream advances in between

    grads = nnx.grad(loss)(model)
    return grads, model


@pytest.mark.parametrize("spec", ["full", "every_k:k=2", "names_except:exclude=hidden"])
def test_nnx_module_class(spec):
    ref_grads, ref_model = nnx_grads(NnxBlock)
    grads, model = nnx_grads(jremat.policy(spec)(NnxBlock))
    assert max_abs_diff(nnx.state(grads, nnx.Param), nnx.state(ref_grads, nnx.Param)) <= 1e-6
    # The RNG stream's counter was written back, as without remat.
    count = lambda m: [int(a) for a in jax.tree.leaves(nnx.state(m, nnx.RngCount))]
    assert count(model) == count(ref_model) == [2]


@pytest.mark.heavy
def test_nnx_method():
    ref_grads, _ = nnx_grads(NnxBlock)
    grads, _ = nnx_grads(NnxBlockMethod)
    assert max_abs_diff(nnx.state(grads, nnx.Param), nnx.state(ref_grads, nnx.Param)) <= 1e-6


class LinenBlock(nn.Module):
    """An existing user block: dropout via make_rng, a static `deterministic` argument."""

    features: int = 16

    @nn.compact
    def __call__(self, x, deterministic: bool):
        h = checkpoint_name(jnp.tanh(nn.Dense(self.features)(x)), "hidden")
        h = nn.Dropout(0.5)(h, deterministic=deterministic)
        return x + nn.Dense(x.shape[-1])(h)


class LinenModel(nn.Module):
    block: type

    @nn.compact
    def __call__(self, x, deterministic=False):
        for _ in range(2):
            x = self.block()(x, deterministic)
        return x


def linen_loss(variables, block, x, deterministic=False):
    out = LinenModel(block).apply(variables, x, deterministic, rngs={"dropout": jax.random.key(7)})
    return jnp.sum(out**2)


@pytest.mark.parametrize("spec", ["full", "every_k:k=2", "skip_cheap", "names:save=hidden"])
@pytest.mark.heavy
def test_linen_module_class_with_dropout(spec):
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    variables = LinenModel(LinenBlock).init({"params": jax.random.key(0)}, x, True)
    decorated = jremat.policy(spec)(LinenBlock)
    assert decorated.__name__ == "LinenBlock"  # same auto-names, so the same parameter tree
    ref = jax.grad(linen_loss)(variables, LinenBlock, x)
    grads = jax.jit(jax.grad(linen_loss), static_argnums=1)(variables, decorated, x)
    assert max_abs_diff(grads, ref) <= 1e-6
    # Dropout was on: deterministic gradients differ, so the comparison above can fail.
    assert max_abs_diff(jax.grad(linen_loss)(variables, LinenBlock, x, True), ref) > 1e-3
    # deterministic=True still works through the decorated class (static argument).
    det = jax.grad(linen_loss)(variables, decorated, x, True)
    assert max_abs_diff(det, jax.grad(linen_loss)(variables, LinenBlock, x, True)) <= 1e-6


def make_method_block(decorate):
    """A Linen block whose ``__call__`` is decorated in the class body (or not)."""

    def call(self, x, deterministic: bool):
        h = nn.Dropout(0.5)(jnp.tanh(nn.Dense(16)(x)), deterministic=deterministic)
        return x + nn.Dense(x.shape[-1])(h)

    method = nn.compact(call)
    # Same class name both ways: Linen derives dropout RNGs from module paths.
    return type("MethodBlock", (nn.Module,), {"__call__": decorate(method) if decorate else method})


def test_linen_decorated_in_class_body():
    plain, decorated = make_method_block(None), make_method_block(jremat.policy("full"))
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    variables = LinenModel(plain).init({"params": jax.random.key(0)}, x, True)
    ref = jax.grad(linen_loss)(variables, plain, x)
    assert max_abs_diff(jax.grad(linen_loss)(variables, decorated, x), ref) <= 1e-6


def test_custom_callback_policy_usable_by_name():
    with registry.scoped():

        @jremat.custom_policy("test_keep_dots_and_sin")
        def keep(prim, *avals, **params):
            """Save matmuls and sines."""
            return prim.name in ("dot_general", "sin")

        assert "test_keep_dots_and_sin" in jremat.available()
        assert "Save matmuls and sines." in jremat.describe()
        w, x = jnp.eye(3) * 0.5, jnp.ones((2, 3))
        decorated = jremat.policy("test_keep_dots_and_sin")(chain)
        assert max_abs_diff(jax.grad(decorated)(w, x), jax.grad(chain)(w, x)) <= 1e-6
        # Under jax_remat3 the kept outputs are saved by name ('jremat<n>/<equation>'): read
        # the equation's primitive back from the traced program, so both engines are held to the
        # same saved set.
        prog = jremat.trace_program(chain, w, x)
        kept = [
            f"output of {prog.ops[int(m.group(1))].primitive}" if (m := CALLBACK_TAG_RE.search(why)) else why
            for _, why in saved_residuals(lambda w: decorated(w, x), w)
        ]
        assert all(
            why.startswith(("from the argument", "from a constant", "output of sin", "output of dot_general"))
            for why in kept
        )
        assert sum(why.startswith("output of sin") for why in kept) == 3  # the sines feeding matmuls
        with pytest.raises(ValueError, match="already registered"):
            jremat.custom_policy("test_keep_dots_and_sin")(keep)
    assert "test_keep_dots_and_sin" not in jremat.available()


def test_custom_plan_policy_and_policy_module(tmp_path, monkeypatch):
    (tmp_path / "my_test_policies.py").write_text(
        textwrap.dedent('''
        import jremat

        @jremat.custom_policy("test_first_op_only", kind="plan")
        def first_op(program):
            """Save compute op 0 only."""
            return jremat.Plan(save=frozenset({program.compute_ops[0].index}))
    ''')
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with registry.scoped():
        try:
            jremat.load_module("my_test_policies")  # what --policy-module does
            from jremat.models import preset
            from tests.conftest import loss_and_grads, max_relative_error

            cfg = preset("tiny", attn_dropout=0.5, resid_dropout=0.5)
            _, ref = loss_and_grads(cfg.replace(remat_policy="none", remat_granularity="none"))
            _, grads = loss_and_grads(cfg.replace(remat_policy="test_first_op_only"))
            assert max_relative_error(grads, ref) <= 1e-5
        finally:
            sys.modules.pop("my_test_policies", None)
    assert "test_first_op_only" not in jremat.available()
    with pytest.raises(ValueError, match="cannot import policy module 'no_such_module_xyz'"):
        jremat.load_module("no_such_module_xyz")
    with pytest.raises(ValueError, match="kind must be one of callback, plan"):
        jremat.custom_policy("x", kind="bogus")


@pytest.mark.parametrize("wrap", [jremat.checkpoint, jremat.filter_checkpoint])
@pytest.mark.heavy
def test_the_trace_cache_keeps_no_argument_alive(wrap):
    """A cached trace holds the arguments' structure, not the arrays of the call that traced it:
    an eager input is freed after the call, and a jit's tracers do not leak out of its trace."""
    import gc
    import weakref

    f = wrap(lambda x, w: jnp.sin(x @ w), "full")
    x = jnp.ones((8, 8))
    x_ref = weakref.ref(x)
    f(x, jnp.ones((8, 8)))
    del x
    gc.collect()
    assert x_ref() is None
    with jax.checking_leaks():
        jax.jit(jax.grad(lambda w, x: jnp.sum(f(x, w))))(jnp.ones((4, 4)), jnp.ones((4, 4)))
