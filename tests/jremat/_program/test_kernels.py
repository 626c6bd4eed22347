"""Kernels jremat did not write (Pallas, FFI, a custom_vjp written in JAX): each is counted by name in
the gradient, every policy that runs one again is named by explain and jremat.testing, and selective
and names keep a kernel's output and statistics so that it runs once per layer, under both engines,
in plain JAX, Flax NNX and Linen, layers unrolled or scanned."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
import jremat.testing
from jremat import kernels
from jremat._program import kernels as _kernels_impl
from tests.conftest import single_function_policies
from tests.jremat import kernel_models as km


def forward_runs(framework, kernel, spec, scan) -> int:
    """Runs of the kernel's forward in the value-and-gradient, a kernel in the layer scan once per layer."""
    loss, params, x = km.model(framework, kernel, spec, scan)
    primal = jax.make_jaxpr(km.model(framework, kernel, None, scan)[0])(params, x)
    grad = jax.make_jaxpr(jax.value_and_grad(loss))(params, x)
    return kernels.count_kernel_runs(grad, primal=primal, loop_iterations=True).get(km.FORWARD_NAMES[kernel], 0)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("kernel", ["flash", "pallas"])
@pytest.mark.heavy
def test_selective_runs_the_kernel_once_per_layer_in_plain_jax(remat_engine, kernel, scan):
    assert forward_runs("jax", kernel, None, scan) == km.LAYERS
    assert forward_runs("jax", kernel, "selective", scan) == km.LAYERS
    # skip_cheap keeps it by its price: a scan costs its body times its length.
    assert forward_runs("jax", kernel, "skip_cheap", scan) == km.LAYERS
    assert forward_runs("jax", kernel, "full", scan) == 2 * km.LAYERS  # the count can tell


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("kernel", ["flash", "pallas"])
@pytest.mark.parametrize("framework", ["nnx", "linen"])
@pytest.mark.heavy
def test_selective_runs_the_kernel_once_per_layer_in_flax(framework, kernel, scan):
    assert forward_runs(framework, kernel, "selective", scan) == km.LAYERS
    assert forward_runs(framework, kernel, "skip_cheap", scan) == km.LAYERS
    assert forward_runs(framework, kernel, "full", scan) == 2 * km.LAYERS


def _grads(loss, params, x):
    return jax.jit(jax.grad(loss))(params, x)


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(w)))
        assert jnp.allclose(g, w, rtol=1e-5, atol=1e-5 * scale), float(jnp.max(jnp.abs(g - w)))


@pytest.mark.parametrize(
    ("kernel", "scan"),
    [("flash", False), ("flash", True), ("pallas", True)],
    ids=["flash-unrolled", "flash-scan", "pallas-scan"],
)
@pytest.mark.heavy
def test_selective_gradients_equal_none_in_plain_jax(remat_engine, kernel, scan):
    loss, params, x = km.model("jax", kernel, "selective", scan)
    _assert_close(_grads(loss, params, x), _grads(km.model("jax", kernel, None, scan)[0], params, x))


@pytest.mark.parametrize("kernel", ["flash", "pallas"])
@pytest.mark.parametrize("framework", ["nnx", "linen"])
@pytest.mark.heavy
def test_selective_gradients_equal_none_in_flax(framework, kernel):
    loss, params, x = km.model(framework, kernel, "selective", True)
    _assert_close(_grads(loss, params, x), _grads(km.model(framework, kernel, None, True)[0], params, x))


@pytest.mark.slow  # the whole matrix; the suite runs the scanned layout on the classic engine above
@pytest.mark.parametrize("spec", ["selective", "skip_cheap"])
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("kernel", ["flash", "pallas"])
@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_gradients_equal_none_in_flax_in_every_layout_under_both_engines(remat_engine, framework, kernel, scan, spec):
    loss, params, x = km.model(framework, kernel, spec, scan)
    _assert_close(_grads(loss, params, x), _grads(km.model(framework, kernel, None, scan)[0], params, x))


@pytest.mark.parametrize("kernel", ["flash", "pallas"])
def test_selective_compiled_temp_is_at_most_none(kernel):
    temps = []
    for spec in ("selective", None):
        loss, params, x = km.model("jax", kernel, spec, True)
        report = jremat.memory_report(jax.grad(loss), params, x)
        if not report.available:
            pytest.skip("the backend reports no compiled memory")
        temps.append(report.temp_bytes)
    assert temps[0] <= temps[1]


