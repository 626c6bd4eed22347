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
  through shape-only ops such as reshape, transpose or convert, in either direction), and
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
    Param,
    Plan,
    PlanPolicy,
    Program,
    register,
    require_host_memory,
)
from jremat import _engine as engine
from jremat._program import SHAPE_ONLY_PRIMITIVES, ProgramCache, evaluate_tagged, jaxpr_tags
from jremat.names import check_found
from jremat.registry import REQUIRED


def _checked(fn: Callable, policy: CallbackPolicy, requirements, prevent_cse: bool) -> Callable:
    """``fn`` checkpointed under ``policy``'s callback, once its tags are checked against ``requirements``.

    ``fn`` is traced once and the checkpoint evaluates that trace, so a function with Python
    side effects (a Linen scope drawing RNG keys) runs once per new argument structure and avals
    (later calls reuse the trace, as with ``jax.checkpoint``).
    """

    cache = ProgramCache()

    def build(program: Program):
        checkpointed = engine.checkpoint(
            lambda *leaves: evaluate_tagged(program, {}, leaves), callback=policy.callback, prevent_cse=prevent_cse
        )
        return program, checkpointed

    @functools.wraps(fn)
    def call(*args, **kwargs):
        program, checkpointed = cache.traced(fn, args, kwargs, build)
        found = jaxpr_tags(program.closed_jaxpr.jaxpr)
        for wanted, name, key in requirements:
            check_found(wanted, found, policy=name, key=key)
        return jax.tree.unflatten(program.out_tree, checkpointed(*jax.tree.leaves((args, kwargs))))

    return call


class SaveNames(CallbackPolicy):
    """Save exactly the values tagged with the given names; recompute everything else."""

    def __init__(self, save: Iterable[str]):
        self.save = tuple(save)
        super().__init__(jax.checkpoint_policies.save_only_these_names(*self.save))

    def checkpoint(self, fn, *, prevent_cse=True):
        return _checked(fn, self, [(self.save, "names", "save")], prevent_cse)


def same_data_closure(program: Program, seeds: Iterable[int]) -> frozenset[int]:
    """Equation indices holding the same data as ``seeds``: connected through shape-only ops.

    Starting from the equations ``seeds``, follow shape-only equations (reshape, transpose,
    convert, name tags, ...) backwards to the producer of their input and forwards to their
    consumers, in both directions, until no new equation is reached.

    Args:
      program: the traced program.
      seeds: equation indices to start from.

    Returns:
      The seeds together with every equation reached.
    """
    eqns = program.closed_jaxpr.jaxpr.eqns
    producer = {}
    consumers: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            producer[v] = i
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                consumers.setdefault(v, []).append(i)
    shape_only = lambda i: eqns[i].primitive.name in SHAPE_ONLY_PRIMITIVES
    reached = set(seeds)
    stack = list(reached)
    while stack:
        i = stack.pop()
        neighbours = []
        if shape_only(i):  # its input is the same data
            neighbours += [producer[v] for v in eqns[i].invars if not isinstance(v, jcore.Literal) and v in producer]
        for v in eqns[i].outvars:  # shape-only consumers of its output are the same data
            neighbours += [j for j in consumers.get(v, ()) if shape_only(j)]
        for j in neighbours:
            if j not in reached:
                reached.add(j)
                stack.append(j)
    return frozenset(reached)


