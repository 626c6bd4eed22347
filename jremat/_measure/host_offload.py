"""Offload pricing: whether host memory can hold activations, and what moving a byte there and back costs in FLOPs."""

from __future__ import annotations

import functools
import threading
import time

import jax
import jax.numpy as jnp


def host_offload_available() -> bool:
    """Whether offloading can free device memory: an accelerator that addresses ``pinned_host``.

    XLA:CPU also lists ``pinned_host``, but there host and device are the same RAM.
    """
    device = jax.devices()[0]
    return device.platform != "cpu" and "pinned_host" in {m.kind for m in device.addressable_memories()}


def best_s(fn, repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one untimed), in seconds."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


_measure_lock = threading.Lock()


def offload_flops_per_byte(dtype: str = "bfloat16", transfer_bytes: int = 64 * 2**20, matmul_size: int = 2048) -> float:
    """FLOP-equivalents of moving one byte to host memory and back, measured on the default device.

    Times a round trip of ``transfer_bytes`` to ``pinned_host`` and a ``matmul_size``-square
    matmul in ``dtype``; the ratio prices offloading in the recompute cost model's unit. It does
    not credit the overlap of transfers with compute, so offloading is priced pessimistically.
    Measured once per argument set; threads asking at once wait for one measurement (two at a
    time would slow each other's timings).

    Raises:
      ValueError: if the device has no ``pinned_host`` memory.
    """
    with _measure_lock:
        return _measured_flops_per_byte(dtype, transfer_bytes, matmul_size)


@functools.lru_cache(maxsize=8)
def _measured_flops_per_byte(dtype: str, transfer_bytes: int, matmul_size: int) -> float:
    device = jax.devices()[0]
    if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        raise ValueError(f"{device} has no pinned_host memory to offload to")
    to_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    to_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    data = jnp.ones((transfer_bytes // 4,), jnp.float32)
    round_trip_s = best_s(lambda: jax.device_put(jax.device_put(data, to_host), to_device))
    a = jnp.ones((matmul_size, matmul_size), jnp.dtype(dtype))
    matmul = jax.jit(lambda x: x @ x)
    flops_per_s = 2 * matmul_size**3 / best_s(lambda: matmul(a))
    return round_trip_s / transfer_bytes * flops_per_s


__all__ = ["host_offload_available", "offload_flops_per_byte"]
