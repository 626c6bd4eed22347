"""Name-based policies: ``names``, ``names_except`` and ``offload``.

They refer to the tensor names a model tags with :func:`jax.ad_checkpoint.checkpoint_name`:
the reference model's (:mod:`jremat.names`) or a user's own. Every name must be tagged
somewhere in the checkpointed function; one that matches nothing is an error listing the tags
found (never a policy that silently saves nothing).

* ``names:save=a+b`` saves exactly the values tagged ``a`` and ``b`` (JAX's
  ``save_only_these_names``) and recomputes everything else.
* ``names_except:exclude=a+b`` saves every value except those tagged ``a`` and ``b``. JAX's own
  ``save_anything_except_these_names`` is a stub that saves everything in JAX 0.10.2, so this
  is a :class:`jremat.PlanPolicy`: it tags every computed value of the traced program except
  the excluded ones *and every value that holds the same data* (connected to an excluded name
  through shape-only ops such as reshape, transpose or convert, in either direction; the other
  parts of a ``split`` are different data and stay saved, the split's operand is not), and
  every unnamed value that exists only to compute excluded ones (the matmul before a bias add,
  the scores before their mask) or is an elementwise function of excluded values alone, so
  that no stand-in of the same size is saved in place of an excluded value.
* ``offload:names=a+b[,save=c]`` moves the values tagged ``a`` and ``b`` to host memory
  (``pinned_host``) in the forward pass and brings them back for the backward pass, saves
  ``c`` on the device, and recomputes everything else (JAX's
  ``save_and_offload_only_these_names``). On a backend without host memory it raises
  :class:`ValueError` (see :func:`jremat.require_host_memory`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jremat import (
    CallbackPolicy,
    Plan,
    PlanPolicy,
    Program,
    kernels,
    register,
    require_host_memory,
)
from jremat.internal import BUILTIN_PARAMS, ProgramCache, evaluate_tagged, lower_checkpoint
from jremat.internal import jaxpr as _jaxpr
from jremat.names import check_found


def _checked(fn: Callable, policy: CallbackPolicy, requirements, prevent_cse: bool) -> Callable:
    """``fn`` checkpointed under ``policy``'s callback, once its tags are checked against ``requirements``.

    ``fn`` is traced once and the checkpoint evaluates that trace, so a function with Python
    side effects (a Linen scope drawing RNG keys) runs once per new argument structure and avals
    (later calls reuse the trace, as with ``jax.checkpoint``).
    """

    cache = ProgramCache()

    def build(program: Program):
        checkpointed = lower_checkpoint(
            lambda *leaves: evaluate_tagged(program, {}, leaves), callback=policy.callback, prevent_cse=prevent_cse
        )
        return program, checkpointed

    @functools.wraps(fn)
    def call(*args, **kwargs):
        program, checkpointed = cache.traced(fn, args, kwargs, build)
        found = _jaxpr.name_tags(program.closed_jaxpr.jaxpr)
        for wanted, name, key in requirements:
            check_found(wanted, found, policy=name, key=key)
        return jax.tree.unflatten(program.out_tree, checkpointed(*jax.tree.leaves((args, kwargs))))

    return call


class SaveNames(CallbackPolicy):
    """Save exactly the values tagged with the given names; recompute everything else."""

    def __init__(self, save: Iterable[str]):
        self.save = tuple(save)
        super().__init__(jax.checkpoint_policies.save_only_these_names(*self.save))

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        # A kernel's custom_vjp residuals become values tagged kernel_residuals (jremat.kernels).
        return _checked(kernels.split_kernels(fn), self, [(self.save, "names", "save")], prevent_cse)


def _wiring(program: Program) -> tuple[list, dict, dict]:
    """``(equations, producer, consumers)``: the equation index that makes each value and the
    indices of the equations that read it."""
    eqns = program.closed_jaxpr.jaxpr.eqns
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    consumers: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                consumers.setdefault(v, []).append(i)
    return eqns, producer, consumers


def _shape_only_pairs(eqn) -> list[tuple]:
    """``(input, output)`` pairs of a shape-only equation that hold the same data: positional
    when it has as many inputs as outputs (``optimization_barrier``), else every pair."""
    ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
    if len(ins) == len(eqn.outvars):
        return list(zip(ins, eqn.outvars))
    return [(a, b) for a in ins for b in eqn.outvars]


def same_data_closure(program: Program, seeds: Iterable) -> frozenset:
    """Values holding the same data as the values ``seeds``: connected through shape-only ops.

    From each value, follow shape-only equations (reshape, transpose, convert, name tags, ...)
    backwards to their input and forwards to their output, until no new value is reached. Only
    the one value a shape-only equation maps to is followed: the other outputs of an equation
    with several (the other parts of a ``split``) are different data and are not reached.

    Args:
      program: the traced program.
      seeds: values (jaxpr variables) to start from.

    Returns:
      The seeds together with every value reached.
    """
    eqns, producer, consumers = _wiring(program)
    shape_only = lambda i: eqns[i].primitive.name in _jaxpr.SHAPE_ONLY_PRIMITIVES
    reached = set(seeds)
    stack = list(reached)
    while stack:
        v = stack.pop()
        neighbours = []
        if v in producer and shape_only(producer[v]):  # its input is the same data
            neighbours += [a for a, b in _shape_only_pairs(eqns[producer[v]]) if b is v]
        for j in consumers.get(v, ()):  # so is a shape-only consumer's output
            if shape_only(j):
                neighbours += [b for a, b in _shape_only_pairs(eqns[j]) if a is v]
        for w in neighbours:
            if w not in reached:
                reached.add(w)
                stack.append(w)
    return frozenset(reached)


def stand_in_closure(program: Program, seeds: Iterable[int]) -> frozenset:
    """Values that are, or would stand in for, the excluded values if saved.

    Starts from the values tagged by the ``name`` equations ``seeds`` and grows
    :func:`same_data_closure` until nothing changes by adding (1) every unnamed value used only
    by equations all of whose outputs are excluded (it exists only to compute them: the matmul
    before a bias add, the scores before their mask), never crossing a value tagged with a name
    that is not excluded; and (2) every output of an elementwise equation
    (:attr:`jremat.Op.is_elementwise`) whose floating-point inputs are all excluded (a scaled or
    masked copy of an excluded value). A loop, scan, call or any other structured op is not
    such a copy.

    An equation that splits a value into parts (``split``) keeps its other parts: they are
    different data. Its operand holds the excluded part, so it is excluded too, along with the
    values it is an elementwise function of alone (the bias add after a fused projection and
    the matmul before it); but it is not excluded data itself, so what computes it (the input
    of the fused projection) does not count as existing only to compute excluded values.

    Args:
      program: the traced program.
      seeds: indices of ``name`` equations whose tagged values are excluded.

    Returns:
      The excluded values (jaxpr variables).
    """
    eqns, _, consumers = _wiring(program)
    ops = program.ops
    jaxpr = program.closed_jaxpr.jaxpr
    program_outputs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    named = {v for eqn in eqns if eqn.primitive.name == _jaxpr.NAME for v in (*eqn.invars, *eqn.outvars)}
    is_data = {v: jnp.issubdtype(getattr(v.aval, "dtype", jnp.int32), jnp.inexact) for v in jaxpr.invars}
    for eqn in eqns:
        depends = any(is_data.get(v, False) for v in eqn.invars if not isinstance(v, jcore.Literal))
        for v in eqn.outvars:
            is_data[v] = depends
    seed_values = [v for i in seeds for v in (*eqns[i].invars, *eqns[i].outvars) if not isinstance(v, jcore.Literal)]
    excluded = set(same_data_closure(program, seed_values))  # excluded data
    holders: set = set()  # values holding excluded data among other data (a split's operand)

    def droppable(v) -> bool:  # unnamed, read by some equation, not a result of the program
        return v not in named and v not in program_outputs and bool(consumers.get(v))

    changed = True
    while changed:
        changed = False
        for i, eqn in enumerate(eqns):
            op = ops[i]
            new: set = set()
            for v in eqn.outvars:
                if v in excluded or v in holders or not droppable(v):
                    continue
                # (1) used only by equations whose outputs are all excluded
                if all(eqns[j].outvars and all(w in excluded for w in eqns[j].outvars) for j in consumers[v]):
                    new.add(v)
            data_inputs = [v for v in eqn.invars if not isinstance(v, jcore.Literal) and is_data.get(v, False)]
            if op.is_elementwise and data_inputs and not any(v in named for v in eqn.outvars):
                # (2) an elementwise copy of excluded values
                if all(v in excluded for v in data_inputs):
                    new |= {v for v in eqn.outvars if v not in excluded}
            if new:
                excluded |= same_data_closure(program, new)
                changed = True
            held = set()
            # A split with an excluded part: its operand holds the excluded data.
            if eqn.primitive.name in _jaxpr.PARTS_PRIMITIVES and any(
                v in excluded or v in holders for v in eqn.outvars
            ):
                held |= {eqn.invars[0]} if droppable(eqn.invars[0]) else set()
            # Values read only by elementwise functions giving holders (the matmul before a bias add).
            for v in eqn.outvars:
                if v in holders or v in excluded or not droppable(v):
                    continue
                if all(
                    (ops[j].is_elementwise or eqns[j].primitive.name in _jaxpr.SHAPE_ONLY_PRIMITIVES)
                    and all(w in holders or w in excluded for w in eqns[j].outvars)
                    for j in consumers[v]
                ):
                    held.add(v)
            held -= holders | excluded
            if held:
                holders |= same_data_closure(program, held) - excluded
                changed = True
    return frozenset(excluded | holders)


class SaveAllExcept(PlanPolicy):
    """Save every computed value except those tagged with the given names and their stand-ins."""

    def __init__(self, exclude: Iterable[str]):
        self.exclude = tuple(exclude)

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        # A kernel's custom_vjp residuals become values it saves, so the kernel runs once (jremat.kernels).
        return super().checkpoint_untied(kernels.split_kernels(fn), prevent_cse=prevent_cse)

    def plan(self, program: Program) -> Plan:
        found = {op.tensor_name for op in program.ops if op.primitive == _jaxpr.NAME}
        check_found(self.exclude, found, policy="names_except", key="exclude")
        seeds = (op.index for op in program.ops if op.primitive == _jaxpr.NAME and op.tensor_name in self.exclude)
        excluded = stand_in_closure(program, seeds)
        eqns, _, consumers = _wiring(program)
        save = set()
        for op in program.ops:
            if not op.counted or op.rng_derived:
                continue
            outs = eqns[op.index].outvars
            if not any(v in excluded for v in outs):
                save.add(op.index)
                continue
            # A plan saves whole equations: the parts of a split that are not excluded are saved
            # through the shape-only equations that read them (their reshape, their name tag).
            for v in outs:
                if v not in excluded:
                    save |= {j for j in consumers.get(v, ()) if eqns[j].primitive.name in _jaxpr.SHAPE_ONLY_PRIMITIVES}
        return Plan(save=frozenset(save))


class OffloadNames(CallbackPolicy):
    """Offload the values tagged ``offload`` to host memory, save ``save`` on device, recompute the rest."""

    offload_src = "device"
    offload_dst = "pinned_host"
    #: It decides by name, which a ``vmap`` does not change (its callback is opaque to jremat).
    reads_batched_equations = False

    def __init__(self, offload: Iterable[str], save: Iterable[str] = ()):
        self.offload = tuple(offload)
        self.save = tuple(save)
        both = [n for n in self.offload if n in self.save]
        if both:
            raise ValueError(
                f"policy 'offload': {', '.join(map(repr, both))} listed both to offload (names=) and to "
                "save on device (save=); a value is either offloaded or saved, give it once"
            )
        if not self.offload:
            raise ValueError("policy 'offload': names= must list at least one tensor name to offload")
        require_host_memory(self.offload_dst)
        super().__init__(
            jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=list(self.save),
                names_which_can_be_offloaded=list(self.offload),
                offload_src=self.offload_src,
                offload_dst=self.offload_dst,
            )
        )

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        require_host_memory(self.offload_dst)  # the backend may differ from construction time
        requirements = [(self.offload, "offload", "names"), (self.save, "offload", "save")]
        return _checked(kernels.split_kernels(fn), self, requirements, prevent_cse)


@register(
    "names",
    doc="Save exactly the values tagged with the listed names (checkpoint_name); recompute everything else.",
    params=BUILTIN_PARAMS["names"],
)
def names_policy(save: tuple[str, ...]) -> SaveNames:
    """Build the ``names`` policy."""
    return SaveNames(save)


@register(
    "names_except",
    doc="Save every computed value except those tagged with the listed names and the values holding "
    "the same data (their reshapes, transposes and unnamed producers through shape-only ops); "
    "never saves dropout masks.",
    params=BUILTIN_PARAMS["names_except"],
)
def names_except_policy(exclude: tuple[str, ...]) -> SaveAllExcept:
    """Build the ``names_except`` policy."""
    return SaveAllExcept(exclude)


@register(
    "offload",
    doc="Move the values tagged names= to host memory (pinned_host) and back for the backward pass, "
    "save the values tagged save= on the device, recompute everything else. Errors on a backend "
    "without host memory.",
    params=BUILTIN_PARAMS["offload"],
)
def offload_policy(names: tuple[str, ...], save: tuple[str, ...]) -> OffloadNames:
    """Build the ``offload`` policy."""
    return OffloadNames(names, save)
