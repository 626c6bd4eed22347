"""Memory budgets: ``6GiB``, ``512MiB``, ``1000000`` (bytes) or a fraction in ``(0, 1]`` of the no-remat memory."""

from __future__ import annotations

import dataclasses
import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
#: The largest budget accepted, in bytes: what a signed 64-bit byte count holds.
_MAX_BYTES = 2**63 - 1
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget: absolute bytes, or a fraction of the no-remat memory.

    Attributes:
      bytes: the budget in bytes, or ``None`` for a fractional budget.
      fraction: in ``(0, 1]``, or ``None`` for an absolute budget.
      text: as the user wrote it.
    """

    bytes: int | None
    fraction: float | None
    text: str

    def resolve(self, none_bytes: int, floor_bytes: int = 0) -> int:
        """Absolute bytes: a fraction ``f`` means ``floor + f * (none_bytes - floor)``.

        Args:
          none_bytes: the memory without remat (a step's peak, or a function's residual bytes).
          floor_bytes: the part a policy cannot change (parameters, optimizer state, ...).
        """
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None  # a budget holds bytes or a fraction
        return int(floor_bytes + self.fraction * (none_bytes - floor_bytes))


def parse_budget(text: str) -> Budget:
    """Parse a budget string.

    A number with a unit is a size (``6GiB``, ``1.5GB``: whole bytes). A number without a unit
    is a fraction of the no-remat memory when it is at most 1 (``0.5``, ``1``, ``1.0``: all of
    it) and a byte count when it is a whole number above 1 (``1000000``).

    Raises:
      ValueError: if it is not a positive size with a known unit, a fraction in ``(0, 1]`` or a
        whole number of bytes, or if it is too large for a byte count (``1e400``).
    """
    match = _BUDGET_RE.match(str(text))
    units = "B, KB, MB, GB, KiB, MiB, GiB, TiB"
    form = (
        f"a size like 6GiB or 512MiB (units {units}), a whole number of bytes like 1000000, "
        "or a fraction in (0, 1] of the no-remat memory like 0.5"
    )
    if not match:
        raise ValueError(f"memory budget {text!r} is not {form}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"memory budget {text!r}: unknown unit {match.group(2)!r}; valid units: {units}")
    if number <= 0:
        raise ValueError(f"memory budget {text!r} must be positive; expected {form}")
    if not unit and number <= 1.0:
        return Budget(bytes=None, fraction=number, text=str(text).strip())
    size = number * _UNITS[unit]
    if not math.isfinite(size) or size > _MAX_BYTES:
        raise ValueError(f"memory budget {text!r} is too large (at most 2**63 - 1 bytes); expected {form}")
    if size != int(size):
        raise ValueError(f"memory budget {text!r} is not a whole number of bytes; expected {form}")
    return Budget(bytes=int(size), fraction=None, text=str(text).strip())


def as_budget(budget: str | Budget) -> Budget:
    """``budget`` parsed if it is a string."""
    return budget if isinstance(budget, Budget) else parse_budget(budget)


def format_bytes(n) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``"1.50 GiB"``); ``"n/a"`` for ``None`` or ``""``."""
    if n is None or n == "":
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


__all__ = ["Budget", "as_budget", "format_bytes", "parse_budget"]
