"""The bench's report: the verdict (:func:`check_targets`), why targets were missed, and RESULTS.md
(each part's tables come from its :class:`~train.bench.part.Part`; plots: :mod:`train.bench.plots`)."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Sequence

import jax

from jremat.train.bench.markdown import table
from jremat.train.bench.part import Target
from jremat.train.bench.parts import BENCH_PARTS, part_of_rows

#: The order of the report's part sections (and of the notes on missed targets): the run order but
#: for ``fit``, whose section comes before ``auto``'s.
SECTION_ORDER = ("needle", "needle_time", "megatron", "maxbatch", "time", "peers", "fit", "auto")


def check_targets(rows: Sequence[dict]) -> list[Target]:
    """Every target the measured rows cover, part by part in run order."""
    return [t for name, own in part_of_rows(list(rows)).items() for t in BENCH_PARTS[name].targets(own)]


def miss_notes(targets: Sequence[Target]) -> list[str]:
    """The notes of the missed ``targets``, each once, in the order of ``targets``."""
    return list(dict.fromkeys(t.miss_note for t in targets if not t.met and t.miss_note))


def throughput_note(rows: Sequence[dict]) -> str:
    """What the absolute columns are and which peak MFU is against ("" when no row was timed)."""
    timed = [r for r in rows if r.get("step_s", "") not in ("", None)]
    if not timed:
        return ""
    peak = next((r["peak_bf16_tflops"] for r in timed if r.get("peak_bf16_tflops", "") not in ("", None)), None)
    mfu = (
        f"MFU = TFLOP/s over the device's published dense bf16 peak, {peak:g} TFLOP/s (float32 runs too)"
        if peak
        else "MFU is empty: no published peak is known for this device, and none is guessed"
    )
    return (
        "Absolute figures: step = the median timed step; tokens/s = batch x seq / step; TFLOP/s = model FLOPs per "
        "step / step, per device (MaxText's count, docs/benchmark.md: 6 x matmul weights + causal attention per "
        f"token, recomputation not counted); {mfu}."
    )


def machine_description() -> str:
    """The machine and software that produced the figures, in one line."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({usable} usable), JAX "
        f"{jax.__version__} (backend {jax.default_backend()}, {jax.devices()[0].device_kind}), Python "
        f"{platform.python_version()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '').strip() or '(unset)'}"
    )


#: A report line after which ``train.bench`` keeps the old report's text when it rewrites it:
#: results from other machines, written by hand (docs/RESULTS.md's accelerator runs).
KEPT_MARKER = "<!-- train.bench keeps everything below this line when it rewrites this file -->"


def kept_text(path: str) -> str:
    """The part of an existing report that a rewrite keeps: from :data:`KEPT_MARKER` to the end.

    Args:
      path: the report's path.

    Returns:
      A newline and that text, to append to the new report; ``""`` if there is no file or no marker.
    """
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        return ""
    at = old.find(KEPT_MARKER)
    return "" if at < 0 else "\n" + old[at:]


def results_markdown(
    rows: Sequence[dict],
    plots: Sequence[str],
    plot_dir: str,
    command: str,
    wall_s: float,
    notes: Sequence[str] = (),
    explanations: str = "",
) -> str:
    """The report: how it was produced, the verdict table, one section per part, notes.

    Args:
      rows: every measured row.
      plots: the PNG file names written.
      plot_dir: where the plots and CSV files are, relative to the report.
      command: the exact command line.
      wall_s: the run's wall time.
      notes: extra lines (skipped policies ...).
      explanations: markdown placed after the verdict (why the numbers are what they are).
    """
    own = part_of_rows(list(rows))
    targets = {name: BENCH_PARTS[name].targets(part_rows) for name, part_rows in own.items()}
    data = ", ".join(
        f"[{plot_dir}/{BENCH_PARTS[name].csv_name}]({plot_dir}/{BENCH_PARTS[name].csv_name})" for name in own
    )
    lines = [
        "# Benchmark results",
        "",
        "Everything below, tables and plots, comes from one run of:",
        "",
        "```",
        command,
        "```",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; wall time "
        f"{wall_s / 60:.0f} min (compiles included)",
        f"- Machine: {machine_description()}",
        f"- Data: {data} (one CSV per part, one row per measurement)",
        "- Memory is compile-only: XLA's buffer assignment of the jitted step (nothing is allocated); "
        "peak = arguments + outputs - aliased + temp. Time ratios are to `none` measured in the same process: "
        "the median over interleaved rounds of each round's paired ratio, with the quartiles of those ratios.",
    ]
    note = throughput_note(rows)
    lines += [f"- {note}"] if note else []
    lines += [
        "",
        "## Verdict",
        "",
    ]
    verdict = [t for part_targets in targets.values() for t in part_targets]
    lines += table(("target", "measured", "met"), [(t.text, t.measured, "yes" if t.met else "**no**") for t in verdict])
    sections = [name for name in SECTION_ORDER if name in own]
    missed = miss_notes([t for name in sections for t in targets[name]])
    if missed:
        lines += ["### Why the misses", ""] + [f"* {note}" for note in missed] + [""]
    if explanations:
        lines += [explanations.strip(), ""]
    for name in sections:
        lines += BENCH_PARTS[name].tables(own[name], plots, plot_dir)
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)
