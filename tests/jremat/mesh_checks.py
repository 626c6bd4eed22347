"""Remat on 8 simulated devices: collectives, gradients, the tie; run in a subprocess by
tests/jremat/_measure/test_collectives.py.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX starts, so these
run in their own process: ``python -m tests.jremat.mesh_checks [CHECK ...]`` prints one JSON
object with the figures the tests assert on. Checks: ``collectives`` (every mesh, layout, engine
and policy: jremat's report beside a direct count of the optimized HLO, the gradients against no
remat), ``tie`` (all-reduces with and without the cotangent tie), ``keep_gathered`` (the FSDP
target of ``keep_gathered``), ``explain`` (``explain`` of ``full`` on the FSDP model), ``fit``
(``jremat.fit_search`` on the FSDP model).

The model: a 4-layer MLP stack in plain JAX, weights stored sharded (``w1 [d, f]`` over
``(fsdp, tensor)``, ``w2 [f, d]`` over ``(tensor, fsdp)``) and gathered in the block by a sharding
constraint to their tensor-parallel placement (FSDP's all-gather; Megatron's column / row
parallel MLP, whose row-parallel output XLA all-reduces), the batch over ``(data, fsdp)``.
"""

from __future__ import annotations

import os
import re
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
import jremat.testing

jax.config.update("jax_default_matmul_precision", "highest")

MESHES = {"fsdp": "fsdp=8", "tp": "data=2,tensor=4", "fsdp_tp": "fsdp=2,tensor=4"}
AXES = ("data", "fsdp", "tensor")
LAYERS, D, F, BATCH = 4, 16, 64, 16
POLICIES = ("none", "full", "dots", "dots_no_batch", "full:keep_gathered=true", "dots:keep_gathered=true")
ENGINES = ("classic", "remat3")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def make_mesh(spec: str, axis_type=AxisType.Auto):
    sizes = dict.fromkeys(AXES, 1)
    sizes.update({k: int(v) for k, v in (part.split("=") for part in spec.split(","))})
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(axis_type,) * len(AXES))


def block_fn(mesh):
    """One residual MLP block: its weights gathered to their tensor-parallel placement."""

    explicit = AxisType.Explicit in mesh.axis_types
    place = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint

    # Explicit axes (FSDP only there): a contraction over a sharded dimension needs its output
    # sharding spelled out, so the weights are gathered whole.
    tensor = None if explicit else "tensor"

    def block(w, x):
        w1 = place(w["w1"], NamedSharding(mesh, P(None, tensor)))
        w2 = place(w["w2"], NamedSharding(mesh, P(tensor, None)))
        y = x + jnp.tanh(x @ w1) @ w2
        return place(y, NamedSharding(mesh, P(("data", "fsdp"), None)))

    return block


def arguments(mesh, layout: str, seed: int = 0):
    """``(weights, x)`` on ``mesh``: a list of per-layer dicts (unrolled) or one stacked dict (scanned)."""
    rng = np.random.RandomState(seed)
    s1, s2 = (
        NamedSharding(mesh, P(*lead, *spec)) for lead, spec in [((), ("fsdp", "tensor")), ((), ("tensor", "fsdp"))]
    )
    if layout == "scanned":
        s1, s2 = NamedSharding(mesh, P(None, "fsdp", "tensor")), NamedSharding(mesh, P(None, "tensor", "fsdp"))

    def put(shape, sharding):
        return jax.device_put(jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32), sharding)

    if layout == "scanned":
        weights = {"w1": put((LAYERS, D, F), s1), "w2": put((LAYERS, F, D), s2)}
    else:
        weights = [{"w1": put((D, F), s1), "w2": put((F, D), s2)} for _ in range(LAYERS)]
    x = jax.device_put(jnp.asarray(rng.normal(size=(BATCH, D)), jnp.float32), NamedSharding(mesh, P(("data", "fsdp"))))
    return weights, x


