"""Memory analysis: compiled memory figures, saved-residual breakdowns and recompute FLOPs.

Three views of what a rematerialization policy costs and saves, all model-agnostic:

* :func:`memory_report` compiles a function (typically ``jax.jit(jax.grad(loss))`` or a train
  step) and reads XLA's buffer assignment: argument, output, alias, temp and generated-code
  bytes and a peak estimate. Nothing is executed; arguments may be
  :class:`jax.ShapeDtypeStruct`.
* :func:`saved_residuals_report` traces ``jax.vjp`` of a function and lists every value kept
  for the backward pass (shape, dtype, bytes, tensor name or producing primitive, source line),
  classified as activations, parameter-derived values, PRNG keys or constants. Nothing is
  compiled.
* :func:`program_flops` prices a traced function with the cost model of
  :func:`jremat.program.equation_flops` (loop bodies multiplied by their trip count), so the
  FLOPs a policy adds by recomputation are ``program_flops(grad under policy) -
  program_flops(grad without remat)``.

:func:`live_memory` runs a function once and reads the device's allocator statistics where the
backend has them (GPU, TPU); :func:`diagnose_remat` says when compiled temp memory did not follow
the saved residuals, and why that usually happens.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Callable, Iterable, Sequence

import jax
from jax.extend import core as jcore

from jremat import _jax_compat
from jremat import engine as _engine
from jremat import program as _program
from jremat import xla_flags as _xla_flags

#: How ``MemoryReport.peak_bytes`` was obtained.
PEAK_FROM_BACKEND = "backend peak_memory_in_bytes"
PEAK_FROM_SUM = "argument + output - alias + temp"
PEAK_UNAVAILABLE = "unavailable"

#: Residual kinds (see :class:`SavedResidual`).
ACTIVATION = "activation"
PARAMETER = "parameter"
RNG_KEY = "rng_key"
CONSTANT = "constant"
RESIDUAL_KINDS = (ACTIVATION, PARAMETER, RNG_KEY, CONSTANT)

#: Primitives that return their input unchanged; a residual is looked through them.
IDENTITY_PRIMITIVES = frozenset({"name", "reduce_precision", "copy", "copy_p"})

#: Names that :class:`jremat.policy.PlanPolicy` gives the values it chose (``jremat3/17``), and
#: that :func:`jremat.engine.checkpoint` gives the values a callback keeps under jax_remat3
#: (``jremat_cb2/5``).
PLAN_TAG_RE = re.compile(r"^jremat(_cb)?\d+/\d+(\.\d+)?$")

_LOOP_PRIMITIVES = ("scan",)


# ---------------------------------------------------------------------------------------------
# Compiled memory
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """XLA's memory figures for one compiled program.

    Attributes:
      available: whether the backend reported usable figures; when False every byte field is
        ``None`` and :attr:`notes` says why.
      platform: the backend platform (``cpu``, ``gpu``, ``tpu``).
      argument_bytes: bytes of the program's inputs.
      output_bytes: bytes of its outputs.
      alias_bytes: bytes of outputs that reuse (donated) input buffers.
      temp_bytes: bytes of XLA's temporary buffers (activations, residuals, workspace).
      generated_code_bytes: bytes of generated code.
      peak_bytes: the peak estimate (see :attr:`peak_source`).
      peak_source: :data:`PEAK_FROM_BACKEND`, :data:`PEAK_FROM_SUM` or :data:`PEAK_UNAVAILABLE`.
      notes: caveats, e.g. why the backend's own peak was not used.
    """

    available: bool
    platform: str
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    generated_code_bytes: int | None
    peak_bytes: int | None
    peak_source: str
    notes: tuple[str, ...] = ()

    @property
    def summed_peak_bytes(self) -> int | None:
        """``argument + output - alias + temp`` (``None`` when unavailable)."""
        if not self.available:
            return None
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def format_bytes(n) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``"1.50 GiB"``); ``"n/a"`` for ``None`` or ``""``."""
    if n is None or n == "":
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _stat(stats, name: str) -> int | None:
    value = getattr(stats, name, None)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def compiled_memory_report(compiled, *, platform: str | None = None) -> MemoryReport:
    """Read a compiled executable's ``memory_analysis()`` into a :class:`MemoryReport`.

    The peak is the backend's ``peak_memory_in_bytes`` when that field is filled and at least
    the temp size, except on XLA:CPU, which fills it with argument + output only; otherwise
    ``argument + output - alias + temp``. Backends that return ``None`` or all zeros (jax issue
    #18954) give ``available=False`` rather than a report of 0 bytes.

    Args:
      compiled: a ``jax.stages.Compiled`` (from ``jax.jit(f).lower(...).compile()``).
      platform: the backend name for the report; defaults to the default backend's.
    """
    platform = platform or jax.default_backend()
    try:
        stats = compiled.memory_analysis()
    except Exception as err:  # noqa: BLE001 - backends raise various errors for "unsupported"
        stats, error = None, f"memory_analysis() raised {type(err).__name__}: {err}"
    else:
        error = "memory_analysis() returned None"
    if stats is None:
        return MemoryReport(False, platform, None, None, None, None, None, None, PEAK_UNAVAILABLE,
                            (f"{platform}: {error}; no compiled memory figures (see jax issue #18954)",))
    fields = {
        "argument_bytes": _stat(stats, "argument_size_in_bytes"),
        "output_bytes": _stat(stats, "output_size_in_bytes"),
        "alias_bytes": _stat(stats, "alias_size_in_bytes"),
        "temp_bytes": _stat(stats, "temp_size_in_bytes"),
        "generated_code_bytes": _stat(stats, "generated_code_size_in_bytes"),
    }
    core = [fields[k] for k in ("argument_bytes", "output_bytes", "temp_bytes")]
    if any(v is None for v in core) or not any(core):
        return MemoryReport(False, platform, None, None, None, None, None, None, PEAK_UNAVAILABLE,
                            (f"{platform}: memory_analysis() reported zero or missing argument, output "
                             "and temp sizes, which means the backend does not fill them (jax issue "
                             "#18954), not that the program needs no memory",))
    fields["alias_bytes"] = fields["alias_bytes"] or 0
    fields["generated_code_bytes"] = fields["generated_code_bytes"] or 0
    summed = fields["argument_bytes"] + fields["output_bytes"] - fields["alias_bytes"] + fields["temp_bytes"]
    backend_peak = _stat(stats, "peak_memory_in_bytes")
    notes = []
    # XLA:CPU fills peak_memory_in_bytes with argument + output only; never trust it there,
    # even when it happens to exceed the temp size (it would make policies look equal).
    if backend_peak and platform != "cpu" and backend_peak >= fields["temp_bytes"]:
        peak, source = backend_peak, PEAK_FROM_BACKEND
    else:
        peak, source = summed, PEAK_FROM_SUM
        if backend_peak:
            notes.append(
                f"{platform}: the backend's peak_memory_in_bytes leaves temp buffers out (XLA:CPU "
                f"reports argument + output only); using {PEAK_FROM_SUM}"
            )
        else:
            notes.append(f"{platform}: backend does not report peak_memory_in_bytes; using {PEAK_FROM_SUM}")
    return MemoryReport(True, platform, peak_bytes=peak, peak_source=source, notes=tuple(notes), **fields)


