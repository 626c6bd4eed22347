"""``python -m train.memory --live``: each policy's step run once in a fresh process, and the allocator's peak.

The allocator's peak only grows within a process, so every policy is measured in a child
process (``python -m jremat.train.memory ... --live-child``) that prints one JSON line. On a mesh
the child runs the sharded gradient step and reads one device's peak (per device).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence

from jremat import allocator_stats_missing
from jremat.train import interrupts
from jremat.train.policy_memory import PolicyMemory, config_for_spec, live_step_memory


def _allocator_stats_note() -> str | None:
    missing = allocator_stats_missing()
    return (
        None if missing is None else f"live: {missing}; --live needs a GPU or TPU, so only compiled figures are shown"
    )


def _run_live_child(config, spec: str) -> int | None:
    """The live peak of ``spec``, measured in a fresh Python process (``None`` if it failed)."""
    argv = [sys.executable, "-m", "jremat.train.memory", *config.model_argv(), "--policy", spec, "--live-child"]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    interrupts.INTERRUPTS.before_exit(child.kill)  # a signal that ends this process ends the child too
    try:
        out, _ = child.communicate()
    finally:
        interrupts.INTERRUPTS.forget(child.kill)
    lines = out.strip().splitlines()
    if child.returncode != 0 or not lines:
        return None
    return json.loads(lines[-1]).get("live_peak_bytes")


def live_peaks(config) -> tuple[list[int | None], str | None]:
    """The live peak of every distinct ``--policy`` of ``config`` (a ``train.memory.MemoryConfig``),
    in order, one fresh process each (per device on a mesh).

    Returns:
      ``(peaks, note)``: the peaks (``None`` where a measurement failed; none at all when the
      device reports no allocator statistics), and a note when live figures could not be taken.
    """
    note = _allocator_stats_note()
    if note is not None:
        return [], note
    specs = list(dict.fromkeys(config.policy))  # one row per distinct spec, as compare_policies
    peaks = [_run_live_child(config, spec) for spec in specs]
    failed = [spec for spec, peak in zip(specs, peaks) if peak is None]
    return peaks, (f"live: the measurement failed for {', '.join(failed)}" if failed else None)


def add_live_peaks(config, rows: Sequence[PolicyMemory]) -> tuple[list[PolicyMemory], str | None]:
    """Fill :attr:`PolicyMemory.live_peak_bytes` of every row, one fresh process per policy.

    Returns:
      ``(rows, note)``: the rows, and a note when live figures could not be taken.
    """
    peaks, note = live_peaks(config)
    if not peaks:
        return list(rows), note
    return [dataclasses.replace(r, live_peak_bytes=peak) for r, peak in zip(rows, peaks)], note


def measure_here(config) -> int | None:
    """``--live-child``: the live peak of ``config``'s first policy, measured in this process (one
    device's on a mesh), or ``None`` where the device reports no allocator statistics.

    Raises:
      UsageError: on a mesh that does not fit the devices, or a policy that does not fit the model.
    """
    spec = config.policy[0]
    if config.mesh is None:
        cfg, _ = config_for_spec(
            config.model_config(spec),
            spec,
            config.batch_size,
            config.resolved_seq_len,
            config.memory_budget,
            whole_step=config.remat_head_chunks is None,
        )
        live = live_step_memory(cfg, config.batch_size, config.resolved_seq_len)
    else:
        from jremat.train import memory_mesh, sharded_steps

        mesh = memory_mesh.mesh_of(config)
        cfg = memory_mesh.model_config_on_mesh(config, spec, mesh)
        live = sharded_steps.live_grad_step_memory(cfg, mesh, config.batch_size, config.resolved_seq_len)
    return live.peak_bytes_in_use if live.available else None
