"""train.planning: ``auto`` on the tiny GPT against real compiles (the planner's own guarantees: tests/jremat/_plan/test_planner.py)."""

import pytest

import jremat
from jremat import Candidate, registry
from jremat.models import preset
from jremat.train.planning import apply_candidate, compiled_peak_bytes, keep_gathered_of, plan_for_budget

BATCH = 8


@pytest.fixture(scope="module")
def tiny():
    return preset("tiny", n_layers=2)


def test_candidates_become_valid_configs(tiny):
    assert apply_candidate(Candidate((), 0), tiny).remat_policy == "none"
    assert apply_candidate(Candidate(("q",), tiny.n_layers), tiny).remat_policy == "names:save=q"
    partial = apply_candidate(Candidate((), 1), tiny)
    assert partial.remat_policy == "none" and partial.remat_layer_policies == "1:full"


@pytest.mark.heavy
def test_a_budget_between_full_and_none_fits_the_compiled_step(tiny):
    seq = tiny.max_seq_len
    none_peak = compiled_peak_bytes(apply_candidate(Candidate((), 0), tiny), BATCH, seq)
    full_peak = compiled_peak_bytes(apply_candidate(Candidate((), tiny.n_layers), tiny), BATCH, seq)
    budget = (none_peak + full_peak) // 2
    plan = plan_for_budget(tiny, BATCH, str(budget))
    assert plan.solution.compiled_peak_bytes <= budget
    assert compiled_peak_bytes(plan.config, BATCH, seq) == plan.solution.compiled_peak_bytes
    assert (plan.none_peak_bytes, plan.full_peak_bytes) == (none_peak, full_peak)
    assert 0 < plan.solution.recompute_flops and 0 < plan.recompute_fraction < 1
    assert all(c.name in plan.table() for c in plan.names)
    jremat.resolve(plan.config.remat_policy)


@pytest.mark.parametrize(
    "spec, expected",
    [("auto", None), ("auto:keep_gathered=true", True), ("auto:budget=0.5,keep_gathered=false", False)],
)
def test_keep_gathered_of_an_auto_spec_is_given_or_not(spec, expected):
    assert keep_gathered_of(registry.parse_spec(spec)[1]) is expected
    with pytest.raises(ValueError, match="keep_gathered"):
        keep_gathered_of({"keep_gathered": "sometimes"})
