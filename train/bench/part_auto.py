"""The ``auto`` part (:data:`AUTO`): ``auto`` plans at budgets between ``full``'s and ``none``'s peak, timed
against the built-ins."""

from __future__ import annotations

import time
from collections.abc import Sequence

from jremat import format_bytes
from jremat.models import ModelConfig
from jremat.train.bench import harness
from jremat.train.bench.config import MEGATRON_POLICIES, BenchConfig
from jremat.train.bench.harness import bench_peak, log
from jremat.train.bench.markdown import ABSOLUTE_HEADER, absolute, ratio, table
from jremat.train.bench.part import Part, Target
from jremat.train.bench.rows import ROW_COLUMNS, TIMED_COLUMNS
from jremat.train.bench.timed import timed_rows


def auto_part_specs(policies: Sequence[str]) -> list[str]:
    """The ``--policy`` specs the ``auto`` part times its plans against (beside ``none`` and ``full``)."""
    return [p for p in policies if p in MEGATRON_POLICIES] or list(policies)


def run_auto(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """``auto`` at budgets between full's and none's Adam-step peak, timed against the built-ins.

    Each budget's plan is solved and verified on the step the bench measures; the built-ins and
    plans are timed in one interleaved run, and each budget's row names the fastest built-in that
    fits it. ``compile_s`` of an ``auto`` row is the planning time (solve + verification compiles).
    """
    from jremat.train.planning import plan_for_budget

    cfg, batch = config.time_model(), config.time_batch

    def peak(model_cfg: ModelConfig) -> int:
        return bench_peak(harness.step_memory(model_cfg, batch).memory)

    specs = auto_part_specs(policies)
    builtins = {spec: cfg.replace(remat_policy=spec) for spec in dict.fromkeys(["none", "full", *specs])}
    peaks = {spec: peak(c) for spec, c in builtins.items()}
    budgets = [int(peaks["full"] + f * (peaks["none"] - peaks["full"])) for f in config.auto_budget_fractions]
    plans, plan_s = {}, {}
    for budget in budgets:
        t0 = time.perf_counter()
        plan = plan_for_budget(cfg, batch, str(budget), measure_peak_bytes=peak)
        label = f"auto:budget={budget} ({plan.candidate.describe(cfg.n_layers)})"
        plans[label], plan_s[label] = plan, time.perf_counter() - t0
        log(f"[auto] budget {budget:,} B -> {plan.candidate.describe(cfg.n_layers)} ({plan_s[label]:.1f} s)")
    configs = {**builtins, **{label: plan.config for label, plan in plans.items()}}
    timed = {r["policy"]: r for r in timed_rows(AUTO, config.time_preset, configs, batch, config)}
    rows = []
    for label, budget in zip(plans, budgets):
        best = min((s for s in builtins if peaks[s] <= budget), key=lambda s: timed[s]["time_ratio_vs_none"])
        rows.append(
            {
                **timed[label],
                "budget_bytes": budget,
                "compile_s": plan_s[label],
                "best_fitting_policy": best,
                "best_fitting_time_ratio": timed[best]["time_ratio_vs_none"],
            }
        )
    return rows


COST_MODEL_NOTE = (
    "auto ranks the plans that fit by recompute FLOPs; where the measured time disagrees by more than 3%, the "
    "cost model missed what the machine pays."
)


def auto_targets(rows: list[dict]) -> list[Target]:
    """Per budget: the plan fits it, and is within 3% of the fastest built-in that fits."""
    out = []
    for r in rows:
        out.append(
            Target(
                f"auto fits budget {format_bytes(r['budget_bytes'])}",
                f"peak {format_bytes(r['peak_bytes'])}",
                r["peak_bytes"] <= r["budget_bytes"],
                COST_MODEL_NOTE,
            )
        )
        out.append(
            Target(
                f"auto at {format_bytes(r['budget_bytes'])}: time <= 1.03x the fastest fitting built-in",
                f"{ratio(r['time_ratio_vs_none'])} vs {r['best_fitting_policy']} {ratio(r['best_fitting_time_ratio'])}",
                r["time_ratio_vs_none"] <= 1.03 * r["best_fitting_time_ratio"],
                COST_MODEL_NOTE,
            )
        )
    return out


def auto_tables(rows: list[dict], plots: Sequence[str], plot_dir: str) -> list[str]:
    """Per budget: the plan, its peak and time, the fastest fitting built-in and its time, the planning time."""
    r0 = rows[0]
    lines = [
        f"## auto at {len(rows)} budgets: {r0['model']}, batch {r0['batch_size']} x {r0['seq_len']}, Adam step",
        "",
    ]
    return lines + table(
        (
            "budget",
            "plan",
            "peak",
            "time / none",
            "fastest fitting built-in",
            "its time",
            "planning s",
            *ABSOLUTE_HEADER,
        ),
        [
            (
                format_bytes(r["budget_bytes"]),
                r["policy"],
                format_bytes(r["peak_bytes"]),
                ratio(r["time_ratio_vs_none"]),
                r["best_fitting_policy"],
                ratio(r["best_fitting_time_ratio"]),
                f"{r['compile_s']:.1f}",
                *absolute(r),
            )
            for r in rows
        ],
    )


AUTO = Part(
    "auto",
    run_auto,
    (*ROW_COLUMNS, *TIMED_COLUMNS, "budget_bytes", "best_fitting_policy", "best_fitting_time_ratio"),
    auto_targets,
    auto_tables,
)
