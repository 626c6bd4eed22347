"""``python -m train.memory``'s output on one device: the table of policies, the explain section, the bar chart.

Rows are :class:`train.policy_memory.PolicyMemory`; the columns and the notes under the table
are defined there (``none``, recompute) and in ``docs/memory.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

from jremat import format_bytes
from jremat.train.policy_memory import (
    NONE_DEFINITION,
    RECOMPUTE_DEFINITION,
    PolicyMemory,
    format_recompute,
    head_label,
    ratio,
)
from jremat.train.usage import UsageError


def format_table(rows: Sequence[PolicyMemory], base: PolicyMemory) -> str:
    """The human-readable table: one line per policy, then notes."""
    live = any(r.live_peak_bytes is not None for r in rows)
    fused = any(r.attention_forward_passes for r in rows)
    header = (
        f"{'policy':<24} {'head':>9} {'peak':>11} {'temp':>11} {'saved/layer':>12} {'peak/none':>9} "
        f"{'saved/none':>10} {'recompute':>9} {'work set':>11} {'analytic':>11} {'anal.err':>8}"
        + (f" {'attn fwd':>8}" if fused else "")
        + (f" {'live peak':>11}" if live else "")
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        pr = ratio(r.peak_bytes, base.peak_bytes)
        sr = ratio(r.saved_bytes_per_layer, base.saved_bytes_per_layer)
        err = (
            ratio(r.analytic_peak_bytes - r.peak_bytes, r.peak_bytes)
            if r.peak_bytes and r.analytic_peak_bytes
            else None
        )
        lines.append(
            f"{r.policy:<24} {head_label(r.head_chunks):>9} {format_bytes(r.peak_bytes):>11} "
            f"{format_bytes(r.temp_bytes):>11} {format_bytes(r.saved_bytes_per_layer):>12} "
            f"{f'{pr:.3f}' if pr is not None else 'n/a':>9} {f'{sr:.3f}' if sr is not None else 'n/a':>10} "
            f"{format_recompute(r.recompute_flops_fraction):>9} "
            f"{format_bytes(r.working_set_bytes):>11} {format_bytes(r.analytic_peak_bytes):>11} "
            f"{f'{100 * err:+.1f}%' if err is not None else 'n/a':>8}"
            + (f" {r.attention_forward_passes:>8g}" if fused else "")
            + (f" {format_bytes(r.live_peak_bytes):>11}" if live else "")
        )
    first = rows[0]
    lines.append(
        f"gradient step of {first.n_layers} layers, batch {first.batch_size} x seq {first.seq_len}; "
        f"peak from: {first.peak_source}; {NONE_DEFINITION}; {RECOMPUTE_DEFINITION} ({base.step_flops:.3g}); "
        "head = the final LayerNorm, head and loss: whole, or recomputed over N sequence chunks"
        + "; work set = the backward pass's transient buffers at its peak, compiled on a copy with at most "
        "two layers per layer group (nested or unrolled stacks: the whole model); "
        "analytic = traced residuals, parameters and gradients at full depth + work set"
        + ("; attn fwd = fused attention forward passes per layer (1: not recomputed)" if fused else "")
    )
    seen = set()
    for r in rows:
        for n in r.notes:
            key = (r.policy, n) if "saved residuals fell" in n else n
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"note [{r.policy}]: {n}" if "saved residuals fell" in n else f"note: {n}")
    return "\n".join(lines)


def format_explanations(rows: Sequence[PolicyMemory]) -> str:
    """The explain section: per policy, its decisions, the names it matched and any problem, one line each."""
    parts = [r.explanation.text() for r in rows if r.explanation is not None]
    return "\n".join(["", "explain (what each policy did to the step; jremat.explain):", *parts]) if parts else ""


def write_plot(rows: Sequence[PolicyMemory], path: str) -> None:
    """Write a bar chart of peak bytes and saved bytes (whole step) per policy to ``path`` (PNG).

    Raises:
      UsageError: if the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.policy for r in rows]
    mib = 2**20
    xs = range(len(rows))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(rows)), 4.0))
    ax.bar([x - width / 2 for x in xs], [(r.peak_bytes or 0) / mib for r in rows], width, label="compiled peak")
    ax.bar([x + width / 2 for x in xs], [r.saved_bytes / mib for r in rows], width, label="saved activations")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel("MiB")
    first = rows[0]
    ax.set_title(f"gradient step memory, {first.n_layers} layers, batch {first.batch_size} x {first.seq_len}")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as err:
        raise UsageError(f"cannot write plot {path!r}: {err}") from None
    finally:
        plt.close(fig)
