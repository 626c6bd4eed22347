"""The structure of a jaxpr: primitive names, nested jaxprs, name tags and liveness.

Every analysis in jremat reads jaxprs through this module:

* the primitive vocabulary: each primitive jremat recognises by name, and the sets it groups
  them in (:data:`SHAPE_ONLY_PRIMITIVES`, :data:`LOOP_PRIMITIVES`, :data:`CALL_PRIMITIVES`, ...);
* the jaxprs nested in an equation (:func:`nested_jaxprs`, :func:`subjaxprs`, :func:`call_jaxpr`)
  and one walk over a jaxpr and every jaxpr nested in it (:func:`walk`), which gives each
  equation with the equations that hold it: the ``scan`` loops among them (:func:`loops`) give
  how many times it runs (:func:`trip_count`);
* the name of a ``checkpoint_name`` tag (:func:`name_tag`);
* the values: the bytes one takes (:func:`aval_bytes`), whether it is a PRNG key (:func:`is_key`);
* liveness (:func:`live_equations`, :func:`used_inputs`): which equations and inputs a jaxpr's
  used outputs need, through calls and ``scan`` loops (carries to a fixed point). JAX's remat3 engine leaves a saved value's recomputation in the backward
  program as an input that a ``custom_jvp_call`` ignores (it only supplies a tangent); XLA removes
  such dead code when it compiles, so neither the recomputation nor a residual that feeds only it
  costs anything. :func:`used_inputs` sees which inputs survive that removal, without compiling.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jremat._engine import jax_compat as _jax_compat

# ---------------------------------------------------------------------------------------------
# Primitive names

#: ``jax.ad_checkpoint.checkpoint_name``'s tag (classic engine); its ``name`` parameter is the tag.
NAME = "name"
#: Loops: ``lax.scan`` (a trip count, its ``length`` parameter) and ``lax.while_loop``.
SCAN = "scan"
SHARD_MAP = "shard_map"
WHILE = "while"
COND = "cond"
#: Under jax_remat3 a ``checkpoint_name`` tag is this primitive (:func:`remat3_name_tag`).
CALL_HI_PRIMITIVE = "call_hi_primitive"
#: ``jax.experimental.pallas.pallas_call``.
PALLAS_CALL = "pallas_call"
#: ``jax.ffi.ffi_call``.
FFI_CALL = "ffi_call"
CUSTOM_VJP_CALL = "custom_vjp_call"
CUSTOM_JVP_CALL = "custom_jvp_call"
DOT_GENERAL = "dot_general"
BROADCAST_IN_DIM = "broadcast_in_dim"
#: A grouped matmul (``jax.lax.ragged_dot``, ``ragged_dot_general``): one matmul per group of rows.
RAGGED_DOT_GENERAL = "ragged_dot_general"
CONV = "conv_general_dilated"
DYNAMIC_UPDATE_SLICE = "dynamic_update_slice"
EXP = "exp"
REDUCE_SUM = "reduce_sum"
#: Reading the grid position inside a Pallas kernel body.
PROGRAM_ID = "program_id"
NUM_PROGRAMS = "num_programs"
#: ``jnp.split``: one input, several parts.
SPLIT = "split"
#: What a ``while`` loop of a counted range compares and steps its counter with.
LESS_THAN = "lt"
ADD = "add"
#: Elementwise primitives an attention's softmax normalises with.
DIV = "div"
MUL = "mul"
#: A running maximum (elementwise, or a reduction).
MAX = "max"
REDUCE_MAX = "reduce_max"
#: What a softmax computes: an ``exp``, summed, divided by the sum.
SOFTMAX_PRIMITIVES = frozenset({EXP, REDUCE_SUM, DIV})
#: Primitives whose derivative reads their own output (``exp``'s is ``t * exp(x)``, ``top_k``'s its indices): a
#: saved output of one is tagged where that derivative reads it (:func:`jremat._engine.interpreter.bind_named`).
OUTPUT_READING_DERIVATIVES = frozenset({EXP, "tanh", "logistic", "top_k"})
#: How a softmax divides by its sum: a division, or a product with the reciprocal.
NORMALIZING_PRIMITIVES = frozenset({DIV, MUL})

#: ``lax.scan`` and ``lax.while_loop``.
LOOP_PRIMITIVES = frozenset({SCAN, WHILE})
#: Classic ``jax.checkpoint``.
CLASSIC_CHECKPOINT_PRIMITIVES = frozenset({"remat2", "checkpoint"})
#: Call-like primitives whose body is inlined when a program is flattened.
INLINED_CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
#: Custom-derivative calls (``jax.custom_vjp``, ``jax.custom_jvp``).
CUSTOM_CALL_PRIMITIVES = frozenset({CUSTOM_VJP_CALL, CUSTOM_JVP_CALL})
#: Custom-derivative calls, and ``custom_vjp_call_jaxpr``: the name some JAX releases give a ``custom_vjp`` call.
CUSTOM_DERIVATIVE_PRIMITIVES = CUSTOM_CALL_PRIMITIVES | {"custom_vjp_call_jaxpr"}
#: Equations that run one nested jaxpr once, whose inputs and outputs are the equation's own.
CALL_PRIMITIVES = INLINED_CALL_PRIMITIVES | CLASSIC_CHECKPOINT_PRIMITIVES | CUSTOM_CALL_PRIMITIVES
#: Every primitive that is a kernel: a Pallas call or an FFI call.
KERNEL_PRIMITIVES = frozenset({PALLAS_CALL, FFI_CALL})
#: ``jax.nn.dot_product_attention(..., implementation="cudnn")``'s forward kernel.
CUDNN_FORWARD_PRIMITIVES = frozenset({"dot_product_attention_fwd_wrapper", "dot_product_attention_fp8_fwd_wrapper"})

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
        NAME,
        "reduce_precision",
        "optimization_barrier",
        "sharding_constraint",
        "mesh_cast",
        "device_put",
        "stop_gradient",
    }
)
#: Primitives whose output is their input, value for value (a residual seen through them is the same).
IDENTITY_PRIMITIVES = frozenset({NAME, "reduce_precision", "copy", "copy_p"})
#: Primitives an all-gathered weight passes through unchanged in value (a dtype, a layout, a tag).
GATHER_PASS_THROUGH_PRIMITIVES = frozenset(
    {"convert_element_type", "reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim", "copy", NAME}
)
SHARDING_CONSTRAINT = "sharding_constraint"
#: Primitives that place a value on a mesh (a sharding constraint, a reshard).
PLACEMENT_PRIMITIVES = frozenset({SHARDING_CONSTRAINT, "reshard"})
#: Primitives that change a value's dtype or copy it, its shape and placement unchanged.
DTYPE_ONLY_PRIMITIVES = frozenset({"convert_element_type", "copy"})

#: JAX's elementwise primitives: each output element is a function of the input elements at the
#: same position (operands of one shape; a scalar literal broadcasts). Loops, scans, conditionals,
#: calls, custom calls and every slicing, gathering, sorting or combining op are not among them.
ELEMENTWISE_PRIMITIVES = frozenset(
    {
        # unary
        "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bessel_i0e", "bessel_i1e", "cbrt",
        "ceil", "clz", "conj", "cos", "cosh", "digamma", "erf", "erf_inv", "erfc", EXP, "exp2",
        "expm1", "floor", "imag", "integer_pow", "is_finite", "lgamma", "log", "log1p", "logistic",
        "neg", "not", "population_count", "real", "round", "rsqrt", "sign", "sin", "sinh", "sqrt",
        "square", "tan", "tanh",
        # binary and ternary
        ADD, "add_any", "and", "atan2", "clamp", "complex", DIV, "eq", "ge", "gt", "igamma",
        "igamma_grad_a", "igammac", "le", LESS_THAN, MAX, "min", MUL, "mulhi", "ne", "nextafter", "or",
        "polygamma", "pow", "random_gamma_grad", "regularized_incomplete_beta", "rem", "select_n",
        "shift_left", "shift_right_arithmetic", "shift_right_logical", "sub", "xor", "zeta",
    }
)  # fmt: skip
#: Primitives priced as matrix multiplies by the cost model.
MATMUL_PRIMITIVES = frozenset({DOT_GENERAL, RAGGED_DOT_GENERAL, CONV})
#: Reductions and scans over an axis not named ``reduce_*``, priced one FLOP per input element.
REDUCTION_PRIMITIVES = frozenset({"argmax", "argmin", "cumsum", "cumprod"})
#: The prefix of JAX's reduction primitives (``reduce_sum``, ``reduce_max``, ...).
REDUCE_PREFIX = "reduce_"
#: Primitives that make a PRNG key from raw bits (legacy ``uint32[2]`` keys, seeds).
KEY_MAKING_PRIMITIVES = frozenset({"random_wrap", "random_seed"})
#: Primitives that draw or derive random bits.
RANDOM_PRIMITIVES = frozenset(
    {
        "random_bits",
        "random_split",
        "random_fold_in",
        "random_seed",
        "random_wrap",
        "threefry2x32",
        "rng_bit_generator",
        "rng_uniform",
    }
)
#: Primitives of a kernel body that move data between a kernel's blocks and memory, or read the
#: grid position: no arithmetic.
KERNEL_MEMORY_PRIMITIVES = frozenset(
    {
        "get",
        "swap",
        "masked_load",
        "masked_swap",
        "load",
        PROGRAM_ID,
        NUM_PROGRAMS,
        "multiple_of",
        "dma_start",
        "dma_wait",
        "semaphore_read",
        "semaphore_signal",
        "semaphore_wait",
        "delay",
    }
)
#: Primitives whose outputs are parts of their first operand: the operand holds their data.
PARTS_PRIMITIVES = frozenset({SPLIT})
#: Static selections of an operand's elements (a fused gate-and-up projection split into its halves).
SELECTION_PRIMITIVES = frozenset({SPLIT, "slice"})


def _truncating_div(a, b):
    if b == 0:
        return None
    quotient = abs(a) // abs(b)
    return quotient if (a >= 0) == (b >= 0) else -quotient


#: Integer and boolean scalar arithmetic a kernel computes its loop bounds with: primitive name ->
#: the function of Python ints it computes (``None``: undefined, a division by zero).
INTEGER_SCALAR_FUNCTIONS: dict[str, Callable] = {
    ADD: lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    MUL: lambda a, b: a * b,
    DIV: _truncating_div,
    "rem": lambda a, b: None if b == 0 else a - b * _truncating_div(a, b),
    MAX: max,
    "min": min,
    "neg": lambda a: -a,
    LESS_THAN: lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "and": lambda a, b: a & b,  # bitwise on integers, logical on booleans (as 0 and 1)
    "or": lambda a, b: a | b,
    "select_n": lambda which, *cases: cases[int(which)],
    "convert_element_type": lambda a: a,
    "clamp": lambda lo, x, hi: min(max(x, lo), hi),
}


# ---------------------------------------------------------------------------------------------
# Values


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


# ---------------------------------------------------------------------------------------------
# Nested jaxprs

_CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def as_jaxpr(value):
    """The ``Jaxpr`` of a ``Jaxpr`` or ``ClosedJaxpr``."""
    return value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value


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


def subjaxprs(eqn) -> list:
    """The jaxprs in an equation's call parameters (``jaxpr``, ``call_jaxpr``, ``fun_jaxpr``:
    ``jit``, ``remat2``, custom derivatives, a ``scan`` body)."""
    found = []
    for name in _CALL_JAXPR_PARAMS:
        sub = eqn.params.get(name)
        if sub is None:
            continue
        found.append(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
    return found


def call_jaxpr(eqn):
    """The jaxpr a call-like equation (:data:`CALL_PRIMITIVES`) runs once with its own inputs and
    outputs, else ``None``."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    for name in _CALL_JAXPR_PARAMS:
        sub = as_jaxpr(eqn.params.get(name))
        if isinstance(sub, jcore.Jaxpr) and len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars):
            return sub
    return None


