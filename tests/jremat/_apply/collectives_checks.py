"""``keep_collectives`` on 8 simulated devices; run in a subprocess by
tests/jremat/_apply/test_collectives.py.

``python -m tests.jremat._apply.collectives_checks [CHECK ...]`` prints one JSON object. Checks:
``counts`` (every model, layout, engine and policy: a direct count of the optimized HLO's
collectives, independent of jremat, and the gradients against no remat), ``explain`` (what
``explain_applied`` says of each model under ``full`` and ``full:keep_collectives=true``),
``assert`` (``assert_no_reissued_collectives`` on the expert-parallel model), ``unplaced`` (the
XLA-gathered model on a mesh of two axes), ``user_models`` (the expert-parallel block as a Flax
NNX and an Equinox module), ``nnx_fsdp`` (a Flax NNX block with a LayerNorm and biases, the
gathers left to XLA), ``fsdp_target`` (docs/sharding.md's FSDP target at
d 512, f 2048, 262,144 tokens; not run by the tests).

The models, each a residual block of two layers in plain JAX, the collectives written in a
:func:`jax.shard_map` or left to XLA:

* ``expert_parallel``: an MoE-style block over an ``expert`` axis: each device sends a slice of
  its tokens to every device (``all_to_all``: dispatch), runs its own expert's GELU MLP on what it
  received and sends the outputs back (``all_to_all``: combine);
* ``tensor_parallel``: two of Megatron's MLPs over a ``tensor`` axis (column-parallel ``w1``,
  row-parallel ``w2``, a ``psum`` of the partial outputs: all-reduce), the second one reading
  the first one's reduced output, which its backward pass needs;
* ``fsdp_shard_map``: FSDP written by hand: each weight stored in shards over ``fsdp``,
  ``all_gather``-ed in the block; the batch over ``fsdp``;
* ``fsdp_tp_shard_map``: both on ``fsdp=4,tensor=2``: each weight's FSDP shard
  ``all_gather``-ed, then the two tensor-parallel MLPs (all-gathers and all-reduces);
* ``fsdp_constraint``: FSDP with the gather written as a sharding constraint of each weight to its
  gathered placement (auto axes);
* ``fsdp_xla``: FSDP with the gathers left to XLA (weights and the first matmul's bias placed by
  ``NamedSharding``, no constraint in the block): ``keep_collectives`` gathers them in the
  checkpoint itself (:func:`jremat._apply.collectives.xla_gathers`); scanned, only the bias,
  which the backward pass does not read.
"""

from __future__ import annotations

import os
import sys

from tests.compile_flags import FAST_COMPILE_XLA_FLAGS
from tests.device_checks import run_checks

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["XLA_FLAGS"] += " " + FAST_COMPILE_XLA_FLAGS

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jremat
from jremat._engine import jax_compat
from tests.jremat.mesh_checks import direct_count, max_rel_error
from tests.jremat.mesh_checks import loss_fn as stack_loss

jax.config.update("jax_default_matmul_precision", "highest")

DEVICES, LAYERS, D, F, TOKENS = 8, 2, 16, 32, 64
MODELS = ("expert_parallel", "tensor_parallel", "fsdp_shard_map", "fsdp_tp_shard_map", "fsdp_constraint", "fsdp_xla")
LAYOUTS = ("unrolled", "scanned")
ENGINES = ("classic", "remat3")
POLICIES = (
    "none",
    "full",
    "dots",
    "full:keep_collectives=true",
    "dots:keep_collectives=true",
    "skip_cheap:keep_collectives=true",
)
AXIS = {
    "expert_parallel": "expert",
    "tensor_parallel": "tensor",
    "fsdp_shard_map": "fsdp",
    "fsdp_tp_shard_map": "fsdp",
    "fsdp_constraint": "fsdp",
    "fsdp_xla": "fsdp",
}


def make_mesh(model: str):
    if model == "fsdp_tp_shard_map":
        return jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    return jax.make_mesh((DEVICES,), (AXIS[model],), axis_types=(AxisType.Auto,))


