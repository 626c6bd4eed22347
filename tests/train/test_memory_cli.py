"""python -m train.memory: JSON schema, table, plot and one-line errors with exit code 2 (tiny, compile-only)."""

import json
from types import SimpleNamespace

import pytest

import jremat
from jremat.train import memory as tm
from jremat.train import memory_live

TINY = ["--preset", "tiny", "--batch-size", "2", "--dtype", "bfloat16"]
KEYS = {
    "policy",
    "peak_bytes",
    "temp_bytes",
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "saved_bytes",
    "saved_bytes_per_layer",
    "n_layers",
    "recompute_flops_fraction",
}


@pytest.mark.heavy
def test_json_rows_have_the_schema_and_consistent_figures(capsys):
    code = tm.main(TINY + ["--policy", "none", "--policy", "full", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    rows = json.loads(out)
    assert [r["policy"] for r in rows] == ["none", "full"]
    for r in rows:
        assert KEYS <= set(r)
        assert r["peak_bytes"] >= r["temp_bytes"] > 0 and r["n_layers"] == 2
    none, full = rows
    assert full["saved_bytes_per_layer"] == 2 * 16 * 32 * 2  # one bf16 block input [2, 16, 32]
    assert full["saved_bytes_per_layer"] < none["saved_bytes_per_layer"]
    assert full["recompute_flops_fraction"] > 0 and none["recompute_flops_fraction"] == 0
    assert none["peak_ratio_vs_none"] == 1.0


@pytest.mark.heavy
def test_auto_row_fits_its_budget_and_reuses_the_planners_compile(capsys, traced_reports):
    code = tm.main(
        TINY + ["--batch-size", "8", "--policy", "none", "--policy", "auto", "--memory-budget", "0.5", "--json"]
    )
    assert code == 0
    none, auto = json.loads(capsys.readouterr().out)
    budget = int(auto["policy"].split("auto:budget=")[1].split(" ")[0])
    assert auto["peak_bytes"] <= budget < none["peak_bytes"]
    assert traced_reports.cache_info().hits == 1  # the auto row: the planner's compile of its plan


@pytest.mark.heavy
def test_nested_policies_get_rows(capsys, traced_reports):  # the layer stack applies them
    argv = TINY + ["--policy", "none", "--policy", "nested:block=2", "--policy", "nested:block=auto", "--json"]
    assert tm.main(argv) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [r["policy"] for r in rows] == ["none", "nested:block=2", "nested:block=auto"]
    assert rows[1]["recompute_flops_fraction"] > 0
    # the compiles are announced on stderr, the JSON on stdout stays whole
    assert captured.err == "compiling the gradient step under 3 policies (none, nested:block=2, nested:block=auto)...\n"


@pytest.mark.heavy
def test_sublayer_granularity_takes_names_of_either_sublayer(capsys, traced_reports):
    argv = TINY + ["--granularity", "sublayer", "--policy", "none", "--policy", "names:save=q+k+v", "--json"]
    assert tm.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["none", "names:save=q+k+v"]
    assert rows[1]["saved_bytes_per_layer"] < rows[0]["saved_bytes_per_layer"]


@pytest.mark.heavy
def test_table_and_plot(tmp_path, capsys, traced_reports):  # the layout, not XLA's figures
    plot = tmp_path / "mem.png"
    assert tm.main(TINY + ["--policy", "full", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "saved/layer" in out and "peak" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "nope"], "invalid choice"),
        (["--preset", "tiny", "--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--preset", "tiny", "--layers", "-1"], "--layers must be a positive integer"),
        (["--preset", "tiny", "--d-model", "0"], "--d-model must be a positive integer"),
        (["--preset", "tiny", "--heads", "3"], "does not divide d_model"),
        (["--preset", "tiny", "--policy", "no_such_policy"], "unknown policy"),
        (["--preset", "tiny", "--policy", "every_k:k=0"], "k must be >="),
        (["--preset", "tiny", "--dropout", "1.5"], "--dropout"),
        (["--preset", "tiny", "--granularity", "layer"], "--granularity"),
        (["--preset", "tiny", "--seq-len", "4096"], "is longer than the model has positions"),
        (["--preset", "tiny", "--policy-module", "no.such.module"], "cannot import policy module"),
        (["--preset", "tiny", "--batch-size", "two"], "expected an integer"),
        (["--preset", "tiny", "--bogus"], "unrecognized arguments"),
        (["--preset", "tiny", "--policy", "auto", "--memory-budget", "6 parsecs"], "unknown unit 'parsecs'"),
        # the planner's error after three real compiles (CI checks it through train.ptb, measured
        # by the compile-free stand-in: tests/train/test_ptb.py)
        pytest.param(
            ["--preset", "tiny", "--policy", "auto", "--memory-budget", "1KiB"],
            "smallest achievable peak is",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert tm.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err and "Traceback" not in err


def test_help_lists_registered_policies(capsys):
    assert tm.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in jremat.available():
        assert name in out


def test_heads_without_head_dim_divides_d_model():
    cfg = tm.MemoryConfig(preset="tiny", heads=4, d_model=64).model_config("full")
    assert (cfg.n_heads, cfg.head_dim, cfg.d_model) == (4, 16, 64)


def test_live_on_cpu_says_why_and_keeps_compiled_figures(capsys, traced_reports):  # the wiring
    code = tm.main(TINY + ["--policy", "none", "--live", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    (row,) = json.loads(captured.out)
    assert row["live_peak_bytes"] is None and row["peak_bytes"] > 0
    assert "no allocator statistics" in captured.err and "--live needs a GPU or TPU" in captured.err


def test_live_child_prints_one_json_line(capsys):
    assert tm.main(TINY + ["--policy", "full", "--live-child"]) == 0
    assert json.loads(capsys.readouterr().out) == {"live_peak_bytes": None}


@pytest.mark.heavy
def test_live_peaks_come_from_one_process_per_policy(monkeypatch, capsys, traced_reports):  # the wiring
    calls = []

    def fake_child(config, spec):
        calls.append((tuple(config.model_argv()), spec))
        return {"none": 1000, "full": 600}[spec]

    monkeypatch.setattr(memory_live, "_allocator_stats_note", lambda: None)
    monkeypatch.setattr(memory_live, "_run_live_child", fake_child)
    assert tm.main(TINY + ["--policy", "none", "--policy", "full", "--live"]) == 0
    out = capsys.readouterr().out
    assert "live peak" in out.splitlines()[0]
    assert [spec for _, spec in calls] == ["none", "full"]
    assert calls[0][0] == (
        "--preset", "tiny", "--batch-size", "2", "--dtype", "bfloat16", "--attention", "explicit",
        "--attention-block-size", "128",
    )  # fmt: skip


@pytest.mark.heavy
def test_live_on_a_mesh_runs_each_policy_on_the_mesh_and_reports_per_device(monkeypatch, capsys):
    calls = []

    def fake_child(config, spec):
        calls.append((config.model_argv(), spec))
        return {"none": 1000, "full": 600}[spec]

    monkeypatch.setattr(memory_live, "_allocator_stats_note", lambda: None)
    monkeypatch.setattr(memory_live, "_run_live_child", fake_child)
    argv = ["--preset", "tiny", "--batch-size", "2", "--mesh", "data=1", "--policy", "none", "--policy", "full"]
    assert tm.main([*argv, "--live", "--remat-head-chunks", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "live/device" in lines[0] and "peak/device" in lines[0]
    assert "1000 B" in lines[2] and "600 B" in lines[3]
    assert [spec for _, spec in calls] == ["none", "full"]
    assert all(" ".join(child_argv).endswith("--mesh data=1") for child_argv, _ in calls)  # the child runs on the mesh


def test_model_argv_rebuilds_the_same_model():
    config = tm.parse_config(
        TINY
        + [
            "--layers",
            "3",
            "--heads",
            "2",
            "--dropout",
            "0.2",
            "--unrolled",
            "--remat-head-chunks",
            "2",
            "--attention",
            "blockwise",
            "--attention-block-size",
            "8",
            "--max-seq-len",
            "32",
            "--seq-len",
            "32",
            "--policy",
            "selective",
        ]
    )
    again = tm.parse_config(config.model_argv() + ["--policy", "selective"])
    assert again.model_config("selective") == config.model_config("selective")
    assert again.model_config("selective").attention == "blockwise" and again.resolved_seq_len == 32


# --------------------------------------------------------------------------------------------
# --timeline (one compile per policy: the timeline's compile also gives the row's figures)
# --------------------------------------------------------------------------------------------

TIMELINE_POLICIES = ("none", "full")


@pytest.fixture(scope="module")
def timeline_run(tmp_path_factory):
    png = tmp_path_factory.mktemp("timeline") / "timeline.png"
    argv = TIMELINE_ARGS + [a for p in TIMELINE_POLICIES for a in ("--policy", p)] + ["--timeline", str(png), "--json"]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = tm.main(argv)
    return code, {r["policy"]: r for r in json.loads(out.getvalue())}, png


TIMELINE_ARGS = TINY + ["--dropout", "0"]  # no dropout: a smaller program, a faster compile


def _stacked_internal(buffers, n_layers, batch, seq_len, d_model):
    """Forward residuals stacked over layers ([layers, batch, seq, ...]) that are not a block's input."""
    out = []
    for b in buffers:
        dims = [int(d) for d in b["shape"].split("[", 1)[1].split("]", 1)[0].split(",") if d]
        stacked = len(dims) >= 4 and dims[:3] == [n_layers, batch, seq_len]
        if b["kind"] == "forward residual" and stacked and dims[3:] != [d_model]:
            out.append(b)
    return out


@pytest.mark.heavy
def test_timeline_png_and_maximum_matches_the_compiled_peak(timeline_run):
    code, rows, png = timeline_run
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(rows) == set(TIMELINE_POLICIES)
    for row in rows.values():
        tl = row["timeline"]
        assert tl["compiled_peak_bytes"] == row["peak_bytes"]
        assert abs(tl["peak_bytes"] - row["peak_bytes"]) <= 0.02 * row["peak_bytes"], row["policy"]
        assert 0 <= tl["peak_position"] < tl["positions"] and len(tl["top_buffers"]) == 10
        sizes = [b["size_bytes"] for b in tl["top_buffers"]]
        assert sizes == sorted(sizes, reverse=True)


@pytest.mark.heavy
def test_full_remat_peak_holds_no_internal_activation_of_earlier_layers(timeline_run):
    _, rows, _ = timeline_run
    shape = (2, 2, 16, 32)  # tiny: layers, batch, seq, d_model
    # Without remat the backward loop holds every layer's internal activations (the check can fail) ...
    assert _stacked_internal(rows["none"]["timeline"]["buffers_at_peak"], *shape)
    # ... with full remat only the stacked block inputs are kept: not among the top buffers, nor anywhere.
    assert _stacked_internal(rows["full"]["timeline"]["top_buffers"], *shape) == []
    assert _stacked_internal(rows["full"]["timeline"]["buffers_at_peak"], *shape) == []


@pytest.mark.parametrize(
    "path, message",
    [
        ("{tmp}/no/such/dir/t.png", "does not exist"),
        ("{tmp}/t.svg", "must end in .png"),
        ("{tmp}", "is a directory"),
    ],
)
def test_bad_timeline_path_exits_2_before_compiling(path, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tm, "compare_policies", lambda *a, **k: pytest.fail("compiled despite a bad path"))
    assert tm.main(TINY + ["--timeline", path.format(tmp=tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --timeline ") and message in err and "\n" not in err


def test_timeline_png_legend_tells_peaks_a_few_kib_apart(tmp_path, monkeypatch):
    import matplotlib.axes

    from jremat.train import timeline_plot

    legends = []
    draw_legend = matplotlib.axes.Axes.legend

    def legend(ax, *args, **kwargs):
        legends.append(ax.get_legend_handles_labels()[1])
        return draw_legend(ax, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", legend)
    rows = [
        SimpleNamespace(
            policy=policy,
            n_layers=2,
            batch_size=1,
            seq_len=16,
            timeline=SimpleNamespace(
                peak_bytes=peak,
                peak_position=1,
                live_bytes=[0, peak, 0],
                compiled_peak_bytes=peak,
                loops=[],
                top_buffers=[],
            ),
        )
        for policy, peak in (("none", 218_172), ("full", 201_073), ("dots", 209_265))
    ]
    timeline_plot.write_timeline_png(rows, str(tmp_path / "t.png"))
    assert legends == [["none: peak 213.06 KiB", "full: peak 196.36 KiB", "dots: peak 204.36 KiB"]]