def walk(jaxpr, enclosing: tuple = (), *, enter: Callable | None = None) -> Iterator[tuple]:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it, in program order (an equation
    before the equations of its nested jaxprs), each with the equations that hold it.

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      enclosing: the equations that hold ``jaxpr`` itself, outermost first.
      enter: ``enter(eqn, enclosing)``: whether to walk into the jaxprs nested in ``eqn``
        (default: always).

    Yields:
      ``(eqn, enclosing)``: ``enclosing`` the equations whose nested jaxprs hold ``eqn``, outermost
      first; :func:`trip_count` of it is how many times ``eqn`` runs per run of ``jaxpr``, as far
      as ``scan`` lengths tell (:func:`loops`).
    """
    for eqn in as_jaxpr(jaxpr).eqns:
        yield eqn, enclosing
        if enter is None or enter(eqn, enclosing):
            for sub in nested_jaxprs(eqn):
                yield from walk(sub, (*enclosing, eqn), enter=enter)


def equations(jaxpr, *, enter: Callable | None = None) -> Iterator:
    """The equations :func:`walk` yields, without what holds them."""
    return (eqn for eqn, _ in walk(jaxpr, enter=enter))


def loops(enclosing: Sequence) -> tuple:
    """The ``scan`` equations among ``enclosing`` (from :func:`walk`): the loops around an
    equation whose trip counts are known. A ``while`` loop's is not: it counts once."""
    return tuple(eqn for eqn in enclosing if eqn.primitive.name == SCAN)