def block_fn(model: str, mesh):
    """``block(w, x)`` of ``model`` (module docstring); ``w = (w1, w2)``."""
    axis = AXIS[model]
    if model == "expert_parallel":

        def expert(w1, w2, x):
            # x: this device's tokens [TOKENS / 8, D]; w1 [1, D, F], w2 [1, F, D]: its expert.
            sent = x.reshape(DEVICES, -1, D)
            received = jax.lax.all_to_all(sent, axis, 0, 0, tiled=True)
            out = jnp.einsum("sf,fd->sd", jax.nn.gelu(jnp.einsum("sd,df->sf", received.reshape(-1, D), w1[0])), w2[0])
            back = jax.lax.all_to_all(out.reshape(DEVICES, -1, D), axis, 0, 0, tiled=True)
            return x + back.reshape(x.shape)

        body = jax.shard_map(expert, mesh=mesh, in_specs=(P(axis), P(axis), P(axis)), out_specs=P(axis))
        return lambda w, x: body(w[0], w[1], x)
    if model == "tensor_parallel":

        def mlp(w1, w2, x):
            y = x + jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, axis)
            return y + jax.lax.psum(jax.nn.gelu(y @ w1) @ w2, axis)

        body = jax.shard_map(mlp, mesh=mesh, in_specs=(P(None, axis), P(axis, None), P()), out_specs=P())
        return lambda w, x: body(w[0], w[1], x)
    if model == "fsdp_shard_map":

        def fsdp(w1, w2, x):
            w1 = jax.lax.all_gather(w1, axis, tiled=True)
            w2 = jax.lax.all_gather(w2, axis, tiled=True)
            return x + jax.nn.gelu(x @ w1) @ w2

        body = jax.shard_map(fsdp, mesh=mesh, in_specs=(P(axis), P(axis), P(axis)), out_specs=P(axis))
        return lambda w, x: body(w[0], w[1], x)
    if model == "fsdp_tp_shard_map":

        def fsdp_tp(w1, w2, x):
            # Each weight's FSDP shard gathered, then Megatron's MLP over tensor (two, as above).
            w1 = jax.lax.all_gather(w1, "fsdp", axis=0, tiled=True)
            w2 = jax.lax.all_gather(w2, "fsdp", axis=1, tiled=True)
            y = x + jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "tensor")
            return y + jax.lax.psum(jax.nn.gelu(y @ w1) @ w2, "tensor")

        specs = (P("fsdp", "tensor"), P("tensor", "fsdp"), P("fsdp"))
        body = jax.shard_map(fsdp_tp, mesh=mesh, in_specs=specs, out_specs=P("fsdp"))
        return lambda w, x: body(w[0], w[1], x)
    gathered = NamedSharding(mesh, P())

    def block(w, x):
        w1, w2, *bias = w
        if model == "fsdp_constraint":
            w1, w2 = (jax.lax.with_sharding_constraint(v, gathered) for v in (w1, w2))
        h = x @ w1
        return x + jax.nn.gelu(h + bias[0] if bias else h) @ w2

    return block


def arguments(model: str, mesh, layout: str, seed: int = 0):
    """``(weights, x)``: a list of per-layer ``(w1, w2)`` (unrolled) or one stacked pair (scanned)."""
    rng = np.random.RandomState(seed)
    axis = AXIS[model]
    if model == "expert_parallel":
        shapes, specs = ((DEVICES, D, F), (DEVICES, F, D)), (P(axis), P(axis))
    elif model == "tensor_parallel":
        shapes, specs = ((D, F), (F, D)), (P(None, axis), P(axis, None))
    elif model == "fsdp_tp_shard_map":
        shapes, specs = ((D, F), (F, D)), (P("fsdp", "tensor"), P("tensor", "fsdp"))
    elif model == "fsdp_xla":  # and a bias, which the backward pass does not read
        shapes, specs = ((D, F), (F, D), (F,)), (P(axis), P(axis), P(axis))
    else:
        shapes, specs = ((D, F), (F, D)), (P(axis), P(axis))

    def put(shape, spec, lead: tuple = ()):
        value = rng.normal(size=lead + shape) / np.sqrt(shape[0])
        return jax.device_put(jnp.asarray(value, jnp.float32), NamedSharding(mesh, P(*(None,) * len(lead), *spec)))

    if layout == "scanned":
        weights = tuple(put(s, p, (LAYERS,)) for s, p in zip(shapes, specs))
    else:
        weights = [tuple(put(s, p) for s, p in zip(shapes, specs)) for _ in range(LAYERS)]
    x_spec = P() if model == "tensor_parallel" else P(axis)
    x = jax.device_put(jnp.asarray(rng.normal(size=(TOKENS, D)), jnp.float32), NamedSharding(mesh, x_spec))
    return weights, x


def loss_fn(model: str, mesh, layout: str, policy: str):
    """The loss of the two-layer stack, each block checkpointed under ``policy`` (tied unrolled)."""
    return stack_loss(mesh, layout, policy, block=block_fn(model, mesh))


