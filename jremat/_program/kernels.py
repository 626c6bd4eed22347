"""The implementation of :mod:`jremat.kernels` (its public names are re-exported there)."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from jremat._engine import interpreter as _interpreter
from jremat._engine import jax_compat as _jax_compat
from jremat._engine import jaxpr as _jaxpr
from jremat._program import kernel_cost as _kernel_cost
from jremat._spec import names

#: A ``pallas_call`` whose name holds one of these (lower case) is an attention kernel...
ATTENTION_WORDS = ("mha", "flash", "attention", "splash")
#: ...and a backward one if its name also holds one of these.
BACKWARD_WORDS = ("backward", "bwd", "dq", "dkv", "preprocess")

#: The ``jax.named_scope`` around :func:`jremat.attention.blockwise_attention`'s forward loop.
BLOCKWISE_FORWARD_SCOPE = "jremat_blockwise_attention_fwd"
#: Primitives of ``jax.nn.dot_product_attention(..., implementation="cudnn")``'s forward kernel.
CUDNN_FORWARD_PRIMITIVES = _jaxpr.CUDNN_FORWARD_PRIMITIVES
#: The name stack scope (``<scope>.<kernel name>``) around a forward rule :func:`split_kernels` runs.
SPLIT_FORWARD_SCOPE = "jremat_kernel_fwd"

#: The kinds of attention forward kernel (:func:`jremat.attention.forward_kernel`).
BLOCKWISE = "blockwise"
CUDNN = "cudnn"
PALLAS = "pallas"
#: A ``custom_vjp`` kernel written in JAX that computes attention (an online softmax, or declared).
CUSTOM_ATTENTION = "custom attention"
#: The kinds of the other kernels :func:`count_kernel_runs` names.
PALLAS_CALL = _jaxpr.PALLAS_CALL
FFI_CALL = _jaxpr.FFI_CALL
CUSTOM = "custom_vjp"
#: Kinds whose kernel computes attention.
ATTENTION_KINDS = frozenset({BLOCKWISE, CUDNN, PALLAS, CUSTOM_ATTENTION})


def kernel_name(eqn) -> str | None:
    """The name of a ``pallas_call`` equation (``"mha_forward"``), ``""`` for an unnamed one,
    ``None`` for any other equation."""
    if eqn.primitive.name != PALLAS_CALL:
        return None
    return str(eqn.params.get("name") or "")


def is_attention_forward_kernel(eqn) -> bool:
    """Whether ``eqn`` is an attention forward kernel: a ``pallas_call`` named like one of
    :data:`ATTENTION_WORDS`, or a kernel declared ``attention=True``
    (:func:`jremat.register_kernel`), and named like none of :data:`BACKWARD_WORDS`."""
    name = _kernel_cost.kernel_label(eqn).lower() if _kernel_cost.is_kernel(eqn) else ""
    if any(w in name for w in BACKWARD_WORDS):
        return False
    return _kernel_cost.declared_attention(eqn) or (
        kernel_name(eqn) is not None and any(w in name for w in ATTENTION_WORDS)
    )


def holds_attention_kernel(jaxpr) -> bool:
    """Whether ``jaxpr`` or a jaxpr nested in it (not a kernel body) runs a Pallas attention forward kernel."""
    not_into_kernels = lambda eqn, _: kernel_name(eqn) is None
    return any(is_attention_forward_kernel(eqn) for eqn in _jaxpr.equations(jaxpr, enter=not_into_kernels))


def _declared(name: str | None) -> bool:
    """Whether kernels of ``name`` are declared attention (:func:`jremat.register_kernel` with
    ``attention=True``): for a ``custom_vjp`` kernel written in JAX, its function's name."""
    found = _kernel_cost._declaration(name) if name else None
    return found is not None and found.attention


# ---------------------------------------------------------------------------------------------
# Kernels written in JAX: custom_vjp / custom_jvp functions holding a loop


def _function_name(eqn) -> str:
    """The name of the function a ``custom_vjp``/``custom_jvp`` call wraps (``"custom_vjp"`` if unknown)."""
    info = getattr(eqn.params.get("call_jaxpr"), "jaxpr", eqn.params.get("call_jaxpr"))
    source = getattr(getattr(info, "debug_info", None), "func_src_info", None) or ""
    name = source.split(" ", 1)[0]
    return name if name and name != "<lambda>" else eqn.primitive.name.replace("_call", "")


