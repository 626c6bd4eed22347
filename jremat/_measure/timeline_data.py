"""What :func:`jremat.memory_timeline` returns: buffer kinds, the buffers live at the peak, loop spans.

The kinds and how the curve is built are described in :mod:`jremat._measure.timeline`.
"""

from __future__ import annotations

import dataclasses

from jremat._measure import memory as _memory
from jremat._spec.budget import format_bytes

#: Buffer kinds (see :mod:`jremat._measure.timeline`).
ARGUMENT = "argument"
FORWARD = "forward"
FORWARD_RESIDUAL = "forward residual"
RECOMPUTATION = "recomputation"
GRADIENT = "gradient"
OUTPUT = "output"
OTHER = "other"
#: A weight all-gathered on a mesh (FSDP), in the forward pass or again for the backward pass.
GATHERED = "gathered weight"
BUFFER_KINDS = (ARGUMENT, FORWARD, FORWARD_RESIDUAL, RECOMPUTATION, GATHERED, GRADIENT, OUTPUT, OTHER)


# ---------------------------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimelineBuffer:
    """One buffer live at the timeline's peak.

    Attributes:
      name: ``checkpoint_name`` tag, or the JAX name stack's last parts, or the HLO instruction.
      kind: one of :data:`BUFFER_KINDS`.
      size_bytes: bytes the buffer occupies.
      shape: HLO shape, e.g. ``bf16[2,16,32]{2,1,0}``.
      instruction: the HLO instruction that defines it.
      op_name: the JAX name stack of that instruction (``""`` when XLA left none).
      source: innermost ``file:line`` of the instruction's Python stack (``""`` when unknown).
      start_position: first schedule position at which it is live.
      end_position: last schedule position at which it is live.
    """

    name: str
    kind: str
    size_bytes: int
    shape: str
    instruction: str
    op_name: str
    source: str
    start_position: int
    end_position: int


@dataclasses.dataclass(frozen=True)
class LoopSpan:
    """A top-level ``while`` loop's span of schedule positions (its body is scheduled once).

    Attributes:
      instruction: the HLO ``while`` instruction.
      start_position: first position of its condition or body.
      end_position: the position of the ``while`` itself.
      trip_count: iterations when XLA knows them, else ``None``.
      op_name: the loop's JAX name stack (``jvp()/while`` is a forward scan, ``transpose(...)`` a
        backward one).
    """

    instruction: str
    start_position: int
    end_position: int
    trip_count: int | None
    op_name: str


@dataclasses.dataclass(frozen=True)
class MemoryTimeline:
    """Live bytes over a compiled program's schedule (see :mod:`jremat._measure.timeline` for the model).

    Attributes:
      live_bytes: live bytes at each schedule position ``0 .. len - 1``.
      peak_position: the position of the maximum (the first one, on ties).
      peak_bytes: ``max(live_bytes)``.
      top_buffers: the buffers live at the peak, largest first (all, or as many as asked for).
      loops: top-level ``while`` loop spans.
      compiled_peak_bytes: :attr:`jremat.MemoryReport.peak_bytes` of the same executable.
      argument_bytes: bytes of the argument allocations (live throughout).
      output_bytes: bytes of the output allocations that are not arguments.
      temp_bytes: size of the preallocated temp block(s) (``0`` where none).
      unmodelled_bytes: constants and thread-local scratch, not in :attr:`live_bytes`.
      platform: the backend the program was compiled for.
      notes: what was and was not modelled, and disagreements with the compiled peak.
      report: the :class:`jremat.MemoryReport` of the same executable (``None`` when built
        from dump text without one).
      devices: the devices the program's input shardings span; above 1 every figure is one
        device's (its share of the SPMD program), and :meth:`table` says so.
    """

    live_bytes: tuple[int, ...]
    peak_position: int
    peak_bytes: int
    top_buffers: tuple[TimelineBuffer, ...]
    loops: tuple[LoopSpan, ...]
    compiled_peak_bytes: int | None
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    unmodelled_bytes: int
    platform: str
    notes: tuple[str, ...] = ()
    report: _memory.MemoryReport | None = None
    devices: int = 1

    @property
    def agreement(self) -> float | None:
        """``peak_bytes / compiled_peak_bytes`` (``None`` without a compiled peak)."""
        return self.peak_bytes / self.compiled_peak_bytes if self.compiled_peak_bytes else None

    def in_loop(self, position: int) -> LoopSpan | None:
        """The top-level loop whose span contains ``position``, if any."""
        return next((lp for lp in self.loops if lp.start_position <= position <= lp.end_position), None)

    def table(self, top: int = 10) -> str:
        """A text table of the ``top`` largest buffers at the peak, with a header line."""
        loop = self.in_loop(self.peak_position)
        where = f"position {self.peak_position} of {len(self.live_bytes)}"
        if loop is not None:
            where += f" (inside loop {loop.instruction}, positions {loop.start_position}-{loop.end_position})"
        per = f" per device ({self.devices} devices)" if self.devices > 1 else ""
        lines = [
            f"peak {format_bytes(self.peak_bytes)}{per} at {where}; "
            f"compiled peak {format_bytes(self.compiled_peak_bytes)}"
            + (f" (timeline/compiled {self.agreement:.3f})" if self.agreement is not None else "")
        ]
        header = f"  {'bytes':>10}  {'kind':<16} {'name':<30} {'shape':<24} {'live':>11}  source"
        lines += [header, "  " + "-" * (len(header) - 2)]
        for b in self.top_buffers[:top]:
            shape = b.shape.split("{")[0]
            lines.append(
                f"  {format_bytes(b.size_bytes):>10}  {b.kind:<16} {b.name[:30]:<30} {shape[:24]:<24} "
                f"{b.start_position:>5}-{b.end_position:<5}  {b.source}"
            )
        return "\n".join(lines)