def check_counts() -> dict:
    """``{model/layout/engine/policy: {"hlo": {kind: [count, bytes]}, "grad_rel_error": e}}``."""
    rows = {}
    for model in MODELS:
        mesh = make_mesh(model)
        for layout in LAYOUTS:
            weights, x = arguments(model, mesh, layout)
            for engine in ENGINES:
                with jax_compat.remat3_enabled(engine == "remat3"):
                    reference = None
                    for policy in POLICIES:
                        grad = jax.jit(jax.grad(loss_fn(model, mesh, layout, policy)))
                        hlo = grad.lower(weights, x).compile().as_text()
                        value = grad(weights, x)
                        reference = value if reference is None else reference
                        rows[f"{model}/{layout}/{engine}/{policy}"] = {
                            "hlo": direct_count(hlo),
                            "grad_rel_error": max_rel_error(value, reference),
                        }
    return rows


def check_explain() -> dict:
    """``{model/policy: text}``: ``explain_applied`` (compiled) of the unrolled stack of each model."""
    out = {}
    for model in MODELS:
        mesh = make_mesh(model)
        weights, x = arguments(model, mesh, "unrolled")
        for policy in ("full", "full:keep_collectives=true"):
            explanation = jremat.explain_applied(
                loss_fn(model, mesh, "unrolled", policy),
                weights,
                x,
                policy=policy,
                baseline=loss_fn(model, mesh, "unrolled", "none"),
            )
            out[f"{model}/{policy}"] = explanation.text()
    return out


def check_assert() -> dict:
    """``jremat.testing.assert_no_reissued_collectives`` (every kind by default) on the unrolled
    expert-parallel model: ``{policy: message or ""}``."""
    import jremat.testing

    mesh = make_mesh("expert_parallel")
    weights, x = arguments("expert_parallel", mesh, "unrolled")
    out = {}
    for policy in ("full", "full:keep_collectives=true"):
        try:
            jremat.testing.assert_no_reissued_collectives(
                jax.grad(loss_fn("expert_parallel", mesh, "unrolled", policy)),
                jax.grad(loss_fn("expert_parallel", mesh, "unrolled", "none")),
                weights,
                x,
            )
            out[policy] = ""
        except AssertionError as e:
            out[policy] = str(e)
    return out


def check_user_models() -> dict:
    """The expert-parallel block as a Flax NNX module (``@jremat.policy`` on the class) and as an
    Equinox module (``jremat.filter_checkpoint``), two layers unrolled: ``{kind/spec: {"all_to_all":
    direct count, "grad_rel_error": e}}``."""
    import equinox as eqx
    from flax import nnx

    mesh = make_mesh("expert_parallel")
    block = block_fn("expert_parallel", mesh)
    (layer0, layer1), x = arguments("expert_parallel", mesh, "unrolled")

    class NnxExperts(nnx.Module):
        def __init__(self, w):
            self.w1, self.w2 = nnx.Param(w[0]), nnx.Param(w[1])

        def __call__(self, x):
            return block((self.w1[...], self.w2[...]), x)

    class EqxExperts(eqx.Module):
        w1: jax.Array
        w2: jax.Array

        def __call__(self, x):
            return block((self.w1, self.w2), x)

    def nnx_grad(spec):
        cls = NnxExperts if spec == "none" else jremat.policy(spec)(NnxExperts)
        graphdef, state = nnx.split([cls(layer0), cls(layer1)])

        def loss(state, x):
            for layer in nnx.merge(graphdef, state):
                x = layer(x)
            return jnp.mean(x**2)

        return jax.jit(jax.grad(loss)), state

    def eqx_grad(spec):
        call = EqxExperts.__call__ if spec == "none" else jremat.filter_checkpoint(EqxExperts.__call__, spec)
        layers = [EqxExperts(*layer0), EqxExperts(*layer1)]

        def loss(layers, x):
            for layer in layers:
                x = call(layer, x)
            return jnp.mean(x**2)

        return jax.jit(jax.grad(loss)), layers

    out = {}
    for kind, make in (("nnx", nnx_grad), ("equinox", eqx_grad)):
        reference = None
        for spec in ("none", "full", "full:keep_collectives=true"):
            grad, params = make(spec)
            value = grad(params, x)
            reference = value if reference is None else reference
            hlo = grad.lower(params, x).compile().as_text()
            out[f"{kind}/{spec}"] = {
                "all_to_all": direct_count(hlo).get("all-to-all", [0, 0])[0],
                "grad_rel_error": max_rel_error(value, reference),
            }
    return out