def memory_report(fn: Callable, *args, compiler_options: dict | None = None, **kwargs) -> MemoryReport:
    """Compile ``fn(*args, **kwargs)`` (nothing runs) and report XLA's memory figures.

    Args:
      fn: a function of pytrees of arrays, jitted or not (it is wrapped in ``jax.jit`` if it has
        no ``lower`` method). Typically ``jax.grad(loss)`` or a whole train step.
      *args: arrays or :class:`jax.ShapeDtypeStruct` (shapes suffice).
      compiler_options: XLA options to compile with; ``None`` means
        :func:`jremat.xla_flags.compiler_options` (what :func:`jremat.jit` uses), ``{}`` plain
        ``jax.jit``.
      **kwargs: keyword arguments, likewise.

    Returns:
      A :class:`MemoryReport`; ``available`` is False (with a note) on backends that do not
      report memory.

    Raises:
      TypeError: if ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"memory_report needs a callable, got {type(fn).__name__}")
    lowerable = fn if hasattr(fn, "lower") else jax.jit(fn)
    options = _xla_flags.compiler_options() if compiler_options is None else compiler_options
    compiled = lowerable.lower(*args, **kwargs).compile(options or None)
    report = compiled_memory_report(compiled)
    if options.get("xla_disable_hlo_passes") == _xla_flags.CPU_HOISTING_PASS:
        report = dataclasses.replace(report, notes=report.notes + (
            f"compiled as jremat.jit compiles: XLA pass {_xla_flags.CPU_HOISTING_PASS} off; plain jax.jit "
            "can keep an extra f32 copy of every scan-stacked bf16 residual (see jremat.xla_flags)",))
    return report


# ---------------------------------------------------------------------------------------------
# Saved residuals
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SavedResidual:
    """One value kept for the backward pass.

    Attributes:
      shape: its shape.
      dtype: its dtype name.
      bytes: its size.
      kind: :data:`ACTIVATION` (depends on a non-parameter argument: data, keys),
        :data:`PARAMETER` (depends only on parameter arguments, e.g. a bf16 copy of a weight),
        :data:`RNG_KEY` (a PRNG key) or :data:`CONSTANT` (depends on no argument, e.g. a causal
        mask or a literal).
      name: the ``checkpoint_name`` the value carries (looked up through identity and
        shape-only ops), or ``None``.
      primitive: the primitive that produced it, or ``argument`` / ``constant`` / ``literal``.
      source: ``file:line (function)`` of the producing equation, or the argument's path.
      plan_tag: the :class:`jremat.PlanPolicy` tag (``jremat3/17``) if a plan chose it.
      layer_stacked: whether it is a stacked ``[n_layers, ...]`` output of a loop over layers.
    """

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    kind: str
    name: str | None
    primitive: str
    source: str
    plan_tag: str | None = None
    layer_stacked: bool = False

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
      bytes: their total size.
      bytes_per_layer: ``bytes / n_layers``.
      shapes: the distinct shapes, in first-seen order.
    """

    label: str
    kind: str
    count: int
    bytes: int
    bytes_per_layer: float
    shapes: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class ResidualsReport:
    """Every value a function keeps for its backward pass.

    Attributes:
      residuals: one :class:`SavedResidual` per distinct saved value.
      n_layers: how many layers the analysed function spans (1 for one block, ``L`` for the
        whole model); per-layer figures divide by it.
    """

    residuals: tuple[SavedResidual, ...]
    n_layers: int = 1

    def bytes_of(self, kind: str) -> int:
        """Total bytes of the residuals of ``kind``.

        Raises:
          ValueError: if ``kind`` is not one of :data:`RESIDUAL_KINDS`.
        """
        if kind not in RESIDUAL_KINDS:
            raise ValueError(f"unknown residual kind {kind!r}; valid kinds: {', '.join(RESIDUAL_KINDS)}")
        return sum(r.bytes for r in self.residuals if r.kind == kind)

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
            entry = acc.setdefault((r.kind, r.label), [0, 0, []])
            entry[0] += 1
            entry[1] += r.bytes
            if r.shape not in entry[2]:
                entry[2].append(r.shape)
        groups = [
            ResidualGroup(label, kind, count, nbytes, nbytes / self.n_layers, tuple(shapes))
            for (kind, label), (count, nbytes, shapes) in acc.items()
        ]
        return tuple(sorted(groups, key=lambda g: -g.bytes))

    def table(self, kinds: Sequence[str] = RESIDUAL_KINDS) -> str:
        """A printable table: one line per residual group, then totals per kind."""
        lines = [f"{'kind':<10} {'label':<28} {'count':>5} {'bytes':>14} {'bytes/layer':>14}  shapes"]
        for g in self.groups(kinds):
            shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in g.shapes[:3])
            lines.append(f"{g.kind:<10} {g.label:<28} {g.count:>5} {g.bytes:>14,} {g.bytes_per_layer:>14,.0f}  {shapes}")
        for kind in kinds:
            lines.append(f"total {kind}: {self.bytes_of(kind):,} bytes ({self.bytes_of(kind) / self.n_layers:,.0f} per layer)")
        return "\n".join(lines)


