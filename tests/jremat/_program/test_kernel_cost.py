"""Kernels priced as first-class ops: JAX's Pallas flash attention by its body times its grid
(within 10% of the analytic attention FLOPs), a ``CostEstimate`` where a kernel gives one, an FFI
call by its declaration (a real FFI target compiled here) or as expensive; the policies that
price (``skip_cheap``, ``every_k``) keeping a kernel so that it runs once, the budget planner and
``fit_search``'s time model reading the same price."""

import ctypes
import os
import shutil
import subprocess
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import jremat
from jremat._engine.jaxpr import nested_jaxprs
from jremat._program import kernel_cost as _kernel_cost
from jremat._program.flops import jaxpr_flops
from jremat.attention import count_forward_passes, pallas_attention
from jremat.policies.every_k import EveryK
from jremat.policies.skip_cheap import SkipCheap
from tests.conftest import max_relative_error

TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _declarations_restored():
    """Each test starts from the declarations it found and leaves them so."""
    with _kernel_cost._LOCK:
        by_name, by_predicate = dict(_kernel_cost._BY_NAME), list(_kernel_cost._BY_PREDICATE)
    yield
    with _kernel_cost._LOCK:
        _kernel_cost._BY_NAME.clear()
        _kernel_cost._BY_NAME.update(by_name)
        _kernel_cost._BY_PREDICATE[:] = by_predicate


def _kernels(jaxpr) -> dict:
    """Every kernel equation of a jaxpr and the jaxprs nested in it (not into kernel bodies), by name."""
    found = {}
    stack = [getattr(jaxpr, "jaxpr", jaxpr)]
    while stack:
        for eqn in stack.pop().eqns:
            if _kernel_cost.is_kernel(eqn):
                found.setdefault(_kernel_cost.kernel_label(eqn), []).append(eqn)
            else:
                stack.extend(nested_jaxprs(eqn))
    return found


# --- JAX's Pallas flash attention, priced by its body times its grid -------------------------

#: Long enough that the diagonal key blocks, which a causal kernel computes in full, are 1/32 of
#: the work; wide enough heads that the softmax's elementwise FLOPs (counted) are a few percent.
BATCH, SEQ, HEADS, HEAD_DIM, BLOCK = 1, 1024, 2, 64, 32


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_pallas_flash_attention_costs_its_analytic_flops(causal):
    """Forward 4·b·h·s²·d (causal: half); JAX's backward kernel 14·b·h·s²·d (causal: half): it
    runs seven s x s x d matmuls, recomputing q·kᵀ and dO·vᵀ in its dq pass. Traced, not run."""
    spec = jax.ShapeDtypeStruct((BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32)
    attend = lambda q, k, v: pallas_attention(q, k, v, causal=causal, block_size=BLOCK, interpret=True)
    analytic = 4 * BATCH * HEADS * SEQ**2 * HEAD_DIM / (2 if causal else 1)

    forward = jax.make_jaxpr(attend)(spec, spec, spec)
    assert abs(jaxpr_flops(forward) / analytic - 1) <= 0.10, jaxpr_flops(forward) / analytic

    grad = jax.make_jaxpr(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))(spec, spec, spec)
    kernels = _kernels(grad)
    costs = {name: _kernel_cost.kernel_cost(eqns[0]) for name, eqns in kernels.items()}
    assert {c.source for c in costs.values()} == {_kernel_cost.BODY_TIMES_GRID}  # mha gives no CostEstimate
    assert abs(costs["mha_forward"].flops / analytic - 1) <= 0.10
    assert abs(costs["mha_backward"].flops / (3.5 * analytic) - 1) <= 0.10
    expected_total = sum(c.flops for c in costs.values())
    assert jaxpr_flops(grad) >= expected_total  # the gradient's own ops come on top


def test_causal_attention_counts_the_blocks_the_kernel_runs():
    """The causal kernel's loop over key blocks runs to its query block, a bound computed from
    ``program_id``: block i runs i + 1 key blocks, so the kernel costs (n + 1) / (2n) of the
    unmasked one, with n the number of query blocks."""
    spec = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.float32)

    def forward_cost(causal):
        attend = lambda q, k, v: pallas_attention(q, k, v, causal=causal, block_size=32, interpret=True)
        (eqn,) = _kernels(jax.make_jaxpr(attend)(spec, spec, spec))["mha_forward"]
        return _kernel_cost.kernel_cost(eqn).flops

    n = 128 // 32
    assert forward_cost(True) / forward_cost(False) == pytest.approx((n + 1) / (2 * n), rel=0.02)


