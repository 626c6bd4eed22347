"""A traced, flattened view of a checkpointed function, and re-evaluation with name tags.

Policies that decide from the *whole* program (every k-th op, cost per byte, "everything
except these names") cannot be written as JAX policy callbacks: a callback sees one primitive
at a time, may be called more than once and is cached. Instead we trace the function once to
a jaxpr, inline nested ``jit`` calls, classify every equation, let the policy pick which
outputs to keep, and re-evaluate the jaxpr with those outputs tagged by
:func:`jax.ad_checkpoint.checkpoint_name`. ``jax.checkpoint`` with a names policy then saves
exactly the tagged values. The choice is a pure function of the traced program.

Op classification (used by every policy that counts or prices ops):

* *shape-only* ops (:data:`SHAPE_ONLY_PRIMITIVES`: reshape, broadcast, convert, transpose,
  squeeze, expand_dims, copy, name tags, ...) move or relabel data without arithmetic.
* *RNG-derived* values depend on a PRNG key (typed, or legacy ``uint32`` bits turned into a
  key by ``random_wrap``) and on no floating-point input: dropout masks, uniform draws, NNX
  ``Rngs`` counters and the keys folded from them. They are never saved: they are regenerated
  from the key.
* *constant-derived* values depend on no floating-point input at all (causal masks from
  ``iota``, integer positions); they are not numbered either.
* Every other equation with outputs is a *compute op*. Compute ops are numbered from 0 in
  program order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jremat import _engine, _interpreter, _kernel_cost

#: Primitives that only reshape, relabel or move data; never counted, never saved by tagging.
SHAPE_ONLY_PRIMITIVES = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "convert_element_type",
        "squeeze",
        "expand_dims",
        "transpose",
        "copy",
        "copy_p",
        "name",
        "reduce_precision",
        "optimization_barrier",
        "sharding_constraint",
        "mesh_cast",
        "device_put",
        "stop_gradient",
    }
)

#: JAX's elementwise primitives: each output element is a function of the input elements at the
#: same position (operands of one shape; a scalar literal broadcasts). Loops, scans, conditionals,
#: calls, custom calls and every slicing, gathering, sorting or combining op are not among them.
ELEMENTWISE_PRIMITIVES = frozenset(
    {
        # unary
        "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bessel_i0e", "bessel_i1e", "cbrt",
        "ceil", "clz", "conj", "cos", "cosh", "digamma", "erf", "erf_inv", "erfc", "exp", "exp2",
        "expm1", "floor", "imag", "integer_pow", "is_finite", "lgamma", "log", "log1p", "logistic",
        "neg", "not", "population_count", "real", "round", "rsqrt", "sign", "sin", "sinh", "sqrt",
        "square", "tan", "tanh",
        # binary and ternary
        "add", "add_any", "and", "atan2", "clamp", "complex", "div", "eq", "ge", "gt", "igamma",
        "igamma_grad_a", "igammac", "le", "lt", "max", "min", "mul", "mulhi", "ne", "nextafter", "or",
        "polygamma", "pow", "random_gamma_grad", "regularized_incomplete_beta", "rem", "select_n",
        "shift_left", "shift_right_arithmetic", "shift_right_logical", "sub", "xor", "zeta",
    }
)  # fmt: skip

#: Call-like primitives whose body is inlined before classification.
INLINED_CALL_PRIMITIVES = _engine.INLINED_CALL_PRIMITIVES
#: Re-trace a jaxpr with nested ``jit`` / ``closed_call`` bodies inlined (:func:`jremat._interpreter.inline_calls`).
inline_calls = _interpreter.inline_calls

#: Primitives priced as matrix multiplies by the cost model.
MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})

_SUBJAXPR_PARAM_NAMES = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def is_key(aval) -> bool:
    """Whether ``aval`` is a typed PRNG key."""
    return jax.dtypes.issubdtype(getattr(aval, "dtype", None), jax.dtypes.prng_key)


def aval_bytes(aval) -> int:
    """Bytes taken by one value of abstract type ``aval`` (0 for tokens and keys' metadata)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    if is_key(aval):
        return math.prod(shape) * 8
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def subjaxprs(eqn) -> list:
    """The jaxprs nested in an equation's parameters (``jit``, ``remat2``, custom derivatives)."""
    found = []
    for name in _SUBJAXPR_PARAM_NAMES:
        sub = eqn.params.get(name)
        if sub is None:
            continue
        found.append(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
    return found


def equation_flops(eqn) -> float:
    """Cost-model FLOPs to recompute one equation's outputs from its inputs.

    ``dot_general``: 2 x batch x free(lhs) x free(rhs) x contracted. ``conv``: 2 x output
    elements x kernel elements / output features. Reductions: input elements. Nested
    checkpoint / custom-derivative calls: the sum over their body; a ``scan``: its body times
    its length. Shape-only ops: 0.
    ``dynamic_update_slice``: one per element written (the update; XLA writes in place).
    A kernel (a ``pallas_call``, an FFI call): its price (:func:`jremat.kernel_cost`).
    Everything else (elementwise): one FLOP per output element.
    """
    kernel_flops = _kernel_cost.kernel_flops(eqn)
    if kernel_flops is not None:
        return kernel_flops
    name = eqn.primitive.name
    if name in SHAPE_ONLY_PRIMITIVES:
        return 0.0
    if name == "dot_general":
        (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        contracted = math.prod(lhs_shape[d] for d in lhs_contract)
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted
    if name == "conv_general_dilated":
        rhs_shape = eqn.invars[1].aval.shape
        out_features = rhs_shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs_shape) / out_features
    subs = subjaxprs(eqn)
    if subs:
        # A scan's outputs cost its body times its length (a while loop's count is unknown: once).
        trips = eqn.params["length"] if name == "scan" else 1
        return float(trips * sum(equation_flops(e) for sub in subs for e in sub.eqns))
    if name == "dynamic_update_slice":
        return float(math.prod(eqn.invars[1].aval.shape))
    if name.startswith("reduce_") or name in ("argmax", "argmin", "cumsum", "cumprod"):
        return float(sum(math.prod(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape")))
    return float(sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")))


@dataclasses.dataclass(frozen=True)
class Op:
    """One equation of a flattened program with the facts policies decide from.

    Attributes:
      index: position among all equations of the flattened jaxpr.
      primitive: the primitive's name (``dot_general``, ``tanh``, ``remat2``, ...).
      out_shapes: shapes of the outputs.
      out_dtypes: dtypes of the outputs.
      out_bytes: bytes of all outputs together.
      flops: cost-model FLOPs to recompute the outputs (:func:`equation_flops`).
      counted: whether this is a compute op (not shape-only, not RNG- or constant-derived).
      compute_index: position among compute ops (0-based), or ``None`` if not counted.
      rng_derived: whether the outputs depend only on PRNG keys and constants.
      tensor_name: the ``checkpoint_name`` this op's output is tagged with downstream, if any.
      is_matmul: whether the cost model prices this op as a matrix multiply.
    """

    index: int
    primitive: str
    out_shapes: tuple
    out_dtypes: tuple
    out_bytes: int
    flops: float
    counted: bool
    compute_index: int | None
    rng_derived: bool
    tensor_name: str | None
    is_matmul: bool

    @property
    def flops_per_byte(self) -> float:
        """Recompute FLOPs per byte that saving this op's outputs would cost."""
        return self.flops / self.out_bytes if self.out_bytes else 0.0

    @property
    def is_elementwise(self) -> bool:
        """True for counted ops whose primitive is elementwise (:data:`ELEMENTWISE_PRIMITIVES`).

        Matmuls, reductions, calls, loops (``while``, ``scan``), conditionals, custom calls and
        slicing or combining ops (``split``, ``concatenate``, ``gather``, ...) are not.
        """
        return self.counted and self.primitive in ELEMENTWISE_PRIMITIVES


@dataclasses.dataclass(frozen=True)
class Program:
    """A checkpointed function traced once, flattened, with one :class:`Op` per equation.

    Build one with :func:`trace_program`.
    """

    closed_jaxpr: Any
    ops: tuple[Op, ...]
    in_tree: Any
    out_tree: Any

    @property
    def compute_ops(self) -> tuple[Op, ...]:
        """The counted compute ops, in program order."""
        return tuple(op for op in self.ops if op.counted)

    def ops_named(self, names: Sequence[str]) -> tuple[Op, ...]:
        """Ops whose output carries one of ``names`` (see :attr:`Op.tensor_name`)."""
        wanted = set(names)
        return tuple(op for op in self.ops if op.tensor_name in wanted)


def _is_float(aval) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and not is_key(aval) and jnp.issubdtype(dtype, jnp.inexact)


#: Primitives that make a PRNG key from raw bits (legacy ``uint32[2]`` keys, seeds).
KEY_MAKING_PRIMITIVES = frozenset({"random_wrap", "random_seed"})


def _classify(jaxpr) -> tuple[Op, ...]:
    # "Data" is floating-point input: a value that depends on none (only on keys, counters,
    # integer ids or constants) is never a compute op, and if a key went into it, it is random.
    data_dep: dict = {v: _is_float(v.aval) for v in jaxpr.invars}
    key_dep: dict = {v: is_key(v.aval) for v in jaxpr.invars}
    consumer_name: dict = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and not isinstance(eqn.invars[0], jcore.Literal):
            consumer_name[eqn.invars[0]] = eqn.params["name"]
    ops = []
    compute_index = 0
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        name = eqn.primitive.name
        has_data = any(data_dep.get(v, False) for v in ins)
        has_key = (
            name in KEY_MAKING_PRIMITIVES or any(key_dep.get(v, False) for v in ins) or any(is_key(v.aval) for v in ins)
        )
        for v in eqn.outvars:
            data_dep[v] = has_data
            key_dep[v] = has_key
        rng_derived = has_key and not has_data
        counted = (
            has_data
            and bool(eqn.outvars)
            and name not in SHAPE_ONLY_PRIMITIVES
            and not any(is_key(v.aval) for v in eqn.outvars)
        )
        if name == "name":
            tensor_name = eqn.params["name"]
        else:
            tensor_name = consumer_name.get(eqn.outvars[0]) if eqn.outvars else None
        ops.append(
            Op(
                index=i,
                primitive=name,
                out_shapes=tuple(getattr(v.aval, "shape", ()) for v in eqn.outvars),
                out_dtypes=tuple(getattr(v.aval, "dtype", None) for v in eqn.outvars),
                out_bytes=sum(aval_bytes(v.aval) for v in eqn.outvars),
                flops=equation_flops(eqn),
                counted=counted,
                compute_index=compute_index if counted else None,
                rng_derived=rng_derived,
                tensor_name=tensor_name,
                is_matmul=name in MATMUL_PRIMITIVES,
            )
        )
        if counted:
            compute_index += 1
    return tuple(ops)


def trace_program(fn: Callable, *args, **kwargs) -> Program:
    """Trace ``fn(*args, **kwargs)`` into a flattened :class:`Program`.

    Nested ``jit`` calls are inlined so that numbering sees the ops a user wrote; nested
    ``jax.checkpoint`` and custom-derivative calls stay single ops.

    Args:
      fn: a function of pytrees of arrays (tracers are fine: this works inside ``jit``/``scan``).
      *args: positional arguments.
      **kwargs: keyword arguments (pytrees of arrays).

    Returns:
      The :class:`Program`; its jaxpr takes the flattened ``(args, kwargs)`` leaves.
    """
    flat, in_tree, out_tree = _interpreter.trace_flat(fn, args, kwargs)
    return Program(closed_jaxpr=flat, ops=_classify(flat.jaxpr), in_tree=in_tree, out_tree=out_tree)


def program_of_jaxpr(jaxpr) -> Program:
    """A :class:`Program` of an already traced, flattened jaxpr without constants (a checkpoint's
    body), for policies to describe; its trees are unknown (``None``)."""
    return Program(closed_jaxpr=jcore.ClosedJaxpr(jaxpr, []), ops=_classify(jaxpr), in_tree=None, out_tree=None)


class ProgramCache(_engine.TraceCache):
    """Programs of one function traced once per argument structure, shapes and dtypes (the
    contract of ``jax.checkpoint``'s own cache: see :class:`jremat._engine.TraceCache`)."""

    def traced(self, fn: Callable, args: tuple, kwargs: dict, build: Callable[[Program], Any] = lambda p: p):
        """``build(trace_program(fn, *args, **kwargs))``, from the cache when traced before.

        Args:
          fn: the function (fixed for one cache).
          args: positional arguments.
          kwargs: keyword arguments.
          build: what to keep per program (the program itself by default).
        """

        def trace():
            program = trace_program(fn, *args, **kwargs)
            return build(program), program.closed_jaxpr.consts

        return self.get(args, kwargs, trace)


def feeds_only_effects(program: Program) -> frozenset[int]:
    """Equations whose outputs are used only by side-effecting equations (``jax.debug.print``).

    Such outputs are neither program outputs nor inputs of any computation the backward pass
    could need.
    """
    jaxpr = program.closed_jaxpr.jaxpr
    outputs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    consumers: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                consumers.setdefault(v, []).append(eqn)
    found = set()
    for i, eqn in enumerate(jaxpr.eqns):
        users = [u for v in eqn.outvars for u in consumers.get(v, ())]
        if users and all(u.effects for u in users) and not any(v in outputs for v in eqn.outvars):
            found.add(i)
    return frozenset(found)


def nested_jaxprs(eqn) -> list:
    """Every jaxpr in an equation's parameters (scan and while bodies, cond branches, calls)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jcore.Jaxpr):
                found.append(item)
    return found


def jaxpr_tags(jaxpr) -> frozenset[str]:
    """Every ``checkpoint_name`` tag in ``jaxpr`` and the jaxprs nested in it (scan, cond, calls)."""
    found = set()
    stack = [jaxpr]
    while stack:
        current = stack.pop()
        for eqn in current.eqns:
            if eqn.primitive.name == "name":
                found.add(eqn.params["name"])
            stack.extend(nested_jaxprs(eqn))
    return frozenset(found)


def evaluate_tagged(program: Program, tags: Mapping[int, str], flat_args: Sequence) -> list:
    """Evaluate ``program`` with the outputs of equation ``i`` tagged as ``tags[i]``.

    An equation with several outputs gets ``f"{tags[i]}.{j}"`` on output ``j``.

    Args:
      program: from :func:`trace_program`.
      tags: equation index -> checkpoint name.
      flat_args: the flattened argument leaves.

    Returns:
      The flat list of outputs.
    """
    return _interpreter.evaluate_tagged(program.closed_jaxpr, tags, flat_args)
