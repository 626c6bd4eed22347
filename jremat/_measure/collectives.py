"""Collectives in a compiled program: what a policy makes a sharded step communicate.

On a mesh, XLA's SPMD partitioner turns every sharding mismatch into a collective: FSDP
all-gathers each weight where a matmul uses it, tensor parallelism all-reduces a row-parallel
matmul's output. A checkpoint that recomputes such a matmul in the backward pass re-issues the
collective that fed it, unless the gathered value is among what it saves. :func:`collectives_report`
compiles a function (nothing runs) and reads every collective from the optimized HLO.

How it is read (and the limits):

* every ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all`` and
  ``collective-permute`` instruction, in every computation the entry reaches; an asynchronous
  pair (``all-gather-start`` / ``all-gather-done``) counts once, at its ``-done``;
* a ``while`` loop's body counts its trip count times (XLA's ``known_trip_count``, which
  ``lax.scan`` loops carry); a loop without one counts once and a note says so; each branch of a
  conditional counts once (an upper bound of what runs), and a computation once per calling
  computation (the module is read by :func:`jremat._measure.xla_dump.parse_hlo`);
* bytes are per device (an SPMD program is one device's share): the result buffer of each
  collective, except ``reduce-scatter``, whose operand (the unscattered buffer) is counted;
* the phase comes from the instruction's ``op_name`` metadata, which JAX writes from the
  transformation stack: ``rematted_computation`` (the recomputation of a checkpoint, both remat
  engines) is :data:`RECOMPUTE`, ``transpose(`` (the backward pass) :data:`BACKWARD`, anything
  else :data:`FORWARD`; the name scope of jremat's cotangent tie (:data:`jremat._engine.tie.TIE_SCOPE`)
  is :data:`TIE`: the 4-byte all-reduce each tied checkpoint adds on a mesh (one per checkpoint's
  backward step), which :meth:`CollectivesReport.reissued` leaves out and :func:`tie_lines` reports.
  XLA may combine it with other all-reduces into one tuple all-reduce, whose ``op_name`` is one
  of theirs. XLA may move a collective onto an operand from elsewhere (in a
  ``lax.scan`` the re-gather of a weight lands on the loop's slice of the stacked weights, whose
  metadata names the slice, not the checkpoint), so a recomputation's collective can be labelled
  backward. The difference from the same program without remat (:meth:`CollectivesReport.reissued`)
  does not depend on the labels: it is what a policy re-issues.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jremat._engine import tie as _tie
from jremat._measure import memory as _memory
from jremat._measure import xla_dump as _xla_dump
from jremat._measure.mesh import mesh_devices
from jremat._spec.budget import format_bytes

#: Collective kinds, in report order.
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
#: Phases of a collective.
FORWARD, BACKWARD, RECOMPUTE = "forward", "backward", "recompute"
#: The phase of the all-reduces jremat's cotangent tie adds (:mod:`jremat._engine.tie`).
TIE = "cotangent tie"
PHASES = (FORWARD, BACKWARD, RECOMPUTE, TIE)

_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (``f32[64,256]{1,0}``, or a tuple of them: summed)."""
    total_bits = 0
    for dtype, dims in _ARRAY.findall(shape):
        # The element width is the type's first number (f32, bf16, s4, f8e4m3fn, c64); pred is a byte.
        width = re.search(r"\d+", dtype)
        bits = int(width.group()) if width else 8 if dtype == "pred" else 0
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total_bits += n * bits
    return total_bits // 8


def _kind(opcode: str) -> str | None:
    """The collective kind of an opcode counted, ``None`` for other opcodes and ``-start`` halves."""
    base = opcode.removesuffix("-done")
    return base if base in KINDS else None


