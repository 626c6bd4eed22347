"""``keep_collectives``: no collective re-issued by a recomputation, whoever wrote it.

The 8-device figures come from one subprocess (tests/jremat/_apply/collectives_checks.py): a
direct count of the optimized HLO's collectives, independent of jremat, for every model, layout,
engine and policy. The finding, tagging and engine fallback are tested here on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jremat
from jremat._apply import collectives as _collectives
from jremat._engine import jax_compat
from jremat._measure import collectives as _measure
from tests.conftest import saved_residuals
from tests.jremat._apply.collectives_checks import ENGINES, LAYERS, LAYOUTS, MODELS
from tests.jremat._measure.test_collectives import _mesh_checks

#: The kind of collective each model's recomputation re-issues.
KIND = {
    "expert_parallel": "all-to-all",
    "tensor_parallel": "all-reduce",
    "fsdp_shard_map": "all-gather",
    "fsdp_tp_shard_map": "all-gather",
    "fsdp_constraint": "all-gather",
    "fsdp_xla": "all-gather",
}
KEEPING = ("full:keep_collectives=true", "dots:keep_collectives=true", "skip_cheap:keep_collectives=true")


@pytest.fixture(scope="module")
def checks():
    return _mesh_checks(
        "counts",
        "explain",
        "assert",
        "unplaced",
        "user_models",
        "nnx_fsdp",
        module="tests.jremat._apply.collectives_checks",
    )


def _count(checks, model, layout, engine, policy, kind=None) -> int:
    return checks["counts"][f"{model}/{layout}/{engine}/{policy}"]["hlo"].get(kind or KIND[model], [0, 0])[0]


@pytest.mark.heavy  # the 8-device subprocess
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_keep_collectives_reissues_none_of_the_models_collectives(checks, model, layout, engine):
    none = _count(checks, model, layout, engine, "none")
    full = _count(checks, model, layout, engine, "full")
    for policy in KEEPING:
        kept = _count(checks, model, layout, engine, policy)
        assert kept <= none and kept < full, (policy, kept, none, full)
    assert none == _count(checks, model, layout, engine, "full:keep_collectives=true")
    if model == "fsdp_tp_shard_map":  # both kinds at once: the all-reduces are kept too
        reduces = {p: _count(checks, model, layout, engine, p, "all-reduce") for p in ("none", "full", *KEEPING)}
        tie = LAYERS if layout == "unrolled" else 0  # the cotangent tie's 4-byte all-reduce per checkpoint
        limit = reduces["none"] + tie
        assert reduces["full"] > limit and all(reduces[p] <= limit for p in KEEPING), reduces
    if model == "fsdp_shard_map":  # the backward pass's own reduce-scatters stay
        assert _count(checks, model, layout, engine, "full:keep_collectives=true", "reduce-scatter") == _count(
            checks, model, layout, engine, "none", "reduce-scatter"
        )


@pytest.mark.heavy  # the same subprocess
def test_a_users_nnx_block_with_the_gathers_left_to_xla_reissues_none(checks):
    rows = checks["nnx_fsdp"]
    for layout in LAYOUTS:
        none, full, kept = (
            rows[f"{layout}/{p}"]["all_gathers"] for p in ("none", "full", "full:keep_collectives=true")
        )
        assert kept <= none < full, (layout, kept, none, full)
        assert all(rows[f"{layout}/{p}"]["grad_rel_error"] < 1e-5 for p in ("full", "full:keep_collectives=true"))
    # Scanned, the LayerNorm scale the backward pass reads is kept: XLA gathers it once, not twice.
    assert rows["scanned/full:keep_collectives=true"]["all_gathers"] < rows["scanned/none"]["all_gathers"]


@pytest.mark.heavy  # the same subprocess
def test_gradients_equal_no_remat_under_every_policy_model_layout_and_engine(checks):
    errors = {key: row["grad_rel_error"] for key, row in checks["counts"].items()}
    assert len(errors) == len(MODELS) * len(LAYOUTS) * len(ENGINES) * 6
    assert max(errors.values()) < 1e-6, {k: e for k, e in errors.items() if e >= 1e-6}


@pytest.mark.heavy  # the same subprocess
@pytest.mark.parametrize("kind", ["nnx", "equinox"])
def test_keep_collectives_on_flax_nnx_and_equinox_modules(checks, kind):
    rows = {key.split("/", 1)[1]: row for key, row in checks["user_models"].items() if key.startswith(kind + "/")}
    assert len(rows) == 3
    assert rows["full"]["all_to_all"] > rows["none"]["all_to_all"] == rows["full:keep_collectives=true"]["all_to_all"]
    assert max(row["grad_rel_error"] for row in rows.values()) < 1e-6


@pytest.mark.heavy  # the same subprocess
def test_gathers_xla_inserts_on_a_mesh_of_two_axes_are_named_not_miscounted(checks):
    unplaced = checks["unplaced"]
    assert unplaced["full"][0] > unplaced["none"][0]
    assert unplaced["full:keep_collectives=true"] == unplaced["full"]  # nothing kept, nothing claimed
    lines = [line for line in unplaced["describe"] if line.startswith("cannot keep the gather of")]
    assert [line.split(" (")[0] for line in lines] == [
        "cannot keep the gather of args[0][0]",
        "cannot keep the gather of args[0][1]",
    ]
    assert all("several axes (fsdp=4,tensor=2)" in line for line in lines)


@pytest.mark.heavy  # the same subprocess
@pytest.mark.parametrize("model", MODELS)
def test_explain_names_each_reissued_kind_and_the_key(checks, model):
    full = checks["explain"][f"{model}/full"]
    line = next(line for line in full.splitlines() if line.startswith("re-issued collectives"))
    assert KIND[model] in line and "per step per device" in line and "keep_collectives=true" in line
    kept = checks["explain"][f"{model}/full:keep_collectives=true"]
    assert not [line for line in kept.splitlines() if line.startswith("re-issued collectives")]
    kept_per_layer = 3 if model == "fsdp_xla" else 2  # fsdp_xla: two weights and a bias
    assert f"keeps the outputs of {kept_per_layer} {KIND[model]}s" in kept


@pytest.mark.heavy  # the same subprocess
def test_assert_no_reissued_collectives_checks_all_to_alls_by_default(checks):
    assert "re-issues 2 all-to-alls" in checks["assert"]["full"]
    assert checks["assert"]["full:keep_collectives=true"] == ""


# --- one device ------------------------------------------------------------------------------


def _expert_block(mesh):
    def inner(w, x):
        y = jax.lax.all_to_all(x.reshape(1, -1, x.shape[-1]), "i", 0, 0, tiled=True).reshape(x.shape)
        y = jnp.tanh(y @ w[0]) + jax.lax.psum(jnp.sum(y), "i")
        return jax.lax.all_to_all(y.reshape(1, -1, y.shape[-1]), "i", 0, 0, tiled=True).reshape(y.shape)

    return jax.shard_map(inner, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P("i"))


@pytest.fixture
def expert_block():
    mesh = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    w = jnp.asarray(np.random.RandomState(0).normal(size=(1, 8, 8)), jnp.float32)
    x = jnp.asarray(np.random.RandomState(1).normal(size=(4, 8)), jnp.float32)
    return _expert_block(mesh), w, x


def test_collective_counts_finds_them_inside_shard_map_and_scan_bodies(expert_block):
    block, w, x = expert_block
    program = jremat.trace_program(block, w, x)
    assert _collectives.collective_counts(program) == {"all-to-all": 2, "all-reduce": 1}

    def scanned(ws, x):
        return jax.lax.scan(lambda h, w: (block(w, h), None), x, ws)[0]

    program = jremat.trace_program(scanned, jnp.stack([w, w]), x)
    assert _collectives.collective_counts(program) == {"all-to-all": 2, "all-reduce": 1}  # per body, not per trip


def test_describe_match_names_what_is_kept_or_that_nothing_is(expert_block):
    block, w, x = expert_block
    policy = jremat.resolve("full:keep_collectives=true")
    assert isinstance(policy, _collectives.KeepCollectives)
    assert policy.describe_match(jremat.trace_program(block, w, x))[-1] == (
        "keeps the outputs of 1 all-reduce, 2 all-to-alls"
    )
    dense = jremat.trace_program(lambda w, x: jnp.tanh(x @ w[0]), w, x)
    assert "no collective to keep" in policy.describe_match(dense)[-1]


@pytest.mark.heavy  # three policies' gradients under each engine
@pytest.mark.parametrize("remat3", [False, True])
def test_the_tagged_block_saves_each_collective_output_and_keeps_gradients(expert_block, remat3):
    block, w, x = expert_block
    loss = lambda f: lambda w, x: jnp.sum(f(w, x) ** 2)
    with jax_compat.remat3_enabled(remat3):
        expected = jax.grad(loss(block), (0, 1))(w, x)
        for spec in ("full", "full:keep_collectives=true", "dots:keep_collectives=true"):
            got = jax.grad(loss(jremat.checkpoint(block, spec)), (0, 1))(w, x)
            for a, b in zip(got, expected):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        shapes = {
            spec: sorted(r.shape for r in jremat.saved_residuals_report(jremat.checkpoint(block, spec), w, x).residuals)
            for spec in ("full", "full:keep_collectives=true")
        }
        # The dispatch all-to-all's output [1, 4, 8] is kept in place of its input x (the combine's
        # and the psum's outputs are not read by the backward pass).
        assert shapes == {"full": [(1, 8, 8), (4, 8)], "full:keep_collectives=true": [(1, 4, 8), (1, 8, 8)]}


def test_a_checkpoint_holding_a_shard_map_is_differentiated_under_remat3(expert_block):
    # JAX's remat3 has no shard_map rule; jremat applies such a checkpoint with the classic engine.
    block, w, x = expert_block
    with jax_compat.remat3_enabled(True):
        grad = jax.grad(lambda w: jnp.sum(jremat.checkpoint(block, "full")(w, x)))(w)
        reference = jax.grad(lambda w: jnp.sum(block(w, x)))(w)
    np.testing.assert_allclose(grad, reference, rtol=1e-6, atol=1e-6)


def _abstract(mesh_shape: tuple[int, ...]):
    names = ("fsdp", "tensor")[: len(mesh_shape)]
    mesh = AbstractMesh(mesh_shape, names, axis_types=(AxisType.Auto,) * len(mesh_shape))
    return lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P()))


def test_xla_gathers_tells_weights_from_activations_and_gathers_them_whole_on_one_axis():
    s = _abstract((8,))
    residual = lambda w, x: x + jax.nn.gelu(x @ w[0]) @ w[1]
    found = _collectives.xla_gathers(jremat.trace_program(residual, (s(16, 32), s(32, 16)), s(64, 16)))
    assert sorted(found.placed) == [0, 1] and found.unplaced == ()  # x feeds the residual add too
    assert all(sharding.spec == P() for sharding in found.placed.values())
    # Both operands only feed the matmul: which one is the weight is not guessed (gathering the
    # activation whole would replicate it); both are named.
    found = _collectives.xla_gathers(jremat.trace_program(lambda w, x: jnp.tanh(x @ w), s(16, 16), s(4, 64, 16)))
    assert found.placed == {} and [line.split(" ")[0] for line in found.unplaced] == ["args[0]", "args[1]"]
    assert "which one is the weight is not known" in found.unplaced[0]


def _layer(p, x):
    """A residual layer: a LayerNorm (scale, bias), a matmul in a ``jit`` and a bias; and an
    input ``c`` broadcast and added, as an activation of fewer dimensions would be."""
    y = jremat.ops.layer_norm(x, p["scale"], p["norm_bias"])
    h = jax.jit(lambda y, w: y @ w)(y, p["w"]) + p["bias"][None, None, :]
    return x + jnp.tanh(h) + p["c"][None]


def _layer_inputs(s):
    return {"bias": s(16), "c": s(64, 16), "norm_bias": s(16), "scale": s(16), "w": s(16, 16)}, s(4, 64, 16)


def test_xla_gathers_finds_vectors_and_weights_inside_calls_and_in_a_scan_no_matrix_the_backward_reads():
    s = _abstract((8,))
    program = jremat.trace_program(_layer, *_layer_inputs(s))
    # Input leaves in order: bias, c, norm_bias, scale, w, x.
    assert _collectives.backward_reads(program) == frozenset({3, 4, 5})  # scale, w and x; not the biases
    assert sorted(_collectives.xla_gathers(program).placed) == [0, 2, 3, 4]  # not c, not x
    # In a scan the step without remat gathers again in its backward pass the matrices that pass
    # reads; the vectors (the scale too, which the backward pass reads) are gathered and kept.
    assert sorted(_collectives.xla_gathers(program, in_scan=True).placed) == [0, 2, 3]
    assert jremat.resolve("full:keep_collectives=true").describe_match(program) == [
        "keeps the outputs of 4 all-gathers",
        "in a scan (prevent_cse=False) it does not keep the gathers of args[0]['w']: the backward "
        "pass reads them, and XLA gathers them again for it, as without remat",
    ]


def test_a_row_parallel_matmul_is_found_as_an_all_reduce_and_kept():
    s = _abstract((4, 2))
    mesh = s(1).sharding.mesh
    place = lambda w, *spec: jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(*spec)))

    def mlp(w1, w2, x):
        h = jax.nn.gelu(x @ place(w1, None, "tensor"))  # column-parallel: no reduction
        y = x + h @ place(w2, "tensor", None).astype(jnp.bfloat16).astype(jnp.float32)  # row-parallel
        return y + jnp.tanh(y @ w1) @ w2  # reads y, which the backward pass needs

    program = jremat.trace_program(mlp, s(16, 32), s(32, 16), s(64, 16))
    eqns = program.closed_jaxpr.jaxpr.eqns
    found = _collectives.partial_sum_matmuls(program)
    assert [eqns[i].invars[1].aval.shape for i in found] == [(32, 16)]
    assert _collectives.collective_counts(program)["all-reduce"] == 1
    # The reduced output is what the policy keeps (a [64, 16] residual named as a collective's).
    loss = lambda w1, w2, x: jnp.sum(jremat.checkpoint(mlp, "full:keep_collectives=true")(w1, w2, x))
    kept = [
        a.shape for a, source in saved_residuals(loss, s(16, 32), s(32, 16), s(64, 16)) if "jremat_collective" in source
    ]
    assert (64, 16) in kept


def test_backward_reads_takes_keys_and_integer_inputs():
    def layer(w, b, key, rows, x):
        keep = jax.random.bernoulli(key, 0.5, x.shape[:1] + w.shape[1:])
        return jnp.where(keep, jnp.tanh(x @ w + b[None]), 0.0)[rows]

    inputs = (jnp.ones((8, 8)), jnp.ones(8), jax.random.key(0), jnp.arange(2), jnp.ones((4, 8)))
    assert _collectives.backward_reads(jremat.trace_program(layer, *inputs)) == frozenset({0, 4})  # w and x


def test_in_a_scan_keep_collectives_keeps_the_gathered_vectors_only():
    s = _abstract((8,))
    p, x = _layer_inputs(s)

    def stored(spec, prevent_cse):
        """The parameters kept as stored (not gathered), which XLA gathers again for the backward pass."""
        loss = lambda p, x: jnp.sum(jremat.checkpoint(_layer, spec, prevent_cse=prevent_cse)(p, x))
        return sorted(source for _, source in saved_residuals(loss, p, x) if source.startswith("from the argument p"))

    every = ["from the argument p['bias']", "from the argument p['norm_bias']", "from the argument p['scale']"]
    assert stored("full", False) == [*every, "from the argument p['w']"]
    assert stored("full:keep_collectives=true", True) == []  # straight-line code: every gather kept
    # In a scan (untied): the matrix, which the backward pass reads, is gathered again there.
    assert stored("full:keep_collectives=true", False) == ["from the argument p['w']"]


def test_keep_collectives_in_a_scan_inside_a_shard_map_body_traces_and_keeps_the_gradients():
    # In a shard_map body XLA gathers nothing, and the weights' types vary over the manual axes:
    # tracing the body again without those types (to find what the backward pass reads) failed.
    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))

    def loss(spec, p, h):
        def body(p, h):
            p = jax.tree.map(lambda v: jax.lax.pcast(v, ("x",), to="varying"), p)
            layer = lambda p, h: jnp.tanh(jremat.ops.layer_norm(h, p["scale"], p["bias"]) @ p["w"])
            if spec != "none":
                layer = jremat.checkpoint(layer, spec, prevent_cse=False)
            _, ys = jax.lax.scan(lambda c, chunk: (c, layer(p, chunk)), None, h.reshape(2, -1, 4))
            return jax.lax.psum(jnp.sum(ys), "x")

        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())(p, h)

    rng = np.random.RandomState(0)
    p = {"scale": jnp.asarray(rng.normal(size=4)), "bias": jnp.zeros(4), "w": jnp.asarray(rng.normal(size=(4, 4)))}
    h = jnp.asarray(rng.normal(size=(8, 4)))
    expected = jax.grad(lambda p: loss("none", p, h))(p)
    got = jax.grad(lambda p: loss("full:keep_collectives=true", p, h))(p)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_xla_gathers_names_the_weights_it_cannot_place():
    s = _abstract((4, 2))
    residual = lambda w, x: x + jnp.tanh(x @ w)
    found = _collectives.xla_gathers(jremat.trace_program(residual, s(16, 16), s(4, 64, 16)))
    assert found.placed == {}
    assert found.unplaced == (
        "args[0] (float32[16,16]): on a mesh of several axes (fsdp=4,tensor=2) where XLA gathers it is not in the "
        "traced program; gather it in the model (jax.lax.with_sharding_constraint to its gathered placement)",
    )
    # One device: no gather to find.
    one = jremat.trace_program(residual, jnp.ones((16, 16)), jnp.ones((4, 64, 16)))
    assert _collectives.xla_gathers(one) == _collectives.XlaGathers(placed={}, unplaced=())


def test_keep_collectives_is_a_key_of_every_policy_of_one_function():
    assert jremat.registry.resolve_spec("full:keep_collectives=true").spec == "full:keep_collectives=true"
    assert isinstance(jremat.resolve("every_k:k=2,keep_collectives=true"), _collectives.KeepCollectives)
    assert not isinstance(jremat.resolve("full:keep_collectives=false"), _collectives.KeepCollectives)
    with pytest.raises(ValueError, match="keep_collectives=true keeps the gathered weights too"):
        jremat.resolve("full:keep_gathered=false,keep_collectives=true")
    with pytest.raises(ValueError, match="keep_collectives"):
        jremat.resolve("nested:keep_collectives=true")


def test_reissued_lines_name_every_kind_and_what_xla_inserted():
    def report(kind, n):
        one = _measure.Collective(kind, _measure.RECOMPUTE, 64, 1, "c", "e", "checkpoint")
        return _measure.CollectivesReport(collectives=(one,) * n, devices=8)

    base = _measure.CollectivesReport(collectives=(), devices=8)
    for kind in _measure.KINDS:
        (line,) = _measure.reissued_lines("f", report(kind, 2), base)
        assert f"re-issues 2 {kind}s" in line and "keep_collectives=true" in line
        (kept,) = _measure.reissued_lines("f", report(kind, 2), base, kept_kinds=frozenset({kind}))
        assert "XLA inserts these on its own" in kept
