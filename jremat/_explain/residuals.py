"""Saved residuals: every value a function keeps for its backward pass, traced (nothing compiled).

:func:`saved_residuals_report` traces ``jax.vjp`` of a function and lists every value kept for
the backward pass (shape, dtype, bytes, tensor name or producing primitive, source line),
classified as activations, parameter-derived values, PRNG keys or constants.

On a mesh each residual also has the bytes one device holds: its shard's, from the sharding its
aval carries where every mesh axis is explicit, else from the output sharding XLA's SPMD
partitioner gives it in the compiled forward pass (``jax.vjp``'s residuals as outputs; one
compile, nothing runs).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jremat._engine import active as _active_engine
from jremat._engine import jax_compat as _jax_compat
from jremat._engine import jaxpr as _jaxpr
from jremat._engine import tags as _tags
from jremat._measure import shards as _shards
from jremat._measure.mesh import mesh_devices
from jremat._program import program as _program

#: Residual kinds (see :class:`SavedResidual`).
ACTIVATION = "activation"
PARAMETER = "parameter"
RNG_KEY = "rng_key"
CONSTANT = "constant"
RESIDUAL_KINDS = (ACTIVATION, PARAMETER, RNG_KEY, CONSTANT)

#: Primitives that return their input unchanged; a residual is looked through them.
IDENTITY_PRIMITIVES = _jaxpr.IDENTITY_PRIMITIVES


@dataclasses.dataclass(frozen=True)
class SavedResidual:
    """One value kept for the backward pass.

    Attributes:
      shape: its shape.
      dtype: its dtype name.
      bytes: its size (global: the whole value, all devices together).
      kind: :data:`ACTIVATION` (depends on a non-parameter argument: data, keys),
        :data:`PARAMETER` (depends only on parameter arguments, e.g. a bf16 copy of a weight),
        :data:`RNG_KEY` (a PRNG key) or :data:`CONSTANT` (depends on no argument, e.g. a causal
        mask or a literal).
      name: the ``checkpoint_name`` the value carries (looked up through identity and
        shape-only ops), or ``None``.
      primitive: the primitive that produced it, or ``argument`` / ``constant`` / ``literal``.
      source: ``file:line (function)`` of the producing equation, or the argument's path.
      internal_tag: jremat's internal tag (``jremat3/17``, :mod:`jremat._engine.tags`) if a
        :class:`jremat.PlanPolicy` or a policy callback under ``jax_remat3`` chose it, else
        ``None`` (also readable as ``plan_tag``).
      layer_stacked: whether it is a stacked ``[n_layers, ...]`` output of a loop over layers.
      device_bytes: the bytes one device holds (its shard; :attr:`bytes` off a mesh or replicated).
    """

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    kind: str
    name: str | None
    primitive: str
    source: str
    internal_tag: str | None = None
    layer_stacked: bool = False
    device_bytes: int | None = None

    def __post_init__(self):
        if self.device_bytes is None:
            object.__setattr__(self, "device_bytes", self.bytes)

    @property
    def plan_tag(self) -> str | None:
        """The same as :attr:`internal_tag` (a compatible alias)."""
        return self.internal_tag

    @property
    def label(self) -> str:
        """The tensor name if tagged, else ``primitive:dtype`` (``lt:bool`` is a dropout mask)."""
        return self.name if self.name else f"{self.primitive}:{self.dtype}"


@dataclasses.dataclass(frozen=True)
class ResidualGroup:
    """Residuals of one kind sharing a label, summed.

    Attributes:
      label: tensor name or producing primitive.
      kind: the residuals' kind.
      count: how many residuals.
      bytes: their total size (global).
      bytes_per_layer: ``bytes / n_layers``.
      shapes: the distinct shapes, in first-seen order.
      device_bytes: their total size on one device.
    """

    label: str
    kind: str
    count: int
    bytes: int
    bytes_per_layer: float
    shapes: tuple[tuple[int, ...], ...]
    device_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class ResidualsReport:
    """Every value a function keeps for its backward pass.

    Attributes:
      residuals: one :class:`SavedResidual` per distinct saved value.
      n_layers: how many layers the analysed function spans (1 for one block, ``L`` for the
        whole model); per-layer figures divide by it.
      devices: the devices the arguments' shardings span. :attr:`SavedResidual.bytes` is the
        traced (global) value's size, :attr:`SavedResidual.device_bytes` one device's share; the
        ``per_device`` figures and :meth:`table` on a mesh use the latter.
    """

    residuals: tuple[SavedResidual, ...]
    n_layers: int = 1
    devices: int = 1

    def bytes_of(self, kind: str, per_device: bool = False) -> int:
        """Total bytes of the residuals of ``kind``: global, or one device's with ``per_device``.

        Raises:
          ValueError: if ``kind`` is not one of :data:`RESIDUAL_KINDS`.
        """
        if kind not in RESIDUAL_KINDS:
            raise ValueError(f"unknown residual kind {kind!r}; valid kinds: {', '.join(RESIDUAL_KINDS)}")
        return sum((r.device_bytes or 0) if per_device else r.bytes for r in self.residuals if r.kind == kind)

    @property
    def saved_device_bytes(self) -> int:
        """:attr:`saved_bytes` on one device (its shards)."""
        return self.bytes_of(ACTIVATION, per_device=True)

    @property
    def saved_bytes(self) -> int:
        """Bytes of saved activations (what remat trades for recomputation)."""
        return self.bytes_of(ACTIVATION)

    @property
    def saved_bytes_per_layer(self) -> float:
        """:attr:`saved_bytes` divided by :attr:`n_layers`."""
        return self.saved_bytes / self.n_layers

    @property
    def total_bytes(self) -> int:
        """Bytes of every residual, all kinds."""
        return sum(r.bytes for r in self.residuals)

    @property
    def computed_bytes(self) -> int:
        """Bytes of non-constant residuals that are not the function's own arguments.

        Arguments are already counted as the program's inputs, and constant-derived values
        (broadcast masks, literals) are usually fused away or hoisted by XLA; this is what the
        forward pass adds to memory for the backward pass.
        """
        return sum(r.bytes for r in self.residuals if r.primitive != "argument" and r.kind != CONSTANT)

    @property
    def computed_device_bytes(self) -> int:
        """:attr:`computed_bytes` on one device (its shards): what the forward pass adds to each
        device's memory for the backward pass."""
        return sum(r.device_bytes or 0 for r in self.residuals if r.primitive != "argument" and r.kind != CONSTANT)

    @property
    def layer_stacked_bytes(self) -> int:
        """Bytes of activations that are stacked ``[n_layers, ...]`` outputs of a layer loop."""
        return sum(r.bytes for r in self.residuals if r.layer_stacked and r.kind == ACTIVATION)

    def groups(self, kinds: Sequence[str] = (ACTIVATION,)) -> tuple[ResidualGroup, ...]:
        """Residuals of ``kinds`` grouped by (kind, label), largest first.

        Raises:
          ValueError: on an unknown kind.
        """
        for kind in kinds:
            if kind not in RESIDUAL_KINDS:
                raise ValueError(f"unknown residual kind {kind!r}; valid kinds: {', '.join(RESIDUAL_KINDS)}")
        acc: dict = collections.OrderedDict()
        for r in self.residuals:
            if r.kind not in kinds:
                continue
            entry = acc.setdefault((r.kind, r.label), [0, 0, [], 0])
            entry[0] += 1
            entry[1] += r.bytes
            entry[3] += r.device_bytes
            if r.shape not in entry[2]:
                entry[2].append(r.shape)
        groups = [
            ResidualGroup(label, kind, count, nbytes, nbytes / self.n_layers, tuple(shapes), device_bytes)
            for (kind, label), (count, nbytes, shapes, device_bytes) in acc.items()
        ]
        return tuple(sorted(groups, key=lambda g: -g.bytes))

    def table(self, kinds: Sequence[str] = RESIDUAL_KINDS) -> str:
        """A printable table: one line per residual group, then totals per kind.

        On a mesh the bytes are one device's (its shards) and a column gives the global bytes.
        """
        mesh = self.devices > 1
        header = (
            f"{'kind':<10} {'label':<28} {'count':>5} {'bytes/device' if mesh else 'bytes':>14} {'bytes/layer':>14}"
        )
        lines = [header + (f" {'global bytes':>14}" if mesh else "") + "  shapes"]
        for g in self.groups(kinds):
            shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in g.shapes[:3])
            nbytes = g.device_bytes if mesh else g.bytes
            row = f"{g.kind:<10} {g.label:<28} {g.count:>5} {nbytes:>14,} {nbytes / self.n_layers:>14,.0f}"
            lines.append(row + (f" {g.bytes:>14,}" if mesh else "") + f"  {shapes}")
        for kind in kinds:
            nbytes = self.bytes_of(kind, per_device=mesh)
            line = f"total {kind}: {nbytes:,} bytes{' per device' if mesh else ''} ({nbytes / self.n_layers:,.0f} per layer)"
            lines.append(line + (f", {self.bytes_of(kind):,} global" if mesh else ""))
        if mesh:
            lines.append(
                f"bytes are per device (each device's shard on {self.devices} devices); global bytes are the "
                "unsharded values, all devices together"
            )
        return "\n".join(lines)