def loss_fn(mesh, layout: str, policy: str, *, tie: bool = True, block=None):
    """The loss of the 4-layer stack with each block checkpointed under ``policy``."""
    block = block or block_fn(mesh)
    if policy != "none":
        # jremat's tie rule: straight-line code is tied, a scan of several steps is not.
        block = jremat.checkpoint(block, policy, prevent_cse=tie and layout == "unrolled")

    def loss(weights, x):
        if layout == "scanned":
            x, _ = jax.lax.scan(lambda h, w: (block(w, h), None), x, weights)
        else:
            for w in weights:
                x = block(w, x)
        return jnp.mean(x**2)

    return loss


def direct_count(hlo: str) -> dict:
    """``{kind: [count, bytes]}`` by regular expressions over the HLO text, independent of
    jremat._measure.collectives: each collective line (``-start`` halves skipped) counted with its result
    bytes, the lines of a ``while`` body times the loop's ``known_trip_count``."""
    bodies = {}
    for m in re.finditer(r"while\(.*?body=%?([\w.\-]+).*?\"known_trip_count\":\{\"n\":\"(\d+)\"", hlo):
        bodies[m.group(1)] = int(m.group(2))
    found = {}
    multiplier = 1
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(", line)
        if header:
            multiplier = bodies.get(header.group(1), 1)
        m = re.match(
            r"^\s+(?:ROOT )?%?[\w.\-]+ = (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-done)?\(",
            line,
        )
        if not m:
            continue
        size = 0
        for dtype, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", m.group(1)):
            size += int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * {"f32": 4, "s32": 4, "pred": 1}[dtype]
        count, total = found.get(m.group(2), [0, 0])
        found[m.group(2)] = [count + multiplier, total + size * multiplier]
    return found


def max_rel_error(tree, reference) -> float:
    diffs = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference))
    ]
    return max(diffs) / max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(reference))


def broken_remat(block, factor: float):
    """``block`` under a hand-written remat whose recomputation is wrong: the forward pass is the
    block's own, exact; the backward pass saves only the inputs and runs the block again scaled by
    ``factor``, as a recomputation that differs from the forward pass would."""

    @jax.custom_vjp
    def remat(w, x):
        return block(w, x)

    def forward(w, x):
        return block(w, x), (w, x)

    def backward(inputs, cotangent):
        _, pullback = jax.vjp(lambda w, x: block(w, x) * factor, *inputs)
        return pullback(cotangent)

    remat.defvjp(forward, backward)
    return remat


def _compile(loss, weights, x):
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(weights, x).compile(jremat.compiler_options() or None)


def check_collectives() -> dict:
    """Every (mesh, layout, engine, policy): the report, the direct count, phases, temp, gradient error."""
    out = {}
    for mesh_name, spec in MESHES.items():
        mesh = make_mesh(spec)
        for layout in ("unrolled", "scanned"):
            weights, x = arguments(mesh, layout)
            reference = None
            for engine in ENGINES:
                jax.config.update("jax_remat3", engine == "remat3")
                for policy in POLICIES:
                    if engine == "remat3" and policy.startswith("dots"):
                        continue  # the engines' dots are compared on one device (tests/policies)
                    if mesh_name != "fsdp" and "keep_gathered" in policy:
                        continue  # keep_gathered acts on FSDP weight gathers: on the FSDP mesh here and in check_keep_gathered
                    compiled = _compile(loss_fn(mesh, layout, policy), weights, x)
                    report = jremat.compiled_collectives_report(compiled)
                    grads = compiled(weights, x)
                    reference = reference if reference is not None else grads
                    out[f"{mesh_name}/{layout}/{engine}/{policy}"] = {
                        "report": {k: list(v) for k, v in report.by_kind().items()},
                        "direct": direct_count(compiled.as_text()),
                        "phases": {
                            k: [report.count(k, p) for p in ("forward", "backward", "recompute")] for k in KINDS
                        },
                        "devices": report.devices,
                        "temp": compiled.memory_analysis().temp_size_in_bytes,
                        "grad_rel_error": max_rel_error(grads, reference),
                    }
            jax.config.update("jax_remat3", False)
            if mesh_name == "fsdp" and layout == "unrolled":
                # A deliberately broken remat (its recomputed block differs by 1e-3, its forward
                # pass does not) is caught by the gradients alone.
                broken = loss_fn(mesh, layout, "none", block=broken_remat(block_fn(mesh), 1.001))
                wrong = _compile(broken, weights, x)(weights, x)
                out["broken_grad_rel_error"] = max_rel_error(wrong, reference)
                exact = loss_fn(mesh, layout, "none")
                out["broken_loss_rel_error"] = max_rel_error(jax.jit(broken)(weights, x), jax.jit(exact)(weights, x))
    return out