def check_nnx_fsdp() -> dict:
    """A user's Flax NNX block on ``fsdp=8`` with the gathers left to XLA: LayerNorm, two biased
    ``Linear`` layers and a GELU, the layers' parameters stacked and placed with
    ``NamedSharding(mesh, P(None, "fsdp"))``, unrolled and in a ``lax.scan`` (``prevent_cse=False``):
    ``{layout/spec: {"all_gathers": direct count, "grad_rel_error": e}}``."""
    from flax import nnx

    mesh = make_mesh("fsdp_xla")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(D, rngs=rngs)
            self.up, self.down = nnx.Linear(D, F, rngs=rngs), nnx.Linear(F, D, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(self.norm(x))))

    keys = jax.random.split(jax.random.key(0), LAYERS)
    graphdef, state = nnx.split(nnx.vmap(lambda k: Block(nnx.Rngs(k)))(keys))
    rng = np.random.RandomState(0)
    state = jax.tree.map(
        lambda a: jax.device_put(a + rng.normal(size=a.shape) * 0.1, NamedSharding(mesh, P(None, "fsdp"))), state
    )
    x = jax.device_put(jnp.asarray(rng.normal(size=(TOKENS, D)), jnp.float32), NamedSharding(mesh, P("fsdp")))
    call = lambda params, h: nnx.merge(graphdef, params)(h)

    def grad_fn(spec, layout):
        block = call if spec == "none" else jremat.checkpoint(call, spec, prevent_cse=layout == "unrolled")

        def loss(params, h):
            if layout == "scanned":
                h, _ = jax.lax.scan(lambda h, p: (block(p, h), None), h, params)
            else:
                for i in range(LAYERS):
                    h = block(jax.tree.map(lambda a, i=i: a[i], params), h)
            return jnp.mean(h**2)

        return jax.jit(jax.grad(loss))

    out = {}
    for layout in LAYOUTS:
        reference = grad_fn("none", layout)(state, x)
        for spec in ("none", "full", "full:keep_collectives=true"):
            grad = grad_fn(spec, layout)
            out[f"{layout}/{spec}"] = {
                "all_gathers": direct_count(grad.lower(state, x).compile().as_text()).get("all-gather", [0, 0])[0],
                "grad_rel_error": max_rel_error(grad(state, x), reference),
            }
    return out


def check_unplaced() -> dict:
    """The XLA-gathered model on ``fsdp=4,tensor=2`` (weights over both axes): what ``describe``
    says under ``full:keep_collectives=true`` and the all-gathers per policy (unrolled)."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.RandomState(0)

    def put(shape, spec):
        value = jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)
        return jax.device_put(value, NamedSharding(mesh, spec))

    weights = [(put((D, F), P("fsdp", "tensor")), put((F, D), P("tensor", "fsdp"))) for _ in range(LAYERS)]
    x = put((TOKENS, D), P("fsdp"))
    block = block_fn("fsdp_xla", mesh)
    program = jremat.trace_program(block, weights[0], x)
    out = {"describe": jremat.resolve("full:keep_collectives=true").describe_match(program)}
    for policy in ("none", "full", "full:keep_collectives=true"):
        loss = stack_loss(mesh, "unrolled", policy, block=block)
        hlo = jax.jit(jax.grad(loss)).lower(weights, x).compile().as_text()
        out[policy] = direct_count(hlo).get("all-gather", [0, 0])
    return out


def check_fsdp_target() -> dict:
    """docs/sharding.md's target (not run by the tests): FSDP with the gathers left to XLA at d 512,
    f 2048, 4 layers, 262,144 tokens on ``fsdp=8``, compiled only: per layout and policy, the
    compiled temp per device and the direct count of all-gathers."""
    d, f, layers, tokens = 512, 2048, 4, 262_144
    mesh = make_mesh("fsdp_xla")
    block = block_fn("fsdp_xla", mesh)
    rows = {}
    for layout in LAYOUTS:
        lead = (layers,) if layout == "scanned" else ()
        w = tuple(
            jax.ShapeDtypeStruct(
                lead + shape, jnp.float32, sharding=NamedSharding(mesh, P(*(None,) * len(lead), "fsdp"))
            )
            for shape in ((d, f), (f, d))
        )
        weights = w if layout == "scanned" else [w] * layers
        x = jax.ShapeDtypeStruct((tokens, d), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
        for policy in ("none", "full", "full:keep_collectives=true"):
            compiled = jax.jit(jax.grad(stack_loss(mesh, layout, policy, block=block))).lower(weights, x).compile()
            rows[f"{layout}/{policy}"] = {
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                "all_gathers": direct_count(compiled.as_text()).get("all-gather", [0, 0]),
            }
    return rows


CHECKS = {
    "counts": check_counts,
    "explain": check_explain,
    "assert": check_assert,
    "unplaced": check_unplaced,
    "user_models": check_user_models,
    "nnx_fsdp": check_nnx_fsdp,
    "fsdp_target": check_fsdp_target,
}

if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
