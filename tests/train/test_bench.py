"""python -m train.bench: parts dispatched through the table, the report from fake measurements, one real tiny compile."""

import csv
import dataclasses
import os
import stat

import jax
import pytest
from flax import nnx

from jremat.fit import largest_fitting
from jremat.models import GPT, PRESETS
from jremat.train.bench import cli as bench
from jremat.train.bench import (
    flops,
    harness,
    part_maxbatch,
    part_megatron,
    part_needle,
    parts,
    peers,
    plots,
    report,
    rows,
    timed,
)
from jremat.train.bench.config import BenchConfig
from jremat.train.bench.part_time import TIME
from tests.train.bench_rows import measured_rows


def test_verdict_holds_every_target_and_says_where_jremat_is_worse():
    verdict = {t.text: (t.measured, t.met) for t in report.check_targets(measured_rows(miss=False))}
    assert verdict["Needle fig. 1 (whole step): peak reduction > 55% at every batch"][1]
    assert verdict["Needle fig. 2: reduction grows with d_ff"][1]
    assert verdict["Needle fig. 3: step time grows with k (largest k slower than smallest)"][1]
    assert verdict["Megatron: none saves s*b*h*(34 + 5*a*s/h) per layer (within 1%)"][1]
    assert verdict["Max batch (whole step): full >= 5x none"] == ("48 vs 8 (6.00x)", True)
    assert verdict["Time, block-dominated: full <= 1.35x none"] == ("1.080x (FLOPs bound 1.240x)", True)
    analytic = [ok for target, (_, ok) in verdict.items() if target.startswith("Analytic peak")]
    assert analytic == [True, True, True, True]
    assert verdict["auto fits budget 900.00 MiB"][1]
    assert all(met for _, met in verdict.values())
    # jremat full beats jax.checkpoint; Linen nn.remat_scan faster than it: the verdict says no.
    missed = {t.text: t.met for t in report.check_targets(measured_rows(miss=True))}
    assert missed["Peer jax.checkpoint: jremat full peak <= it and time within 5%"]
    assert not missed["Peer linen nn.remat_scan: jremat full peak <= it and time within 5%"]


@pytest.mark.heavy
def test_report_csv_and_plots_from_measured_rows(tmp_path):
    measured = measured_rows(miss=True)
    back = []
    for name, own in parts.part_of_rows(measured).items():
        part = parts.BENCH_PARTS[name]
        rows.write_csv(own, tmp_path / part.csv_name, part.columns)
        with open(tmp_path / part.csv_name) as f:
            reader = csv.DictReader(f)
            assert tuple(reader.fieldnames) == part.columns and len(list(reader)) == len(own)
        back += rows.read_csv(tmp_path / part.csv_name)
    assert len(back) == len(measured) and report.check_targets(back) == report.check_targets(measured)
    written = plots.write_plots(measured, str(tmp_path))
    assert written == ["needle_batch.png", "needle_dff.png", "needle_k_time.png", "time.png", "peers.png"]
    assert all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in written)
    text = report.results_markdown(measured, written, "results", "python -m train.bench", 600.0, ["a note"], "## Guide")
    assert "```\npython -m train.bench\n```" in text and f"JAX {jax.__version__}" in text
    assert "### Why the misses" in text and "Where a peer is smaller or faster, jremat is worse" in text
    assert "## Verdict" in text and "| **no** |" in text and "## Guide" in text and "- a note" in text
    assert "![time.png](results/time.png)" in text and "[results/bench-time.csv](results/bench-time.csv)" in text
    # a Needle table row: none, blocks, head and whole step side by side
    assert "| 256 | 64 | 95.37 MiB | 90.60 MiB (5.0%) | 38.15 MiB (60.0%) | 47.93 MiB (49.7%) |" in text
    assert "run " not in text.lower().replace("one run", "")


def time_rows() -> list[dict]:
    return [r for r in measured_rows(miss=False) if r["part"] == "time"]


