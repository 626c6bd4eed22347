"""XLA flags that make rematerialization actually save memory.

XLA:CPU's default concurrency-optimized scheduler hoists recomputation next to the forward
pass in unrolled programs, so ``jax.checkpoint`` saves almost nothing there (measured with
JAX 0.10.2: an 8-layer unrolled chain used 256 MiB of temp memory with and without full
remat). Turning that scheduler off restores most of the saving. XLA reads ``XLA_FLAGS`` once,
when the backend starts, so this must run before the first computation.
"""

from __future__ import annotations

import os
import warnings

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
OPT_OUT_ENV = "JREMAT_KEEP_XLA_FLAGS"


def backends_initialized() -> bool:
    """Whether JAX has already started a backend (after which XLA_FLAGS is ignored)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        return False


def configure() -> bool:
    """Add :data:`CPU_SCHEDULER_FLAG` to ``XLA_FLAGS`` unless the user set the flag or opted out.

    Set ``JREMAT_KEEP_XLA_FLAGS=1`` to leave ``XLA_FLAGS`` untouched.

    Returns:
      True if the flag is in effect for this process's backend.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" in flags:
        return CPU_SCHEDULER_FLAG in flags
    if os.environ.get(OPT_OUT_ENV) == "1":
        return False
    if backends_initialized():
        warnings.warn(
            "jremat was imported after JAX started its backend, so it could not set "
            f"{CPU_SCHEDULER_FLAG}; on XLA:CPU, remat in unrolled layer stacks may save "
            "little memory. Import jremat before running any JAX computation.",
            stacklevel=3,
        )
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}".strip()
    return True
