"""The gathers the reference model writes so that a policy can keep them (``keep_gathered``,
``keep_collectives``): each parameter constrained to its placement without ``fsdp``.

Related modules: :mod:`train.sharding` holds the placement rules these read;
:mod:`train.sharded_steps` builds the model with them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jremat.train.sharding import FSDP_AXIS, axis_size, logical_to_spec, param_logical_axes, path_names


@dataclasses.dataclass(frozen=True)
class GatheredWeights:
    """``params -> params``: one layer's parameters constrained to their gathered placement.

    Hashable (a static attribute of the model's graph definition, ``GPT(weight_sharding=...)``).
    Each parameter gets its tensor-parallel placement (:data:`LOGICAL_AXIS_RULES`) without
    ``fsdp``: the all-gather FSDP needs, made a value of the layer's checkpoints, which a policy
    with ``keep_gathered=true`` keeps for the backward pass instead of gathering it again (at the
    cost of the gathered weights, per device, from each layer's forward to its backward pass).
    """

    mesh: Mesh
    #: Gather only the vectors (LayerNorm scales, biases) and leave the matrices' gathers to XLA.
    vectors_only: bool = False

    def __call__(self, params: Any) -> Any:
        """``params`` (one layer's, unstacked), each leaf constrained to its gathered placement."""

        def one(path, leaf):
            shape = tuple(getattr(leaf, "shape", ()))
            if not shape or not jnp.issubdtype(getattr(leaf, "dtype", jnp.int32), jnp.floating):
                return leaf
            if self.vectors_only and len(shape) > 1:
                return leaf
            spec = logical_to_spec(param_logical_axes(path, len(shape)), shape, self.mesh)
            return jax.lax.with_sharding_constraint(leaf, NamedSharding(self.mesh, spec))

        return jax.tree_util.tree_map_with_path(one, params)


def gathered_layer_bytes(params: Any, mesh: Mesh) -> int:
    """Per-device bytes of one layer's weight matrices gathered to their placement without ``fsdp``
    (what :class:`GatheredWeights` makes a value of the layer's checkpoints), from the model's
    parameters (arrays or shape structs; the stacked ``blocks``, layer axis first)."""
    total = 0

    def one(path, leaf):
        nonlocal total
        names = path_names(path)
        shape = tuple(getattr(leaf, "shape", ()))
        if "blocks" not in names or len(shape) < 3 or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return
        layer_shape = shape[1:]
        spec = logical_to_spec(param_logical_axes(path, len(shape))[1:], layer_shape, mesh)
        split = math.prod(
            axis_size(mesh, a) for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)
        )
        total += math.prod(layer_shape) * jnp.dtype(leaf.dtype).itemsize // split

    jax.tree_util.tree_map_with_path(one, params)
    return total


def keeps_gathered(model_cfg: Any, keys: tuple[str, ...] = ("keep_gathered", "keep_collectives")) -> bool:
    """Whether any policy of ``model_cfg`` (``remat_policy``, ``remat_layer_policies``) sets one of ``keys``
    (``keep_gathered=true`` or ``keep_collectives=true``), so that the model must make its gathered weights
    values of its checkpoints (:class:`GatheredWeights`)."""
    # Every spelling of true the registry takes (jremat.registry's bool keys).
    on = re.compile(rf"({'|'.join(keys)})\s*=\s*(true|1|yes)\b", re.IGNORECASE)
    return any(on.search(spec) for spec in (model_cfg.remat_policy, model_cfg.remat_layer_policies))


def weight_gathers(model_cfg: Any, mesh: Mesh) -> GatheredWeights | None:
    """The gathers :class:`models.GPT`'s blocks write (``weight_sharding``) so that its policy can
    keep them; ``None`` without ``fsdp`` or a policy that keeps gathered weights (:func:`keeps_gathered`).

    A block gathers all its weights, except under ``keep_collectives`` alone with scanned layers:
    there the step without remat gathers a layer's matrices again in its backward pass (XLA keeps
    no gathered buffer across a loop's iterations), so they are left to XLA, gathered once in the
    backward pass as without remat, and only the vectors are gathered and kept. (The loss head's
    weights are gathered once, where its ``shard_map`` begins: :func:`train.head.sharded_head`.)
    """
    if mesh.shape[FSDP_AXIS] == 1 or not keeps_gathered(model_cfg):
        return None
    vectors_only = model_cfg.scan_layers and not keeps_gathered(model_cfg, ("keep_gathered",))
    return GatheredWeights(mesh, vectors_only=vectors_only)
