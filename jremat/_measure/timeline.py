"""Memory timeline: live bytes over a compiled program's schedule, the peak, and what is live there.

:func:`memory_timeline` compiles a function once with XLA's dump options set for that compile
only (``xla_dump_to`` in ``compiler_options``, a temporary folder, removed afterwards) and reads
three files XLA writes for the optimized module (parsed by :mod:`jremat._measure.xla_dump`):

* ``*buffer-assignment.txt``: every allocation (parameter, output, preallocated temp ...) and the
  logical buffers (HLO values) placed in it, with size and offset;
* ``*live-range.txt``: the flattened schedule (one position per instruction, loop bodies and
  called computations inlined where they run) and each value's live range in positions;
* ``*after_optimizations.txt``: the scheduled HLO, whose ``metadata`` gives each instruction's
  JAX name stack (``op_name``) and Python stack frame.

**What the curve models.** At schedule position ``t`` the live bytes are: every argument
(parameter allocation) and every output allocation for the whole program (the runtime allocates
both before the program starts); and the temp values live at ``t``, counted by the bytes of the preallocated temp block
they occupy (values that share memory, like an in-place update and its operand, count once).
The compiled peak of :func:`jremat.memory_report` is ``argument + output - alias + temp``,
where ``temp`` is the size of the temp block, i.e. the heap's high-water mark including
fragmentation; the timeline's maximum is at most that, and :attr:`MemoryTimeline.agreement`
says how close it came. Constants and thread-local scratch (``thread-local`` allocations:
per-fusion scalars) are left out; :attr:`MemoryTimeline.notes` gives their bytes.

**Loops.** A ``lax.scan`` over layers is one XLA ``while`` loop; its body is scheduled once, so
the positions inside a loop span show one iteration, and a buffer live there is live in every
iteration (the stacked per-layer residuals the loop reads are single allocations of all
layers). :attr:`MemoryTimeline.loops` lists the spans of the top-level loops with their trip
counts where XLA knows them.

**Names.** Each buffer is named by the ``jax.ad_checkpoint.checkpoint_name`` tag of the value
that produced it where the tag's source line is on the instruction's Python stack (tags do not
survive into HLO themselves; :func:`memory_timeline` traces the function to map tag source lines
to tags), else by its JAX name stack and innermost source line. Kinds: ``argument`` (an input
of the program: parameters, optimizer state, data), ``forward`` (computed by the forward pass;
``forward residual`` when it is still live once the backward pass has begun), ``recomputation``
(JAX's ``rematted_computation``, or forward-pass math that runs after the backward pass has begun
and that the backward pass reads, such as a dropout mask drawn again from its key or a residual
converted to another dtype; a recomputation XLA merged with the forward's own computation of the
value is the forward's),
``gathered weight`` (on a mesh, an all-gather's result or a copy of it in another layout or dtype,
in either pass: communication, not recomputed math),
``gradient`` (the backward pass:
cotangents and their working set), ``output`` (a result buffer with no live value at that
position, or one written by an instruction without metadata), ``other`` (XLA-inserted values
without metadata). A name is the place a value was computed: a tag whose line also casts a
weight (``self.fc_in(x)`` casts the kernel to the compute dtype) names that cast too, and the
source column tells the two apart. Kinds and names are given in :mod:`jremat._measure.timeline_buffers`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from jremat._engine import jaxpr as _jaxpr
from jremat._measure import compile as _compile
from jremat._measure import memory as _memory
from jremat._measure import timeline_buffers as _timeline_buffers
from jremat._measure.mesh import mesh_devices
from jremat._measure.timeline_data import (
    ARGUMENT,
    BUFFER_KINDS,
    FORWARD,
    FORWARD_RESIDUAL,
    GATHERED,
    GRADIENT,
    OTHER,
    OUTPUT,
    RECOMPUTATION,
    LoopSpan,
    MemoryTimeline,
    TimelineBuffer,
)
from jremat._measure.xla_dump import (
    Hlo,
    Value,
    parse_buffer_assignment,
    parse_hlo,
    parse_live_range,
)
from jremat._spec.budget import format_bytes


def _reachable(comp: str, called: dict) -> set:
    out, todo = set(), [comp]
    while todo:
        c = todo.pop()
        if c in out:
            continue
        out.add(c)
        todo.extend(called.get(c, ()))
    return out


def build_timeline(
    buffer_assignment: str,
    live_range: str,
    hlo_text: str,
    *,
    tags: dict | None = None,
    report: _memory.MemoryReport | None = None,
    top: int | None = None,
) -> MemoryTimeline:
    """A :class:`MemoryTimeline` from the text of three XLA dump files of one compiled module.

    Works on any backend's dump (``cpu_after_optimizations-...``, ``gpu_after_optimizations-...``).

    Args:
      buffer_assignment: text of ``*after_optimizations-buffer-assignment.txt``.
      live_range: text of ``*after_optimizations-live-range.txt``.
      hlo_text: text of ``*after_optimizations.txt`` (or ``compiled.as_text()``).
      tags: ``(source file, line) -> {checkpoint_name tags}`` used to name buffers.
      report: the compiled :class:`jremat.MemoryReport` to compare the maximum with.
      top: how many buffers at the peak to keep (``None``: all of them).

    Raises:
      ValueError: if a text is not the dump it should be, or the schedule is empty.
    """
    allocations = parse_buffer_assignment(buffer_assignment)
    sequence, ranges = parse_live_range(live_range)
    if not sequence:
        raise ValueError("the live-range dump has an empty instruction sequence")
    hlo = parse_hlo(hlo_text)
    tags = tags or {}
    n = len(sequence)
    position = {name: t for t, name in enumerate(sequence)}
    live = np.zeros(n + 1, dtype=np.int64)  # difference array for whole-allocation spans
    argument_bytes = output_bytes = temp_bytes = unmodelled = 0
    spans: list[tuple] = []  # (start, end, value, bytes, reserved-only) for the buffers at the peak
    temp_values: list[tuple[int, int, Value]] = []
    missing_ranges = 0
    for alloc in allocations:
        if alloc.kind in ("constant", "thread-local"):
            unmodelled += alloc.size
            continue
        if alloc.kind == "parameter":
            argument_bytes += alloc.size
            live[0] += alloc.size
            live[n] -= alloc.size
            for v in alloc.values[:1]:
                spans.append((0, n - 1, v, alloc.size, False))
            continue
        ranged = []
        for v in alloc.values:
            r = ranges.get(v.key)
            if r is None:
                missing_ranges += 1
                continue
            ranged.append((r[0], min(r[1], n - 1), v))
        if alloc.kind == "temp":
            temp_bytes += alloc.size
            temp_values.extend(ranged)
            continue
        if alloc.kind == "output":
            output_bytes += alloc.size
            start, end = 0, n - 1  # the runtime allocates every result buffer before the program runs
        elif ranged:
            start, end = min(r[0] for r in ranged), max(r[1] for r in ranged)
        else:
            continue
        live[start] += alloc.size
        live[end + 1] -= alloc.size
        spans.extend((s, e, v, alloc.size, False) for s, e, v in ranged)
        if alloc.kind == "output" and ranged:  # reserved for the result even where no value is live
            spans.append((0, n - 1, max(ranged, key=lambda r: r[0])[2], alloc.size, True))
    live_bytes = np.cumsum(live[:n])
    live_bytes += _temp_occupancy(temp_values, n)
    peak_position = int(np.argmax(live_bytes))
    peak_bytes = int(live_bytes[peak_position])
    spans.extend((s, e, v, v.size, False) for s, e, v in temp_values)

    loops = _loop_spans(hlo, position)
    backward_start = _backward_start(sequence, hlo, loops)
    top_buffers = _timeline_buffers.buffers_at(peak_position, spans, allocations, hlo, tags, backward_start, top)
    compiled_peak = report.peak_bytes if report is not None and report.available else None
    notes = [
        (
            "modelled: argument and output buffers for the whole program, temp values while live (bytes of the "
            "temp block they occupy)"
        ),
    ]
    if unmodelled:
        notes.append(f"not modelled: {format_bytes(unmodelled)} of constants and thread-local scratch")
    if missing_ranges:
        notes.append(f"{missing_ranges} values of the buffer assignment had no live range in the dump and are left out")
    if compiled_peak:
        gap = compiled_peak - peak_bytes
        if abs(gap) > 0.02 * compiled_peak:
            notes.append(
                f"timeline maximum {format_bytes(peak_bytes)} is {100 * gap / compiled_peak:+.1f}% off the compiled peak "
                f"{format_bytes(compiled_peak)}: the compiled temp size is the heap's high-water mark, which includes "
                "fragmentation between live temp values"
            )
    return MemoryTimeline(
        live_bytes=tuple(int(x) for x in live_bytes),
        peak_position=peak_position,
        peak_bytes=peak_bytes,
        top_buffers=top_buffers,
        loops=loops,
        compiled_peak_bytes=compiled_peak,
        argument_bytes=argument_bytes,
        output_bytes=output_bytes,
        temp_bytes=temp_bytes,
        unmodelled_bytes=unmodelled,
        platform=report.platform if report is not None else "",
        notes=tuple(notes),
        report=report,
    )


def _temp_occupancy(values: list, n: int) -> np.ndarray:
    """Bytes of the temp block occupied at each position: the union of live values' extents.

    A sweep over positions with a live-value count per elementary segment of the block, so
    memory stays linear in the number of values.
    """
    out = np.zeros(n, dtype=np.int64)
    if not values:
        return out
    bounds = sorted({b for _, _, v in values for b in (v.offset, v.offset + v.size)})
    index = {b: i for i, b in enumerate(bounds)}
    seg_bytes = np.diff(np.asarray(bounds, dtype=np.int64))
    count = np.zeros(len(seg_bytes), dtype=np.int32)
    starts, ends = collections.defaultdict(list), collections.defaultdict(list)
    for s, e, v in values:
        extent = (index[v.offset], index[v.offset + v.size])
        starts[s].append(extent)
        ends[e + 1].append(extent)
    for t in range(n):
        for lo, hi in ends.get(t, ()):
            count[lo:hi] -= 1
        for lo, hi in starts.get(t, ()):
            count[lo:hi] += 1
        out[t] = seg_bytes[count > 0].sum()
    return out


def _loop_spans(hlo: Hlo, position: dict) -> tuple[LoopSpan, ...]:
    out = []
    for name, (cond, body, trip, op_name) in hlo.whiles.items():
        if hlo.computation.get(name) != hlo.entry or name not in position:
            continue
        comps = _reachable(cond, hlo.called) | _reachable(body, hlo.called)
        inside = [position[i] for i, c in hlo.computation.items() if c in comps and i in position]
        start = min(inside) if inside else position[name]
        out.append(LoopSpan(name, start, position[name], trip, op_name))
    return tuple(sorted(out, key=lambda lp: lp.start_position))


def _backward_start(sequence: list, hlo: Hlo, loops: Sequence[LoopSpan]) -> int:
    """The first position of the backward pass: after every top-level forward loop, the first
    instruction of a ``transpose(...)`` name stack that computes something (gradient accumulators
    are zeroed early) from another such instruction's result, i.e. from a cotangent.

    A backward-pass instruction that reads forward values only (a checkpoint's recomputation,
    ``.../rematted_computation/...``, or a factor of a derivative such as a softmax's ``1/sum``)
    can run as soon as those exist, and XLA often schedules it inside the forward pass; it does not
    start the backward pass."""
    forward_end = max((lp.end_position for lp in loops if "transpose(" not in lp.op_name), default=-1)

    reads_cotangent: dict[str, bool] = {}  # instruction -> whether a backward instruction is upstream

    def reads(name: str) -> bool:
        todo = [name]  # iterative post-order over operands (HLO is acyclic)
        while todo:
            current = todo[-1]
            pending = [o for o in hlo.operands.get(current, ()) if o not in reads_cotangent]
            if pending:
                todo.extend(pending)
                continue
            todo.pop()
            reads_cotangent[current] = any(
                _timeline_buffers.is_backward(o, hlo) or reads_cotangent[o] for o in hlo.operands.get(current, ())
            )
        return reads_cotangent[name]

    for t, name in enumerate(sequence):
        if t > forward_end and _timeline_buffers.is_backward(name, hlo) and reads(name):
            return t
    return len(sequence)


# ---------------------------------------------------------------------------------------------
# Tags and the entry point
# ---------------------------------------------------------------------------------------------


def _user_location(source_info, skip_dirs: tuple) -> tuple | None:
    traceback = getattr(source_info, "traceback", None)
    frames = getattr(traceback, "frames", None) or ()
    for frame in frames:
        if not frame.file_name.startswith(skip_dirs):
            return frame.file_name, frame.line_num
    return None


def checkpoint_name_locations(jaxpr) -> dict:
    """``(file, line) -> {tags}`` of every ``checkpoint_name`` call in a (closed) jaxpr, nested ones included.

    The location is the first stack frame outside JAX itself, which is where the model called
    ``checkpoint_name``; the tag names whatever the compiled program computes on that line.
    """
    skip = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (jax,))
    out: dict = collections.defaultdict(set)

    for eqn in _jaxpr.equations(jaxpr):
        tag = _jaxpr.any_name_tag(eqn)
        if tag is not None:
            loc = _user_location(eqn.source_info, skip)
            if loc is not None:
                out[loc].add(str(tag))
    return dict(out)


_cache_off_lock = threading.Lock()
_cache_off_users = 0  # timelines compiling now with the persistent cache turned off by jremat


@contextlib.contextmanager
def _persistent_cache_off() -> Iterator[None]:
    # The dump options are not part of JAX's persistent-cache key: a cache hit would skip XLA and
    # leave the dump folder empty, so this one compile bypasses the cache. The flag is global:
    # the first of several concurrent timelines turns it off and the last turns it back on.
    global _cache_off_users
    with _cache_off_lock:
        if _cache_off_users == 0 and not jax.config.jax_enable_compilation_cache:  # type: ignore[attr-defined]
            owned = False
        else:
            owned = True
            if _cache_off_users == 0:
                jax.config.update("jax_enable_compilation_cache", False)
                compilation_cache.reset_cache()
            _cache_off_users += 1
    try:
        yield
    finally:
        if owned:
            with _cache_off_lock:
                _cache_off_users -= 1
                if _cache_off_users == 0:
                    jax.config.update("jax_enable_compilation_cache", True)
                    compilation_cache.reset_cache()


def _read_dump(folder: str, suffix: str) -> str:
    found = sorted(glob.glob(os.path.join(folder, f"*after_optimizations{suffix}")))
    if not found:
        raise RuntimeError(
            f"XLA wrote no *after_optimizations{suffix} for this compile (dump folder {folder}); the backend "
            "may not honour per-compile dump options"
        )
    with open(found[-1]) as fh:
        return fh.read()


def memory_timeline(
    fn: Callable, *args, compiler_options: dict | None = None, top: int | None = None, **kwargs
) -> MemoryTimeline:
    """Compile ``fn(*args, **kwargs)`` (nothing runs) and return its :class:`MemoryTimeline`.

    The compile uses the same options as :func:`jremat.memory_report` plus XLA's dump
    options pointed at a temporary folder (removed afterwards), so the compiled peak it is
    compared with is that of this very executable.

    Args:
      fn: a function of pytrees of arrays, jitted or not.
      *args: arrays or :class:`jax.ShapeDtypeStruct`.
      compiler_options: XLA options; ``None`` means :func:`jremat.compiler_options`.
      top: how many of the largest buffers at the peak to keep (``None``: all of them).
      **kwargs: keyword arguments of ``fn``.

    Raises:
      TypeError: if ``fn`` is not callable.
      ValueError: if ``top`` is not a positive integer.
      RuntimeError: if XLA wrote no buffer-assignment dump for the compile.
    """
    if not callable(fn):
        raise TypeError(f"memory_timeline needs a callable, got {type(fn).__name__}")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
        raise ValueError(f"top must be a positive integer or None, got {top!r}")
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    traced = jitted.trace(*args, **kwargs)
    tags = checkpoint_name_locations(traced.jaxpr)
    options = dict(_compile.analysis_options() if compiler_options is None else compiler_options)
    folder = tempfile.mkdtemp(prefix="jremat-timeline-")
    try:
        options.update(xla_dump_to=folder, xla_dump_hlo_as_text=True)
        with _persistent_cache_off():
            compiled = traced.lower().compile(options)
        report = _memory.compiled_memory_report(compiled)
        timeline = build_timeline(
            _read_dump(folder, "-buffer-assignment.txt"),
            _read_dump(folder, "-live-range.txt"),
            _read_dump(folder, ".txt"),
            tags=tags,
            report=report,
            top=top,
        )
        devices = mesh_devices(compiled.input_shardings)
        if devices > 1:
            note = (
                f"per device: one device's share of the SPMD program on {devices} devices (buffers are "
                f"shards; all-gathered weights are kind {GATHERED!r})"
            )
            timeline = dataclasses.replace(timeline, notes=(*timeline.notes, note), devices=devices)
        return timeline
    finally:
        shutil.rmtree(folder, ignore_errors=True)


__all__: Sequence[str] = (
    "ARGUMENT",
    "BUFFER_KINDS",
    "FORWARD",
    "FORWARD_RESIDUAL",
    "GATHERED",
    "GRADIENT",
    "OTHER",
    "OUTPUT",
    "RECOMPUTATION",
    "LoopSpan",
    "MemoryTimeline",
    "TimelineBuffer",
    "build_timeline",
    "checkpoint_name_locations",
    "memory_timeline",
)
