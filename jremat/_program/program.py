"""A traced, flattened view of a checkpointed function, and re-evaluation with name tags.

Policies that decide from the *whole* program (every k-th op, cost per byte, "everything
except these names") cannot be written as JAX policy callbacks: a callback sees one primitive
at a time, may be called more than once and is cached. Instead we trace the function once to
a jaxpr, inline nested ``jit`` calls, classify every equation, let the policy pick which
outputs to keep, and re-evaluate the jaxpr with those outputs tagged by
:func:`jax.ad_checkpoint.checkpoint_name`. ``jax.checkpoint`` with a names policy then saves
exactly the tagged values. The choice is a pure function of the traced program.

Op classification (used by every policy that counts or prices ops):

* *shape-only* ops (:data:`jremat._engine.jaxpr.SHAPE_ONLY_PRIMITIVES`: reshape, broadcast, convert, transpose,
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
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jremat._engine import interpreter as _interpreter
from jremat._engine import jaxpr as _jaxpr
from jremat._engine import lowering as _engine
from jremat._program import flops as _flops

#: Re-trace a jaxpr with nested ``jit`` / ``closed_call`` bodies inlined (:func:`jremat._engine.interpreter.inline_calls`).
inline_calls = _interpreter.inline_calls


@dataclasses.dataclass(frozen=True)
class Op:
    """One equation of a flattened program with the facts policies decide from.

    Attributes:
      index: position among all equations of the flattened jaxpr.
      primitive: the primitive's name (``dot_general``, ``tanh``, ``remat2``, ...).
      out_shapes: shapes of the outputs.
      out_dtypes: dtypes of the outputs.
      out_bytes: bytes of all outputs together.
      flops: cost-model FLOPs to recompute the outputs (:func:`jremat._program.flops.equation_flops`).
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
        """True for counted ops whose primitive is elementwise (:data:`jremat._engine.jaxpr.ELEMENTWISE_PRIMITIVES`).

        Matmuls, reductions, calls, loops (``while``, ``scan``), conditionals, custom calls and
        slicing or combining ops (``split``, ``concatenate``, ``gather``, ...) are not.
        """
        return self.counted and self.primitive in _jaxpr.ELEMENTWISE_PRIMITIVES


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
    return dtype is not None and not _jaxpr.is_key(aval) and jnp.issubdtype(dtype, jnp.inexact)


def _classify(jaxpr) -> tuple[Op, ...]:
    # "Data" is floating-point input: a value that depends on none (only on keys, counters,
    # integer ids or constants) is never a compute op, and if a key went into it, it is random.
    data_dep: dict = {v: _is_float(v.aval) for v in jaxpr.invars}
    key_dep: dict = {v: _jaxpr.is_key(v.aval) for v in jaxpr.invars}
    consumer_name: dict = {}
    for eqn in jaxpr.eqns:
        if (tag := _jaxpr.name_tag(eqn)) is not None and not isinstance(eqn.invars[0], jcore.Literal):
            consumer_name[eqn.invars[0]] = tag
    ops = []
    compute_index = 0
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        name = eqn.primitive.name
        has_data = any(data_dep.get(v, False) for v in ins)
        has_key = (
            name in _jaxpr.KEY_MAKING_PRIMITIVES
            or any(key_dep.get(v, False) for v in ins)
            or any(_jaxpr.is_key(v.aval) for v in ins)
        )
        for v in eqn.outvars:
            data_dep[v] = has_data
            key_dep[v] = has_key
        rng_derived = has_key and not has_data
        counted = (
            has_data
            and bool(eqn.outvars)
            and name not in _jaxpr.SHAPE_ONLY_PRIMITIVES
            and not any(_jaxpr.is_key(v.aval) for v in eqn.outvars)
        )
        if name == _jaxpr.NAME:
            tensor_name = eqn.params["name"]
        else:
            tensor_name = consumer_name.get(eqn.outvars[0]) if eqn.outvars else None
        ops.append(
            Op(
                index=i,
                primitive=name,
                out_shapes=tuple(getattr(v.aval, "shape", ()) for v in eqn.outvars),
                out_dtypes=tuple(getattr(v.aval, "dtype", None) for v in eqn.outvars),
                out_bytes=sum(_jaxpr.aval_bytes(v.aval) for v in eqn.outvars),
                flops=_flops.equation_flops(eqn),
                counted=counted,
                compute_index=compute_index if counted else None,
                rng_derived=rng_derived,
                tensor_name=tensor_name,
                is_matmul=name in _jaxpr.MATMUL_PRIMITIVES,
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
    contract of ``jax.checkpoint``'s own cache: see :class:`jremat._engine.lowering.TraceCache`)."""

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


def run_traced_once(fn: Callable, build: Callable[[Program], tuple[Any, Callable]]) -> Callable:
    """``fn`` traced once per input signature and run as ``build`` says.

    ``build(program)`` returns ``(out_tree, run)``: ``run(*flat_inputs)`` gives the flat outputs.
    ``fn`` is not called again for a signature seen before (a second call would draw a Linen
    module's random values anew).
    """
    cache = ProgramCache()

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out_tree, run = cache.traced(fn, args, kwargs, build)
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves((args, kwargs))))

    return wrapped


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