def _summarize_source(eqn) -> str:
    if _jax_compat.source_summarize is None:  # pragma: no cover
        return "unknown"
    try:
        return _jax_compat.source_summarize(eqn.source_info) or "inside a JAX library function"
    except Exception:
        return "unknown"


def _dtype_name(aval) -> str:
    dtype = getattr(aval, "dtype", None)
    return str(dtype) if dtype is not None else "token"


def _literal(aval) -> SavedResidual:
    """A saved literal (a constant the backward pass reads)."""
    shape = tuple(getattr(aval, "shape", ()))
    return SavedResidual(shape, _dtype_name(aval), _jaxpr.aval_bytes(aval), CONSTANT, None, "literal", "a literal")


def _primitive_name(eqn) -> str:
    """The equation's primitive name, with JAX remat3's ``checkpoint_name`` read as ``name``."""
    return _jaxpr.NAME if _jaxpr.any_name_tag(eqn) is not None else eqn.primitive.name


def _vjp_residual_jaxpr(fn, args, kwargs):
    leaves, in_tree = jax.tree.flatten((args, kwargs))

    def flat_fn(*flat):
        a, kw = jax.tree.unflatten(in_tree, flat)
        return fn(*a, **kw)

    def forward(*flat):
        return jax.vjp(flat_fn, *flat)

    closed, out_shape = jax.make_jaxpr(forward, return_shape=True)(*leaves)
    n_res = len(jax.tree.leaves(out_shape[1]))
    # Inline nested jit calls so that each residual's producer is a real primitive, and values a
    # jit merely forwards become the same variable (no double counting).
    inlined = _program.inline_calls(closed, leaves)
    jaxpr = inlined.jaxpr
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - n_res :]
    read = _residuals_the_backward_reads(out_shape)
    fractions = _shards.device_fractions(forward, leaves, jax.tree.leaves(out_shape[1]))
    kept = [i for i, r in enumerate(read) if r]
    return jaxpr, [res_vars[i] for i in kept], [fractions[i] for i in kept], leaves


