"""``jremat.fit_search``: the (policy, batch) with the highest measured throughput that fits a budget.

A plain-JAX model (a stack of MLP blocks, parameters a list of dicts, the step donating them) is
the user's step builder; budgets sit between what its policies need at small batches, so the
searches cross real boundaries in a few compiles. A fixed time model keeps the finalists
independent of this machine's speed.
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat import fit
from jremat._plan import fit as _fit

D, LAYERS, SEQ = 32, 3, 16
MODEL = jremat.TimeModel(flops_per_s=2.0**33, bytes_per_s=2.0**33)


def init(key):
    keys = jax.random.split(key, LAYERS)
    return [
        {"w1": jax.random.normal(k, (D, 4 * D)) * 0.05, "w2": jax.random.normal(k, (4 * D, D)) * 0.05} for k in keys
    ]


def block(p, x):
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def build(policy: str, batch: int, micro: int):
    """The user's builder: an SGD step over ``micro`` micro-batches of ``batch`` (``lax.scan``)."""
    if policy == "nothing here":
        return None
    remat = {"same as full": "full"}.get(policy, policy)
    layer = jremat.checkpoint(block, remat) if remat != "none" else block

    def loss(params, x):
        for p in params:
            x = layer(p, x)
        return jnp.mean(x**2)

    def step(params, xs):
        def micro_step(acc, x):
            return jax.tree.map(jnp.add, acc, jax.grad(loss)(params, x)), None

        grads, _ = jax.lax.scan(micro_step, jax.tree.map(jnp.zeros_like, params), xs)
        return jax.tree.map(lambda w, g: w - 1e-3 * g, params, grads), jnp.float32(0)

    params = jax.eval_shape(init, jax.random.key(0))
    xs = jax.ShapeDtypeStruct((micro, batch, SEQ, D), jnp.float32)
    return jremat.FitStep(jax.jit(step, donate_argnums=0), (params, xs), carry=(0,))


def peak(policy: str, batch: int, micro: int = 1) -> int:
    fit_step = build(policy, batch, micro)
    compiled = fit_step.step.lower(*fit_step.args).compile()
    return jremat.compiled_memory_report(compiled).peak_bytes


@pytest.fixture(scope="module")
def budget():
    """Between none's and full's peak at batch 8: the searches end at different batches."""
    return (peak("none", 8) + peak("full", 8)) // 2


def search(budget, policies=("none", "full"), **kwargs):
    kwargs = {"tokens_per_example": SEQ, "time_model": MODEL, "rounds": 1, "calls_per_round": 1, **kwargs}
    return jremat.fit_search(build, list(policies), budget, **kwargs)


def test_each_policy_ends_at_its_largest_fitting_batch_and_the_winner_fits(budget):
    result = search(budget, batch_tolerance=0.0)
    assert result.winner.probe.peak_bytes <= budget
    assert {r.probe.policy for r in result.rows} == {"none", "full"}
    for row in result.rows:
        b = row.probe.batch_size
        assert row.probe.peak_bytes <= budget
        assert peak(row.probe.policy, b + 1) > budget, f"{row.probe.policy}: batch {b + 1} fits too"
    batches = {r.probe.policy: r.probe.batch_size for r in result.rows}
    assert batches["full"] > batches["none"]  # remat buys batch


def fake_timing(monkeypatch, tokens_per_s_by_policy):
    """Replace the timed rounds with fixed tokens/s per policy (one value per round)."""

    def time(self, keys, rounds, calls_per_round, tokens_per_example):
        return {k: list(tokens_per_s_by_policy[k[0]][:rounds]) for k in keys}

    monkeypatch.setattr(_fit._Search, "time", time)


def test_a_clear_winner_is_the_fastest_measured_even_with_more_recompute(budget, monkeypatch):
    fake_timing(monkeypatch, {"none": [100.0, 104.0, 98.0], "full": [150.0, 160.0, 155.0]})
    result = search(budget, finalists=2, rounds=3)
    finalists = {r.probe.policy: r for r in result.rows if r.finalist}
    assert set(finalists) == {"none", "full"} and all(len(r.rounds_tokens_per_s) == 3 for r in finalists.values())
    assert finalists["full"].probe.flops_per_example > finalists["none"].probe.flops_per_example
    assert result.winner.probe.policy == "full" and result.within_noise == ()
    assert result.margin is not None and result.margin[1] < 0.97
    assert "<- winner" in result.table() and "fastest measured: full" in result.table()
    assert "within noise" not in result.table()
    assert result.to_json()["winner"]["policy"] == "full"