def _summarize_source(eqn) -> str:
    if _jax_compat.source_summarize is None:  # pragma: no cover
        return "unknown"
    try:
        return _jax_compat.source_summarize(eqn.source_info) or "inside a JAX library function"
    except Exception:  # noqa: BLE001 - best effort, never fail a report over a line number
        return "unknown"


def _dtype_name(aval) -> str:
    dtype = getattr(aval, "dtype", None)
    return str(dtype) if dtype is not None else "token"


def _primitive_name(eqn) -> str:
    """The equation's primitive name, with JAX remat3's ``checkpoint_name`` read as ``name``."""
    return "name" if _engine.tag_name(eqn) is not None else eqn.primitive.name


def _vjp_residual_jaxpr(fn, args, kwargs):
    leaves, in_tree = jax.tree.flatten((args, kwargs))

    def flat_fn(*flat):
        a, kw = jax.tree.unflatten(in_tree, flat)
        return fn(*a, **kw)

    closed, out_shape = jax.make_jaxpr(lambda *flat: jax.vjp(flat_fn, *flat), return_shape=True)(*leaves)
    n_res = len(jax.tree.leaves(out_shape[1]))
    # Inline nested jit calls so that each residual's producer is a real primitive, and values a
    # jit merely forwards become the same variable (no double counting).
    inlined = _program.inline_calls(closed, leaves)
    jaxpr = inlined.jaxpr
    return jaxpr, jaxpr.outvars[len(jaxpr.outvars) - n_res:], leaves, in_tree


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
        if name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
            carry = masks[n_consts:n_consts + n_carry]
            for _ in range(4):
                inner = dict(zip(body.invars, masks[:n_consts] + carry + masks[n_consts + n_carry:]))
                _propagate_deps(body, inner)
                body_outs = [0 if isinstance(v, jcore.Literal) else inner.get(v, 0) for v in body.outvars]
                new_carry = [a | b for a, b in zip(carry, body_outs[:n_carry])]
                if new_carry == carry:
                    break
                carry = new_carry
            outs = carry + body_outs[n_carry:]
        else:
            subs = _program.subjaxprs(eqn)
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
    """List every value ``fn`` keeps for its backward pass, without compiling.

    Traces ``jax.vjp(fn, *args, **kwargs)`` (like ``jax.ad_checkpoint.print_saved_residuals``)
    and describes each residual. Values that several variables share (a ``checkpoint_name``
    output and its input, a value a nested ``jit`` forwards) count once.

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
    jaxpr, res_vars, leaves, _ = _vjp_residual_jaxpr(fn, args, kwargs)
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
        if _program.is_key(v.aval):
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
        while not isinstance(v, jcore.Literal) and v in producer and _primitive_name(producer[v]) in IDENTITY_PRIMITIVES:
            eqn = producer[v]
            if _primitive_name(eqn) == "name":
                names.append(_engine.tag_name(eqn))
            v = eqn.invars[0]
        return v, names

    def forward_names(v, depth=8):
        found, frontier, seen = [], [v], set()
        for _ in range(depth):
            nxt = []
            for u in frontier:
                for eqn in consumers.get(u, ()):
                    if id(eqn) in seen:
                        continue
                    seen.add(id(eqn))
                    prim = _primitive_name(eqn)
                    if prim == "name":
                        found.append(_engine.tag_name(eqn))
                    if prim in IDENTITY_PRIMITIVES or prim in _program.SHAPE_ONLY_PRIMITIVES:
                        nxt.extend(o for o in eqn.outvars if not isinstance(o, jcore.DropVar))
            user = [n for n in found if not PLAN_TAG_RE.match(n)]
            if user:
                return user
            frontier = nxt
        return found

    residuals = []
    seen_vars = set()
    for v in res_vars:
        if isinstance(v, jcore.Literal):
            aval = jax.core.get_aval(v.val) if not hasattr(v, "aval") else v.aval
            residuals.append(SavedResidual(tuple(getattr(aval, "shape", ())), _dtype_name(aval),
                                           _program.aval_bytes(aval), CONSTANT, None, "literal", "a literal"))
            continue
        base, chain_names = canonical(v)
        if isinstance(base, jcore.Literal):
            aval = base.aval
            residuals.append(SavedResidual(tuple(aval.shape), _dtype_name(aval), _program.aval_bytes(aval),
                                           CONSTANT, None, "literal", "a literal"))
            continue
        if base in seen_vars:
            continue
        seen_vars.add(base)
        aval = base.aval
        nbytes = _program.aval_bytes(aval)
        names = chain_names + [n for n in forward_names(base) if n not in chain_names]
        user_names = [n for n in names if not PLAN_TAG_RE.match(n)]
        plan_tags = [n for n in names if PLAN_TAG_RE.match(n)]
        name = user_names[0] if user_names else None
        plan_tag = plan_tags[0] if plan_tags else None
        mask = deps.get(base, 0)
        stacked = False
        if base in invar_index:
            primitive, source = "argument", f"argument {paths[invar_index[base]]}"
        elif base in producer:
            eqn = producer[base]
            primitive, source = eqn.primitive.name, _summarize_source(eqn)
            if primitive in _LOOP_PRIMITIVES:
                length = eqn.params.get("length")
                stacked = bool(length == n_layers and aval.shape and aval.shape[0] == n_layers and n_layers > 1)
        else:
            primitive, source = "constant", "a constant"
        if _program.is_key(aval):
            kind = RNG_KEY
        elif mask & (_DATA | _KEY):
            kind = ACTIVATION
        elif mask & _PARAM:
            kind = PARAMETER
        else:
            kind = CONSTANT
        residuals.append(SavedResidual(tuple(aval.shape), _dtype_name(aval), nbytes, kind, name, primitive,
                                       source, plan_tag, stacked))
    return ResidualsReport(tuple(residuals), n_layers)


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def jaxpr_flops(jaxpr) -> float:
    """Cost-model FLOPs of a jaxpr (see :func:`jremat.program.equation_flops`).

    Loop bodies count once per iteration (``scan``: ``length`` times; ``while``: once, its trip
    count being unknown); ``cond`` counts its costliest branch; calls, checkpoints and
    custom-derivative functions count their bodies.

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"])
        elif name == "while":
            total += jaxpr_flops(eqn.params["body_jaxpr"]) + jaxpr_flops(eqn.params["cond_jaxpr"])
        elif name == "cond":
            total += max((jaxpr_flops(b) for b in eqn.params["branches"]), default=0.0)
        else:
            subs = _program.subjaxprs(eqn)
            total += sum(jaxpr_flops(s) for s in subs) if subs else _program.equation_flops(eqn)
    return total


