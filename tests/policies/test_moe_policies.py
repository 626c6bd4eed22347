"""The policies on mixture-of-experts FFNs written as users write them (tests/jremat/moe_user_models.py):
the grouped matmuls (``jax.lax.ragged_dot``) each policy runs in the gradient, counted on the traced
gradient independently of jremat's own counters; what ``selective`` recomputes; the gradients of every
policy, bitwise, with a broken remat caught; and what ``explain`` says of a JAX policy that re-runs them."""

import re

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat import names
from jremat.testing import RematMismatch, assert_remat_exact
from tests.conftest import live_runs, run_under_engine, saved_residuals, single_function_policies
from tests.jremat import moe_user_models as moe
from tests.jremat.test_testing import FreshKeyOnRecompute

#: A grouped matmul: the primitive, or a Pallas kernel (the only kernels of these models are
#: megablox's grouped matmuls, ``gmm`` and ``tgmm``).
GROUPED_MATMUL_PRIMITIVES = ("ragged_dot_general", "pallas_call")


def grouped_matmuls(jaxpr) -> int:
    """Grouped matmuls a traced gradient runs (:func:`tests.conftest.live_runs`)."""
    return live_runs(jaxpr, GROUPED_MATMUL_PRIMITIVES)


def gradient_grouped_matmuls(layer_policy, layout, ffn=moe.moe_ffn) -> int:
    """Grouped matmuls in the traced gradient of the 2-layer MoE, each layer (``ffn``) checkpointed by ``layer_policy``."""
    layer = ffn if layer_policy is None else jremat.checkpoint(ffn, layer_policy)
    loss = (moe.scanned_loss if layout == "scanned" else moe.unrolled_loss)(layer)
    x, key = moe.inputs()
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(moe.params(), x, key)
    return grouped_matmuls(jaxpr.jaxpr)


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
@pytest.mark.heavy
def test_dots_skip_cheap_and_selective_run_no_grouped_matmul_again(remat_engine, layout):
    none = gradient_grouped_matmuls(None, layout)
    assert none == moe.LAYERS * 6  # two forward, four backward per layer
    for spec in ("dots", "dots_no_batch", "skip_cheap", "selective", "every_k:k=1"):
        assert gradient_grouped_matmuls(spec, layout) == none, spec
    # Recomputing everything runs both expert matmuls of each layer again (the combine's gradient
    # with respect to the router's weights reads the second one's output).
    assert gradient_grouped_matmuls("full", layout) == none + 2 * moe.LAYERS


def test_dots_keeps_the_grouped_matmuls_of_a_scan_inside_one_checkpoint(remat_engine):
    """One checkpoint around the whole scanned stack: dots keeps the grouped matmuls inside the
    loop body (remat3 included, where they are kept by name inside the body)."""
    x, key = moe.inputs()
    loss = moe.scanned_loss(moe.moe_ffn)
    runs = {
        label: grouped_matmuls(jax.make_jaxpr(jax.grad(f, (0, 1)))(moe.params(), x, key).jaxpr)
        for label, f in {"none": loss, "dots": jremat.checkpoint(loss, "dots")}.items()
    }
    assert runs["dots"] == runs["none"] == moe.LAYERS * 6


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
@pytest.mark.heavy
def test_a_megablox_gmm_kernel_is_kept_like_the_primitive(remat_engine, layout, megablox_promotion):
    """The experts as JAX's Pallas grouped matmul (megablox ``gmm``, a ``custom_vjp`` around a
    ``pallas_call``): dots, skip_cheap and selective run no kernel again; full runs both again."""
    none = gradient_grouped_matmuls(None, layout, moe.gmm_ffn)
    assert none == moe.LAYERS * 6  # gmm twice forward; gmm and tgmm per forward gmm backward
    for spec in ("dots", "dots_no_batch", "skip_cheap", "selective"):
        assert gradient_grouped_matmuls(spec, layout, moe.gmm_ffn) == none, spec
    assert gradient_grouped_matmuls("full", layout, moe.gmm_ffn) == none + 2 * moe.LAYERS