def trip_count(enclosing: Sequence) -> int:
    """How many times an equation inside ``enclosing`` (from :func:`walk`) runs: the product of
    the lengths of the ``scan`` loops around it."""
    n = 1
    for loop in loops(enclosing):
        n *= loop.params["length"]
    return n


def is_scan(eqn) -> bool:
    """Whether ``eqn`` is a ``lax.scan``."""
    return eqn.primitive.name == SCAN


#: Primitives that issue a collective across a mesh axis (in a ``shard_map``), by the HLO collective each lowers to.
COLLECTIVE_PRIMITIVES = (
    dict.fromkeys(("all_gather", "all_gather_invariant"), "all-gather")
    | dict.fromkeys(("psum", "psum_invariant", "pmax", "pmin"), "all-reduce")
    | dict.fromkeys(("all_to_all", "ragged_all_to_all"), "all-to-all")
    | {"reduce_scatter": "reduce-scatter", "ppermute": "collective-permute"}
)


def is_shard_map(eqn) -> bool:
    """Whether ``eqn`` is a :func:`jax.shard_map`."""
    return eqn.primitive.name == SHARD_MAP


def is_loop(eqn) -> bool:
    """Whether ``eqn`` is a loop (:data:`LOOP_PRIMITIVES`)."""
    return eqn.primitive.name in LOOP_PRIMITIVES


