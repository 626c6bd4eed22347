"""`@jremat.policy` and `jremat.checkpoint` on users' functions: each promise, one test."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jremat
from jremat import registry
from tests.conftest import saved_residuals, tolerance_jit
from tests.jremat import user_models


def unrolled(block, n=3):
    def f(ws, x):
        for w in ws:
            x = block(w, x)
        return jnp.sum(jnp.sin(x))

    return f


def tanh_block(w, x):
    return jnp.tanh(x @ w) @ w.T + x


WS = [jax.random.normal(jax.random.key(i), (4, 4)) / 2 for i in range(3)]
X = jax.random.normal(jax.random.key(9), (2, 4))


# --- forward-mode differentiation, signed zeros, closures --------------------------------------


@pytest.mark.parametrize("spec", ["full", "every_k:k=2"])
@pytest.mark.heavy
def test_forward_mode_through_tied_remat(spec):
    plain, tied = unrolled(tanh_block), unrolled(jremat.checkpoint(tanh_block, spec))
    t = [jnp.ones_like(w) for w in WS]
    assert jnp.array_equal(
        jax.jvp(lambda x: tied(WS, x), (X,), (X,))[1], jax.jvp(lambda x: plain(WS, x), (X,), (X,))[1]
    )
    assert jnp.allclose(jax.jacfwd(tied, argnums=1)(WS, X), jax.jacfwd(plain, argnums=1)(WS, X), rtol=1e-6)
    assert jnp.allclose(jax.hessian(tied, argnums=1)(WS, X), jax.hessian(plain, argnums=1)(WS, X), rtol=1e-5, atol=1e-6)
    _, lin = jax.linearize(lambda ws: tied(ws, X), WS)
    _, lin_plain = jax.linearize(lambda ws: plain(ws, X), WS)
    assert jnp.allclose(lin(t), lin_plain(t), rtol=1e-6)
    # Reverse mode recomputes; XLA may fuse the recomputed tanh differently (last-bit rounding).
    assert jnp.allclose(jax.jit(jax.grad(tied))(WS, X)[0], jax.jit(jax.grad(plain))(WS, X)[0], rtol=1e-6)


@pytest.mark.heavy
def test_forward_mode_through_an_unrolled_gpt():
    from jremat.models import GPT, cross_entropy_loss, preset

    cfg = preset("tiny", n_layers=2, scan_layers=False, remat_policy="full", max_seq_len=8, remat_head_chunks=2)
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % cfg.vocab_size
    loss = lambda p: cross_entropy_loss(nnx.merge(graphdef, p), tokens, tokens)
    tangent = jax.tree.map(jnp.ones_like, params)
    _, derivative = tolerance_jit(lambda p, t: jax.jvp(loss, (p,), (t,)))(params, tangent)
    grads = tolerance_jit(jax.grad(loss))(params)
    expected = sum(jnp.vdot(g, t) for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(tangent)))
    assert jnp.allclose(derivative, expected, rtol=1e-4), (derivative, expected)


def test_signed_zero_is_kept_bit_for_bit():
    def block(x):
        return jnp.copysign(1.0, x) * jnp.sin(x)  # d/dx depends on the sign of a saved zero

    tied = jremat.checkpoint(block, "full")
    x = jnp.array([-0.0, 0.0, -1.0])
    expected = jax.grad(lambda x: jnp.sum(block(x * 1.0)))(x)
    got = jax.grad(lambda x: jnp.sum(tied(x * 1.0)))(x)
    assert jnp.array_equal(got, expected) and float(got[0]) == -1.0


def test_unrolled_layers_may_close_over_a_differentiated_weight():
    def loss(w):
        layer = jremat.checkpoint(lambda x: jnp.tanh(x @ w) @ w.T, "full")
        return jnp.sum(layer(layer(X)))

    def plain(w):
        return jnp.sum(jnp.tanh(jnp.tanh(X @ w) @ w.T @ w) @ w.T)

    assert jnp.allclose(jax.grad(loss)(WS[0]), jax.grad(plain)(WS[0]), rtol=1e-6)


# --- names_except removes the excluded bytes ---------------------------------------------------


def attention(params, x):
    wq, wk, wv, b = params
    q = checkpoint_name(x @ wq + b[None, :], "q")
    k = checkpoint_name(x @ wk + b[None, :], "k")
    v = checkpoint_name(x @ wv + b[None, :], "v")
    scores = jnp.where(jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool)), q @ k.T / 4.0, -1e9)
    probs = jax.nn.softmax(scores)
    return jnp.sum(jnp.tanh(probs @ v))


def activation_bytes(fn, *args):
    return sum(
        math.prod(a.shape) * a.dtype.itemsize
        for a, why in saved_residuals(fn, *args)
        if not why.startswith("from the argument")
    )


def test_names_except_removes_the_excluded_bytes():
    params = [jax.random.normal(jax.random.key(i), (8, 8)) for i in range(3)] + [jnp.ones(8)]
    x = jax.random.normal(jax.random.key(5), (8, 8))
    none = activation_bytes(attention, params, x)
    qkv = 3 * 8 * 8 * 4
    excluded = activation_bytes(jremat.checkpoint(attention, "names_except:exclude=q+k+v"), params, x)
    assert excluded <= none - qkv, (excluded, none, qkv)


@pytest.mark.heavy
def test_names_except_saves_memory_on_the_gpt_under_scan():
    from jremat.models import preset
    from tests.conftest import train_step_memory

    cfg = preset("tiny", n_layers=2)
    none = train_step_memory(cfg.replace(remat_policy="none"), 4).temp_bytes
    excluded = train_step_memory(cfg.replace(remat_policy="names_except:exclude=q+k+v"), 4).temp_bytes
    assert excluded < none, (excluded, none)


# --- random values are never saved -------------------------------------------------------------


def random_residuals(fn, *args):
    """Saved values that are booleans or unsigned integers of activation size: masks and random bits."""
    return [
        (a, why)
        for a, why in saved_residuals(fn, *args)
        if not why.startswith("from the argument")
        and (a.dtype == jnp.bool_ or jnp.issubdtype(a.dtype, jnp.unsignedinteger))
        and a.size > 2
    ]


RANDOM_SPECS = ["every_k:k=1", "names_except:exclude=hidden", "auto:budget=1"]


@pytest.mark.parametrize("spec", RANDOM_SPECS)
def test_dropout_masks_from_legacy_uint32_keys_are_not_saved(spec):
    key = jax.random.PRNGKey(0)
    params = (jnp.ones((4, 16)) / 4, jnp.ones((16, 4)) / 4)
    fn = jremat.checkpoint(user_models.plain_block, spec)
    assert random_residuals(lambda p, x: fn(p, x, key), params, X) == []
    assert random_residuals(lambda p, x: user_models.plain_block(p, x, key), params, X)  # the test can fail


@pytest.mark.parametrize("spec", RANDOM_SPECS)
def test_dropout_masks_from_linen_make_rng_are_not_saved(spec):
    block = jremat.policy(spec)(user_models.LinenBlock)()
    variables = block.init(jax.random.PRNGKey(0), X, True)

    def apply(params, x):
        return jnp.sum(block.apply({"params": params}, x, False, rngs={"dropout": jax.random.PRNGKey(1)}))

    assert random_residuals(apply, variables["params"], X) == []


@pytest.mark.parametrize("spec", RANDOM_SPECS)
def test_dropout_masks_from_call_time_nnx_rngs_are_not_saved(spec):
    block = jremat.policy(spec)(user_models.NnxCallTimeRngsBlock)(4, nnx.Rngs(0))
    graphdef, state = nnx.split(block)

    def apply(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, rngs=nnx.Rngs(dropout=3)))

    assert random_residuals(apply, state, X) == []


# --- names, static arguments, specs ------------------------------------------------------------


def test_a_users_own_tag_is_accepted_and_a_typo_lists_the_tags_found():
    params = (jnp.ones((4, 16)), jnp.ones((16, 4)))
    key = jax.random.PRNGKey(0)
    saved = saved_residuals(
        lambda p: jnp.sum(jremat.checkpoint(user_models.plain_block, "names:save=hidden")(p, X, key)), params
    )
    assert any("named 'hidden'" in why for _, why in saved)
    for spec in ["names:save=hiden", "names_except:exclude=hiden", "offload:names=hiden"]:
        with pytest.raises(
            ValueError, match=r"'hiden', which the checkpointed function does not tag; tags it has: hidden"
        ):
            jax.grad(lambda p, spec=spec: jnp.sum(jremat.checkpoint(user_models.plain_block, spec)(p, X, key)))(params)


def test_checkpoint_takes_static_arguments_like_the_decorator():
    def block(x, w, repeats, activation):
        for _ in range(repeats):
            x = getattr(jnp, activation)(x @ w)
        return jnp.sum(x)

    expected = jax.grad(block, argnums=1)(X, WS[0], 3, "tanh")
    for fn in (
        jremat.checkpoint(block, "every_k:k=2", static_argnums=(2, 3)),
        jremat.policy("every_k:k=2", static_argnums=(2, 3))(block),
    ):
        assert jnp.allclose(jax.grad(fn, argnums=1)(X, WS[0], 3, "tanh"), expected)


def example_spec(name):
    from tests.jremat._apply.test_user_models import EXAMPLE_SPECS

    return EXAMPLE_SPECS.get(name, "nested:block=2,layer=every_k:k=2;skip_cheap=true")


@pytest.mark.parametrize("name", sorted(registry.entries()))
def test_every_canonical_spec_resolves_to_an_equal_policy(name):
    if registry.entries()[name].stack:  # a layer-stack entry: its canonical spec gives the same config
        spec = registry.normalize_spec(example_spec(name))
        assert registry.normalize_spec(spec) == spec
        assert jremat.RematConfig(policy=spec) == jremat.RematConfig(policy=example_spec(name))
        return
    policy = jremat.resolve(example_spec(name))
    again = jremat.resolve(policy.spec)
    assert again == policy and again.spec == policy.spec and type(again) is type(policy)


def test_budget_numbers_without_a_unit():
    from jremat import parse_budget

    assert parse_budget("1").fraction == 1.0 and parse_budget("1.0").fraction == 1.0
    assert parse_budget("1000000").bytes == 1_000_000 and parse_budget("1.5GB").bytes == 1_500_000_000
    with pytest.raises(ValueError, match="'1.5' is not a whole number of bytes"):
        parse_budget("1.5")
    assert jremat.resolve("auto:budget=64KiB").spec == "auto:budget=64KiB"


def test_train_cli_auto_policy_with_a_budget_key(tmp_path):
    from jremat.train.config import TrainConfig

    cfg = TrainConfig(policy="auto", policy_keys=(("budget", "0.5"),))
    assert jremat.resolve(cfg.policy_spec()).spec == "auto:budget=0.5"


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(k=2.5), "k must be an integer, got '2.5'"),
        (dict(k=True), "k must be an integer, got True"),
        (dict(skip_cheap=5), "skip_cheap must be true or false, got 5"),
        (dict(min_flops_per_byte="x"), "min_flops_per_byte must be a number"),
    ],
)
def test_typed_keys_are_validated_like_strings(keys, message):
    with pytest.raises(ValueError, match=message):
        jremat.resolve("every_k", **keys)


def test_an_empty_name_list_is_rejected():
    with pytest.raises(ValueError, match="save must list at least one name"):
        jremat.resolve("names", save=[])


# --- smaller promises --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["every_k:k=1", "skip_cheap", "names_except:exclude=hidden", "auto"])
def test_debug_print_inside_a_plan_based_policy(spec, capsys):
    def block(x):
        h = checkpoint_name(jnp.sin(x), "hidden")
        jax.debug.print("h0={h}", h=h[0, 0])
        return jnp.sum(jnp.sin(h))

    expected = jax.grad(block)(X)
    got = jax.jit(jax.grad(jremat.checkpoint(block, spec)))(X)
    assert jnp.allclose(got, expected)
    assert "h0=" in capsys.readouterr().out


def test_methods_that_do_not_exist_are_a_value_error():
    with pytest.raises(ValueError, match=r"NnxBlock has no method 'missing'; its methods: __call__"):
        jremat.policy("full", methods=("missing",))(user_models.NnxBlock)


def test_out_of_range_plan_indices_are_rejected():
    with registry.scoped():
        jremat.custom_policy("test_bad_plan", kind="plan")(lambda program: jremat.Plan(save=frozenset({-1, 10**6})))
        with pytest.raises(ValueError, match=r"Plan.save holds \[-1, 1000000\], which are not equation indices"):
            jax.grad(jremat.checkpoint(lambda x: jnp.sum(jnp.sin(x)), "test_bad_plan"))(X)


def test_a_stack_level_policy_fails_at_decoration_time():
    with pytest.raises(ValueError, match="checkpoints a stack of layers") as err:
        jremat.policy("nested")
    # names what exists: RematConfig / run_layers and the CLIs' --policy (there is no --remat-policy)
    assert "jremat.RematConfig / run_layers, or --policy of the train CLIs" in str(err.value)
    assert "--remat-policy" not in str(err.value)
    with pytest.raises(ValueError, match="checkpoints a stack of layers"):
        jremat.checkpoint(jnp.sin, "nested")


def test_static_and_class_methods_can_be_decorated():
    class Layers:
        scale = 2.0

        @jremat.policy("full")
        @staticmethod
        def double_sin(x):
            return jnp.sum(jnp.sin(x) * 2.0)

        @jremat.policy("full")
        @classmethod
        def scaled_sin(cls, x):
            return jnp.sum(jnp.sin(x) * cls.scale)

    expected = jax.grad(lambda x: jnp.sum(jnp.sin(x) * 2.0))(X)
    assert jnp.allclose(jax.grad(Layers.double_sin)(X), expected)
    assert jnp.allclose(jax.grad(Layers().double_sin)(X), expected)
    assert jnp.allclose(jax.grad(Layers.scaled_sin)(X), expected)


def test_linen_setup_style_call_decorated_in_the_class_body():
    class Block(nn.Module):
        def setup(self):
            self.dense = nn.Dense(4)

        @jremat.policy("full")
        def __call__(self, x):
            return jnp.tanh(self.dense(x))

    variables = Block().init(jax.random.PRNGKey(0), X)
    grads = jax.grad(lambda v: jnp.sum(Block().apply(v, X)))(variables)
    assert jax.tree.structure(grads) == jax.tree.structure(variables)
