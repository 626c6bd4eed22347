"""Per-layer-group policies and nested (√n) checkpointing of the layer stack."""

import functools

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat._apply.layers import parse_layer_policies
from jremat.models import preset
from tests.conftest import loss_and_grads, max_relative_error


def test_parse_layer_policies_grammar():
    assert parse_layer_policies("") == ()
    assert parse_layer_policies("2:full,rest:none") == ((2, "full"), (None, "none"))
    assert parse_layer_policies("1:every_k:k=2,skip_cheap=true,rest:dots") == (
        (1, "every_k:k=2,skip_cheap=true"),
        (None, "dots"),
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("2full", "is not COUNT:SPEC"),
        ("0:full", "group size must be positive"),
        ("rest:full,1:none", "'rest' must be the last group"),
        ("2:bogus", "unknown policy 'bogus'"),
        ("2:every_k:k=0", "k must be >= 1"),
        ("2:nested:block=2", "checkpoints a stack of layers"),
    ],
)
def test_bad_layer_policies(text, message):
    with pytest.raises(ValueError, match=message):
        jremat.RematConfig(layer_policies=text)


def test_layer_groups_cover_the_stack():
    config = jremat.RematConfig(policy="dots", layer_policies="1:full,2:none")
    groups = config.layer_groups(4)
    assert [(n, p.spec) for n, p in groups] == [(1, "full"), (2, "none"), (1, "dots")]
    with pytest.raises(ValueError, match="covers 3 layers, but the model has only 2"):
        preset("tiny", remat_layer_policies="1:full,2:none")


def test_nested_block_size():
    assert jremat.RematConfig(nest="auto").nest_size(12) == 3
    assert jremat.RematConfig(nest="auto").nest_size(4) == 2
    assert jremat.RematConfig(nest="auto").nest_size(7) == 1
    assert jremat.RematConfig().nest_size(7) is None
    with pytest.raises(ValueError, match="block=3 does not divide the 4 layers; valid block sizes: auto, 1, 2, 4"):
        preset("small", n_layers=4, remat_policy="nested:block=3")
    with pytest.raises(ValueError, match="cannot be combined with layer_policies"):
        jremat.RematConfig(policy="nested", layer_policies="1:full")
    with pytest.raises(ValueError, match="checkpoints a stack of layers"):
        jremat.checkpoint(jnp.sin, "nested")(jnp.ones(2))


def test_nesting_is_a_field_of_the_stack_config():
    spelled = jremat.RematConfig(policy="nested:block=2,layer=every_k:k=2;skip_cheap=true", granularity="sublayer")
    assert spelled == jremat.RematConfig(policy="every_k:k=2,skip_cheap=true", granularity="sublayer", nest=2)
    assert spelled.resolved_policy().spec == "every_k:k=2,skip_cheap=true"
    assert jremat.RematConfig(policy="nested") == jremat.RematConfig(policy="none", nest="auto")
    assert jremat.RematConfig(nest="3").nest == 3
    for bad in (0, -1, "two", 2.5, True):
        with pytest.raises(ValueError, match="block must be 'auto' or a positive integer"):
            jremat.RematConfig(nest=bad)
    with pytest.raises(ValueError, match="do not also give nest=2"):
        jremat.RematConfig(policy="nested", nest=2)


@functools.cache
def no_remat_reference(cfg):
    return loss_and_grads(cfg.replace(remat_policy="none", remat_granularity="none"))


@pytest.mark.parametrize("scan_layers", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["scan", "unrolled"])
@pytest.mark.parametrize(
    "spec, layer_policies",
    [("every_k:k=2", "1:full"), ("none", "1:selective,rest:every_k:k=3"), ("nested:block=2,layer=full", "")],
)
@pytest.mark.heavy
def test_gradients_match_no_remat(spec, layer_policies, scan_layers):
    cfg = preset("tiny", attn_dropout=0.5, resid_dropout=0.5, n_layers=4)
    ref_loss, ref_grads = no_remat_reference(cfg)
    loss, grads = loss_and_grads(
        cfg.replace(remat_policy=spec, remat_layer_policies=layer_policies, scan_layers=scan_layers)
    )
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert max_relative_error(grads, ref_grads) <= 1e-5


def test_layer_groups_run_one_scan_per_group():
    cfg = preset("tiny", n_layers=4, remat_layer_policies="1:full,rest:none")
    from flax import nnx

    from jremat.models import GPT

    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    tokens = jnp.zeros((1, cfg.max_seq_len), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens))(params)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [1, 3]