def _phase(op_name: str) -> str:
    if _tie.TIE_SCOPE in op_name:
        return TIE
    if "rematted_computation" in op_name:
        return RECOMPUTE
    if "transpose(" in op_name:
        return BACKWARD
    return FORWARD


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      kind: one of :data:`KINDS`.
      phase: :data:`FORWARD`, :data:`BACKWARD`, :data:`RECOMPUTE` or :data:`TIE` (read from ``op_name``; see
        the module docstring for its limits).
      bytes: bytes per device of one execution (the result; a reduce-scatter's operand).
      executions: how many times it runs per call of the program (loop trip counts multiplied).
      instruction: its HLO instruction name.
      computation: the HLO computation it is in.
      op_name: its ``op_name`` metadata (``""`` if none).
    """

    kind: str
    phase: str
    bytes: int
    executions: int
    instruction: str
    computation: str
    op_name: str

    @property
    def total_bytes(self) -> int:
        """``bytes * executions``."""
        return self.bytes * self.executions


@dataclasses.dataclass(frozen=True)
class CollectivesReport:
    """Every collective of a compiled program, per device (see :func:`collectives_report`).

    Attributes:
      collectives: one :class:`Collective` per instruction.
      devices: the devices the program runs on (1: no mesh, no collectives).
      notes: caveats (a loop whose trip count is unknown).
    """

    collectives: tuple[Collective, ...]
    devices: int = 1
    notes: tuple[str, ...] = ()

    def _select(self, kind: str | None, phase: str | None):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; valid kinds: {', '.join(KINDS)}")
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; valid phases: {', '.join(PHASES)}")
        return [c for c in self.collectives if kind in (None, c.kind) and phase in (None, c.phase)]

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        """Executions per step of collectives of ``kind`` in ``phase`` (``None``: all).

        Raises:
          ValueError: on an unknown kind or phase.
        """
        return sum(c.executions for c in self._select(kind, phase))

    def bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes per device per step of collectives of ``kind`` in ``phase`` (``None``: all).

        Raises:
          ValueError: on an unknown kind or phase.
        """
        return sum(c.total_bytes for c in self._select(kind, phase))

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """``{kind: (count, bytes)}`` for every kind present, in :data:`KINDS` order."""
        return {k: (self.count(k), self.bytes(k)) for k in KINDS if self.count(k)}

    def reissued(self, baseline: CollectivesReport) -> dict[str, tuple[int, int]]:
        """``{kind: (count, bytes)}`` more than ``baseline`` (usually the program without remat),
        for every kind where either differs (negative: fewer); the cotangent tie's all-reduces
        (phase :data:`TIE`, see :func:`tie_lines`) are left out of both."""

        def untied(report: CollectivesReport, kind: str) -> tuple[int, int]:
            return report.count(kind) - report.count(kind, TIE), report.bytes(kind) - report.bytes(kind, TIE)

        out = {}
        for k in KINDS:
            (count, size), (base_count, base_size) = untied(self, k), untied(baseline, k)
            delta = (count - base_count, size - base_size)
            if delta != (0, 0):
                out[k] = delta
        return out

    def text(self, baseline: CollectivesReport | None = None) -> str:
        """One line per kind: count and bytes per device per step, by phase, and the difference
        from ``baseline`` when given (the cotangent tie's apart, as in :meth:`reissued`);
        ``"no collectives"`` when there are none."""
        if not self.collectives:
            return f"no collectives ({self.devices} device{'s' if self.devices != 1 else ''})"
        lines = []
        extra = self.reissued(baseline) if baseline is not None else {}
        for kind, (count, total) in self.by_kind().items():
            phases = ", ".join(f"{p} {self.count(kind, p)}" for p in PHASES if self.count(kind, p))
            more = ""
            if baseline is not None:
                dc, db = extra.get(kind, (0, 0))
                more = f"; {dc:+d} ({'+' if db >= 0 else '-'}{format_bytes(abs(db))}) vs without remat"
                if self.count(kind, TIE):
                    more += f", the cotangent tie's {self.count(kind, TIE)} apart"
            lines.append(f"{kind}: {count} per step, {format_bytes(total)} per device ({phases}){more}")
        return "\n".join(lines + list(self.notes))

    def to_json(self) -> dict:
        """Counts and bytes per kind and phase, devices and notes, as JSON-ready values."""
        return {
            "devices": self.devices,
            "kinds": {
                k: {"count": c, "bytes": b, "phases": {p: self.count(k, p) for p in PHASES if self.count(k, p)}}
                for k, (c, b) in self.by_kind().items()
            },
            "notes": list(self.notes),
        }


def hlo_collectives(hlo_text: str, devices: int = 1) -> CollectivesReport:
    """Read the collectives of an optimized HLO module's text (``compiled.as_text()``).

    Args:
      hlo_text: the HLO module text.
      devices: the number of devices the program runs on (recorded in the report).

    Returns:
      A :class:`CollectivesReport`.

    Raises:
      ValueError: if the text has no ``ENTRY`` computation.
    """
    hlo = _xla_dump.parse_hlo(hlo_text)
    if hlo.entry is None:
        raise ValueError("not an HLO module's text: no ENTRY computation found")
    trips = {body: trip for _, body, trip, _ in hlo.whiles.values()}
    notes = [
        f"a while loop in {hlo.computation[name]} has no known trip count: its body is counted once"
        for name, (_, _, trip, _) in hlo.whiles.items()
        if trip is None
    ]
    callers: dict = {}
    for caller, callees in hlo.called.items():
        for callee in callees:
            callers.setdefault(callee, []).append(caller)
    executions = {hlo.entry: 1}

    def count_of(name: str, seen: frozenset = frozenset()) -> int:
        # A computation runs as often as its callers together (a loop body: times the trip count).
        if name not in executions:
            if name in seen:
                return 0
            runs = sum(count_of(c, seen | {name}) for c in callers.get(name, ()))
            executions[name] = runs * (trips.get(name) or 1)
        return executions[name]

    found = []
    for name, opcode in hlo.opcode.items():
        kind = _kind(opcode)
        runs = count_of(hlo.computation[name]) if kind else 0
        if not runs:
            continue
        size = shape_bytes(hlo.shape[name])
        if kind == "reduce-scatter":
            size = sum(shape_bytes(hlo.shape.get(o, "")) for o in hlo.operands.get(name, ()))
        op_name = hlo.op_name.get(name, "")
        assert kind is not None  # runs is 0 for an opcode of no kind
        found.append(Collective(kind, _phase(op_name), size, runs, name, hlo.computation[name], op_name))
    return CollectivesReport(tuple(found), devices, tuple(dict.fromkeys(notes)))


_price_lock = threading.Lock()
#: Kinds :func:`collective_s_per_byte` times; a collective-permute is priced as an all-gather.
TIMED_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")


def _devices_for_price(kind: str, devices, name: str) -> tuple:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    devices = tuple(getattr(devices, "devices", np.asarray(jax.devices() if devices is None else devices)).flat)
    if len(devices) < 2:
        raise ValueError(f"{name} needs at least 2 devices, got {len(devices)}")
    return devices


def collective_s_per_byte(kind: str = "all-gather", devices=None, *, transfer_bytes: int = 4 * 2**20) -> float:
    """Seconds per byte (per device) of a collective of ``kind`` across ``devices``, measured there.

    Times the collective over all ``devices`` (one mesh axis through them) on ``transfer_bytes``
    per device, in the report's byte convention (the result; a reduce-scatter's operand).
    ``collective-permute`` is priced as an all-gather. It does not credit the
    overlap of communication with compute. Measured once per argument set and cached; threads
    asking at once wait for one measurement. :func:`jremat.fit_search` prices a step's
    collectives with it.

    Args:
      kind: one of :data:`KINDS`.
      devices: a :class:`jax.sharding.Mesh` or a sequence of devices (default: ``jax.devices()``).
      transfer_bytes: bytes per device per collective timed.

    Raises:
      ValueError: on an unknown kind, or fewer than two devices (no communication to price).
    """
    devices = _devices_for_price(kind, devices, "collective_s_per_byte")
    with _price_lock:
        return _measured_s_per_byte(kind if kind in TIMED_KINDS else "all-gather", devices, transfer_bytes)


def power_of_two(x: float) -> float:
    """``x`` rounded to the nearest power of two (in log scale): the rates the planners price with,
    so that runs on machines of one kind (and repeated runs on one) agree unless a rate sits near a
    power of two."""
    return 2.0 ** round(math.log2(max(x, 1e-30)))


def rounded_s_per_byte(kind: str, devices) -> float:
    """:func:`collective_s_per_byte` rounded by :func:`power_of_two`: the rate :func:`jremat.fit_search`
    (``TimeModel.collective_s_per_byte``) and :func:`collective_flops_per_byte` price with.

    Raises:
      ValueError: as :func:`collective_s_per_byte`.
    """
    return power_of_two(collective_s_per_byte(kind, devices))


def collective_flops_per_byte(
    kind: str = "all-gather", devices=None, *, transfer_bytes: int = 4 * 2**20, matmul_size: int = 1024
) -> float:
    """FLOP-equivalents of one byte of a collective of ``kind`` across ``devices``, measured there.

    :func:`collective_s_per_byte` times the FLOP rate of a ``matmul_size``-square float32 matmul
    on one of the devices, each rounded to a power of two as :func:`jremat.fit_search`'s time
    model rounds its rates (:func:`power_of_two`), so that the price, and the plan ``auto``
    chooses with it, agree between runs unless a rate sits near a power of two: communication in the recompute cost model's
    unit, as :func:`jremat.offload_flops_per_byte` prices offloading. Measured once per argument
    set and cached; threads asking at once wait for one measurement.

    Args:
      kind: one of :data:`KINDS`.
      devices: a :class:`jax.sharding.Mesh` or a sequence of devices (default: ``jax.devices()``).
      transfer_bytes: bytes per device per collective timed.
      matmul_size: the side of the matmul timed.

    Raises:
      ValueError: on an unknown kind, or fewer than two devices (no communication to price).
    """
    devices = _devices_for_price(kind, devices, "collective_flops_per_byte")
    with _price_lock:
        seconds = _measured_s_per_byte(kind if kind in TIMED_KINDS else "all-gather", devices, transfer_bytes)
        return power_of_two(seconds) * power_of_two(_matmul_flops_per_s(devices[0], matmul_size))


@functools.lru_cache(maxsize=16)
def _measured_s_per_byte(kind: str, devices: tuple, transfer_bytes: int) -> float:
    from jax.sharding import NamedSharding, PartitionSpec

    from jremat._measure.host_offload import best_s

    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("devices",))
    split, whole = NamedSharding(mesh, PartitionSpec("devices")), NamedSharding(mesh, PartitionSpec())
    per_device = max(transfer_bytes // 4, n)
    if kind == "all-gather":  # each device ends with the whole array: transfer_bytes of result
        data = jax.device_put(jnp.ones((per_device - per_device % n,), jnp.float32), split)
        step = jax.jit(lambda x: x + 0, out_shardings=whole)
    elif kind == "all-to-all":  # rows split to columns split: each device's result is its share
        side = max(n, math.isqrt(per_device * n) // n * n)
        data = jax.device_put(jnp.ones((side, side), jnp.float32), split)
        step = jax.jit(lambda x: x + 0, out_shardings=NamedSharding(mesh, PartitionSpec(None, "devices")))
        return best_s(lambda: step(data)) / (side * side // n * 4)
    else:  # [n, m] split over devices, summed over n: all-reduce (whole) or reduce-scatter (split)
        m = per_device if kind == "all-reduce" else per_device - per_device % n
        data = jax.device_put(jnp.ones((n, m), jnp.float32), split)
        step = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=whole if kind == "all-reduce" else split)
    return best_s(lambda: step(data)) / (per_device * 4)


@functools.lru_cache(maxsize=16)
def _matmul_flops_per_s(device, matmul_size: int) -> float:
    from jremat._measure.host_offload import best_s

    a = jax.device_put(jnp.ones((matmul_size, matmul_size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    return 2 * matmul_size**3 / best_s(lambda: matmul(a))


#: How to avoid re-issuing each kind of collective, for :func:`reissued_lines`.
HOW_TO_AVOID = {
    "all-gather": (
        "the recomputation gathers again; keep_collectives=true on the policy (e.g. 'full:keep_collectives=true') "
        "keeps each checkpoint's gathers (written in a shard_map, or a weight's sharding constraint before its "
        "matmul) from its forward to its backward pass, per device, as no remat does (keep_gathered=true keeps the "
        "gathered weights alone)"
    ),
    "all-to-all": (
        "the recomputation exchanges again (an expert-parallel dispatch or combine); keep_collectives=true on the "
        "policy keeps the outputs of the all-to-alls written in a shard_map"
    ),
    "all-reduce": (
        "the recomputation reduces again; keep_collectives=true on the policy keeps the outputs of the psums written "
        "in a shard_map (for a row-parallel matmul whose output XLA all-reduces, save that matmul's output: dots, "
        "or its checkpoint_name with names:save=...)"
    ),
    "reduce-scatter": "keep_collectives=true on the policy keeps the outputs of the psum_scatters written in a shard_map",
    "collective-permute": "keep_collectives=true on the policy keeps the outputs of the ppermutes written in a shard_map",
}


#: The advice when the policy keeps that kind already and it is re-issued: XLA inserted it.
KEPT_YET_REISSUED = (
    "the policy keeps every {kind} written in the model, so XLA inserts these on its own (a sharding mismatch) and "
    "they are not in the traced program; make each explicit in the model, inside the checkpoint: "
    "jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec)) of a weight to its gathered placement (P() when "
    "only FSDP shards it; jax.sharding.reshard on a mesh of explicit axes), or the collective in a shard_map"
)


def reissued_lines(
    label: str, report: CollectivesReport, baseline: CollectivesReport, *, kept_kinds: frozenset[str] = frozenset()
) -> list[str]:
    """One line per collective kind ``report`` issues more of than ``baseline`` (the same program
    without remat), with bytes per device per step and how to avoid them; ``[]`` when none. The
    cotangent tie's all-reduces are not among them (:func:`tie_lines`). ``kept_kinds``: the kinds
    the policy keeps already (``keep_gathered``: all-gathers; ``keep_collectives``: every kind), so
    re-issued ones of those kinds are ones XLA inserted."""
    lines = []
    for kind, (count, size) in report.reissued(baseline).items():
        if count <= 0 and size <= 0:
            continue
        how = HOW_TO_AVOID.get(kind, "keep_collectives=true on the policy")
        if kind in kept_kinds:
            how = KEPT_YET_REISSUED.format(kind=kind)
            if kept_kinds == {"all-gather"}:  # keep_gathered alone
                how += "; or keep_collectives=true, which gathers such weights itself on a mesh of one split axis"
        lines.append(
            f"re-issued collectives ({label}): re-issues {count} {kind}{'s' if count != 1 else ''}, "
            f"{format_bytes(size)} per step per device more than none; {how}"
        )
    return lines


def tie_lines(label: str, report: CollectivesReport) -> list[str]:
    """The line naming the all-reduces jremat's cotangent tie adds to ``report`` (phase :data:`TIE`)
    and how to drop them; ``[]`` when there are none."""
    count = report.count("all-reduce", TIE)
    if not count:
        return []
    size = report.bytes("all-reduce", TIE)
    return [
        f"cotangent tie ({label}): the cotangent tie adds {count} all-reduce{'s' if count != 1 else ''} of "
        f"{format_bytes(size // count)} ({format_bytes(size)} per step per device), one per tied "
        "checkpoint's backward step; they keep each recomputation in that step, which straight-line code needs; "
        "inside a lax.scan of more than one step, pass prevent_cse=False (as to jax.checkpoint there) to drop them"
    ]


def compiled_collectives_report(compiled) -> CollectivesReport:
    """The collectives of a compiled executable (``jax.jit(f).lower(...).compile()``).

    Raises:
      ValueError: if the executable's text is not HLO.
    """
    return hlo_collectives(compiled.as_text(), mesh_devices(getattr(compiled, "input_shardings", ())))


def collectives_report(
    fn: Callable, *args, compiler_options: dict | None = None, donate_argnums: int | tuple[int, ...] = (), **kwargs
) -> CollectivesReport:
    """Compile ``fn(*args, **kwargs)`` as :func:`jremat.memory_report` does (nothing runs) and
    read every collective it issues per device and step.

    Args:
      fn: a function of pytrees of arrays, or one already jitted (with its own shardings), such
        as ``jax.grad(loss)`` or a whole train step.
      *args: arrays or :class:`jax.ShapeDtypeStruct`; their ``sharding`` places them on a mesh.
      compiler_options: as in :func:`jremat.memory_report`.
      donate_argnums: as in :func:`jremat.memory_report`.
      **kwargs: keyword arguments, likewise.

    Returns:
      A :class:`CollectivesReport`: empty on one device; :meth:`CollectivesReport.reissued`
      against the same function without remat gives what a policy re-issues.

    Raises:
      TypeError: if ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"collectives_report needs a callable, got {type(fn).__name__}")
    compiled, _ = _memory.compile_for_analysis(
        fn, *args, compiler_options=compiler_options, donate_argnums=donate_argnums, **kwargs
    )
    return compiled_collectives_report(compiled)


__all__ = [
    # The report and what it is made of.
    "collectives_report",
    "compiled_collectives_report",
    "hlo_collectives",
    "CollectivesReport",
    "Collective",
    "KINDS",
    "PHASES",
    "FORWARD",
    "BACKWARD",
    "RECOMPUTE",
    "TIE",
    # Prices, measured on the mesh.
    "collective_s_per_byte",
    "collective_flops_per_byte",
    # Helpers other reports use.
    "reissued_lines",
    "tie_lines",
    "shape_bytes",
]
