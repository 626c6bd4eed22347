"""What a kernel costs: the one price every policy and analysis uses for code JAX cannot look into.

A *kernel* is an equation whose work is not a JAX op jremat can price one by one:

* a ``pallas_call`` (JAX's Pallas flash attention, splash attention, grouped matmuls, your own);
* an FFI custom call, ``jax.ffi.ffi_call`` (the ``ffi_call`` primitive: Transformer Engine,
  your own CUDA or C++). JAX's own cuDNN attention (``jax.nn.dot_product_attention(...,
  implementation="cudnn")``) binds primitives of its own, which are not kernels here.

A ``custom_vjp`` / ``custom_jvp`` function whose forward holds one costs its body, kernel included.

How a kernel is priced (:func:`kernel_cost`), first match wins:

1. **declared**: a declaration made with :func:`register_kernel` for the kernel's name (a
   ``pallas_call``'s ``name=``, an FFI call's target name) or a predicate on that name;
2. **cost estimate**: a ``pallas_call`` given ``cost_estimate=pl.CostEstimate(...)``: its
   ``flops + transcendentals`` (a transcendental is one FLOP in jremat's model, as an ``exp``
   outside a kernel is) and its ``bytes_accessed``;
3. **body x grid**: any other ``pallas_call``: the FLOPs of its kernel body at every point of its
   grid, summed (:func:`jremat._program.flop_model.kernel_body_flops`). The body runs with its
   ``program_id`` values known, so a loop whose trip count depends on the grid position (a causal
   kernel's loop over the key blocks at or before the query block) counts the iterations it
   runs there. Loads and stores of the kernel's blocks cost nothing; bytes accessed are the
   kernel's inputs and outputs, each once;
4. **undeclared**: any other kernel (an FFI call nobody declared) is priced as expensive, never
   as free: :data:`UNDECLARED_FLOPS_PER_BYTE` FLOPs per byte of its inputs and outputs, so
   ``skip_cheap`` keeps its outputs rather than running it again.

Attention, the convention: analytic attention FLOPs are those of its matrix products,
``4·b·h·s²·d`` forward (``q·kᵀ`` and ``p·v``), half that causal. JAX's Pallas flash attention
(``jax.experimental.pallas.ops.gpu.attention.mha``) gives no ``CostEstimate``, so it is priced by
body x grid, which counts what the kernel runs: its matmuls, one FLOP per element of its online
softmax (a few percent at a head width of 64), and, causal, the key blocks at or before each query
block, the diagonal ones in full: ``(n + 1) / (2n)`` of the unmasked kernel for ``n`` query
blocks, not ``1/2``. Its backward ``pallas_call`` (``mha_backward``) runs seven ``s x s x d``
products (it recomputes ``q·kᵀ`` and ``dO·vᵀ`` for ``dq``): ``14·b·h·s²·d``, causal about half.

Declarations are global to the process and read when a function is traced: declare a kernel
before the first trace of a function that runs it (a traced program is cached per shape).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
from collections.abc import Callable

import jax

from jremat._engine import jaxpr as _jaxpr
from jremat._program import flop_model as _flop_model

#: FLOPs per byte of inputs and outputs at which a kernel nobody declared is priced: the
#: arithmetic intensity of a large matmul, far above ``skip_cheap``'s threshold.
UNDECLARED_FLOPS_PER_BYTE = 64.0

#: How :func:`kernel_cost` found a price (:attr:`KernelCost.source`).
DECLARED = "declared"
COST_ESTIMATE = "cost estimate"
BODY_TIMES_GRID = "body x grid"
UNDECLARED = "undeclared"

#: Grid points at most at which a kernel body is priced; a larger grid is priced at this many
#: evenly spaced points and scaled to the whole grid.
MAX_PRICED_GRID_POINTS = 256


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """The price of one kernel call.

    Attributes:
      name: the kernel's name (a ``pallas_call``'s ``name``, an FFI call's target name).
      primitive: ``"pallas_call"`` or ``"ffi_call"``.
      flops: FLOPs of one call (the same model as :func:`jremat.jaxpr_flops`).
      bytes_accessed: bytes one call reads and writes.
      attention: whether the kernel is declared attention (:func:`register_kernel`).
      source: how the price was found: ``"declared"``, ``"cost estimate"``, ``"body x grid"``
        or ``"undeclared"``.
    """

    name: str
    primitive: str
    flops: float
    bytes_accessed: float
    attention: bool
    source: str


@dataclasses.dataclass(frozen=True)
class _Declaration:
    match: str | Callable[[str], bool]
    flops: Callable | float
    bytes_accessed: Callable | float | None
    attention: bool


_LOCK = threading.Lock()
# Guarded by _LOCK: declarations by exact name, and predicate declarations in registration order.
_BY_NAME: dict[str, _Declaration] = {}
_BY_PREDICATE: list[_Declaration] = []


def _check_amount(value, what: str, allow_none: bool = False):
    if value is None and allow_none:
        return
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise TypeError(
            f"register_kernel: {what} must be a function of (in_avals, out_avals) or a non-negative number"
            f"{' or None' if allow_none else ''}, got {value!r}"
        )


def register_kernel(
    match: str | Callable[[str], bool],
    *,
    flops: Callable | float,
    bytes_accessed: Callable | float | None = None,
    attention: bool = False,
) -> None:
    """Declare what a kernel costs, for every policy and analysis that prices ops.

    An FFI call (``jax.ffi.ffi_call``) is otherwise priced as expensive
    (:data:`UNDECLARED_FLOPS_PER_BYTE`); a ``pallas_call`` by its ``CostEstimate`` or its body
    times its grid. A declaration wins over both. Declaring the same name (or the same predicate
    object) again replaces the earlier declaration. Declare before a function that runs the
    kernel is first traced.

    Args:
      match: the kernel's name (an FFI target name such as ``"my_ffi_target"``, or a
        ``pallas_call``'s ``name``), or a function from a kernel's name to ``bool``. Names are
        looked up before predicates; predicates in the order they were declared.
      flops: FLOPs of one call: a number, or a function called as ``flops(in_avals, out_avals)``
        with two tuples of :class:`jax.ShapeDtypeStruct` (the call's operands and results).
      bytes_accessed: bytes one call reads and writes, as ``flops``; ``None``: the bytes of its
        operands and results.
      attention: whether the kernel is a fused attention kernel (:attr:`KernelCost.attention`):
        a forward one (its name holds none of :data:`jremat.kernels.BACKWARD_WORDS`) is then one
        that :func:`jremat.kernels.split_attention_kernels` splits and the attention kernel
        counts find, whatever its name.

    Raises:
      ValueError: if ``match`` is an empty name.
      TypeError: if ``match`` is neither a string nor callable, ``flops`` or ``bytes_accessed``
        is neither callable nor a finite non-negative number, or ``attention`` is not a bool.
    """
    if isinstance(match, str):
        if not match:
            raise ValueError("register_kernel: the kernel name must not be empty")
    elif not callable(match):
        raise TypeError(f"register_kernel: match must be a kernel name (str) or a predicate on the name, got {match!r}")
    _check_amount(flops, "flops")
    _check_amount(bytes_accessed, "bytes_accessed", allow_none=True)
    if not isinstance(attention, bool):
        raise TypeError(f"register_kernel: attention must be True or False, got {attention!r}")
    declaration = _Declaration(match, flops, bytes_accessed, attention)
    with _LOCK:
        if isinstance(match, str):
            _BY_NAME[match] = declaration
        else:
            _BY_PREDICATE[:] = [d for d in _BY_PREDICATE if d.match is not match] + [declaration]


def unregister_kernel(match: str | Callable[[str], bool]) -> bool:
    """Remove the declaration made with :func:`register_kernel` for ``match`` (the same name, or
    the same predicate object).

    Returns:
      Whether there was one.
    """
    with _LOCK:
        if isinstance(match, str):
            return _BY_NAME.pop(match, None) is not None
        kept = [d for d in _BY_PREDICATE if d.match is not match]
        removed = len(kept) != len(_BY_PREDICATE)
        _BY_PREDICATE[:] = kept
        return removed


def _declaration(name: str) -> _Declaration | None:
    with _LOCK:
        found = _BY_NAME.get(name)
        predicates = tuple(_BY_PREDICATE)
    if found is not None:
        return found
    return next((d for d in predicates if callable(d.match) and d.match(name)), None)


def is_kernel(eqn) -> bool:
    """Whether ``eqn`` is a kernel: a ``pallas_call`` or an FFI call (:data:`jremat._engine.jaxpr.KERNEL_PRIMITIVES`)."""
    return eqn.primitive.name in _jaxpr.KERNEL_PRIMITIVES


def kernel_label(eqn) -> str:
    """The name a kernel equation is declared and reported by: a ``pallas_call``'s ``name``, an
    FFI call's target name (``""`` if it has none)."""
    if eqn.primitive.name == _jaxpr.FFI_CALL:
        return str(eqn.params.get("target_name") or "")
    return str(eqn.params.get("name") or "")


def declared_attention(eqn) -> bool:
    """Whether ``eqn`` is a kernel declared ``attention=True`` (:func:`register_kernel`)."""
    if not is_kernel(eqn):
        return False
    declared = _declaration(kernel_label(eqn))
    return declared is not None and declared.attention


def _avals(variables) -> tuple:
    return tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in variables if hasattr(v.aval, "shape"))