def _stack(attn):
    """The layers in one scan, the whole scan checkpointed: the kernel runs inside a scan body of
    the checkpointed function."""
    layer = km.jax_layer(attn)

    def stack(w, x):
        return jax.lax.scan(lambda h, wi: (layer(wi, h), None), x, w)[0]

    return stack


@pytest.mark.parametrize("spec", ["selective", "names:save=kernel_residuals"])
def test_a_kernel_inside_a_checkpointed_scan_is_kept(remat_engine, spec):
    stack = _stack(km.flash)
    w, x = km.inputs()
    primal = jax.make_jaxpr(stack)(w, x)
    checkpointed = jremat.checkpoint(stack, spec)
    loss = lambda w: jnp.sum(checkpointed(w, x) ** 2)
    grad = jax.make_jaxpr(jax.value_and_grad(loss))(w)
    assert kernels.count_kernel_runs(grad, primal=primal, loop_iterations=True) == {"flash": km.LAYERS}
    _assert_close(jax.jit(jax.grad(loss))(w), jax.jit(jax.grad(lambda w: jnp.sum(stack(w, x) ** 2)))(w))


def test_the_split_disabled_is_caught(monkeypatch):
    """Without the split, selective cannot keep the kernel's log-sum-exp: the kernel runs again,
    and the counts, explain and jremat.testing all say so."""
    monkeypatch.setattr(_kernels_impl, "_split_call", lambda eqn, invals: None)
    assert forward_runs("jax", "flash", "selective", False) == 2 * km.LAYERS
    layer, (w, x) = km.jax_layer(km.flash), km.inputs()
    with pytest.raises(jremat.testing.KernelRerun, match="kernel flash: 2 runs, none: 1") as caught:
        jremat.testing.assert_kernels_not_rerun(layer, "selective", w[0], x)
    assert caught.value.runs == {"flash": (2, 1)}


def test_assert_kernels_not_rerun_passes_when_the_kernel_is_kept():
    layer, (w, x) = km.jax_layer(km.pallas), km.inputs()
    jremat.testing.assert_kernels_not_rerun(layer, "selective", w[0], x)
    with pytest.raises(jremat.testing.KernelRerun, match="kernel mha_forward: 2 runs, none: 1; selective keeps"):
        jremat.testing.assert_kernels_not_rerun(layer, "full", w[0], x)


# --- every built-in policy, named by explain when it runs a kernel again -------------------------


def _direct_runs(jaxpr, runs=None) -> collections.Counter:
    """Kernel runs in ``jaxpr`` and every jaxpr nested in it (a loop body once), counted without
    jremat: ``pallas_call`` by its name, ``ffi_call`` by its target, and :func:`km.flash`'s forward
    as the ``scan`` whose first three outputs are its running max, sum and accumulator."""
    runs = collections.Counter() if runs is None else runs
    flash_carry = [(km.B, km.H, km.S), (km.B, km.H, km.S), (km.B, km.H, km.S, km.D)]
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and [tuple(v.aval.shape) for v in eqn.outvars[:3]] == flash_carry:
            runs["flash"] += 1
        elif eqn.primitive.name in ("pallas_call", "ffi_call"):
            runs[str(eqn.params.get("name") or eqn.params.get("target_name"))] += 1
            continue  # not into a kernel's body
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _direct_runs(sub, runs)
    return runs


def _truth(layer, spec, w, x) -> dict:
    """Each kernel's runs (with the policy, without) in the value-and-gradient, counted directly
    (:func:`_direct_runs`)."""

    def runs(fn):
        loss = lambda w, x: jnp.sum(fn(w, x))
        return _direct_runs(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(w, x).jaxpr)

    base, remat = runs(layer), runs(jremat.checkpoint(layer, spec))
    return {k: (remat[k], base[k]) for k in remat.keys() | base.keys()}


#: Which built-in policies run the user kernel's forward again (a check that the truth is as known).
RERUNS = {"full", "dots", "dots_no_batch", "every_k", "names_except", "auto"}


