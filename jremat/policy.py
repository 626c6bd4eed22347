"""Policy objects: what a rematerialized function keeps for the backward pass.

A :class:`Policy` turns a function into its checkpointed version. Three kinds exist:

* :class:`NoRemat` keeps everything (the function is returned unchanged).
* :class:`CallbackPolicy` wraps one of JAX's per-primitive policy callbacks.
* :class:`PlanPolicy` decides from the whole traced program (see :mod:`jremat.program`):
  it returns a :class:`Plan` of equations to save or offload, which is applied by tagging
  those outputs with unique names and checkpointing with a names policy.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import itertools
from typing import Callable

import jax

from jremat import engine as _engine
from jremat import program as _program

_tag_counter = itertools.count()


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

    Attributes:
      spec: the canonical spec string that builds this policy (``"every_k:k=4"``).
    """

    spec: str = ""

    @abc.abstractmethod
    def wrap(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """Return ``fn`` rematerialized under this policy.

        Args:
          fn: a function of pytrees of arrays.
          prevent_cse: passed to ``jax.checkpoint``; ``False`` is safe (and faster) under scan.
        """

    def __repr__(self) -> str:
        return f"<jremat policy {self.spec!r}>"


class NoRemat(Policy):
    """Keep every intermediate; no rematerialization at all."""

    def wrap(self, fn, *, prevent_cse=True):
        return fn


class CallbackPolicy(Policy):
    """A policy given by a JAX checkpoint-policy callback ``(prim, *avals, **params) -> bool``.

    The callback may also return :class:`jax.ad_checkpoint.Offloadable` /
    ``Recompute`` / ``Saveable``, as JAX allows.
    """

    def __init__(self, callback: Callable):
        self.callback = callback

    def wrap(self, fn, *, prevent_cse=True):
        return _engine.checkpoint(fn, callback=self.callback, prevent_cse=prevent_cse)


class PlanPolicy(Policy):
    """A policy that chooses saved values from the whole traced program.

    Subclasses implement :meth:`plan`. Values tagged for offload go to
    :attr:`offload_dst` memory (``pinned_host``) and come back for the backward pass.
    """

    offload_src: str = "device"
    offload_dst: str = "pinned_host"

    @abc.abstractmethod
    def plan(self, program: _program.Program) -> Plan:
        """Choose what to keep for ``program``; must depend on nothing but ``program``."""

    def wrap(self, fn, *, prevent_cse=True):
        @functools.wraps(fn)
        def rematerialized(*args, **kwargs):
            prog = _program.trace_program(fn, *args, **kwargs)
            chosen = self.plan(prog)
            prefix = f"jremat{next(_tag_counter)}"
            tags = {i: f"{prefix}/{i}" for i in sorted(chosen.save | chosen.offload)}
            save_names = [n for i in chosen.save for n in _program.tag_names(tags[i], prog.ops[i])]
            offload_names = [
                n for i in chosen.offload for n in _program.tag_names(tags[i], prog.ops[i])
            ]
            if offload_names:
                require_host_memory(self.offload_dst)
            tagged = _engine.checkpoint(
                lambda *leaves: _program.evaluate_tagged(prog, tags, leaves),
                save_names=save_names,
                offload_names=offload_names,
                offload_src=self.offload_src,
                offload_dst=self.offload_dst,
                prevent_cse=prevent_cse,
            )
            outs = tagged(*jax.tree.leaves((args, kwargs)))
            return jax.tree.unflatten(prog.out_tree, outs)

        return rematerialized


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
