"""Compiling with the XLA options under which remat's savings survive: :func:`jit`, :func:`compiler_options`.

* Loop-invariant code motion on XLA:CPU hoists an f32 copy of every scan-stacked bf16 residual
  out of the backward loop; :func:`compiler_options` turns the pass off on CPU and :func:`jit`
  applies it. :func:`jremat.memory_report` compiles this way by default.
* The concurrency-optimized scheduler stays on: turning it off (:data:`CPU_SCHEDULER_FLAG`) helps
  plain ``jax.checkpoint`` in unrolled code but hurts the cotangent tie (:mod:`jremat._engine.tie`). The
  memory report names the flag when it finds it set.

Measurements for both: docs/xla-notes.md.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

import jax

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

#: The XLA pass that hoists f32 copies of scan-stacked bf16 residuals out of the backward loop.
CPU_HOISTING_PASS = "while-loop-invariant-code-motion"


def compiler_options(platform: str | None = None) -> dict[str, str]:
    """XLA compiler options under which remat's memory savings hold on ``platform``.

    Args:
      platform: ``cpu``, ``gpu``, ``tpu`` ...; defaults to ``jax.default_backend()``.

    Returns:
      ``{"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}`` on ``cpu`` (see the
      module docstring for why and what it measured), ``{}`` elsewhere.
    """
    platform = platform or jax.default_backend()
    return {"xla_disable_hlo_passes": CPU_HOISTING_PASS} if platform == "cpu" else {}


#: XLA options that make a compile-only analysis of XLA:CPU faster without changing it: backend
#: optimization level 0 and one LLVM module only change LLVM code generation, not the HLO or its
#: buffer assignment (the memory figures and ``cost_analysis()`` stay equal).
CPU_FAST_ANALYSIS_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_parallel_codegen_split_count": 1}


def fast_analysis_compile(lowered):
    """``lowered.compile()`` for reading memory and cost figures only, not for running: on XLA:CPU with
    :data:`CPU_FAST_ANALYSIS_OPTIONS` (slower code, same figures), elsewhere as is."""
    if jax.default_backend() == "cpu":
        try:
            return lowered.compile(compiler_options=CPU_FAST_ANALYSIS_OPTIONS)
        except jax.errors.JaxRuntimeError as err:  # an XLA that no longer has one of the options
            if "No such compile option" not in str(err):
                raise
    return lowered.compile()


def cost_analysis(compiled) -> dict:
    """``compiled.cost_analysis()`` as one dict (older JAX returns a list of one; ``{}`` if none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return dict(cost or {})


def hlo_fingerprint(compiled) -> str:
    """A short hash of ``compiled``'s optimized HLO without its metadata (source locations, op
    names) and module name: two programs with the same fingerprint compute the same thing the same way,
    so a time difference between them is the machine's noise."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    text = re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)
    # The source-location tables (FileNames, FunctionNames, FileLocations, StackFrames) end at a blank line.
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*", "", text, flags=re.M)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def analysis_options() -> dict[str, str]:
    """The XLA options of jremat's compile-only analyses (:func:`jremat.memory_report`, :func:`jremat.memory_timeline`).

    The single source of both analyses' default options: those of :func:`jit`
    (:func:`compiler_options` for the default backend), so that a report describes the executable
    :func:`jit` builds.

    Returns:
      A dict of XLA option names to values.
    """
    return compiler_options()


def jit(fn: Callable, **jit_kwargs: Any):
    """``jax.jit(fn, **jit_kwargs)`` with :func:`compiler_options` for the default backend merged in.

    Options passed in ``jit_kwargs["compiler_options"]`` win over jremat's. Use it for the
    outermost jit only: JAX refuses compiler options on a jit nested inside another (jit the
    unjitted function once, with your shardings, instead of wrapping a jitted one).

    Args:
      fn: the function to compile (a train step, ``jax.grad`` of a loss ...).
      **jit_kwargs: any other ``jax.jit`` argument (``donate_argnums``, ``in_shardings`` ...).

    Returns:
      The jitted function.
    """
    options = {**compiler_options(), **(jit_kwargs.pop("compiler_options", None) or {})}
    return jax.jit(fn, compiler_options=options or None, **jit_kwargs)