@pytest.mark.parametrize("policy", single_function_policies(tags=["kernel_residuals"]))
@pytest.mark.heavy
def test_explain_names_every_kernel_a_built_in_policy_runs_again(policy):
    layer, (w, x) = km.jax_layer(km.flash), km.inputs()
    w = w[0]
    truth = _truth(layer, policy, w, x)
    explained = jremat.explain(layer, policy, w, x, compile=False)
    lines = [m for m in explained.messages if m.startswith("kernel re-run (")]
    reruns = {k: v for k, v in truth.items() if v[0] > v[1]}
    assert {k.name: (k.runs, k.baseline_runs) for k in explained.kernel_runs} == truth
    assert len(lines) == len(reruns)
    for name, (n, base) in reruns.items():
        assert any(f"kernel {name}: {n:g} runs, none: {base:g}; " in line for line in lines), lines
    name = jremat.registry.parse_spec(policy)[0]
    if name in RERUNS:
        assert reruns == {"flash": (2, 1)}
    elif name in ("none", "selective", "names", "offload", "skip_cheap"):
        assert reruns == {}


def _layer_stack(layer, spec):
    """The layers run by :func:`jremat.run_layers` under ``spec`` (a layer stack's entry, ``nested``)."""
    cfg = jremat.RematConfig(policy=spec)

    def make_layer_fn(policy):
        return lambda w, h, key: jremat.remat_at(layer, "block", cfg, policy=policy)(w, h)

    return lambda w, x: jremat.run_layers(make_layer_fn, w, x, None, cfg)


@pytest.mark.parametrize(("spec", "runs"), [("nested:block=1,layer=full", 3), ("nested:block=1,layer=selective", 2)])
def test_nested_is_named_when_its_groups_run_the_kernel_again(spec, runs):
    """``nested`` wraps a layer stack, not one function (explain_applied reads the stack). Each group
    saves only its input, so its backward pass runs the group's forward again, kernel included: once
    more than its layers' policy does."""
    w, x = km.inputs()
    layer = km.jax_layer(km.flash)
    explained = jremat.explain_applied(
        _layer_stack(layer, spec),
        w,
        x,
        policy=jremat.RematConfig(policy=spec).policy,  # the layers' policy; the label names the stack's
        label=spec,
        baseline=_layer_stack(layer, "none"),
        compile=False,
        layers=km.LAYERS,
    )
    lines = [m for m in explained.messages if m.startswith("kernel re-run (")]
    assert len(lines) == 1 and f"kernel flash: {runs} runs per layer, none: 1; selective keeps" in lines[0], lines


def test_an_ffi_kernel_is_named_by_its_target_and_kept_by_names():
    layer, (w, x) = km.jax_layer(km.ffi_kernel), km.inputs()
    explained = jremat.explain(layer, "full", w[0], x, compile=False)
    assert any(
        m.startswith("kernel re-run (full): kernel toy_kernel_fwd: 2 runs, none: 1; ") for m in explained.messages
    )
    assert _truth(layer, "names:save=kernel_residuals", w[0], x)["toy_kernel_fwd"] == (1, 1)
    with pytest.raises(ValueError, match="no attention core"):
        jremat.explain(layer, "selective", w[0], x, compile=False).messages and jremat.checkpoint(layer, "selective")(
            w[0], x
        )


def test_an_ffi_kernel_declared_attention_is_kept_by_selective():
    layer, (w, x) = km.jax_layer(km.ffi_kernel), km.inputs()
    jremat.register_kernel("toy_kernel_fwd", flops=1.0, attention=True)
    try:
        assert _truth(layer, "selective", w[0], x)["toy_kernel_fwd"] == (1, 1)
    finally:
        jremat.unregister_kernel("toy_kernel_fwd")


@jax.custom_vjp
def _scaled_by_scan(q, bias):
    """A kernel written in JAX (a scan) whose backward rule gives ``bias`` a NumPy cotangent."""
    total, _ = jax.lax.scan(lambda carry, row: (carry + jnp.exp(q * row).sum(), None), jnp.float32(0), q)
    return q * total + bias


def _scaled_by_scan_bwd(residuals, d_out):
    (q,) = residuals
    return d_out * 2.0, np.full(q.shape, 3.0, np.float32)  # JAX uses what the rule returns


_scaled_by_scan.defvjp(lambda q, bias: (_scaled_by_scan(q, bias), (q,)), _scaled_by_scan_bwd)


def test_a_split_kernel_keeps_a_numpy_cotangent_its_backward_rule_returns(remat_engine):
    def layer(w):
        return jnp.sin(_scaled_by_scan(jnp.tanh(w), w))

    w = jnp.linspace(0.1, 0.5, 8)
    want = jax.grad(lambda w: layer(w).sum())(w)
    got = jax.grad(lambda w: jremat.checkpoint(layer, "names:save=kernel_residuals")(w).sum())(w)
    # Read as a zero cotangent, the bias's 3s would be lost: a difference of 3 at every element.
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5
