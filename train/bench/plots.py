"""The benchmark's PNG plots, one per part present in the rows (written under ``docs/results/``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from jremat.train.bench.harness import MIB
from jremat.train.bench.rows import rows_by_part


def write_plots(rows: Sequence[dict], out: str) -> list[str]:
    """Write the PNG plots of the parts present in ``rows``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts, written = rows_by_part(rows), []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), format="png", dpi=100)
        plt.close(fig)
        written.append(name)

    for part, xkey, target in (("needle_batch", "batch_size", 0.55), ("needle_dff", "d_ff", 0.60)):
        pts = parts.get(part, [])
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for scope in ("blocks", "head", "whole step"):
            sel = [r for r in pts if r["scope"] == scope]
            if sel:
                ax.plot([r[xkey] for r in sel], [100 * r["peak_reduction_vs_none"] for r in sel], "o-", label=scope)
        ax.axhline(100 * target, ls="--", lw=1, color="gray", label=f"target {100 * target:.0f}%")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xkey.replace("_size", ""))
        ax.set_ylabel("Adam-step peak reduction vs none (%)")
        ax.set_ylim(0, 100)
        ax.set_title("Needle preset: every_k:k=4 on blocks, none + chunked head, both", fontsize=9)
        ax.legend(fontsize=8)
        save(fig, f"{part}.png")

    pts = sorted(parts.get("needle_time", []), key=lambda r: r["k"])
    if pts:
        fig, ax = plt.subplots(figsize=(6, 4))
        ks = [r["k"] for r in pts]
        ax.errorbar(
            ks,
            [r["time_ratio_vs_none"] for r in pts],
            yerr=[
                [r["time_ratio_vs_none"] - r["time_ratio_low"] for r in pts],
                [r["time_ratio_high"] - r["time_ratio_vs_none"] for r in pts],
            ],
            fmt="o-",
            capsize=3,
            label="step time / none (quartiles)",
        )
        ax.plot(ks, [r["flops_bound"] for r in pts], "s--", label="FLOPs bound")
        ax.set_xlabel("k (0 = none)")
        ax.legend(fontsize=8)
        ax.set_title("Needle preset, whole step: step time vs k", fontsize=9)
        save(fig, "needle_k_time.png")

    pts = parts.get("time", [])
    if pts:
        models = list(dict.fromkeys(r["model"] for r in pts))
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        for ax, model in zip(axes[0], models):
            sel = [r for r in pts if r["model"] == model]
            xs = range(len(sel))
            ax.bar(xs, [r["time_ratio_vs_none"] for r in sel], color="tab:blue", label="step time / none")
            ax.scatter(
                xs, [r["flops_bound"] for r in sel], color="red", marker="_", s=300, zorder=3, label="FLOPs bound"
            )
            ax.set_xticks(list(xs))
            ax.set_xticklabels([r["policy"] for r in sel], rotation=40, ha="right", fontsize=7)
            ax.set_title(model, fontsize=9)
            ax.legend(fontsize=8)
        save(fig, "time.png")

    pts = parts.get("peers", [])
    if pts:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in pts:
            ax.scatter(r["time_ratio_vs_none"], r["peak_bytes"] / MIB, marker="o" if r["compared_with"] else "s")
            ax.annotate(
                r["policy"],
                (r["time_ratio_vs_none"], r["peak_bytes"] / MIB),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax.set_xlabel("step time / jremat none")
        ax.set_ylabel("compiled Adam-step peak (MiB)")
        ax.set_title("block-dominated model: jremat (squares) and peers (circles)", fontsize=9)
        save(fig, "peers.png")
    return written