def program_flops(fn: Callable, *args, **kwargs) -> float:
    """Cost-model FLOPs of ``fn(*args, **kwargs)``, traced (not compiled, not run).

    Apply it to ``jax.grad(loss)`` under two policies: the difference is the FLOPs the policy
    spends recomputing.

    Args:
      fn: a function of pytrees of arrays; arguments may be :class:`jax.ShapeDtypeStruct`.
    """
    return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs))


# ---------------------------------------------------------------------------------------------
# Live measurement
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LiveMemory:
    """Allocator statistics read after running a function once.

    Attributes:
      available: whether the device reports memory statistics.
      device: the device, in words.
      peak_bytes_in_use: the allocator's high-water mark after the run (process-wide since
        start: it includes anything allocated before), or ``None``.
      bytes_in_use_before: bytes in use just before the run, or ``None``.
      reason: why the figures are missing, or ``""``.
    """

    available: bool
    device: str
    peak_bytes_in_use: int | None
    bytes_in_use_before: int | None
    reason: str = ""


def allocator_stats_missing(device=None) -> str | None:
    """Why ``device`` cannot report a live peak (no ``peak_bytes_in_use`` statistic), or ``None`` if it can.

    Args:
      device: the device to ask; defaults to ``jax.devices()[0]``.
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return None
    return f"{device.platform} device {device} reports no allocator statistics (memory_stats() is None)"


def live_memory(fn: Callable, *args, device=None, **kwargs) -> LiveMemory:
    """Run ``fn(*args, **kwargs)`` once and read the device's ``memory_stats()`` peak.

    On backends without allocator statistics (XLA:CPU returns ``None``) nothing is run and the
    result says so.

    Args:
      fn: the function (a jitted train step); arguments must be concrete arrays.
      device: the device to read; defaults to ``jax.devices()[0]``.

    Returns:
      A :class:`LiveMemory`.
    """
    device = device or jax.devices()[0]
    missing = allocator_stats_missing(device)
    if missing is not None:
        return LiveMemory(False, str(device), None, None, f"{missing}: live measurement needs a GPU or TPU")
    before = int(device.memory_stats().get("bytes_in_use", 0))
    jax.block_until_ready(fn(*args, **kwargs))
    after = device.memory_stats()
    return LiveMemory(True, str(device), int(after["peak_bytes_in_use"]), before)


# ---------------------------------------------------------------------------------------------
# Diagnosis
# ---------------------------------------------------------------------------------------------


def diagnose_remat(
    temp_bytes: int,
    baseline_temp_bytes: int,
    saved_bytes: float,
    baseline_saved_bytes: float,
    *,
    scan_layers: bool | None = None,
    min_saved_drop: float = 0.25,
    min_temp_fraction: float = 0.25,
) -> str | None:
    """Say when compiled temp memory did not follow the saved residuals, and the likely cause.

    Flags a policy whose saved residuals are at least ``min_saved_drop`` (as a fraction of the
    baseline's) smaller than the baseline's while its temp memory fell by less than
    ``min_temp_fraction`` of that drop.

    Args:
      temp_bytes: the policy's compiled temp bytes.
      baseline_temp_bytes: the same for the baseline (usually the ``none`` policy).
      saved_bytes: the policy's saved residual bytes.
      baseline_saved_bytes: the baseline's.
      scan_layers: whether the layers run under ``lax.scan`` (``None`` if unknown).
      min_saved_drop: how much smaller the residuals must be for the check to apply.
      min_temp_fraction: the fraction of the residual drop that temp memory must show.

    Returns:
      A one-paragraph explanation, or ``None`` if temp memory followed the residuals.
    """
    saved_drop = baseline_saved_bytes - saved_bytes
    if baseline_saved_bytes <= 0 or saved_drop < min_saved_drop * baseline_saved_bytes:
        return None
    temp_drop = baseline_temp_bytes - temp_bytes
    if temp_drop >= min_temp_fraction * saved_drop:
        return None
    flag_on = _xla_flags.CPU_SCHEDULER_FLAG in os.environ.get("XLA_FLAGS", "")
    causes = []
    if jax.default_backend() == "cpu" and scan_layers is not True:
        causes.append(
            "in unrolled programs (and length-1 scans) XLA:CPU strips jax.checkpoint's optimization "
            "barriers and merges the recomputation with the forward pass (common-subexpression "
            "elimination), or its concurrency-optimized scheduler runs it early; remat applied "
            "through jremat.remat_at/run_layers ties recomputation to the cotangent to prevent this, "
            "a hand-written jax.checkpoint does not (measured: 8-layer unrolled chain, 192 MiB with "
            f"jax.checkpoint vs 136 MiB without and 104 MiB with the tie; {_xla_flags.CPU_SCHEDULER_FLAG} "
            f"is {'set' if flag_on else 'NOT set'} in this process)"
        )
    causes.append("XLA scheduling recomputation early or fusing it with the forward pass")
    causes.append("the peak being set by buffers other than residuals (logits, gradients, workspace)")
    return (
        f"saved residuals fell by {saved_drop / max(baseline_saved_bytes, 1):.0%} "
        f"({baseline_saved_bytes:,.0f} -> {saved_bytes:,.0f} bytes) but compiled temp memory fell only "
        f"{baseline_temp_bytes:,} -> {temp_bytes:,} bytes; likely cause: " + "; or ".join(causes)
    )


__all__ = [
    "ACTIVATION",
    "allocator_stats_missing",
    "CONSTANT",
    "LiveMemory",
    "MemoryReport",
    "PARAMETER",
    "PEAK_FROM_BACKEND",
    "PEAK_FROM_SUM",
    "PEAK_UNAVAILABLE",
    "RESIDUAL_KINDS",
    "RNG_KEY",
    "ResidualGroup",
    "ResidualsReport",
    "SavedResidual",
    "compiled_memory_report",
    "diagnose_remat",
    "jaxpr_flops",
    "live_memory",
    "memory_report",
    "program_flops",
    "saved_residuals_report",
]
