"""The mixture-of-experts FFN of the reference model (``ModelConfig.moe_experts > 0``).

:class:`MoE` replaces a block's MLP: a softmax router picks each token's top-k experts (their
probabilities renormalized to sum to 1), every expert is a SwiGLU MLP of width ``d_ff`` without
biases (``w_out(silu(w_gate x) * w_up x)``, as in Mixtral, DeepSeek-V3 and Qwen3-MoE), and the
token's output is the router-weighted sum of its experts' outputs.

On one device dispatch is dropless: the ``tokens * top_k`` assignments are sorted by expert and
each of the experts' three matmuls runs as one grouped matmul over their contiguous rows
(:func:`jax.lax.ragged_dot` with the per-expert counts as group sizes); the outputs are
un-sorted and combined. Under expert parallelism (:class:`ExpertParallel`, a mesh with an
``expert`` axis) the layer runs under :func:`jax.shard_map`: each device routes its own tokens,
sends each expert at most ``capacity`` of them with :func:`jax.lax.all_to_all` (the rest are
dropped, as in Switch and GShard), runs its local experts and sends the outputs back with
another ``all_to_all``.

The tensors are tagged with the names of :data:`jremat.names.MOE_NAMES` (router logits,
dispatched tokens, the experts' gate and up projections, their hidden layer after the
activation, expert output, combined output), so name-based policies (``names:save=moe_hidden``)
apply to them.

The layer also returns its two auxiliary losses (:func:`aux_losses`): the load-balancing loss of
Switch Transformer and the router z-loss of ST-MoE. :func:`with_aux_gradient` adds their
weighted gradient to the backward pass without changing the forward value (as Megatron-LM's
``MoEAuxLossAutoScaler`` does), so the block keeps its ``x -> x`` signature and the training
loss its value (the cross-entropy).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jremat import names, ops
from jremat.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where an MoE layer's tokens and experts live under expert parallelism (hashable: a static
    argument of the model's blocks).

    Attributes:
      mesh: the device mesh.
      axis: the mesh axis the experts are split over (``train.sharding.EXPERT_AXIS``).
      batch_axes: the mesh axes the batch dimension of the activations is split over (``axis`` among them).
      seq_axes: the mesh axes the sequence dimension is split over.
      capacity_factor: slots per expert that each device sends, as a multiple of its even share
        ``local tokens * top_k / experts`` (:func:`capacity`).
    """

    mesh: Any
    axis: str
    batch_axes: tuple[str, ...]
    seq_axes: tuple[str, ...]
    capacity_factor: float

    @property
    def size(self) -> int:
        """Devices along :attr:`axis`."""
        return int(self.mesh.shape[self.axis])

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Every mesh axis that splits the tokens (the auxiliary losses are means over all of them)."""
        return self.batch_axes + self.seq_axes


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """Slots one device sends each expert: ``ceil(factor * tokens * top_k / experts)``, at least 1.

    Args:
      tokens: the device's tokens.
      top_k: experts per token.
      experts: experts in the layer (all devices').
      factor: the capacity factor (``> 0``).
    """
    return max(1, math.ceil(factor * tokens * top_k / experts))


@jax.custom_vjp
def with_aux_gradient(y: jax.Array, aux: jax.Array) -> jax.Array:
    """``y`` unchanged, with the gradient of the scalar ``aux`` added to the backward pass.

    The backward pass gives ``aux`` the cotangent 1, as if ``aux`` were added to the loss, whatever
    is done with ``y``: the auxiliary losses of an MoE layer train the router without a second
    output of the layer (Megatron-LM's ``MoEAuxLossAutoScaler``). Their value is not in the loss.

    Args:
      y: the layer's output.
      aux: a float32 scalar, the weighted auxiliary losses.
    """
    return y


def _with_aux_forward(y, aux):
    return y, None


def _with_aux_backward(_, cotangent):
    return cotangent, jnp.ones((), jnp.float32)


with_aux_gradient.defvjp(_with_aux_forward, _with_aux_backward)


def route(x: jax.Array, router: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The softmax top-k router, in float32.

    Args:
      x: tokens ``[tokens, d_model]``.
      router: ``[d_model, experts]``.
      top_k: experts per token.

    Returns:
      ``(logits [tokens, experts], weights [tokens, top_k], experts [tokens, top_k])``: the
      router logits (tagged :data:`jremat.names.MOE_ROUTER_LOGITS`), each token's top-k experts
      by logit and their probabilities renormalized over the k (a softmax of the k logits).
    """
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
    logits = checkpoint_name(logits, names.MOE_ROUTER_LOGITS)
    top_logits, experts = jax.lax.top_k(logits, top_k)
    return logits, jax.nn.softmax(top_logits, axis=-1), experts


def aux_losses(logits: jax.Array, experts: jax.Array, mean=lambda v: v) -> tuple[jax.Array, jax.Array]:
    """The load-balancing loss and the router z-loss of one layer (float32 scalars).

    Load balance (Switch Transformer, eq. 4): ``E * sum_e f_e * P_e`` with ``f_e`` the fraction
    of the ``tokens * top_k`` assignments that go to expert ``e`` (no gradient) and ``P_e`` the
    mean router probability of ``e``; 1 when both are uniform. Router z-loss (ST-MoE, eq. 5):
    the mean over tokens of ``logsumexp(logits)^2``.

    Args:
      logits: ``[tokens, experts]`` router logits.
      experts: ``[tokens, top_k]`` chosen experts.
      mean: applied to each per-device mean before it is used (under expert parallelism a
        ``pmean`` over the token axes, so every device gets the means over all tokens).
    """
    n_experts = logits.shape[-1]
    assigned = jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=jnp.float32), axis=(0, 1))
    fraction = mean(jax.lax.stop_gradient(assigned / experts.size))
    probability = mean(jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0))
    load_balance = n_experts * jnp.sum(fraction * probability)
    router_z = mean(jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))))
    return load_balance, router_z


