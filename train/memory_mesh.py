"""``python -m train.memory --mesh SPEC``: the sharded gradient step per policy, every figure per device.

The step is compiled on the mesh (:func:`train.sharded_steps.sharded_step_memory`, nothing runs)
for each ``--policy``; ``auto`` plans against the per-device compiled peak. With ``--timeline``
each policy's timeline is that of the sharded step (one device's share, all-gathered weights as
their own kind: :func:`jremat.memory_timeline`); with ``--live`` each policy's step runs once on
the mesh in a fresh process and the allocator's peak of one device is read (:mod:`train.memory_live`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

import jremat
from jremat import format_bytes, registry
from jremat.models import ModelConfig
from jremat.train import sharded_steps, sharding, timeline_plot
from jremat.train.usage import UsageError


@dataclasses.dataclass
class MeshRow:
    """One policy's row of the ``--mesh`` report; every figure is per device.

    Attributes:
      policy: the ``--policy`` spec (``auto``: the plan it chose).
      config: the model under that policy.
      memory: the compiled step's per-device memory and collectives.
      batch_size, seq_len: the global batch.
      live_peak_bytes: with ``--live``, the allocator's peak of one device after one step.
      timeline: with ``--timeline``, the sharded step's memory timeline (one device's share).
    """

    policy: str
    config: ModelConfig
    memory: sharded_steps.DeviceMemory
    batch_size: int
    seq_len: int
    live_peak_bytes: int | None = None
    timeline: jremat.MemoryTimeline | None = None

    @property
    def n_layers(self) -> int:
        """The model's layers (for the timeline's title)."""
        return self.config.n_layers


def mesh_of(config):
    """The mesh of ``config.mesh`` (:func:`train.sharding.mesh_from_flag`).

    Raises:
      UsageError: the mesh does not fit the devices (or names an unknown axis).
    """
    try:
        return sharding.mesh_from_flag(config.mesh)
    except ValueError as err:
        raise UsageError(f"--mesh: {err}") from None


def step_memory_cache(config, mesh) -> Callable[[ModelConfig], sharded_steps.DeviceMemory]:
    """``model config -> DeviceMemory`` of its sharded gradient step on ``mesh``, compiled once per config."""
    compiled: dict = {}

    def step_memory(model_cfg: ModelConfig) -> sharded_steps.DeviceMemory:
        if model_cfg not in compiled:
            compiled[model_cfg] = sharded_steps.sharded_step_memory(
                model_cfg, mesh, config.batch_size, config.resolved_seq_len
            )
        return compiled[model_cfg]

    return step_memory


def mesh_policy_config(config, spec: str, mesh, step_memory) -> tuple[str, ModelConfig, str | None]:
    """``(row label, model config, auto's plan report)`` of one ``--policy`` on the mesh; the report is
    ``None`` for any policy but ``auto``.

    Raises:
      ValueError: on a policy that does not fit the model, or an ``auto`` budget no plan fits.
    """
    if registry.parse_spec(spec)[0] != "auto":
        return spec, config.model_config(spec), None
    plan, reissued_bytes, reissue_flops = mesh_auto_plan(config, spec, mesh, step_memory)
    priced = (
        f"; re-issuing a layer's collectives ({reissued_bytes:,} B per device) priced at {reissue_flops:,.0f} "
        "FLOP-equivalents, keeping them at their bytes"
        if reissued_bytes
        else ""
    )
    report = (
        f"auto on mesh {config.mesh}: budget and peaks per device, tensor bytes/layer global (all devices "
        f"together){priced}\n{plan.table()}"
    )
    return f"auto: {plan.candidate.describe(plan.n_layers)}", plan.config, report


def run_mesh(config) -> list[MeshRow]:
    """``--mesh``: one :class:`MeshRow` per distinct policy, compiled on the mesh (nothing runs); with
    ``--timeline``, each with its per-device timeline.

    Raises:
      UsageError: on a mesh that does not fit the devices, a batch or sequence that does not split,
        or a policy that does not fit the model.
    """
    mesh = mesh_of(config)
    specs = list(dict.fromkeys(config.policy))
    print(
        f"compiling the sharded gradient step under {len(specs)} polic{'y' if len(specs) == 1 else 'ies'} on "
        f"--mesh {config.mesh}...",
        file=sys.stderr,
    )
    step_memory = step_memory_cache(config, mesh)
    rows = []
    for spec in specs:
        try:
            label, cfg, plan_report = mesh_policy_config(config, spec, mesh, step_memory)
            if plan_report:
                print(plan_report, file=sys.stderr)
            row = MeshRow(label, cfg, step_memory(cfg), config.batch_size, config.resolved_seq_len)
            if config.timeline is not None:
                row.timeline = sharded_steps.grad_step_timeline(cfg, mesh, config.batch_size, config.resolved_seq_len)
        except ValueError as err:
            raise UsageError(str(err)) from None
        rows.append(row)
    return rows


def mesh_auto_plan(config, spec: str, mesh, step_memory) -> tuple[jremat.LayerPlan, int, float]:
    """``(plan, bytes per device of the collectives a rematerialized layer issues again, their price
    in FLOP-equivalents)``.

    ``auto`` on a mesh: the least-cost plan whose per-device compiled peak fits the budget (a size
    per device, or a fraction of the way from full's per-device peak to none's); under ``fsdp``,
    re-gathering weights is priced at the all-gather's cost measured on this mesh
    (:func:`jremat.collective_flops_per_byte`) and plans that keep gathered weights are candidates;
    the spec's ``keep_gathered=true`` (``false``) allows only the plans that keep (re-gather) them.
    With an ``expert`` or ``tensor`` axis, the other collectives a rematerialized layer issues again
    (an expert-parallel layer's all-to-alls, a tensor-parallel layer's all-reduces; measured: what
    ``full`` issues beyond ``full:keep_collectives=true``, per layer) are priced at each kind's cost
    too, and, where there are such collectives, the keeping plans set ``keep_collectives`` (the
    spec's ``keep_collectives``, else its ``keep_gathered``, then allows one kind only).

    Raises:
      ValueError: on a bad budget, or when no plan fits.
    """
    from jremat.train import sharded_steps
    from jremat.train.planning import keep_collectives_of, keep_gathered_of, plan_for_budget

    base = config.model_config("none")
    reissued_bytes, reissue_flops = sharded_steps.regather_price(base, mesh)
    raw = registry.parse_spec(spec)[1]
    keep, keep_key = keep_gathered_of(raw), registry.KEEP_GATHERED
    if any(mesh.shape.get(axis, 1) > 1 for axis in (sharding.EXPERT_AXIS, sharding.TENSOR_AXIS)):
        # Expert and tensor parallelism: a rematerialized layer also exchanges its tokens again
        # (all-to-alls) or reduces its row-parallel matmuls again (all-reduces), measured as what
        # full issues beyond the key, per layer (all-gathers are priced above).
        full = step_memory(config.model_config("full")).collectives
        avoided = full.reissued(step_memory(config.model_config(f"full:{registry.KEEP_COLLECTIVES}=true")).collectives)
        others = {kind: nbytes // base.n_layers for kind, (_, nbytes) in avoided.items() if kind != "all-gather"}
        others = {kind: nbytes for kind, nbytes in others.items() if nbytes > 0}
        reissued_bytes += sum(others.values())
        reissue_flops += sum(n * jremat.collective_flops_per_byte(kind, mesh) for kind, n in others.items())
        if others:
            given = keep_collectives_of(raw)
            keep, keep_key = (keep if given is None else given), registry.KEEP_COLLECTIVES
    budget = config.memory_budget or raw.get("budget", "0.5")
    plan = plan_for_budget(
        base,
        config.batch_size,
        budget,
        config.resolved_seq_len,
        measure_peak_bytes=lambda c: step_memory(c).peak,
        offload=False,
        regather_flops=reissue_flops,
        keep_gathered=keep,
        keep_key=keep_key,
        devices=mesh.size,
    )
    return plan, reissued_bytes, reissue_flops


def format_mesh_table(rows: Sequence[MeshRow]) -> str:
    """The ``--mesh`` table: per policy, per-device peak and temp (and live peak, with ``--live``),
    all-gathers and all-reduces (count and bytes per device per step), and the collectives it
    issues beyond ``none``'s (when ``none`` is a row)."""
    base = none_collectives(rows)
    live = any(r.live_peak_bytes is not None for r in rows)
    width = max(28, *(len(r.policy) for r in rows))
    header = (
        f"{'policy':<{width}} {'peak/device':>12} {'temp/device':>12}"
        + (f" {'live/device':>12}" if live else "")
        + f" {'all-gathers':>18} {'all-reduces':>18} {'other':>14}  re-issued beyond none"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        spec, m = row.policy, row.memory
        c = m.collectives
        cells = []
        for kinds in (("all-gather",), ("all-reduce",), ("reduce-scatter", "all-to-all", "collective-permute")):
            n, b = sum(c.count(k) for k in kinds), sum(c.bytes(k) for k in kinds)
            cells.append(f"{n} / {format_bytes(b)}" if n else "0")
        extra = c.reissued(base) if base is not None else {}
        reissued = ", ".join(
            f"{n:+d} {k} ({'+' if b >= 0 else '-'}{format_bytes(abs(b))})" for k, (n, b) in extra.items()
        ) or ("none" if base is not None else "n/a (no none row)")
        lines.append(
            f"{spec:<{width}} {format_bytes(m.peak):>12} {format_bytes(m.temp):>12}"
            + (f" {format_bytes(row.live_peak_bytes):>12}" if live else "")
            + f" {cells[0]:>18} {cells[1]:>18} {cells[2]:>14}  {reissued}"
        )
    first = rows[0].memory
    lines.append(
        f"gradient step on mesh {first.mesh} ({sharding.device_count(first.devices)}), compiled only; every figure is per device "
        f"(one device's share of the SPMD program); collectives as count / bytes per step (jremat.collectives_report)"
        + ("; live = the allocator's peak of the mesh's first device after one step" if live else "")
    )
    return "\n".join(lines)


def none_collectives(rows: Sequence[MeshRow]) -> jremat.CollectivesReport | None:
    """The collectives of the ``none`` row, what the others re-issue beyond; ``None`` without one."""
    return next((r.memory.collectives for r in rows if r.policy == "none"), None)


def mesh_row_json(row: MeshRow, none: jremat.CollectivesReport | None = None) -> dict:
    """One ``--mesh --json`` object: the policy, per-device memory and collectives, and
    ``reissued_beyond_none`` (per collective kind it issues more or fewer of than ``none``, the
    ``none`` row's :class:`jremat.CollectivesReport`: count and bytes per device per step; ``null``
    without one) (and, when measured, the live peak and the timeline, per device)."""
    out = {k: v for k, v in dataclasses.asdict(row.memory).items() if k != "collectives"}
    out = {"policy": row.policy, **out, "collectives": row.memory.collectives.to_json()}
    extra = row.memory.collectives.reissued(none) if none is not None else None
    out["reissued_beyond_none"] = (
        None if extra is None else {kind: {"count": n, "bytes": b} for kind, (n, b) in extra.items()}
    )
    if row.live_peak_bytes is not None:
        out["live_peak_bytes"] = row.live_peak_bytes
    if row.timeline is not None:
        out["timeline"] = timeline_plot.timeline_json(row.timeline)
    return out


def format_mesh_timelines(rows: Sequence[MeshRow]) -> str:
    """The ``--mesh --timeline`` text: what the figures are (per device), then per policy the bytes live
    at its peak by kind (gathered weights apart from recomputation) and the top buffers there."""
    first = rows[0].memory
    lines = [
        f"timelines per device: one device's share of the sharded gradient step on mesh {first.mesh} "
        f"({sharding.device_count(first.devices)}); buffers are shards, all-gathered weights have their own kind"
    ]
    for row in rows:
        by_kind: dict[str, int] = {}
        for buffer in row.timeline.top_buffers:
            by_kind[buffer.kind] = by_kind.get(buffer.kind, 0) + buffer.size_bytes
        kinds = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in sorted(by_kind.items(), key=lambda kv: -kv[1]))
        lines.append(f"per device at the peak [{row.policy}]: {kinds}")
    lines.append(timeline_plot.format_timelines(rows))
    return "\n".join(lines)