@pytest.mark.parametrize("policy", ["dots", "selective", "full"])
@pytest.mark.heavy
def test_gradients_through_megablox_gmm_kernels_equal_no_remat(policy, megablox_promotion):
    stack = moe.scanned_loss
    decorate = lambda _, p: stack(jremat.checkpoint(moe.gmm_ffn, p))
    args = (moe.params(), *moe.inputs())
    assert_remat_exact(stack(moe.gmm_ffn), policy, *args, argnums=(0, 1), **TOLERANCE, decorate=decorate)


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
def test_selective_finds_swiglu_through_a_fused_gate_and_up_projection(layout):
    """SwiGLU experts whose gate and up projections are one grouped matmul split in halves: selective
    finds the activation through the split, keeps the halves, runs no grouped matmul again and gives
    no remat's gradients."""
    stack = moe.scanned_loss if layout == "scanned" else moe.unrolled_loss
    args = (moe.params(gated=True), *moe.inputs())
    count = lambda ffn: grouped_matmuls(jax.make_jaxpr(jax.grad(stack(ffn), (0, 1)))(*args).jaxpr)
    assert count(jremat.checkpoint(moe.fused_swiglu_ffn, "selective")) == count(moe.fused_swiglu_ffn) == 6 * moe.LAYERS
    decorate = lambda _, p: stack(jremat.checkpoint(moe.fused_swiglu_ffn, p))
    assert_remat_exact(stack(moe.fused_swiglu_ffn), "selective", *args, argnums=(0, 1), **TOLERANCE, decorate=decorate)
    layer_args = (*(p[0] for p in args[0]), *args[1:])
    explained = jremat.explain(moe.fused_swiglu_ffn, "selective", *layer_args, compile=False)
    assert any("expert activation found by structure" in m for m in explained.matched), explained.matched
    # The split's halves are kept, not the fused output split again (on a mesh, moving the halves again).
    layer = jremat.checkpoint(moe.fused_swiglu_ffn, "selective")
    shapes = [aval.shape for aval, _ in saved_residuals(lambda *a: jnp.sum(layer(*a)), *layer_args)]
    assert (moe.TOKENS * moe.TOP_K, moe.D_FF) not in shapes, shapes
    assert shapes.count((moe.TOKENS * moe.TOP_K, moe.D_FF // 2)) >= 2, shapes


@pytest.mark.heavy
def test_selective_finds_the_expert_activation_between_megablox_kernels(megablox_promotion):
    (router, w_in, w_out), (x, key) = (p[0] for p in moe.params()), moe.inputs()
    explained = jremat.explain(moe.gmm_ffn, "selective", router, w_in, w_out, x, key, compile=False)
    assert any("expert activation found by structure" in m for m in explained.matched), explained.matched
    assert not [m for m in explained.messages if "re-run" in m], explained.messages


def test_a_jax_policy_keeps_its_meaning_for_grouped_matmuls(remat_engine):
    """Drop-in: JAX's dots_saveable names dot_general only; passed to jremat.checkpoint it
    re-runs the grouped matmuls exactly as jax.checkpoint does."""
    policy = jax.checkpoint_policies.dots_saveable
    x, key = moe.inputs()
    runs = {}
    for label, wrap in {
        "jremat": lambda f: jremat.checkpoint(f, policy),
        "jax": lambda f: jax.checkpoint(f, policy=policy),
    }.items():
        loss = moe.unrolled_loss(wrap(moe.moe_ffn))
        runs[label] = grouped_matmuls(jax.make_jaxpr(jax.grad(loss, (0, 1)))(moe.params(), x, key).jaxpr)
    assert runs["jremat"] == runs["jax"] > gradient_grouped_matmuls(None, "unrolled")


def test_explain_names_the_grouped_matmuls_a_jax_policy_reruns():
    (router, w_in, w_out), (x, key) = (p[0] for p in moe.params()), moe.inputs()
    jax_dots = jremat.CallbackPolicy(jax.checkpoint_policies.dots_saveable)
    lines = {
        label: [m for m in jremat.explain(moe.moe_ffn, p, router, w_in, w_out, x, key, compile=False).messages]
        for label, p in {"jax": jax_dots, "dots": "dots"}.items()
    }
    reruns = [m for m in lines["jax"] if m.startswith("grouped matmul re-run (")]
    assert len(reruns) == 1, lines["jax"]
    runs, none = map(
        int,
        re.search(
            r": (\d+) grouped matmuls \(jax.lax.ragged_dot or a grouped matmul kernel\) in the gradient, none: (\d+)",
            reruns[0],
        ).groups(),
    )
    assert none == 6 and runs > none, reruns  # two forward and four backward grouped matmuls without remat
    assert not [m for m in lines["dots"] if m.startswith("grouped matmul re-run")]


@pytest.mark.parametrize("tagged", [False, True], ids=["untagged", "tagged"])
def test_selective_recomputes_the_expert_activation_only(tagged):
    """selective (Megatron's moe_act recompute) keeps the grouped matmul outputs and the routing:
    it saves less than none by at least the activation's output and runs no grouped matmul again."""
    (router, w_in, w_out), (x, key) = (p[0] for p in moe.params()), moe.inputs()
    layer = lambda r, a, b, h, k: moe.moe_ffn(r, a, b, h, k, tagged=tagged)

    def saved_bytes(spec):
        loss = lambda r, a, b, h: jnp.sum(jremat.checkpoint(layer, spec)(r, a, b, h, key) ** 2)
        return jremat.saved_residuals_report(loss, router, w_in, w_out, x, param_argnums=(0, 1, 2)).computed_bytes

    activation_bytes = moe.TOKENS * moe.TOP_K * moe.D_FF * 4  # the GELU's output, float32
    assert saved_bytes("selective") <= saved_bytes("none") - activation_bytes
    assert saved_bytes("selective") >= activation_bytes  # the pre-activation (a grouped matmul's output) is kept
    explained = jremat.explain(layer, "selective", router, w_in, w_out, x, key, compile=False)
    assert any("expert activation found by structure" in m for m in explained.matched), explained.matched


def test_selective_without_attention_or_experts_is_still_an_error():
    with pytest.raises(jremat.PolicyDoesNotApply, match="mixture of experts' activation between two grouped"):
        jax.grad(lambda w, x: jnp.sum(jremat.checkpoint(lambda w, x: jnp.tanh(x @ w), "selective")(w, x)))(
            jnp.ones((4, 4)), jnp.ones((2, 4))
        )


# Every policy: the scanned plain-JAX stack under the classic engine in CI, a few policies on the other
# user models (the unrolled stack, NNX, Equinox) and under remat3; the whole matrix under -m slow.
FEW = ("full", "dots", "selective", "every_k")


def _few(params_list):
    """``params_list`` with every policy but :data:`FEW` slow-marked (a skipped one stays skipped, with its reason)."""
    return [
        p if p.id in FEW else pytest.param(*p.values, id=p.id, marks=(*p.marks, pytest.mark.slow)) for p in params_list
    ]


#: Gradients are compared within these tolerances: XLA fuses a recomputed GELU differently from the
#: forward pass (rounding: about 6e-5 relative, 4e-6 absolute here). The broken remat below is caught at them.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def _per_layer(stack):
    """``decorate`` for :func:`assert_remat_exact`: the stack with each layer checkpointed by the policy."""
    return lambda _, policy: stack(jremat.checkpoint(moe.moe_ffn, policy))


@pytest.mark.parametrize(
    ("engine", "policy"),
    [pytest.param("classic", *p.values, id=f"classic-{p.id}", marks=p.marks) for p in single_function_policies()]
    + [pytest.param("remat3", *p.values, id=f"remat3-{p.id}", marks=p.marks) for p in _few(single_function_policies())],
)
@pytest.mark.heavy
def test_every_policy_exact_on_a_scanned_moe(engine, policy):
    args = (moe.params(), *moe.inputs())
    stack = moe.scanned_loss
    with run_under_engine(engine):
        assert_remat_exact(stack(moe.moe_ffn), policy, *args, argnums=(0, 1), **TOLERANCE, decorate=_per_layer(stack))


@pytest.mark.parametrize("policy", _few(single_function_policies()))
@pytest.mark.heavy
def test_every_policy_exact_on_an_unrolled_moe(policy):
    args = (moe.params(), *moe.inputs())
    stack = moe.unrolled_loss
    assert_remat_exact(stack(moe.moe_ffn), policy, *args, argnums=(0, 1), **TOLERANCE, decorate=_per_layer(stack))


@pytest.mark.parametrize("policy", _few(single_function_policies(names.MOE_NAMES)))
@pytest.mark.heavy
def test_every_policy_exact_on_an_nnx_moe(policy):
    x, key = moe.inputs()
    assert_remat_exact(moe.NnxMoE(), policy, x, key, **TOLERANCE)


@pytest.mark.parametrize("policy", _few(single_function_policies()))
def test_every_policy_exact_on_an_equinox_moe(policy):
    x, key = moe.inputs()
    assert_remat_exact(lambda m, h, k: jnp.sum(m(h, k) ** 2), policy, moe.EqxMoE(), x, key, **TOLERANCE)


@pytest.mark.heavy
def test_routing_recomputed_with_another_key_is_caught():
    """The broken variant: the backward pass recomputes the router's jitter (and dropout) with
    another key, so tokens go to other experts there; the check must fail."""
    x, key = moe.inputs()
    args = (moe.params(), x, key)
    stack = moe.unrolled_loss
    assert_remat_exact(stack(moe.moe_ffn), "full", *args, **TOLERANCE, decorate=_per_layer(stack))
    with pytest.raises(RematMismatch):
        assert_remat_exact(stack(moe.moe_ffn), FreshKeyOnRecompute(), *args, **TOLERANCE, decorate=_per_layer(stack))


def test_selective_finds_the_reference_models_expert_activation():
    """On the reference MoE model the activation is jremat.ops.swiglu, a nested checkpoint: selective
    looks through it, so the saved residuals fall by at least the experts' activation outputs, and
    what it recomputes (the attention core and the activation) is at most 2% of the gradient's FLOPs
    at the tiny preset's sequence length (docs/moe.md's target)."""
    from jremat.models import preset
    from jremat.train.programs import loss_program

    cfg = preset("tiny", moe_experts=8, moe_top_k=2, attn_dropout=0.0, resid_dropout=0.0)
    batch = 2
    saved, flops = {}, {}
    for spec in ("none", "selective"):
        loss, args = loss_program(cfg.replace(remat_policy=spec), batch, cfg.max_seq_len)
        saved[spec] = jremat.saved_residuals_report(loss, *args, param_argnums=(0,)).computed_bytes
        flops[spec] = jremat.jaxpr_flops(jax.make_jaxpr(jax.grad(loss))(*args))
    activation_bytes = cfg.n_layers * batch * cfg.max_seq_len * cfg.moe_top_k * cfg.d_ff * 4
    assert saved["none"] - saved["selective"] >= activation_bytes, saved
    assert 0 < flops["selective"] - flops["none"] <= 0.02 * flops["none"], flops


def test_selective_modules_choose_what_is_recomputed():
    """``modules`` (Megatron-LM's --recompute-modules names) on the reference MoE model: moe_act keeps
    the attention's [seq, seq] tensors, core_attn the experts' activation outputs; each recomputes
    less than the default (both) and saves less than none."""
    from jremat.models import preset
    from jremat.train.programs import loss_program

    cfg = preset("tiny", moe_experts=4, moe_top_k=2, attn_dropout=0.0, resid_dropout=0.0)
    batch = 2
    saved, flops = {}, {}
    for spec in ("none", "selective", "selective:modules=moe_act", "selective:modules=core_attn"):
        loss, args = loss_program(cfg.replace(remat_policy=spec), batch, cfg.max_seq_len)
        saved[spec] = jremat.saved_residuals_report(loss, *args, param_argnums=(0,)).computed_bytes
        flops[spec] = jremat.jaxpr_flops(jax.make_jaxpr(jax.grad(loss))(*args))
    activation_bytes = cfg.n_layers * batch * cfg.max_seq_len * cfg.moe_top_k * cfg.d_ff * 4
    scores_bytes = cfg.n_layers * batch * cfg.n_heads * cfg.max_seq_len**2 * 4  # one [b, h, s, s] float32 per layer
    assert saved["selective:modules=moe_act"] - saved["selective"] >= scores_bytes, saved
    assert saved["selective:modules=core_attn"] - saved["selective"] >= activation_bytes, saved
    assert saved["selective:modules=moe_act"] < saved["none"], saved
    assert flops["none"] < flops["selective:modules=moe_act"] < flops["selective"], flops
    assert flops["none"] < flops["selective:modules=core_attn"] < flops["selective"], flops
    loss, args = loss_program(cfg.replace(remat_policy="selective:modules=moe_act"), batch, cfg.max_seq_len)
    matched = jremat.explain_applied(loss, *args, policy="selective:modules=moe_act", compile=False).matched
    assert any("expert activation found by structure" in m for m in matched), matched
    assert any("attention core kept (modules=moe_act)" in m for m in matched), matched
    assert not any("attention core found" in m for m in matched), matched


def test_selective_modules_without_what_they_name_is_an_error():
    """A module the checkpointed function lacks is an error naming it, not a silent 'none'."""
    attention = lambda x: jax.nn.softmax(x @ x.T) @ x
    with pytest.raises(jremat.PolicyDoesNotApply, match=r"modules=moe_act.*mixture of experts' activation"):
        jax.grad(lambda x: jnp.sum(jremat.checkpoint(attention, "selective:modules=moe_act")(x)))(jnp.ones((4, 4)))
    (router, w_in, w_out), (x, key) = (p[0] for p in moe.params()), moe.inputs()
    layer = jremat.checkpoint(moe.moe_ffn, "selective:modules=core_attn")
    with pytest.raises(jremat.PolicyDoesNotApply, match=r"modules=core_attn.*an attention core"):
        jax.grad(lambda r: jnp.sum(layer(r, w_in, w_out, x, key) ** 2))(router)
    with pytest.raises(ValueError, match=r"modules='moe': unknown 'moe'; valid: core_attn, moe_act"):
        jremat.registry.resolve("selective:modules=moe")


def test_the_routing_keeps_top_ks_indices_not_the_router_logits(remat_engine):
    """A policy that saves ``top_k``'s outputs keeps the indices its derivative reads: under the
    classic engine the backward pass runs no ``top_k`` and keeps no ``[tokens, experts]`` logits;
    remat3 differentiates its recorded recomputation, which runs ``top_k`` again from the logits."""
    tokens, experts = 16, 64
    x, router = jnp.ones((tokens, 8)), jnp.linspace(-1.0, 1.0, 8 * experts).reshape(8, experts)

    def route(router, x):
        values, indices = jax.lax.top_k(x @ router, 2)
        return jnp.sum(jax.nn.softmax(values) * jnp.take_along_axis(x, indices % 8, axis=1))

    layer = jremat.checkpoint(route, "every_k:k=1")
    runs = live_runs(jax.make_jaxpr(jax.grad(layer))(router, x), ("top_k",))
    logits_kept = [a for a, _ in saved_residuals(layer, router, x) if a.shape == (tokens, experts)]
    if remat_engine == "classic":
        assert runs == 1 and not logits_kept, (runs, logits_kept)
    else:
        assert runs == 2 and logits_kept, (runs, logits_kept)
    assert jnp.array_equal(jax.grad(layer)(router, x), jax.grad(route)(router, x))
