"""jremat._plan.planner: budgets, candidate sets, the frontier walk and the layer planner, on fake measurements."""

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat import Budget, Candidate, NameCost, parse_budget, plan_layers
from jremat._plan.planner import save_sets, solve

N_LAYERS = 4
COSTS = (NameCost("q", 100, 50.0), NameCost("k", 100, 10.0), NameCost("mlp_act", 400, 400.0))
BLOCK_INPUT = 64
NONE_LAYER = BLOCK_INPUT + sum(c.bytes for c in COSTS)
FLOOR = 10_000  # parameters and gradients: the part no plan changes


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
    [
        ("lots", "is not a size like 6GiB"),
        ("6 parsecs", "unknown unit 'parsecs'"),
        ("0", "must be positive"),
        ("1e400", "'1e400' is too large"),
        ("1e400GiB", "'1e400GiB' is too large"),
        ("1e300GiB", "'1e300GiB' is too large"),
        ("1e30", "'1e30' is too large"),
    ],
)
def test_parse_budget_rejects_bad_input(text, message):
    with pytest.raises(ValueError, match=message):
        parse_budget(text)


def test_fraction_resolves_between_floor_and_none():
    assert parse_budget("0.5").resolve(1000, floor_bytes=200) == 600
    assert parse_budget("300").resolve(1000, floor_bytes=200) == 300


def test_save_sets_are_every_subset_when_few_and_greedy_prefixes_when_many():
    assert len(save_sets(COSTS)) == 2 ** len(COSTS)
    many = [NameCost(f"n{i}", 10, float(i)) for i in range(5)]
    prefixes = save_sets(many, exhaustive_up_to=3)
    assert len(prefixes) == len(many) + 1
    assert prefixes[1] == ("n4",)  # the most FLOPs per byte first
    assert all(set(a) <= set(b) for a, b in zip(prefixes, prefixes[1:]))


def fake_peak(cand: Candidate, *, error: int = 0) -> int:
    """A step peak that is linear in the kept bytes, plus ``error`` on every remat plan."""
    by_name = {c.name: c for c in COSTS}
    kept = BLOCK_INPUT + sum(by_name[n].bytes for n in cand.save)
    per_layer = [kept] * cand.remat_layers + [NONE_LAYER] * (N_LAYERS - cand.remat_layers)
    return FLOOR + sum(per_layer) + (error if 0 < cand.remat_layers else 0)


def plan(budget, measure=fake_peak, **kw):
    return plan_layers(
        budget,
        costs=COSTS,
        n_layers=N_LAYERS,
        block_input_bytes=BLOCK_INPUT,
        none_layer_bytes=NONE_LAYER,
        measure_peak_bytes=measure,
        **kw,
    )


NONE_PEAK, FULL_PEAK = fake_peak(Candidate((), 0)), fake_peak(Candidate((), N_LAYERS))


def test_budget_at_none_returns_none_and_fractions_span_full_to_none():
    assert plan(str(NONE_PEAK)).candidate.remat_layers == 0
    assert plan("1").candidate.remat_layers == 0
    assert plan("1").budget_bytes == NONE_PEAK
    assert plan("0.5").budget_bytes == FULL_PEAK + (NONE_PEAK - FULL_PEAK) // 2


def test_every_budget_fits_and_cost_falls_as_the_budget_rises():
    budgets = [*range(FULL_PEAK, NONE_PEAK, 37), NONE_PEAK]
    plans = [plan(str(b)) for b in budgets]
    for budget, p in zip(budgets, plans):
        assert p.solution.compiled_peak_bytes <= budget
        assert all(c.name in p.table() for c in p.names)
    costs = [p.solution.recompute_flops for p in plans]
    assert costs == sorted(costs, reverse=True)
    assert costs[0] > costs[-1] == 0


