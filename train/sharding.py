"""Multi-device training with ``jax.sharding``: data parallel, FSDP (ZeRO-3), tensor and sequence parallel.

A run names its device mesh with a string, ``--mesh data=4,fsdp=2`` (axes left out have size 1;
the sizes must multiply to the number of devices). The mesh always has the four axes of
:data:`MESH_AXES`, in that order:

* ``data``: the batch is split over it; parameters are replicated.
* ``fsdp``: the batch is split over it too (an extra data axis, as in MaxText), and every
  parameter and optimizer-state tensor is split over it along its largest dimension that the
  axis size divides (ZeRO-3); XLA all-gathers a layer's weights where they are used.
* ``tensor``: the attention heads, MLP hidden units and vocabulary dimensions of the weights
  are split over it (Megatron tensor parallelism, left to XLA's SPMD partitioner).
* ``sequence``: the residual stream between sublayers (block input, between attention and MLP,
  block output) is split along the sequence axis (Megatron sequence parallelism), so the
  activations a remat policy keeps there take ``1 / sequence`` of the memory per device.

Where each tensor dimension goes is decided in one place: :data:`LOGICAL_AXIS_RULES` maps
logical axis names to mesh axes, :data:`PARAM_LOGICAL_AXES` names the dimensions of every
parameter of :class:`models.GPT`, and :data:`ACTIVATION_AXES` / :data:`BATCH_AXES` name those
of the residual stream and the token batches.

Multi-host: call :func:`initialize_distributed` before anything else touches JAX; it calls
``jax.distributed.initialize`` when ``JAX_COORDINATOR_ADDRESS`` (with ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID``) or a cluster scheduler (SLURM, Open MPI) is found in the environment.
See "Multi-device training" in README.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import jremat
from models import GPT, ModelConfig, cross_entropy_loss

#: The mesh axes, in mesh order (outermost first).
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "sequence")

#: The mesh axis over which parameters and optimizer state are split (ZeRO-3).
FSDP_AXIS = "fsdp"

#: Logical axis name -> the mesh axes that dimension is split over (in order). The one table of
#: where every parameter and activation dimension goes; ``()`` means replicated. The ``fsdp`` axis
#: is not listed for parameters: it goes to each tensor's largest free dimension that it divides
#: (see :func:`param_partition_spec`), except dimensions in :data:`FSDP_EXCLUDED`.
LOGICAL_AXIS_RULES: dict[str, tuple[str, ...]] = {
    # activations and batches
    "act_batch": ("data", "fsdp"),
    "act_seq": ("sequence",),
    "act_embed": (),
    # parameters
    "layers": (),  # the stacked-layer axis that lax.scan slices: never split
    "vocab": ("tensor",),  # the output head's vocabulary dimension
    "table_vocab": (),  # the embedding table's rows: a gather from rows split over tensor would be replicated
    "embed": (),
    "heads": ("tensor",),  # n_heads * head_dim of the q/k/v projections and the output projection's input
    "mlp": ("tensor",),
    "positions": (),
}

#: Logical axes the ``fsdp`` axis never splits (slicing a split layer axis inside ``lax.scan``
#: would all-gather the whole stack in every iteration).
FSDP_EXCLUDED: frozenset[str] = frozenset({"layers"})

#: Logical axes of every parameter of :class:`models.GPT`, by the end of its path (without the
#: leading ``layers`` axis, which parameters under ``blocks`` get in front). The longest matching
#: suffix wins; optimizer-state leaves end with their parameter's path and match the same way.
PARAM_LOGICAL_AXES: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("token_embed", "embedding"), ("table_vocab", "embed")),
    (("pos_embed",), ("positions", "embed")),
    (("q_proj", "kernel"), ("embed", "heads")),
    (("k_proj", "kernel"), ("embed", "heads")),
    (("v_proj", "kernel"), ("embed", "heads")),
    (("q_proj", "bias"), ("heads",)),
    (("k_proj", "bias"), ("heads",)),
    (("v_proj", "bias"), ("heads",)),
    (("out_proj", "kernel"), ("heads", "embed")),
    (("out_proj", "bias"), ("embed",)),
    (("fc_in", "kernel"), ("embed", "mlp")),
    (("fc_in", "bias"), ("mlp",)),
    (("fc_out", "kernel"), ("mlp", "embed")),
    (("fc_out", "bias"), ("embed",)),
    (("scale",), ("embed",)),
    (("bias",), ("embed",)),  # LayerNorm bias (the Linear biases above have longer suffixes)
    (("head", "kernel"), ("embed", "vocab")),
    (("head", "bias"), ("vocab",)),
)

#: Logical axes of the residual stream ``[batch, seq, d_model]`` between sublayers.
ACTIVATION_AXES: tuple[str, ...] = ("act_batch", "act_seq", "act_embed")

#: Logical axes of a token batch ``[batch, seq]``.
BATCH_AXES: tuple[str, ...] = ("act_batch", "act_seq")

_MESH_PART_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([^,=]*?)\s*$")


# ----------------------------------------------------------------------------- the mesh


def parse_mesh(text: str) -> dict[str, int]:
    """Parse a mesh spec such as ``"data=4,fsdp=2"`` into sizes for every axis of :data:`MESH_AXES`.

    Axes left out have size 1; order in the string does not matter.

    Args:
      text: comma-separated ``AXIS=SIZE`` parts; axes are ``data``, ``fsdp``, ``tensor``,
        ``sequence``; sizes are positive integers.

    Returns:
      ``{"data": ..., "fsdp": ..., "tensor": ..., "sequence": ...}`` in :data:`MESH_AXES` order.

    Raises:
      ValueError: on an empty spec, a part that is not ``AXIS=SIZE``, an unknown or repeated
        axis, or a size that is not a positive integer.
    """
    form = f"expected AXIS=SIZE[,AXIS=SIZE...] with AXIS one of {', '.join(MESH_AXES)}, e.g. 'data=4,fsdp=2'"
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"empty mesh spec {text!r}; {form}")
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen: set[str] = set()
    for part in text.split(","):
        match = _MESH_PART_RE.match(part)
        if not match:
            raise ValueError(f"malformed mesh spec {text!r}: {part.strip()!r} is not AXIS=SIZE; {form}")
        axis, raw = match.groups()
        if axis not in sizes:
            raise ValueError(f"unknown mesh axis {axis!r} in {text!r}; valid axes: {', '.join(MESH_AXES)}")
        if axis in seen:
            raise ValueError(f"mesh axis {axis!r} given twice in {text!r}")
        seen.add(axis)
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"mesh axis {axis!r} size must be a positive integer, got {raw!r} in {text!r}")
        sizes[axis] = int(raw)
    return sizes


def format_mesh(mesh: Mesh) -> str:
    """The spec string of ``mesh``'s axes larger than 1 (``"data=4,fsdp=2"``; ``"data=1"`` if none)."""
    parts = [f"{name}={size}" for name, size in mesh.shape.items() if size > 1]
    return ",".join(parts) or f"{MESH_AXES[0]}=1"


