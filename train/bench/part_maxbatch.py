"""The ``maxbatch`` part (:data:`MAXBATCH`): the largest batch whose compiled Adam-step peak fits a budget."""

from __future__ import annotations

import time
from collections.abc import Sequence

from jremat import format_bytes
from jremat.fit import largest_fitting
from jremat.train.bench import harness
from jremat.train.bench.config import MAXBATCH_POLICIES, BenchConfig
from jremat.train.bench.harness import GIB, bench_peak, log, memory_fields
from jremat.train.bench.markdown import table
from jremat.train.bench.part import Part, Target
from jremat.train.bench.rows import MEMORY_COLUMNS, ROW_COLUMNS

#: The max-batch search: compiles per policy at most, and the largest batch tried.
MAXBATCH_PROBES = 8
MAXBATCH_LIMIT = 1 << 16


def run_maxbatch(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Largest batch per policy (whole step) whose compiled Adam-step peak fits the budget."""
    budget = int(config.maxbatch_budget_gib * GIB)
    seq = config.maxbatch_seq
    rows = []
    for spec in MAXBATCH_POLICIES:
        cfg = config.whole_step(config.megatron_config(spec), spec)
        t0 = time.perf_counter()
        batch, verified = largest_fitting(
            lambda b, cfg=cfg: bench_peak(harness.step_memory(cfg, b, seq).memory),
            budget,
            limit=MAXBATCH_LIMIT,
            max_probes=MAXBATCH_PROBES,
        )
        log(f"[maxbatch] {spec}: {batch}{'' if verified else ' (lower bound)'} ({time.perf_counter() - t0:.1f} s)")
        fields = memory_fields(harness.step_memory(cfg, batch, seq).memory) if batch else {}
        rows.append(
            MAXBATCH.row(
                spec,
                cfg,
                batch,
                seq,
                model=config.megatron_preset,
                scope="whole step" if cfg.remat_head_chunks else "none",
                budget_bytes=budget,
                max_batch=batch,
                max_batch_verified=verified,
                **fields,
            )
        )
    return rows


RATIO_NOTE = (
    "Under `full` the peak is mostly parameters, gradients and both Adam moments, which do not shrink with the "
    "batch; the ratio depends on how much of the budget they leave."
)


def maxbatch_targets(rows: list[dict]) -> list[Target]:
    """``full``'s max batch at least 5x ``none``'s (when both ran)."""
    mb = {r["policy"]: r["max_batch"] for r in rows}
    if "none" not in mb or "full" not in mb:
        return []
    ratio = mb["full"] / mb["none"] if mb["none"] else float("inf")
    return [
        Target(
            "Max batch (whole step): full >= 5x none",
            f"{mb['full']} vs {mb['none']} ({ratio:.2f}x)",
            ratio >= 5,
            RATIO_NOTE,
        )
    ]


def maxbatch_tables(rows: list[dict], plots: Sequence[str], plot_dir: str) -> list[str]:
    """Max batch per policy, whether verified, its ratio to ``none``'s and the peak there."""
    r0 = rows[0]
    none = next((r["max_batch"] for r in rows if r["policy"] == "none"), 0)
    lines = [
        f"## Max batch under {r0['budget_bytes'] / GIB:g} GiB: {r0['model']}, s={r0['seq_len']}, Adam step, whole step",
        "",
    ]
    return lines + table(
        ("policy", "max batch", "verified", "vs none", "peak at max batch"),
        [
            (
                r["policy"],
                r["max_batch"],
                "yes" if r["max_batch_verified"] else "lower bound",
                f"{r['max_batch'] / none:.2f}x" if none else "n/a",
                format_bytes(r["peak_bytes"] or 0),
            )
            for r in rows
        ],
    )


MAXBATCH = Part(
    "maxbatch",
    run_maxbatch,
    (*ROW_COLUMNS, "budget_bytes", "max_batch", "max_batch_verified", *MEMORY_COLUMNS),
    maxbatch_targets,
    maxbatch_tables,
)