def _residuals_the_backward_reads(out_shape) -> list[bool]:
    """Which residuals of ``jax.vjp``'s pullback its backward pass reads once dead code is gone.

    Under the classic engine every residual is read. Under remat3 a saved value's recomputation
    stays in the pullback as an input that a ``custom_jvp_call`` ignores, and the residuals only
    it reads are removed by XLA: they are not kept.
    """
    primal_shape, pullback_shape = out_shape
    res_shapes = jax.tree.leaves(pullback_shape)
    if _active_engine.active_engine() != _active_engine.REMAT3:
        return [True] * len(res_shapes)
    pullback_tree, primal_tree = jax.tree.structure(pullback_shape), jax.tree.structure(primal_shape)
    primals = jax.tree.leaves(primal_shape)
    inexact = [jnp.issubdtype(p.dtype, jnp.inexact) for p in primals]

    def backward(res, float_cts):
        # Integer and boolean outputs take float0 cotangents, which are constants here.
        it = iter(float_cts)
        cts = [next(it) if f else np.zeros(p.shape, jax.dtypes.float0) for p, f in zip(primals, inexact)]
        return jax.tree.unflatten(pullback_tree, res)(jax.tree.unflatten(primal_tree, cts))

    backward_jaxpr = jax.make_jaxpr(backward)(res_shapes, [p for p, f in zip(primals, inexact) if f])
    return _jaxpr.used_inputs(backward_jaxpr)[: len(res_shapes)]


def _leaf_paths(args, kwargs) -> list[str]:
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        paths.append(jax.tree_util.keystr(path))
    return paths


def _argnum_of_leaves(args, kwargs) -> list[int | str]:
    owners: list[int | str] = []
    for i, a in enumerate(args):
        owners.extend([i] * len(jax.tree.leaves(a)))
    for k in kwargs:
        owners.extend([k] * len(jax.tree.leaves(kwargs[k])))
    return owners