def check_tie() -> dict:
    """All-reduces of ``full`` on the unrolled FSDP and TP models, tied and untied."""
    out = {}
    for mesh_name in ("fsdp", "tp", "fsdp_explicit"):
        # Explicit axes: the sharding is part of each value's type (a slice of a sharded
        # dimension cannot be written there).
        explicit = mesh_name.endswith("_explicit")
        mesh = make_mesh(MESHES[mesh_name.removesuffix("_explicit")], AxisType.Explicit if explicit else AxisType.Auto)
        weights, x = arguments(mesh, "unrolled")
        for tie in (True, False):
            compiled = _compile(loss_fn(mesh, "unrolled", "full", tie=tie), weights, x)
            report = jremat.compiled_collectives_report(compiled)
            out[f"{mesh_name}/{'tied' if tie else 'untied'}"] = {
                "all-reduce": report.count("all-reduce"),
                "tie": [report.count("all-reduce", "cotangent tie"), report.bytes("all-reduce", "cotangent tie")],
                "temp": compiled.memory_analysis().temp_size_in_bytes,
            }
    return out


def check_advice() -> dict:
    """What ``explain_applied`` and ``assert_no_reissued_collectives`` say of the tie's all-reduces
    (apart from re-issued ones), of a row-parallel all-reduce the recomputation re-runs, and of
    ``keep_gathered`` on weights XLA gathers implicitly; the tie inside a user's ``lax.scan``."""

    def explained(mesh, policy, block, weights, x):
        remat, base = (loss_fn(mesh, "unrolled", p, block=block) for p in (policy, "none"))
        return jremat.explain_applied(remat, weights, x, policy=policy, baseline=base).text()

    out = {}
    tp = make_mesh(MESHES["tp"])
    weights, x = arguments(tp, "unrolled")
    inner = block_fn(tp)

    def block(w, h):  # the row-parallel output feeds a tanh: full recomputes its all-reduce
        return jnp.tanh(inner(w, h))

    out["tp full"] = explained(tp, "full", block, weights, x)
    fsdp = make_mesh(MESHES["fsdp"])
    weights, x = arguments(fsdp, "unrolled")
    try:
        jremat.testing.assert_no_reissued_collectives(
            jax.grad(loss_fn(fsdp, "unrolled", "full:keep_gathered=true")),
            jax.grad(loss_fn(fsdp, "unrolled", "none")),
            weights,
            x,
            kinds=("all-gather", "all-reduce"),
        )
    except AssertionError as err:
        out["kept assert"] = str(err)
    else:
        out["kept assert"] = None

    def implicit(w, h):  # no sharding constraint: XLA gathers the weights where the matmuls need them
        return h + jnp.tanh(h @ w["w1"]) @ w["w2"]

    out["implicit kept"] = explained(fsdp, "full:keep_gathered=true", implicit, weights, x)
    # A user's own scan over jremat.checkpoint: tied by default (prevent_cse=True, as jax.checkpoint).
    stacked, x = arguments(fsdp, "scanned")
    for prevent_cse in (True, False):
        block = jremat.checkpoint(block_fn(fsdp), "full", prevent_cse=prevent_cse)

        def loss(weights, x, block=block):
            return jnp.mean(jax.lax.scan(lambda h, w: (block(w, h), None), x, weights)[0] ** 2)

        report = jremat.compiled_collectives_report(_compile(loss, stacked, x))
        out[f"scan prevent_cse={prevent_cse}"] = [
            report.count("all-reduce", "cotangent tie"),
            report.count("all-reduce"),
        ]
    return out


