"""The one place jremat touches JAX's private modules (``jax._src``).

``jax._src`` changes without notice between JAX releases. Every private symbol jremat uses is
listed in :data:`PRIVATE_SYMBOLS` and loaded through :func:`private`, which raises
:class:`MissingJaxInternal` naming the symbol, what jremat needs it for and the running JAX
version, instead of an ``ImportError`` deep inside a policy. The test suite checks each symbol
(``tests/jremat/_engine/test_jax_compat.py``), so a JAX upgrade that removes one fails there first.

Under ``jax_remat3`` jremat binds two remat3 primitives of its own, built here on JAX's
``VJPHiPrimitive`` interface (:func:`remat3_name_tag`, :func:`remat3_offload`): JAX 0.10.2's
``checkpoint_name`` has no batching rule (``vmap``, ``jax.jacfwd``) and its ``custom_remat``
cannot run outside differentiation (an ``init`` call, or ``jit`` of the forward pass).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import numbers
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

#: (module, attribute) -> what jremat uses it for. Keep in sync with the accessors below.
PRIVATE_SYMBOLS: dict[tuple[str, str], str] = {
    ("jax._src.source_info_util", "summarize"): "source lines (file:line) of equations in saved-residual reports",
    ("jax._src.source_info_util", "user_context"): "keeping user source lines on re-bound equations",
    ("jax._src.source_info_util", "current_name_stack"): "keeping name stacks on re-bound equations",
    ("jax._src.ad_checkpoint", "saved_residuals"): "listing the residuals jax.vjp keeps (tests and reports)",
    ("jax._src.source_info_util", "register_exclusion"): "attributing saved values to the user's source "
    "lines rather than to jremat's own wrappers",
    ("jax._src.ad_checkpoint", "CheckpointName"): "reading checkpoint_name tags in jaxprs traced under "
    "jax_remat3 (saved-residual reports), and the base of jremat's remat3 name tag, which also batches",
    ("jax._src.config", "remat3"): "switching between JAX's remat engines (the jax_remat3 flag)",
    ("jax._src.core", "trace_ctx"): "telling forward-mode differentiation (jvp, linearize) from reverse "
    "mode, under which the cotangent tie (jremat._engine.tie) cannot apply, and a vmap that batches a "
    "checkpoint's inputs before any differentiation does",
    ("jax._src.source_info_util", "set_name_stack"): "keeping the name stacks of a tied checkpoint's "
    "equations what jax.checkpoint gives them (jremat._engine.tie)",
    ("jax._src.source_info_util", "NameStack"): "keeping the name stacks of a tied checkpoint's "
    "backward pass what jax.checkpoint gives them (jremat._engine.tie)",
    ("jax._src.config", "trace_context"): "keying jremat's trace caches on the configuration a trace "
    "depends on (x64, default device, ...), as jax.jit's cache does",
}


class MissingJaxInternal(ImportError):
    """A private JAX symbol jremat relies on is absent from the running JAX."""


def private(module: str, name: str) -> Any:
    """Return the private symbol ``module.name`` listed in :data:`PRIVATE_SYMBOLS`.

    Args:
      module: the ``jax._src`` module path.
      name: the attribute of that module.

    Raises:
      KeyError: if the pair is not listed in :data:`PRIVATE_SYMBOLS` (every private use is listed).
      MissingJaxInternal: if the running JAX lacks the module or the attribute.
    """
    purpose = PRIVATE_SYMBOLS[(module, name)]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise MissingJaxInternal(
            f"jremat needs JAX's private {module}.{name} for {purpose}, but JAX {jax.__version__} "
            f"does not have it ({type(err).__name__}: {err}); update jremat/_jax_compat.py for this "
            "JAX release or install a JAX version jremat supports"
        ) from err


def _optional(module: str, name: str) -> Any:
    try:
        return private(module, name)
    except MissingJaxInternal:
        return None


_trace_context: Callable | None = _optional("jax._src.config", "trace_context")


def trace_context() -> tuple:
    """The configuration values a trace depends on (``jax_enable_x64`` and the rest), hashable.

    JAX's own ``trace_context`` where this JAX has it; otherwise the x64 flag alone.
    """
    if _trace_context is not None:
        return _trace_context()
    return (bool(jax.config.jax_enable_x64),)  # type: ignore[attr-defined]


# Source-line helpers are optional: reports fall back to "unknown" without them.
source_summarize: Callable | None = _optional("jax._src.source_info_util", "summarize")
source_user_context: Callable | None = _optional("jax._src.source_info_util", "user_context")
source_current_name_stack: Callable | None = _optional("jax._src.source_info_util", "current_name_stack")


def exclude_from_tracebacks(path: str) -> None:
    """Make JAX skip frames of the file ``path`` when it attributes equations to source lines
    (as it skips its own files); a no-op on a JAX without that hook."""
    register = _optional("jax._src.source_info_util", "register_exclusion")
    if register is not None:
        register(path)


def checkpoint_name_of(prim) -> str | None:
    """The name that ``prim``, the ``_prim`` parameter of a jax_remat3 tag equation, gives its
    value, if it is JAX's private ``CheckpointName``; else ``None`` (also on a JAX without it, where
    no remat3 tags can exist)."""
    if prim is None:
        return None
    checkpoint_name_type = _optional("jax._src.ad_checkpoint", "CheckpointName")
    if checkpoint_name_type is None or not isinstance(prim, checkpoint_name_type):
        return None
    return prim.params["name"]


def scan_counts(eqn) -> tuple[int, int]:
    """``(constants, carried values)`` of a ``scan`` equation: how its leading inputs split.

    A scan's parameters are private to JAX: older releases give the counts (``num_consts``,
    ``num_carry``); newer ones a flat tree of (constants, carry, scanned inputs) (``ft_in``).
    Chosen from the parameters the equation has.

    Args:
      eqn: a jaxpr equation of the ``scan`` primitive.

    Returns:
      ``(number of constant inputs, number of carried inputs)``; the scanned inputs follow them.

    Raises:
      MissingJaxInternal: if the equation has neither form.
    """
    params = eqn.params
    if "num_consts" in params and "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    raise MissingJaxInternal(
        f"JAX {jax.__version__}'s scan equation has neither num_consts/num_carry nor ft_in "
        f"(it has {', '.join(sorted(params))}); jremat needs them to follow values through layer loops "
        "in saved-residual reports"
    )


def saved_residuals(fn: Callable, *args, **kwargs) -> list:
    """``[(aval, description)]`` of every value ``jax.vjp(fn, *args)`` keeps for the backward pass.

    JAX's own (private) ``saved_residuals``, as ``jax.ad_checkpoint.print_saved_residuals`` prints it.

    Raises:
      MissingJaxInternal: if the running JAX lacks it.
    """
    return list(private("jax._src.ad_checkpoint", "saved_residuals")(fn, *args, **kwargs))


def remat3_flag_exists() -> bool:
    """Whether the running JAX has the ``jax_remat3`` flag (both remat engines present)."""
    try:
        private("jax._src.config", "remat3")
    except MissingJaxInternal:
        return False
    return True


def remat3_enabled(value: bool):
    """Context manager setting ``jax_remat3`` to ``value`` for the code inside it (thread-local).

    Raises:
      MissingJaxInternal: if the running JAX has no ``jax_remat3`` flag.
    """
    return private("jax._src.config", "remat3")(value)


def classic_remat_context():
    """Context manager under which ``jax.checkpoint`` and ``checkpoint_name`` emit the classic
    primitives (``remat2``, ``name``); a no-op on a JAX without the ``jax_remat3`` flag."""
    if not remat3_flag_exists():
        return contextlib.nullcontext()
    return remat3_enabled(False)


def batched_first(values) -> bool:
    """Whether a ``vmap`` batches ``values`` before any differentiation sees them.

    True when the innermost trace that owns one of the tracers among ``values`` is a batch trace
    (``jax.grad(lambda x: jax.vmap(f)(x))`` calling ``f``): JAX batches an equation on those values
    first and differentiates the batched equation. False outside ``vmap``, when a differentiation
    trace owns them first (``jax.vmap(jax.grad(f))``), and for values no active trace owns.

    Args:
      values: a pytree (arrays, tracers, anything else).

    Raises:
      MissingJaxInternal: if the running JAX has no trace context.
    """
    tracers = [leaf for leaf in jax.tree.leaves(values) if isinstance(leaf, jax.core.Tracer)]
    if not tracers:
        return False
    trace = private("jax._src.core", "trace_ctx").trace
    while trace is not None:
        if any(getattr(t, "_trace", None) is trace for t in tracers):
            return type(trace).__name__ == "BatchTrace"
        trace = getattr(trace, "parent_trace", None)
    return False


def keep_name_stack() -> Callable[[], contextlib.AbstractContextManager]:
    """A context-manager factory that sets JAX's name stack back to the one current now.

    Equations bound inside carry the name stack of the place this was called, not the
    transformations entered since (a ``jvp(...)`` that ``jax.vjp`` adds); a no-op on a JAX
    without name stacks.
    """
    set_name_stack = _optional("jax._src.source_info_util", "set_name_stack")
    if set_name_stack is None or source_current_name_stack is None:  # pragma: no cover
        return contextlib.nullcontext
    stack = source_current_name_stack()
    return lambda: set_name_stack(stack)


def skip_next_name_transform() -> contextlib.AbstractContextManager:
    """A context manager under which the next transformation JAX enters adds nothing to the name stack.

    ``jax.vjp``'s pullback enters ``transpose``: called inside this, the equations it binds carry
    the name stack they would carry had the caller's own backward pass transposed them directly.
    A no-op on a JAX whose name stacks are not built that way.
    """
    name_stack_type = _optional("jax._src.source_info_util", "NameStack")
    set_name_stack = _optional("jax._src.source_info_util", "set_name_stack")
    if name_stack_type is None or set_name_stack is None or source_current_name_stack is None:  # pragma: no cover
        return contextlib.nullcontext()
    skipping = _skipping_name_stack(name_stack_type)
    if skipping is None:  # pragma: no cover
        return contextlib.nullcontext()
    return set_name_stack(skipping(source_current_name_stack().stack))


@functools.cache
def _skipping_name_stack(name_stack_type) -> Any:
    """A subclass of JAX's ``NameStack`` whose ``transform`` returns the plain stack unchanged (once:
    the result is a plain ``NameStack``); ``None`` if ``NameStack`` cannot be subclassed so."""
    try:

        class SkippingNameStack(name_stack_type):
            __slots__ = ()

            def transform(self, transform_name: str):
                return name_stack_type(self.stack)

            def __eq__(self, other) -> bool:
                return isinstance(other, name_stack_type) and self.stack == other.stack

            __hash__ = name_stack_type.__hash__

        SkippingNameStack(())
    except (TypeError, AttributeError):  # pragma: no cover
        return None
    return SkippingNameStack


def forward_mode_active() -> bool:
    """Whether a forward-mode differentiation is tracing the current call.

    True under ``jax.jvp`` / ``jax.jacfwd`` / ``jax.hessian``'s outer pass (a JVP trace) and
    under ``jax.linearize`` (a linearize trace that is not building a VJP); False under
    ``jax.grad`` / ``jax.vjp`` and outside any differentiation.

    Raises:
      MissingJaxInternal: if the running JAX has no trace context.
    """
    trace = private("jax._src.core", "trace_ctx").trace
    while trace is not None:
        kind = type(trace).__name__
        if kind == "JVPTrace" or (kind == "LinearizeTrace" and not getattr(trace, "is_vjp", True)):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def classic_name_primitive():
    """The primitive a classic ``checkpoint_name`` binds (``name``), as classic policy callbacks see it."""
    return _remat3_primitives().name_primitive


def remat3_name_tag(x, name: str):
    """``x`` tagged ``name`` for remat3 checkpoints: JAX's ``checkpoint_name`` that also batches.

    Saved exactly when JAX's own remat3 tag would be: under ``save_only_these_names`` listing
    ``name``, ``save_any_names_but_these`` not listing it, or ``everything_saveable``. Unlike JAX
    0.10.2's tag it has a batching rule, so ``vmap`` and ``jax.jacfwd`` pass through it; JAX's
    saved-residual reports read it as a ``checkpoint_name`` (it is a subclass).

    Raises:
      MissingJaxInternal: if the running JAX lacks ``CheckpointName``.
    """
    return _remat3_primitives().tag(name, jax.typeof(x))(x)


def remat3_offload(x, src, dst):
    """``x`` unchanged; inside a remat3 checkpoint the residual is its copy in ``dst`` memory.

    The forward pass copies ``x`` to ``dst`` (a ``jax.memory.Space``) and the checkpoint keeps
    that copy; the backward pass copies it back to ``src`` instead of recomputing ``x``. Outside
    a checkpoint, and under ``jit``, ``vmap``, ``jax.jvp`` or ``jax.linearize``, it is the identity.

    Raises:
      MissingJaxInternal: if the running JAX lacks the hijax primitive interface.
    """
    return _remat3_primitives().offload(jax.typeof(x), src, dst)(x)


_remat3_primitives_built: list = []  # the one _Remat3Primitives, once built
_remat3_primitives_lock = threading.Lock()


def _remat3_primitives() -> _Remat3Primitives:
    """jremat's remat3 primitives, built once: every thread must tag and offload with the same classes."""
    if not _remat3_primitives_built:
        with _remat3_primitives_lock:
            if not _remat3_primitives_built:
                _remat3_primitives_built.append(_build_remat3_primitives())
    return _remat3_primitives_built[0]