def _io_bytes(eqn) -> float:
    return float(sum(_jaxpr.aval_bytes(v.aval) for v in (*eqn.invars, *eqn.outvars)))


def _declared_amount(amount, ins: tuple, outs: tuple, what: str, name: str) -> float:
    value = amount(ins, outs) if callable(amount) else amount
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"kernel {name!r}: its declared {what} (jremat.register_kernel) gave {value!r}; "
            "it must give a finite non-negative number"
        )
    return float(value)


def kernel_cost(eqn) -> KernelCost | None:
    """The price of a kernel equation (module docstring), or ``None`` if ``eqn`` is not a kernel.

    Args:
      eqn: a jaxpr equation.

    Raises:
      ValueError: if a declared cost function gives something other than a finite non-negative number.
    """
    if not is_kernel(eqn):
        return None
    name, primitive = kernel_label(eqn), eqn.primitive.name
    declared = _declaration(name)
    if declared is not None:
        ins, outs = _avals(eqn.invars), _avals(eqn.outvars)
        flops = _declared_amount(declared.flops, ins, outs, "flops", name)
        if declared.bytes_accessed is None:
            accessed = _io_bytes(eqn)
        else:
            accessed = _declared_amount(declared.bytes_accessed, ins, outs, "bytes_accessed", name)
        return KernelCost(name, primitive, flops, accessed, declared.attention, DECLARED)
    estimate = eqn.params.get("cost_estimate") if primitive == _jaxpr.PALLAS_CALL else None
    if estimate is not None:
        flops = float(estimate.flops) + float(estimate.transcendentals)
        return KernelCost(name, primitive, flops, float(estimate.bytes_accessed), False, COST_ESTIMATE)
    if primitive == _jaxpr.PALLAS_CALL:
        return KernelCost(name, primitive, _pallas_body_times_grid(eqn), _io_bytes(eqn), False, BODY_TIMES_GRID)
    accessed = _io_bytes(eqn)
    return KernelCost(name, primitive, UNDECLARED_FLOPS_PER_BYTE * accessed, accessed, False, UNDECLARED)