def stand_in_closure(program: Program, seeds: Iterable[int]) -> frozenset[int]:
    """Equations that would stand in for the excluded equations ``seeds`` if saved.

    Grows :func:`same_data_closure` until nothing changes by adding (1) every unnamed equation
    all of whose outputs are used only by excluded equations (it exists only to compute them:
    the matmul before a bias add, the scores before their mask), never crossing a value tagged
    with a name that is not excluded; and (2) every elementwise equation whose floating-point
    inputs are all excluded (a scaled or masked copy of an excluded value).

    Args:
      program: the traced program.
      seeds: equation indices to exclude.

    Returns:
      The excluded equation indices.
    """
    eqns = program.closed_jaxpr.jaxpr.eqns
    ops = program.ops
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    consumers: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                consumers.setdefault(v, []).append(i)
    program_outputs = {v for v in program.closed_jaxpr.jaxpr.outvars if not isinstance(v, jcore.Literal)}
    is_data = {
        v: jnp.issubdtype(getattr(v.aval, "dtype", jnp.int32), jnp.inexact) for v in program.closed_jaxpr.jaxpr.invars
    }
    for eqn in eqns:
        depends = any(is_data.get(v, False) for v in eqn.invars if not isinstance(v, jcore.Literal))
        for v in eqn.outvars:
            is_data[v] = depends
    seeds = frozenset(seeds)
    excluded = set(same_data_closure(program, seeds))
    changed = True
    while changed:
        changed = False
        for i, eqn in enumerate(eqns):
            if i in excluded or not eqn.outvars:
                continue
            op = ops[i]
            named_elsewhere = op.tensor_name is not None and i not in seeds and op.primitive != "name"
            only_feeds_excluded = (
                not named_elsewhere
                and op.tensor_name is None
                and all(v not in program_outputs for v in eqn.outvars)
                and all(consumers.get(v) and all(j in excluded for j in consumers[v]) for v in eqn.outvars)
            )
            data_inputs = [v for v in eqn.invars if not isinstance(v, jcore.Literal) and is_data.get(v, False)]
            copy_of_excluded = (
                op.is_elementwise
                and op.tensor_name is None
                and bool(data_inputs)
                and all(v in producer and producer[v] in excluded for v in data_inputs)
            )
            if only_feeds_excluded or copy_of_excluded:
                excluded |= same_data_closure(program, [i])
                changed = True
    return frozenset(excluded)


class SaveAllExcept(PlanPolicy):
    """Save every computed value except those tagged with the given names and their stand-ins."""

    def __init__(self, exclude: Iterable[str]):
        self.exclude = tuple(exclude)

    def plan(self, program: Program) -> Plan:
        found = {op.tensor_name for op in program.ops if op.primitive == "name"}
        check_found(self.exclude, found, policy="names_except", key="exclude")
        excluded = stand_in_closure(program, (op.index for op in program.ops_named(self.exclude)))
        return Plan(
            save=frozenset(
                op.index for op in program.ops if op.counted and not op.rng_derived and op.index not in excluded
            )
        )


class OffloadNames(CallbackPolicy):
    """Offload the values tagged ``offload`` to host memory, save ``save`` on device, recompute the rest."""

    offload_src = "device"
    offload_dst = "pinned_host"

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

    def checkpoint(self, fn, *, prevent_cse=True):
        require_host_memory(self.offload_dst)  # the backend may differ from construction time
        requirements = [(self.offload, "offload", "names"), (self.save, "offload", "save")]
        return _checked(fn, self, requirements, prevent_cse)


@register(
    "names",
    doc="Save exactly the values tagged with the listed names (checkpoint_name); recompute everything else.",
    params={"save": Param("names", REQUIRED, "checkpoint_name tags to save, joined by '+'")},
)
def names_policy(save: tuple[str, ...]) -> SaveNames:
    """Build the ``names`` policy."""
    return SaveNames(save)


@register(
    "names_except",
    doc="Save every computed value except those tagged with the listed names and the values holding "
    "the same data (their reshapes, transposes and unnamed producers through shape-only ops); "
    "never saves dropout masks.",
    params={"exclude": Param("names", REQUIRED, "checkpoint_name tags not to save, joined by '+'")},
)
def names_except_policy(exclude: tuple[str, ...]) -> SaveAllExcept:
    """Build the ``names_except`` policy."""
    return SaveAllExcept(exclude)


@register(
    "offload",
    doc="Move the values tagged names= to host memory (pinned_host) and back for the backward pass, "
    "save the values tagged save= on the device, recompute everything else. Errors on a backend "
    "without host memory.",
    params={
        "names": Param("names", REQUIRED, "tensor names to offload to host, joined by '+'"),
        "save": Param("names", (), "tensor names to keep on the device, joined by '+'"),
    },
)
def offload_policy(names: tuple[str, ...], save: tuple[str, ...]) -> OffloadNames:
    """Build the ``offload`` policy."""
    return OffloadNames(names, save)
