"""Keep or re-gather: the ``keep_gathered`` key every built-in single-function policy takes.

Under FSDP each weight is stored sharded and gathered where a matmul uses it. A checkpoint that
recomputes its forward in the backward pass gathers every weight again (the all-gather is part of
what it recomputes), and keeping matmul outputs (``dots``) does not keep the gathered weight that
the backward's ``dY @ Wᵀ`` reads. ``keep_gathered=true`` adds those gathered weights to what the
policy saves, found by structure on the checkpoint's jaxpr: the output of a
``sharding_constraint`` (on a mesh of explicit axes, a ``reshard``) whose operand comes from the
checkpoint's inputs alone (through shape-only ops: no activation feeds it) and that feeds a
``dot_general`` or is broadcast to more dimensions (a LayerNorm scale, a bias; through shape-only ops).

Memory: each checkpoint then keeps its gathered weights (per device, the whole weight where FSDP
stored ``1 / fsdp`` of it) from its forward pass to its backward pass; without remat they are
kept the same way, so the backward's all-gathers return to the count without remat. A weight
XLA gathers implicitly (no sharding constraint in the model) is not a value of the jaxpr and
cannot be kept: constrain it to its gathered placement in the block
(``jax.lax.with_sharding_constraint(w, gathered_sharding)``; ``jax.sharding.reshard`` on a mesh of
explicit axes, where a sharding constraint does not gather), as the reference model does with
``GPT(..., weight_sharding=...)``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
from jax.extend import core as jcore

from jremat._apply.policy import CallbackPolicy, NoRemat, PlanPolicy, Policy
from jremat._engine import jaxpr as _jaxpr
from jremat._engine import lowering as _engine
from jremat._program import program as _program
from jremat._program.program import Program

#: The spec key that keeps gathered weights.
KEY = "keep_gathered"


def gathered_weights(program: Program) -> frozenset[int]:
    """Equation indices of ``program`` whose outputs are gathered weights (module docstring).

    Args:
      program: a checkpointed function's traced :class:`jremat.Program`.

    Returns:
      The indices of the ``sharding_constraint`` equations found.
    """
    jaxpr = program.closed_jaxpr.jaxpr
    from_inputs, feeds_matmul = weight_flow(jaxpr)
    found = set()
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name not in _jaxpr.PLACEMENT_PRIMITIVES:
            continue
        operand = eqn.invars[0]
        if from_inputs.get(operand, False) and feeds_matmul(eqn.outvars[0]):
            found.add(i)
    return frozenset(found)


_RANK_RAISING_PRIMITIVES = frozenset({_jaxpr.BROADCAST_IN_DIM, "reshape", "expand_dims"})


def raises_rank(eqn) -> bool:
    """Whether ``eqn`` is a shape-only op that gives its operand more dimensions: how a parameter of
    fewer dimensions than the activations (a LayerNorm scale, a bias) meets them."""
    return eqn.primitive.name in _RANK_RAISING_PRIMITIVES and eqn.outvars[0].aval.ndim > eqn.invars[0].aval.ndim


@dataclasses.dataclass
class WeightUses:
    """How one variable is used, followed through shape-only ops and into calls (``jit``, a nested
    checkpoint, a custom derivative's function).

    Attributes:
      matmuls: the ``dot_general`` equations it is an operand of.
      raised: whether, given more dimensions (:func:`raises_rank`), it meets the activations in
        another op (a scale's multiply, a bias's add).
      other: whether it has any other use (without being given more dimensions first).
      reached: every variable it flows to on the way (itself included), inner jaxprs' too.
    """

    matmuls: list = dataclasses.field(default_factory=list)
    raised: bool = False
    other: bool = False
    reached: list = dataclasses.field(default_factory=list)


def weight_uses(jaxpr, var) -> WeightUses:
    """The uses of ``var`` in ``jaxpr`` (:class:`WeightUses`)."""
    uses = WeightUses()
    consumers_of: dict[int, dict] = {}

    def consumers(jp) -> dict:
        if id(jp) not in consumers_of:
            table: dict = {}
            for eqn in jp.eqns:
                for v in eqn.invars:
                    if not isinstance(v, jcore.Literal):
                        table.setdefault(v, []).append(eqn)
            consumers_of[id(jp)] = table
        return consumers_of[id(jp)]

    def follow(jp, v, depth: int, raised: bool) -> None:
        uses.reached.append(v)
        for eqn in consumers(jp).get(v, ()):
            inner = _jaxpr.call_jaxpr(eqn)
            if eqn.primitive.name == _jaxpr.DOT_GENERAL:
                uses.matmuls.append(eqn)
            elif eqn.primitive.name in _jaxpr.GATHER_PASS_THROUGH_PRIMITIVES and depth < 8:
                for out in eqn.outvars:
                    follow(jp, out, depth + 1, raised or raises_rank(eqn))
            elif inner is not None and depth < 8:
                for k, u in enumerate(eqn.invars):
                    if u is v:
                        follow(inner, inner.invars[k], depth + 1, raised)
            elif raised:
                uses.raised = True  # given more dimensions, it meets the activations here
            else:
                uses.other = True

    follow(jaxpr, var, 0, False)
    return uses


def weight_flow(jaxpr) -> tuple[dict, Callable[[Any], bool]]:
    """``(from_inputs, feeds_matmul)`` for a jaxpr: which variables come from its inputs alone
    through shape-only ops and placements (no activation feeds them), and a test of whether a
    variable is used as a weight (:func:`weight_uses`): as a ``dot_general`` operand, or given more
    dimensions to meet the activations."""
    from_inputs = {v: True for v in jaxpr.invars}
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        passes = eqn.primitive.name in _jaxpr.GATHER_PASS_THROUGH_PRIMITIVES | _jaxpr.PLACEMENT_PRIMITIVES
        for v in eqn.outvars:
            from_inputs[v] = passes and bool(ins) and all(from_inputs.get(u, False) for u in ins)

    def feeds_matmul(var) -> bool:
        uses = weight_uses(jaxpr, var)
        return bool(uses.matmuls) or uses.raised

    return from_inputs, feeds_matmul


#: The checkpoint name a gathered weight gets, so that the inner policy saves it wherever it is.
GATHERED_TAG = "jremat_gathered_weight"


def tag_gathered_weights(fn: Callable) -> Callable:
    """``fn`` with the output of each of its gathered weights (:func:`gathered_weights`) tagged
    :data:`GATHERED_TAG`; values and gradients unchanged.

    ``fn`` is traced once per input signature and its program evaluated with the tags (not called
    again: a second call would draw a Linen module's random values anew).
    """

    def build(prog: Program):
        tags = dict.fromkeys(gathered_weights(prog), GATHERED_TAG)
        return prog.out_tree, lambda *leaves: _program.evaluate_tagged(prog, tags, leaves)

    return _program.run_traced_once(fn, build)


def saving_tag(callback: Callable | None, tag: str) -> Callable:
    """A checkpoint-policy callback that saves what ``callback`` saves and every value tagged
    ``tag``. JAX's own policies (name lists, the dots policies) stay JAX policies,
    which remat3 applies inside ``scan`` bodies too; another callback is combined with the tag in
    a function, which remat3 applies at the checkpoint's top level only."""
    policies = jax.checkpoint_policies
    if callback is None or callback is policies.nothing_saveable:
        return policies.save_only_these_names(tag)
    if type(callback) in (_engine.DotsSaveable, _engine.DotsAndNames):
        dots = cast(Any, callback)
        dot_names: frozenset[str] = frozenset(getattr(dots, "saveable_names", ()))
        return _engine.DotsAndNames(saveable_names=dot_names | {tag}, only_if_no_batch_dims=dots.only_if_no_batch_dims)
    if type(callback) is _engine.GroupedDotsSaveable:
        grouped = cast(Any, callback)
        return _engine.GroupedDotsSaveable(
            only_if_no_batch_dims=grouped.only_if_no_batch_dims,
            saveable_names=grouped.saveable_names | {tag},
        )
    if type(callback) is _engine.SaveOnlyTheseNames:
        return policies.save_only_these_names(*cast(Any, callback).saveable_names, tag)

    def either(prim, *avals, **params):
        if prim.name == _jaxpr.NAME and params.get("name") == tag:
            return True
        return callback(prim, *avals, **params)

    return either


def _saving_gathered(callback: Callable | None) -> Callable:
    """:func:`saving_tag` with :data:`GATHERED_TAG`."""
    return saving_tag(callback, GATHERED_TAG)


class KeepTagged(Policy):
    """``inner`` plus the values a subclass tags :attr:`tag` in every checkpoint.

    ``inner`` checkpoints the tagged function (:meth:`tagged`) with the tag added to what it
    saves, so ``inner`` keeps everything else it does: its kernel split, its checks of the names
    it needs, its saves inside ``scan`` bodies.

    Args:
      inner: a :class:`jremat.CallbackPolicy` or :class:`jremat.PlanPolicy`.

    Raises:
      ValueError: for another kind of policy (a layer-stack policy, ``none``).
    """

    #: The spec key that asks for this wrapper.
    key: str = ""
    #: The checkpoint name the kept values get.
    tag: str = ""

    def __init__(self, inner: Policy):
        if not isinstance(inner, (CallbackPolicy, PlanPolicy)):
            raise ValueError(
                f"{self.key}=true applies to a policy of one function (a callback or plan policy), not {inner!r}"
            )
        self.inner = inner
        saving = copy.copy(inner)
        if isinstance(saving, PlanPolicy):
            saving.saved_tags = (*saving.saved_tags, self.tag)
        else:
            saving.callback = saving_tag(saving.callback, self.tag)
        self._saving = saving

    def tagged(self, fn: Callable, *, in_scan: bool = False) -> Callable:
        """``fn`` with the values to keep tagged :attr:`tag`; values and gradients unchanged.

        Args:
          fn: the checkpointed function.
          in_scan: the checkpoint runs in a scan of more than one step (built with ``prevent_cse=False``).
        """
        raise NotImplementedError

    @property
    def per_call(self) -> bool:  # type: ignore[override]
        return self._saving.per_call

    @property
    def reads_batched_equations(self) -> bool:  # type: ignore[override]
        return self._saving.reads_batched_equations

    @property
    def offload_src(self) -> str:
        return getattr(self.inner, "offload_src", "device")

    @property
    def offload_dst(self) -> str:
        return getattr(self.inner, "offload_dst", "pinned_host")

    def checkpoint_untied(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        tied = prevent_cse if isinstance(prevent_cse, bool) else any(prevent_cse)
        return self._saving.checkpoint_untied(self.tagged(fn, in_scan=not tied), prevent_cse=prevent_cse)


class KeepGathered(KeepTagged):
    """``inner`` plus the gathered weights of every checkpoint (:func:`gathered_weights`), tagged
    :data:`GATHERED_TAG` (:class:`KeepTagged`)."""

    key = KEY
    tag = GATHERED_TAG

    def tagged(self, fn: Callable, *, in_scan: bool = False) -> Callable:
        return tag_gathered_weights(fn)

    def describe_match(self, program: Program) -> list[str]:
        n = len(gathered_weights(program))
        lines = self.inner.describe_match(program)
        if not n:
            return [*lines, "no gathered weight (no sharding constraint on an input that feeds a matmul) to keep"]
        return [*lines, f"keeps {n} gathered weight{'s' if n != 1 else ''} (sharding constraint -> matmul)"]


def with_keep_gathered(policy: Policy, keep: bool) -> Policy:
    """``policy`` wrapped in :class:`KeepGathered` when ``keep``; ``none`` keeps everything already.

    Raises:
      ValueError: as :class:`KeepGathered`.
    """
    if not keep or isinstance(policy, NoRemat):
        return policy
    return KeepGathered(policy)