def _build_remat3_primitives() -> _Remat3Primitives:
    checkpoint_name_type: Any = private("jax._src.ad_checkpoint", "CheckpointName")
    try:
        from jax.experimental.hijax import VJPHiPrimitive
    except ImportError as err:
        raise MissingJaxInternal(
            f"jremat's remat3 lowering needs jax.experimental.hijax.VJPHiPrimitive, which JAX "
            f"{jax.__version__} does not have ({err}); turn jax_remat3 off"
        ) from err
    from jax.ad_checkpoint import checkpoint_name

    with classic_remat_context():
        name_primitive = jax.make_jaxpr(lambda v: checkpoint_name(v, "n"))(1.0).jaxpr.eqns[0].primitive
    cp = jax.checkpoint_policies

    def keeps(policy, name, aval) -> bool:
        if policy is None or policy is cp.nothing_saveable:
            return False
        if policy is cp.everything_saveable:
            return True
        return policy(name_primitive, aval, name=name) is True

    class Tag(checkpoint_name_type):
        def again(self, x):
            return Tag(self.name, jax.typeof(x))(x)

        def remat(self, policy, x):
            y = self.again(x)
            if keeps(policy, self.name, self.in_avals[0]):
                return y, functools.partial(_value_then_tangent_of, y)
            return y, _identity

        def jvp(self, primals, tangents):
            return self.again(primals[0]), tangents[0]

        def vjp_fwd(self, nzs_in, x):
            return self.again(x), None

        def lin(self, nzs_in, x):
            return self.again(x), None

        def batch(self, axis_data, args, dims):
            return self.again(args[0]), dims[0]

    class Offload(VJPHiPrimitive):
        # VJPHiPrimitive.__init__ copies ``params`` onto the instance: these are ``params``'s two keys.
        src: Any
        dst: Any

        def __init__(self, aval, src, dst):
            self.in_avals = (aval,)
            self.out_aval = aval
            self.params = dict(src=src, dst=dst)
            super().__init__()

        def again(self, x):
            return Offload(jax.typeof(x), self.src, self.dst)(x)

        def expand(self, x):
            return x

        def remat(self, policy, x):
            y = self.again(x)
            copy = jax.device_put(y, self.dst)
            return y, lambda recomputed: _value_then_tangent_of(jax.device_put(copy, self.src), recomputed)

        def jvp(self, primals, tangents):
            return self.again(primals[0]), tangents[0]

        def vjp_fwd(self, nzs_in, x):
            return self.again(x), None

        def vjp_bwd_retval(self, residuals, g):
            return (g,)

        def lin(self, nzs_in, x):
            return self.again(x), None

        def linearized(self, residuals, t):
            return t

        def batch(self, axis_data, args, dims):
            return self.again(args[0]), dims[0]

    return _Remat3Primitives(tag=Tag, offload=Offload, name_primitive=name_primitive)


