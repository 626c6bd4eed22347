"""What we measured about XLA:CPU's scheduler and remat, and the flag involved.

jremat does not set this flag. In an unrolled program XLA:CPU strips ``jax.checkpoint``'s
optimization barriers and merges the recomputation with the forward pass, so remat saves
nothing (8-layer unrolled chain, JAX 0.10.2: 256 MiB temp with and without remat). Turning off
the concurrency-optimized scheduler with :data:`CPU_SCHEDULER_FLAG` recovers part of that
(248 -> 136 MiB), but :func:`jremat.remat.recompute_after_cotangent`, which jremat applies to
every unrolled layer, does better and is hurt by the flag: on the 8-layer ``small`` model,
unrolled full remat keeps 39.2 MB of temp memory with default flags and 54.9 MB with the flag
(no remat: 71.8 MB). The memory report names the flag when it finds it set.
"""

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
