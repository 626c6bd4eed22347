"""Every built-in policy on models written the way users write them (tests/jremat/user_models.py).

For each model and policy: gradients equal the undecorated model's, and the non-parameter
state after the call (RNG counters, batch statistics) is identical. Memory: full remat of an
unrolled 4-block stack compiles to at most 60% of the undecorated temp memory.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat import registry
from jremat.testing import policy_examples
from tests.conftest import ATTENTION_ONLY_POLICIES, expect_does_not_apply, tolerance_jit
from tests.jremat import user_models

#: The built-in policies (registered by the ``policies`` package).
BUILTINS = frozenset(
    name for name, e in registry.entries().items() if e.factory.__module__.startswith("jremat.policies.")
)
STACK_LEVEL = {"nested"}


def example_specs(tag):
    """jremat.testing's example spec of every built-in policy that can wrap one function, naming ``tag``."""
    return {ex.name: ex.spec for ex in policy_examples(tags=(tag,)) if ex.skip_reason is None and ex.name in BUILTINS}


EXAMPLE_SPECS = example_specs(user_models.HIDDEN)
WMT_SPECS = example_specs("wmt_mlp")
#: Models whose decorated blocks hold attention (selective applies there, found by structure).
MODELS_WITH_ATTENTION = {"wmt", "nnx_attention"}


def test_every_builtin_policy_is_covered():
    assert BUILTINS - set(EXAMPLE_SPECS) == STACK_LEVEL


def grads_and_state(case):
    return tolerance_jit(case.run)(case.params, case.key)


def assert_trees_close(got, expected, rtol, what):
    """Equal trees; floats within ``rtol`` of the largest float magnitude in ``expected``.

    One scale for the whole tree: some gradients are exactly zero in exact arithmetic (an
    attention key's bias, by softmax's shift invariance), so a per-leaf ratio would compare
    rounding noise with rounding noise.
    """
    paths = jax.tree_util.tree_leaves_with_path(expected)
    leaves = jax.tree.leaves(got)
    assert len(leaves) == len(paths), what
    # Compared on the host with NumPy: one eager jax.numpy op per leaf shape would compile a program.
    pairs = [(path, _host(e), _host(g)) for (path, e), g in zip(paths, leaves)]
    floats = [e for _, e, _ in pairs if np.issubdtype(e.dtype, np.floating)]
    scale = max([float(np.max(np.abs(e))) for e in floats if e.size] + [1e-30])
    for path, e, g in pairs:
        if np.issubdtype(e.dtype, np.floating):
            err = float(np.max(np.abs(g - e))) / scale if e.size else 0.0
            assert err <= rtol, f"{what} {jax.tree_util.keystr(path)}: error {err:.2e} of the largest value"
        else:
            assert np.array_equal(g, e), f"{what} {jax.tree_util.keystr(path)} differs"


def _host(leaf):
    """``leaf`` as a NumPy array: floats (bfloat16 too) as float64, a typed PRNG key as its key data."""
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    host = np.asarray(leaf)
    return host.astype(np.float64) if jnp.issubdtype(host.dtype, jnp.floating) else host


_REFERENCES = {}


def reference(model):
    if model not in _REFERENCES:
        _REFERENCES[model] = grads_and_state(user_models.CASES[model](None))
    return _REFERENCES[model]


# CI runs every policy on a plain function with legacy uint32 keys, the other models under the
# policies that lower differently (full, names, offload, selective), and the WMT re-type, the
# slowest to compile, under its own tensor name; the rest of the matrix runs with ``-m slow``.
# (Every policy on an unrolled Linen stack, with a typed key and instance decoration, and on an
# NNX module with call-time nnx.Rngs also runs bitwise in tests/jremat/test_testing.py.)
_EVERY_POLICY_IN_CI = {"plain"}
_POLICIES_IN_CI = {"full", "names", "offload", "selective"}
_WMT_POLICIES_IN_CI = {"names"}
_NNX_ATTENTION_POLICIES_IN_CI = {"full", "selective"}


def _marks(model, policy):
    in_ci = {"wmt": _WMT_POLICIES_IN_CI, "nnx_attention": _NNX_ATTENTION_POLICIES_IN_CI}.get(model, _POLICIES_IN_CI)
    return () if model in _EVERY_POLICY_IN_CI or policy in in_ci else pytest.mark.slow


_MODEL_POLICY = [
    pytest.param(model, policy, marks=_marks(model, policy))
    for model in sorted(user_models.CASES)
    for policy in sorted(EXAMPLE_SPECS)
]


@pytest.mark.parametrize("model, policy", _MODEL_POLICY)
@pytest.mark.heavy
def test_gradients_and_state_equal_undecorated(model, policy):
    spec = (WMT_SPECS if model == "wmt" else EXAMPLE_SPECS)[policy]
    loss0, state0, grads0 = reference(model)
    if policy in ATTENTION_ONLY_POLICIES and model not in MODELS_WITH_ATTENTION:  # MLP blocks: no core, says so
        with expect_does_not_apply(policy):
            grads_and_state(user_models.CASES[model](spec))
        return
    loss, state, grads = grads_and_state(user_models.CASES[model](spec))
    assert_trees_close(loss, loss0, 1e-5, "loss")
    assert_trees_close(grads, grads0, 1e-5, "gradient")
    assert_trees_close(state, state0, 1e-6, "state")  # counters and keys: exactly


class FreshKeyOnRecompute(jremat.Policy):
    """A deliberately broken remat: the backward pass recomputes with different dropout bits."""

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        @jax.custom_vjp
        def call(*args):
            return fn(*args)

        def call_fwd(*args):
            return fn(*args), args

        def call_bwd(args, cotangent):
            fresh = [a ^ 1 if a.dtype == jnp.uint32 else a for a in args]  # flip a key bit
            return jax.vjp(fn, *fresh)[1](cotangent)

        call.defvjp(call_fwd, call_bwd)
        return call


def test_a_fresh_dropout_key_on_recompute_is_caught():
    """The comparison above fails when recomputation draws new dropout bits."""
    _, _, reference_grads = reference("plain")
    _, _, grads = grads_and_state(user_models.plain_case(FreshKeyOnRecompute()))
    with pytest.raises(AssertionError, match="gradient"):
        assert_trees_close(grads, reference_grads, 1e-5, "gradient")


def temp_bytes(case):
    return jremat.memory_report(case.run, case.params, case.key).temp_bytes


@pytest.mark.parametrize("model", ["plain", "linen", "nnx", "nnx_call_time_rngs"])
@pytest.mark.heavy
def test_full_remat_of_an_unrolled_stack_saves_memory(model):
    build = user_models.CASES[model]
    none = temp_bytes(build(None, batch=256, width=64))
    full = temp_bytes(build("full", batch=256, width=64))
    assert full <= 0.6 * none, (model, full, none)