def test_the_cheapest_fitting_plan_is_chosen():
    # Room for every layer to keep mlp_act (400 B), the costliest name to recompute; leaving two
    # layers without remat (2 x 600 B) or keeping q and k (800 B) would recompute more.
    p = plan(str(FULL_PEAK + 4 * 400))
    assert p.candidate.save == ("mlp_act",) and p.candidate.remat_layers == N_LAYERS
    assert p.solution.recompute_flops == N_LAYERS * (50.0 + 10.0)
    assert plan(str(FULL_PEAK + 400)).candidate.save == ("q",)


def test_an_underestimated_plan_is_tightened_until_the_measurement_fits():
    p = plan(str(FULL_PEAK + 400), measure=lambda c: fake_peak(c, error=1))
    assert p.solution.compiled_peak_bytes <= FULL_PEAK + 400
    assert len(p.solution.compiled) > 1  # the first plan predicted to fit was measured over budget


def test_infeasible_budget_names_the_smallest_peak_and_plan():
    with pytest.raises(
        ValueError, match=rf"smallest achievable peak is {FULL_PEAK:,} bytes .* reached by full on layers"
    ):
        plan(str(FULL_PEAK - 1))


@pytest.mark.parametrize("per_byte, offloaded", [(0.0, True), (1e12, False)])
def test_offload_replaces_recompute_only_where_cheaper(per_byte, offloaded):
    p = plan(str(FULL_PEAK + 1), offload_cost_per_byte=per_byte)
    unsaved = [c.name for c in p.names if c.name not in p.candidate.save]
    if offloaded:  # free transfers: every value not kept on the device goes to the host
        assert p.candidate.offload == tuple(unsaved) and unsaved
        assert p.candidate.spec().startswith("offload:names=") and p.solution.recompute_flops == 0
        assert "offload to host" in p.table()
        jremat.resolve(p.candidate.spec())
    else:
        assert p.candidate.offload == () and "offload to host" not in p.table()


def test_solve_never_measures_a_plan_predicted_over_budget():
    measured = []

    def measure(c):
        measured.append(c)
        return c

    sol = solve(
        5, [9, 7, 5, 3], predict_peak_bytes=lambda c: c, recompute_flops=lambda c: 10 - c, measure_peak_bytes=measure
    )
    assert sol.candidate == 5 and measured == [5]


def mlp(w1, w2, x):
    h = jnp.tanh(x @ w1)
    return jnp.sin(h @ w2) @ w2.T


def test_ops_to_keep_within_budget_fits_and_keeps_more_as_the_budget_rises():
    args = (jnp.ones((32, 64)), jnp.ones((64, 64)), jnp.ones((16, 32)))
    program = jremat.trace_program(mlp, *args)
    by_index = {op.index: op.out_bytes for op in program.ops}
    kept = [
        sum(by_index[i] for i in jremat.ops_to_keep_within_budget(program, str(b))) for b in (16, 4096, 8192, 65536)
    ]
    assert all(k <= b for k, b in zip(kept, (16, 4096, 8192, 65536)))
    assert kept == sorted(kept) and kept[-1] > kept[0] == 0


def test_offload_is_off_on_cpu_and_its_price_is_measured():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU default")
    assert not jremat.host_offload_available()  # pinned_host is listed, but it is the same RAM
    per_byte = jremat.offload_flops_per_byte("float32", transfer_bytes=4 * 2**20, matmul_size=256)
    assert 0 < per_byte < float("inf")


#: Per layer, per device: the gathered weights a rematerialized layer keeps with keep_gathered.
GATHERED = 400


def gathered_peak(cand: Candidate) -> int:
    """:func:`fake_peak` plus the gathered weights of every layer that keeps them."""
    return fake_peak(cand) + (GATHERED * cand.remat_layers if cand.keep_gathered else 0)


def gathered_plan(budget: int, regather_flops: float, keep_gathered=None):
    return plan(str(budget), gathered_peak, regather_flops=regather_flops, keep_gathered=keep_gathered, devices=8)


KEPT_PEAK = gathered_peak(Candidate((), N_LAYERS, (), True))