def _add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def _add_one(cost_estimate=None):
    return pl.pallas_call(
        _add_one_kernel,
        out_shape=jax.ShapeDtypeStruct((32,), jnp.float32),
        grid=(4,),
        in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
        out_specs=pl.BlockSpec((8,), lambda i: (i,)),
        interpret=True,
        cost_estimate=cost_estimate,
        name="add_one",
    )


def test_a_pallas_kernel_costs_its_body_times_its_grid():
    """One add per element of a block of 8, on a grid of 4; loads and stores are free."""
    x = jax.ShapeDtypeStruct((32,), jnp.float32)
    (eqn,) = _kernels(jax.make_jaxpr(_add_one())(x))["add_one"]
    cost = _kernel_cost.kernel_cost(eqn)
    assert (cost.flops, cost.bytes_accessed, cost.source) == (32.0, 256.0, _kernel_cost.BODY_TIMES_GRID)
    assert jremat.program_flops(_add_one(), x) == 32.0


def test_a_pallas_kernel_costs_its_cost_estimate():
    estimate = pl.CostEstimate(flops=1000, transcendentals=24, bytes_accessed=512)
    x = jax.ShapeDtypeStruct((32,), jnp.float32)
    (eqn,) = _kernels(jax.make_jaxpr(_add_one(estimate))(x))["add_one"]
    assert jremat.kernel_cost(eqn) == jremat.KernelCost("add_one", "pallas_call", 1024.0, 512.0, False, "cost estimate")


def test_a_declaration_wins_over_the_kernel_body():
    jremat.register_kernel("add_one", flops=lambda ins, outs: 7.0 * ins[0].shape[0], bytes_accessed=3)
    x = jax.ShapeDtypeStruct((32,), jnp.float32)
    assert jremat.program_flops(_add_one(), x) == 7.0 * 32


# --- skip_cheap and every_k keep the Pallas kernel ---------------------------------------------

B, S, H, D = 1, 16, 2, 8
E = H * D


def _block(p, x):
    q, k, v = ((x @ p[w]).reshape(B, S, H, D) for w in ("wq", "wk", "wv"))
    x = x + pallas_attention(q, k, v, causal=True, block_size=8, interpret=True).reshape(B, S, E) @ p["wo"]
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def _layer_params(seed):
    shapes = {"wq": (E, E), "wk": (E, E), "wv": (E, E), "wo": (E, E), "w1": (E, 4 * E), "w2": (4 * E, E)}
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {n: jax.random.normal(k, s) / np.sqrt(s[0]) for k, (n, s) in zip(keys, shapes.items())}


def _stacked_loss(block, spec):
    """Mean square of ``block`` applied once per layer, each checkpointed under ``spec``."""
    layer = block if spec == "none" else jremat.checkpoint(block, spec)

    def loss(layers, x):
        for p in layers:
            x = layer(p, x)
        return (x**2).mean()

    return loss


def _two_layer_loss(spec):
    return _stacked_loss(_block, spec)


@pytest.fixture(scope="module")
def two_layers():
    return [_layer_params(i) for i in range(2)], jax.random.normal(jax.random.key(9), (B, S, E))


def _forward_kernels_per_layer(spec, layers, x) -> float:
    jaxpr = jax.make_jaxpr(jax.value_and_grad(_two_layer_loss(spec)))(layers, x)
    return count_forward_passes(jaxpr) / len(layers)


@pytest.mark.heavy
def test_skip_cheap_keeps_the_pallas_kernel_and_runs_it_once(remat_engine, two_layers):
    layers, x = two_layers
    assert [_forward_kernels_per_layer(s, layers, x) for s in ("none", "skip_cheap", "full")] == [1, 1, 2]
    ref_loss, ref_grads = jax.value_and_grad(_two_layer_loss("none"))(layers, x)
    loss, grads = jax.value_and_grad(_two_layer_loss("skip_cheap"))(layers, x)
    assert abs(float(loss) - float(ref_loss)) <= TOLERANCE * abs(float(ref_loss))
    assert max_relative_error(grads, ref_grads) <= TOLERANCE


def test_skip_cheap_with_kernels_priced_free_runs_the_kernel_again(remat_engine, two_layers, monkeypatch):
    """The price is what keeps it: a kernel priced at nothing is cheap, and recomputed."""
    monkeypatch.setattr(_kernel_cost, "kernel_flops", lambda eqn: 0.0 if _kernel_cost.is_kernel(eqn) else None)
    layers, x = two_layers
    assert _forward_kernels_per_layer("skip_cheap", layers, x) == 2


