"""Value checks shared by the command-line configs' ``__post_init__``: each raises
:class:`jremat.train.usage.UsageError` naming the flag, what was given and what is valid."""

from __future__ import annotations

import math
from collections.abc import Sequence

from jremat import registry
from jremat.train.cli import flag_name
from jremat.train.usage import UsageError


def require(ok: bool, message: str) -> None:
    """Raise :class:`UsageError` with ``message`` unless ``ok``."""
    if not ok:
        raise UsageError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(name: str, value, *, minimum: int = 1) -> None:
    """``value`` must be an integer ``>= minimum``; ``name`` is the field (shown as its flag)."""
    require(
        _is_int(value) and value >= minimum,
        f"{flag_name(name)} must be {'a positive integer' if minimum == 1 else f'an integer >= {minimum}'}, "
        f"got {value!r}",
    )


def require_number(name: str, value, *, minimum: float = 0.0, inclusive: bool = False) -> None:
    """``value`` must be a finite number ``> minimum`` (``>=`` with ``inclusive``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= minimum if inclusive else value > minimum)
    if inclusive:
        wanted = f"a number >= {minimum:g}"
    else:
        wanted = "a positive number" if minimum == 0 else f"a number > {minimum:g}"
    if name.endswith("_s"):
        wanted += " of seconds"
    require(ok, f"{flag_name(name)} must be {wanted}, got {value!r}")


def require_one_budget(specs: Sequence[str], memory_budget: str | None, search_flag: str | None = None) -> None:
    """``--memory-budget`` and an ``auto`` spec's own ``budget=`` must not both be given.

    Args:
      specs: the ``--policy`` specs.
      memory_budget: the ``--memory-budget`` value, if given.
      search_flag: the flag that makes ``--memory-budget`` the budget of a search (``--fit``,
        ``--batch-size auto``), if given: then the spec's ``budget=`` is the one to drop.

    Raises:
      UsageError: naming both budgets and what to give instead.
    """
    if memory_budget is None:
        return
    for spec in specs:
        name, values = registry.parse_spec(spec)
        if name == "auto" and "budget" in values:
            fix = (
                f"drop budget= from --policy {spec!r} ({search_flag} searches at --memory-budget)"
                if search_flag
                else f"--policy auto --memory-budget {memory_budget}, or --policy {spec!r} alone"
            )
            raise UsageError(
                f"--policy {spec!r} sets its own budget and --memory-budget {memory_budget} sets another; "
                f"give one: {fix}"
            )


def require_choice(name: str, value, choices: Sequence[str]) -> None:
    """``value`` must be one of ``choices``."""
    require(value in choices, f"{flag_name(name)} must be one of {', '.join(choices)}, got {value!r}")


def check_mesh_flag(mesh: str, batch_size: int | None, seq_len: int | None) -> None:
    """``--mesh``: its syntax, and that the batch and sequence split over it (``None``: not checked).

    The device count is checked where the mesh is built. Imports JAX (only for a run that gives ``--mesh``).

    Raises:
      UsageError: on a bad mesh spec, or a batch or sequence length that does not split.
    """
    from jremat.train import sharding

    try:
        sizes = sharding.parse_mesh(mesh)
    except ValueError as err:
        raise UsageError(f"--mesh: {err}") from None
    axes = [a for a in ("data", "fsdp", sharding.EXPERT_AXIS) if a in sizes]
    ways = math.prod(sizes[a] for a in axes)
    require(
        batch_size is None or batch_size % ways == 0,
        f"--batch-size {batch_size} does not split over --mesh {mesh} ({' x '.join(axes)} = {ways}); "
        f"use a multiple of {ways}",
    )
    require(
        seq_len is None or seq_len % sizes["sequence"] == 0,
        f"--seq-len {seq_len} does not split over --mesh {mesh} (sequence = {sizes['sequence']}); "
        f"use a multiple of {sizes['sequence']}",
    )
