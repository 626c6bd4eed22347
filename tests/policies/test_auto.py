"""``auto``: budget parsing, the per-function knapsack, and the whole-step planner's guarantees."""

import jax.numpy as jnp
import pytest

import jremat
from models import preset
from policies.auto import Budget, parse_budget
from tests.conftest import saved_residuals
from train.auto import Candidate, compiled_peak_bytes, host_offload_available, plan_for_budget

BATCH = 8


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6GiB", Budget(6 * 2**30, None, "6GiB")),
        ("512MiB", Budget(512 * 2**20, None, "512MiB")),
        ("1.5GB", Budget(1_500_000_000, None, "1.5GB")),
        ("1000000", Budget(1_000_000, None, "1000000")),
        ("0.5", Budget(None, 0.5, "0.5")),
    ],
)
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [("lots", "is not a size like 6GiB"), ("6 parsecs", "unknown unit 'parsecs'"), ("0", "must be positive")],
)
def test_parse_budget_rejects_bad_input(text, message):
    with pytest.raises(ValueError, match=message):
        parse_budget(text)


def mlp(w1, w2, x):
    h = jnp.tanh(x @ w1)
    return jnp.sin(h @ w2) @ w2.T


def saved_bytes(policy_spec):
    w1, w2, x = jnp.ones((32, 64)), jnp.ones((64, 64)), jnp.ones((16, 32))
    fn = jremat.checkpoint(mlp, policy_spec)
    residuals = saved_residuals(lambda w1, w2, x: fn(w1, w2, x).sum(), w1, w2, x)
    return sum(a.size * a.dtype.itemsize for a, where in residuals if "argument" not in where)


def test_function_level_auto_respects_budget_and_is_monotonic():
    budgets = [0, 4096, 8192, 16384, 65536]
    used = [saved_bytes(f"auto:budget={b}") if b else saved_bytes("full") for b in budgets]
    for budget, u in zip(budgets[1:], used[1:]):
        assert u <= budget
    assert used == sorted(used)
    assert used[-1] > used[0]


@pytest.fixture(scope="module")
def tiny():
    return preset("tiny", n_layers=2)


@pytest.fixture(scope="module")
def extremes(tiny):
    seq = tiny.max_seq_len
    return (
        compiled_peak_bytes(Candidate((), 0).apply(tiny), BATCH, seq),
        compiled_peak_bytes(Candidate((), tiny.n_layers).apply(tiny), BATCH, seq),
    )


def test_budget_at_or_above_none_returns_none(tiny, extremes):
    none_peak, _ = extremes
    plan = plan_for_budget(tiny, BATCH, str(none_peak))
    assert plan.candidate.remat_layers == 0
    assert plan.config.remat_policy == "none"
    assert plan.solution.recompute_flops == 0


def test_budget_just_above_full_is_no_costlier_than_full(tiny, extremes):
    _, full_peak = extremes
    plan = plan_for_budget(tiny, BATCH, str(full_peak + 1))
    full_cost = sum(c.recompute_flops for c in plan.names) * tiny.n_layers
    assert plan.solution.compiled_peak_bytes <= full_peak + 1
    assert plan.solution.recompute_flops <= full_cost


def test_budgets_between_full_and_none_fit_and_cost_is_monotonic(tiny, extremes):
    none_peak, full_peak = extremes
    budgets = [int(full_peak + f * (none_peak - full_peak)) for f in (0.1, 0.4, 0.7, 0.95)]
    plans = [plan_for_budget(tiny, BATCH, str(b)) for b in budgets]
    for budget, plan in zip(budgets, plans):
        assert plan.solution.compiled_peak_bytes <= budget
        # The printed plan names every tensor with a decision.
        assert all(c.name in plan.table() for c in plan.names)
    costs = [p.solution.recompute_flops for p in plans]
    assert costs == sorted(costs, reverse=True), costs


def test_infeasible_budget_names_smallest_peak(tiny, extremes):
    _, full_peak = extremes
    with pytest.raises(ValueError, match=rf"smallest achievable peak is {full_peak:,} bytes .* reached by full"):
        plan_for_budget(tiny, BATCH, str(full_peak // 2))


def _fake_measure(none_peak, full_peak):
    """Every remat plan at full's peak, no remat at none's: the planner runs without compiling."""
    return lambda cfg: none_peak if cfg.remat_policy == "none" and not cfg.remat_layer_policies else full_peak


@pytest.mark.parametrize("per_byte, offloaded", [(0.0, True), (1e12, False)])
def test_offload_replaces_recompute_only_where_cheaper(tiny, extremes, per_byte, offloaded):
    none_peak, full_peak = extremes
    plan = plan_for_budget(tiny, BATCH, str(full_peak + 1), measure_peak_bytes=_fake_measure(none_peak, full_peak),
                           offload=True, offload_cost_per_byte=per_byte)
    unsaved = [c.name for c in plan.names if c.name not in plan.candidate.save]
    if offloaded:  # free transfers: every value not kept on the device goes to the host
        assert plan.candidate.offload == tuple(unsaved) and unsaved
        assert plan.config.remat_policy.startswith("offload:names=")
        assert plan.solution.recompute_flops == 0
        assert "offload to host" in plan.table()
    else:  # transfers dearer than any recompute: the plan is the recompute-only one
        assert plan.candidate.offload == ()
        assert "offload to host" not in plan.table()
    jremat.resolve(plan.config.remat_policy)  # the spec is a valid registered policy


def test_offload_is_off_by_default_on_cpu_and_its_price_is_measured(tiny, extremes):
    import jax

    from train.auto import offload_flops_per_byte

    if jax.default_backend() != "cpu":
        pytest.skip("CPU default")
    assert not host_offload_available()  # pinned_host is listed, but it is the same RAM
    plan = plan_for_budget(tiny, BATCH, str(extremes[1] + 1))
    assert plan.candidate.offload == () and all(c.offload_flops is None for c in plan.names)
    per_byte = offload_flops_per_byte("float32", transfer_bytes=4 * 2**20, matmul_size=256)
    assert 0 < per_byte < float("inf")
