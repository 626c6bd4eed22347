"""Test helpers for policies, built on :func:`tests.conftest.saved_residuals`."""

from __future__ import annotations

import math
import re

import jremat
from tests.conftest import saved_residuals

_TAG_RE = re.compile(r"named 'jremat\d+/(\d+)'")


def saved_op_indices(fn, *args):
    """Equation indices (in ``jremat.trace_program`` numbering) of the values a PlanPolicy saved,
    and the residuals that are not PlanPolicy tags (arguments and anything else)."""
    indices, others = set(), []
    for aval, why in saved_residuals(fn, *args):
        match = _TAG_RE.search(why)
        if match:
            indices.add(int(match.group(1)))
        else:
            others.append((aval, why))
    return indices, others


def residual_bytes(residuals) -> int:
    """Bytes taken by a list of ``(aval, description)`` residuals."""
    return sum(math.prod(aval.shape) * aval.dtype.itemsize for aval, _ in residuals)


def program_of(fn, *args) -> jremat.Program:
    """The traced program a PlanPolicy sees for ``fn(*args)``."""
    return jremat.trace_program(fn, *args)