@pytest.mark.heavy
def test_within_noise_the_tie_rule_chooses_less_recompute_and_says_so(budget, monkeypatch):
    # full is the faster median, but none beats it in one round of three: a coin toss.
    fake_timing(monkeypatch, {"none": [100.0, 95.0, 110.0], "full": [102.0, 103.0, 99.0]})
    result = search(budget, finalists=2, rounds=3)
    assert max((r for r in result.rows if r.finalist), key=lambda r: r.tokens_per_s).probe.policy == "full"
    assert result.winner.probe.policy == "none"  # fewer FLOPs per example: no recompute
    assert {k[0] for k in result.within_noise} == {"none", "full"}
    assert result.margin[1] > 1.0  # the runner-up (full) measured faster in most rounds
    line = f"chose none batch {result.winner.probe.batch_size} x 1 by {fit.TIE_RULE}"
    assert "within noise" in result.table() and line in result.table()
    assert result.to_json()["decision"] == result.decision and line in result.decision
    # The same times give the same digest; other times that keep the tie give it too.
    fake_timing(monkeypatch, {"none": [100.0, 101.0, 90.0], "full": [100.5, 99.0, 100.0]})
    assert search(budget, finalists=2, rounds=3).digest == result.digest


def test_the_tie_rule_then_prefers_the_larger_batch():
    probes = {
        ("a", 8, 1): jremat.FitProbe("a", 8, 1, 1, flops=800.0),
        ("b", 10, 1): jremat.FitProbe("b", 10, 1, 1, flops=1000.0),  # the same FLOPs per example
        ("c", 4, 1): jremat.FitProbe("c", 4, 1, 1, flops=4000.0),
    }
    times = {("a", 8, 1): [100.0, 99.0], ("b", 10, 1): [99.0, 100.0], ("c", 4, 1): [98.0, 99.5]}
    picked = list(probes)
    assert _fit._decide(picked, times, probes, 0.03) == (("b", 10, 1), tuple(picked))
    # b's rounds reach a's; c's fall short by up to 2%, within 3% but not 0%
    assert _fit._decide(picked, times, probes, 0.0) == (("b", 10, 1), (("a", 8, 1), ("b", 10, 1)))
    far = {**times, ("b", 10, 1): [50.0, 51.0], ("c", 4, 1): [40.0, 41.0]}
    assert _fit._decide(picked, far, probes, 0.03) == (("a", 8, 1), ())


@pytest.mark.heavy
def test_the_same_inputs_give_the_same_digest_whatever_the_threads(budget):
    # One finalist: the decision takes no wall-clock time, so it must be the same.
    first = search(budget, policies=("none", "full", "dots"), workers=1, finalists=1)
    second = search(budget, policies=("none", "full", "dots"), workers=3, finalists=1)
    assert first.digest == second.digest
    assert [p.key for p in first.probes] == [p.key for p in second.probes]
    other = search(budget + 4096 * 64, policies=("none", "full", "dots"), finalists=1)
    assert other.digest != first.digest


def test_finalists_come_from_the_time_model_and_ties_go_to_the_earlier_policy(budget):
    result = search(budget, policies=("none", "full", "dots"), finalists=1)
    (finalist,) = [r for r in result.rows if r.finalist]
    assert finalist is result.winner
    assert finalist.predicted_tokens_per_s == max(r.predicted_tokens_per_s for r in result.rows)