def expert_ffn(
    rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_out: jax.Array, group_sizes: jax.Array
) -> jax.Array:
    """Every expert's SwiGLU MLP over its contiguous rows: three grouped matmuls (:func:`jax.lax.ragged_dot`)
    around :func:`jremat.ops.swiglu`.

    Args:
      rows: ``[rows, d_model]`` tokens sorted by expert (tagged :data:`jremat.names.MOE_DISPATCHED`
        here).
      w_gate, w_up: ``[experts, d_model, d_ff]``; their outputs are tagged
        :data:`jremat.names.MOE_HIDDEN_PRE_ACT` and :data:`jremat.names.MOE_HIDDEN_UP`, the
        activation's output :data:`jremat.names.MOE_HIDDEN`.
      w_out: ``[experts, d_ff, d_model]``.
      group_sizes: ``[experts]`` int32 rows per expert, in order; they sum to at most ``rows``.

    Returns:
      ``[rows, d_model]`` (tagged :data:`jremat.names.MOE_EXPERT_OUT`), in the order of ``rows``.
    """
    rows = checkpoint_name(rows, names.MOE_DISPATCHED)
    gate = checkpoint_name(jax.lax.ragged_dot(rows, w_gate.astype(rows.dtype), group_sizes), names.MOE_HIDDEN_PRE_ACT)
    up = checkpoint_name(jax.lax.ragged_dot(rows, w_up.astype(rows.dtype), group_sizes), names.MOE_HIDDEN_UP)
    hidden = checkpoint_name(ops.swiglu(gate, up), names.MOE_HIDDEN)
    return checkpoint_name(jax.lax.ragged_dot(hidden, w_out.astype(rows.dtype), group_sizes), names.MOE_EXPERT_OUT)


def _combine(per_assignment: jax.Array, weights: jax.Array) -> jax.Array:
    """``[tokens, top_k, d]`` expert outputs weighted by ``[tokens, top_k]`` and summed over k."""
    combined = jnp.einsum("tkd,tk->td", per_assignment, weights.astype(per_assignment.dtype))
    return checkpoint_name(combined, names.MOE_COMBINED)


