"""Policy objects: what a rematerialized function keeps for the backward pass.

A :class:`Policy` turns a function into its checkpointed version. Three kinds exist:

* :class:`NoRemat` keeps everything (the function is returned unchanged).
* :class:`CallbackPolicy` wraps one of JAX's per-primitive policy callbacks; what each answer
  means (save, offload, recompute) is decided by :func:`jremat._engine.tags.callback_decision`, for
  the run and for :func:`jremat.explain` alike.
* :class:`PlanPolicy` decides from the whole traced program (see :mod:`jremat._program.program`):
  its :meth:`~PlanPolicy.plan` returns a :class:`Plan` of equations to save or offload, which
  is applied by :func:`jremat._engine.lowering.checkpoint_chosen` (the chosen outputs tagged with
  internal names, then checkpointed by name).

:meth:`Policy.wrap` is the checkpoint jremat applies (tied to its cotangent where needed:
:mod:`jremat._engine.tie`); :meth:`Policy.checkpoint_untied` is the untied checkpoint a subclass defines.
The built-in policies are in :mod:`jremat.policies`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable

import jax

from jremat._engine import lowering as _engine
from jremat._engine import tie as _tie
from jremat._program import program as _program
from jremat._spec.errors import PolicyDoesNotApply as PolicyDoesNotApply


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which outputs of a traced program a :class:`PlanPolicy` keeps.

    Attributes:
      save: equation indices whose outputs stay in device memory.
      offload: equation indices whose outputs go to host memory for the backward pass.
    """

    save: frozenset[int] = frozenset()
    offload: frozenset[int] = frozenset()


