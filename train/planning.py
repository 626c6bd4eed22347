"""``--policy auto --memory-budget B`` for the reference GPT: :func:`jremat.plan_layers` on its programs.

A layer plan (the candidate the budget planner chooses, :class:`jremat.LayerPlan`) becomes an
ordinary config (:func:`apply_candidate`): ``remat_policy="names:save=..."``
(``full`` for the empty set; ``offload:names=...,save=...`` when some names go to host memory)
and, for a partial stack, ``layer_policies="G:<spec>"`` with the remaining layers on ``none``.
The step measured is the gradient step (:func:`train.programs.step_program`) unless the caller
passes its own measurement (the benchmark measures its Adam step).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

import jremat
from jremat import Budget, Candidate, LayerPlan, registry
from jremat.internal import convert_values
from jremat.models.config import ModelConfig
from jremat.train.programs import block_program, step_flops, step_memory_report


def apply_candidate(candidate: Candidate, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with ``candidate`` as its remat settings (block granularity)."""
    if candidate.remat_layers == 0:
        return cfg.replace(remat_policy="none", remat_granularity="block", remat_layer_policies="")
    if candidate.remat_layers == cfg.n_layers:
        return cfg.replace(remat_policy=candidate.spec(), remat_granularity="block", remat_layer_policies="")
    return cfg.replace(
        remat_policy="none",
        remat_granularity="block",
        remat_layer_policies=f"{candidate.remat_layers}:{candidate.spec()}",
    )


def compiled_peak_bytes(cfg: ModelConfig, batch_size: int, seq_len: int) -> int:
    """Compiled peak of the gradient step of ``cfg`` (:func:`train.programs.step_memory_report`).

    Raises:
      ValueError: if the backend reports no memory figures.
    """
    report = step_memory_report(cfg, batch_size, seq_len)
    if not report.available or report.peak_bytes is None:
        raise ValueError(
            f"this backend reports no compiled memory figures ({'; '.join(report.notes)}); auto cannot verify a plan"
        )
    return int(report.peak_bytes)


def keep_gathered_of(values: dict) -> bool | None:
    """The ``keep_gathered`` key of an ``auto`` spec's raw values (:func:`jremat.registry.parse_spec`):
    ``True`` or ``False`` when given (``plan_for_budget(keep_gathered=...)``), ``None`` when not.

    Raises:
      ValueError: a value that is not a boolean.
    """
    return _bool_key(values, registry.KEEP_GATHERED)


def keep_collectives_of(values: dict) -> bool | None:
    """The ``keep_collectives`` key of an ``auto`` spec's raw values, as :func:`keep_gathered_of`.

    Raises:
      ValueError: a value that is not a boolean.
    """
    return _bool_key(values, registry.KEEP_COLLECTIVES)


def _bool_key(values: dict, key: str) -> bool | None:
    if key not in values:
        return None
    param = {key: registry.UNIVERSAL_PARAMS[key]}
    return convert_values("auto", param, {key: values[key]})[key]


def plan_for_budget(
    cfg: ModelConfig,
    batch_size: int,
    budget: str | Budget,
    seq_len: int | None = None,
    *,
    measure_peak_bytes: Callable[[ModelConfig], int] | None = None,
    offload: bool | None = None,
    offload_cost_per_byte: float | None = None,
    regather_flops: float = 0.0,
    keep_gathered: bool | None = None,
    keep_key: str = "keep_gathered",
    devices: int = 1,
) -> LayerPlan:
    """The least-recompute layer plan for ``cfg`` whose compiled step peak fits ``budget``.

    Args:
      cfg: the model (its remat fields are replaced by the plan).
      batch_size: sequences per batch.
      budget: ``"6GiB"``-style bytes, or a fraction in ``(0, 1]`` of the way from full remat's
        peak to the no-remat peak.
      seq_len: tokens per sequence (default ``cfg.max_seq_len``).
      measure_peak_bytes: compiles a config and returns its peak; default: the gradient step
        (:func:`compiled_peak_bytes`).
      offload: consider offloading names to host memory; ``None`` (default): on accelerators
        with ``pinned_host`` memory (:func:`jremat.host_offload_available`).
      offload_cost_per_byte: FLOP-equivalents per offloaded byte; default: measured by
        :func:`jremat.offload_flops_per_byte`.
      regather_flops: on a mesh, as in :func:`jremat.plan_layers` (with a ``measure_peak_bytes``
        that compiles the sharded step): plans that keep each layer's gathered weights are
        candidates, and re-gathering is priced.
      keep_gathered: only plans that keep (``True``) or re-gather (``False``) the gathered weights,
        as in :func:`jremat.plan_layers`; ``None`` (default): the cheaper.
      keep_key: the key the keeping plans set, as in :func:`jremat.plan_layers`.
      devices: the devices of the step's mesh, as in :func:`jremat.plan_layers`.

    Returns:
      The :class:`jremat.LayerPlan`; its ``config`` is the planned :class:`ModelConfig`.

    Raises:
      ValueError: on a bad budget, when no plan fits (with the smallest achievable peak), or
        when ``offload=True`` on a device without host memory.
    """
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    none_cfg = cfg.replace(remat_policy="none", remat_granularity="block")
    block_fn, block_args = block_program(none_cfg, batch_size, seq_len)
    costs = jremat.name_costs(jremat.trace_program(block_fn, *block_args))
    if offload is None:
        offload = jremat.host_offload_available()
    if offload and offload_cost_per_byte is None:
        offload_cost_per_byte = jremat.offload_flops_per_byte(cfg.dtype)
    measure = measure_peak_bytes or (lambda c: compiled_peak_bytes(c, batch_size, seq_len))
    return jremat.plan_layers(
        budget,
        costs=costs,
        n_layers=cfg.n_layers,
        block_input_bytes=batch_size * seq_len * cfg.d_model * jnp.dtype(cfg.dtype).itemsize,
        none_layer_bytes=jremat.saved_residuals_report(block_fn, *block_args, param_argnums=(0,)).saved_bytes,
        measure_peak_bytes=lambda cand: measure(apply_candidate(cand, cfg)),
        apply=lambda cand: apply_candidate(cand, cfg),
        step_flops=step_flops(none_cfg, batch_size, seq_len),
        offload_cost_per_byte=offload_cost_per_byte if offload else None,
        regather_flops=regather_flops,
        keep_gathered=keep_gathered,
        keep_key=keep_key,
        devices=devices,
    )


__all__ = [
    "apply_candidate",
    "compiled_peak_bytes",
    "keep_collectives_of",
    "keep_gathered_of",
    "plan_for_budget",
]