@dataclasses.dataclass(frozen=True)
class _Remat3Primitives:
    tag: type
    offload: type
    name_primitive: Any


def _identity(x):
    return x


@jax.custom_jvp
def _value_then_tangent_of(saved, recomputed):
    """``saved``, with the tangent of ``recomputed``: a remat3 residual that the backward pass
    reads instead of the recomputed value (JAX's ``dot_general`` remat rule does the same)."""
    return saved


@_value_then_tangent_of.defjvp
def _value_then_tangent_of_jvp(primals, tangents):
    return primals[0], tangents[1]


__all__ = [
    "PRIVATE_SYMBOLS",
    "MissingJaxInternal",
    "batched_first",
    "classic_remat_context",
    "classic_name_primitive",
    "exclude_from_tracebacks",
    "forward_mode_active",
    "keep_name_stack",
    "private",
    "remat3_enabled",
    "remat3_flag_exists",
    "remat3_name_tag",
    "remat3_offload",
    "checkpoint_name_of",
    "saved_residuals",
    "custom_vjp_forward_jaxpr",
    "scan_counts",
    "skip_next_name_transform",
    "source_current_name_stack",
    "source_summarize",
    "source_user_context",
]


def custom_vjp_forward_jaxpr(eqn):
    """``(jaxpr, consts)`` of a ``custom_vjp_call`` equation's forward rule, every input
    differentiated (its ``fwd_jaxpr_thunk``): it returns the residuals that are not inputs, then
    the outputs."""
    return eqn.params["fwd_jaxpr_thunk"].call_wrapped(*[True] * len(eqn.invars))