def test_every_k_numbers_the_kernel_as_a_compute_op(two_layers):
    """every_k:skip_cheap=true numbers the forward rule that runs the kernel (its output and
    log-sum-exp), priced by the kernel; k=1 keeps it, so it runs once."""
    layers, x = two_layers
    program = jremat.trace_program(jremat.kernels.split_attention_kernels(_block), layers[0], x)
    numbered = EveryK(1, skip_cheap=True).numbered_ops(program)
    (kernel_op,) = [op for op in numbered if op.primitive == "custom_vjp_call"]
    (eqn,) = _kernels(program.closed_jaxpr.jaxpr.eqns[kernel_op.index].params["call_jaxpr"])["mha_forward"]
    assert kernel_op.flops >= _kernel_cost.kernel_cost(eqn).flops > 0
    assert len(kernel_op.out_shapes) == 2  # output and log-sum-exp
    assert _forward_kernels_per_layer("every_k:k=1,skip_cheap=true", layers, x) == 1


# --- FFI calls: declared, or expensive ---------------------------------------------------------

DOUBLE_TARGET = "jremat_test_double"
DOUBLE_SOURCE = r"""
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
static ffi::Error Double(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  for (size_t i = 0; i < x.element_count(); ++i) y->typed_data()[i] = 2.0f * x.typed_data()[i];
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DoubleHandler, Double, ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
"""


