"""Keep or re-issue: the ``keep_collectives`` key every built-in single-function policy takes.

On a mesh, a checkpoint that recomputes its forward pass in the backward pass issues its
collectives again: the all-gathers of FSDP's weights, an expert-parallel MoE's dispatch and
combine all-to-alls, a tensor-parallel block's all-reduces. ``keep_collectives=true`` adds the
output of every collective the recomputation would issue again to what the policy saves, so
the backward pass reads it instead:

* the collectives written inside :func:`jax.shard_map` (``all_gather``, ``all_to_all``,
  ``psum``/``pmean``/``pmax``/``pmin``, ``psum_scatter``, ``ppermute``; kinds in
  :data:`jremat._engine.jaxpr.COLLECTIVE_PRIMITIVES`), wherever they are: at the checkpoint's top
  level, inside ``shard_map`` and ``lax.scan`` bodies;
* the gathered weights the model writes (:func:`jremat._apply.gathered.gathered_weights`: a
  sharding constraint or reshard of an input that feeds a matmul), which is ``keep_gathered``.

The backward pass's own collectives (the transposes: a ``psum``'s broadcast, an all-to-all back)
are not recomputation and stay. A collective XLA inserts on its own (a weight sharded by
``NamedSharding`` and gathered where a matmul uses it, with no constraint in the model) is not
a value of the traced program and cannot be kept: make it explicit in the model
(``jax.lax.with_sharding_constraint`` to its gathered placement), as :func:`jremat.explain_applied`
says for each one it finds re-issued in the compiled step.

Memory: each checkpoint keeps its collectives' outputs (per device) from its forward pass to
its backward pass, as the step without remat keeps them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jremat._apply.gathered import KeepTagged, gathered_weights
from jremat._apply.policy import NoRemat, Policy
from jremat._engine import interpreter as _interpreter
from jremat._engine import jaxpr as _jaxpr
from jremat._program import program as _program
from jremat._program.program import Program

#: The spec key that keeps the outputs of collectives.
KEY = "keep_collectives"
#: The checkpoint name a collective's output gets, so that the inner policy saves it wherever it is.
COLLECTIVE_TAG = "jremat_collective"


def collective_kind(eqn) -> str | None:
    """The HLO collective kind ``eqn`` issues (:data:`jremat._engine.jaxpr.COLLECTIVE_PRIMITIVES`), or ``None``."""
    return _jaxpr.COLLECTIVE_PRIMITIVES.get(eqn.primitive.name)


def collective_counts(program: Program) -> dict[str, int]:
    """Collective equations of ``program`` that :class:`KeepCollectives` keeps, by HLO kind:
    those written in the program (inside ``shard_map`` and ``scan`` bodies too, each counted once,
    not per trip) and its gathered weights (``all-gather``).

    Args:
      program: a checkpointed function's traced :class:`jremat.Program`.

    Returns:
      ``{kind: count}`` for the kinds found.
    """
    counts: dict[str, int] = {}
    tagged_inside = lambda eqn, _: _jaxpr.is_scan(eqn) or _jaxpr.is_shard_map(eqn)  # as tag_collectives reaches
    for eqn in _jaxpr.equations(program.closed_jaxpr.jaxpr, enter=tagged_inside):
        kind = collective_kind(eqn)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    gathered = len(gathered_weights(program))
    if gathered:
        counts["all-gather"] = counts.get("all-gather", 0) + gathered
    return counts


def tag_collectives(fn: Callable) -> Callable:
    """``fn`` with the output of each collective and each gathered weight tagged
    :data:`COLLECTIVE_TAG` (:func:`collective_counts`); values and gradients unchanged.

    ``fn`` is traced once per input signature and its program evaluated with the tags (not
    called again: a second call would draw a Linen module's random values anew).
    """
    cache = _program.ProgramCache()

    def build(prog: Program):
        eqns = prog.closed_jaxpr.jaxpr.eqns
        gathered = {id(eqns[i]) for i in gathered_weights(prog)}

        def tag_of(eqn):
            return COLLECTIVE_TAG if id(eqn) in gathered or collective_kind(eqn) is not None else None

        return prog.out_tree, lambda *leaves: _interpreter.evaluate_tagged_where(prog.closed_jaxpr, tag_of, leaves)

    @functools.wraps(fn)
    def tagged(*args, **kwargs):
        out_tree, run = cache.traced(fn, args, kwargs, build)
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves((args, kwargs))))

    return tagged


class KeepCollectives(KeepTagged):
    """``inner`` plus the outputs of every checkpoint's collectives (:func:`collective_counts`),
    tagged :data:`COLLECTIVE_TAG` (:class:`jremat._apply.gathered.KeepTagged`).

    Args:
      inner: a :class:`jremat.CallbackPolicy` or :class:`jremat.PlanPolicy`.

    Raises:
      ValueError: for another kind of policy (a layer-stack policy, ``none``).
    """

    key = KEY
    tag = COLLECTIVE_TAG

    def tagged(self, fn: Callable) -> Callable:
        return tag_collectives(fn)

    def describe_match(self, program: Program) -> list[str]:
        counts = collective_counts(program)
        lines = self.inner.describe_match(program)
        if not counts:
            return [
                *lines,
                "no collective to keep (none written in a shard_map, no sharding constraint on an input that "
                "feeds a matmul); collectives XLA inserts on its own are not in the traced program",
            ]
        found = ", ".join(f"{n} {kind}{'s' if n != 1 else ''}" for kind, n in sorted(counts.items()))
        return [*lines, f"keeps the outputs of {found}"]


def with_keep_collectives(policy: Policy, keep: bool) -> Policy:
    """``policy`` wrapped in :class:`KeepCollectives` when ``keep``; ``none`` keeps everything already.

    Raises:
      ValueError: as :class:`KeepCollectives`.
    """
    if not keep or isinstance(policy, NoRemat):
        return policy
    return KeepCollectives(policy)


__all__ = [
    "COLLECTIVE_TAG",
    "collective_kind",
    "KEY",
    "KeepCollectives",
    "collective_counts",
    "tag_collectives",
    "with_keep_collectives",
]