def test_run_goes_through_the_part_table_and_writes_the_report(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_part(config, policies):
        seen.append(tuple(policies))
        return time_rows()

    monkeypatch.setitem(bench.BENCH_PARTS, "time", dataclasses.replace(TIME, run=fake_part))
    out, md = tmp_path / "results", tmp_path / "RESULTS.md"
    kept = f"{report.KEPT_MARKER}\n\n## A run on another machine\n\n| a | table |\n"
    md.write_text("# an older report\n\nits tables\n\n" + kept)
    md.chmod(0o644)
    umask = os.umask(0o022)
    code = bench.main(
        ["--parts", "time", "--out", str(out), "--report", str(md), "--policy", "none", "--policy", "full", "--quick"]
    )
    os.umask(umask)
    assert code == 0 and seen == [("none", "full")]
    assert stat.S_IMODE(md.stat().st_mode) == 0o644 and stat.S_IMODE((out / "bench-time.csv").stat().st_mode) == 0o644
    assert sorted(os.listdir(out)) == ["bench-time.csv", "time.png"]  # no partial folder left
    text = md.read_text()
    assert "python -m train.bench --parts time" in text and "![time.png](results/time.png)" in text
    assert "an older report" not in text and text.endswith(kept) and text.count(report.KEPT_MARKER) == 1
    assert "met    Time, block-dominated: full <= 1.35x none" in capsys.readouterr().out


def test_a_run_that_fails_midway_leaves_the_last_csv_and_report(tmp_path, monkeypatch, capsys):
    def done_part(config, policies):
        return time_rows()

    def failing_part(config, policies):
        raise RuntimeError("out of memory")

    monkeypatch.setitem(bench.BENCH_PARTS, "time", dataclasses.replace(TIME, run=done_part))
    monkeypatch.setitem(bench.BENCH_PARTS, "peers", dataclasses.replace(parts.BENCH_PARTS["peers"], run=failing_part))
    out, md = tmp_path / "results", tmp_path / "RESULTS.md"
    out.mkdir()
    (out / "bench-time.csv").write_text("the last complete run\n")
    md.write_text("# the last report\n")
    with pytest.raises(RuntimeError, match="out of memory"):
        bench.main(["--parts", "time,peers", "--out", str(out), "--report", str(md), "--policy", "none", "--quick"])
    assert (out / "bench-time.csv").read_text() == "the last complete run\n" and md.read_text() == "# the last report\n"
    (partial,) = out.glob("bench.partial-*")
    assert os.listdir(partial) == ["bench-time.csv"]  # the finished part's rows, and no other part's
    assert len(rows.read_csv(partial / "bench-time.csv")) == len(done_part(None, None))
    assert "[peers] failed" in capsys.readouterr().err
    # A later run that succeeds replaces bench-time.csv and leaves the failed run's rows where they were.
    argv = ["--parts", "time", "--out", str(out), "--report", str(md), "--policy", "none", "--quick"]
    assert bench.main(argv) == 0
    assert list(out.glob("bench.partial-*")) == [partial] and len(rows.read_csv(partial / "bench-time.csv")) == len(
        done_part(None, None)
    )
    assert len(rows.read_csv(out / "bench-time.csv")) == len(done_part(None, None))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parts", "needle,bogus"], "--parts takes a comma-separated subset"),
        (["--policy", "every_k:k=0"], "bad policy"),
        (["--policy", "no_such_policy"], "unknown policy"),
        (["--time-steps", "8", "--time-rounds", "9"], "--time-rounds 9 exceeds --time-steps 8"),
        (["--needle-batches", "4,x"], "comma-separated int values"),
        (["--auto-budget-fractions", "0.5,1.5"], "--auto-budget-fractions must be numbers in (0, 1)"),
        (["--remat-head-chunks", "3"], "--remat-head-chunks 3 does not divide sequence length 20"),
        (["--megatron-preset", "huge"], "invalid choice: 'huge'"),
        (["--policy", "none", "--k", "4"], "--k is a key of every_k"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_policy_key_flags_apply_to_the_policy_that_takes_them():
    config = bench.parse_config(["--policy", "none", "--policy", "every_k", "--k", "4", "--parts", "time,peers"])
    assert config.policy == ("none", "every_k:k=4") and config.parts == ("time", "peers")


def test_time_ratios_pair_rounds_so_load_drift_cancels():
    # round 2 is 10x slower for both (load drift), round 1 only for the label (an outlier):
    # paired ratios 1.1, 11, 1.1 give 1.1, where the ratio of overall medians would give 11
    times = {"none": [[1.0], [1.0], [10.0]], "p": [[1.1], [11.0], [11.0]]}
    ratio, low, high = bench.time_ratios(times, "none")["p"]
    assert ratio == pytest.approx(1.1)
    assert low == pytest.approx(1.1) and high == pytest.approx(6.05)
    assert bench.time_ratios(times, "none")["none"] == (1.0, 1.0, 1.0)


def test_max_batch_search_finds_the_boundary_when_the_slope_changes():
    # peak rises 1 per sequence up to 8, then only 0.4: a line through batches 1 and 2 says 8,
    # the answer is 9; the bench's search stops at part_maxbatch.MAXBATCH_PROBES compiles
    calls = []

    def peak(batch):
        calls.append(batch)
        return 10 + (batch - 1 if batch <= 8 else 7 + 0.4 * (batch - 8))

    limit, probes = part_maxbatch.MAXBATCH_LIMIT, part_maxbatch.MAXBATCH_PROBES
    assert largest_fitting(peak, 17.5, limit=limit, max_probes=probes) == (9, True)
    assert len(set(calls)) == len(calls) <= probes
    calls.clear()
    assert largest_fitting(peak, 10**6, limit=10**6, max_probes=3) == (8, False)  # a lower bound
    assert len(calls) == 3


def test_needle_scopes_cover_blocks_head_and_whole_step():
    assert part_needle.needle_scopes(4) == [
        ("none", "none", 0),
        ("blocks", "every_k:k=4", 0),
        ("head", "none", 4),
        ("whole step", "every_k:k=4", 4),
    ]
    assert [s for s, _, _ in part_needle.needle_scopes(0)] == ["none", "blocks"]
    config = BenchConfig(quick=True)
    assert config.whole_step(config.block_model(), "full").remat_head_chunks == 4
    assert config.whole_step(config.block_model(), "none").remat_head_chunks == 0


def test_linen_port_has_the_nnx_model_parameters():
    cfg = BenchConfig(quick=True).block_model()
    _, nnx_params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    linen_params = jax.eval_shape(
        lambda: peers.LinenGPT(cfg, "remat_scan").init(jax.random.key(0), jax.numpy.zeros((1, 16), "int32"))
    )
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    assert count(linen_params) == count(nnx_params)


@pytest.mark.heavy
def test_one_real_tiny_compile_and_timed_step():
    config = BenchConfig(quick=True)
    cfg = config.block_model()
    programs = [
        harness.gpt_program("none", cfg.replace(remat_policy="none"), 2),
        harness.gpt_program("full", config.whole_step(cfg, "full"), 2),
    ]
    measured = harness.measure(programs, steps=2, rounds=2)
    none, full = measured["none"], measured["full"]
    assert harness.bench_peak(full.memory) < harness.bench_peak(none.memory)
    assert full.flops > none.flops > 0 and none.compile_s > 0
    assert [len(r) for r in full.rounds] == [1, 1]
    assert harness.measured_ratios(measured, "none")["none"] == (1.0, 1.0, 1.0)


def test_model_flops_match_a_hand_count_for_tiny():
    cfg = PRESETS["tiny"]  # 2 layers, d_model 32, 2 heads of 16, d_ff 64, vocab 64, seq 16
    # per layer q, k, v, out: 4 * 32 * 32 = 4096; MLP: 2 * 32 * 64 = 4096; head: 32 * 64 = 2048
    assert flops.matmul_parameters(cfg) == 2 * (4096 + 4096) + 2048 == 18432
    weights = 6 * 18432  # per token: 2 FLOPs per weight forward, 4 backward
    # per token and layer: QK^T and PV, 2 * 16 * 32 FLOPs each forward (seq 16, 2 heads x 16), halved
    # by the causal mask, times 3 for forward + backward: 6 * 16 * 2 * 16 = 3072
    attention = 2 * 3 * (2 * 2 * 16 * 32) // 2
    assert attention == 6 * 2 * 16 * 2 * 16 == 6144
    assert flops.model_flops_per_step(cfg, 4, 16) == 4 * 16 * (weights + attention) == 7_471_104
    # embeddings, biases and LayerNorms are not matmul weights
    assert flops.matmul_parameters(cfg) < cfg.parameter_count()
    # MoE, 8 experts, top-2: per layer the router 32 * 8 and two SwiGLU experts, 3 * 32 * 64 each
    moe = cfg.replace(moe_experts=8, moe_top_k=2)
    assert flops.matmul_parameters(moe) == 2 * (4096 + 32 * 8 + 2 * 3 * 32 * 64) + 2048 == 35328
    shared = moe.replace(moe_shared_expert=True)  # plus the dense GELU MLP every token goes through
    assert flops.matmul_parameters(shared) == 35328 + 2 * 4096
    fields = flops.throughput_fields(cfg, 4, 16, 0.5, None)
    assert fields["tokens_per_s"] == 128 and fields["model_tflops_per_s"] == pytest.approx(7_471_104 / 0.5 / 1e12)
    assert fields["mfu"] == "" and fields["peak_bf16_tflops"] == ""
    known = flops.throughput_fields(cfg, 4, 16, 0.5, 989.4)
    assert known["mfu"] == pytest.approx(known["model_tflops_per_s"] / 989.4)


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", None),
        ("TPU v4", 275.0),
        ("TPU v4 lite", None),
        ("TPU v5 lite", 197.0),
        ("TPU v5", 459.0),
        ("TPU v6 lite", 918.0),
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu", None),
    ],
)
def test_mfu_peak_only_for_a_known_device_kind(kind, peak):
    assert flops.peak_bf16_tflops(kind) == peak


