"""Flagship controls: a remat that draws a fresh dropout key on recompute is caught.

The gradient-equality matrix itself (every registered policy, ``full`` and ``none`` included, x
block/sublayer x scan/unrolled, dropout 0.5; part of it under ``-m slow``) is parametrized from
the registry in ``tests/policies/test_policy_gradients.py``; the tests here prove that comparison
has teeth.
"""

import jax
import pytest

import jremat
from jremat import Policy
from jremat.models import preset
from tests.conftest import loss_and_grads, max_relative_error

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference():
    cfg = preset("tiny", attn_dropout=0.5, resid_dropout=0.5, remat_granularity="none")
    return loss_and_grads(cfg)


class FreshKeyOnRecompute(Policy):
    """A deliberately broken remat: the backward pass recomputes with a *different* dropout key."""

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        @jax.custom_vjp
        def block(params, x, key):
            return fn(params, x, key)

        def forward(params, x, key):
            return fn(params, x, key), (params, x, key)

        def backward(residuals, cotangent):
            params, x, key = residuals
            fresh_key = jax.random.fold_in(key, 12345)
            _, vjp = jax.vjp(lambda p, h: fn(p, h, fresh_key), params, x)
            return (*vjp(cotangent), None)

        block.defvjp(forward, backward)
        return block


@pytest.fixture
def broken_policy():
    with jremat.registry.scoped():
        jremat.register("test_fresh_key_on_recompute", doc="broken on purpose")(FreshKeyOnRecompute)
        yield "test_fresh_key_on_recompute"


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_fresh_dropout_key_on_recompute_is_caught(tiny_config, reference, broken_policy, scan_layers):
    ref_loss, ref_grads = reference
    cfg = tiny_config.replace(remat_granularity="block", scan_layers=scan_layers, remat_policy=broken_policy)
    loss, grads = loss_and_grads(cfg)
    # The forward pass is untouched, so the loss agrees ...
    assert abs(float(loss) - float(ref_loss)) <= TOLERANCE * abs(float(ref_loss))
    # ... but the gradients come from other masks, and the comparison rejects them.
    assert max_relative_error(grads, ref_grads) > 100 * TOLERANCE


def test_broken_control_is_harmless_without_dropout(tiny_config, broken_policy):
    """The control fails only because of dropout: with rate 0 the fresh key changes nothing."""
    cfg = tiny_config.replace(attn_dropout=0.0, resid_dropout=0.0)
    _, ref_grads = loss_and_grads(cfg.replace(remat_granularity="none"))
    _, grads = loss_and_grads(cfg.replace(remat_granularity="block", remat_policy=broken_policy))
    assert max_relative_error(grads, ref_grads) <= TOLERANCE


def test_dropout_key_changes_gradients(tiny_config, reference):
    """Different keys give different gradients, so equal gradients above are not vacuous."""
    _, ref_grads = reference
    _, grads = loss_and_grads(tiny_config.replace(remat_granularity="none"), seed=7)
    assert max_relative_error(grads, ref_grads) > 100 * TOLERANCE
