"""The ``megatron`` part (:data:`MEGATRON`): per-layer saved activations next to Megatron-LM's formulas,
and the analytic peak estimate against the compiled peak."""

from __future__ import annotations

import time
from collections.abc import Sequence

from jremat import format_bytes
from jremat.models.config import FUSED_ATTENTIONS
from jremat.train.bench.config import MEGATRON_POLICIES, BenchConfig
from jremat.train.bench.harness import GIB, log
from jremat.train.bench.markdown import table
from jremat.train.bench.part import Part, Target
from jremat.train.bench.rows import ROW_COLUMNS
from jremat.train.policy_memory import policy_memory


def megatron_formulas(s: int, b: int, h: int, a: int, attention: str = "explicit") -> dict[str, float]:
    """Megatron-LM's activation bytes per layer (16-bit activations), in units of ``s*b*h``.

    ``none``: ``34 + 5*a*s/h``; ``selective``: 34; ``full``: 2 (Korthikanti et al. 2022, table 2).
    The ``5*a*s/h`` term is attention's ``[s, s]`` tensors (scores, softmax, dropout mask), which
    the fused kernels (``attention`` ``cudnn``, ``blockwise``, ``pallas``) never keep, as Megatron's selective
    recompute: ``none`` is then 34. Under ``xla`` (``jax.nn.dot_product_attention`` differentiated
    by XLA, no dropout) Megatron gives no figure for ``none``, and it is left out.
    """
    out = {"none": 34 + 5 * a * s / h, "selective": 34.0, "full": 2.0}
    if attention in FUSED_ATTENTIONS:
        out["none"] = 34.0
    elif attention != "explicit":
        del out["none"]
    return out


def run_megatron(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Per-layer saved activations vs Megatron-LM's formulas, and the analytic peak vs the compiled one.

    The step is the gradient step of :func:`train.policy_memory.policy_memory` (what ``train.memory``
    reports and its analytic estimate models), blocks only.
    """
    b, s = config.megatron_batch, config.megatron_seq
    none_cfg = config.megatron_config("none")
    sbh = s * b * none_cfg.d_model
    formulas = megatron_formulas(s, b, none_cfg.d_model, none_cfg.n_heads, none_cfg.attention)
    rows, base = [], None
    for spec in MEGATRON_POLICIES:
        cfg = config.megatron_config(spec)
        t0 = time.perf_counter()
        r = policy_memory(cfg, b, s, baseline_step_flops=base.step_flops if base else None)
        base = base or r
        err = r.analytic_peak_bytes / r.peak_bytes - 1
        log(
            f"[megatron] {spec}: saved/layer {r.saved_bytes_per_layer / sbh:.2f} sbh, peak {r.peak_bytes / GIB:.2f} "
            f"GiB, analytic {100 * err:+.1f}% ({time.perf_counter() - t0:.1f} s)"
        )
        rows.append(
            MEGATRON.row(
                spec,
                cfg,
                b,
                s,
                model=config.megatron_preset,
                scope="blocks",
                saved_bytes_per_layer=r.saved_bytes_per_layer,
                saved_per_sbh=r.saved_bytes_per_layer / sbh,
                megatron_per_sbh=formulas.get(spec, ""),
                peak_bytes=r.peak_bytes,
                temp_bytes=r.temp_bytes,
                peak_source=r.peak_source,
                peak_reduction_vs_none=1 - r.peak_bytes / base.peak_bytes,
                flops=r.step_flops,
                flops_bound=r.step_flops / base.step_flops,
                working_set_bytes=r.working_set_bytes,
                analytic_peak_bytes=r.analytic_peak_bytes,
                analytic_error=err,
            )
        )
    return rows


FORMULA_NOTE = (
    "The block's saved activations differ from Megatron-LM's accounting for this policy; the Megatron table "
    "gives the bytes per layer."
)
ANALYTIC_NOTE = (
    "The estimate (`train.programs.analytic_peak_bytes`) adds a shallow copy's compiled working set to the "
    "traced bytes at full depth; a miss means, e.g., that the layers do not each keep what their traced residuals "
    "say, or that the compiler schedules the deep stack differently from the shallow copy."
)


def megatron_targets(rows: list[dict]) -> list[Target]:
    """Saved bytes per layer against Megatron-LM's formulas, then every policy's analytic peak within 10%."""
    out = []
    meg = {r["policy"]: r for r in rows}
    if "none" in meg and meg["none"]["megatron_per_sbh"] != "":
        v, f = meg["none"]["saved_per_sbh"], meg["none"]["megatron_per_sbh"]
        fused = meg["none"].get("attention", "explicit") in FUSED_ATTENTIONS
        formula = "34 (fused attention: no s*s term)" if fused else "(34 + 5*a*s/h)"
        out.append(
            Target(
                f"Megatron: none saves s*b*h*{formula} per layer (within 1%)",
                f"{v:.2f} vs {f:.2f} sbh",
                abs(v / f - 1) <= 0.01,
                FORMULA_NOTE,
            )
        )
    for spec, limit in (("selective", 32.0), ("full", 2.1)):
        if spec in meg:
            v = meg[spec]["saved_per_sbh"]
            out.append(
                Target(f"Megatron: {spec} saves <= {limit:g} sbh per layer", f"{v:.2f} sbh", v <= limit, FORMULA_NOTE)
            )
    for spec, r in meg.items():
        out.append(
            Target(
                f"Analytic peak within 10% of the compiled peak: {spec} ({r['model']} b{r['batch_size']} "
                f"s{r['seq_len']} {r['dtype']})",
                f"{100 * r['analytic_error']:+.1f}%",
                abs(r["analytic_error"]) <= 0.10,
                ANALYTIC_NOTE,
            )
        )
    return out


def megatron_tables(rows: list[dict], plots: Sequence[str], plot_dir: str) -> list[str]:
    """Saved bytes per layer (and per s*b*h, next to Megatron's), compiled and analytic peak per policy."""
    r0 = rows[0]
    attention = r0.get("attention") or "explicit"
    dropout = "dropout 0.1" if r0.get("attn_dropout", 0.1) else "residual dropout 0.1, attention dropout 0"
    lines = [
        f"## Megatron-LM accounting and the analytic estimate: {r0['model']}, b={r0['batch_size']}, "
        f"s={r0['seq_len']}, {r0['dtype']}, attention {attention}, {dropout}, gradient step, blocks only",
        "",
    ]
    return lines + table(
        ("policy", "saved / layer", "/ sbh", "Megatron / sbh", "compiled peak", "work set", "analytic peak", "error"),
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
            for r in rows
        ],
    )


MEGATRON = Part(
    "megatron",
    run_megatron,
    (
        *ROW_COLUMNS,
        "saved_bytes_per_layer",
        "saved_per_sbh",
        "megatron_per_sbh",
        "peak_bytes",
        "temp_bytes",
        "peak_source",
        "peak_reduction_vs_none",
        "flops",
        "flops_bound",
        "working_set_bytes",
        "analytic_peak_bytes",
        "analytic_error",
    ),
    megatron_targets,
    megatron_tables,
)
