"""Fitting training into a memory budget: the fastest (policy, batch) that fits, measured.

The fit search and the tools it is built from, in one namespace (as :mod:`equinox.debug` keeps
Equinox's debugging tools): :func:`fit_search` and :func:`fit_search_budgets` choose a policy and
batch for a budget, :func:`largest_fitting` is their batch search on its own (the largest batch
whose compiled peak fits, in few compiles), :func:`compile_figures` the figures one compile
gives, the time model ranks candidates (:func:`calibrate_time_model`), and :class:`Budget` /
:func:`parse_budget` read a budget such as ``"6GiB"``. The search's names are also at the top
level (``jremat.fit_search is jremat.fit.fit_search``). See ``docs/fit.md``.
"""

from jremat._plan.fit import (
    fit_search,
    fit_search_budgets,
    keep_collectives_variants,
    keep_gathered_variants,
    measure_throughput,
)
from jremat._plan.fit_types import TIE_RULE, FitError, FitProbe, FitResult, FitRow, FitStep, StepBuilder, TimeModel
from jremat._plan.probe import SEARCH_GROWTH, compile_figures, largest_fitting
from jremat._plan.time_model import calibrate_time_model, with_collective_rates
from jremat._spec.budget import Budget, parse_budget

__all__ = [
    "SEARCH_GROWTH",
    "TIE_RULE",
    "Budget",
    "FitError",
    "FitProbe",
    "FitResult",
    "FitRow",
    "FitStep",
    "StepBuilder",
    "TimeModel",
    "calibrate_time_model",
    "compile_figures",
    "fit_search",
    "fit_search_budgets",
    "keep_collectives_variants",
    "keep_gathered_variants",
    "largest_fitting",
    "measure_throughput",
    "parse_budget",
    "with_collective_rates",
]
