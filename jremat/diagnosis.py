"""Diagnosing what a policy did: the tools that explain, measure and count, in one namespace (as
:mod:`equinox.debug` keeps Equinox's debugging tools).

- What a policy decided and why: :func:`explain`, :func:`explain_applied`; what it keeps:
  :func:`saved_residuals_report`.
- Memory: :func:`memory_report` and :func:`compiled_memory_report` (compiled figures, with
  :data:`PEAK_FROM_SUM` and its siblings naming where a peak came from), :func:`diagnose_remat`,
  the live bytes over the compiled schedule (:func:`memory_timeline`, :func:`build_timeline`) and
  the allocator's peak of a real run (:func:`live_memory`).
- Collectives on a mesh: :func:`collectives_report`, :func:`compiled_collectives_report` and
  their measured rates (:func:`collective_s_per_byte`).
- Counting work: :func:`program_flops`, :func:`jaxpr_flops`, attention forward kernels run
  (:func:`count_forward_passes`), a compiled program's XLA cost (:func:`cost_analysis`) and
  identity (:func:`hlo_fingerprint`).

Those of its names that are also at the top level are the same objects
(``jremat.explain is jremat.diagnosis.explain``). See ``docs/memory.md`` and ``docs/timeline.md``.
"""

from jremat._explain.explain import Explanation, explain, explain_applied
from jremat._explain.residuals import ResidualsReport, saved_residuals_report
from jremat._measure.collectives import (
    Collective,
    CollectivesReport,
    collective_flops_per_byte,
    collective_s_per_byte,
    collectives_report,
    compiled_collectives_report,
)
from jremat._measure.compile import cost_analysis, hlo_fingerprint
from jremat._measure.live import LiveMemory, allocator_stats_missing, live_memory
from jremat._measure.memory import (
    PEAK_FROM_BACKEND,
    PEAK_FROM_SUM,
    PEAK_UNAVAILABLE,
    MemoryReport,
    compiled_memory_report,
    diagnose_remat,
    memory_report,
)
from jremat._measure.timeline import MemoryTimeline, TimelineBuffer, build_timeline, memory_timeline
from jremat._program.flops import jaxpr_flops, program_flops
from jremat._spec.budget import format_bytes
from jremat.attention import count_forward_passes

__all__ = [
    "PEAK_FROM_BACKEND",
    "PEAK_FROM_SUM",
    "PEAK_UNAVAILABLE",
    "Collective",
    "CollectivesReport",
    "Explanation",
    "LiveMemory",
    "MemoryReport",
    "MemoryTimeline",
    "ResidualsReport",
    "TimelineBuffer",
    "allocator_stats_missing",
    "build_timeline",
    "collective_flops_per_byte",
    "collective_s_per_byte",
    "collectives_report",
    "compiled_collectives_report",
    "compiled_memory_report",
    "cost_analysis",
    "count_forward_passes",
    "diagnose_remat",
    "explain",
    "explain_applied",
    "format_bytes",
    "hlo_fingerprint",
    "jaxpr_flops",
    "live_memory",
    "memory_report",
    "memory_timeline",
    "program_flops",
    "saved_residuals_report",
]
