"""The bench report from a fixed set of measured rows (byte for byte), miss notes that travel with their targets,
and one CSV per part of exactly its columns."""

import csv
import dataclasses
import pathlib
import re

import pytest

from jremat.train.bench import cli as bench
from jremat.train.bench import parts, report, rows
from jremat.train.bench.cli import READING_GUIDE
from jremat.train.bench.config import PARTS, BenchConfig
from jremat.train.bench.part import Target
from jremat.train.bench.part_time import BOUND_NOTE
from tests.train.bench_rows import measured_rows

GOLDEN = pathlib.Path(__file__).parent / "bench_golden"


def rendered(rows: list[dict]) -> str:
    """The report of ``rows``, its date and machine lines (which change from run to run) blanked."""
    text = report.results_markdown(
        rows,
        ["needle_batch.png", "needle_dff.png", "needle_k_time.png", "time.png", "peers.png"],
        "results",
        "python -m train.bench --quick",
        1234.0,
        ["a note"],
        READING_GUIDE,
    )
    text = re.sub(r"^- Date: .*? UTC;", "- Date: (date) UTC;", text, flags=re.M)
    return re.sub(r"^- Machine: .*$", "- Machine: (machine)", text, flags=re.M)


@pytest.mark.parametrize("miss", [False, True], ids=["met", "missed"])
def test_report_of_fixed_rows_is_unchanged(miss):
    golden = (GOLDEN / f"report_{'missed' if miss else 'met'}.md").read_text()
    assert rendered(measured_rows(miss)) == golden


def test_a_reworded_target_keeps_its_miss_note(monkeypatch):
    time_part = parts.BENCH_PARTS["time"]

    def reworded(own: list[dict]) -> list[Target]:
        return [dataclasses.replace(t, text=f"step time check {i}") for i, t in enumerate(time_part.targets(own))]

    monkeypatch.setitem(parts.BENCH_PARTS, "time", dataclasses.replace(time_part, targets=reworded))
    text = rendered(measured_rows(miss=True))
    verdict, notes = text.split("### Why the misses")
    assert "| step time check 2 | 1.500x (FLOPs bound 1.240x) | **no** |" in verdict and "| Time, " not in verdict
    assert f"* {BOUND_NOTE}" in notes.split("## What each number covers")[0]
    # met, the same targets bring no note
    assert "### Why the misses" not in rendered(measured_rows(miss=False))


def test_missed_notes_come_once_each_in_target_order():
    targets = [
        Target("a", "1", False, "note one"),
        Target("b", "2", True, "note met"),
        Target("c", "3", False, "note two"),
        Target("d", "4", False, "note one"),
        Target("e", "5", False),
    ]
    assert report.miss_notes(targets) == ["note one", "note two"]


def test_each_part_writes_a_csv_of_exactly_its_own_columns(tmp_path, monkeypatch):
    fixture = parts.part_of_rows(measured_rows(miss=True))
    assert tuple(fixture) == PARTS  # the fixture covers every part
    for name, part in parts.BENCH_PARTS.items():
        monkeypatch.setitem(parts.BENCH_PARTS, name, dataclasses.replace(part, run=lambda c, p, own=fixture[name]: own))
    out = tmp_path / "results"
    assert bench.main(["--quick", "--policy", "none", "--out", str(out), "--report", str(tmp_path / "R.md")]) == 0
    for name, part in parts.BENCH_PARTS.items():
        with open(out / part.csv_name, newline="") as f:
            reader = csv.DictReader(f)
            assert tuple(reader.fieldnames) == part.columns
            assert [r["part"] for r in reader] == [r["part"] for r in fixture[name]]
        assert len(set(part.columns)) == len(part.columns)
    assert sorted(p.name for p in out.glob("*.csv")) == sorted(p.csv_name for p in parts.BENCH_PARTS.values())
    assert [ln for ln in (tmp_path / "R.md").read_text().splitlines() if "- Data:" in ln] == [
        "- Data: "
        + ", ".join(f"[results/{p.csv_name}](results/{p.csv_name})" for p in parts.BENCH_PARTS.values())
        + " (one CSV per part, one row per measurement)"
    ]
    # a run of one part leaves no other part's CSV beside its report
    assert bench.main(["--quick", "--parts", "maxbatch", "--out", str(out), "--report", ""]) == 0
    assert [p.name for p in out.glob("*.csv")] == ["bench-maxbatch.csv"]


def test_a_part_refuses_a_column_it_does_not_have(tmp_path):
    cfg = BenchConfig(quick=True).block_model()
    maxbatch, time_part = parts.BENCH_PARTS["maxbatch"], parts.BENCH_PARTS["time"]
    with pytest.raises(ValueError, match="part 'maxbatch' has no column time_ratio_vs_none"):
        maxbatch.row("full", cfg, 8, 16, time_ratio_vs_none=1.0)
    with pytest.raises(ValueError, match="part 'needle' writes rows of needle_batch, needle_dff, not 'time'"):
        parts.BENCH_PARTS["needle"].row("none", cfg, 8, 16, part="time")
    with pytest.raises(ValueError, match="dict contains fields not in fieldnames: .*'max_batch'"):
        rows.write_csv([maxbatch.row("full", cfg, 8, 16, max_batch=8)], tmp_path / "x.csv", time_part.columns)
    assert "max_batch" in maxbatch.columns and "max_batch" not in time_part.columns
