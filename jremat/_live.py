"""Live memory: run a function once and read the device allocator's peak (GPU, TPU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class LiveMemory:
    """Allocator statistics read after running a function once.

    Attributes:
      available: whether the device reports memory statistics.
      device: the device, in words.
      peak_bytes_in_use: the allocator's high-water mark after the run (process-wide since
        start: it includes anything allocated before), or ``None``.
      bytes_in_use_before: bytes in use just before the run, or ``None``.
      reason: why the figures are missing, or ``""``.
    """

    available: bool
    device: str
    peak_bytes_in_use: int | None
    bytes_in_use_before: int | None
    reason: str = ""


def allocator_stats_missing(device=None) -> str | None:
    """Why ``device`` cannot report a live peak (no ``peak_bytes_in_use`` statistic), or ``None`` if it can.

    Args:
      device: the device to ask; defaults to ``jax.devices()[0]``.
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return None
    return f"{device.platform} device {device} reports no allocator statistics (memory_stats() is None)"


def live_memory(fn: Callable, *args, device=None, **kwargs) -> LiveMemory:
    """Run ``fn(*args, **kwargs)`` once and read the device's ``memory_stats()`` peak.

    On backends without allocator statistics (XLA:CPU returns ``None``) nothing is run and the
    result says so.

    Args:
      fn: the function (a jitted train step); arguments must be concrete arrays.
      device: the device to read; defaults to ``jax.devices()[0]``.

    Returns:
      A :class:`LiveMemory`.
    """
    device = device or jax.devices()[0]
    missing = allocator_stats_missing(device)
    if missing is not None:
        return LiveMemory(False, str(device), None, None, f"{missing}: live measurement needs a GPU or TPU")
    before = int(device.memory_stats().get("bytes_in_use", 0))
    jax.block_until_ready(fn(*args, **kwargs))
    after = device.memory_stats()
    return LiveMemory(True, str(device), int(after["peak_bytes_in_use"]), before)


__all__ = ["LiveMemory", "allocator_stats_missing", "live_memory"]