def test_keep_gathered_true_or_false_allows_only_the_plans_that_keep_or_regather():
    roomy = KEPT_PEAK + 1
    # Priced high, auto keeps them where they fit; asked to re-gather, it does.
    chosen = gathered_plan(roomy, 1e6)
    assert chosen.candidate.keep_gathered and chosen.candidate.remat_layers == N_LAYERS
    assert (
        "keeps gathered weights: cheaper than re-gathering them (1,000,000 FLOP-equivalents per layer)"
        in (chosen.table().splitlines()[0])
    )
    regathers = gathered_plan(roomy, 1e6, keep_gathered=False)
    assert not regathers.candidate.keep_gathered and regathers.candidate.remat_layers > 0
    assert regathers.table().splitlines()[0].endswith("; re-gathers weights, as asked (keep_gathered=false)")
    # Priced at nothing, auto re-gathers; asked to keep them, it does.
    assert not gathered_plan(roomy, 1e-9).candidate.keep_gathered
    kept = gathered_plan(roomy, 1e-9, keep_gathered=True)
    assert kept.candidate.keep_gathered and kept.solution.compiled_peak_bytes <= roomy
    assert kept.table().splitlines()[0].endswith("; keeps gathered weights, as asked (keep_gathered=true)")


def test_keep_gathered_true_that_fits_no_budget_names_the_smallest_peak_keeping_them():
    tight = FULL_PEAK + 1  # full re-gathering fits; keeping the gathered weights does not
    with pytest.raises(ValueError, match=r"^keep_gathered=true: no plan fits .* the smallest achievable peak is"):
        gathered_plan(tight, 1e6, keep_gathered=True)
    chosen = gathered_plan(tight, 1e6)
    assert not chosen.candidate.keep_gathered
    assert (
        chosen.table()
        .splitlines()[0]
        .endswith(
            f"; re-gathers weights: keeping them does not fit the budget of {tight:,} B "
            f"(full remat keeping them peaks at {KEPT_PEAK:,} B)"
        )
    )


def test_regathering_that_costs_less_than_keeping_says_so():
    # Room to keep the gathered weights under full, or to save mlp_act (400 B) and re-gather:
    # re-gathering priced at 1 FLOP a layer is cheaper than recomputing mlp_act.
    chosen = gathered_plan(FULL_PEAK + N_LAYERS * GATHERED, 1.0)
    assert chosen.candidate == Candidate(("mlp_act",), N_LAYERS)
    assert (
        chosen.table()
        .splitlines()[0]
        .endswith(
            "; re-gathers weights: cheaper than keeping them within the budget (re-gathering a layer's weights priced "
            "at 1 FLOP-equivalents)"
        )
    )


def test_regather_price_is_rounded_as_the_fit_search_rounds_its_rates(monkeypatch):
    from jremat._measure import collectives as _collectives
    from jremat._plan.fit_types import TimeModel
    from jremat._plan.time_model import with_collective_rates

    # Two measurements of one machine, 20% apart (within one power of two): one price.
    draws = iter([2.0**-30 * 1.1, 2.0**-30 * 1.3])
    rates = iter([2.0**38 * 0.9, 2.0**38 * 1.2])
    monkeypatch.setattr(_collectives, "_measured_s_per_byte", lambda kind, devices, transfer_bytes: next(draws))
    monkeypatch.setattr(_collectives, "_matmul_flops_per_s", lambda device, matmul_size: next(rates))
    devices = [jax.devices()[0]] * 2
    first = jremat.collective_flops_per_byte("all-gather", devices)
    assert first == jremat.collective_flops_per_byte("all-gather", devices) == 2.0**8
    # The fit search's time model prices the same collective at the same rate (one draw per kind timed).
    draws = iter([2.0**-30 * 1.2] * len(_collectives.TIMED_KINDS))
    fit_rate = dict(with_collective_rates(TimeModel(2.0**38, 1.0), devices).collective_s_per_byte)
    assert fit_rate["all-gather"] * 2.0**38 == first


def test_plan_function_is_an_alias_of_ops_to_keep_within_budget():
    assert jremat.plan_function is jremat.ops_to_keep_within_budget
