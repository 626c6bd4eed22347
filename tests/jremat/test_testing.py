"""``jremat.testing``: exact-gradient checks for any model, and the policies to parametrize with.

Each deliberately broken remat below must be caught, with the right cause; every built-in policy
must pass on the reference GPT, an unrolled Linen model and an NNX model with call-time Rngs.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import jremat
from jremat import Policy
from jremat.models import GPT, cross_entropy_loss, preset
from jremat.testing import (
    CAUSE_RANDOM,
    CAUSE_STATE,
    CAUSE_VALUE,
    RematMismatch,
    _reference_apply,
    assert_remat_exact,
    policies,
)
from tests.conftest import expect_does_not_apply, single_function_policies

GPT_TAGS = ("q", "k", "mlp_in")


def dropout_chain(w, x, key):
    for site in range(3):
        x = jremat.dropout(jnp.sin(x @ w), 0.5, key, site)
    return jnp.sum(x**2)


def chain_args():
    return jnp.eye(4) * 0.7 + 0.1, jnp.linspace(-1.0, 1.0, 8).reshape(2, 4), jax.random.key(0)


class FreshKeyOnRecompute(Policy):
    """Broken on purpose: the backward pass recomputes with another key than the forward pass."""

    spec = "test_fresh_key"

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        @jax.custom_vjp
        def checkpointed(*args):
            return fn(*args)

        def forward(*args):
            return fn(*args), args

        def backward(args, cotangent):
            fresh = [jax.random.fold_in(a, 1) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a for a in args]
            diff = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact)]

            def recomputed(*d):
                full = list(fresh)
                for i, v in zip(diff, d):
                    full[i] = v
                return fn(*full)

            grads = jax.vjp(recomputed, *[args[i] for i in diff])[1](cotangent)
            out = [None] * len(args)
            for i, g in zip(diff, grads):
                out[i] = g
            return tuple(out)

        checkpointed.defvjp(forward, backward)
        return checkpointed


class Bf16Residuals(Policy):
    """Broken on purpose: every saved float residual is rounded through bfloat16."""

    spec = "test_bf16_residuals"

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        @jax.custom_vjp
        def checkpointed(*args):
            return fn(*args)

        def forward(*args):
            return jax.vjp(fn, *args)

        def backward(vjp_fn, cotangent):
            leaves, treedef = jax.tree.flatten(vjp_fn)
            rounded = [
                r.astype(jnp.bfloat16).astype(r.dtype) if jnp.issubdtype(r.dtype, jnp.floating) else r for r in leaves
            ]
            return jax.tree.unflatten(treedef, rounded)(cotangent)

        checkpointed.defvjp(forward, backward)
        return checkpointed


def forgetful_decorate(fn, policy):
    """Broken on purpose: a hand-written jax.checkpoint of a pure function of the module's state,
    which drops the updated state (the policy is ignored)."""

    def call(module, *args, **kwargs):
        graphdef, state = nnx.split(module)

        def pure(state, *a):
            return fn(nnx.merge(graphdef, state), *a, **kwargs)

        return jax.checkpoint(pure)(state, *args)

    return call


class StoredRngNet(nnx.Module):
    """Dropout with an RNG stream stored in the module (its counter advances per call)."""

    def __init__(self, rngs):
        self.fc1 = nnx.Linear(4, 8, rngs=rngs)
        self.fc2 = nnx.Linear(8, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))

    def __call__(self, x):
        return self.fc2(self.drop(jnp.tanh(self.fc1(x))))


class CallTimeRngNet(nnx.Module):
    """Dropout drawing from an ``nnx.Rngs`` passed at call time."""

    def __init__(self, rngs):
        self.fc1 = nnx.Linear(4, 8, rngs=rngs)
        self.fc2 = nnx.Linear(8, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, *, rngs):
        h = self.drop(checkpoint_name(jnp.tanh(self.fc1(x)), "mlp_in"), rngs=rngs)
        return jnp.sum(self.fc2(h) ** 2)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = False):
        h = nn.Dropout(0.5)(checkpoint_name(jnp.tanh(nn.Dense(8)(x)), "mlp_in"), deterministic=deterministic)
        return x + nn.Dense(x.shape[-1])(h)


class UnrolledLinen(nn.Module):
    n_layers: int = 2

    @nn.compact
    def __call__(self, x, deterministic: bool = False):
        for _ in range(self.n_layers):
            x = LinenBlock()(x, deterministic)
        return x


# --- deliberately broken variants are caught -------------------------------------------------


def test_fresh_dropout_key_on_recompute_is_caught():
    args = chain_args()
    assert_remat_exact(dropout_chain, "full", *args)  # the correct remat passes bitwise
    with pytest.raises(RematMismatch) as caught:
        assert_remat_exact(dropout_chain, FreshKeyOnRecompute(), *args)
    err = caught.value
    assert err.cause == CAUSE_RANDOM and err.where == "gradient" and err.path == "gradient of args[0]"
    assert "random value drawn differently on recompute" in str(err) and "max abs error" in str(err)


def test_fresh_key_is_harmless_without_randomness():
    """The control above fails only because of dropout: without it the broken remat is exact."""
    w, x, _ = chain_args()
    assert_remat_exact(lambda w, x: jnp.sum(jnp.sin(jnp.sin(x @ w) @ w) ** 2), FreshKeyOnRecompute(), w, x)


def test_nnx_state_not_written_back_is_caught():
    model = StoredRngNet(nnx.Rngs(0))
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    assert_remat_exact(model, "full", x)  # @jremat.policy writes the RNG counter back
    with pytest.raises(RematMismatch) as caught:
        assert_remat_exact(model, "full", x, decorate=forgetful_decorate)
    err = caught.value
    assert err.cause == CAUSE_STATE and err.where == "state"
    assert err.path == "state of module['drop']['rngs']['count']"
    # The model itself is untouched by the checks (they run on copies).
    assert int(model.drop.rngs.count[...]) == 0


def test_another_wrapper_through_decorate():
    """``decorate=`` checks another library's remat: Flax's nnx.remat writes the RNG counter back too."""
    model = StoredRngNet(nnx.Rngs(0))
    assert_remat_exact(model, None, jnp.linspace(-1.0, 1.0, 8).reshape(2, 4), decorate=lambda f, _: nnx.remat(f))


def test_call_time_rngs_written_back_by_nnx_remat_pass():
    """The check itself handles an nnx.Rngs passed at call time: a wrapper that writes it back passes."""

    def nnx_remat(fn, _):
        positional = nnx.remat(lambda m, x, r: fn(m, x, rngs=r))
        return lambda m, x, *, rngs: positional(m, x, rngs)

    model = CallTimeRngNet(nnx.Rngs(0))
    assert_remat_exact(
        model, None, jnp.linspace(-1.0, 1.0, 8).reshape(2, 4), rngs=nnx.Rngs(dropout=1), decorate=nnx_remat
    )


def test_policy_changing_a_saved_value_is_caught():
    w, x, _ = chain_args()
    fn = lambda w, x: jnp.sum(jnp.sin(jnp.sin(x @ w) @ w) ** 2)
    with pytest.raises(RematMismatch) as caught:
        assert_remat_exact(fn, Bf16Residuals(), w, x)
    err = caught.value
    assert err.cause == CAUSE_VALUE and err.where == "gradient"
    assert 0 < err.max_rel_error <= 1e-2 and "rounding" in str(err)
    assert_remat_exact(fn, Bf16Residuals(), w, x, rtol=2e-2, atol=1e-3)  # opt-in tolerance accepts it


# --- every built-in policy passes -------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_case():
    # Layers unrolled: a whole-function plan policy (names_except) sees the tags only outside a scan.
    cfg = preset(
        "tiny", attn_dropout=0.5, resid_dropout=0.5, remat_granularity="none", scan_layers=False, max_seq_len=8, d_ff=32
    )
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.max_seq_len), 0, cfg.vocab_size)
    return model, tokens, jnp.roll(tokens, -1, axis=1), jax.random.key(2)


#: Run by default on the GPT (one callback, one plan and one name-based policy); every policy with -m slow.
GPT_FAST = ("full", "selective", "names")


@pytest.mark.parametrize(
    "policy",
    [
        p if p.id in GPT_FAST else pytest.param(*p.values, id=p.id, marks=(*p.marks, pytest.mark.slow))
        for p in single_function_policies(tags=GPT_TAGS)
    ],
)
@pytest.mark.heavy
def test_every_policy_exact_on_reference_gpt(policy, gpt_case):
    assert_remat_exact(cross_entropy_loss, policy, *gpt_case)


@pytest.mark.parametrize("policy", single_function_policies(tags=("mlp_in",)))
@pytest.mark.heavy
def test_every_policy_exact_on_unrolled_linen(policy):
    model = UnrolledLinen()
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    variables = model.init(jax.random.key(0), x, True)
    with expect_does_not_apply(policy):
        assert_remat_exact(model, policy, variables, x, rngs={"dropout": jax.random.key(5)})


@pytest.mark.parametrize("policy", single_function_policies(tags=("mlp_in",)))
@pytest.mark.heavy
def test_every_policy_exact_on_nnx_call_time_rngs(policy):
    model = CallTimeRngNet(nnx.Rngs(0))
    with expect_does_not_apply(policy):
        assert_remat_exact(model, policy, jnp.linspace(-1.0, 1.0, 8).reshape(2, 4), rngs=nnx.Rngs(dropout=1))


def test_policies_keeps_a_policy_that_cannot_wrap_one_function_as_a_skip_with_its_reason():
    params = {p.id: p for p in policies(tags=("mlp_in",))}
    (skip,) = params["nested"].marks
    assert skip.name == "skip" and "checkpoints a stack of layers" in skip.kwargs["reason"]
    assert not params["full"].marks and params["full"].values == ("full",)
    assert [p.id for p in single_function_policies(tags=("mlp_in",))] == [i for i in params if i != "nested"]


@pytest.mark.heavy
def test_equal_linen_modules_share_one_reference_compile():
    """A parametrized test builds its Linen model anew per policy; the reference compiles once."""
    from jremat._explain import exactness as _exactness

    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    variables = UnrolledLinen(n_layers=3).init(jax.random.key(0), x, True)
    _exactness._RUNNERS.clear()
    for policy in ("full", "every_k:k=2"):
        assert_remat_exact(UnrolledLinen(n_layers=3), policy, variables, x, rngs={"dropout": jax.random.key(5)})
    assert len(_exactness._RUNNERS) == 1
    # Equal but not the same: 1 == True, so the field's repr keeps them apart.
    assert _reference_apply(UnrolledLinen(n_layers=1)) is not _reference_apply(UnrolledLinen(n_layers=True))
