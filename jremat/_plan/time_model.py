"""The fit search's clock: the time model's device rates, measured once, and timing a compiled step."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jremat._measure.collectives import TIMED_KINDS, power_of_two, rounded_s_per_byte
from jremat._plan.fit_types import FitError, FitStep, TimeModel


def _best_time_s(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def calibrate_time_model(dtype: str = "float32", devices: Sequence | None = None) -> TimeModel:
    """Measure this device's matmul FLOP rate in ``dtype`` and its copy bandwidth, rounded to powers of two;
    with two or more ``devices``, also each timed collective kind's seconds per byte across them
    (:func:`with_collective_rates`).

    The rounding makes machines of one kind agree on the model (the finalists it picks) unless a
    rate sits near a power of two.
    """
    accelerator = jax.default_backend() != "cpu"
    n = 4096 if accelerator else 1024
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x: x @ x)
    flops_per_s = 2 * n**3 / _best_time_s(matmul, a)
    x = jnp.ones((64 * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda v: v * 2.0)
    bytes_per_s = 2 * x.nbytes / _best_time_s(copy, x)
    model = TimeModel(power_of_two(flops_per_s), power_of_two(bytes_per_s))
    return with_collective_rates(model, devices) if devices is not None and len(devices) > 1 else model


def with_collective_rates(model: TimeModel, devices: Sequence) -> TimeModel:
    """``model`` with the seconds per byte of each timed collective kind across ``devices``
    (:func:`jremat.collective_s_per_byte`: measured once per mesh and cached), rounded to powers of two
    (:func:`jremat._measure.collectives.rounded_s_per_byte`, as ``auto``'s re-gather price is).

    Raises:
      ValueError: fewer than two devices.
    """
    rates = tuple((kind, rounded_s_per_byte(kind, devices)) for kind in TIMED_KINDS)
    return dataclasses.replace(model, collective_s_per_byte=rates)


def _filled(leaf):
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf.copy() if isinstance(leaf, jax.Array) else leaf
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        key = jax.random.key(0)
        if key.dtype != leaf.dtype:
            raise FitError(
                f"cannot make a PRNG key of dtype {leaf.dtype} for timing; give the step builder concrete keys"
            )
        value = jnp.broadcast_to(key, leaf.shape)
    else:
        value = jnp.zeros(leaf.shape, leaf.dtype)
    sharding = getattr(leaf, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else value


def _time_round(compiled, fit_step: FitStep, calls: int) -> float:
    """Seconds of ``calls`` calls after one untimed call, on fresh arguments (freed afterwards)."""
    args = list(jax.tree.map(_filled, fit_step.args, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)))

    def call():
        out = compiled(*args)
        for i in fit_step.carry:
            args[i] = out[i]
        return out

    jax.block_until_ready(call())
    t0 = time.perf_counter()
    for _ in range(calls):
        out = call()
    jax.block_until_ready(out)
    return time.perf_counter() - t0
