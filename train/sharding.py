"""Where every tensor lives on a device mesh: data parallel, FSDP (ZeRO-3), tensor and sequence parallel.

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

An MoE model (``--moe-experts``) may add a fifth axis, ``expert`` (:data:`EXPERT_AXIS`), last in
the mesh and only when given (``--mesh data=2,expert=4``): the experts of every MoE layer are
split over it (expert parallelism, :class:`models.moe.ExpertParallel`: tokens go to their experts'
devices and back with ``all_to_all``), and the batch is split over it too, as over ``data``.

Where each tensor dimension goes is decided in one place: :data:`LOGICAL_AXIS_RULES` maps
logical axis names to mesh axes, :data:`PARAM_LOGICAL_AXES` names the dimensions of every
parameter of :class:`models.GPT`, and :data:`ACTIVATION_AXES` / :data:`BATCH_AXES` name those
of the residual stream and the token batches.

Related modules: :mod:`train.sharded_steps` creates sharded state and compiles the sharded
steps (and reads their per-device memory); :mod:`train.distributed` joins a multi-process run.
See docs/multiprocess.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

#: The mesh axes, in mesh order (outermost first).
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "sequence")

#: The mesh axis over which parameters and optimizer state are split (ZeRO-3).
FSDP_AXIS = "fsdp"

#: The mesh axis of tensor parallelism: attention heads, MLP hidden units and the vocabulary.
TENSOR_AXIS = "tensor"

#: The mesh axis the experts of an MoE model are split over (expert parallelism). Not one of
#: :data:`MESH_AXES`: a mesh has it, last, only when a spec gives it (:func:`parse_mesh`).
EXPERT_AXIS = "expert"

#: Every axis a mesh spec may give: :data:`MESH_AXES`, then :data:`EXPERT_AXIS`.
ALL_MESH_AXES: tuple[str, ...] = MESH_AXES + (EXPERT_AXIS,)

#: Logical axis name -> the mesh axes that dimension is split over (in order). The one table of
#: where every parameter and activation dimension goes; ``()`` means replicated. The ``fsdp`` axis
#: is not listed for parameters: it goes to each tensor's largest free dimension that it divides
#: (see :func:`param_partition_spec`), except dimensions in :data:`FSDP_EXCLUDED`.
LOGICAL_AXIS_RULES: dict[str, tuple[str, ...]] = {
    # activations and batches
    "act_batch": ("data", "fsdp", EXPERT_AXIS),
    "act_seq": ("sequence",),
    "act_embed": (),
    "act_hidden": (TENSOR_AXIS,),  # the attention context and MLP hidden units the output projections contract
    # parameters
    "layers": (),  # the stacked-layer axis that lax.scan slices: never split
    "vocab": ("tensor",),  # the output head's vocabulary dimension
    "table_vocab": (),  # the embedding table's rows: a gather from rows split over tensor would be replicated
    "embed": (),
    "heads": ("tensor",),  # n_heads * head_dim of the q/k/v projections and the output projection's input
    "mlp": ("tensor",),
    "positions": (),
    "experts": (EXPERT_AXIS,),  # an MoE layer's expert dimension
    "router_experts": (),  # the router's output: every device routes its tokens over all experts
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
    (("moe", "router"), ("embed", "router_experts")),
    (("moe", "w_gate"), ("experts", "embed", "mlp")),
    (("moe", "w_up"), ("experts", "embed", "mlp")),
    (("moe", "w_out"), ("experts", "mlp", "embed")),
    (("scale",), ("embed",)),
    (("bias",), ("embed",)),  # LayerNorm bias (the Linear biases above have longer suffixes)
    (("head", "kernel"), ("embed", "vocab")),
    (("head", "bias"), ("vocab",)),
)

#: Logical axes of the residual stream ``[batch, seq, d_model]`` between sublayers.
ACTIVATION_AXES: tuple[str, ...] = ("act_batch", "act_seq", "act_embed")

#: Logical axes of what a block's output projections contract ``[batch, seq, features]``.
HIDDEN_AXES: tuple[str, ...] = ("act_batch", "act_seq", "act_hidden")

#: Logical axes of a token batch ``[batch, seq]``.
BATCH_AXES: tuple[str, ...] = ("act_batch", "act_seq")

_MESH_PART_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([^,=]*?)\s*$")


# ----------------------------------------------------------------------------- the mesh


def parse_mesh(text: str) -> dict[str, int]:
    """Parse a mesh spec such as ``"data=4,fsdp=2"`` into sizes for every axis of :data:`MESH_AXES`.

    Axes left out have size 1; order in the string does not matter. The ``expert`` axis
    (:data:`EXPERT_AXIS`) is in the result, last, only when the spec gives it.

    Args:
      text: comma-separated ``AXIS=SIZE`` parts; axes are ``data``, ``fsdp``, ``tensor``,
        ``sequence`` and ``expert``; sizes are positive integers.

    Returns:
      ``{"data": ..., "fsdp": ..., "tensor": ..., "sequence": ...}`` in :data:`MESH_AXES` order,
      then ``"expert"`` if given.

    Raises:
      ValueError: on an empty spec, a part that is not ``AXIS=SIZE``, an unknown or repeated
        axis, or a size that is not a positive integer.
    """
    valid = ", ".join(ALL_MESH_AXES)
    form = f"expected AXIS=SIZE[,AXIS=SIZE...] with AXIS one of {valid}, e.g. 'data=4,fsdp=2'"
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"empty mesh spec {text!r}; {form}")
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen: set[str] = set()
    for part in text.split(","):
        match = _MESH_PART_RE.match(part)
        if not match:
            raise ValueError(f"malformed mesh spec {text!r}: {part.strip()!r} is not AXIS=SIZE; {form}")
        axis, raw = match.groups()
        if axis not in ALL_MESH_AXES:
            raise ValueError(f"unknown mesh axis {axis!r} in {text!r}; valid axes: {valid}")
        if axis in seen:
            raise ValueError(f"mesh axis {axis!r} given twice in {text!r}")
        seen.add(axis)
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"mesh axis {axis!r} size must be a positive integer, got {raw!r} in {text!r}")
        sizes[axis] = int(raw)
    return sizes


def axis_size(mesh: Any, axis: str) -> int:
    """The size of ``axis`` in ``mesh`` (a :class:`Mesh` or :class:`jax.sharding.AbstractMesh`), 1 when
    the mesh lacks it (the ``expert`` axis of a mesh without expert parallelism)."""
    return int(mesh.shape.get(axis, 1))


def format_mesh(mesh: Mesh) -> str:
    """The spec string of ``mesh``'s axes larger than 1 (``"data=4,fsdp=2"``; ``"data=1"`` if none)."""
    parts = [f"{name}={size}" for name, size in mesh.shape.items() if size > 1]
    return ",".join(parts) or f"{MESH_AXES[0]}=1"


