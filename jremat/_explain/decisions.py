"""Read a traced program's checkpoints: what each one's policy decides for every value it computes.

:func:`decisions` asks every checkpoint in a jaxpr (inside ``lax.scan`` bodies too) about each
value, exactly as JAX's partial evaluation does, and sums the answers by decision and place;
:func:`tags` lists the ``checkpoint_name`` tags a program carries. :mod:`jremat._explain.explain` turns
both into a report.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
from jax.extend import core as jcore

from jremat._engine import jaxpr as _jaxpr
from jremat._engine import tags as _tags
from jremat._explain import residuals as _residuals

SAVE = _tags.SAVE
OFFLOAD = _tags.OFFLOAD
RECOMPUTE = _tags.RECOMPUTE
EXCLUDE = "exclude"
#: Decisions in report order.
DECISIONS = (SAVE, OFFLOAD, RECOMPUTE, EXCLUDE)

_CHECKPOINT_PRIMITIVES = _jaxpr.CLASSIC_CHECKPOINT_PRIMITIVES
_IDENTITY = _jaxpr.IDENTITY_PRIMITIVES


@dataclasses.dataclass(frozen=True)
class Decision:
    """Values one decision of the policy covers, in one place.

    Attributes:
      decision: :data:`SAVE`, :data:`OFFLOAD`, :data:`RECOMPUTE` or :data:`EXCLUDE` (recomputed
        because the policy excludes their name).
      count: how many values, per execution of the checkpoint.
      bytes: their bytes, per execution.
      where: ``"top level"`` or the enclosing scan(s), ``"scan(length=2) at file:line (fn)"``.
      iterations: how often the checkpoint runs (the product of the enclosing scan lengths).
      names: the ``checkpoint_name`` tags among these values.
    """

    decision: str
    count: int
    bytes: int
    where: str
    iterations: int
    names: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """:attr:`bytes` times :attr:`iterations`."""
        return self.bytes * self.iterations


def _scope(eqn) -> str:
    return f"scan(length={eqn.params['length']}) at {_residuals._summarize_source(eqn)}"


def _where(scopes: Sequence[tuple[str, int]]) -> str:
    return "inside " + " > ".join(s for s, _ in scopes) if scopes else "top level"


def _iterations(scopes: Sequence[tuple[str, int]]) -> int:
    n = 1
    for _, length in scopes:
        n *= length
    return n


def tags(jaxpr) -> list[tuple[str, int, int]]:
    """``(name, bytes, iterations)`` of every ``checkpoint_name`` tag anywhere in ``jaxpr``."""
    return [
        (tag, _jaxpr.aval_bytes(eqn.outvars[0].aval), _jaxpr.trip_count(enclosing))
        for eqn, enclosing in _jaxpr.walk(jaxpr)
        if (tag := _jaxpr.name_tag(eqn)) is not None
    ]


def _scopes(enclosing) -> tuple:
    """``(scope, length)`` of each ``scan`` among ``enclosing`` (from :func:`jremat._engine.jaxpr.walk`)."""
    return tuple((_scope(loop), loop.params["length"]) for loop in _jaxpr.loops(enclosing))


def _decide(callback, eqn) -> str:
    # No policy saves nothing but the inputs (jax.checkpoint's default).
    return RECOMPUTE if callback is None else _tags.ask_callback(callback, eqn)[0]


def _is_float_var(v) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and not _jaxpr.is_key(v.aval) and jnp.issubdtype(dtype, jnp.inexact)


def _body_decisions(body, callback, scopes, excluded, acc, visit) -> None:
    """Add to ``acc`` what ``callback`` decides for each value computed in checkpoint body ``body``."""
    producer = {v: e for e in body.eqns for v in e.outvars}
    user_name: dict = {}
    for e in body.eqns:  # a value's tag, looked up through identity ops in both directions
        if (tag := _jaxpr.name_tag(e)) is not None and not _tags.is_internal(tag):
            user_name.setdefault(e.invars[0], tag)
            user_name.setdefault(e.outvars[0], tag)

    def canonical(v):
        while not isinstance(v, jcore.Literal) and v in producer and producer[v].primitive.name in _IDENTITY:
            v = producer[v].invars[0]
        return v

    def name_of(v):
        while True:
            if v in user_name:
                return user_name[v]
            if isinstance(v, jcore.Literal) or v not in producer or producer[v].primitive.name not in _IDENTITY:
                return None
            v = producer[v].invars[0]

    decided: dict = {}
    for e in body.eqns:
        prim = e.primitive.name
        if prim in _CHECKPOINT_PRIMITIVES:
            visit(e, scopes)  # a checkpoint of its own; its outputs are decided here too
        else:
            subs = _jaxpr.nested_jaxprs(e)
            if subs:
                inner = (*scopes, *_scopes((e,)))
                for sub in subs:
                    _body_decisions(sub, callback, inner, excluded, acc, visit)
                continue
        decision = RECOMPUTE if prim in _CHECKPOINT_PRIMITIVES else _decide(callback, e)
        for v in e.outvars:
            if isinstance(v, jcore.DropVar) or not _is_float_var(v):
                continue
            base = canonical(v)
            if decision in (SAVE, OFFLOAD):
                decided[base] = decision
            elif prim not in _jaxpr.SHAPE_ONLY_PRIMITIVES:
                decided.setdefault(base, RECOMPUTE)
    for v, decision in decided.items():
        name = name_of(v)
        if decision == RECOMPUTE and name in excluded:
            decision = EXCLUDE
        key = (decision, _where(scopes))
        entry = acc.setdefault(key, [0, 0, _iterations(scopes), []])
        entry[0] += 1
        entry[1] += _jaxpr.aval_bytes(v.aval)
        if name and name not in entry[3]:
            entry[3].append(name)


def checkpoint_bodies(jaxpr) -> list[tuple[str, object]]:
    """``(where, body)`` for every checkpoint in ``jaxpr`` (inside scans too; nested ones included),
    ``body`` the checkpointed jaxpr."""
    return [
        (_where(_scopes(enclosing)), _jaxpr.as_jaxpr(eqn.params["jaxpr"]))
        for eqn, enclosing in _jaxpr.walk(jaxpr)
        if eqn.primitive.name in _CHECKPOINT_PRIMITIVES
    ]


def _checkpoints(jaxpr, excluded: frozenset[str]) -> list[tuple]:
    """One ``(signature, decisions)`` per checkpoint in ``jaxpr`` (nested ones included).

    ``decisions`` maps ``(decision, where)`` to ``[count, bytes, iterations, names]``; the
    signature (place and decisions, frozen) identifies the same checkpoint in another trace.
    """
    found = []

    def visit(eqn, scopes):
        acc: dict = collections.OrderedDict()
        body = eqn.params["jaxpr"]
        _body_decisions(getattr(body, "jaxpr", body), eqn.params.get("policy"), scopes, excluded, acc, visit)
        signature = (_where(scopes), tuple((k, v[0], v[1]) for k, v in acc.items()))
        found.append((signature, acc))

    not_into_checkpoints = lambda eqn, _: eqn.primitive.name not in _CHECKPOINT_PRIMITIVES
    for eqn, enclosing in _jaxpr.walk(jaxpr, enter=not_into_checkpoints):
        if eqn.primitive.name in _CHECKPOINT_PRIMITIVES:
            visit(eqn, _scopes(enclosing))
    return found


def decisions(jaxpr, excluded: frozenset[str], baseline_jaxpr=None) -> tuple[int, list[Decision]]:
    """``(checkpoints, decisions)`` of the checkpoints in ``jaxpr`` that ``baseline_jaxpr`` lacks.

    Checkpoints the function has without the policy (a model's own, e.g. around a LayerNorm)
    are matched by signature and left out: they are not the policy's decisions.
    """
    mine = _checkpoints(jaxpr, excluded)
    if baseline_jaxpr is not None:
        theirs = collections.Counter(sig for sig, _ in _checkpoints(baseline_jaxpr, excluded))
        kept = []
        for sig, acc in mine:
            if theirs[sig]:
                theirs[sig] -= 1
            else:
                kept.append((sig, acc))
        mine = kept
    total: dict = collections.OrderedDict()
    for _, acc in mine:
        for key, (count, nbytes, iterations, names) in acc.items():
            entry = total.setdefault(key, [0, 0, iterations, []])
            entry[0] += count
            entry[1] += nbytes
            entry[3].extend(n for n in names if n not in entry[3])
    order = {d: i for i, d in enumerate(DECISIONS)}
    decisions = [Decision(d, c, b, where, it, tuple(names)) for (d, where), (c, b, it, names) in total.items()]
    return len(mine), sorted(decisions, key=lambda d: (d.where != "top level", d.where, order[d.decision]))
