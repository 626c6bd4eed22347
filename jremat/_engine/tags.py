"""What a policy's answer means, and the internal names under which jremat keeps the values it chose.

A policy chooses equations of a traced program to save or offload: a
:class:`jremat.PlanPolicy` by returning a :class:`jremat.Plan`, a JAX policy callback by its
answer for each equation, read by :func:`callback_decision` (the one reader of such answers, for
the lowering under ``jax_remat3`` and for :func:`jremat.explain` alike). The chosen outputs are
then tagged with internal ``checkpoint_name`` tags and saved by name
(:func:`jremat._engine.lowering.checkpoint_chosen`). This module owns those tags:

* :func:`new_prefix` mints a fresh prefix (``jremat7``) per checkpoint, from one counter;
* :func:`equation_tag` and :func:`output_names` spell the tag of equation ``i``'s outputs
  (``jremat7/12``, or ``jremat7/12.0``, ``jremat7/12.1`` for several outputs);
* :func:`is_internal` recognises them, so reports can tell them from a user's own names
  (:func:`user_names`).
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Iterable
from typing import Any

from jax.ad_checkpoint import Offloadable, Recompute, Saveable

SAVE = "save"
OFFLOAD = "offload"
RECOMPUTE = "recompute"

_PREFIX = "jremat"
#: An internal tag: a minted prefix, ``/``, an equation index, and an output index if several.
TAG_RE = re.compile(rf"^{_PREFIX}\d+/\d+(\.\d+)?$")

_counter = itertools.count()
_counter_lock = threading.Lock()


def new_prefix() -> str:
    """A tag prefix no other checkpoint of this process uses (``jremat7``); safe from several threads."""
    with _counter_lock:
        n = next(_counter)
    return f"{_PREFIX}{n}"


def equation_tag(prefix: str, index: int) -> str:
    """The tag of equation ``index``'s outputs under ``prefix`` (``jremat7/12``)."""
    return f"{prefix}/{index}"


def output_names(tag: str, n_outputs: int) -> list[str]:
    """The ``checkpoint_name`` of each output of an equation tagged ``tag``: ``[tag]`` for one
    output, ``tag.0``, ``tag.1``, ... for several."""
    return [tag] if n_outputs == 1 else [f"{tag}.{j}" for j in range(n_outputs)]


def is_internal(name: str) -> bool:
    """Whether ``name`` is a tag jremat gave a value a policy chose (not a user's ``checkpoint_name``)."""
    return TAG_RE.match(name) is not None


def user_names(names: Iterable[str]) -> list[str]:
    """``names`` without jremat's internal tags, in order."""
    return [n for n in names if not is_internal(n)]


def callback_decision(answer, primitive=None) -> str:
    """What a JAX policy callback's answer for one equation means: :data:`SAVE`, :data:`OFFLOAD`
    or :data:`RECOMPUTE`.

    The answers JAX's classic engine accepts, read as it reads them: ``True`` / ``Saveable``
    save, ``False`` / ``Recompute`` recompute, an ``Offloadable(src, dst)`` offloads. Anything
    else (``1``, a string, ``None``, a NumPy bool) is refused, as the classic engine refuses it,
    so that no reader of the answer can describe a different program from the one that runs.

    Args:
      answer: what the callback returned.
      primitive: the equation's primitive, named in the error.

    Raises:
      TypeError: if ``answer`` is none of the above.
    """
    if isinstance(answer, Offloadable):
        return OFFLOAD
    if answer is Saveable or answer is True:
        return SAVE
    if answer is Recompute or answer is False:
        return RECOMPUTE
    about = f" for {primitive}" if primitive is not None else ""
    hint = "; did you return the class Offloadable instead of Offloadable(src, dst)?" if answer is Offloadable else ""
    raise TypeError(
        f"a remat policy callback returned {answer!r} (type {type(answer).__name__}){about}; valid answers: "
        f"True or Saveable (save), False or Recompute (recompute), Offloadable(src, dst) (offload){hint}"
    )


def ask_callback(callback, eqn) -> tuple[str, Any]:
    """``(decision, answer)``: ``callback``'s answer for equation ``eqn`` and what it means
    (:func:`callback_decision`), asked with the arguments JAX's classic engine gives it:
    ``(primitive, *input_avals, **params)``.

    Raises:
      TypeError: if the callback's answer is not one :func:`callback_decision` accepts.
    """
    answer = callback(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
    return callback_decision(answer, eqn.primitive), answer


__all__ = [
    "OFFLOAD",
    "RECOMPUTE",
    "SAVE",
    "TAG_RE",
    "ask_callback",
    "callback_decision",
    "equation_tag",
    "is_internal",
    "new_prefix",
    "output_names",
    "user_names",
]