def test_this_cpu_has_no_peak_so_no_mfu():
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU")
    assert flops.peak_bf16_tflops(jax.devices()[0].device_kind) is None and timed.device_peak_tflops() is None


def test_report_shows_absolute_figures_and_the_peak_used():
    cfg = BenchConfig(quick=True).block_model()
    timing = dict(time_ratio_vs_none=1.0, time_ratio_low=1.0, time_ratio_high=1.0, flops_bound=1.0, compile_s=2.0)
    timing.update(peak_bytes=10**7, peak_reduction_vs_none=0.0)
    row = TIME.row(
        "none", cfg, 8, 128, model="block-dominated", **timing, **flops.throughput_fields(cfg, 8, 128, 0.5e-3, 989.4)
    )
    text = report.results_markdown([row], [], "results", "python -m train.bench", 60.0)
    assert "| step | tokens/s | TFLOP/s | MFU (bf16 peak) |" in text
    assert "dense bf16 peak, 989.4 TFLOP/s" in text
    # block-dominated none: 8 x 128 tokens in 0.5 ms
    line = next(ln for ln in text.splitlines() if ln.startswith("| none | 1.000x (1.000-1.000)"))
    # 8 * 128 * 6 * (18432 + 2 * 128 * 2 * 16) FLOPs in 0.5 ms: 0.327 TFLOP/s, 0.0331% of 989.4
    assert line.endswith("| 0.5 ms | 2.05M | 0.327 | 0.0331% |")