_PARAM, _DATA, _KEY = 1, 2, 4


def _in_masks(eqn, deps) -> list[int]:
    return [0 if isinstance(v, jcore.Literal) else deps.get(v, 0) for v in eqn.invars]


def _propagate_deps(jaxpr, deps: dict) -> None:
    """Fill ``deps[v]`` (bit set of argument kinds) for every variable of ``jaxpr``.

    Looks inside ``scan`` bodies (carry to a fixed point) and call-like equations so that,
    e.g., a stacked bf16 weight copy made inside a layer loop stays parameter-derived.
    """
    for eqn in jaxpr.eqns:
        masks = _in_masks(eqn, deps)
        name = eqn.primitive.name
        outs = None
        if name == _jaxpr.SCAN:
            body = eqn.params["jaxpr"].jaxpr
            n_consts, n_carry = _jax_compat.scan_counts(eqn)
            carry = masks[n_consts : n_consts + n_carry]
            for _ in range(4):
                inner = dict(zip(body.invars, masks[:n_consts] + carry + masks[n_consts + n_carry :]))
                _propagate_deps(body, inner)
                body_outs = [0 if isinstance(v, jcore.Literal) else inner.get(v, 0) for v in body.outvars]
                new_carry = [a | b for a, b in zip(carry, body_outs[:n_carry])]
                if new_carry == carry:
                    break
                carry = new_carry
            outs = carry + body_outs[n_carry:]
        else:
            subs = _jaxpr.subjaxprs(eqn)
            if len(subs) == 1 and len(subs[0].invars) == len(masks) and len(subs[0].outvars) == len(eqn.outvars):
                inner = dict(zip(subs[0].invars, masks))
                _propagate_deps(subs[0], inner)
                outs = [0 if isinstance(v, jcore.Literal) else inner.get(v, 0) for v in subs[0].outvars]
        if outs is None or len(outs) != len(eqn.outvars):
            union = 0
            for m in masks:
                union |= m
            outs = [union] * len(eqn.outvars)
        for v, m in zip(eqn.outvars, outs):
            deps[v] = m