def _rule_jaxpr(eqn):
    """The jaxpr that runs in a custom call's place in a gradient: a ``custom_vjp`` call's forward
    rule, a ``custom_jvp`` call's primal function; ``None`` where JAX does not give it."""
    if eqn.primitive.name == _jaxpr.CUSTOM_VJP_CALL:
        try:
            return _jax_compat.custom_vjp_forward_jaxpr(eqn)[0]
        except Exception:  # a rule that does not trace without values: fall back to the primal
            pass
    sub = eqn.params.get("call_jaxpr")
    return getattr(sub, "jaxpr", sub)


def _walk(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it, not into a ``pallas_call`` body."""
    return _jaxpr.equations(jaxpr, enter=lambda eqn, _: eqn.primitive.name != PALLAS_CALL)


def _computes_floats(eqn) -> bool:
    # A loop of index arithmetic only (which JAX's differentiation of a scan can hoist out of a
    # kernel loop into a loop of its own, under the same name scope) is not a pass of the kernel.
    return any(jnp.issubdtype(getattr(v.aval, "dtype", jnp.int32), jnp.floating) for v in eqn.outvars)


def _loop_signature(eqn) -> tuple:
    """What identifies a kernel's loop wherever a transformation copies it: its primitive, its
    trip count and the shapes and dtypes it gives (:func:`_matches`)."""
    outs = collections.Counter(
        (tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.outvars if hasattr(v.aval, "shape")
    )
    return eqn.primitive.name, eqn.params.get("length"), tuple(sorted(outs.items()))


def _matches(loop_signature: tuple, kernel_signature: tuple) -> bool:
    """Whether a loop is a copy of a kernel's loop. Differentiation hoists loop-invariant values out
    of a body and reorders its inputs, and a policy that saves values inside the loop (``dots``)
    adds outputs to the forward copy and leaves part of the body to the backward copy: a copy has
    the kernel loop's primitive and trip count and gives at least the values it gives."""
    if loop_signature[:2] != kernel_signature[:2]:
        return False
    outs = dict(loop_signature[2])
    return all(outs.get(aval, 0) >= n for aval, n in kernel_signature[2])


def _is_online_softmax(loop) -> bool:
    """A loop whose body runs two matrix products, an ``exp`` and a running maximum: attention
    one key block at a time."""
    prims = collections.Counter(e.primitive.name for b in _jaxpr.nested_jaxprs(loop) for e in _walk(b))
    running_max = prims[_jaxpr.MAX] + prims[_jaxpr.REDUCE_MAX]
    return prims[_jaxpr.DOT_GENERAL] >= 2 and prims[_jaxpr.EXP] >= 1 and running_max >= 1


def _opaque_kernel(eqn) -> tuple[str, str] | None:
    """``(name, kind)`` of a Pallas, FFI or cuDNN kernel equation, else ``None``."""
    prim = eqn.primitive.name
    if prim in CUDNN_FORWARD_PRIMITIVES:
        return prim, CUDNN
    if _kernel_cost.is_kernel(eqn):
        name = _kernel_cost.kernel_label(eqn) or prim
        if is_attention_forward_kernel(eqn):
            return name, PALLAS
        return name, PALLAS_CALL if prim == PALLAS_CALL else FFI_CALL
    return None


def custom_kernels(jaxpr) -> dict[tuple, tuple[str, str]]:
    """The kernels written in JAX that ``jaxpr`` calls: for each loop of a ``custom_vjp``
    call's forward rule (a ``custom_jvp`` call's primal) holding no Pallas or FFI kernel, its
    signature -> ``(function name, kind)``, the kind :data:`CUSTOM_ATTENTION` for an online
    softmax or a declared name, else :data:`CUSTOM`. :func:`count_kernel_runs` finds those loops in a
    gradient, where the call itself is gone."""
    found: dict = {}
    for eqn in _walk(getattr(jaxpr, "jaxpr", jaxpr)):
        if eqn.primitive.name not in _jaxpr.CUSTOM_CALL_PRIMITIVES:
            continue
        rule = _rule_jaxpr(eqn)
        if rule is None or any(_opaque_kernel(e) for e in _walk(rule)):
            continue
        name = _function_name(eqn)
        for loop in rule.eqns:
            if _jaxpr.is_loop(loop) and _computes_floats(loop):
                attention = _declared(name) or _is_online_softmax(loop)
                found[_loop_signature(loop)] = (name, CUSTOM_ATTENTION if attention else CUSTOM)
    return found


# ---------------------------------------------------------------------------------------------
# Counting runs


def _split_scope_name(eqn) -> str | None:
    """The kernel name of a :data:`SPLIT_FORWARD_SCOPE` around ``eqn``, else ``None``."""
    for part in str(eqn.source_info.name_stack).split("/"):
        if part.startswith(SPLIT_FORWARD_SCOPE + "."):
            return part[len(SPLIT_FORWARD_SCOPE) + 1 :]
    return None


def kernel_at(eqn, inside_blockwise: bool = False, custom: Mapping | None = None) -> tuple[str, str] | None:
    """``(name, kind)`` of the kernel equation ``eqn`` is (not what it holds), else ``None``.

    Args:
      eqn: a jaxpr equation.
      inside_blockwise: whether a jaxpr holding ``eqn`` runs in
        :data:`BLOCKWISE_FORWARD_SCOPE` (name stacks of nested jaxprs are relative).
      custom: :func:`custom_kernels` of the program the jaxpr was differentiated from.
    """
    found = _opaque_kernel(eqn)
    if found is not None or not _jaxpr.is_loop(eqn) or not _computes_floats(eqn):
        return found
    if inside_blockwise or BLOCKWISE_FORWARD_SCOPE in str(eqn.source_info.name_stack):
        return "blockwise_attention", BLOCKWISE  # a loop of the kernel: the loops inside it belong to it
    split = _split_scope_name(eqn)
    if split is not None:
        return split, CUSTOM_ATTENTION if _declared(split) or _is_online_softmax(eqn) else CUSTOM
    if custom:
        signature = _loop_signature(eqn)
        for kernel_signature, found in custom.items():
            if _matches(signature, kernel_signature):
                return found
    return None


def _in_blockwise_scope(eqns) -> bool:
    """Whether one of ``eqns`` (an equation and what holds it: name stacks of nested jaxprs are
    relative) runs in :data:`BLOCKWISE_FORWARD_SCOPE`."""
    return any(BLOCKWISE_FORWARD_SCOPE in str(e.source_info.name_stack) for e in eqns)


def count_kernel_runs(
    closed_jaxpr, *, loop_iterations: bool = False, primal=None, kinds: dict | None = None
) -> dict[str, int]:
    """How many times a traced program runs each kernel (module docstring), by name.

    Walks the program and every jaxpr nested in it (``jit``, ``scan``, ``while``, ``cond``,
    checkpoints, custom derivatives; not a kernel's own body). A kernel inside a loop body counts
    once, not once per iteration, unless ``loop_iterations``: then a kernel inside a ``scan`` (a
    layer stack) counts once per iteration (a ``while`` loop's trip count is unknown: once). Only
    kernels whose results the program's outputs use count: under ``jax_remat3`` a saved value's
    recomputation stays in the jaxpr as an unused input of a call, and XLA removes it.

    Args:
      closed_jaxpr: a ``jax.make_jaxpr`` result (a ``ClosedJaxpr``) or a ``Jaxpr``; usually of a
        value-and-gradient.
      loop_iterations: count a kernel inside a ``scan`` once per iteration.
      primal: the jaxpr of the function before differentiation, where the ``custom_vjp``
        kernels written in JAX are found (:func:`custom_kernels`); ``None``: only those in
        ``closed_jaxpr`` itself, and the Pallas, FFI, cuDNN and blockwise kernels.
      kinds: a dict that receives each counted name's kind (:data:`PALLAS`, :data:`PALLAS_CALL`, ...).

    Returns:
      Kernel name -> runs, for every kernel that runs.
    """
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    custom = custom_kernels(jaxpr)
    if primal is not None:
        custom.update(custom_kernels(primal))
    kinds = {} if kinds is None else kinds
    found_at = lambda eqn, enclosing: kernel_at(eqn, _in_blockwise_scope(enclosing), custom)
    # Not into a kernel's body, nor into a kernel's own loop (the loops inside it belong to it).
    enter = lambda eqn, enclosing: eqn.primitive.name != PALLAS_CALL and found_at(eqn, enclosing) is None
    runs: collections.Counter = collections.Counter()
    for eqn, _, enclosing in _jaxpr.live_equations(jaxpr, enter=enter):
        found = found_at(eqn, enclosing)
        if found is not None:
            runs[found[0]] += _jaxpr.trip_count(enclosing) if loop_iterations else 1
            kinds.setdefault(found[0], found[1])
    return dict(runs)


def count_grouped_matmuls(closed_jaxpr, *, loop_iterations: bool = True) -> int:
    """How many grouped matmuls (``jax.lax.ragged_dot``, or a kernel shaped like one such as
    megablox ``gmm``: a mixture of experts' expert matmuls) a traced program runs, every nested
    jaxpr walked as :func:`count_kernel_runs` walks them (only those whose results the outputs use).

    Args:
      closed_jaxpr: a ``jax.make_jaxpr`` result or a ``Jaxpr``; usually of a value-and-gradient.
      loop_iterations: count one inside a ``scan`` (a layer stack) once per iteration.
    """
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    return sum(
        _jaxpr.trip_count(enclosing) if loop_iterations else 1
        for eqn, _, enclosing in _jaxpr.live_equations(jaxpr)
        if eqn.primitive.name == _jaxpr.RAGGED_DOT_GENERAL
        or (eqn.primitive.name in _jaxpr.KERNEL_PRIMITIVES and _jaxpr.is_grouped_matmul(eqn))
    )


def kernel_reruns(runs: Mapping[str, float], baseline_runs: Mapping[str, float]) -> dict[str, tuple[float, float]]:
    """The kernels run more often in ``runs`` than in ``baseline_runs``: name -> ``(runs, baseline)``."""
    return {k: (n, baseline_runs.get(k, 0)) for k, n in sorted(runs.items()) if n > baseline_runs.get(k, 0)}


def avoid_rerun_advice(kind: str) -> str:
    """How to keep a kernel of ``kind`` so that its gradient runs it once (what each policy does
    with it, docs/policies.md "Your own kernel")."""
    if kind == CUDNN:
        return (
            "JAX names none of cuDNN's statistics, so no policy can keep them: use attention 'pallas' or "
            "'blockwise', whose output and log-sum-exp selective keeps"
        )
    if kind == BLOCKWISE:
        return f"selective keeps its output and log-sum-exp, or names:save={names.ATTN_CONTEXT}+{names.ATTN_LSE}"
    keep = f"names:save={names.KERNEL_RESIDUALS} (with your other names) keeps its output and residuals"
    if kind in (PALLAS, CUSTOM_ATTENTION):
        return f"selective keeps its output and log-sum-exp; or {keep}"
    return (
        f"{keep} where a custom_vjp wraps it; or, if it computes attention, jremat.register_kernel(name, ..., "
        "attention=True) for selective"
    )


def kernel_rerun_lines(reruns: Mapping[str, tuple[float, float]], kinds: Mapping[str, str], per: str = "") -> list[str]:
    """One line per re-run kernel: ``kernel mha_forward: 2 runs, none: 1; <how to avoid it>``."""
    return [
        f"kernel {name}: {n:g} runs{per}, none: {base:g}; {avoid_rerun_advice(kinds.get(name, CUSTOM))}"
        for name, (n, base) in reruns.items()
    ]


# ---------------------------------------------------------------------------------------------
# Splitting a kernel's custom_vjp call


def _is_kernel_call(eqn) -> bool:
    """A ``custom_vjp`` call whose forward runs a kernel (module docstring)."""
    if eqn.primitive.name != _jaxpr.CUSTOM_VJP_CALL:
        return False
    rule = _rule_jaxpr(eqn)
    return rule is not None and any(
        _opaque_kernel(e) is not None or (_jaxpr.is_loop(e) and _computes_floats(e)) for e in _walk(rule)
    )


def is_attention_call(eqn) -> bool:
    """A ``custom_vjp`` call whose forward runs an attention kernel: a Pallas one named like
    attention, a declared one, or a loop with an online softmax."""
    if eqn.primitive.name != _jaxpr.CUSTOM_VJP_CALL:
        return False
    if holds_attention_kernel(eqn.params["call_jaxpr"].jaxpr) or _declared(_function_name(eqn)):
        return True
    rule = _rule_jaxpr(eqn)
    if rule is None:
        return False
    kernels = [k for e in _walk(rule) if (k := _opaque_kernel(e)) is not None]
    if kernels:  # cuDNN's stays whole: its statistics are not ones this split is checked on
        return any(kind in ATTENTION_KINDS - {CUDNN} for _, kind in kernels)
    return any(_jaxpr.is_loop(e) and _is_online_softmax(e) for e in _walk(rule))


def _holds_call(jaxpr, which) -> bool:
    return any(which(e) for e in _jaxpr.equations(jaxpr, enter=lambda eqn, _: _jaxpr.is_scan(eqn)))


def split_kernels(fn: Callable, which: Callable = _is_kernel_call) -> Callable:
    """``fn`` with every ``custom_vjp`` call that runs a kernel (at the top level or inside
    ``lax.scan`` bodies) split into its forward rule, in the ordinary program, and its backward
    rule (module docstring).

    ``fn`` is traced once and its program evaluated (with no such call, as it runs). Calls inside
    ``cond`` branches or ``while`` bodies, and ``custom_jvp`` kernels, are left whole.

    Args:
      fn: a function of pytrees of arrays.
      which: which ``custom_vjp_call`` equations to split (default: every one whose forward rule
        runs a Pallas, FFI or cuDNN kernel or a loop).

    Returns:
      A function with ``fn``'s values and gradients.
    """

    @functools.wraps(fn)
    def split(*args, **kwargs):
        # The traced program is evaluated, not ``fn`` called again: a second call would draw
        # a Linen module's random values anew (its RNG counter moved on in the trace).
        closed, _, out_tree = _interpreter.trace_flat(fn, args, kwargs)
        flat = _evaluate_split(closed.jaxpr, closed.consts, jax.tree.leaves((args, kwargs)), which)
        return jax.tree.unflatten(out_tree, flat)

    return split


def split_attention_kernels(fn: Callable) -> Callable:
    """:func:`split_kernels` of the attention kernels only (a Pallas kernel named like attention,
    a ``custom_vjp`` loop with an online softmax, a declared kernel): what ``selective`` keeps."""
    return split_kernels(fn, is_attention_call)


def _evaluate_split(jaxpr, consts, flat_args, which) -> list:
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, flat_args))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = None
        if which(eqn):
            with jax.named_scope(f"{SPLIT_FORWARD_SCOPE}.{_function_name(eqn)}"):
                outs = _split_call(eqn, invals)
        elif _jaxpr.is_scan(eqn) and _holds_call(eqn.params["jaxpr"].jaxpr, which):
            outs = _interpreter.rebind_scan(
                eqn, invals, lambda body, args: _evaluate_split(body.jaxpr, body.consts, args, which)
            )
        if outs is None:
            outs = _interpreter.bind_equation(eqn, invals)
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _tag_kept(residuals, outs, invals) -> tuple[list, list]:
    """The residuals that are not the call's inputs, and the outputs, tagged
    :data:`jremat.names.KERNEL_RESIDUALS` (a value that is both, once: the output a policy keeps
    is then the residual the backward rule reads)."""
    inputs = {id(x) for x in invals}
    tagged: dict = {}

    def tag(x):
        if id(x) in inputs:
            return x
        if id(x) not in tagged:
            tagged[id(x)] = checkpoint_name(x, names.KERNEL_RESIDUALS)
        return tagged[id(x)]

    return [tag(r) for r in residuals], [tag(o) for o in outs]