@pytest.mark.heavy
def test_a_global_batch_gets_the_fewest_micro_batches_that_fit(budget):
    result = search(budget, global_batch=24)
    for row in result.rows:
        p = row.probe
        assert p.batch_size * p.micro_batches == 24 and p.peak_bytes <= budget
        fewer = [m for m in range(1, p.micro_batches) if 24 % m == 0]
        if fewer:
            assert peak(p.policy, 24 // fewer[-1], fewer[-1]) > budget


@pytest.mark.heavy
def test_a_larger_budget_never_yields_lower_measured_throughput(budget):
    budgets = [budget, budget * 3 // 2, budget * 2]
    results = jremat.fit_search_budgets(
        build,
        ["none", "full"],
        budgets,
        tokens_per_example=SEQ,
        time_model=MODEL,
        rounds=1,
        calls_per_round=1,
        finalists=1,
    )
    winners = [r.winner.tokens_per_s for r in results]
    # The tie rule may choose a finalist within noise_tolerance of the fastest, which is at
    # least as fast as the smaller budget's winner (timed in the same rounds).
    assert all(b >= a * (1 - 0.03) for a, b in zip(winners, winners[1:]))
    for smaller, larger in zip(results, results[1:]):
        assert {r.probe.key for r in smaller.rows if r.finalist} <= {r.probe.key for r in larger.rows if r.finalist}
        searched = {r.probe.policy: r.probe.batch_size for r in larger.rows if r.origin == "search"}
        assert set(searched) == {"none", "full"}
        for r in larger.rows:
            if r.origin == "smaller budget":  # kept from before, below this budget's own largest batch
                assert r.probe.batch_size < searched[r.probe.policy]


def test_one_program_under_two_labels_is_one_candidate(budget):
    result = search(budget, policies=("full", "same as full"))
    assert [r.probe.policy for r in result.rows] == ["full"]


def test_one_program_at_adjacent_batches_is_one_candidate_its_largest_batch(budget):
    def plans(budget_bytes, searched):
        (full,) = [p for p in searched if p.policy == "full"]
        return [("full", full.batch_size - 1, 1), ("full", full.batch_size - 2, 1), ("none", 1, 1)]

    result = search(budget, policies=("full", "none"), extra_candidates=plans, finalists=3)
    searched_full = max(p.batch_size for p in result.probes if p.policy == "full" and p.peak_bytes <= budget)
    assert sorted((r.probe.policy, r.probe.batch_size) for r in result.rows) == [
        ("full", searched_full),
        ("none", next(r.probe.batch_size for r in result.rows if r.probe.policy == "none")),
    ]
    finalists = [r.probe for r in result.rows if r.finalist]
    assert len(finalists) == 2 and len({p.program for p in finalists}) == 2


def test_the_batch_search_stops_within_its_tolerance_in_few_compiles():
    # A peak close to linear (slightly convex), the boundary at batch 131: a 1% batch
    # difference is not worth a compile.
    calls = []

    def peak(batch):
        calls.append(batch)
        return 1_000_000 + 100_000 * batch + 150 * batch**2

    def search_calls(budget, peak):
        calls.clear()
        found = fit.largest_fitting(
            peak, budget, limit=4096, tolerance=0.03, growth=fit.SEARCH_GROWTH, second_probe=fit.SEARCH_GROWTH
        )
        return found, list(calls)

    budget = 16 * 2**20
    exact = max(b for b in range(1, 4097) if peak(b) <= budget)
    (batch, verified), probed = search_calls(budget, peak)
    assert verified and peak(batch) <= budget and exact - batch <= max(1, math.floor(batch * 0.03))
    assert len(probed) <= 6, probed  # 1, 16, past the boundary, two along the line, one to close

    def linear(batch):
        calls.append(batch)
        return 1_000_000 + 100_000 * batch

    (batch, _), probed = search_calls(budget, linear)
    assert batch == 157 and len(probed) <= 4, probed  # linear: 1, 16, the line's answer, one to close
    calls.clear()
    assert fit.largest_fitting(peak, budget, limit=4096) == (exact, True)
    assert len(calls) >= 7  # the exact boundary from batch 2 in 4x steps costs more


@pytest.mark.heavy
def test_a_search_of_three_policies_stays_within_its_compile_count():
    # Boundaries between batch 100 and 200: 1, 16, the line's answer and one probe 3% above it
    # per policy (exact boundaries from batch 2 in 4x steps took 6 or 7 each, 19 in all).
    result = search(peak("none", 120), policies=("none", "full", "dots"), finalists=1)
    assert {p.policy: p.batch_size for p in (r.probe for r in result.rows)}["none"] >= 120 * 0.97
    assert len(result.probes) <= 12, [p.key for p in result.probes]


@pytest.mark.parametrize("keyword", ["extra_candidates", "plans"])
def test_extra_candidates_join_the_candidates_at_the_batches_they_name(budget, keyword):
    seen = []

    def more(budget_bytes, searched):
        seen.append((budget_bytes, [p.key for p in searched]))
        return [("full", p.batch_size, p.micro_batches) for p in searched]

    result = search(budget, policies=("none",), **{keyword: more})
    assert seen and seen[0][0] == budget and seen[0][1][0][0] == "none"
    assert ("full", seen[0][1][0][1], 1) in {r.probe.key for r in result.rows}
    with pytest.raises(TypeError, match="not both"):
        search(budget, policies=("none",), extra_candidates=more, plans=more)


def test_nothing_fits_names_the_smallest_peak():
    with pytest.raises(
        jremat.FitError,
        match=r"nothing fits the budget .* smallest compiled peak is .*, policy '(none|full)' at batch 1$",
    ):
        search(1024, policies=("none", "full", "nothing here"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": "0.5"}, "needs a size"),
        ({"budget": "lots"}, "is not a size"),
        ({"finalists": 0}, "must be at least 1"),
        ({"global_batch": 0}, "global batch must be a positive whole number"),
        ({"policies": ()}, "at least one policy"),
        ({"batch_tolerance": 1.0}, r"batch_tolerance must be a fraction in \[0, 1\)"),
        ({"noise_tolerance": -0.1}, r"noise_tolerance must be a fraction in \[0, 1\)"),
    ],
)
def test_bad_settings_are_fit_errors(budget, kwargs, message):
    args = {"budget": budget, "policies": ("none",), **kwargs}
    with pytest.raises((jremat.FitError, ValueError), match=message):
        search(args.pop("budget"), **args)


def test_a_builder_that_returns_something_else_is_named():
    with pytest.raises(jremat.FitError, match="expected a jremat.FitStep"):
        jremat.fit_search(lambda *a: 42, ["none"], "1MiB", time_model=MODEL)


def test_measure_throughput_times_what_it_is_given(budget):
    timed = jremat.measure_throughput(
        build, [("none", 2, 1), ("full", 4, 2)], tokens_per_example=SEQ, rounds=2, calls_per_round=1
    )
    assert set(timed) == {("none", 2, 1), ("full", 4, 2)}
    assert all(len(v) == 2 and min(v) > 0 for v in timed.values())
    with pytest.raises(jremat.FitError, match="no program"):
        jremat.measure_throughput(build, [("nothing here", 2, 1)])


def test_the_calibrated_model_uses_powers_of_two():
    model = jremat.calibrate_time_model()
    for rate in (model.flops_per_s, model.bytes_per_s):
        assert rate > 0 and float(rate).hex().startswith("0x1.0000000000000p")


def test_keep_gathered_variants_are_of_single_function_policies_that_do_not_set_it():
    policies = ["none", "full", "every_k:k=2", "dots", "full:keep_gathered=true", "auto:budget=5", "my label", "nested"]
    assert jremat.keep_gathered_variants(policies) == ["every_k:k=2,keep_gathered=true", "dots:keep_gathered=true"]


def test_keep_collectives_variants_are_of_single_function_policies_that_do_not_set_it():
    policies = ["none", "full", "dots:keep_collectives=true", "skip_cheap", "auto:budget=5", "nested"]
    assert jremat.keep_collectives_variants(policies) == [
        "full:keep_collectives=true",
        "skip_cheap:keep_collectives=true",
    ]


@pytest.mark.parametrize(
    ("kinds", "recomputed", "searched"),
    [
        ((), (), ["full"]),
        (("all-gather", "all-reduce"), (), ["full", "full:keep_gathered=true"]),
        (("all-reduce",), (), ["full"]),  # data parallel: the gradients' reductions, not recomputed
        (("all-reduce",), ("all-reduce",), ["full", "full:keep_collectives=true"]),  # tensor parallel
        (("all-to-all", "all-reduce"), (), ["full", "full:keep_collectives=true"]),
        (("all-gather", "collective-permute"), (), ["full", "full:keep_gathered=true", "full:keep_collectives=true"]),
    ],
)
def test_the_search_adds_the_variants_the_first_steps_collectives_call_for(kinds, recomputed, searched):
    from jremat._plan.fit import _with_kept_variants

    class FirstProbe:
        def __init__(self):
            self.probed = []

        def probe(self, policy, batch, micro):
            self.probed.append(policy)
            return types.SimpleNamespace(collectives=tuple((kind, 1, 4) for kind in kinds), recomputed=recomputed)

    first = FirstProbe()
    assert _with_kept_variants(first, ["none", "full"], None, None, None) == ["none", *searched]
    # The recomputation is read from the first policy that takes the key.
    assert first.probed[1:] == (["full"] if "all-reduce" in kinds and "all-to-all" not in kinds else [])
    # Given, each key is searched or not whatever the step issues.
    assert _with_kept_variants(FirstProbe(), ["full"], None, False, True) == ["full", "full:keep_collectives=true"]


def test_one_device_has_no_collectives_and_no_keep_gathered_candidates(budget):
    result = search(budget, ("none", "full"))
    assert {p.policy for p in result.probes} == {"none", "full"}  # no all-gather: full's variant not searched
    assert all(p.devices == 1 and p.collectives == () for p in result.probes)
    assert "per device" not in result.table() and result.time_model.collective_s_per_byte == ()


def test_the_time_model_prices_collectives_per_kind():
    model = jremat.TimeModel(2.0**30, 2.0**30, (("all-gather", 2.0**-20), ("all-reduce", 2.0**-10)))
    assert model.collective_s([("all-gather", 3, 2**20), ("all-reduce", 1, 2**10)]) == 2.0
    # A kind without a rate is priced as an all-gather.
    assert model.collective_s([("collective-permute", 1, 2**20)]) == 1.0
    assert model.step_s(2.0**30, 2.0**30, [("all-gather", 1, 2**20)]) == 3.0
    with pytest.raises(jremat.FitError, match="no collective rates"):
        MODEL.collective_s([("all-gather", 1, 4)])
    assert MODEL.collective_s(()) == 0.0