def make_mesh(sizes: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A :class:`jax.sharding.Mesh` with the four :data:`MESH_AXES` over ``devices``.

    Args:
      sizes: axis sizes, e.g. from :func:`parse_mesh` (missing axes have size 1).
      devices: the devices to lay out (default: ``jax.devices()``, every device of every process).

    Raises:
      ValueError: on an unknown axis, or if the sizes do not multiply to the number of devices
        (the message names the platform and, in a multi-process run, the processes).
    """
    unknown = [a for a in sizes if a not in MESH_AXES]
    if unknown:
        raise ValueError(f"unknown mesh axis {unknown[0]!r}; valid axes: {', '.join(MESH_AXES)}")
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(int(sizes.get(a, 1)) for a in MESH_AXES)
    if math.prod(shape) != len(devices):
        spec = ",".join(f"{a}={s}" for a, s in zip(MESH_AXES, shape) if s > 1) or "all sizes 1"
        where = devices[0].platform
        processes = len({d.process_index for d in devices})
        if processes > 1:
            where += f", {processes} processes with {len(devices) // processes} each"
        raise ValueError(
            f"mesh {spec} has {math.prod(shape)} devices but {len(devices)} are available "
            f"({where}); the axis sizes must multiply to {len(devices)}"
        )
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def mesh_from_flag(text: str | None, devices: Sequence[Any] | None = None) -> Mesh | None:
    """The mesh of a ``--mesh`` flag value, or ``None`` when it is ``None`` (single device, no sharding).

    Raises:
      ValueError: see :func:`parse_mesh` and :func:`make_mesh`.
    """
    if text is None:
        return None
    return make_mesh(parse_mesh(text), devices)


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch dimension is split: the product of the ``act_batch`` mesh axes."""
    return math.prod(mesh.shape[a] for a in LOGICAL_AXIS_RULES["act_batch"])


def check_batch(mesh: Mesh, batch_size: int, seq_len: int) -> None:
    """Check that a ``[batch_size, seq_len]`` batch splits evenly over ``mesh``.

    Raises:
      ValueError: if ``batch_size`` is not a multiple of ``data * fsdp`` or ``seq_len`` not a
        multiple of ``sequence``; the message names the valid choices.
    """
    ways = data_parallel_size(mesh)
    if batch_size % ways:
        raise ValueError(
            f"batch size {batch_size} does not split over the mesh's data x fsdp = "
            f"{mesh.shape['data']} x {mesh.shape['fsdp']} = {ways} devices; use a multiple of {ways}"
        )
    seq_ways = mesh.shape["sequence"]
    if seq_len % seq_ways:
        raise ValueError(
            f"sequence length {seq_len} does not split over the mesh's sequence axis of size {seq_ways}; "
            f"use a multiple of {seq_ways}"
        )


# ----------------------------------------------------------------------------- logical axes -> specs


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """The :class:`PartitionSpec` of a tensor whose dimensions have the given logical axes.

    Each dimension is split over the mesh axes :data:`LOGICAL_AXIS_RULES` gives it, keeping
    only axes of size > 1 whose combined size divides the dimension (the others would need
    padding; that dimension stays replicated over them).

    Raises:
      ValueError: if ``logical`` and ``shape`` differ in length or a logical axis is unknown.
    """
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match a tensor of shape {tuple(shape)}")
    entries = []
    for name, dim in zip(logical, shape):
        if name is not None and name not in LOGICAL_AXIS_RULES:
            raise ValueError(f"unknown logical axis {name!r}; known: {', '.join(LOGICAL_AXIS_RULES)}")
        axes, ways = [], 1
        for axis in LOGICAL_AXIS_RULES.get(name, ()) if name else ():
            size = mesh.shape[axis]
            if size > 1 and dim % (ways * size) == 0:
                axes.append(axis)
                ways *= size
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)