# What a custom_vjp backward rule may return as a real (not zero) cotangent.
_ARRAY_LIKE = (jax.Array, jax.core.Tracer, np.ndarray, np.generic, numbers.Number)


def custom_vjp_forward_and_backward(eqn, invals):
    """Run a ``custom_vjp_call`` equation's forward rule on ``invals``; return its residuals, its
    outputs and a function ``(residuals, output cotangents) -> input cotangents`` (its backward rule).

    Uses the equation's ``fwd_jaxpr_thunk``, ``out_trees`` and ``bwd`` parameters (JAX's
    custom_vjp calling convention: the forward jaxpr returns the residuals that are not inputs,
    then the outputs; ``out_trees()`` says which residuals are inputs). Returns ``None`` for a
    call with closed-over constants or symbolic-zero cotangents, which this convention leaves out.
    """
    params = eqn.params
    if params.get("num_consts", 0) or params.get("symbolic_zeros"):
        return None
    fwd_jaxpr, fwd_consts = custom_vjp_forward_jaxpr(eqn)
    res_and_outs = jax.core.eval_jaxpr(fwd_jaxpr, fwd_consts, *invals)
    _, res_tree, input_fwds = params["out_trees"]()
    n_new = res_tree.num_leaves - sum(f is not None for f in input_fwds)
    new_res, outs = list(res_and_outs[:n_new]), list(res_and_outs[n_new:])
    new_iter = iter(new_res)
    residuals = [next(new_iter) if f is None else invals[f] for f in input_fwds]
    bwd = params["bwd"]
    in_avals = [jax.typeof(x) for x in invals]

    def backward(res, cts_out):
        cts_in = bwd.call_wrapped(*res, *cts_out)
        # Newer JAX returns the flat cotangents beside an auxiliary value: ``(cts, aux)``.
        if len(cts_in) == 2 and isinstance(cts_in[0], (list, tuple)) and len(cts_in[0]) == len(in_avals):
            cts_in = cts_in[0]
        if len(cts_in) != len(in_avals):
            raise NotImplementedError(
                f"a custom_vjp backward rule returned {len(cts_in)} cotangents for {len(in_avals)} inputs; "
                "this JAX version's custom_vjp convention is not supported by jremat's kernel split"
            )
        # A zero cotangent (None or JAX's symbolic zero) becomes explicit zeros; a NumPy array or a
        # Python number a rule returns is a real cotangent.
        return [
            jax.numpy.asarray(ct) if isinstance(ct, _ARRAY_LIKE) else jax.numpy.zeros(a.shape, a.dtype)
            for ct, a in zip(cts_in, in_avals)
        ]

    return residuals, outs, backward
