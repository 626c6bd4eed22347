"""Programs lowered by a pullback called again: ``jremat.checkpoint`` against ``jax.checkpoint``; run
in a fresh process by tests/jremat/_apply/test_dropin_parity.py.

JAX's issue 9661: the backward pass of a ``jax.vjp`` through a checkpointed ``jax.jit`` function,
called 20 times, must not lower programs again (JAX's own test allows ``jax.checkpoint`` two). A
program lowered once stays cached for the whole process, so counting is only meaningful where
nothing alike ran before: ``python -m tests.jremat.pullback_compiles`` prints one JSON object,
``{engine: {case: programs lowered by the 20 calls}, "broken": ...}``, for both engines. Each case
uses its own input shape, so it reuses no shaped program of another; under each engine
``jax.checkpoint``'s cases run first, so a program that jremat lowers and ``jax.checkpoint`` does
not (an eager op of jremat's own) is counted, while one they share (JAX's own, without shapes)
counts for ``jax.checkpoint``. The last case, ``broken``, is jremat with its cotangent tie forced
into the eager pullback (what jremat did before it left eager pullbacks untied): the count must
see the programs that adds.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

import jremat
from jremat._engine import tie as _tie

#: The event JAX records each time it lowers a program (an eager op's included).
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CALLS = 20


def _lowerings_of_pullback(checkpoint, static: bool, size: int) -> int:
    """Programs lowered by 20 calls of the pullback of ``checkpoint`` around a ``jax.jit`` function
    (JAX's test: doubled by the jit; with ``static``, the jit inside and a static flag choosing it)."""
    x = jnp.linspace(0.5, 1.5, size)
    if static:
        doubled = checkpoint(lambda x, y: jax.jit(lambda x: 2 * x if y else x)(x), static_argnums=(1,))
        _, pullback = jax.vjp(lambda x: doubled(x, True), x)
    else:
        _, pullback = jax.vjp(checkpoint(jax.jit(lambda x: 2 * x)), x)
    cotangent = jnp.ones_like(x)
    lowered: list[str] = []

    def count(event: str, duration_secs: float, **kwargs) -> None:
        if event == LOWERING_EVENT:
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        for _ in range(CALLS):
            jax.block_until_ready(pullback(cotangent))
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    return len(lowered)


def main() -> int:
    jremat_checkpoint = lambda fn, **options: jremat.checkpoint(fn, None, **options)
    counts: dict = {}
    sizes = iter(range(2, 100))
    for engine in ("classic", "remat3"):
        jax.config.update("jax_remat3", engine == "remat3")
        counts[engine] = {
            f"{tool} {form}": _lowerings_of_pullback(checkpoint, form == "static_argnums", next(sizes))
            for tool, checkpoint in (("jax", jax.checkpoint), ("jremat", jremat_checkpoint))
            for form in ("plain", "static_argnums")
        }
    _tie._traced = lambda values: True  # the tie in an eager pullback too
    counts["broken"] = _lowerings_of_pullback(jremat_checkpoint, False, next(sizes))
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
