"""The ``time`` part (:data:`TIME`): step time, FLOPs bound, peak and compile time of every policy on a
head-dominated and a block-dominated model."""

from __future__ import annotations

from collections.abc import Sequence

from jremat import format_bytes
from jremat.models import ModelConfig
from jremat.train.bench.config import BenchConfig
from jremat.train.bench.harness import log
from jremat.train.bench.markdown import ABSOLUTE_HEADER, absolute, image, percent, precision, quartiles, ratio, table
from jremat.train.bench.part import Part, Target
from jremat.train.bench.rows import ROW_COLUMNS, TIMED_COLUMNS
from jremat.train.bench.timed import timed_rows

#: The time ratio to ``none`` each policy with a target must stay within.
TIME_LIMITS = {"selective": 1.05, "every_k:k=4": 1.15, "full": 1.35}


def time_models(config: BenchConfig) -> list[tuple[str, ModelConfig, int]]:
    """``(label, model, batch)`` of the ``time`` part's head- and block-dominated models."""
    return [
        (f"head-dominated ({config.time_preset})", config.time_model(), config.time_batch),
        ("block-dominated", config.block_model(), config.block_batch),
    ]


def run_time(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Step time, FLOPs bound, peak and compile time of every policy on a head- and a block-dominated model."""
    rows = []
    for model, cfg, batch in time_models(config):
        configs = {spec: config.whole_step(cfg, spec) for spec in dict.fromkeys(["none", *policies])}
        log(f"[time] {model}: {len(configs)} policies at batch {batch}")
        rows += timed_rows(TIME, model, configs, batch, config)
    return rows


BOUND_NOTE = (
    "Read the time ratio against its FLOPs bound in the same row: a ratio near the bound is the recompute's "
    "cost, not overhead."
)


def time_targets(rows: list[dict]) -> list[Target]:
    """Every policy of :data:`TIME_LIMITS` within its limit, on each model."""
    out = []
    for r in rows:
        limit = TIME_LIMITS.get(r["policy"])
        if limit:
            out.append(
                Target(
                    f"Time, {r['model']}: {r['policy']} <= {limit:.2f}x none",
                    f"{ratio(r['time_ratio_vs_none'])} (FLOPs bound {ratio(r['flops_bound'])})",
                    r["time_ratio_vs_none"] <= limit,
                    BOUND_NOTE,
                )
            )
    return out


def time_tables(rows: list[dict], plots: Sequence[str], plot_dir: str) -> list[str]:
    """One table per model: time ratio, FLOPs bound, peak, its reduction, compile time, absolute figures."""
    lines = [
        "## Step time against the FLOPs bound",
        "",
        "FLOPs bound = the policy's step FLOPs over `none`'s (traced, recomputation included): the time "
        "ratio if every FLOP took the same time. Compile s = trace + lower + compile of the step, paid on "
        "every start. Policies cover the whole step (blocks, and the head and loss in "
        "chunks).",
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == model]
        r0 = sel[0]
        lines += [
            f"### {model}: {r0['n_layers']} layers, d_model {r0['d_model']}, d_ff {r0['d_ff']}, vocab "
            f"{r0['vocab_size']}, batch {r0['batch_size']} x {r0['seq_len']}, {precision(r0)}",
            "",
        ]
        lines += table(
            ("policy", "time / none (quartiles)", "FLOPs bound", "peak", "peak reduction", "compile s")
            + ABSOLUTE_HEADER,
            [
                (
                    r["policy"],
                    quartiles(r),
                    ratio(r["flops_bound"]),
                    format_bytes(r["peak_bytes"]),
                    percent(r["peak_reduction_vs_none"]),
                    f"{r['compile_s']:.1f}",
                    *absolute(r),
                )
                for r in sel
            ],
        )
    return lines + image("time.png", plots, plot_dir)


TIME = Part("time", run_time, (*ROW_COLUMNS, *TIMED_COLUMNS), time_targets, time_tables)