def _float_shapes(avals) -> list[tuple[int, ...]]:
    return [
        tuple(a.shape)
        for a in avals
        if hasattr(a, "shape") and jnp.issubdtype(getattr(a, "dtype", jnp.int32), jnp.floating)
    ]


def grouped_matmul_kernel(in_avals: Sequence, out_avals: Sequence | None = None) -> bool:
    """Whether a kernel call (``pallas_call``, ``ffi_call``) with these operands computes a grouped
    matmul, as JAX's megablox ``gmm`` / ``tgmm`` do: rows ``[m, k]`` times one matrix per group
    ``[g, k, n]`` (or ``[g, n, k]``) giving ``[m, n]``; or, in a gradient, rows ``[m, k]`` (or
    ``[k, m]``) and ``[m, n]`` giving one matrix per group ``[g, k, n]``.

    Args:
      in_avals: the call's operand avals (integer ones, such as group sizes, are passed over).
      out_avals: its result avals; ``None`` (a checkpoint policy, which sees operands only):
        the first layout, judged by the operands alone.
    """
    ins = _float_shapes(in_avals)
    two, three = [s for s in ins if len(s) == 2], [s for s in ins if len(s) == 3]
    outs = None if out_avals is None else _float_shapes(out_avals)
    if outs is not None and len(outs) != 1:
        return False
    out = outs[0] if outs else None
    if out is None or len(out) == 2:
        for m, k in two:
            for w in three:
                n = w[2] if w[1] == k else w[1] if w[2] == k else None
                if n is not None and (out is None or out == (m, n)):
                    return True
        return False
    if len(out) == 3:
        _, k, n = out
        return any(
            b[1] == n and sorted(a) == sorted((b[0], k)) for i, a in enumerate(two) for j, b in enumerate(two) if i != j
        )
    return False


