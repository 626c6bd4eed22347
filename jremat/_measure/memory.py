"""Compiled memory: compile a function (nothing runs) and read XLA's buffer assignment.

:func:`memory_report` is the one way to compile a step and read its memory: it compiles as
:func:`jremat.jit` does (:mod:`jremat._measure.compile`) and reads argument, output, alias, temp and
generated-code bytes and a peak estimate into a :class:`MemoryReport`;
:func:`compiled_memory_report` reads an executable already compiled (one that is also run).
Arguments may be :class:`jax.ShapeDtypeStruct`. :func:`diagnose_remat` says when compiled temp
memory did not follow the saved residuals (:mod:`jremat._explain.residuals`), and why that usually
happens.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax

from jremat._measure import compile as _compile

#: How ``MemoryReport.peak_bytes`` was obtained.
PEAK_FROM_BACKEND = "backend peak_memory_in_bytes"
PEAK_FROM_SUM = "argument + output - alias + temp"
PEAK_UNAVAILABLE = "unavailable"

# ---------------------------------------------------------------------------------------------
# Compiled memory
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """XLA's memory figures for one compiled program.

    Attributes:
      available: whether the backend reported usable figures; when False every byte field is
        ``None`` and :attr:`notes` says why.
      platform: the backend platform (``cpu``, ``gpu``, ``tpu``).
      argument_bytes: bytes of the program's inputs.
      output_bytes: bytes of its outputs.
      alias_bytes: bytes of outputs that reuse (donated) input buffers.
      temp_bytes: bytes of XLA's temporary buffers (activations, residuals, workspace).
      generated_code_bytes: bytes of generated code.
      peak_bytes: the peak estimate (see :attr:`peak_source`).
      peak_source: :data:`PEAK_FROM_BACKEND`, :data:`PEAK_FROM_SUM` or :data:`PEAK_UNAVAILABLE`.
      notes: caveats, e.g. why the backend's own peak was not used.
    """

    available: bool
    platform: str
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    generated_code_bytes: int | None
    peak_bytes: int | None
    peak_source: str
    notes: tuple[str, ...] = ()

    @property
    def summed_peak_bytes(self) -> int | None:
        """``argument + output - alias + temp`` (``None`` when unavailable)."""
        if not self.available:
            return None
        # An available report has every size (compiled_memory_report).
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes  # type: ignore[operator]


def _stat(stats, name: str) -> int | None:
    value = getattr(stats, name, None)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _unavailable(platform: str, why: str) -> MemoryReport:
    """A report without figures, saying why (``why`` follows the platform name)."""
    return MemoryReport(False, platform, None, None, None, None, None, None, PEAK_UNAVAILABLE, (f"{platform}: {why}",))


def compiled_memory_report(compiled, *, platform: str | None = None) -> MemoryReport:
    """Read a compiled executable's ``memory_analysis()`` into a :class:`MemoryReport`.

    The peak is the backend's ``peak_memory_in_bytes`` when that field is filled and at least
    the temp size, except on XLA:CPU, which fills it with argument + output only; otherwise
    ``argument + output - alias + temp``. Backends that return ``None`` or all zeros (jax issue
    #18954) give ``available=False`` rather than a report of 0 bytes.

    Args:
      compiled: a ``jax.stages.Compiled`` (from ``jax.jit(f).lower(...).compile()``).
      platform: the backend name for the report; defaults to the default backend's.
    """
    platform = platform or jax.default_backend()
    try:
        stats = compiled.memory_analysis()
    except Exception as err:
        stats, error = None, f"memory_analysis() raised {type(err).__name__}: {err}"
    else:
        error = "memory_analysis() returned None"
    if stats is None:
        return _unavailable(platform, f"{error}; no compiled memory figures (see jax issue #18954)")
    fields: dict[str, Any] = {
        "argument_bytes": _stat(stats, "argument_size_in_bytes"),
        "output_bytes": _stat(stats, "output_size_in_bytes"),
        "alias_bytes": _stat(stats, "alias_size_in_bytes"),
        "temp_bytes": _stat(stats, "temp_size_in_bytes"),
        "generated_code_bytes": _stat(stats, "generated_code_size_in_bytes"),
    }
    core = [fields[k] for k in ("argument_bytes", "output_bytes", "temp_bytes")]
    if any(v is None for v in core) or not any(core):
        return _unavailable(
            platform,
            "memory_analysis() reported zero or missing argument, output and temp sizes, which means "
            "the backend does not fill them (jax issue #18954), not that the program needs no memory",
        )
    fields["alias_bytes"] = fields["alias_bytes"] or 0
    fields["generated_code_bytes"] = fields["generated_code_bytes"] or 0
    summed = fields["argument_bytes"] + fields["output_bytes"] - fields["alias_bytes"] + fields["temp_bytes"]
    backend_peak = _stat(stats, "peak_memory_in_bytes")
    notes = []
    # XLA:CPU fills peak_memory_in_bytes with argument + output only; never trust it there,
    # even when it happens to exceed the temp size (it would make policies look equal).
    if backend_peak and platform != "cpu" and backend_peak >= fields["temp_bytes"]:
        peak, source = backend_peak, PEAK_FROM_BACKEND
    else:
        peak, source = summed, PEAK_FROM_SUM
        if backend_peak:
            notes.append(
                f"{platform}: the backend's peak_memory_in_bytes leaves temp buffers out (XLA:CPU "
                f"reports argument + output only); using {PEAK_FROM_SUM}"
            )
        else:
            notes.append(f"{platform}: backend does not report peak_memory_in_bytes; using {PEAK_FROM_SUM}")
    return MemoryReport(True, platform, peak_bytes=peak, peak_source=source, notes=tuple(notes), **fields)


def memory_report(
    fn: Callable, *args, compiler_options: dict | None = None, donate_argnums: int | tuple[int, ...] = (), **kwargs
) -> MemoryReport:
    """Compile ``fn(*args, **kwargs)`` as :func:`jremat.jit` compiles it (nothing runs) and read its memory.

    Args:
      fn: a function of pytrees of arrays, or one already jitted (it is then lowered as it is,
        with its own donation). Typically ``jax.grad(loss)`` or a whole train step.
      *args: arrays or :class:`jax.ShapeDtypeStruct` (shapes suffice).
      compiler_options: XLA options to compile with; ``None`` means
        :func:`jremat.compiler_options` (what :func:`jremat.jit` uses), ``{}`` plain
        ``jax.jit``.
      donate_argnums: arguments whose buffers the step donates (a train step donates its
        parameters and optimizer state), so that the report counts them as aliased.
      **kwargs: keyword arguments, likewise.

    Returns:
      A :class:`MemoryReport`; ``available`` is False (with a note) on backends that do not
      report memory.

    Raises:
      TypeError: if ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"memory_report needs a callable, got {type(fn).__name__}")
    compiled, options = compile_for_analysis(
        fn, *args, compiler_options=compiler_options, donate_argnums=donate_argnums, **kwargs
    )
    report = compiled_memory_report(compiled)
    if options.get("xla_disable_hlo_passes") == _compile.CPU_HOISTING_PASS:
        report = dataclasses.replace(
            report,
            notes=report.notes
            + (
                f"compiled as jremat.jit compiles: XLA pass {_compile.CPU_HOISTING_PASS} off; plain jax.jit "
                "can keep an extra f32 copy of every scan-stacked bf16 residual (see jremat.compiler_options)",
            ),
        )
    return report


