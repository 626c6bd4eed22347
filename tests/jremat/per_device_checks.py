"""Per-device figures on 8 simulated devices: residuals, explain, the timeline, the live reading
(and ``dots:keep_gathered=true`` under remat3);
run in a subprocess by tests/jremat/_measure/test_per_device.py (``python -m tests.jremat.per_device_checks
[CHECK ...]`` prints one JSON object). The model is tests/jremat/mesh_checks.py's 4-layer MLP.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jremat
from jremat._measure import timeline_buffers as _timeline_buffers
from tests.device_checks import run_checks
from tests.jremat import mesh_checks as mc  # sets the 8-device XLA flag before JAX's backend starts

#: (mesh name, mesh spec, axis type) of the residual checks.
MESHES = (
    ("fsdp", "fsdp=8", AxisType.Auto),
    ("fsdp_explicit", "fsdp=8", AxisType.Explicit),
    ("tp", "data=2,tensor=4", AxisType.Auto),
)


def _residual_rows(report) -> list:
    return [[r.label, list(r.shape), r.bytes, r.device_bytes] for r in report.residuals]


def check_residuals() -> dict:
    """``saved_residuals_report`` of the 4-layer loss per mesh, layout, engine and policy: each
    residual's global and per-device bytes, the report's devices and table."""
    out = {}
    for name, spec, axis_type in MESHES:
        mesh = mc.make_mesh(spec, axis_type)
        layouts = ("unrolled",) if axis_type == AxisType.Explicit else ("unrolled", "scanned")
        for layout in layouts:
            weights, x = mc.arguments(mesh, layout)
            for engine in mc.ENGINES:
                jax.config.update("jax_remat3", engine == "remat3")
                try:
                    for policy in ("none", "dots"):
                        report = jremat.saved_residuals_report(mc.loss_fn(mesh, layout, policy), weights, x)
                        out[f"{name}/{layout}/{engine}/{policy}"] = {
                            "residuals": _residual_rows(report),
                            "devices": report.devices,
                            "computed": [report.computed_bytes, report.computed_device_bytes],
                            "table": report.table(),
                        }
                finally:
                    jax.config.update("jax_remat3", False)
    return out


def check_explain() -> dict:
    """``explain`` of ``full`` on one FSDP block (auto axes): its residual figures and text."""
    mesh = mc.make_mesh("fsdp=8")
    weights, x = mc.arguments(mesh, "unrolled")
    out = {}
    for engine in mc.ENGINES:
        jax.config.update("jax_remat3", engine == "remat3")
        try:
            explanation = jremat.explain(mc.block_fn(mesh), "full", weights[0], x)
        finally:
            jax.config.update("jax_remat3", False)
        out[engine] = {
            "saved": [explanation.baseline_saved_bytes, explanation.saved_bytes],
            "global_saved": [explanation.baseline_global_saved_bytes, explanation.global_saved_bytes],
            "text": explanation.text(),
        }
    # Explicit axes, a block whose output keeps its input's row sharding: the gradient's
    # cotangent must have that sharding too.
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    w = jax.device_put(np.eye(16, dtype=np.float32), NamedSharding(mesh, P("fsdp", None)))
    rows = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("fsdp", None)))
    with jax.set_mesh(mesh):
        explanation = jremat.explain(lambda w, x: x + jnp.tanh(x @ jax.sharding.reshard(w, P())), "full", w, rows)
    out["explicit"] = {"saved": [explanation.baseline_saved_bytes, explanation.saved_bytes]}
    return out


def check_timeline() -> dict:
    """``memory_timeline`` of ``full``'s gradient on the FSDP model, unrolled and scanned, both
    engines: every buffer at every schedule position (not only the peak) that an all-gather made
    or that a sharding constraint names, with its kind; the notes."""
    mesh = mc.make_mesh("fsdp=8")
    out = {}
    buffers_at = _timeline_buffers.buffers_at
    # Both engines unrolled; scanned, the classic engine (the timeline reads the compiled program).
    for layout, engines in (("unrolled", mc.ENGINES), ("scanned", ("classic",))):
        weights, x = mc.arguments(mesh, layout)
        for engine in engines:
            seen: dict = {}

            def every_position(t, spans, allocations, hlo, tags, backward_start, top, seen=seen):
                for position in range(max(s[1] for s in spans) + 1):
                    for b in buffers_at(position, spans, allocations, hlo, tags, backward_start, None):
                        if hlo.opcode.get(b.instruction, "").startswith("all-gather") or b.op_name.endswith(
                            "sharding_constraint"
                        ):
                            seen[b.instruction] = [b.kind, b.op_name, hlo.opcode.get(b.instruction, "")]
                return buffers_at(t, spans, allocations, hlo, tags, backward_start, top)

            jax.config.update("jax_remat3", engine == "remat3")
            _timeline_buffers.buffers_at = every_position
            try:
                grad = jax.grad(mc.loss_fn(mesh, layout, "full"), argnums=(0, 1))
                timeline = jremat.memory_timeline(grad, weights, x)
            finally:
                _timeline_buffers.buffers_at = buffers_at
                jax.config.update("jax_remat3", False)
            out[f"{layout}/{engine}"] = {
                "buffers": seen,
                "notes": list(timeline.notes),
                "devices": timeline.devices,
                "header": timeline.table().splitlines()[0],
            }
    return out


def _normed_block(mesh):
    """A residual block like the reference model's: LayerNorm and GELU from :mod:`jremat.ops`, whose
    own checkpoints recompute their statistics and ``tanh`` in the backward pass under any policy."""
    place = jax.lax.with_sharding_constraint
    scale, bias = jnp.ones(mc.D), jnp.zeros(mc.D)

    def block(w, x):
        w1 = place(w["w1"], NamedSharding(mesh, P()))
        w2 = place(w["w2"], NamedSharding(mesh, P()))
        y = x + jremat.ops.gelu(jremat.ops.layer_norm(x, scale, bias) @ w1) @ w2
        return place(y, NamedSharding(mesh, P(("data", "fsdp"), None)))

    return block


def check_timeline_kinds() -> dict:
    """``memory_timeline`` of ``none`` and ``full`` on the unrolled FSDP model with normed blocks,
    both engines: the kind of every buffer at every schedule position, as ``kind -> [[instruction,
    op name], ...]`` for the kinds ``recomputation`` and ``forward residual``."""
    mesh = mc.make_mesh("fsdp=8")
    weights, x = mc.arguments(mesh, "unrolled")
    buffers_at = _timeline_buffers.buffers_at
    out = {}
    for engine in mc.ENGINES:
        for policy in ("none", "full"):
            seen: dict = {}

            def every_position(t, spans, allocations, hlo, tags, backward_start, top, seen=seen):
                for position in range(max(s[1] for s in spans) + 1):
                    for b in buffers_at(position, spans, allocations, hlo, tags, backward_start, None):
                        seen[b.instruction] = [b.kind, b.op_name]
                return buffers_at(t, spans, allocations, hlo, tags, backward_start, top)

            jax.config.update("jax_remat3", engine == "remat3")
            _timeline_buffers.buffers_at = every_position
            try:
                grad = jax.grad(mc.loss_fn(mesh, "unrolled", policy, block=_normed_block(mesh)), argnums=(0, 1))
                jremat.memory_timeline(grad, weights, x)
            finally:
                _timeline_buffers.buffers_at = buffers_at
                jax.config.update("jax_remat3", False)
            kinds: dict = {"recomputation": [], "forward residual": []}
            for instruction, (kind, op_name) in sorted(seen.items()):
                if kind in kinds:
                    kinds[kind].append([instruction, op_name])
            out[f"{engine}/{policy}"] = kinds
    return out


class LiveArraysDevice:
    """One CPU device whose ``memory_stats`` counts the bytes of the live arrays' shards on it.

    XLA:CPU keeps no allocator statistics; this reads what an allocator would hold on that device
    between runs (each live array's shard there; a replicated one whole), so ``live_memory``'s
    reading path runs on the CPU. The peak is the highest count read so far.
    """

    def __init__(self, device):
        self.device, self.platform, self.peak_bytes = device, device.platform, 0

    def memory_stats(self) -> dict:
        in_use = sum(
            int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
            for a in jax.live_arrays()
            if self.device in a.sharding.device_set
        )
        self.peak_bytes = max(self.peak_bytes, in_use)
        return {"bytes_in_use": in_use, "peak_bytes_in_use": self.peak_bytes}

    def __str__(self) -> str:
        return str(self.device)


def check_live() -> dict:
    """``live_memory`` of a sharded step on the CPU: what it says of a CPU device (no allocator
    statistics), and what it reads from one device that reports them (:class:`LiveArraysDevice`)
    when the step's gradients stay alive: their shards on that device, against the whole."""
    mesh = mc.make_mesh("fsdp=8")
    weights, x = mc.arguments(mesh, "unrolled")
    # Gradients placed as their arguments are (sharded over the 8 devices).
    shardings = jax.tree.map(lambda a: a.sharding, (weights, x))
    step = jax.jit(jax.grad(mc.loss_fn(mesh, "unrolled", "full"), argnums=(0, 1)), out_shardings=shardings)
    live = jremat.live_memory(step, weights, x)
    kept = []
    read = jremat.live_memory(
        lambda *a: kept.append(step(*a)) or kept[-1], weights, x, device=LiveArraysDevice(jax.devices()[0])
    )
    grads = jax.tree.leaves(kept)
    return {
        "devices": live.devices,
        "available": live.available,
        "reason": live.reason,
        "read": {"available": read.available, "devices": read.devices, "device": read.device, "text": read.text()},
        "read_growth_bytes": read.peak_bytes_in_use - read.bytes_in_use_before,
        "grads_bytes_per_device": sum(int(np.prod(g.sharding.shard_shape(g.shape))) * g.dtype.itemsize for g in grads),
        "grads_bytes": sum(g.nbytes for g in grads),
    }


def check_keep_gathered_remat3() -> dict:
    """Under remat3, the FSDP model per layout and dots policy with ``keep_gathered=true``:
    all-gathers of the compiled gradient and its error against no remat."""
    mesh = mc.make_mesh("fsdp=8")
    out = {}
    jax.config.update("jax_remat3", True)
    try:
        for layout in ("unrolled", "scanned"):
            weights, x = mc.arguments(mesh, layout)
            reference = None
            for policy in ("none", "dots", "dots:keep_gathered=true", "dots_no_batch:keep_gathered=true"):
                compiled = mc._compile(mc.loss_fn(mesh, layout, policy), weights, x)
                grads = compiled(weights, x)
                reference = grads if reference is None else reference
                out[f"{layout}/{policy}"] = {
                    "all-gather": jremat.compiled_collectives_report(compiled).count("all-gather"),
                    "grad_rel_error": mc.max_rel_error(grads, reference),
                }
    finally:
        jax.config.update("jax_remat3", False)
    return out


#: Each check by its name without ``check_``.
CHECKS = {
    f.__name__.removeprefix("check_"): f
    for f in (
        check_residuals,
        check_explain,
        check_timeline,
        check_timeline_kinds,
        check_live,
        check_keep_gathered_remat3,
    )
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, sys.argv[1:]))
