"""``--policy auto --memory-budget B`` for the reference model: the plan that fits, at least recompute.

Decision space: which of the block's tagged tensors to save (every subset of the names in
:mod:`jremat.names` that the block tags, except its input and output) x how many layers, from
the first, are rematerialized (the rest keep everything). A plan becomes an ordinary config:
``remat_policy="names:save=..."`` (``full`` for the empty set; ``offload:names=...,save=...``
when some names go to host memory) and, for a partial stack,
``layer_policies="G:<spec>"`` with the remaining layers on ``none``.

Cost model (shared with ``skip_cheap``): a name's recompute cost is the FLOPs of the block's ops
from the previous tagged value up to it; a plan's cost is the sum over names it does not save,
times the layers it remats. Where the backend has separate host memory (``pinned_host`` on
GPU, TPU), a name that is not saved on the device is offloaded instead of recomputed when moving
its bytes to the host and back costs less: bytes x FLOP-equivalents per byte, measured once on
the device (:func:`offload_flops_per_byte`). Offloaded values take no device memory, so this
choice is per name and does not enlarge the search. Peak prediction: two compiles (``none`` and
``full``) calibrate how XLA's peak moves per traced residual byte; the chosen plan is then
compiled and, if over budget, the walk goes on to the next-cheapest plan
(:func:`policies.auto.solve`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from typing import Callable

import jax
import jax.numpy as jnp

import jremat
from jremat import memory as jmem
from jremat import names as tensor_names
from models.config import ModelConfig
from policies.auto import Budget, Solution, parse_budget, solve
from train.memory import block_program, step_program

#: Names every plan keeps anyway (the checkpoint input) or that are the block's output.
_ALWAYS = (tensor_names.BLOCK_INPUT, tensor_names.BLOCK_OUTPUT)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan: the names saved (and offloaded) in rematerialized layers, and how many layers."""

    save: tuple[str, ...]
    remat_layers: int
    offload: tuple[str, ...] = ()

    def spec(self) -> str:
        """The policy spec of a rematerialized layer."""
        if self.offload:
            return "offload:names=" + "+".join(self.offload) + (",save=" + "+".join(self.save) if self.save else "")
        return "names:save=" + "+".join(self.save) if self.save else "full"

    def apply(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this plan as its remat settings (block granularity)."""
        if self.remat_layers == 0:
            return cfg.replace(remat_policy="none", remat_granularity="block", remat_layer_policies="")
        if self.remat_layers == cfg.n_layers:
            return cfg.replace(remat_policy=self.spec(), remat_granularity="block", remat_layer_policies="")
        return cfg.replace(
            remat_policy="none", remat_granularity="block", remat_layer_policies=f"{self.remat_layers}:{self.spec()}"
        )

    def describe(self, n_layers: int) -> str:
        """A one-line description."""
        if self.remat_layers == 0:
            return "none (no remat)"
        return f"{self.spec()} on layers 0..{self.remat_layers - 1} of {n_layers}" + (
            "" if self.remat_layers == n_layers else ", none on the rest"
        )


@dataclasses.dataclass(frozen=True)
class NameCost:
    """Per-layer bytes and recompute FLOPs of one tagged tensor of the block."""

    name: str
    bytes: int
    recompute_flops: float
    offload_flops: float | None = None

    @property
    def offloaded(self) -> bool:
        """Whether offloading this name (when not saved) is cheaper than recomputing it."""
        return self.offload_flops is not None and self.offload_flops < self.recompute_flops

    @property
    def unsaved_flops(self) -> float:
        """The cost of not saving it on the device: recompute or offload, whichever is cheaper."""
        return self.offload_flops if self.offloaded else self.recompute_flops


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """What ``auto`` chose, with the numbers behind it.

    Attributes:
      config: the model config carrying the chosen plan.
      candidate: the chosen :class:`Candidate`.
      budget_bytes: the budget in bytes.
      names: per-name costs of the block.
      solution: the solver's record (predicted and compiled peak, compiles tried, times).
      none_peak_bytes: compiled peak without remat.
      full_peak_bytes: compiled peak with full remat on every layer.
      step_flops: FLOPs of one step without remat (for the overhead fraction).
    """

    config: ModelConfig
    candidate: Candidate
    budget_bytes: int
    names: tuple[NameCost, ...]
    solution: Solution
    none_peak_bytes: int
    full_peak_bytes: int
    step_flops: float

    @property
    def recompute_fraction(self) -> float:
        """Predicted recompute FLOPs as a fraction of the no-remat step's FLOPs."""
        return self.solution.recompute_flops / self.step_flops if self.step_flops else 0.0

    def table(self) -> str:
        """Every tensor name with its decision, then predicted vs compiled peak and overhead."""
        cand = self.candidate
        lines = [f"auto plan for budget {self.budget_bytes:,} bytes ({self.budget_bytes / 2**30:.3f} GiB): "
                 f"{cand.describe(self.config.n_layers)}"]
        lines.append(f"  {'tensor':<14} {'bytes/layer':>14} {'recompute FLOPs':>16}  decision")
        for nc in self.names:
            if cand.remat_layers == 0 or nc.name in cand.save:
                decision = "save"
            elif nc.name in cand.offload:
                decision = "offload to host"
            else:
                decision = "recompute"
            lines.append(f"  {nc.name:<14} {nc.bytes:>14,} {nc.recompute_flops:>16,.0f}  {decision}")
        sol = self.solution
        lines.append(
            f"  predicted peak {sol.predicted_peak_bytes:,} B, compiled peak {sol.compiled_peak_bytes:,} B "
            f"(none {self.none_peak_bytes:,} B, full {self.full_peak_bytes:,} B); predicted recompute "
            f"{self.recompute_fraction:.1%} of the step's FLOPs"
            f"{' (offloads priced in FLOP-equivalents)' if cand.offload else ''}; solved in {sol.solve_s * 1e3:.1f} ms "
            f"+ {len(sol.compiled)} verification compile(s) in {sol.compile_s:.1f} s"
        )
        return "\n".join(lines)


@functools.lru_cache(maxsize=256)
def compiled_peak_bytes(cfg: ModelConfig, batch_size: int, seq_len: int) -> int:
    """XLA's peak for the gradient step of ``cfg`` (compile only; cached per config).

    Raises:
      ValueError: if the backend reports no memory figures.
    """
    grad_fn, args = step_program(cfg, batch_size, seq_len)
    report = jmem.memory_report(grad_fn, *args)
    if not report.available or report.peak_bytes is None:
        raise ValueError(f"this backend reports no compiled memory figures ({'; '.join(report.notes)}); auto cannot verify a plan")
    return int(report.peak_bytes)


def host_offload_available() -> bool:
    """Whether offloading can free device memory: an accelerator that addresses ``pinned_host``.

    XLA:CPU also lists ``pinned_host``, but there host and device are the same RAM.
    """
    device = jax.devices()[0]
    return device.platform != "cpu" and "pinned_host" in {m.kind for m in device.addressable_memories()}


def _best_s(fn, repeats: int = 5) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


@functools.lru_cache(maxsize=8)
def offload_flops_per_byte(dtype: str = "bfloat16", transfer_bytes: int = 64 * 2**20, matmul_size: int = 2048) -> float:
    """FLOP-equivalents of moving one byte to host memory and back, measured on the default device.

    Times a round trip of ``transfer_bytes`` to ``pinned_host`` and a ``matmul_size``-square
    matmul in ``dtype``; the ratio prices offloading in the recompute cost model's unit. It does
    not credit the overlap of transfers with compute, so offloading is priced pessimistically.

    Args:
      dtype: the compute dtype whose matmul rate sets the FLOP side.
      transfer_bytes: bytes moved to the host and back per timing.
      matmul_size: side of the square matmul timed.

    Returns:
      FLOP-equivalents per byte (cached per argument tuple).

    Raises:
      ValueError: if the device has no ``pinned_host`` memory.
    """
    device = jax.devices()[0]
    if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        raise ValueError(f"{device} has no pinned_host memory to offload to")
    to_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    to_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    data = jnp.ones((transfer_bytes // 4,), jnp.float32)
    round_trip_s = _best_s(lambda: jax.device_put(jax.device_put(data, to_host), to_device))
    a = jnp.ones((matmul_size, matmul_size), jnp.dtype(dtype))
    matmul = jax.jit(lambda x: x @ x)
    flops_per_s = 2 * matmul_size**3 / _best_s(lambda: matmul(a))
    return round_trip_s / transfer_bytes * flops_per_s


def name_costs(cfg: ModelConfig, batch_size: int, seq_len: int) -> tuple[NameCost, ...]:
    """Per-layer bytes and recompute FLOPs of each tensor the block tags, in program order."""
    block_fn, args = block_program(cfg.replace(remat_policy="none", remat_granularity="block"), batch_size, seq_len)
    program = jremat.trace_program(block_fn, *args)
    costs, segment_flops = [], 0.0
    for op in program.ops:
        segment_flops += op.flops
        if op.primitive == "name" and op.tensor_name in tensor_names.ALL_NAMES:
            if op.tensor_name not in _ALWAYS:
                costs.append(NameCost(op.tensor_name, op.out_bytes, segment_flops))
            segment_flops = 0.0
    return tuple(costs)


def plan_for_budget(
    cfg: ModelConfig,
    batch_size: int,
    budget: "str | Budget",
    seq_len: int | None = None,
    *,
    measure_peak_bytes: "Callable[[ModelConfig], int] | None" = None,
    offload: bool | None = None,
    offload_cost_per_byte: float | None = None,
) -> AutoPlan:
    """Choose the least-recompute plan whose compiled gradient-step peak fits ``budget``.

    Args:
      cfg: the model (its remat fields are replaced by the plan).
      batch_size: sequences per batch.
      budget: ``"6GiB"``-style bytes, or a fraction in ``(0, 1]`` of the way from the
        parameter-and-gradient floor to the no-remat peak.
      seq_len: tokens per sequence (default ``cfg.max_seq_len``).
      measure_peak_bytes: compiles a config and returns its peak; default: the gradient step
        (:func:`compiled_peak_bytes`). The benchmark passes its Adam train step.
      offload: consider offloading names to host memory; ``None`` (default): on accelerators
        with ``pinned_host`` memory (:func:`host_offload_available`).
      offload_cost_per_byte: FLOP-equivalents per offloaded byte; default: measured by
        :func:`offload_flops_per_byte`.

    Returns:
      The :class:`AutoPlan`.

    Raises:
      ValueError: on a bad budget, when no plan fits (with the smallest achievable peak), or
        when ``offload=True`` on a device without host memory.
    """
    budget = budget if isinstance(budget, Budget) else parse_budget(budget)
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    n_layers = cfg.n_layers
    costs = name_costs(cfg, batch_size, seq_len)
    if offload is None:
        offload = host_offload_available()
    if offload:
        per_byte = offload_flops_per_byte(cfg.dtype) if offload_cost_per_byte is None else offload_cost_per_byte
        costs = tuple(dataclasses.replace(c, offload_flops=c.bytes * per_byte) for c in costs)
    block_input_bytes = batch_size * seq_len * cfg.d_model * jnp.dtype(cfg.dtype).itemsize

    def measure(cand: Candidate) -> int:
        if measure_peak_bytes is not None:
            return measure_peak_bytes(cand.apply(cfg))
        return compiled_peak_bytes(cand.apply(cfg), batch_size, seq_len)

    none_cand, full_cand = Candidate((), 0), Candidate((), n_layers)
    none_peak, full_peak = measure(none_cand), measure(full_cand)
    none_block_fn, none_block_args = block_program(
        cfg.replace(remat_policy="none", remat_granularity="block"), batch_size, seq_len
    )
    none_layer_bytes = jmem.saved_residuals_report(none_block_fn, *none_block_args, param_argnums=(0,)).saved_bytes
    traced_span = max(none_layer_bytes - block_input_bytes, 1)
    bytes_per_traced_byte = max(none_peak - full_peak, 0) / (n_layers * traced_span)
    by_name = {c.name: c for c in costs}

    def kept_bytes(cand: Candidate) -> int:
        kept = block_input_bytes + sum(by_name[n].bytes for n in cand.save)
        return min(kept, none_layer_bytes)

    def predict(cand: Candidate) -> int:
        if cand.remat_layers == 0:
            return none_peak
        extra = cand.remat_layers * (kept_bytes(cand) - block_input_bytes) + (n_layers - cand.remat_layers) * traced_span
        return int(full_peak + bytes_per_traced_byte * extra)

    def cost(cand: Candidate) -> float:
        return cand.remat_layers * sum(c.unsaved_flops for c in costs if c.name not in cand.save)

    names_in_order = [c.name for c in costs]
    candidates = [none_cand]
    for r in range(len(names_in_order) + 1):
        for subset in itertools.combinations(names_in_order, r):
            moved = tuple(c.name for c in costs if c.offloaded and c.name not in subset)
            candidates.extend(Candidate(subset, g, moved) for g in range(1, n_layers + 1))
    floor = full_peak if budget.fraction is not None else 0
    budget_bytes = budget.resolve(none_peak, floor_bytes=floor)
    solution = solve(
        budget_bytes,
        candidates,
        predict_peak_bytes=predict,
        recompute_flops=cost,
        measure_peak_bytes=measure,
        describe=lambda c: c.describe(n_layers),
    )
    grad_fn, args = step_program(cfg.replace(remat_policy="none", remat_granularity="block"), batch_size, seq_len)
    return AutoPlan(
        config=solution.candidate.apply(cfg),
        candidate=solution.candidate,
        budget_bytes=budget_bytes,
        names=costs,
        solution=solution,
        none_peak_bytes=none_peak,
        full_peak_bytes=full_peak,
        step_flops=jmem.program_flops(grad_fn, *args),
    )
