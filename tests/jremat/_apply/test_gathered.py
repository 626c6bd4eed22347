"""``keep_gathered=true`` adds the gathered weights to what a policy saves and changes nothing else
the policy does: its kernel split, its checks of the names it needs, its saves inside scan bodies.
(The gathered weights themselves, on 8 devices: tests/jremat/_measure/test_collectives.py.)"""

import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec

import jremat
from jremat import kernels
from jremat._apply import gathered as _gathered
from jremat._engine import jax_compat as _jax_compat
from jremat._engine import lowering as _engine
from tests.jremat import kernel_models as km


def _kernel_runs(spec: str) -> int:
    layer, (w, x) = km.jax_layer(km.flash), km.inputs()
    w = w[0]
    primal = jax.make_jaxpr(layer)(w, x)
    loss = lambda w, x: jnp.sum(jremat.checkpoint(layer, spec)(w, x))
    return kernels.count_kernel_runs(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(w, x), primal=primal)["flash"]


@pytest.mark.parametrize("spec", ["selective", "names:save=kernel_residuals", "skip_cheap"])
def test_the_inner_policys_kernel_split_is_kept(remat_engine, spec):
    assert _kernel_runs(spec + (":" if ":" not in spec else ",") + "keep_gathered=true") == _kernel_runs(spec) == 1


def test_the_inner_policys_name_check_is_kept():
    with pytest.raises(jremat.PolicyDoesNotApply, match="nosuchname"):
        jax.eval_shape(jremat.checkpoint(lambda x: jnp.sin(x) * 2, "names:save=nosuchname,keep_gathered=true"), 1.0)


def _scan_block(ws, x):
    def body(h, w):
        return checkpoint_name(jnp.tanh(h @ w), "hid"), None

    return jax.lax.scan(body, x, ws)[0]


@pytest.mark.parametrize("spec", ["dots", "names:save=hid"])
def test_the_inner_policys_saves_inside_a_scan_are_kept(remat_engine, spec):
    ws, x = jnp.ones((4, 16, 16)) * 0.01, jnp.ones((4, 16))

    def residual_bytes(s):
        return sum(
            a.size * a.dtype.itemsize for a, _ in _jax_compat.saved_residuals(jremat.checkpoint(_scan_block, s), ws, x)
        )

    kept = residual_bytes(spec + ("," if ":" in spec else ":") + "keep_gathered=true")
    assert kept == residual_bytes(spec) > residual_bytes("full")


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_a_gathered_weight_is_found_on_auto_and_explicit_axes(axis_type):
    """Auto axes gather through a sharding constraint; explicit axes (``jax.make_mesh``'s default)
    through ``reshard``, where a sharding constraint changes no type and gathers nothing."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from jremat._apply.gathered import gathered_weights
    from jremat._program.program import trace_program

    explicit = axis_type == "explicit"
    mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(AxisType.Explicit if explicit else AxisType.Auto,))
    whole = NamedSharding(mesh, PartitionSpec())
    gather = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint

    def block(w, h):
        return h + jnp.tanh(h @ gather(w, whole))

    w = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, PartitionSpec("fsdp", None)))
    assert gathered_weights(trace_program(block, w, jnp.ones((2, 4)))) == frozenset({0})


def test_gathered_vectors_are_found_where_they_meet_the_activations_inside_calls():
    """A LayerNorm's gathered scale and bias (inside ``jremat.ops.layer_norm``'s own checkpoint)
    and a gathered weight used in a ``jit`` are found; a constrained activation is not."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from jremat import ops
    from jremat._apply.gathered import gathered_weights
    from jremat._program.program import trace_program

    mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(AxisType.Auto,))
    whole = lambda v: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, PartitionSpec()))

    def block(p, h):
        h = whole(h)  # an activation's placement: not a gathered weight
        y = ops.layer_norm(h, whole(p["scale"]), whole(p["bias"]))
        return h + jax.jit(lambda y, w: y @ w)(y, whole(p["w"]))

    p = {"bias": jnp.zeros(4), "scale": jnp.ones(4), "w": jnp.ones((4, 4))}
    program = trace_program(block, p, jnp.ones((2, 4)))
    found = gathered_weights(program)
    eqns = program.closed_jaxpr.jaxpr.eqns
    assert sorted(eqns[i].outvars[0].aval.shape for i in found) == [(4,), (4,), (4, 4)]


def test_adding_the_gathered_tag_to_a_jax_policy_keeps_it_a_jax_policy_twice_over():
    """The dots policies stay dots policies (with the tag among their names), also when the tag is
    added to a policy that has it already; a name list keeps its names."""
    policies = jax.checkpoint_policies
    for dots in (policies.dots_saveable, policies.dots_with_no_batch_dims_saveable):
        once = _gathered._saving_gathered(dots)
        twice = _gathered._saving_gathered(once)
        for policy in (once, twice):
            assert type(policy) is _engine.DotsAndNames
            assert policy.saveable_names == frozenset({_gathered.GATHERED_TAG})
            assert policy.only_if_no_batch_dims == dots.only_if_no_batch_dims
    names = _gathered._saving_gathered(policies.save_only_these_names("q", "k"))
    assert set(names.saveable_names) == {"q", "k", _gathered.GATHERED_TAG}


def _gathered_block(w, h):
    whole = jax.sharding.NamedSharding(jax.make_mesh((1,), ("fsdp",), axis_types=(AxisType.Auto,)), PartitionSpec())
    return h + jnp.tanh(h @ jax.lax.with_sharding_constraint(w, whole))


@pytest.mark.parametrize("spec", ["full:keep_gathered=true", "dots:keep_gathered=true"])
def test_what_keep_gathered_binds_is_attributed_to_the_users_line(remat_engine, spec):
    """The gathered-weight tags, and the equations re-bound to add them, carry the model's source
    line (a timeline's source column, an HLO op's metadata), not a line of the modules that trace
    and re-bind the model (the tie's own equations are jremat's, and say so)."""
    loss = lambda w, h: jnp.sum(jremat.checkpoint(_gathered_block, spec)(w, h))
    lowered = jax.jit(jax.grad(loss)).lower(jnp.ones((4, 4)), jnp.ones((2, 4)))
    paths = set(re.findall(r'loc\("([^"]+\.py)":\d+', lowered.as_text(debug_info=True)))
    assert os.path.basename(__file__) in {os.path.basename(s) for s in paths}
    tracing = ("_engine/interpreter.py", "_apply/gathered.py", "_program/program.py", "_engine/lowering.py")
    assert not {s for s in paths if s.endswith(tracing)}, paths
