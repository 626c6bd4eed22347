"""XLA options that decide whether remat's savings survive compilation, and what we measured.

**Loop-invariant code motion on XLA:CPU (jremat turns it off).** XLA:CPU computes bf16 dots in
f32, so the backward loop of a ``lax.scan`` over layers converts every bf16 residual slice it
reads to f32. The ``while-loop-invariant-code-motion`` pass then rewrites that as one convert
of the whole stacked ``[n_layers, ...]`` residual, hoisted out of the loop, so the backward pass
holds every saved residual a second time in f32. Measured (JAX 0.10.2, gpt2-small shapes, batch
8 x 1024, bf16, gradient step without optimizer, compile-only): compiled peak ``none`` 20.87 -> 13.43 GiB,
``every_k:k=4`` 17.23 -> 10.49, ``dots`` 13.30 -> 8.91, ``selective`` 9.80 -> 7.12 and ``full``
6.58 -> 5.39 GiB with the pass off. Step time on the f32 ``small`` preset was unchanged within
noise (0.98-1.03x). :func:`compiler_options` returns the option for the CPU backend and
:func:`jit` applies it; :func:`jremat.memory_report` compiles with it by default.

**The concurrency-optimized scheduler (jremat leaves it on).** In an unrolled program XLA:CPU
strips ``jax.checkpoint``'s optimization barriers and merges the recomputation with the forward
pass, so remat saves nothing (8-layer unrolled chain: 256 MiB temp with and without remat).
Turning off the concurrency-optimized scheduler with :data:`CPU_SCHEDULER_FLAG` recovers part of
that (248 -> 136 MiB), but :func:`jremat.remat.recompute_after_cotangent`, which jremat applies to
every unrolled checkpointed layer (and to a length-1 scan, which XLA flattens), does better and
is hurt by the flag: on the 8-layer ``small`` model, unrolled full remat keeps 39.2 MB of temp
memory with default flags and 54.9 MB with the flag (no remat: 71.8 MB). The memory report
names the flag when it finds it set.
"""

from __future__ import annotations

from typing import Any, Callable

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
