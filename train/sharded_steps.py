"""Sharded model state and train/eval steps on a device mesh, and their per-device memory.

The layout (which mesh axes split which tensor dimension) comes from :mod:`train.sharding`;
this module creates parameters and optimizer state with those shardings, jits the single-device
steps of :mod:`train.step` with explicit in/out shardings, and reads a compiled sharded step's
memory per device through :func:`jremat.compiled_memory_report`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

import jremat
from jremat import compiled_memory_report, format_bytes
from jremat.models import GPT, ModelConfig, cross_entropy_loss
from jremat.train.experts import expert_parallel
from jremat.train.gathered import gathered_layer_bytes, weight_gathers
from jremat.train.head import sharded_head
from jremat.train.sharding import (
    FSDP_AXIS,
    HIDDEN_AXES,
    TENSOR_AXIS,
    ActivationSharding,
    axis_size,
    batch_sharding,
    check_batch,
    device_count,
    format_mesh,
    replicated,
    state_shardings,
)

# ----------------------------------------------------------------------------- state and steps


def abstract_params(model_cfg: ModelConfig, mesh: Mesh) -> tuple[Any, Any]:
    """``(graphdef, params)`` of :class:`models.GPT` with sequence-parallel activations, as shapes (nothing allocated).

    Under ``fsdp`` with a policy that sets ``keep_gathered=true`` or ``keep_collectives=true`` the model
    also constrains its weights to their gathered placement (:func:`train.gathered.weight_gathers`).
    An MoE model on a mesh with an ``expert`` axis runs its MoE layers expert-parallel
    (:func:`train.experts.expert_parallel`), and a chunked loss head runs each device's tokens
    (:func:`train.head.sharded_head`). On a ``tensor`` axis the blocks constrain what their
    output projections contract (``hidden_sharding``: :data:`train.sharding.HIDDEN_AXES`).

    Raises:
      ValueError: an ``expert`` axis for a dense model, or one that does not divide the experts.

    The ``params`` leaves are :class:`jax.ShapeDtypeStruct` carrying their shardings on ``mesh``.
    """
    # A policy that keeps gathered weights needs them as values of the checkpoints.
    gathered = weight_gathers(model_cfg, mesh)
    experts = expert_parallel(mesh, model_cfg)
    graphdef, shapes = nnx.split(
        nnx.eval_shape(
            lambda: GPT(
                model_cfg,
                rngs=nnx.Rngs(0),
                activation_sharding=ActivationSharding(mesh),
                hidden_sharding=ActivationSharding(mesh, HIDDEN_AXES) if axis_size(mesh, TENSOR_AXIS) > 1 else None,
                weight_sharding=gathered,
                sharded_head=sharded_head(mesh, model_cfg),
                expert_parallel=experts,
            )
        )
    )
    shardings = state_shardings(shapes, mesh)
    return graphdef, jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_params(model_cfg: ModelConfig, seed: int, mesh: Mesh) -> tuple[Any, Any]:
    """``(graphdef, params)`` of a freshly initialized :class:`models.GPT`, created sharded on ``mesh``.

    The values of ``train.step.init_params(model_cfg, seed)`` (up to float rounding: the
    initializers run under ``jit``); each device only ever holds its own shards. The graph definition carries :class:`ActivationSharding` for ``mesh``.
    """
    graphdef, abstract = abstract_params(model_cfg, mesh)
    shardings = jax.tree.map(lambda s: s.sharding, abstract)

    def init():
        return nnx.split(GPT(model_cfg, rngs=nnx.Rngs(seed)))[1]

    params = jax.jit(init, out_shardings=shardings)()
    return graphdef, params


def shard_params(params: Any, mesh: Mesh) -> Any:
    """``params`` (or any parameter-like tree) moved onto ``mesh`` per :func:`state_shardings`."""
    return jax.device_put(params, state_shardings(params, mesh))


def init_opt_state(tx: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
    """``tx.init(params)`` created sharded: moment estimates like their parameters, counters replicated."""
    shardings = state_shardings(jax.eval_shape(tx.init, params), mesh)
    return jax.jit(tx.init, out_shardings=shardings)(params)


def _shardings_of(tree: Any) -> Any:
    return jax.tree.map(lambda leaf: leaf.sharding, tree)


def make_train_step(graphdef, tx: optax.GradientTransformation, mesh: Mesh, params: Any, opt_state: Any) -> Callable:
    """``train.step.make_train_step`` jitted with explicit shardings on ``mesh``.

    ``(params, opt_state, tokens, targets, key) -> (params, opt_state, loss)``; params and
    optimizer state keep the shardings they came in with (``params``/``opt_state`` here are the
    sharded trees, or shape structs with shardings), batches are split per
    :func:`batch_sharding`, key and loss are replicated. ``params`` and ``opt_state`` are donated.
    """
    from jremat.train import (
        step as step_lib,  # the single-device step: the same update, here partitioned
    )

    p_sh, o_sh = _shardings_of(params), _shardings_of(opt_state)
    b_sh, r_sh = batch_sharding(mesh), replicated(mesh)
    return jremat.jit(
        step_lib.train_step_fn(graphdef, tx),
        in_shardings=(p_sh, o_sh, b_sh, b_sh, r_sh),
        out_shardings=(p_sh, o_sh, r_sh),
        donate_argnums=(0, 1),
    )


def make_eval_step(graphdef, mesh: Mesh, params: Any) -> Callable:
    """``train.step.make_eval_step`` jitted with explicit shardings: ``(params, tokens, targets) -> loss``."""
    from jremat.train import step as step_lib

    b_sh = batch_sharding(mesh)
    return jremat.jit(
        step_lib.eval_step_fn(graphdef),
        in_shardings=(_shardings_of(params), b_sh, b_sh),
        out_shardings=replicated(mesh),
    )


def make_grad_fn(graphdef, mesh: Mesh, params: Any) -> Callable:
    """A sharded jitted ``(params, tokens, targets, key) -> (loss, grads)``; grads sharded like params."""
    p_sh, b_sh, r_sh = _shardings_of(params), batch_sharding(mesh), replicated(mesh)

    def loss_and_grads(p, tokens, targets, key):
        return jax.value_and_grad(lambda q: cross_entropy_loss(nnx.merge(graphdef, q), tokens, targets, key))(p)

    return jremat.jit(loss_and_grads, in_shardings=(p_sh, b_sh, b_sh, r_sh), out_shardings=(r_sh, p_sh))


def compile_steps(
    graphdef, tx: optax.GradientTransformation, mesh: Mesh, params: Any, opt_state: Any, batch_size: int, seq_len: int
) -> tuple[Any, Any]:
    """AOT-compiled sharded ``(train_step, eval_step)`` for ``[batch_size, seq_len]`` batches.

    Raises:
      ValueError: if the batch does not split over the mesh (see :func:`check_batch`).
    """
    check_batch(mesh, batch_size, seq_len)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding(mesh))
    key = jax.random.key(0)
    train_c = (
        make_train_step(graphdef, tx, mesh, params, opt_state).lower(params, opt_state, tokens, tokens, key).compile()
    )
    eval_c = make_eval_step(graphdef, mesh, params).lower(params, tokens, tokens).compile()
    return train_c, eval_c


def abstract_train_step(
    model_cfg: ModelConfig, mesh: Mesh, batch_size: int, seq_len: int, tx: optax.GradientTransformation
) -> tuple[Callable, tuple]:
    """``(step, args)``: the sharded train step (:func:`make_train_step`) and its arguments as shape
    structs with their shardings (nothing allocated): ``(params, opt_state, tokens, targets, key)``.

    Raises:
      ValueError: if the batch does not split over the mesh (see :func:`check_batch`).
    """
    check_batch(mesh, batch_size, seq_len)
    graphdef, params = abstract_params(model_cfg, mesh)
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_shapes, state_shardings(opt_shapes, mesh)
    )
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding(mesh))
    key = jax.eval_shape(lambda: jax.random.key(0))
    step = make_train_step(graphdef, tx, mesh, params, opt_state)
    return step, (params, opt_state, tokens, tokens, key)


def abstract_grad_step(model_cfg: ModelConfig, mesh: Mesh, batch_size: int, seq_len: int) -> tuple[Callable, tuple]:
    """The sharded gradient step (:func:`make_grad_fn`) and its arguments as shapes with shardings
    (nothing allocated): ``(grad_fn, (params, tokens, targets, key))``.

    Raises:
      ValueError: if the batch does not split over the mesh (see :func:`check_batch`).
    """
    check_batch(mesh, batch_size, seq_len)
    graphdef, params = abstract_params(model_cfg, mesh)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding(mesh))
    key = jax.eval_shape(lambda: jax.random.key(0))
    return make_grad_fn(graphdef, mesh, params), (params, tokens, tokens, key)


def grad_step_timeline(model_cfg: ModelConfig, mesh: Mesh, batch_size: int, seq_len: int) -> jremat.MemoryTimeline:
    """The memory timeline (:func:`jremat.memory_timeline`) of the sharded gradient step: one device's
    share of the SPMD program, all-gathered weights as their own kind (compiled only, nothing runs).

    Raises:
      ValueError: if the batch does not split over the mesh.
    """
    grad_fn, args = abstract_grad_step(model_cfg, mesh, batch_size, seq_len)
    return jremat.memory_timeline(grad_fn, *args)


def live_grad_step_memory(model_cfg: ModelConfig, mesh: Mesh, batch_size: int, seq_len: int) -> jremat.LiveMemory:
    """Run the sharded gradient step once on real arrays and read the allocator's peak of the mesh's
    first device (:func:`jremat.live_memory`): per device. Nothing runs on a backend without
    allocator statistics (XLA:CPU); the result then says why.

    Raises:
      ValueError: if the batch does not split over the mesh.
    """
    device = mesh.devices.flat[0]
    missing = jremat.allocator_stats_missing(device)
    if missing is not None:
        return jremat.LiveMemory(False, str(device), None, None, missing)
    check_batch(mesh, batch_size, seq_len)
    graphdef, params = init_params(model_cfg, 0, mesh)
    tokens = jax.device_put(jnp.zeros((batch_size, seq_len), jnp.int32), batch_sharding(mesh))
    key = jax.device_put(jax.random.key(0), replicated(mesh))
    return jremat.live_memory(make_grad_fn(graphdef, mesh, params), params, tokens, tokens, key, device=device)


def regather_price(model_cfg: ModelConfig, mesh: Mesh) -> tuple[int, float]:
    """``(bytes, FLOP-equivalents)`` of gathering one layer's weights again in the backward pass, per
    device, under ``fsdp`` (:func:`train.gathered.gathered_layer_bytes` times the all-gather's price
    measured on ``mesh``, :func:`jremat.collective_flops_per_byte`); ``(0, 0.0)`` without ``fsdp``."""
    if mesh.shape[FSDP_AXIS] <= 1:
        return 0, 0.0
    gathered = gathered_layer_bytes(abstract_params(model_cfg, mesh)[1], mesh)
    return gathered, gathered * jremat.collective_flops_per_byte("all-gather", mesh)


# ----------------------------------------------------------------------------- per-device memory


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """XLA's compile-time memory figures of a sharded step, per device (bytes).

    Read through :func:`jremat.compiled_memory_report`, so the peak follows the
    library's rules (on XLA:CPU the backend's own peak leaves temporaries out and is not used).

    Attributes:
      mesh: the mesh spec (``"data=4,fsdp=2"``).
      devices: number of devices in the mesh.
      temp: temporaries (saved activations, gradients in flight, workspace) on one device.
      argument: this device's shards of the arguments.
      output: this device's shards of the outputs.
      alias: output bytes that reuse (donated) argument buffers.
      peak: the figure to compare with device memory (``argument + output + temp - alias``
        unless the backend reports a usable peak of its own).
      peak_source: how :attr:`peak` was obtained (see :class:`jremat.MemoryReport`).
      collectives: the step's collectives per device (:func:`jremat.collectives_report`).
    """

    mesh: str
    devices: int
    temp: int
    argument: int
    output: int
    alias: int
    peak: int
    peak_source: str
    collectives: jremat.CollectivesReport | None = None

    def format(self) -> str:
        """One line: ``mesh data=4,fsdp=2 (8 devices), per device: peak ... temp ... args ... out ...``."""
        return (
            f"mesh {self.mesh} ({device_count(self.devices)}), per device: peak {format_bytes(self.peak)}, "
            f"temp {format_bytes(self.temp)}, arguments {format_bytes(self.argument)}, "
            f"outputs {format_bytes(self.output)}, aliased {format_bytes(self.alias)}"
        )


def sharded_step_memory(
    model_cfg: ModelConfig, mesh: Mesh, batch_size: int, seq_len: int, tx: optax.GradientTransformation | None = None
) -> DeviceMemory:
    """Per-device memory of a sharded step on ``mesh``, from XLA's analysis of the compiled program (nothing runs).

    Args:
      model_cfg: the model (its remat policy included).
      mesh: the device mesh (:func:`train.sharding.make_mesh`).
      batch_size, seq_len: the global batch shape.
      tx: with an optimizer, the whole train step (:func:`make_train_step`, params and
        optimizer state donated); ``None``: forward + backward only (:func:`make_grad_fn`).

    Raises:
      ValueError: if the batch does not split over the mesh, or the backend reports no memory
        figures (the message gives its reason).
    """
    if tx is None:
        grad_fn, args = abstract_grad_step(model_cfg, mesh, batch_size, seq_len)
        lowered = grad_fn.lower(*args)
    else:
        step, args = abstract_train_step(model_cfg, mesh, batch_size, seq_len, tx)
        lowered = step.lower(*args)
    compiled = lowered.compile()
    report = compiled_memory_report(compiled, platform=mesh.devices.flat[0].platform)
    if not report.available:
        raise ValueError(f"no per-device memory figures for mesh {format_mesh(mesh)}: {'; '.join(report.notes)}")
    return DeviceMemory(
        mesh=format_mesh(mesh),
        devices=mesh.size,
        temp=report.temp_bytes,
        argument=report.argument_bytes,
        output=report.output_bytes,
        alias=report.alias_bytes,
        peak=report.peak_bytes,
        peak_source=report.peak_source,
        collectives=jremat.compiled_collectives_report(compiled),
    )
