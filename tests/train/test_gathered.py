"""The gathers the reference model writes for a policy that keeps them (train/gathered.py)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jremat.models import GPT, preset
from jremat.train import gathered
from tests.train.test_sharding import abstract_mesh


def test_gathered_layer_bytes_counts_one_layers_matrices_without_fsdp():
    cfg = preset("tiny")  # d_model 32, d_ff 64: q, k, v, out 32x32 and the MLP 32x64, 64x32, float32
    params = nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    per_layer = (4 * 32 * 32 + 2 * 32 * 64) * 4
    assert gathered.gathered_layer_bytes(params, abstract_mesh(fsdp=8)) == per_layer
    assert (
        gathered.gathered_layer_bytes(params, abstract_mesh(fsdp=2, tensor=4)) == per_layer // 4
    )  # tensor stays split


def test_keeps_gathered_reads_every_policy_of_the_model():
    cfg = preset("tiny")
    assert not gathered.keeps_gathered(cfg.replace(remat_policy="full"))
    assert gathered.keeps_gathered(cfg.replace(remat_policy="dots:keep_gathered=true"))
    assert gathered.keeps_gathered(cfg.replace(remat_policy="none", remat_layer_policies="1:full:keep_gathered=true"))
    assert not gathered.keeps_gathered(cfg.replace(remat_policy="full:keep_collectives=1"), ("keep_gathered",))


def test_weight_gathers_leave_a_scanned_models_matrices_to_xla_under_keep_collectives():
    cfg = preset("tiny")
    mesh = abstract_mesh(fsdp=8)
    assert gathered.weight_gathers(cfg.replace(remat_policy="full"), mesh) is None
    assert gathered.weight_gathers(cfg.replace(remat_policy="full:keep_collectives=true"), abstract_mesh()) is None
    cases = {
        ("full:keep_collectives=true", True): True,  # scanned: the step without remat gathers them again too
        ("full:keep_collectives=true", False): False,
        ("full:keep_gathered=true", True): False,
        ("full:keep_collectives=true,keep_gathered=true", True): False,
    }
    for (spec, scanned), vectors_only in cases.items():
        blocks = gathered.weight_gathers(cfg.replace(remat_policy=spec, scan_layers=scanned), mesh)
        assert blocks == gathered.GatheredWeights(mesh, vectors_only=vectors_only), spec


def test_gathered_weights_constrains_vectors_only_when_asked():
    mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"fc_in": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}}

    def constrained(gather):
        jaxpr = jax.make_jaxpr(gather)(params)
        return sorted(e.outvars[0].aval.shape for e in jaxpr.eqns if e.primitive.name == "sharding_constraint")

    assert constrained(gathered.GatheredWeights(mesh)) == [(4, 8), (8,)]
    assert constrained(gathered.GatheredWeights(mesh, vectors_only=True)) == [(8,)]