@pytest.fixture(scope="module")
def double_ffi_target(tmp_path_factory):
    """A real FFI target, compiled here (a C++ handler against the XLA FFI headers jaxlib ships)
    and registered for the CPU: ``y = 2 * x``."""
    compiler = shutil.which("g++")
    if compiler is None or not os.path.isdir(jax.ffi.include_dir()):
        pytest.skip("no g++ or no XLA FFI headers to build an FFI target with")
    folder = tmp_path_factory.mktemp("ffi")
    (folder / "double.cc").write_text(DOUBLE_SOURCE)
    library = folder / "double.so"
    subprocess.run(
        [compiler, "-O0", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", "double.cc", "-o", library],
        cwd=folder,
        check=True,
        capture_output=True,
    )
    handler = ctypes.cdll.LoadLibrary(str(library)).DoubleHandler
    jax.ffi.register_ffi_target(DOUBLE_TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    return DOUBLE_TARGET


def _with_ffi(target):
    """An FFI call between two matmuls: ``tanh(2 * (x @ w)) @ w``."""

    def fn(x, w):
        y = x @ w
        y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(y.shape, y.dtype))(y)
        return jnp.tanh(y) @ w

    return fn


def _ffi_op(program):
    (op,) = [op for op in program.ops if op.primitive == "ffi_call"]
    return op


X_W = (jnp.ones((8, 16), jnp.float32), jnp.full((16, 16), 0.25, jnp.float32))


@pytest.mark.heavy
def test_a_declared_ffi_call_is_priced_by_its_declaration(double_ffi_target):
    fn = _with_ffi(double_ffi_target)
    np.testing.assert_array_equal(jax.jit(fn)(*X_W), jnp.tanh(2 * (X_W[0] @ X_W[1])) @ X_W[1])  # a real target
    matmuls = 2 * (2 * 8 * 16 * 16)
    tanh = 8 * 16
    jremat.register_kernel(double_ffi_target, flops=lambda ins, outs: float(ins[0].size), bytes_accessed=0)
    assert jremat.program_flops(fn, *X_W) == matmuls + tanh + 8 * 16
    op = _ffi_op(jremat.trace_program(fn, *X_W))
    assert (op.flops, op.counted) == (8 * 16, True)
    assert op.index not in SkipCheap(8.0).plan(jremat.trace_program(fn, *X_W)).save  # declared cheap: recomputed


def test_an_undeclared_ffi_call_is_priced_as_expensive(double_ffi_target):
    fn = _with_ffi(double_ffi_target)
    program = jremat.trace_program(fn, *X_W)
    op = _ffi_op(program)
    io_bytes = 2 * 8 * 16 * 4
    assert op.flops == _kernel_cost.UNDECLARED_FLOPS_PER_BYTE * io_bytes
    assert op.index in SkipCheap(8.0).plan(program).save
    assert op.index in EveryK(1, skip_cheap=True).plan(program).save


def test_a_predicate_declares_every_kernel_it_matches():
    """Names are looked up before predicates. Traced only: no target of these names exists."""
    is_fused = lambda name: name.startswith("fused_")
    jremat.register_kernel(is_fused, flops=100, attention=True)
    jremat.register_kernel("fused_exact", flops=5)
    x = jnp.ones((4,), jnp.float32)
    call = lambda name: lambda x: jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    assert jremat.program_flops(call("fused_gemm"), x) == 100
    assert jremat.program_flops(call("fused_exact"), x) == 5
    (eqn,) = _kernels(jax.make_jaxpr(call("fused_gemm"))(x))["fused_gemm"]
    assert jremat.kernel_cost(eqn).attention and jremat.kernel_cost(eqn).source == "declared"
    assert jremat.unregister_kernel(is_fused) and not jremat.unregister_kernel(is_fused)
    assert jremat.program_flops(call("fused_gemm"), x) == _kernel_cost.UNDECLARED_FLOPS_PER_BYTE * 32


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("",), {"flops": 1}, ValueError, "kernel name must not be empty"),
        ((3,), {"flops": 1}, TypeError, "match must be a kernel name"),
        (("k",), {"flops": "many"}, TypeError, "flops must be a function of"),
        (("k",), {"flops": -1.0}, TypeError, "flops must be a function of"),
        (("k",), {"flops": True}, TypeError, "flops must be a function of"),
        (("k",), {"flops": 1, "bytes_accessed": float("nan")}, TypeError, "bytes_accessed must be"),
        (("k",), {"flops": 1, "attention": "yes"}, TypeError, "attention must be True or False"),
    ],
)
def test_register_kernel_refuses_bad_input(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        jremat.register_kernel(*args, **kwargs)
    assert "k" not in _kernel_cost._BY_NAME


def test_a_declared_cost_that_gives_no_number_is_an_error():
    jremat.register_kernel("bad_cost", flops=lambda ins, outs: -5)
    x = jnp.ones((4,), jnp.float32)
    call = lambda x: jax.ffi.ffi_call("bad_cost", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    with pytest.raises(ValueError, match="kernel 'bad_cost': its declared flops .* gave -5"):
        jremat.program_flops(call, x)


def test_declaring_waits_for_the_registry_lock():
    """Every change to the declarations happens under the module's lock."""
    declaring = threading.Thread(target=jremat.register_kernel, args=("locked_out",), kwargs={"flops": 1})
    with _kernel_cost._LOCK:
        declaring.start()
        declaring.join(timeout=0.2)
        assert declaring.is_alive() and "locked_out" not in _kernel_cost._BY_NAME
    declaring.join()
    assert _kernel_cost._declaration("locked_out").flops == 1


def test_declarations_from_many_threads_are_all_kept():
    threads, each = 8, 200
    barrier = threading.Barrier(threads)
    predicates = [[(lambda name, t=t, i=i: False) for i in range(each)] for t in range(threads)]

    def declare(t):
        barrier.wait()
        for i, predicate in enumerate(predicates[t]):
            jremat.register_kernel(predicate, flops=1)
            jremat.register_kernel(f"thread{t}_{i}", flops=i)

    workers = [threading.Thread(target=declare, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    kept = {id(d.match) for d in _kernel_cost._BY_PREDICATE}
    assert kept >= {id(p) for row in predicates for p in row}
    assert all(_kernel_cost._declaration(f"thread{t}_{i}").flops == i for t in range(threads) for i in range(each))


def test_a_kernel_declared_attention_is_an_attention_forward_kernel():
    """Whatever its name: ``add_one`` is no attention kernel until declared one."""
    x = jax.ShapeDtypeStruct((32,), jnp.float32)
    (eqn,) = _kernels(jax.make_jaxpr(_add_one())(x))["add_one"]
    assert not jremat.kernels.is_attention_forward_kernel(eqn)
    jremat.register_kernel("add_one", flops=32, attention=True)
    assert jremat.kernels.is_attention_forward_kernel(eqn)


def _square_through_ffi(target):
    """``x²`` as a ``custom_vjp`` whose forward rule runs the FFI kernel (``d = 2x``) and hands
    ``d`` to its backward rule as a residual the caller never sees: ``x · d / 2``, gradient ``g · d``."""
    double = lambda x: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    @jax.custom_vjp
    def square(x):
        return x * double(x) / 2

    def square_fwd(x):
        d = double(x)
        return x * d / 2, d

    square.defvjp(square_fwd, lambda d, g: (g * d,))

    def block(w, x):
        return square(jnp.tanh(x @ w)) @ w

    return lambda spec: _stacked_loss(block, spec)


def test_skip_cheap_keeps_a_custom_vjp_ffi_kernel_declared_attention(remat_engine, double_ffi_target):
    """Declared ``attention=True``, the kernel's ``custom_vjp`` is split: its residual is an output
    ``skip_cheap`` keeps (the FFI call priced by its declaration), so the kernel runs once per
    layer, as under ``none``, and ``full`` runs it twice (the count sees a re-run)."""
    jremat.register_kernel(double_ffi_target, flops=1e6, attention=True)
    loss = _square_through_ffi(double_ffi_target)
    ws = [jnp.full((16, 16), 0.1 * (i + 1), jnp.float32) for i in range(2)]
    x = jnp.linspace(-1.0, 1.0, 8 * 16, dtype=jnp.float32).reshape(8, 16)
    runs = lambda spec: count_forward_passes(jax.make_jaxpr(jax.value_and_grad(loss(spec)))(ws, x)) / len(ws)
    assert [runs(spec) for spec in ("none", "skip_cheap", "full")] == [1, 1, 2]
    ref_loss, ref_grads = jax.value_and_grad(loss("none"))(ws, x)
    got_loss, grads = jax.value_and_grad(loss("skip_cheap"))(ws, x)
    assert abs(float(got_loss) - float(ref_loss)) <= TOLERANCE * abs(float(ref_loss))
    assert max_relative_error(grads, ref_grads) <= TOLERANCE


def test_skip_cheap_without_the_split_runs_the_ffi_kernel_again(remat_engine, double_ffi_target, monkeypatch):
    """The split is what keeps the residual: without it ``skip_cheap`` keeps the ``custom_vjp``'s
    output alone, and the backward pass runs the kernel again for its residual."""
    monkeypatch.setattr(jremat.kernels, "split_attention_kernels", lambda fn: fn)
    jremat.register_kernel(double_ffi_target, flops=1e6, attention=True)
    loss = _square_through_ffi(double_ffi_target)
    ws = [jnp.full((16, 16), 0.1 * (i + 1), jnp.float32) for i in range(2)]
    x = jnp.ones((8, 16), jnp.float32)
    assert count_forward_passes(jax.make_jaxpr(jax.value_and_grad(loss("skip_cheap")))(ws, x)) / len(ws) == 2


def test_the_budget_planner_keeps_the_kernel_its_price_makes_costliest(double_ffi_target):
    """Every op's output is 512 bytes; a budget of one keeps the costliest to recompute: the
    undeclared FFI call (64 FLOPs per byte in and out), or, declared cheap, a matmul."""
    from jremat._plan.planner import ops_to_keep_within_budget

    fn = _with_ffi(double_ffi_target)
    program = jremat.trace_program(fn, *X_W)
    assert ops_to_keep_within_budget(program, "512B") == {_ffi_op(program).index}
    jremat.register_kernel(double_ffi_target, flops=1)
    program = jremat.trace_program(fn, *X_W)
    (kept,) = ops_to_keep_within_budget(program, "512B")
    assert program.ops[kept].primitive == "dot_general"


def test_fit_search_times_a_step_with_the_kernel_priced(double_ffi_target):
    """fit_search's time model reads the traced step's FLOPs, the kernel's declared price included."""
    from jremat._plan.probe import _compile

    jremat.register_kernel(double_ffi_target, flops=1e6)
    step = jax.jit(_with_ffi(double_ffi_target))
    flops = _compile(jremat.FitStep(step, X_W))[1]
    assert flops == 2 * (2 * 8 * 16 * 16) + 8 * 16 + 1e6


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_skip_cheap_runs_the_reference_models_pallas_kernel_once_per_layer(remat_engine, scan_layers):
    """The reference GPT (Flax NNX) under ``--attention pallas``: as ``none``, not as ``full``."""
    from jremat.models import preset
    from jremat.train.programs import attention_forward_passes

    cfg = lambda spec: preset(
        "tiny",
        attention="pallas",
        attention_block_size=8,
        remat_policy=spec,
        attn_dropout=0.0,
        resid_dropout=0.0,
        scan_layers=scan_layers,
    )
    assert [attention_forward_passes(cfg(spec), 2) for spec in ("skip_cheap", "full")] == [1, 2]
