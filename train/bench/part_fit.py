"""The ``fit`` part (:data:`FIT`): the fit search (:mod:`train.fit`) at budgets between ``full``'s and
``none``'s peak, each winner timed against every built-in at its largest fitting batch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from jremat import format_bytes
from jremat.train.bench.config import BenchConfig
from jremat.train.bench.harness import log
from jremat.train.bench.markdown import table
from jremat.train.bench.part import Part, Target
from jremat.train.bench.rows import ROW_COLUMNS


def run_fit(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """The fit search (:mod:`train.fit`) at budgets between full's and none's train-step peak at
    ``--time-batch``, then every built-in at its largest fitting batch and each winner timed
    together in one session, so each winner is compared with the best built-in that fits.

    ``search_s`` is the whole search's wall time (every budget); ``tokens_per_s`` is from the
    comparison session; ``best_fitting_time_ratio`` is the winner's tokens/s over the best
    built-in's (>= 1: the winner is faster).
    """
    import jremat
    from jremat.train import fit as fit_lib

    cfg, batch = config.time_model(), config.time_batch
    seq = cfg.max_seq_len
    builder = fit_lib.GPTStepBuilder(lambda spec: config.whole_step(cfg, spec), seq, fit_lib.SEARCH_OPTIMIZER)
    peaks = {s: builder.peak_bytes(builder.config(s, batch, 1), batch, 1) for s in ("none", "full")}
    budgets = [int(peaks["full"] + f * (peaks["none"] - peaks["full"])) for f in config.fit_budget_fractions]
    log(
        f"[fit] budgets {', '.join(f'{b:,}' for b in budgets)} B (full {peaks['full']:,}, none {peaks['none']:,} at batch {batch})"
    )
    t0 = time.perf_counter()
    results = fit_lib.search(
        builder, budgets, fit_lib.FIT_POLICIES, auto=True, rounds=config.fit_rounds, progress=False
    )
    search_s = time.perf_counter() - t0
    log(
        f"[fit] searched in {search_s:.0f} s: "
        + "; ".join(f"{r.budget_bytes:,} B -> {r.winner.probe.policy} b={r.winner.probe.batch_size}" for r in results)
    )

    def builtins(result):  # every built-in at its largest fitting batch for this budget
        return [f for f in result.rows if f.origin == "search" and f.probe.policy in fit_lib.FIT_POLICIES]

    keys = list(dict.fromkeys(f.probe.key for r in results for f in [r.winner, *builtins(r)]))
    measured = jremat.measure_throughput(builder, keys, tokens_per_example=seq, rounds=config.fit_rounds)
    median = {k: statistics.median(v) for k, v in measured.items()}
    rows = []
    for r in results:
        best = max(builtins(r), key=lambda fit_row: median[fit_row.probe.key])
        for fit_row in dict.fromkeys([r.winner, *builtins(r)]):
            p = fit_row.probe
            rows.append(
                FIT.row(
                    builder.describe(*p.key),
                    builder.config(*p.key),
                    p.batch_size,
                    seq,
                    model=config.time_preset,
                    micro_batches=p.micro_batches,
                    fit_role=f"winner ({fit_row.origin})" if fit_row is r.winner else "built-in",
                    fit_digest=r.digest,
                    search_s=search_s,
                    budget_bytes=r.budget_bytes,
                    peak_bytes=p.peak_bytes,
                    predicted_tokens_per_s=fit_row.predicted_tokens_per_s,
                    tokens_per_s=median[p.key],
                    time_steps=config.fit_rounds * 3,
                    best_fitting_policy=f"{best.probe.policy} b={best.probe.batch_size}",
                    best_fitting_time_ratio=median[r.winner.probe.key] / median[best.probe.key],
                )
            )
    return rows


FINALISTS_NOTE = (
    "The fit search times only the finalists its time model ranks first; a miss means the model ranked the "
    "fastest built-in below them, or the machine's noise between sessions exceeded the margin."
)
SESSIONS_NOTE = (
    "Each budget's winner is the fastest of its finalists in the search's own session; the comparison session "
    "measures again, and noise between sessions can reorder winners that are within it."
)


def fit_targets(rows: list[dict]) -> list[Target]:
    """Per budget: the winner fits and is within 3% of the best built-in; over budgets: its tokens/s never fall."""
    out = []
    winners = sorted((r for r in rows if r["fit_role"].startswith("winner")), key=lambda r: r["budget_bytes"])
    for r in winners:
        budget = format_bytes(r["budget_bytes"])
        out.append(
            Target(
                f"fit {budget}: the winner fits",
                f"peak {format_bytes(r['peak_bytes'])}",
                r["peak_bytes"] <= r["budget_bytes"],
                FINALISTS_NOTE,
            )
        )
        out.append(
            Target(
                f"fit {budget}: winner >= 0.97x the tokens/s of the best built-in at its largest fitting batch",
                f"{r['best_fitting_time_ratio']:.3f} ({r['policy']} b={r['batch_size']} vs {r['best_fitting_policy']})",
                r["best_fitting_time_ratio"] >= 0.97,
                FINALISTS_NOTE,
            )
        )
    if len(winners) > 1:
        out.append(
            Target(
                "fit: the winner's tokens/s never falls as the budget grows",
                " -> ".join(f"{r['tokens_per_s']:,.0f}" for r in winners),
                all(a["tokens_per_s"] <= b["tokens_per_s"] for a, b in zip(winners, winners[1:])),
                SESSIONS_NOTE,
            )
        )
    return out


def fit_tables(rows: list[dict], plots: Sequence[str], plot_dir: str) -> list[str]:
    """Per budget: the winner and every built-in at its largest fitting batch, predicted and measured tokens/s."""
    r0 = rows[0]
    lines = [
        f"## Fit search: the policy and batch that train fastest in a budget ({r0['model']}, seq {r0['seq_len']}, "
        "Adam step)",
        "",
        f"`train.fit` searched {len({r['budget_bytes'] for r in rows})} budgets between `full`'s and `none`'s peak in "
        f"{r0['search_s']:.0f} s of wall time (compile-only batch searches, the planner's plans, the finalists timed). "
        "Then each winner and every built-in at its largest fitting batch were timed together in one session "
        f"({r0['time_steps']} steps each, interleaved rounds); those are the tokens/s below.",
        "",
    ]
    return lines + table(
        (
            "budget",
            "candidate",
            "role",
            "batch",
            "peak",
            "predicted tokens/s",
            "tokens/s",
            "winner / best built-in",
            "digest",
        ),
        [
            (
                format_bytes(r["budget_bytes"]),
                f"`{r['policy']}`",
                r["fit_role"],
                r["batch_size"],
                format_bytes(r["peak_bytes"]),
                f"{r['predicted_tokens_per_s']:,.0f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['best_fitting_time_ratio']:.3f}" if r["fit_role"].startswith("winner") else "",
                f"`{r['fit_digest']}`" if r["fit_role"].startswith("winner") else "",
            )
            for r in rows
        ],
    )


FIT = Part(
    "fit",
    run_fit,
    (
        *ROW_COLUMNS,
        "micro_batches",
        "fit_role",
        "fit_digest",
        "search_s",
        "budget_bytes",
        "peak_bytes",
        "predicted_tokens_per_s",
        "tokens_per_s",
        "time_steps",
        "best_fitting_policy",
        "best_fitting_time_ratio",
    ),
    fit_targets,
    fit_tables,
)
