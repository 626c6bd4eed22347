"""Each value's share on one device of a mesh, from its sharding.

:func:`device_fractions` reads the outputs of a function: from the sharding each output's aval
carries where every axis of its mesh is explicit (the sharding is part of the type), else from
the output shardings XLA's SPMD partitioner chooses when the function is compiled (nothing runs).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jremat._measure import memory as _memory
from jremat._measure.mesh import mesh_devices


def device_fractions(fn: Callable, leaves: list, outputs: list) -> list[float]:
    """The share one device holds of each of the last ``len(outputs)`` outputs of ``fn(*leaves)``
    (``1.0`` off a mesh, or where replicated).

    Args:
      fn: a function of array leaves (``jax.vjp``'s forward pass: its outputs end with the residuals).
      leaves: its arguments, arrays or :class:`jax.ShapeDtypeStruct`, sharded on a mesh or not.
      outputs: the avals (or shape structs) of those last outputs.
    """
    if mesh_devices(leaves) <= 1:
        return [1.0] * len(outputs)
    shardings = [getattr(r, "sharding", None) for r in outputs]
    explicit = all(
        s is not None and s.mesh.axis_types and all(t == jax.sharding.AxisType.Explicit for t in s.mesh.axis_types)
        for s in shardings
    )
    if not explicit:
        compiled, _ = _memory.compile_for_analysis(fn, *leaves)
        compiled_shardings = jax.tree.leaves(compiled.output_shardings)
        shardings = compiled_shardings[len(compiled_shardings) - len(outputs) :]
    fractions = []
    for r, sharding in zip(outputs, shardings):
        if sharding is None:  # no sharding known for this output: counted as replicated
            fractions.append(1.0)
            continue
        size = int(np.prod(r.shape, dtype=np.int64))
        shard = int(np.prod(sharding.shard_shape(tuple(r.shape)), dtype=np.int64)) if r.shape else 1
        fractions.append(shard / size if size else 1.0)
    return fractions


__all__ = ["device_fractions"]