def is_grouped_matmul(eqn) -> bool:
    """Whether ``eqn`` computes a grouped matmul (a mixture of experts' expert layer): a
    ``ragged_dot_general``, a kernel call shaped like one (:func:`grouped_matmul_kernel`: JAX's
    megablox ``gmm``), or a call (``jit``, a custom derivative) with one result that runs such a
    kernel and whose operands are shaped like its (megablox ``gmm`` as a user calls it)."""
    name = eqn.primitive.name
    if name == RAGGED_DOT_GENERAL:
        return True
    ins, outs = [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars]
    if name in KERNEL_PRIMITIVES:
        return grouped_matmul_kernel(ins, outs)
    if name not in INLINED_CALL_PRIMITIVES | CUSTOM_DERIVATIVE_PRIMITIVES or not grouped_matmul_kernel(ins, outs):
        return False
    return any(
        inner.primitive.name in KERNEL_PRIMITIVES and is_grouped_matmul(inner)
        for sub in nested_jaxprs(eqn)
        for inner in equations(sub, enter=lambda e, _: e.primitive.name not in KERNEL_PRIMITIVES)
    )


def grouped_matmul_rows(eqn):
    """The operand of a grouped matmul equation (:func:`is_grouped_matmul`) that holds its rows
    ``[m, k]`` (the tokens sorted by expert): a ``ragged_dot_general``'s first operand, a kernel's
    or call's 2-D float operand with the result's rows."""
    if eqn.primitive.name == RAGGED_DOT_GENERAL:
        return eqn.invars[0]
    out_shape: tuple = getattr(eqn.outvars[0].aval, "shape", ())
    for v in eqn.invars:
        shape: tuple = getattr(v.aval, "shape", ())
        if len(shape) == 2 and out_shape[:1] == shape[:1] and jnp.issubdtype(v.aval.dtype, jnp.floating):
            return v
    return eqn.invars[0]


def name_tag(eqn) -> str | None:
    """The tag of a classic ``checkpoint_name`` equation (a ``name`` primitive), else ``None``."""
    return eqn.params["name"] if eqn.primitive.name == NAME else None


def remat3_name_tag(eqn) -> str | None:
    """The tag of a ``checkpoint_name`` equation traced under jax_remat3 (a ``call_hi_primitive``
    whose ``_prim`` is JAX's ``CheckpointName``), else ``None``."""
    return _jax_compat.checkpoint_name_of(eqn.params.get("_prim")) if eqn.primitive.name == CALL_HI_PRIMITIVE else None


def any_name_tag(eqn) -> str | None:
    """The tag of a ``checkpoint_name`` equation traced under either engine, else ``None``."""
    tag = name_tag(eqn)
    return tag if tag is not None else remat3_name_tag(eqn)


def name_tags(jaxpr) -> frozenset[str]:
    """Every classic ``checkpoint_name`` tag in ``jaxpr`` and the jaxprs nested in it."""
    return frozenset(tag for eqn in equations(jaxpr) if (tag := name_tag(eqn)) is not None)


# ---------------------------------------------------------------------------------------------
# Liveness


