"""python -m train.bench: smoke run on tiny sizes (CSV columns, plots, summary) and exit code 2 on bad flags."""

import csv

import pytest

import jax
from train import bench


def test_quick_run_writes_csv_plots_and_summary(tmp_path, capsys):
    out = tmp_path / "results"
    code = bench.main(["--quick", "--out", str(out), "--parts", "needle,needle_time,megatron,time",
                       "--policy", "none", "--policy", "full", "--policy", "every_k:k=4", "--policy", bench.BASELINE_JAX,
                       "--needle-batches", "4", "--needle-d-ffs", "32", "--needle-ks", "0,2"])
    assert code == 0
    with open(out / "bench.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == bench.CSV_COLUMNS
        rows = list(reader)
    assert {r["part"] for r in rows} == {"needle_batch", "needle_dff", "needle_time", "megatron", "time"}
    meg = {r["policy"]: r for r in rows if r["part"] == "megatron"}
    assert list(meg) == ["none", "full", "every_k:k=4", bench.BASELINE_JAX]
    # full keeps one bf16 block input per layer: exactly 2 bytes per element of [b, s, h].
    assert float(meg["full"]["saved_per_sbh"]) == pytest.approx(2.0)
    assert float(meg[bench.BASELINE_JAX]["saved_per_sbh"]) == pytest.approx(2.0)
    assert float(meg["none"]["saved_per_sbh"]) > float(meg["every_k:k=4"]["saved_per_sbh"]) > 2.0
    assert int(meg["full"]["peak_bytes"]) < int(meg["none"]["peak_bytes"])
    timed = [r for r in rows if r["part"] in ("time", "needle_time")]
    assert {r["policy"] for r in timed} == {"none", "full", "every_k:k=4", bench.BASELINE_JAX, "every_k:k=2"}
    for r in timed:
        ratio, low, high = (float(r[c]) for c in ("time_ratio_vs_none", "time_ratio_low", "time_ratio_high"))
        assert int(r["time_steps"]) == 5 and int(r["peak_bytes"]) > 0
        # --quick times in one round: the round's ratio is the overall ratio.
        assert low == pytest.approx(ratio) and high == pytest.approx(ratio)
        if r["policy"] == "none":
            assert ratio == 1.0
    for name in ("needle_batch", "needle_dff", "needle_k_time", "megatron", "pareto"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    assert "python -m train.bench --quick" in summary and f"JAX {jax.__version__}" in summary
    assert "## Targets" in summary and "![pareto.png](pareto.png)" in summary


def test_quick_maxbatch_and_auto_parts(tmp_path, capsys):
    out = tmp_path / "results"
    code = bench.main(["--quick", "--out", str(out), "--parts", "maxbatch,auto", "--policy", "none", "--policy", "full"])
    assert code == 0
    with open(out / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    maxb = {r["policy"]: int(r["max_batch"]) for r in rows if r["part"] == "maxbatch"}
    assert maxb["full"] >= maxb["none"] >= 1
    [auto] = [r for r in rows if r["part"] == "auto"]
    assert int(auto["peak_bytes"]) <= int(auto["budget_bytes"])
    assert auto["best_fitting_policy"] in ("none", "full") and float(auto["time_ratio_vs_none"]) > 0
    assert "## auto at 1 budgets" in (out / "summary.md").read_text()
    for name in ("maxbatch", "pareto"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unregistered_default_policy_is_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "DEFAULT_POLICIES", ("none", "no_such_policy_yet"))
    config = bench.BenchConfig(out=str(tmp_path), parts=("megatron",), quick=True, policy=bench.DEFAULT_POLICIES)
    rows, _, notes = bench.run(config, "test")
    assert [r["policy"] for r in rows] == ["none"]
    assert "skipped policy 'no_such_policy_yet'" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parts", "needle,bogus"], "unknown part 'bogus'"),
        (["--policy", "every_k:k=0"], "bad --policy"),
        (["--policy", "no_such_policy"], "unknown policy"),
        (["--time-steps", "3"], "--time-steps must be an integer >= 5"),
        (["--time-steps", "8", "--time-rounds", "9"], "--time-rounds 9 exceeds --time-steps 8"),
        (["--needle-batches", "4,x"], "comma-separated integers"),
        (["--auto-budget-fractions", "0.5,1.5"], "--auto-budget-fractions must be numbers in (0, 1)"),
        (["--remat-head-chunks", "3"], "--remat-head-chunks 3 does not divide sequence length 20"),
        (["--megatron-preset", "huge"], "is not a preset"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_time_ratios_pair_rounds_so_load_drift_cancels():
    # round 2 is 10x slower for both (load drift), round 1 only for the label (an outlier):
    # paired ratios 1.1, 11, 1.1 give 1.1, where the ratio of overall medians would give 11
    times = {"none": [[1.0], [1.0], [10.0]], "p": [[1.1], [11.0], [11.0]]}
    ratio, low, high = bench.time_ratios(times, "none")["p"]
    assert ratio == pytest.approx(1.1)
    assert low == pytest.approx(1.1) and high == pytest.approx(6.05)
    assert bench.time_ratios(times, "none")["none"] == (1.0, 1.0, 1.0)


def test_max_batch_bisects_when_the_affine_prediction_is_off(monkeypatch):
    # peak rises 1 per sequence up to 8, then only 0.4: the prediction from batches 1 and 8 says
    # 8, the answer is 9; walking down one batch at a time from 16 would run out of compiles
    peaks = {}

    def fake_peak(batch):
        peaks[batch] = 10 + (batch - 1 if batch <= 8 else 7 + 0.4 * (batch - 8))
        return peaks[batch]

    monkeypatch.setattr(bench, "step_memory", lambda cfg, batch, seq: batch)
    monkeypatch.setattr(bench, "bench_peak", fake_peak)
    assert bench.max_batch(None, budget=17.5, seq=16) == (9, True)
    assert len(peaks) <= 8