def _path_names(path) -> tuple[str, ...]:
    """The string keys of a pytree key path, without NNX's trailing ``value`` attribute."""
    names = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey) and isinstance(entry.key, str):
            names.append(entry.key)
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            names.append(entry.name)
    while names and names[-1] == "value":
        names.pop()
    return tuple(names)


def param_logical_axes(path, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of a parameter (or optimizer-state leaf) at pytree key ``path``.

    Matches the longest suffix in :data:`PARAM_LOGICAL_AXES`; parameters under ``blocks`` get
    a leading ``layers`` axis. A leaf no rule matches (or whose rank does not fit) gets
    unnamed axes: only the ``fsdp`` rule applies to it.
    """
    names = _path_names(path)
    best: tuple[str, ...] | None = None
    best_len = 0
    for suffix, axes in PARAM_LOGICAL_AXES:
        if len(suffix) > best_len and names[-len(suffix):] == suffix:
            best, best_len = axes, len(suffix)
    if best is not None and "blocks" in names:
        best = ("layers",) + best
    if best is None or len(best) != ndim:
        return (None,) * ndim
    return best


def param_partition_spec(path, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Where a parameter or optimizer-state leaf lives on ``mesh`` (ZeRO-3 over ``fsdp``).

    First the :data:`LOGICAL_AXIS_RULES` of its logical axes (tensor parallelism); then the
    ``fsdp`` axis goes to the largest dimension still unsplit, not in :data:`FSDP_EXCLUDED`, and
    divisible by the ``fsdp`` size (ties: the earlier dimension). Tensors with no such
    dimension (scalars, small biases) stay replicated over ``fsdp``.
    """
    logical = param_logical_axes(path, len(shape))
    spec = list(logical_to_spec(logical, shape, mesh))
    spec += [None] * (len(shape) - len(spec))
    fsdp = mesh.shape[FSDP_AXIS]
    if fsdp > 1:
        free = [i for i, (name, entry) in enumerate(zip(logical, spec))
                if entry is None and name not in FSDP_EXCLUDED and shape[i] % fsdp == 0]
        if free:
            i = max(free, key=lambda d: (shape[d], -d))
            spec[i] = FSDP_AXIS
    return PartitionSpec(*spec)


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """A pytree of :class:`NamedSharding` for a tree of parameters or optimizer state (same structure).

    Leaves may be arrays or :class:`jax.ShapeDtypeStruct`; typed PRNG keys and scalars are replicated.
    """

    def one(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, param_partition_spec(path, shape, mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of a value every device holds whole (the loss, the dropout key)."""
    return NamedSharding(mesh, PartitionSpec())


def replicated_key(seed: int, mesh: Mesh) -> jax.Array:
    """``jax.random.key(seed)`` held whole by every device of ``mesh`` (of every process).

    A global array, so that orbax can save it in a multi-process run (a key on one local
    device is not serializable there) and the sharded steps take it as it is.
    """
    data = np.asarray(jax.random.key_data(jax.random.key(seed)))
    return jax.random.wrap_key_data(jax.make_array_from_callback(data.shape, replicated(mesh), lambda index: data[index]))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a ``[batch, seq]`` token batch: batch over ``data`` x ``fsdp``, seq over ``sequence``."""
    return NamedSharding(mesh, PartitionSpec(*(LOGICAL_AXIS_RULES[a] or None for a in BATCH_AXES)))


def shard_batch(mesh: Mesh, batch) -> jax.Array:
    """Put a global ``[batch, seq]`` array (the same on every process) onto ``mesh``, split per :func:`batch_sharding`.

    Works on one host and on many: each process contributes the pieces its devices hold.

    Raises:
      ValueError: if the batch does not split evenly (see :func:`check_batch`).
    """
    batch = np.asarray(batch)
    if batch.ndim != 2:
        raise ValueError(f"expected a [batch, seq] token array, got shape {batch.shape}")
    check_batch(mesh, *batch.shape)
    return jax.make_array_from_callback(batch.shape, batch_sharding(mesh), lambda index: batch[index])


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """``x -> with_sharding_constraint(x, ...)`` for the residual stream ``[batch, seq, d_model]``.

    Hashable (it is a static attribute of the model's graph definition). Batch over ``data`` x
    ``fsdp``, sequence over ``sequence`` (sequence parallelism), model width replicated.
    """

    mesh: Mesh

    @property
    def sharding(self) -> NamedSharding:
        """The :class:`NamedSharding` the residual stream is constrained to."""
        return NamedSharding(self.mesh, PartitionSpec(*(LOGICAL_AXIS_RULES[a] or None for a in ACTIVATION_AXES)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Constrain ``x`` (rank 3) to :attr:`sharding`, dropping mesh axes that do not divide its dims."""
        spec = logical_to_spec(ACTIVATION_AXES, x.shape, self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


# ----------------------------------------------------------------------------- state and steps


def abstract_params(model_cfg: ModelConfig, mesh: Mesh) -> tuple[Any, Any]:
    """``(graphdef, params)`` of :class:`models.GPT` with sequence-parallel activations, as shapes (nothing allocated).

    The ``params`` leaves are :class:`jax.ShapeDtypeStruct` carrying their shardings on ``mesh``.
    """
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0),
                                                            activation_sharding=ActivationSharding(mesh))))
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
    from train import step as step_lib  # the single-device step: the same update, here partitioned

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
    from train import step as step_lib

    b_sh = batch_sharding(mesh)
    return jremat.jit(step_lib.eval_step_fn(graphdef), in_shardings=(_shardings_of(params), b_sh, b_sh),
                      out_shardings=replicated(mesh))


def make_grad_fn(graphdef, mesh: Mesh, params: Any) -> Callable:
    """A sharded jitted ``(params, tokens, targets, key) -> (loss, grads)``; grads sharded like params."""
    p_sh, b_sh, r_sh = _shardings_of(params), batch_sharding(mesh), replicated(mesh)

    def loss_and_grads(p, tokens, targets, key):
        return jax.value_and_grad(lambda q: cross_entropy_loss(nnx.merge(graphdef, q), tokens, targets, key))(p)

    return jremat.jit(loss_and_grads, in_shardings=(p_sh, b_sh, b_sh, r_sh), out_shardings=(r_sh, p_sh))


def compile_steps(graphdef, tx: optax.GradientTransformation, mesh: Mesh, params: Any, opt_state: Any,
                  batch_size: int, seq_len: int) -> tuple[Any, Any]:
    """AOT-compiled sharded ``(train_step, eval_step)`` for ``[batch_size, seq_len]`` batches.

    Raises:
      ValueError: if the batch does not split over the mesh (see :func:`check_batch`).
    """
    check_batch(mesh, batch_size, seq_len)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding(mesh))
    key = jax.random.key(0)
    train_c = make_train_step(graphdef, tx, mesh, params, opt_state).lower(params, opt_state, tokens, tokens, key).compile()
    eval_c = make_eval_step(graphdef, mesh, params).lower(params, tokens, tokens).compile()
    return train_c, eval_c


# ----------------------------------------------------------------------------- per-device memory


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """XLA's compile-time memory figures of a sharded step, per device (bytes).

    Attributes:
      mesh: the mesh spec (``"data=4,fsdp=2"``).
      devices: number of devices in the mesh.
      temp: temporaries (saved activations, gradients in flight, workspace) on one device.
      argument: this device's shards of the arguments.
      output: this device's shards of the outputs.
      alias: output bytes that reuse (donated) argument buffers.
      peak: ``argument + output + temp - alias``, the figure to compare with device memory.
    """

    mesh: str
    devices: int
    temp: int
    argument: int
    output: int
    alias: int

    @property
    def peak(self) -> int:
        """``argument + output + temp - alias``."""
        return self.argument + self.output + self.temp - self.alias

    def format(self) -> str:
        """One line: ``mesh data=4,fsdp=2 (8 devices), per device: peak ... temp ... args ... out ...``."""
        mib = 1 << 20
        return (f"mesh {self.mesh} ({self.devices} devices), per device: peak {self.peak / mib:.2f} MiB, "
                f"temp {self.temp / mib:.2f} MiB, arguments {self.argument / mib:.2f} MiB, "
                f"outputs {self.output / mib:.2f} MiB, aliased {self.alias / mib:.2f} MiB")


def sharded_step_memory(model_cfg: ModelConfig, mesh: Mesh, batch_size: int, seq_len: int,
                        tx: optax.GradientTransformation | None = None) -> DeviceMemory:
    """Per-device memory of a sharded step on ``mesh``, from XLA's analysis of the compiled program (nothing runs).

    Args:
      model_cfg: the model (its remat policy included).
      mesh: the device mesh (:func:`make_mesh`).
      batch_size, seq_len: the global batch shape.
      tx: with an optimizer, the whole train step (:func:`make_train_step`, params and
        optimizer state donated); ``None``: forward + backward only (:func:`make_grad_fn`).

    Raises:
      ValueError: if the batch does not split over the mesh.
    """
    check_batch(mesh, batch_size, seq_len)
    graphdef, params = abstract_params(model_cfg, mesh)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding(mesh))
    key = jax.eval_shape(lambda: jax.random.key(0))
    if tx is None:
        lowered = make_grad_fn(graphdef, mesh, params).lower(params, tokens, tokens, key)
    else:
        opt_shapes = jax.eval_shape(tx.init, params)
        opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                 opt_shapes, state_shardings(opt_shapes, mesh))
        lowered = make_train_step(graphdef, tx, mesh, params, opt_state).lower(params, opt_state, tokens, tokens, key)
    analysis = lowered.compile().memory_analysis()
    return DeviceMemory(
        mesh=format_mesh(mesh),
        devices=mesh.size,
        temp=int(analysis.temp_size_in_bytes),
        argument=int(analysis.argument_size_in_bytes),
        output=int(analysis.output_size_in_bytes),
        alias=int(analysis.alias_size_in_bytes),
    )


# ----------------------------------------------------------------------------- multi-host


#: The variables that name a multi-process run explicitly (all three, or none).
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def distributed_config(env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The ``jax.distributed.initialize`` arguments the environment asks for, or ``None`` (single process).

    * ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES`` and
      ``JAX_PROCESS_ID``: explicit; returns those three arguments.
    * otherwise a multi-task SLURM job (``SLURM_JOB_ID`` with ``SLURM_NTASKS`` > 1) or Open MPI
      run (``OMPI_COMM_WORLD_SIZE`` > 1): returns ``{}`` (JAX detects the rest itself).

    Raises:
      ValueError: if only some of :data:`DISTRIBUTED_ENV` are set, or a number is malformed
        or out of range.
    """
    env = os.environ if env is None else env
    given = [v for v in DISTRIBUTED_ENV if env.get(v)]
    if given:
        missing = [v for v in DISTRIBUTED_ENV if v not in given]
        if missing:
            raise ValueError(
                f"multi-host setup: {', '.join(given)} set but {', '.join(missing)} missing; set all of "
                f"{', '.join(DISTRIBUTED_ENV)} (or none for a single process)"
            )
        address = env["JAX_COORDINATOR_ADDRESS"]
        if not re.match(r"^[^:\s]+:\d+$", address):
            raise ValueError(f"JAX_COORDINATOR_ADDRESS must be HOST:PORT of process 0, got {address!r}")
        try:
            n, pid = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
        except ValueError:
            raise ValueError(
                f"JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers, got "
                f"{env['JAX_NUM_PROCESSES']!r} and {env['JAX_PROCESS_ID']!r}"
            ) from None
        if n < 1 or not 0 <= pid < n:
            raise ValueError(f"need JAX_NUM_PROCESSES >= 1 and 0 <= JAX_PROCESS_ID < JAX_NUM_PROCESSES, got {n} and {pid}")
        return dict(coordinator_address=address, num_processes=n, process_id=pid)

    def count(name):
        try:
            return int(env.get(name, "1"))
        except ValueError:
            return 1

    if (env.get("SLURM_JOB_ID") and count("SLURM_NTASKS") > 1) or count("OMPI_COMM_WORLD_SIZE") > 1:
        return {}
    return None


class DistributedSetupError(ValueError):
    """A multi-process run cannot start: coordinator unreachable, port taken, or inconsistent process counts."""


#: Seconds between connection attempts while waiting for the coordinator.
_POLL_INTERVAL_S = 0.2

#: Extra seconds JAX's own initialization deadline gets beyond ``timeout_s``, so that the
#: watchdog of :func:`initialize_distributed` (a clear one-line message) fires before JAX
#: aborts the process (a fatal C++ log with a stack trace).
_JAX_DEADLINE_GRACE_S = 15


def _split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait until a TCP connection to the coordinator at ``address`` (``host:port``) succeeds.

    Args:
      address: ``JAX_COORDINATOR_ADDRESS``, the host and port of process 0.
      timeout_s: how long to keep trying.

    Raises:
      DistributedSetupError: if no connection succeeded within ``timeout_s``; the message names
        the address, the timeout and the last connection error.
    """
    import socket
    import time

    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            last = err.strerror or type(err).__name__
        if time.monotonic() >= deadline:
            raise DistributedSetupError(
                f"could not reach the coordinator at {address} within {timeout_s:g} s ({last}); start process 0 "
                "with the same JAX_COORDINATOR_ADDRESS, check that HOST:PORT names its host and an open port, "
                "or allow longer with --init-timeout-s"
            )
        time.sleep(_POLL_INTERVAL_S)


def check_coordinator_port(address: str) -> None:
    """Check that process 0 can open the coordinator's port (it listens there on every interface).

    Raises:
      DistributedSetupError: if the port cannot be bound (typically: already in use).
    """
    import socket

    _, port = _split_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as err:
            raise DistributedSetupError(
                f"process 0 cannot open the coordinator port {port} of JAX_COORDINATOR_ADDRESS={address} "
                f"({err.strerror or err}); choose a free port"
            ) from None


def _exit_with_message(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(2)


def initialize_distributed(env: Mapping[str, str] | None = None, *, timeout_s: float = 300,
                           fail: Callable[[str], None] = _exit_with_message) -> bool:
    """Call ``jax.distributed.initialize`` if :func:`distributed_config` finds a multi-process run.

    Must run before any other JAX call in the process. On CPU, cross-process collectives use
    gloo. With the explicit variables, process 0 first checks that it can open the coordinator
    port and every other process waits (at most ``timeout_s``) until the coordinator accepts
    connections; afterwards every process checks that the coordinator counts as many processes
    as its ``JAX_NUM_PROCESSES`` says.

    Two failures happen once JAX's distributed runtime is running, where an ordinary exit would
    wait for (or be aborted by) the other processes: not all processes reaching the coordinator
    within ``timeout_s`` (one was not started, or process 0 was given a larger
    ``JAX_NUM_PROCESSES``; JAX itself would abort with a fatal log), and a ``JAX_NUM_PROCESSES``
    larger than the coordinator's. For those ``fail(message)`` is called (from a watchdog thread
    for the first); it must end the process. The default prints ``error: message`` to stderr and
    exits at once with code 2.

    Args:
      env: the environment to read (default ``os.environ``).
      timeout_s: seconds to wait for the coordinator and for every process to connect.
      fail: called with a one-line message on the two failures above; must not return.

    Returns:
      Whether it initialized (``False``: a single-process run, nothing done).

    Raises:
      ValueError: on an inconsistent environment (see :func:`distributed_config`).
      DistributedSetupError: coordinator unreachable or its port taken (before JAX's runtime starts).
    """
    import threading

    config = distributed_config(env)
    if config is None:
        return False
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = config.get("coordinator_address")
    if address is not None:
        if config["process_id"] == 0:
            check_coordinator_port(address)
        else:
            wait_for_coordinator(address, timeout_s)
    where = f"the coordinator at {address}" if address else "the coordinator found in the scheduler's environment"
    expected = f"JAX_NUM_PROCESSES={config['num_processes']}" if address else "the scheduler's task count"
    this = f" (this is process {config['process_id']})" if address else ""
    message = (
        f"not every process reached {where} within {timeout_s:g} s{this}; start all {expected} processes, "
        "each with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES and its own JAX_PROCESS_ID, "
        "or allow longer with --init-timeout-s"
    )
    done = threading.Event()

    def watchdog():
        if not done.wait(timeout_s):
            fail(message)

    threading.Thread(target=watchdog, name="jremat-distributed-watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(**config, initialization_timeout=math.ceil(timeout_s) + _JAX_DEADLINE_GRACE_S)
    finally:
        done.set()
    if address is not None and jax.process_count() != config["num_processes"]:
        fail(f"JAX_NUM_PROCESSES={config['num_processes']} on this process, but {where} runs "
             f"{jax.process_count()} processes; give every process the same JAX_NUM_PROCESSES")
    return True


def is_primary() -> bool:
    """Whether this is process 0 (the one that prints, writes metrics and shows progress)."""
    return jax.process_index() == 0


def wait_for_all_processes(name: str, timeout_s: float) -> None:
    """Block until every process reaches the barrier ``name`` (nothing to do in a single process).

    A barrier of the coordination service (through orbax's multihost helpers), so it waits up to
    ``timeout_s``; used after compiling, where processes may finish far apart: the first CPU
    collective otherwise gives up when a peer is more than about 30 s late (gloo's connection
    timeout). Every process must call it with the same unique ``name``.

    Raises:
      jax.errors.JaxRuntimeError: if some process did not arrive within ``timeout_s``.
    """
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost

    multihost.get_barrier_sync_fn()(key=name, timeout_ms=int(timeout_s * 1000))


def agree_any(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (a small all-gather; the flag itself on one process).

    Every process must call it at the same point of the program.
    """
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(bool(flag)))))
