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
from jremat.testing import RematMismatch, assert_remat_exact, policies
from tests.conftest import run_under_engine
from tests.jremat import moe_user_models as moe
from tests.jremat.test_testing import FreshKeyOnRecompute

RAGGED_DOT = "ragged_dot_general"


def grouped_matmuls(jaxpr, trips: int = 1) -> int:
    """Grouped matmul equations in ``jaxpr`` and every jaxpr nested in it, a ``scan`` body's times its length.

    Written here on purpose, apart from ``jremat.kernels.count_grouped_matmuls``: the truth of the tests."""
    count = 0
    for eqn in jaxpr.eqns:
        count += trips * (eqn.primitive.name == RAGGED_DOT)
        inner = trips * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                body = getattr(sub, "jaxpr", sub)
                if hasattr(body, "eqns"):
                    count += grouped_matmuls(body, inner)
    return count


def gradient_grouped_matmuls(layer_policy, layout) -> int:
    """Grouped matmuls in the traced gradient of the 2-layer MoE, each layer checkpointed by ``layer_policy``."""
    layer = moe.moe_ffn if layer_policy is None else jremat.checkpoint(moe.moe_ffn, layer_policy)
    loss = (moe.scanned_loss if layout == "scanned" else moe.unrolled_loss)(layer)
    x, key = moe.inputs()
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(moe.params(), x, key)
    return grouped_matmuls(jaxpr.jaxpr)


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
def test_dots_skip_cheap_and_selective_run_no_grouped_matmul_again(remat_engine, layout):
    none = gradient_grouped_matmuls(None, layout)
    assert none == moe.LAYERS * 6  # two forward, four backward per layer
    for spec in ("dots", "dots_no_batch", "skip_cheap", "selective", "every_k:k=1"):
        assert gradient_grouped_matmuls(spec, layout) == none, spec
    # Recomputing everything runs both expert matmuls of each layer again (the combine's gradient
    # with respect to the router's weights reads the second one's output).
    assert gradient_grouped_matmuls("full", layout) == none + 2 * moe.LAYERS


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
        re.search(r": (\d+) grouped matmuls \(jax.lax.ragged_dot\) in the gradient, none: (\d+)", reruns[0]).groups(),
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
    [pytest.param("classic", *p.values, id=f"classic-{p.id}", marks=p.marks) for p in policies()]
    + [pytest.param("remat3", *p.values, id=f"remat3-{p.id}", marks=p.marks) for p in _few(policies())],
)
def test_every_policy_exact_on_a_scanned_moe(engine, policy):
    args = (moe.params(), *moe.inputs())
    stack = moe.scanned_loss
    with run_under_engine(engine):
        assert_remat_exact(stack(moe.moe_ffn), policy, *args, argnums=(0, 1), **TOLERANCE, decorate=_per_layer(stack))


@pytest.mark.parametrize("policy", _few(policies()))
def test_every_policy_exact_on_an_unrolled_moe(policy):
    args = (moe.params(), *moe.inputs())
    stack = moe.unrolled_loss
    assert_remat_exact(stack(moe.moe_ffn), policy, *args, argnums=(0, 1), **TOLERANCE, decorate=_per_layer(stack))


@pytest.mark.parametrize("policy", _few(policies(names.MOE_NAMES)))
def test_every_policy_exact_on_an_nnx_moe(policy):
    x, key = moe.inputs()
    assert_remat_exact(moe.NnxMoE(), policy, x, key, **TOLERANCE)


@pytest.mark.parametrize("policy", _few(policies()))
def test_every_policy_exact_on_an_equinox_moe(policy):
    x, key = moe.inputs()
    assert_remat_exact(lambda m, h, k: jnp.sum(m(h, k) ** 2), policy, moe.EqxMoE(), x, key, **TOLERANCE)


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
    """On the reference MoE model the activation is jremat.ops.gelu, a nested checkpoint: selective
    looks through it, so the saved residuals fall by at least the experts' activation outputs."""
    from jremat.models import preset
    from jremat.train.programs import loss_program

    cfg = preset("tiny", moe_experts=4, moe_top_k=2, attn_dropout=0.0, resid_dropout=0.0)
    batch = 2
    saved = {}
    for spec in ("none", "selective"):
        loss, args = loss_program(cfg.replace(remat_policy=spec), batch, cfg.max_seq_len)
        saved[spec] = jremat.saved_residuals_report(loss, *args, param_argnums=(0,)).computed_bytes
    activation_bytes = cfg.n_layers * batch * cfg.max_seq_len * cfg.moe_top_k * cfg.d_ff * 4
    assert saved["none"] - saved["selective"] >= activation_bytes, saved
