"""The bench's outputs: the CSV, the verdict (:func:`check_targets`) and the markdown report (plots: :mod:`train.bench.plots`)."""

from __future__ import annotations

import csv
import datetime
import io
import os
import platform
from collections.abc import Sequence
from typing import Any

import jax

from jremat import format_bytes
from jremat.models.config import FUSED_ATTENTIONS
from jremat.train.bench.harness import GIB
from jremat.train.bench.parts import CSV_COLUMNS
from jremat.train.files import write_text_atomically


def write_csv(rows: Sequence[dict], path: str) -> None:
    """Write ``rows`` with the columns :data:`~train.bench.parts.CSV_COLUMNS` (atomically)."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for r in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    write_text_atomically(path, buffer.getvalue())


def read_csv(path: str) -> list[dict]:
    """Rows written by :func:`write_csv`, with numbers as numbers ("" stays "")."""

    def value(text: str):
        if text in ("", "True", "False"):
            return {"True": True, "False": False}.get(text, text)
        try:
            return int(text)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return text

    with open(path, newline="") as f:
        return [{k: value(v) for k, v in r.items()} for r in csv.DictReader(f)]


def rows_by_part(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """``rows`` grouped by their ``part`` column, in first-seen order."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["part"], []).append(r)
    return out


def _pct(x) -> str:
    return "n/a" if x in (None, "") else f"{100 * x:.1f}%"


def _x(x) -> str:
    return "n/a" if x in (None, "") else f"{x:.3f}x"


def _step(r: dict) -> str:
    x = r.get("step_s", "")
    return "" if x in (None, "") else (f"{1e3 * x:.3g} ms" if x < 1 else f"{x:.3g} s")


def _si(x) -> str:
    """``12345.6`` -> ``12.3k`` (3 significant digits)."""
    if x in (None, ""):
        return ""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


#: The absolute columns of every timed table (:func:`_absolute`); MFU is against the dense bf16 peak.
ABSOLUTE_HEADER = ("step", "tokens/s", "TFLOP/s", "MFU (bf16 peak)")


def _absolute(r: dict) -> list[str]:
    """Step time, tokens/s, model TFLOP/s per device and MFU of a timed row ("" where not measured or no peak)."""
    tflops, mfu = r.get("model_tflops_per_s", ""), r.get("mfu", "")
    return [
        _step(r),
        _si(r.get("tokens_per_s", "")),
        "" if tflops in (None, "") else f"{tflops:.3g}",
        "" if mfu in (None, "") else f"{100 * mfu:.3g}%",
    ]


def _quartiles(r: dict) -> str:
    """``1.050x (1.040-1.060)``: the time ratio and its quartiles."""
    return f"{_x(r['time_ratio_vs_none'])} ({r['time_ratio_low']:.3f}-{r['time_ratio_high']:.3f})"


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


def _table(header: Sequence[str], lines: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c) for c in line) + " |" for line in lines] + [""]