def _pallas_body_times_grid(eqn) -> float:
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    grid = tuple(d if isinstance(d, int) else 1 for d in eqn.params["grid_mapping"].grid)
    varying = sorted(a for a in _flop_model.program_id_axes(body) if a < len(grid))
    fixed_points = math.prod(d for a, d in enumerate(grid) if a not in varying)
    extents = [grid[a] for a in varying]
    count = math.prod(extents)
    if count == 0:
        return 0.0
    flat = range(count) if count <= MAX_PRICED_GRID_POINTS else _evenly_spaced(count, MAX_PRICED_GRID_POINTS)
    total = 0.0
    for index in flat:
        position = dict(zip(varying, _unravel(index, extents)))
        ids = tuple(position.get(a, 0) for a in range(len(grid)))
        total += _flop_model.kernel_body_flops(body, ids, grid, kernel_flops)
    return total * (count / len(flat)) * fixed_points


def _evenly_spaced(count: int, points: int) -> list[int]:
    return sorted({(i * count) // points for i in range(points)})


def _unravel(index: int, extents: list[int]) -> tuple[int, ...]:
    out = []
    for extent in reversed(extents):
        index, position = divmod(index, extent)
        out.append(position)
    return tuple(reversed(out))


def kernel_flops(eqn) -> float | None:
    """FLOPs of a kernel equation (:func:`kernel_cost`), ``None`` if it is not a kernel."""
    cost = kernel_cost(eqn)
    return None if cost is None else cost.flops


__all__ = ["KernelCost", "kernel_cost", "register_kernel", "unregister_kernel"]