def compile_for_analysis(
    fn: Callable, *args, compiler_options: dict | None = None, donate_argnums: int | tuple[int, ...] = (), **kwargs
):
    """``(compiled, options)``: ``fn(*args, **kwargs)`` compiled as :func:`memory_report` compiles it."""
    options = _compile.analysis_options() if compiler_options is None else compiler_options
    if hasattr(fn, "lower"):
        compiled = fn.lower(*args, **kwargs).compile(options or None)
    else:
        compiled = (
            jax.jit(fn, donate_argnums=donate_argnums, compiler_options=options or None)
            .lower(*args, **kwargs)
            .compile()
        )
    return compiled, options


# ---------------------------------------------------------------------------------------------
# Diagnosis
# ---------------------------------------------------------------------------------------------


def diagnose_remat(
    temp_bytes: int,
    baseline_temp_bytes: int,
    saved_bytes: float,
    baseline_saved_bytes: float,
    *,
    scan_layers: bool | None = None,
    min_saved_drop: float = 0.25,
    min_temp_fraction: float = 0.25,
) -> str | None:
    """Say when compiled temp memory did not follow the saved residuals, and the likely cause.

    Flags a policy whose saved residuals are at least ``min_saved_drop`` (as a fraction of the
    baseline's) smaller than the baseline's while its temp memory fell by less than
    ``min_temp_fraction`` of that drop.

    Args:
      temp_bytes: the policy's compiled temp bytes.
      baseline_temp_bytes: the same for the baseline (usually the ``none`` policy).
      saved_bytes: the policy's saved residual bytes.
      baseline_saved_bytes: the baseline's.
      scan_layers: whether the layers run under ``lax.scan`` (``None`` if unknown).
      min_saved_drop: how much smaller the residuals must be for the check to apply.
      min_temp_fraction: the fraction of the residual drop that temp memory must show.

    Returns:
      A one-paragraph explanation, or ``None`` if temp memory followed the residuals.
    """
    saved_drop = baseline_saved_bytes - saved_bytes
    if baseline_saved_bytes <= 0 or saved_drop < min_saved_drop * baseline_saved_bytes:
        return None
    temp_drop = baseline_temp_bytes - temp_bytes
    if temp_drop >= min_temp_fraction * saved_drop:
        return None
    flag_on = _compile.CPU_SCHEDULER_FLAG in os.environ.get("XLA_FLAGS", "")
    causes = []
    if jax.default_backend() == "cpu" and scan_layers is not True:
        causes.append(
            "in unrolled programs (and length-1 scans) XLA:CPU strips jax.checkpoint's optimization "
            "barriers and merges the recomputation with the forward pass (common-subexpression "
            "elimination), or its concurrency-optimized scheduler runs it early; remat applied "
            "through jremat.remat_at/run_layers ties recomputation to the cotangent to prevent this, "
            "a hand-written jax.checkpoint does not (measurements in docs/xla-notes.md; "
            f"{_compile.CPU_SCHEDULER_FLAG} "
            f"is {'set' if flag_on else 'NOT set'} in this process)"
        )
    causes.append("XLA scheduling recomputation early or fusing it with the forward pass")
    causes.append("the peak being set by buffers other than residuals (logits, gradients, workspace)")
    return (
        f"saved residuals fell by {saved_drop / max(baseline_saved_bytes, 1):.0%} "
        f"({baseline_saved_bytes:,.0f} -> {saved_bytes:,.0f} bytes) but compiled temp memory fell only "
        f"{baseline_temp_bytes:,} -> {temp_bytes:,} bytes; likely cause: " + "; or ".join(causes)
    )


__all__ = [
    "MemoryReport",
    "PEAK_FROM_BACKEND",
    "PEAK_FROM_SUM",
    "PEAK_UNAVAILABLE",
    "compiled_memory_report",
    "diagnose_remat",
    "memory_report",
]