def scan_body_used_outputs(eqn, used_outputs: Sequence[bool]) -> list[bool]:
    """Which outputs of a ``scan`` equation's body are used, given which of the scan's are:
    a carry that the body reads is an output of the previous iteration."""
    body = as_jaxpr(eqn.params["jaxpr"])
    n_consts, n_carry = _jax_compat.scan_counts(eqn)
    used_out = list(used_outputs)
    while True:
        used_in = used_inputs(body, used_out)
        grown = False
        for i in range(n_carry):
            if used_in[n_consts + i] and not used_out[i]:
                used_out[i] = grown = True
        if not grown:
            return used_out


def live_equations(jaxpr, used_outputs: Sequence[bool] | None = None, *, enter: Callable | None = None):
    """The equations of ``jaxpr`` and of the jaxprs nested in it that computing its used outputs
    runs: what is left after dead-code elimination.

    A call-like equation (:func:`call_jaxpr`: ``jit``, checkpoints, custom derivatives, their
    primal jaxpr) runs the part of its body its used outputs need, a ``scan`` the part of its body
    its used outputs need with carries to a fixed point (:func:`scan_body_used_outputs`); any other
    equation with nested jaxprs (``while``, ``cond``) runs all of them and reads all its inputs
    when one of its outputs is used. Equations with effects always run and read all their inputs.

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      used_outputs: which outputs are used (default: all).
      enter: ``enter(eqn, enclosing)``: whether to walk into the jaxprs nested in ``eqn``
        (default: always); an equation not walked into reads all its inputs.

    Returns:
      A generator of ``(eqn, used, enclosing)``, last equation first (an equation before the
      equations of its nested jaxprs): ``used`` which of ``eqn``'s outputs are used, ``enclosing``
      as :func:`walk` gives it. Its return value (``StopIteration.value``) is :func:`used_inputs`.
    """
    jaxpr = as_jaxpr(jaxpr)
    used_outputs = [True] * len(jaxpr.outvars) if used_outputs is None else list(used_outputs)
    return _live(jaxpr, used_outputs, (), enter)


def _live(jaxpr, used_outputs, enclosing, enter):
    live = {v for v, used in zip(jaxpr.outvars, used_outputs) if used and isinstance(v, jcore.Var)}
    for eqn in reversed(jaxpr.eqns):
        used = [v in live for v in eqn.outvars]
        if not any(used) and not eqn.effects:
            continue
        yield eqn, used, enclosing
        reads = None
        if enter is None or enter(eqn, enclosing):
            inner = (*enclosing, eqn)
            if (sub := call_jaxpr(eqn)) is not None:
                reads = yield from _live(sub, used, inner, enter)
            elif eqn.primitive.name == SCAN:
                body_used = scan_body_used_outputs(eqn, used)
                reads = yield from _live(as_jaxpr(eqn.params["jaxpr"]), body_used, inner, enter)
            else:
                for sub in nested_jaxprs(eqn):
                    yield from _live(sub, [True] * len(sub.outvars), inner, enter)
        if reads is None or eqn.effects:
            reads = [True] * len(eqn.invars)
        live.update(v for v, r in zip(eqn.invars, reads) if r and isinstance(v, jcore.Var))
    return [v in live for v in jaxpr.invars]


def _reads_through(eqn, enclosing) -> bool:
    # Only the bodies whose liveness is finer than "every input" are worth walking into.
    return not eqn.effects and (call_jaxpr(eqn) is not None or eqn.primitive.name == SCAN)


def used_inputs(jaxpr, used_outputs: Sequence[bool] | None = None) -> list[bool]:
    """For each input of ``jaxpr``, whether computing its used outputs reads it
    (:func:`live_equations`).

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      used_outputs: which outputs are used (default: all).

    Returns:
      One bool per input variable of ``jaxpr``.
    """
    return drain(live_equations(jaxpr, used_outputs, enter=_reads_through))


def drain(generator):
    """Run ``generator`` to its end and return its return value."""
    while True:
        try:
            next(generator)
        except StopIteration as stop:
            return stop.value