class Policy(abc.ABC):
    """A rematerialization policy.

    A subclass defines :meth:`checkpoint_untied`; :meth:`wrap` is what jremat applies (that
    checkpoint, tied to its cotangent where XLA could undo it). :meth:`checkpoint` is an alias of
    :meth:`checkpoint_untied`: a subclass may define either, and both names work.

    Attributes:
      spec: the canonical spec string that builds this policy (``"every_k:k=4"``).
      per_call: what is kept is decided on each call's own program, before a ``vmap`` around the
        call batches it (the checkpoint sits in the tie's ``custom_vjp`` even with
        ``prevent_cse=False``).
      reads_batched_equations: what is kept is decided by JAX on the equations as batched (a JAX
        policy callback whose answers a ``vmap`` may change, as
        ``dots_with_no_batch_dims_saveable``'s): under a ``vmap`` that batches the call first, the
        checkpoint runs untied, as ``jax.checkpoint`` would.
    """

    spec: str = ""
    per_call: bool = False
    reads_batched_equations: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        # Each class that defines one name gets the other, so that ``super()`` calls under
        # either name reach the parent's own definition. (Assigning a method is the point here.)
        if "checkpoint_untied" in own and "checkpoint" not in own:
            cls.checkpoint = own["checkpoint_untied"]  # type: ignore[method-assign]
        elif "checkpoint" in own and "checkpoint_untied" not in own:
            cls.checkpoint_untied = own["checkpoint"]  # type: ignore[method-assign]

    def wrap(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """Return ``fn`` rematerialized under this policy.

        With ``prevent_cse=True`` a checkpoint that recomputes anything is also tied to its
        cotangent (:mod:`jremat._engine.tie`), so that XLA cannot merge the recomputation back into the
        forward pass of straight-line code. A policy judged per call (:attr:`per_call`) sits in
        the tie's ``custom_vjp`` even untied; one that reads batched equations
        (:attr:`reads_batched_equations`) runs untied where a ``vmap`` batches the call first.

        Args:
          fn: a function of positional pytrees of arrays.
          prevent_cse: :func:`jremat._engine.tie.needs_tie` of where the checkpoint runs: ``True`` in
            straight-line code, ``False`` inside a ``lax.scan`` of more than one step; or one bool
            per argument leaf (``jax.checkpoint``'s tuple form), tied if any is ``True``.
        """
        checkpointed = self.checkpoint_untied(fn, prevent_cse=prevent_cse)
        tie = prevent_cse if isinstance(prevent_cse, bool) else any(prevent_cse)
        if (tie or self.per_call) and checkpointed is not fn:
            return _tie.tie_to_cotangent(checkpointed, tie=tie, untied_when_batched=self.reads_batched_equations)
        return checkpointed

    @abc.abstractmethod
    def checkpoint_untied(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """Return ``fn`` checkpointed under this policy, untied (``fn`` itself if nothing is recomputed).

        Args:
          fn: a function of positional pytrees of arrays.
          prevent_cse: passed to ``jax.checkpoint``.
        """

    def checkpoint(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """An alias of :meth:`checkpoint_untied`."""
        return self.checkpoint_untied(fn, prevent_cse=prevent_cse)

    def describe_match(self, program: _program.Program) -> list[str]:
        """How this policy matches ``program``, one line each, for :func:`jremat.explain`.

        The default says nothing; ``selective`` says where it found the attention core (by tag or
        by structure). A line that starts with ``"no "`` says the policy matched nothing here;
        :func:`jremat.explain` shows such lines only when no checkpoint matched. Raises nothing.
        """
        return []

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and bool(self.spec) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash((type(self), self.spec or id(self)))

    def __repr__(self) -> str:
        return f"<jremat policy {self.spec!r}>"


class NoRemat(Policy):
    """Keep every intermediate; no rematerialization at all."""

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        return fn


class CallbackPolicy(Policy):
    """A policy given by a JAX checkpoint-policy callback ``(prim, *avals, **params) -> bool``.

    The callback may also return :class:`jax.ad_checkpoint.Offloadable` /
    ``Recompute`` / ``Saveable``, as JAX allows.

    Under ``jax.vmap`` the callback is asked what ``jax.checkpoint`` asks it: about the batched
    equations where the ``vmap`` batches the call before any differentiation, so that
    ``dots_with_no_batch_dims_saveable`` saves no matmul the ``vmap`` gave a batch dimension.
    With ``per_call=True`` it is asked about each call's own program instead, unbatched (a
    pipeline's ``vmap`` over stages: each stage's weight matmuls are kept).

    Args:
      callback: the JAX policy callable.
      per_call: judge each call's own program, before batching (:attr:`Policy.per_call`).
    """

    def __init__(self, callback: Callable, per_call: bool = False):
        self.callback = callback
        self.per_call = per_call

    @property
    def reads_batched_equations(self) -> bool:  # type: ignore[override]
        """Whether a ``vmap`` that batches the call first may change what is kept (:attr:`Policy.reads_batched_equations`)."""
        return not self.per_call and not _engine.same_under_batching(self.callback)

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        return _engine.lower_checkpoint(fn, callback=self.callback, prevent_cse=prevent_cse)


class PlanPolicy(Policy):
    """A policy that chooses saved values from the whole traced program.

    Subclasses implement :meth:`plan`. Values tagged for offload go to
    :attr:`offload_dst` memory (``pinned_host``) and come back for the backward pass.
    """

    offload_src: str = "device"
    offload_dst: str = "pinned_host"
    #: ``checkpoint_name`` tags saved wherever they are, inside ``scan`` bodies too (which a
    #: :class:`Plan` of the top-level program does not reach).
    saved_tags: tuple[str, ...] = ()

    @abc.abstractmethod
    def plan(self, program: _program.Program) -> Plan:
        """Choose what to keep for ``program``; must depend on nothing but ``program``."""

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        def build(prog: _program.Program):
            chosen = check_plan(self.plan(prog), prog, self.spec or type(self).__name__)
            # A value only side effects use (jax.debug.print's argument) is not a residual;
            # tagging it would make JAX keep it for a backward pass that never reads it.
            effects_only = _program.feeds_only_effects(prog)
            chosen = Plan(save=chosen.save - effects_only, offload=chosen.offload - effects_only)
            if chosen.offload:
                require_host_memory(self.offload_dst)
            tagged = _engine.checkpoint_chosen(
                prog.closed_jaxpr,
                chosen.save,
                {i: (self.offload_src, self.offload_dst) for i in chosen.offload},
                saved_tags=self.saved_tags,
                prevent_cse=prevent_cse,
            )
            return prog.out_tree, tagged

        return _program.run_traced_once(fn, build)


def check_plan(plan: Plan, program: _program.Program, policy_name: str) -> Plan:
    """Check that ``plan`` names equations of ``program`` with outputs, each at most once.

    Raises:
      ValueError: if ``plan`` is not a :class:`Plan`, or an index is not an equation index of
        ``program``, or an equation is both saved and offloaded.
    """
    if not isinstance(plan, Plan):
        raise ValueError(f"policy {policy_name!r} returned {plan!r}, not a jremat.Plan")
    n_ops = len(program.ops)
    for kind, indices in (("save", plan.save), ("offload", plan.offload)):
        bad = sorted(i for i in indices if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_ops)
        if bad:
            raise ValueError(
                f"policy {policy_name!r}: Plan.{kind} holds {bad[:5]}, which are not equation indices of the "
                f"traced program; valid indices are 0..{n_ops - 1} (jremat.Op.index)"
            )
    both = sorted(plan.save & plan.offload)
    if both:
        raise ValueError(f"policy {policy_name!r}: equations {both[:5]} are both saved and offloaded; choose one")
    return plan


def require_host_memory(kind: str = "pinned_host") -> None:
    """Check that the default backend's devices can address memory of ``kind``.

    Raises:
      ValueError: if no device memory of that kind exists (offloading would silently do nothing).
    """
    device = jax.devices()[0]
    kinds = sorted({m.kind for m in device.addressable_memories()})
    if kind not in kinds:
        raise ValueError(
            f"offload needs memory kind {kind!r}, but {device.platform} device {device} "
            f"only has {', '.join(kinds)}; use a policy that recomputes instead"
        )
