"""The reference model's mixture-of-experts FFN (``moe_experts > 0``): routing, dispatch, the auxiliary
losses and their gradient, the tags, the config's checks and the parameters' layout on a mesh.

The dropless layer and the capacity dispatch of expert parallelism are checked against a per-token
NumPy reference (expert parallelism on one device here; on 8 devices in tests/train/test_moe_mesh.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

import jremat
from jremat import names
from jremat.models import GPT, ModelConfig, cross_entropy_loss, moe, moe_aux_losses, preset
from jremat.train import experts
from jremat.train import sharding as sh
from jremat.train.programs import block_program
from tests.conftest import loss_and_grads, max_relative_error, tolerance_jit

TOKENS, D_MODEL, D_FF, EXPERTS, TOP_K = 12, 8, 16, 4, 2


def _swiglu(gate, up):
    return gate / (1.0 + np.exp(-gate)) * up


def reference_moe(x, router, w_gate, w_up, w_out, top_k, slots=None):
    """Per-token NumPy (float64) MoE: ``(output, load_balance, router_z)``.

    With ``slots``, expert ``e`` serves only the first ``slots`` of its assignments in assignment
    order (token, then choice); the others add nothing to their token's output.
    """
    x, router, w_gate, w_up, w_out = (np.asarray(a, np.float64) for a in (x, router, w_gate, w_up, w_out))
    logits = x @ router
    n_experts = logits.shape[1]
    out = np.zeros_like(x)
    served = np.zeros(n_experts, int)
    assigned = np.zeros(n_experts)
    for t in range(x.shape[0]):
        chosen = np.argsort(-logits[t], kind="stable")[:top_k]
        weights = np.exp(logits[t, chosen] - logits[t, chosen].max())
        weights /= weights.sum()
        for e, w in zip(chosen, weights):
            assigned[e] += 1
            served[e] += 1
            if slots is None or served[e] <= slots:
                out[t] += w * (_swiglu(x[t] @ w_gate[e], x[t] @ w_up[e]) @ w_out[e])
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    load_balance = n_experts * np.sum(assigned / (x.shape[0] * top_k) * probs.mean(0))
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    return out, load_balance, np.mean(lse**2)


@pytest.fixture(scope="module")
def layer():
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (TOKENS, D_MODEL), jnp.float32)
    router = jax.random.normal(keys[1], (D_MODEL, EXPERTS), jnp.float32)
    w_gate, w_up = (jax.random.normal(k, (EXPERTS, D_MODEL, D_FF), jnp.float32) / math.sqrt(D_MODEL) for k in keys[2:4])
    w_out = jax.random.normal(keys[4], (EXPERTS, D_FF, D_MODEL), jnp.float32) / math.sqrt(D_FF)
    return x, router, w_gate, w_up, w_out


def test_dropless_layer_matches_a_per_token_reference(layer):
    out, load_balance, router_z = jax.jit(moe.dropless, static_argnums=5)(*layer, TOP_K)
    want, want_lb, want_z = reference_moe(*layer, TOP_K)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(load_balance), want_lb, rtol=1e-5)
    np.testing.assert_allclose(float(router_z), want_z, rtol=1e-5)
    assert float(load_balance) != pytest.approx(1.0)  # unbalanced on purpose: the loss measures something


def _expert_parallel_on_one_device(layer, factor):
    mesh = jax.make_mesh((1,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    ep = moe.ExpertParallel(mesh, "expert", ("expert",), (), factor)
    body = lambda x, r, wg, wu, wo: moe.expert_parallel_shard(x, r, wg, wu, wo, top_k=TOP_K, ep=ep)
    specs = (PartitionSpec("expert"), PartitionSpec(), *[PartitionSpec("expert")] * 3)
    outs = (PartitionSpec("expert"), PartitionSpec(), PartitionSpec())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=outs))(*layer)


@pytest.mark.parametrize("factor", [0.5, 1.0, EXPERTS / TOP_K], ids=["half", "even", "dropless"])
def test_capacity_dispatch_serves_each_expert_its_first_assignments(layer, factor):
    slots = moe.capacity(TOKENS, TOP_K, EXPERTS, factor)
    out, load_balance, router_z = _expert_parallel_on_one_device(layer, factor)
    want, want_lb, want_z = reference_moe(*layer, TOP_K, slots=slots)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(load_balance), want_lb, rtol=1e-5)  # of the routing: drops do not change it
    np.testing.assert_allclose(float(router_z), want_z, rtol=1e-5)
    dropless_out = reference_moe(*layer, TOP_K)[0]
    assert (np.abs(want - dropless_out).max() > 1e-3) == (slots < TOKENS)  # a small capacity drops tokens here


def test_capacity_is_the_even_share_times_the_factor_rounded_up():
    assert moe.capacity(12, 2, 4, 1.25) == 8  # ceil(1.25 * 12 * 2 / 4) = ceil(7.5)
    assert moe.capacity(12, 2, 4, 0.01) == 1
    assert moe.capacity(12, 2, 4, 2.0) == 12


# ----------------------------------------------------------------------------- the model


def moe_config(**changes):
    return preset("tiny", moe_experts=EXPERTS, moe_top_k=TOP_K, **changes)


@pytest.mark.heavy
def test_aux_gradient_is_the_gradient_of_the_weighted_router_losses():
    """``cross_entropy_loss``'s gradient is that of cross-entropy + n_layers * (coef * mean layer loss), and
    without the coefficients (the auxiliary losses left out) it differs."""
    cfg = moe_config(
        attn_dropout=0.5,
        resid_dropout=0.5,
        moe_load_balance_coef=0.5,
        moe_router_z_coef=0.1,
        remat_granularity="none",  # no remat: this is about the loss, not a policy
        max_seq_len=8,
    )
    _, grads = loss_and_grads(cfg)
    plain = cfg.replace(moe_load_balance_coef=0.0, moe_router_z_coef=0.0)
    graphdef, params = nnx.split(GPT(plain, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.max_seq_len), 0, cfg.vocab_size)  # as loss_and_grads
    key = jax.random.key(0)

    def objective(p):
        model = nnx.merge(graphdef, p)
        aux = moe_aux_losses(model, tokens, key)
        weighted = 0.5 * aux["load_balance"] + 0.1 * aux["router_z"]
        return cross_entropy_loss(model, tokens, jnp.roll(tokens, -1, axis=1), key) + cfg.n_layers * weighted

    want = tolerance_jit(jax.grad(objective))(params)
    assert max_relative_error(grads, want) <= 1e-5
    _, without = loss_and_grads(plain)
    assert max_relative_error(without, want) > 1e-3


def test_every_moe_name_is_tagged_and_names_keeps_the_one_it_lists():
    cfg = moe_config(attn_dropout=0.0, resid_dropout=0.0)

    def saved(policy, cfg=cfg):
        fn, args = block_program(cfg.replace(remat_policy=policy), 2, 8)
        return jremat.saved_residuals_report(fn, *args, param_argnums=(0,)).saved_bytes

    with pytest.raises(ValueError, match="tags it has: ") as err:
        saved("names:save=not_a_tag")
    listed = str(err.value).split("tags it has: ")[1].split(", ")
    assert set(names.MOE_NAMES) <= set(listed)
    assert names.MLP_IN not in listed  # the MoE block has no dense MLP ...
    with pytest.raises(ValueError, match=names.MLP_IN):  # ... unless it has a shared expert
        saved("names:save=not_a_tag", cfg.replace(moe_shared_expert=True))

    rows = 2 * 8 * TOP_K  # every token's top-k assignments
    assert saved("names:save=moe_hidden") - saved("full") == rows * cfg.d_ff * 4
    assert saved("names:save=moe_hidden_pre_act") - saved("full") == rows * cfg.d_ff * 4  # the gate only
    assert saved("names:save=moe_hidden_up") - saved("full") == rows * cfg.d_ff * 4
    assert saved("names:save=moe_dispatched") - saved("full") == rows * cfg.d_model * 4
    assert saved("names:save=moe_router_logits") - saved("full") == 2 * 8 * EXPERTS * 4


@pytest.mark.parametrize("shared", [False, True])
def test_parameter_count_counts_the_router_experts_and_shared_expert(shared):
    cfg = moe_config(moe_shared_expert=shared)
    params = nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    assert cfg.parameter_count() == sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    assert cfg.parameter_count() > preset("tiny").parameter_count()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(moe_top_k=5), "moe_top_k 5 is more than the 4 experts"),
        (dict(moe_top_k=0), "moe_top_k must be a positive integer, got 0"),
        (dict(moe_experts=-1), "moe_experts must be an integer >= 0"),
        (dict(moe_capacity_factor=0.0), "moe_capacity_factor must be a positive number, got 0.0"),
        (dict(moe_capacity_factor=float("inf")), "moe_capacity_factor must be a positive number"),
        (dict(moe_load_balance_coef=-0.1), "moe_load_balance_coef must be a number >= 0, got -0.1"),
        (dict(moe_router_z_coef=float("nan")), "moe_router_z_coef must be a number >= 0"),
    ],
)
def test_bad_moe_fields_are_a_value_error_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(moe_experts=changes.pop("moe_experts", 4), **changes)


def test_a_dense_config_ignores_the_moe_fields_but_top_k():
    assert ModelConfig(moe_top_k=8).moe_experts == 0  # top-k only matters with experts
    with pytest.raises(ValueError, match="moe_top_k must be a positive integer"):
        ModelConfig(moe_top_k=0)


def test_expert_parallel_layout_is_refused_for_a_dense_model():
    ep = moe.ExpertParallel(None, "expert", ("expert",), (), 1.0)
    with pytest.raises(ValueError, match="moe_experts is 0"):
        GPT(preset("tiny"), rngs=nnx.Rngs(0), expert_parallel=ep)


# ----------------------------------------------------------------------------- the layout on a mesh


def expert_mesh(**sizes):
    axes = sh.ALL_MESH_AXES
    return AbstractMesh(tuple(sizes.get(a, 1) for a in axes), axes, axis_types=(AxisType.Auto,) * len(axes))


def test_every_moe_parameter_has_logical_axes_and_the_experts_split_over_the_expert_axis():
    _, params = nnx.split(nnx.eval_shape(lambda: GPT(moe_config(moe_shared_expert=True), rngs=nnx.Rngs(0))))
    mesh = expert_mesh(fsdp=2, expert=4)
    specs = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        axes = sh.param_logical_axes(path, len(leaf.shape))
        assert None not in axes, (sh.path_names(path), axes)
        specs[sh.path_names(path)[-2:]] = sh.param_partition_spec(path, leaf.shape, mesh)
    # [layers, experts, d_model, d_ff]: experts over expert, fsdp on the largest dimension left
    assert specs[("moe", "w_gate")] == specs[("moe", "w_up")] == PartitionSpec(None, "expert", None, "fsdp")
    assert specs[("moe", "w_out")] == PartitionSpec(None, "expert", "fsdp", None)
    assert specs[("moe", "router")] == PartitionSpec(None, "fsdp", None)  # every device routes over all experts
    assert specs[("fc_in", "kernel")] == PartitionSpec(None, None, "fsdp")  # the shared expert: a dense MLP


def test_the_expert_axis_is_in_a_mesh_only_when_given_and_splits_the_batch():
    assert sh.parse_mesh("expert=4,data=2") == {"data": 2, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 4}
    assert "expert" not in sh.parse_mesh("data=2")
    mesh = sh.make_mesh(sh.parse_mesh("expert=1"), jax.devices()[:1])
    assert mesh.axis_names == (*sh.MESH_AXES, "expert")
    assert sh.batch_sharding(mesh).spec == PartitionSpec(("data", "fsdp", "expert"), ("sequence",))
    assert experts.expert_parallel(mesh, moe_config()) is None  # size 1: no expert parallelism
    eight = expert_mesh(data=2, expert=4)
    with pytest.raises(ValueError, match=r"data x fsdp x expert = 2 x 1 x 4 = 8 devices; use a multiple of 8"):
        sh.check_batch(eight, 4, 16)
    with pytest.raises(ValueError, match="6 experts do not split over the mesh's expert axis of size 4"):
        experts.expert_parallel(eight, moe_config().replace(moe_experts=6))
    with pytest.raises(ValueError, match="the model is dense"):
        experts.expert_parallel(eight, preset("tiny"))
    ep = experts.expert_parallel(eight, moe_config(moe_capacity_factor=2.0))
    assert (ep.axis, ep.batch_axes, ep.seq_axes, ep.capacity_factor) == (
        "expert",
        ("data", "fsdp", "expert"),
        ("sequence",),
        2.0,
    )