def dropless(x: jax.Array, router, w_gate, w_up, w_out, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The MoE FFN on one device, dropping no token: ``(output [tokens, d], load_balance, router_z)``.

    The ``tokens * top_k`` assignments are sorted by expert (stable), the experts run as grouped
    matmuls over them (:func:`expert_ffn`), and each output goes back to its token.
    """
    tokens = x.shape[0]
    n_experts = router.shape[-1]
    logits, weights, experts = route(x, router, top_k)
    flat = experts.reshape(-1)  # assignment a = token * top_k + choice
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    out = expert_ffn(x[order // top_k], w_gate, w_up, w_out, group_sizes)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    combined = _combine(out[inverse].reshape(tokens, top_k, -1), weights)
    return combined, *aux_losses(logits, experts)


def expert_parallel_shard(
    x: jax.Array, router, w_gate, w_up, w_out, *, top_k: int, ep: ExpertParallel
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One device's part of the expert-parallel MoE FFN (the body of the ``shard_map``).

    Args:
      x: this device's tokens ``[tokens, d_model]``.
      router: the whole router ``[d_model, experts]``.
      w_gate, w_up, w_out: this device's experts (``experts / ep.size`` of them, in expert order).
      top_k: experts per token.
      ep: the layout.

    Returns:
      ``(output [tokens, d_model], load_balance, router_z)``; the losses are means over every
      device's tokens.

    Each device fills a ``[experts, capacity, d_model]`` buffer with its tokens, in token order
    per expert (assignments past an expert's capacity are dropped: their output is 0), exchanges
    it with ``all_to_all`` so that each device holds its experts' slots from every device, runs
    them as grouped matmuls of ``ep.size * capacity`` rows per expert (empty slots are zeros) and
    sends the outputs back with a second ``all_to_all``.
    """
    tokens, d_model = x.shape
    n_experts = router.shape[-1]
    local_experts = w_gate.shape[0]
    slots = capacity(tokens, top_k, n_experts, ep.capacity_factor)
    logits, weights, experts = route(x, router, top_k)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat.size, dtype=jnp.int32) - starts[flat[order]]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)  # each assignment's place in its expert's queue
    slot = jnp.where(rank < slots, flat * slots + rank, n_experts * slots)  # past the end: dropped
    token_of = jnp.arange(flat.size, dtype=jnp.int32) // top_k
    buffer = jnp.zeros((n_experts * slots, d_model), x.dtype).at[slot].set(x[token_of], mode="drop")
    buffer = buffer.reshape(ep.size, local_experts, slots, d_model)
    received = jax.lax.all_to_all(buffer, ep.axis, 0, 0, tiled=True)  # [source device, local expert, slot, d]
    rows = received.transpose(1, 0, 2, 3).reshape(local_experts * ep.size * slots, d_model)
    group_sizes = jnp.full((local_experts,), ep.size * slots, jnp.int32)
    out = expert_ffn(rows, w_gate, w_up, w_out, group_sizes)
    out = out.reshape(local_experts, ep.size, slots, d_model).transpose(1, 0, 2, 3)
    returned = jax.lax.all_to_all(out, ep.axis, 0, 0, tiled=True).reshape(n_experts * slots, d_model)
    per_assignment = returned.at[slot].get(mode="fill", fill_value=0)
    combined = _combine(per_assignment.reshape(tokens, top_k, d_model), weights)
    mean = lambda v: jax.lax.pmean(v, ep.token_axes)
    return combined, *aux_losses(logits, experts, mean)


class MoE(nnx.Module):
    """Mixture-of-experts FFN: a softmax top-k router over ``moe_experts`` SwiGLU MLPs of width ``d_ff``.

    Parameters: ``router [d_model, experts]`` (float32 logits), ``w_gate`` and ``w_up``
    ``[experts, d_model, d_ff]`` and ``w_out [experts, d_ff, d_model]`` (no biases). Called on
    ``[batch, seq, d_model]``, it returns the output and the layer's load-balancing loss and router
    z-loss (:func:`aux_losses`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, d_ff, n_experts = cfg.d_model, cfg.d_ff, cfg.moe_experts
        param_dtype = jnp.dtype(cfg.param_dtype)
        fan_in = lambda: nnx.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
        )
        self.router = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d, n_experts), param_dtype))
        self.w_gate = nnx.Param(fan_in()(rngs.params(), (n_experts, d, d_ff), param_dtype))
        self.w_up = nnx.Param(fan_in()(rngs.params(), (n_experts, d, d_ff), param_dtype))
        self.w_out = nnx.Param(fan_in()(rngs.params(), (n_experts, d_ff, d), param_dtype))
        self.top_k = cfg.moe_top_k

    def __call__(self, x: jax.Array, expert_parallel: ExpertParallel | None = None):
        """``(output [batch, seq, d_model], load_balance, router_z)`` of ``x [batch, seq, d_model]``.

        Args:
          x: the LayerNorm'd residual stream, in the compute dtype.
          expert_parallel: ``None`` (dropless, on whatever devices ``x`` is) or the layout of an
            expert-parallel run (:func:`expert_parallel_shard` under :func:`jax.shard_map`).

        Raises:
          ValueError: under expert parallelism, if the experts do not split over its axis.
        """
        batch, seq, d = x.shape
        router, w_gate, w_up, w_out = self.router[...], self.w_gate[...], self.w_up[...], self.w_out[...]
        if expert_parallel is None:
            out, load_balance, router_z = dropless(x.reshape(batch * seq, d), router, w_gate, w_up, w_out, self.top_k)
            return out.reshape(batch, seq, d), load_balance, router_z
        ep = expert_parallel
        if w_gate.shape[0] % ep.size:
            raise ValueError(f"{w_gate.shape[0]} experts do not split over the mesh's {ep.axis} axis of size {ep.size}")

        def shard(x_shard, router, w_gate, w_up, w_out):
            b, s, _ = x_shard.shape
            out, load_balance, router_z = expert_parallel_shard(
                x_shard.reshape(b * s, d), router, w_gate, w_up, w_out, top_k=self.top_k, ep=ep
            )
            return out.reshape(b, s, d), load_balance, router_z

        tokens = PartitionSpec(ep.batch_axes or None, ep.seq_axes or None, None)
        experts = PartitionSpec(ep.axis, None, None)
        scalar = PartitionSpec()
        return jax.shard_map(
            shard,
            mesh=ep.mesh,
            in_specs=(tokens, PartitionSpec(None, None), experts, experts, experts),
            out_specs=(tokens, scalar, scalar),
        )(x, router, w_gate, w_up, w_out)
