"""Live memory: run a function once and read the device allocator's peak (GPU, TPU).

On a mesh the allocator of one device is read: the peak is that device's, per device, as the
compiled figures of :func:`jremat.memory_report` are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from jremat._measure.mesh import mesh_devices


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
      devices: the devices the arguments' shardings span; above 1 the figures are ``device``'s
        alone (its share of the SPMD program: per device).
    """

    available: bool
    device: str
    peak_bytes_in_use: int | None
    bytes_in_use_before: int | None
    reason: str = ""
    devices: int = 1

    def text(self) -> str:
        """One line: the peak and where it was read (per device on a mesh), or why there is none."""
        if not self.available:
            return f"no live peak: {self.reason}"
        where = f"per device ({self.device}, one of {self.devices})" if self.devices > 1 else self.device
        return (
            f"live peak {self.peak_bytes_in_use:,} bytes in use {where}; "
            f"{self.bytes_in_use_before:,} in use before the run"
        )


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
      fn: the function (a jitted train step); arguments must be concrete arrays (sharded on a
        mesh or not).
      device: the device to read; defaults to ``jax.devices()[0]``. On a mesh, one of its devices.

    Returns:
      A :class:`LiveMemory`.
    """
    device = device or jax.devices()[0]
    devices = mesh_devices((args, kwargs))
    missing = allocator_stats_missing(device)
    if missing is not None:
        reason = f"{missing}: live measurement needs a GPU or TPU"
        return LiveMemory(False, str(device), None, None, reason, devices)
    before = int(device.memory_stats().get("bytes_in_use", 0))
    jax.block_until_ready(fn(*args, **kwargs))
    after = device.memory_stats()
    return LiveMemory(True, str(device), int(after["peak_bytes_in_use"]), before, devices=devices)


__all__ = ["LiveMemory", "allocator_stats_missing", "live_memory"]
