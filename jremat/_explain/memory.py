"""The memory measurements behind :func:`jremat.explain`: the gradient program it compiles, the
stack of copies of a block, and the lines that say memory did not fall.

:func:`flatten` makes a function of its array leaves (shape structs, mesh shardings kept);
:func:`gradient_program` is the VJP of such a function that :func:`jremat.explain` compiles;
:func:`chain_argnum` and :func:`stack_temps` measure a block as it is used, :data:`STACK_DEPTH`
copies in sequence; :func:`no_saving_line` and :func:`more_than_none_lines` word what the figures show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp

from jremat._apply.decorator import split_static
from jremat._engine import jaxpr as _jaxpr
from jremat._measure import memory as _memory


def is_dynamic(leaf) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))


def flatten(fn: Callable, args: tuple, kwargs: dict, param_argnums: Iterable[int]):
    """``(flat_fn, leaves, param_positions)``: ``fn`` as a function of its array leaves only.

    Leaves become shape structs; other leaves (bools, ints, strings) stay constants, as the
    decorator treats them. ``param_positions`` are the leaf positions of ``param_argnums``.
    """
    flat_fn, leaves, dynamic = split_static(fn, args, kwargs, is_dynamic)
    owners: list[int | None] = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    owners += [None] * (len(leaves) - len(owners))
    wanted = set(param_argnums)
    structs = [
        jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=mesh_sharding(leaves[i])) for i in dynamic
    ]
    params = tuple(j for j, i in enumerate(dynamic) if owners[i] in wanted)
    return flat_fn, structs, params


def mesh_sharding(leaf):
    """``leaf``'s sharding when it spans several devices (a mesh), else ``None``."""
    sharding = getattr(leaf, "sharding", None)
    return sharding if len(getattr(sharding, "device_set", ())) > 1 else None


def gradient_program(flat_fn: Callable, structs: list, with_value: bool = False) -> Callable:
    """The VJP of ``flat_fn`` (cotangent 1) w.r.t. its float leaves, as a function of all leaves;
    with ``with_value``, ``(value, vjp)`` (a training step's shape: the forward's result is used)."""
    floats = [i for i, s in enumerate(structs) if not _jaxpr.is_key(s) and jnp.issubdtype(s.dtype, jnp.inexact)]

    def grad_fn(*values):
        def of_diff(*d):
            full = list(values)
            for i, value in zip(floats, d):
                full[i] = value
            return flat_fn(*full)

        out, vjp = jax.vjp(of_diff, *[values[i] for i in floats])
        grads = vjp(
            jax.tree.map(
                lambda o: (
                    jnp.ones_like(o)  # keeps an explicit-axes output's sharding
                    if jnp.issubdtype(o.dtype, jnp.inexact)
                    else jnp.zeros(o.shape, jax.dtypes.float0)
                ),
                out,
            )
        )
        return (out, grads) if with_value else grads

    return grad_fn


def no_saving_line(
    label: str,
    recomputed: int,
    temp: int,
    base_temp: int,
    saved: int,
    base_saved: int,
    whole_function: bool,
    scan_layers: bool | None,
    stack: tuple[int, int, int] | None = None,
) -> str | None:
    """One line when compiled temp memory did not fall although the policy recomputes, else ``None``.

    Any fall of the residuals counts (:func:`jremat.diagnose_remat` with
    ``min_saved_drop=0``): the temp must show at least a quarter of it. ``stack`` is
    ``(depth, temp, baseline temp)`` of the function run ``depth`` times in sequence, each
    checkpointed (:func:`jremat.explain` on a block that chains), which says what the block saves as used.
    """
    if not recomputed:
        return None
    note = _memory.diagnose_remat(temp, base_temp, saved, base_saved, scan_layers=scan_layers, min_saved_drop=0.0)
    if note is None and temp < base_temp:
        return None
    if whole_function:  # the known cause: diagnose_remat's list of XLA causes does not apply first
        alone = (
            "a single checkpoint around the whole differentiated function cannot save: the backward pass starts "
            "right after the forward, so it recomputes all of it at once and every intermediate is alive again "
            f"(compiled temp {base_temp:,} -> {temp:,} bytes)"
        )
        if stack is not None and stack[1] < stack[2]:
            depth, stack_temp, base_stack_temp = stack
            return (
                f"one checkpoint ({label}): {alone}; as a block, {depth} in sequence each checkpointed, the "
                f"gradient's compiled temp falls {base_stack_temp:,} -> {stack_temp:,} bytes "
                f"({(base_stack_temp - stack_temp) // depth:,} per block): its saving where it is used in a stack"
            )
        in_stack = (
            f"; {stack[0]} in sequence each checkpointed did not save either ({stack[2]:,} -> {stack[1]:,} bytes)"
            if stack is not None
            else ""
        )
        return (
            f"no saving ({label}): residuals for the backward pass fell {base_saved:,} -> {saved:,} bytes but "
            f"{alone}{in_stack}; the residuals are the saving where the function is one of several differentiated "
            "together: checkpoint each block where the model calls it (@jremat.policy on the block, "
            "jremat.run_layers)"
        )
    if note is None:
        note = (
            f"the policy recomputes {recomputed} values but compiled temp memory did not fall "
            f"({base_temp:,} -> {temp:,} bytes); likely cause: XLA merged the recomputation back into the "
            "forward pass or scheduled it early"
        )
    return f"no saving ({label}): {note}"