def device_count(n: int) -> str:
    """``"1 device"``, ``"8 devices"``: a mesh's size as the reports word it."""
    return f"{n} device" if n == 1 else f"{n} devices"


def make_mesh(sizes: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A :class:`jax.sharding.Mesh` with the four :data:`MESH_AXES` over ``devices``, and the
    ``expert`` axis last when ``sizes`` has it.

    Args:
      sizes: axis sizes, e.g. from :func:`parse_mesh` (missing axes have size 1).
      devices: the devices to lay out (default: ``jax.devices()``, every device of every process).

    Raises:
      ValueError: on an unknown axis, or if the sizes do not multiply to the number of devices
        (the message names the platform and, in a multi-process run, the processes).
    """
    unknown = [a for a in sizes if a not in ALL_MESH_AXES]
    if unknown:
        raise ValueError(f"unknown mesh axis {unknown[0]!r}; valid axes: {', '.join(ALL_MESH_AXES)}")
    devices = list(jax.devices() if devices is None else devices)
    axes = MESH_AXES + ((EXPERT_AXIS,) if EXPERT_AXIS in sizes else ())
    shape = tuple(int(sizes.get(a, 1)) for a in axes)
    if math.prod(shape) != len(devices):
        spec = ",".join(f"{a}={s}" for a, s in zip(axes, shape) if s > 1) or "all sizes 1"
        where = devices[0].platform
        processes = len({d.process_index for d in devices})
        if processes > 1:
            where += f", {processes} processes with {len(devices) // processes} each"
        available = f"only {len(devices)} is" if len(devices) == 1 else f"{len(devices)} are"
        if math.prod(shape) > len(devices) > 1:
            available = f"only {available}"
        simulate = ""
        if devices[0].platform == "cpu" and processes == 1 and math.prod(shape) > len(devices):
            # XLA:CPU gives one device unless told otherwise, when its backend starts.
            simulate = (
                f"; on a CPU, simulate {math.prod(shape)} devices by starting with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={math.prod(shape)}"
            )
        raise ValueError(
            f"mesh {spec} has {device_count(math.prod(shape))} but {available} available "
            f"({where}); the axis sizes must multiply to {len(devices)}{simulate}"
        )
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)


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
    return math.prod(axis_size(mesh, a) for a in LOGICAL_AXIS_RULES["act_batch"])


def check_batch(mesh: Mesh, batch_size: int, seq_len: int) -> None:
    """Check that a ``[batch_size, seq_len]`` batch splits evenly over ``mesh``.

    Raises:
      ValueError: if ``batch_size`` is not a multiple of ``data * fsdp`` (``* expert`` on a mesh
        with that axis) or ``seq_len`` not a multiple of ``sequence``; the message names the valid choices.
    """
    ways = data_parallel_size(mesh)
    if batch_size % ways:
        axes = [a for a in LOGICAL_AXIS_RULES["act_batch"] if a in mesh.shape]
        raise ValueError(
            f"batch size {batch_size} does not split over the mesh's {' x '.join(axes)} = "
            f"{' x '.join(str(mesh.shape[a]) for a in axes)} = {ways} devices; use a multiple of {ways}"
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
            size = axis_size(mesh, axis)
            if size > 1 and dim % (ways * size) == 0:
                axes.append(axis)
                ways *= size
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)


def rule_spec(logical: Sequence[str], mesh: Any) -> PartitionSpec:
    """The :class:`PartitionSpec` of :data:`LOGICAL_AXIS_RULES` for dimensions named ``logical``, with
    only the mesh axes ``mesh`` has (whatever their size, and whether or not they divide a shape)."""
    entries = []
    for name in logical:
        axes = tuple(a for a in LOGICAL_AXIS_RULES[name] if a in mesh.shape)
        entries.append(axes or None)
    return PartitionSpec(*entries)


def path_names(path) -> tuple[str, ...]:
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
    names = path_names(path)
    best: tuple[str, ...] | None = None
    best_len = 0
    for suffix, axes in PARAM_LOGICAL_AXES:
        if len(suffix) > best_len and names[-len(suffix) :] == suffix:
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
        free = [
            i
            for i, (name, entry) in enumerate(zip(logical, spec))
            if entry is None and name not in FSDP_EXCLUDED and shape[i] % fsdp == 0
        ]
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
    return jax.random.wrap_key_data(
        jax.make_array_from_callback(data.shape, replicated(mesh), lambda index: data[index])
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a ``[batch, seq]`` token batch: batch over ``data`` x ``fsdp``, seq over ``sequence``."""
    return NamedSharding(mesh, rule_spec(BATCH_AXES, mesh))


def _row_span(index: tuple, batch_size: int) -> tuple[int, int]:
    rows = index[0]
    return (rows.start or 0, batch_size if rows.stop is None else rows.stop)


def rows_held(spans: Sequence[tuple[int, int]]) -> slice:
    """The one contiguous range of batch rows that the ``(start, stop)`` row spans of some devices cover.

    Raises:
      ValueError: if there are no spans or they leave a gap.
    """
    spans = sorted(set(spans))
    if not spans:
        raise ValueError("this process holds no device of the mesh")
    stop = spans[0][0]
    for lo, hi in spans:
        if lo > stop:
            raise ValueError(
                f"this process's devices hold batch rows with a gap ({stop} to {lo - 1} missing); "
                "order the mesh so each process's devices take one contiguous block of the batch"
            )
        stop = max(stop, hi)
    return slice(spans[0][0], stop)


def process_batch_rows(mesh: Mesh, batch_size: int) -> slice:
    """The rows of a global ``[batch_size, seq]`` batch that this process's devices hold.

    In a multi-process run each process loads and places only these rows (see :func:`shard_batch`);
    in a single process (or when the batch is not split over processes) they are all rows.

    Raises:
      ValueError: if the batch does not split over the mesh, or this process's rows are not contiguous.
    """
    check_batch(mesh, batch_size, mesh.shape["sequence"])
    shape = (batch_size, mesh.shape["sequence"])
    indices = batch_sharding(mesh).addressable_devices_indices_map(shape).values()
    return rows_held([_row_span(index, batch_size) for index in indices])


def shard_batch(mesh: Mesh, rows, batch_size: int | None = None) -> jax.Array:
    """The global ``[batch_size, seq]`` array on ``mesh`` (split per :func:`batch_sharding`) from this process's rows.

    Args:
      mesh: the device mesh.
      rows: this process's rows of the batch, ``batch[process_batch_rows(mesh, batch_size)]``;
        each device's shard is cut from them, so no process needs the other processes' rows.
      batch_size: the global batch size (default: ``len(rows)``, a process holding every row).

    Raises:
      ValueError: if the batch does not split evenly (see :func:`check_batch`) or ``rows`` is
        not this process's share of it.
    """
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ValueError(f"expected a [batch, seq] token array, got shape {rows.shape}")
    batch_size = rows.shape[0] if batch_size is None else int(batch_size)
    check_batch(mesh, batch_size, rows.shape[1])
    own = process_batch_rows(mesh, batch_size)
    if rows.shape[0] != own.stop - own.start:
        raise ValueError(
            f"this process holds rows {own.start} to {own.stop - 1} of a batch of {batch_size} "
            f"({own.stop - own.start} rows), got {rows.shape[0]} rows"
        )

    def piece(index):
        lo, hi = _row_span(index, batch_size)
        return rows[(slice(lo - own.start, hi - own.start),) + tuple(index[1:])]

    return jax.make_array_from_callback((batch_size, rows.shape[1]), batch_sharding(mesh), piece)


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """``x -> with_sharding_constraint(x, ...)`` for an activation ``[batch, seq, features]``.

    Hashable (it is a static attribute of the model's graph definition). Batch over ``data`` x
    ``fsdp``, sequence over ``sequence`` (sequence parallelism); the features as ``logical``
    says: the residual stream's replicated (:data:`ACTIVATION_AXES`, the default), or what the
    blocks' output projections contract split over ``tensor`` (:data:`HIDDEN_AXES`: the placement
    XLA gives them under tensor parallelism anyway, written in the program, so that those
    projections are row-parallel in the traced program and ``keep_collectives=true`` keeps their
    all-reduced outputs).
    """

    mesh: Mesh
    logical: tuple[str, ...] = ACTIVATION_AXES

    @property
    def sharding(self) -> NamedSharding:
        """The :class:`NamedSharding` the activation is constrained to."""
        return NamedSharding(self.mesh, rule_spec(self.logical, self.mesh))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Constrain ``x`` (rank 3) to :attr:`sharding`, dropping mesh axes that do not divide its dims."""
        spec = logical_to_spec(self.logical, x.shape, self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def token_axes(mesh: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(batch axes, sequence axes)``: the mesh axes ``mesh`` has that split the tokens
    (:data:`LOGICAL_AXIS_RULES`'s ``act_batch`` and ``act_seq``)."""
    return tuple(a for a in LOGICAL_AXIS_RULES["act_batch"] if a in mesh.shape), tuple(
        a for a in LOGICAL_AXIS_RULES["act_seq"] if a in mesh.shape
    )