def check_targets(rows: Sequence[dict]) -> list[tuple[str, str, bool]]:
    """Every target the measured rows cover: ``(target, measured, met)``."""
    parts, out = rows_by_part(rows), []
    whole = [r for r in parts.get("needle_batch", []) if r["scope"] == "whole step"]
    if whole:
        worst = min(r["peak_reduction_vs_none"] for r in whole)
        out.append(
            ("Needle fig. 1 (whole step): peak reduction > 55% at every batch", f"min {_pct(worst)}", worst > 0.55)
        )
        last = max(whole, key=lambda r: r["batch_size"])
        out.append(
            (
                f"Needle fig. 1: > 62% at batch {last['batch_size']}",
                _pct(last["peak_reduction_vs_none"]),
                last["peak_reduction_vs_none"] > 0.62,
            )
        )
    dff = sorted((r for r in parts.get("needle_dff", []) if r["scope"] == "whole step"), key=lambda r: r["d_ff"])
    if dff:
        worst = min(r["peak_reduction_vs_none"] for r in dff)
        out.append(("Needle fig. 2 (whole step): > 60% at every d_ff", f"min {_pct(worst)}", worst > 0.60))
        grows = all(a["peak_reduction_vs_none"] <= b["peak_reduction_vs_none"] for a, b in zip(dff, dff[1:]))
        out.append(
            (
                "Needle fig. 2: reduction grows with d_ff",
                " -> ".join(_pct(r["peak_reduction_vs_none"]) for r in dff),
                grows,
            )
        )
    nt = sorted((r for r in parts.get("needle_time", []) if r["k"]), key=lambda r: r["k"])
    if len(nt) > 1:
        out.append(
            (
                "Needle fig. 3: step time grows with k (largest k slower than smallest)",
                " -> ".join(f"{r['time_ratio_vs_none']:.2f}" for r in nt),
                nt[-1]["time_ratio_vs_none"] > nt[0]["time_ratio_vs_none"],
            )
        )
    meg = {r["policy"]: r for r in parts.get("megatron", [])}
    if "none" in meg and meg["none"]["megatron_per_sbh"] != "":
        v, f = meg["none"]["saved_per_sbh"], meg["none"]["megatron_per_sbh"]
        fused = meg["none"].get("attention", "explicit") in FUSED_ATTENTIONS
        formula = "34 (fused attention: no s*s term)" if fused else "(34 + 5*a*s/h)"
        out.append(
            (
                f"Megatron: none saves s*b*h*{formula} per layer (within 1%)",
                f"{v:.2f} vs {f:.2f} sbh",
                abs(v / f - 1) <= 0.01,
            )
        )
    for spec, limit in (("selective", 32.0), ("full", 2.1)):
        if spec in meg:
            v = meg[spec]["saved_per_sbh"]
            out.append((f"Megatron: {spec} saves <= {limit:g} sbh per layer", f"{v:.2f} sbh", v <= limit))
    for spec, r in meg.items():
        out.append(
            (
                f"Analytic peak within 10% of the compiled peak: {spec} ({r['model']} b{r['batch_size']} "
                f"s{r['seq_len']} {r['dtype']})",
                f"{100 * r['analytic_error']:+.1f}%",
                abs(r["analytic_error"]) <= 0.10,
            )
        )
    mb = {r["policy"]: r["max_batch"] for r in parts.get("maxbatch", [])}
    if "none" in mb and "full" in mb:
        ratio = mb["full"] / mb["none"] if mb["none"] else float("inf")
        out.append(
            ("Max batch (whole step): full >= 5x none", f"{mb['full']} vs {mb['none']} ({ratio:.2f}x)", ratio >= 5)
        )
    for r in parts.get("time", []):
        limit = {"selective": 1.05, "every_k:k=4": 1.15, "full": 1.35}.get(r["policy"])
        if limit:
            out.append(
                (
                    f"Time, {r['model']}: {r['policy']} <= {limit:.2f}x none",
                    f"{_x(r['time_ratio_vs_none'])} (FLOPs bound {_x(r['flops_bound'])})",
                    r["time_ratio_vs_none"] <= limit,
                )
            )
    peer_rows = parts.get("peers", [])
    ours = {r["policy"]: r for r in peer_rows if not r["compared_with"]}
    for r in peer_rows:
        mine = ours.get(r["compared_with"])
        if mine is None or r["compared_with"] == "none":
            continue
        same = bool(mine.get("hlo_fingerprint")) and mine.get("hlo_fingerprint") == r.get("hlo_fingerprint")
        ok = mine["peak_bytes"] <= r["peak_bytes"] and (
            same or mine["time_ratio_vs_none"] <= 1.05 * r["time_ratio_vs_none"]
        )
        out.append(
            (
                f"Peer {r['policy']}: jremat {r['compared_with']} peak <= it and time within 5%",
                f"peak {format_bytes(mine['peak_bytes'])} vs {format_bytes(r['peak_bytes'])}; time "
                f"{_x(mine['time_ratio_vs_none'])} vs {_x(r['time_ratio_vs_none'])}"
                + ("; the same compiled program (equal HLO fingerprints): the difference is noise" if same else ""),
                ok,
            )
        )
    for r in parts.get("auto", []):
        out.append(
            (
                f"auto fits budget {format_bytes(r['budget_bytes'])}",
                f"peak {format_bytes(r['peak_bytes'])}",
                r["peak_bytes"] <= r["budget_bytes"],
            )
        )
        out.append(
            (
                f"auto at {format_bytes(r['budget_bytes'])}: time <= 1.03x the fastest fitting built-in",
                f"{_x(r['time_ratio_vs_none'])} vs {r['best_fitting_policy']} {_x(r['best_fitting_time_ratio'])}",
                r["time_ratio_vs_none"] <= 1.03 * r["best_fitting_time_ratio"],
            )
        )
    winners = sorted(
        (r for r in parts.get("fit", []) if r["fit_role"].startswith("winner")), key=lambda r: r["budget_bytes"]
    )
    for r in winners:
        budget = format_bytes(r["budget_bytes"])
        out.append(
            (
                f"fit {budget}: the winner fits",
                f"peak {format_bytes(r['peak_bytes'])}",
                r["peak_bytes"] <= r["budget_bytes"],
            )
        )
        out.append(
            (
                f"fit {budget}: winner >= 0.97x the tokens/s of the best built-in at its largest fitting batch",
                f"{r['best_fitting_time_ratio']:.3f} ({r['policy']} b={r['batch_size']} vs {r['best_fitting_policy']})",
                r["best_fitting_time_ratio"] >= 0.97,
            )
        )
    if len(winners) > 1:
        out.append(
            (
                "fit: the winner's tokens/s never falls as the budget grows",
                " -> ".join(f"{r['tokens_per_s']:,.0f}" for r in winners),
                all(a["tokens_per_s"] <= b["tokens_per_s"] for a, b in zip(winners, winners[1:])),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


#: Why a target can be missed, by target prefix; the report lists those of the missed targets.
MISS_NOTES = {
    "Needle fig. 2: reduction grows": (
        "With the head rematerialized, what `every_k:k=4` leaves is mostly the block's saved activations, which "
        "include d_ff-wide outputs and grow with d_ff faster than `none`'s peak (dominated by the d_ff-independent "
        "logits), so the reduction does not grow. The study's growth came from a model whose d_ff part dominated "
        "`none`'s memory."
    ),
    "Needle fig. 3": (
        "The Needle block is one layer of d_model 20 next to a vocabulary-10000 head, so the recompute is a small "
        "part of the step: the FLOPs bound column differs by a few percent between the smallest and largest k, and "
        "the measured step time does not follow k."
    ),
    "Megatron": (
        "The block's saved activations differ from Megatron-LM's accounting for this policy; the Megatron table "
        "gives the bytes per layer."
    ),
    "Analytic peak": (
        "The estimate (`models.programs.analytic_peak_bytes`) adds a shallow copy's compiled working set to the "
        "traced bytes at full depth; a miss means, e.g., that the layers do not each keep what their traced residuals "
        "say, or that the compiler schedules the deep stack differently from the shallow copy."
    ),
    "Max batch": (
        "Under `full` the peak is mostly parameters, gradients and both Adam moments, which do not shrink with the "
        "batch; the ratio depends on how much of the budget they leave."
    ),
    "Time": (
        "Read the time ratio against its FLOPs bound in the same row: a ratio near the bound is the recompute's "
        "cost, not overhead."
    ),
    "Peer": (
        "Where a peer is smaller or faster, jremat is worse on this model and shape; the peers table gives peak, "
        "temp, step time and compile time side by side."
    ),
    "fit ": (
        "The fit search times only the finalists its time model ranks first; a miss means the model ranked the "
        "fastest built-in below them, or the machine's noise between sessions exceeded the margin."
    ),
    "fit:": (
        "Each budget's winner is the fastest of its finalists in the search's own session; the comparison session "
        "measures again, and noise between sessions can reorder winners that are within it."
    ),
    "auto": (
        "auto ranks the plans that fit by recompute FLOPs; where the measured time disagrees by more than 3%, the "
        "cost model missed what the machine pays."
    ),
}


def machine_description() -> str:
    """The machine and software that produced the figures, in one line."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({usable} usable), JAX "
        f"{jax.__version__} (backend {jax.default_backend()}, {jax.devices()[0].device_kind}), Python "
        f"{platform.python_version()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '').strip() or '(unset)'}"
    )


def _precision(r: dict) -> str:
    """``float32, attention explicit``: a row's compute dtype and attention."""
    return f"{r['dtype']}, attention {r.get('attention') or 'explicit'}"


def _section_tables(parts: dict[str, list[dict]], plots: Sequence[str], plot_dir: str) -> list[str]:
    lines: list[str] = []
    img = lambda name: [f"![{name}]({plot_dir}/{name})", ""] if name in plots else []
    for part, title in (
        ("needle_batch", "Needle figure 1: peak reduction vs batch size"),
        ("needle_dff", "Needle figure 2: peak reduction vs d_ff"),
    ):
        pts = parts.get(part, [])
        if not pts:
            continue
        keys = list(dict.fromkeys((r["batch_size"], r["d_ff"]) for r in pts))
        scopes = [s for s in ("blocks", "head", "whole step") if any(r["scope"] == s for r in pts)]
        get = {(r["batch_size"], r["d_ff"], r["scope"]): r for r in pts}
        lines += [f"### {title}", ""]
        lines += _table(
            ["batch", "d_ff", "peak none"] + [f"{s}: peak (reduction)" for s in scopes],
            [
                [b, d, format_bytes(get[(b, d, "none")]["peak_bytes"])]
                + [
                    f"{format_bytes(get[(b, d, s)]['peak_bytes'])} ({_pct(get[(b, d, s)]['peak_reduction_vs_none'])})"
                    for s in scopes
                ]
                for b, d in keys
            ],
        )
        lines += img(f"{part}.png")
    pts = sorted(parts.get("needle_time", []), key=lambda r: r["k"])
    if pts:
        lines += [
            f"### Needle figure 3: step time vs k (batch {pts[0]['batch_size']}, d_ff {pts[0]['d_ff']}, whole step)",
            "",
        ]
        lines += _table(
            ("k", "time / none (quartiles)", "FLOPs bound", "peak", *ABSOLUTE_HEADER),
            [(r["k"], _quartiles(r), _x(r["flops_bound"]), format_bytes(r["peak_bytes"]), *_absolute(r)) for r in pts],
        )
        lines += img("needle_k_time.png")
    pts = parts.get("megatron", [])
    if pts:
        r0 = pts[0]
        attention = r0.get("attention") or "explicit"
        dropout = "dropout 0.1" if r0.get("attn_dropout", 0.1) else "residual dropout 0.1, attention dropout 0"
        lines += [
            f"## Megatron-LM accounting and the analytic estimate: {r0['model']}, b={r0['batch_size']}, "
            f"s={r0['seq_len']}, {r0['dtype']}, attention {attention}, {dropout}, gradient step, blocks only",
            "",
        ]
        lines += _table(
            (
                "policy",
                "saved / layer",
                "/ sbh",
                "Megatron / sbh",
                "compiled peak",
                "work set",
                "analytic peak",
                "error",
            ),
            [
                (
                    r["policy"],
                    format_bytes(r["saved_bytes_per_layer"]),
                    f"{r['saved_per_sbh']:.2f}",
                    f"{r['megatron_per_sbh']:.1f}" if r["megatron_per_sbh"] != "" else "",
                    format_bytes(r["peak_bytes"]),
                    format_bytes(r["working_set_bytes"]),
                    format_bytes(r["analytic_peak_bytes"]),
                    f"{100 * r['analytic_error']:+.1f}%",
                )
                for r in pts
            ],
        )
    pts = parts.get("maxbatch", [])
    if pts:
        r0 = pts[0]
        none = next((r["max_batch"] for r in pts if r["policy"] == "none"), 0)
        lines += [
            f"## Max batch under {r0['budget_bytes'] / GIB:g} GiB: {r0['model']}, s={r0['seq_len']}, "
            "Adam step, whole step",
            "",
        ]
        lines += _table(
            ("policy", "max batch", "verified", "vs none", "peak at max batch"),
            [
                (
                    r["policy"],
                    r["max_batch"],
                    "yes" if r["max_batch_verified"] else "lower bound",
                    f"{r['max_batch'] / none:.2f}x" if none else "n/a",
                    format_bytes(r["peak_bytes"] or 0),
                )
                for r in pts
            ],
        )
    pts = parts.get("time", [])
    if pts:
        lines += [
            "## Step time against the FLOPs bound",
            "",
            "FLOPs bound = the policy's step FLOPs over `none`'s (traced, recomputation included): the time "
            "ratio if every FLOP took the same time. Compile s = trace + lower + compile of the step, paid on "
            "every start. Policies cover the whole step (blocks, and the head and loss in "
            "chunks).",
            "",
        ]
        for model in dict.fromkeys(r["model"] for r in pts):
            sel = [r for r in pts if r["model"] == model]
            r0 = sel[0]
            lines += [
                f"### {model}: {r0['n_layers']} layers, d_model {r0['d_model']}, d_ff {r0['d_ff']}, vocab "
                f"{r0['vocab_size']}, batch {r0['batch_size']} x {r0['seq_len']}, {_precision(r0)}",
                "",
            ]
            lines += _table(
                ("policy", "time / none (quartiles)", "FLOPs bound", "peak", "peak reduction", "compile s")
                + ABSOLUTE_HEADER,
                [
                    (
                        r["policy"],
                        _quartiles(r),
                        _x(r["flops_bound"]),
                        format_bytes(r["peak_bytes"]),
                        _pct(r["peak_reduction_vs_none"]),
                        f"{r['compile_s']:.1f}",
                        *_absolute(r),
                    )
                    for r in sel
                ],
            )
        lines += img("time.png")
    pts = parts.get("peers", [])
    if pts:
        r0 = pts[0]
        lines += [
            f"## Peers: block-dominated model, batch {r0['batch_size']} x {r0['seq_len']}, {_precision(r0)}, "
            "Adam step, blocks only, dropout 0",
            "",
        ]
        lines += _table(
            (
                "program",
                "jremat counterpart",
                "peak",
                "temp",
                "time / jremat none (quartiles)",
                "FLOPs bound",
                "compile s",
                *ABSOLUTE_HEADER,
                "compiled HLO",
            ),
            [
                (
                    r["policy"],
                    r["compared_with"] or "(jremat)",
                    format_bytes(r["peak_bytes"]),
                    format_bytes(r["temp_bytes"]),
                    _quartiles(r),
                    _x(r["flops_bound"]),
                    f"{r['compile_s']:.1f}",
                    *_absolute(r),
                    f"`{r['hlo_fingerprint']}`" if r.get("hlo_fingerprint") else "",
                )
                for r in pts
            ],
        )
        lines += [
            "",
            "`compiled HLO`: a hash of the optimized HLO without metadata; rows with the same hash execute the same "
            "program, so their time ratios differ by the machine's noise alone.",
            "",
        ]
        lines += img("peers.png")
    lines += _fit_section(parts.get("fit", []))
    pts = parts.get("auto", [])
    if pts:
        r0 = pts[0]
        lines += [
            f"## auto at {len(pts)} budgets: {r0['model']}, batch {r0['batch_size']} x {r0['seq_len']}, Adam step",
            "",
        ]
        lines += _table(
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
                    _x(r["time_ratio_vs_none"]),
                    r["best_fitting_policy"],
                    _x(r["best_fitting_time_ratio"]),
                    f"{r['compile_s']:.1f}",
                    *_absolute(r),
                )
                for r in pts
            ],
        )
    return lines