#: Copies of a block run in sequence to measure its saving in a stack (:func:`jremat.explain`).
STACK_DEPTH = 4


def chain_argnum(fn: Callable, args: tuple, kwargs: dict, param_argnums: Iterable[int] = ()) -> int | None:
    """The first positional argument, not one of ``param_argnums``, whose structure, shapes and dtypes
    ``fn``'s output has, else ``None``: a block's output is fed back as its activations, never as its
    parameters."""
    params = set(param_argnums)
    flat_fn, structs, _ = flatten(fn, args, kwargs, ())
    try:
        out = jax.eval_shape(flat_fn, *structs)
    except Exception:  # a function that does not trace here is reported by explain_applied
        return None
    out_avals = [(tuple(o.shape), str(o.dtype)) for o in jax.tree.leaves(out)]
    for i, arg in enumerate(args):
        leaves = jax.tree.leaves(arg)
        if (
            i not in params
            and leaves
            and all(is_dynamic(leaf) for leaf in leaves)
            and jax.tree.structure(arg) == jax.tree.structure(out)  # type: ignore[operator]  # jaxlib: no stub
            and [(tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves] == out_avals
        ):
            return i
    return None


def stack_temps(remat_fn, fn, argnum: int, args: tuple, kwargs: dict, depth: int) -> tuple[int, int] | None:
    """Compiled temp bytes of the gradient of ``depth`` calls in sequence, the output fed back as
    argument ``argnum``: ``(with the policy, without)``; ``None`` where the backend reports none."""

    def chained(block):
        def stack(*a, **kw):
            values = list(a)
            for _ in range(depth):
                values[argnum] = block(*values, **kw)
            return values[argnum]

        return stack

    temps = []
    for block in (remat_fn, fn):
        flat, structs, _ = flatten(chained(block), args, kwargs, ())
        report = _memory.memory_report(gradient_program(flat, structs), *structs)
        if not report.available or report.temp_bytes is None:
            return None
        temps.append(report.temp_bytes)
    return temps[0], temps[1]


def more_than_none_lines(label, saved, base_saved, temp, base_temp) -> list[str]:
    """A line for each measure by which the policy keeps *more* than no remat at all."""
    lines = []
    if None not in (saved, base_saved) and saved > base_saved:
        lines.append(
            f"more than none ({label}): the policy keeps {saved:,} bytes of residuals for the backward pass, "
            f"more than the {base_saved:,} without remat"
        )
    if None not in (temp, base_temp) and temp > base_temp:
        lines.append(
            f"more than none ({label}): compiled temp memory of the gradient is {temp:,} bytes with the policy, "
            f"more than the {base_temp:,} without remat"
        )
    return lines


__all__ = [
    "STACK_DEPTH",
    "chain_argnum",
    "flatten",
    "gradient_program",
    "is_dynamic",
    "mesh_sharding",
    "more_than_none_lines",
    "no_saving_line",
    "stack_temps",
]