@pytest.mark.parametrize("argv", [["--attention", "cudnn"], ["--attention", "cudnn", "--dtype", "bfloat16"]])
def test_cudnn_attention_off_gpu_exits_2_with_one_line(argv, capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    assert bench.main([*argv, "--quick", "--report", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --attention: attention 'cudnn' needs an NVIDIA GPU") and "\n" not in err


def test_attention_and_dtype_reach_every_bench_model():
    xla = BenchConfig(quick=True, attention="xla", dtype="bfloat16")
    timed = [xla.time_model(), xla.block_model(), part_needle.needle_config(xla, 64, "none")]
    assert {(c.attention, c.dtype, c.attn_dropout) for c in timed} == {("xla", "bfloat16", 0.0)}
    assert xla.time_model().resid_dropout == 0.1  # only the attention dropout, which xla lacks, goes
    megatron = xla.megatron_config("none")  # Megatron's accounting is of 16-bit activations, whatever --dtype
    assert (megatron.attention, megatron.dtype, megatron.attn_dropout, megatron.resid_dropout) == (
        "xla",
        "bfloat16",
        0.0,
        0.1,
    )
    blockwise = BenchConfig(quick=True, attention="blockwise", attention_block_size=8)
    assert blockwise.megatron_config("none").attn_dropout == 0.1 and blockwise.block_model().attention_block_size == 8
    assert BenchConfig(quick=True).time_model() == PRESETS["tiny"]  # the defaults change nothing
    assert part_megatron.megatron_formulas(1024, 8, 768, 12)["none"] == 34 + 5 * 12 * 1024 / 768
    assert part_megatron.megatron_formulas(1024, 8, 768, 12, "blockwise")["none"] == 34.0
    assert "none" not in part_megatron.megatron_formulas(1024, 8, 768, 12, "xla")


@pytest.mark.heavy
def test_quick_time_part_in_bf16_with_blockwise_attention_has_absolute_figures(tmp_path):
    out, md = tmp_path / "results", tmp_path / "RESULTS.md"
    argv = ["--quick", "--parts", "time", "--policy", "none", "--dtype", "bfloat16", "--attention", "blockwise"]
    assert bench.main([*argv, "--time-steps", "2", "--time-rounds", "1", "--out", str(out), "--report", str(md)]) == 0
    with open(out / "bench-time.csv") as f:
        assert tuple(csv.DictReader(f).fieldnames) == TIME.columns
    time_rows = rows.read_csv(out / "bench-time.csv")
    assert [r["model"] for r in time_rows] == ["head-dominated (tiny)", "block-dominated"]
    for r in time_rows:
        assert (r["dtype"], r["attention"]) == ("bfloat16", "blockwise")
        assert r["step_s"] > 0 and r["model_tflops_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * r["seq_len"] / r["step_s"], rel=1e-4)
        assert r["model_flops"] == pytest.approx(
            flops.model_flops_per_step(PRESETS["tiny"], r["batch_size"], r["seq_len"]), rel=1e-5
        )
        assert r["mfu"] == "" and r["peak_bf16_tflops"] == ""  # no published peak for this CPU
    text = md.read_text()
    assert "bfloat16, attention blockwise" in text and "MFU is empty" in text