def _fit_section(pts: Sequence[dict]) -> list[str]:
    if not pts:
        return []
    r0 = pts[0]
    lines = [
        f"## Fit search: the policy and batch that train fastest in a budget ({r0['model']}, seq {r0['seq_len']}, "
        "Adam step)",
        "",
        f"`train.fit` searched {len({r['budget_bytes'] for r in pts})} budgets between `full`'s and `none`'s peak in "
        f"{r0['search_s']:.0f} s of wall time (compile-only batch searches, the planner's plans, the finalists timed). "
        "Then each winner and every built-in at its largest fitting batch were timed together in one session "
        f"({r0['time_steps']} steps each, interleaved rounds); those are the tokens/s below.",
        "",
    ]
    lines += _table(
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
            for r in pts
        ],
    )
    return lines


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
      plot_dir: where the plots and CSV are, relative to the report.
      command: the exact command line.
      wall_s: the run's wall time.
      notes: extra lines (skipped policies ...).
      explanations: markdown placed after the verdict (why the numbers are what they are).
    """
    targets = check_targets(rows)
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
        f"- Data: [{plot_dir}/bench.csv]({plot_dir}/bench.csv) (one row per measurement)",
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
    lines += _table(("target", "measured", "met"), [(t, m, "yes" if ok else "**no**") for t, m, ok in targets])
    missed = [
        note for prefix, note in MISS_NOTES.items() if any(t.startswith(prefix) and not ok for t, _, ok in targets)
    ]
    if missed:
        lines += ["### Why the misses", ""] + [f"* {note}" for note in missed] + [""]
    if explanations:
        lines += [explanations.strip(), ""]
    lines += _section_tables(rows_by_part(rows), plots, plot_dir)
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)