def saved_residuals_report(
    fn: Callable, *args, n_layers: int = 1, param_argnums: Iterable[int | str] = (), **kwargs
) -> ResidualsReport:
    """List every value ``fn`` keeps for its backward pass; nothing runs.

    Traces ``jax.vjp(fn, *args, **kwargs)`` (like ``jax.ad_checkpoint.print_saved_residuals``)
    and describes each residual. Values that several variables share (a ``checkpoint_name``
    output and its input, a value a nested ``jit`` forwards) count once. Off a mesh, and on a
    mesh whose axes are all explicit, nothing is compiled; on a mesh with auto axes the forward
    pass is compiled once to read the shardings XLA gives the residuals (their per-device bytes).

    Classification: a residual depending on any argument outside ``param_argnums`` is an
    *activation* (dropout masks count, as in Megatron-LM's accounting: they depend on the key);
    one depending only on ``param_argnums`` arguments is *parameter*-derived (weights, their
    low-precision copies); PRNG keys are *rng_key*; values depending on no argument are
    *constant*. Pass PRNG keys as arguments, not as constants created inside ``fn``, or the
    masks derived from them count as constants.

    Under ``lax.scan`` over layers, per-layer residuals are stacked ``[n_layers, ...]`` scan
    outputs and their names are lost; they are marked ``layer_stacked``. For named per-layer
    figures analyse one layer's function instead (``n_layers=1``) and multiply.

    Args:
      fn: a function of pytrees of arrays; arguments may be :class:`jax.ShapeDtypeStruct`.
      *args: positional arguments.
      n_layers: how many layers ``fn`` spans; per-layer figures divide by it. Must be positive.
      param_argnums: positions (or keyword names) of the arguments holding parameters.
      **kwargs: keyword arguments.

    Returns:
      A :class:`ResidualsReport`.

    Raises:
      ValueError: if ``n_layers`` is not positive or a ``param_argnums`` entry names no argument.
    """
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers <= 0:
        raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
    param_argnums = tuple(param_argnums)
    for a in param_argnums:
        if not ((isinstance(a, int) and 0 <= a < len(args)) or (isinstance(a, str) and a in kwargs)):
            raise ValueError(
                f"param_argnums entry {a!r} names no argument (fn got {len(args)} positional "
                f"arguments and keywords {sorted(kwargs)})"
            )
    jaxpr, res_vars, fractions, leaves = _vjp_residual_jaxpr(fn, args, kwargs)
    owners = _argnum_of_leaves(args, kwargs)
    paths = _leaf_paths(args, kwargs)

    producer: dict = {}
    consumers: dict = collections.defaultdict(list)
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            producer[v] = eqn
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                consumers[v].append(eqn)

    # Which kinds of argument each variable depends on (bit set), by forward propagation.
    deps: dict = {}
    invar_index = {}
    for i, v in enumerate(jaxpr.invars):
        invar_index[v] = i
        if _jaxpr.is_key(v.aval):
            deps[v] = _KEY
        elif owners[i] in param_argnums:
            deps[v] = _PARAM
        else:
            deps[v] = _DATA
    for v in jaxpr.constvars:
        deps[v] = 0
    _propagate_deps(jaxpr, deps)

    def canonical(v):
        names = []
        while (
            not isinstance(v, jcore.Literal) and v in producer and _primitive_name(producer[v]) in IDENTITY_PRIMITIVES
        ):
            eqn = producer[v]
            if (tag := _jaxpr.any_name_tag(eqn)) is not None:
                names.append(tag)
            v = eqn.invars[0]
        return v, names

    def forward_names(v, depth=8):
        found, frontier, seen = [], [v], set()
        for _ in range(depth):
            nxt: list[jcore.Var] = []
            for u in frontier:
                for eqn in consumers.get(u, ()):
                    if id(eqn) in seen:
                        continue
                    seen.add(id(eqn))
                    prim = _primitive_name(eqn)
                    if (tag := _jaxpr.any_name_tag(eqn)) is not None:
                        found.append(tag)
                    if prim in IDENTITY_PRIMITIVES or prim in _jaxpr.SHAPE_ONLY_PRIMITIVES:
                        nxt.extend(o for o in eqn.outvars if not isinstance(o, jcore.DropVar))
            user = _tags.user_names(found)
            if user:
                return user
            frontier = nxt
        return found

    residuals = []
    seen_vars = set()
    for v, fraction in zip(res_vars, fractions):
        if isinstance(v, jcore.Literal):
            aval = jax.typeof(v.val) if not hasattr(v, "aval") else v.aval
            residuals.append(_literal(aval))
            continue
        base, chain_names = canonical(v)
        if isinstance(base, jcore.Literal):
            aval = base.aval
            residuals.append(_literal(aval))
            continue
        if base in seen_vars:
            continue
        seen_vars.add(base)
        aval = base.aval
        nbytes = _jaxpr.aval_bytes(aval)
        names = chain_names + [n for n in forward_names(base) if n not in chain_names]
        user_names = _tags.user_names(names)
        internal_tags = [n for n in names if _tags.is_internal(n)]
        name = user_names[0] if user_names else None
        internal_tag = internal_tags[0] if internal_tags else None
        mask = deps.get(base, 0)
        stacked = False
        if base in invar_index:
            primitive, source = "argument", f"argument {paths[invar_index[base]]}"
        elif base in producer:
            eqn = producer[base]
            primitive, source = eqn.primitive.name, _summarize_source(eqn)
            if _jaxpr.is_scan(eqn):
                length = eqn.params.get("length")
                stacked = bool(length == n_layers and aval.shape and aval.shape[0] == n_layers and n_layers > 1)
        else:
            primitive, source = "constant", "a constant"
        if _jaxpr.is_key(aval):
            kind = RNG_KEY
        elif mask & (_DATA | _KEY):
            kind = ACTIVATION
        elif mask & _PARAM:
            kind = PARAMETER
        else:
            kind = CONSTANT
        residuals.append(
            SavedResidual(
                tuple(aval.shape),
                _dtype_name(aval),
                nbytes,
                kind,
                name,
                primitive,
                source,
                internal_tag,
                stacked,
                round(nbytes * fraction),
            )
        )
    return ResidualsReport(tuple(residuals), n_layers, mesh_devices((args, kwargs)))


__all__ = [
    "ACTIVATION",
    "CONSTANT",
    "IDENTITY_PRIMITIVES",
    "PARAMETER",
    "RESIDUAL_KINDS",
    "RNG_KEY",
    "ResidualGroup",
    "ResidualsReport",
    "SavedResidual",
    "saved_residuals_report",
]