def _compiled_rows(mesh_names, policies) -> dict:
    """Per ``mesh/layout/policy``: all-gathers and all-reduces ``[count, bytes]`` and per-device temp
    of the 4-layer model with realistic proportions (65,536 tokens, d 64, f 256), compiled only."""
    out = {}
    for mesh_name in mesh_names:
        mesh = make_mesh(MESHES[mesh_name])
        for layout in ("unrolled", "scanned"):
            lead = (LAYERS,) if layout == "scanned" else ()
            stacked = (None,) * len(lead)
            w = {
                "w1": jax.ShapeDtypeStruct(
                    (*lead, 64, 256), jnp.float32, sharding=NamedSharding(mesh, P(*stacked, "fsdp", "tensor"))
                ),
                "w2": jax.ShapeDtypeStruct(
                    (*lead, 256, 64), jnp.float32, sharding=NamedSharding(mesh, P(*stacked, "tensor", "fsdp"))
                ),
            }
            weights = w if layout == "scanned" else [w] * LAYERS
            x = jax.ShapeDtypeStruct((8 * 8192, 64), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
            for policy in policies:
                compiled = _compile(loss_fn(mesh, layout, policy), weights, x)
                report = jremat.compiled_collectives_report(compiled)
                out[f"{mesh_name}/{layout}/{policy}"] = {
                    "all-gather": [report.count("all-gather"), report.bytes("all-gather")],
                    "all-reduce": [report.count("all-reduce"), report.bytes("all-reduce")],
                    "temp": compiled.memory_analysis().temp_size_in_bytes,
                }
    return out


def check_keep_gathered() -> dict:
    """FSDP=8, the 4-layer model with realistic proportions: all-gathers and per-device temp of
    each policy, compiled only, unrolled and scanned (``fsdp/`` dropped from the keys)."""
    rows = _compiled_rows(["fsdp"], ("none", "full", "full:keep_gathered=true", "dots", "dots:keep_gathered=true"))
    return {k.split("/", 1)[1]: v for k, v in rows.items()}


def check_table() -> dict:
    """The table of docs/sharding.md: every mesh, layout and policy (not run by the tests)."""
    return _compiled_rows(list(MESHES), ("none", "full", "dots", "full:keep_gathered=true", "dots:keep_gathered=true"))


def check_explain() -> dict:
    """``explain`` of ``full`` (and ``full:keep_gathered=true``) on the unrolled FSDP model."""
    mesh = make_mesh(MESHES["fsdp"])
    weights, x = arguments(mesh, "unrolled")
    out = {}
    for policy in ("full", "full:keep_gathered=true"):
        explanation = jremat.explain_applied(
            loss_fn(mesh, "unrolled", policy), weights, x, policy=policy, baseline=loss_fn(mesh, "unrolled", "none")
        )
        out[policy] = explanation.text()
        grad = jax.grad(loss_fn(mesh, "unrolled", policy), argnums=(0, 1))
        try:
            jremat.testing.assert_no_reissued_collectives(grad, jax.grad(loss_fn(mesh, "unrolled", "none")), weights, x)
        except AssertionError as err:
            out[f"{policy} assert"] = str(err)
        else:
            out[f"{policy} assert"] = None
    return out


def check_timeline() -> dict:
    """``memory_timeline`` of ``full``'s gradient on the unrolled FSDP model: its notes and peak."""
    mesh = make_mesh(MESHES["fsdp"])
    weights, x = arguments(mesh, "unrolled")
    grad = jax.grad(loss_fn(mesh, "unrolled", "full"), argnums=(0, 1))
    timeline = jremat.memory_timeline(grad, weights, x)
    residuals = jremat.saved_residuals_report(loss_fn(mesh, "unrolled", "full"), weights, x)
    return {
        "notes": list(timeline.notes),
        "compiled_peak": timeline.compiled_peak_bytes,
        "residuals_devices": residuals.devices,
        "residuals_table": residuals.table(),
    }


def check_price() -> dict:
    """``collective_flops_per_byte`` on the 8 devices: asked from 4 threads at once, one measurement each kind."""
    from concurrent.futures import ThreadPoolExecutor

    from jremat._measure import collectives

    def measurements():  # timed programs run so far: the measuring functions' cache misses
        return (
            collectives._measured_s_per_byte.cache_info().misses + collectives._matmul_flops_per_s.cache_info().misses
        )

    before = measurements()
    with ThreadPoolExecutor(4) as pool:
        gathers = list(pool.map(lambda _: jremat.collective_flops_per_byte("all-gather"), range(4)))
    after_threads = measurements()
    again = jremat.collective_flops_per_byte("all-gather")
    return {
        "all-gather": gathers,
        "again": again,
        "threads_measured": after_threads - before,  # the collective and the matmul, once each
        "again_measured": measurements() - after_threads,
        "all-reduce": jremat.collective_flops_per_byte("all-reduce"),
        "all-to-all": jremat.collective_s_per_byte("all-to-all"),
    }


def check_fit() -> dict:
    """``jremat.fit_search`` of a gradient-descent step of the unrolled FSDP model, batches per data
    shard (8 rows each), under ``none`` and ``full`` with a given time model (nothing calibrated),
    under each remat engine: every probe's figures, the searched policies, the time model's terms."""
    mesh = make_mesh(MESHES["fsdp"])
    weights, _ = arguments(mesh, "unrolled")
    w_sharding = jax.tree.map(lambda a: a.sharding, weights)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), weights)
    rows = NamedSharding(mesh, P(("data", "fsdp")))

    def build(policy, batch_size, micro_batches):
        loss = loss_fn(mesh, "unrolled", policy)

        def step(w, x):
            value, grads = jax.value_and_grad(loss)(w, x)
            return jax.tree.map(lambda a, g: a - 0.1 * g, w, grads), value

        jitted = jax.jit(step, out_shardings=(w_sharding, NamedSharding(mesh, P())), donate_argnums=0)
        x = jax.ShapeDtypeStruct((8 * batch_size, D), jnp.float32, sharding=rows)
        return jremat.FitStep(jitted, (abstract, x), carry=(0,))

    rate = 2.0**-30
    model = jremat.TimeModel(2.0**30, 2.0**30, (("all-gather", rate), ("all-reduce", rate), ("reduce-scatter", rate)))
    out = {}
    for engine in ENGINES:
        jax.config.update("jax_remat3", engine == "remat3")
        try:
            result = jremat.fit_search(
                build, ["none", "full"], "1GiB", time_model=model, max_batch_size=4, finalists=1, rounds=1
            )
        finally:
            jax.config.update("jax_remat3", False)
        probes = {f"{p.policy}@{p.batch_size}": p for p in result.probes}
        full, kept = probes["full@4"], probes["full:keep_gathered=true@4"]
        out[engine] = {
            "probes": {
                k: {
                    "devices": p.devices,
                    "collectives": [list(c) for c in p.collectives],
                    "recomputed": list(p.recomputed),
                }
                for k, p in probes.items()
            },
            "collective_s": {
                "full": model.collective_s(full.collectives),
                "kept": model.collective_s(kept.collectives),
            },
            # All else equal: the same FLOPs and bytes, each candidate's collectives.
            "step_s_same_work": {
                name: model.step_s(full.flops / full.devices, full.bytes_accessed, p.collectives)
                for name, p in (("full", full), ("kept", kept))
            },
            "predicted_equals_model": all(
                abs(r.predicted_tokens_per_s - r.probe.batch_size / model.probe_s(r.probe))
                <= 1e-9 * r.predicted_tokens_per_s
                for r in result.rows
            ),
            "rows": [r.probe.policy for r in result.rows],
            "table": result.table(),
        }
    return out


CHECKS = {
    "collectives": check_collectives,
    "tie": check_tie,
    "keep_gathered": check_keep_gathered,
    "explain": check_explain,
    "advice": check_advice,
    "table": check_table,
    "timeline": check_timeline,
    "price": check_price,
    "fit": check_fit,
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
