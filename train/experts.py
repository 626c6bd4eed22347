"""Expert parallelism of the reference model's mixture-of-experts layers on a mesh: the ``expert``
axis (:data:`train.sharding.EXPERT_AXIS`) checked against the experts, and the layers' dispatch."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jremat.train.sharding import EXPERT_AXIS, axis_size, token_axes


def expert_parallel(mesh: Mesh, model_cfg: Any) -> Any:
    """The :class:`models.moe.ExpertParallel` of an MoE model on ``mesh``, or ``None`` (no ``expert``
    axis larger than 1: the MoE layers dispatch without ``all_to_all``, partitioned by XLA as any op).

    Tokens are split over the batch axes (:data:`LOGICAL_AXIS_RULES`'s ``act_batch``, the ``expert``
    axis among them) and ``sequence``, the experts over ``expert``.

    Raises:
      ValueError: an ``expert`` axis larger than 1 for a dense model, or one that does not divide
        its experts.
    """
    from jremat.models.moe import ExpertParallel

    size = axis_size(mesh, EXPERT_AXIS)
    if size <= 1:
        return None
    check_expert_axis(size, model_cfg.moe_experts)
    batch_axes, seq_axes = token_axes(mesh)
    return ExpertParallel(mesh, EXPERT_AXIS, batch_axes, seq_axes, model_cfg.moe_capacity_factor)


def check_expert_axis(size: int, moe_experts: int) -> None:
    """An ``expert`` mesh axis of ``size`` fits a model of ``moe_experts`` experts (0: dense).

    Raises:
      ValueError: naming the axis size and the experts, when the model has no experts or the
        axis size does not divide them.
    """
    if size <= 1:
        return
    if moe_experts == 0:
        raise ValueError(
            f"the mesh's expert axis (size {size}) splits the experts of an MoE model, but the model is dense; "
            "give it experts (--moe-experts) or leave the expert axis out"
        )
    if moe_experts % size:
        raise ValueError(
            f"{moe_experts} experts do not split over the mesh's expert axis of size {size}; "
            f"use a number of experts that is a multiple of {size}, or an expert axis that divides {moe_experts}"
        )