def _split_call(eqn, invals) -> list | None:
    stopped = [lax.stop_gradient(x) for x in invals]
    found = _jax_compat.custom_vjp_forward_and_backward(eqn, stopped)
    if found is None:
        return None
    residuals, outs, backward = found
    # A residual the forward rule gives as a constant (megablox gmm's group count, a Python int
    # its backward rule needs static) reaches the backward rule as it is, not as a traced value.
    constants = {i: r for i, r in enumerate(residuals) if not isinstance(r, jax.Array)}
    traced = [r for i, r in enumerate(residuals) if i not in constants]
    traced, outs = _tag_kept(traced, outs, stopped)

    def all_residuals(res):
        it = iter(res)
        return [constants[i] if i in constants else next(it) for i in range(len(residuals))]

    @jax.custom_vjp
    def with_gradient(ins, res, outs):
        return outs

    def with_gradient_fwd(ins, res, outs):
        return outs, res

    def with_gradient_bwd(res, cts_out):
        # The residuals and outputs are functions of the inputs, whose gradient is all here.
        return list(backward(all_residuals(res), cts_out)), [None] * len(res), [None] * len(cts_out)

    with_gradient.defvjp(with_gradient_fwd, with_gradient_bwd)
    return list(with_gradient(list(invals), list(traced), outs))
