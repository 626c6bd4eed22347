"""The Needle study's parts: :data:`NEEDLE` (figures 1 and 2, memory) and :data:`NEEDLE_TIME` (figure 3, step time)."""

from __future__ import annotations

from collections.abc import Sequence

from jremat import format_bytes
from jremat.models import PRESETS, ModelConfig
from jremat.train.bench import harness
from jremat.train.bench.config import BenchConfig
from jremat.train.bench.harness import MIB, bench_peak, log, memory_fields
from jremat.train.bench.markdown import ABSOLUTE_HEADER, absolute, image, percent, quartiles, ratio, table
from jremat.train.bench.part import Part, Target
from jremat.train.bench.rows import MEMORY_COLUMNS, ROW_COLUMNS, TIMED_COLUMNS
from jremat.train.bench.timed import timed_rows


def needle_config(config: BenchConfig, d_ff: int, policy: str, head_chunks: int = 0) -> ModelConfig:
    """Preset ``needle`` with ``d_ff`` and ``policy`` at block granularity, its one layer unrolled,
    under ``--dtype`` and ``--attention`` (:meth:`BenchConfig.model`).

    Unrolled, not under ``lax.scan``: XLA turns a scan of length 1 into straight-line code and
    merges the recomputation with the forward pass; unrolled layers get the cotangent tie
    (:mod:`jremat._engine.tie`), which keeps the recomputation in the backward pass.
    """
    return config.model(PRESETS["needle"]).replace(
        d_ff=d_ff,
        remat_policy=policy,
        remat_granularity="block",
        scan_layers=False,
        remat_head_chunks=head_chunks,
    )


def needle_scopes(head_chunks: int) -> list[tuple[str, str, int]]:
    """``(scope, policy, head chunks)`` of the Needle memory figures: none, blocks only, head only, whole step."""
    scopes = [("none", "none", 0), ("blocks", "every_k:k=4", 0)]
    if head_chunks:
        scopes += [("head", "none", head_chunks), ("whole step", "every_k:k=4", head_chunks)]
    return scopes


def run_needle(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Needle figures 1 and 2: Adam-step peak of ``every_k:k=4`` vs ``none`` on blocks, head, whole step."""
    rows = []
    points = [("needle_batch", b, config.needle_d_ff) for b in config.needle_batches]
    points += [("needle_dff", config.needle_batch, d) for d in config.needle_d_ffs]
    for part, batch, d_ff in points:
        found = {}
        for scope, spec, chunks in needle_scopes(config.remat_head_chunks):
            cfg = needle_config(config, d_ff, spec, chunks)
            found[scope] = (cfg, harness.step_memory(cfg, batch))
        base = bench_peak(found["none"][1].memory)
        log(
            f"[{part}] batch {batch} d_ff {d_ff}: "
            + ", ".join(f"{s} {bench_peak(m.memory) / MIB:.0f} MiB" for s, (_, m) in found.items())
        )
        for scope, (cfg, m) in found.items():
            rows.append(
                NEEDLE.row(
                    cfg.remat_policy,
                    cfg,
                    batch,
                    cfg.max_seq_len,
                    part=part,
                    model="needle",
                    scope=scope,
                    k=4 if cfg.remat_policy != "none" else 0,
                    flops=m.flops,
                    xla_flops=m.xla_flops,
                    compile_s=m.compile_s,
                    peak_reduction_vs_none=1 - bench_peak(m.memory) / base,
                    **memory_fields(m.memory),
                )
            )
    return rows


GROWS_NOTE = (
    "With the head rematerialized, what `every_k:k=4` leaves is mostly the block's saved activations, which "
    "include d_ff-wide outputs and grow with d_ff faster than `none`'s peak (dominated by the d_ff-independent "
    "logits), so the reduction does not grow. The study's growth came from a model whose d_ff part dominated "
    "`none`'s memory."
)


def needle_targets(rows: list[dict]) -> list[Target]:
    """Figure 1: the whole step's reduction at every batch and at the largest; figure 2: at every d_ff, and growing."""
    out = []
    whole = [r for r in rows if r["part"] == "needle_batch" and r["scope"] == "whole step"]
    if whole:
        worst = min(r["peak_reduction_vs_none"] for r in whole)
        out.append(
            Target(
                "Needle fig. 1 (whole step): peak reduction > 55% at every batch", f"min {percent(worst)}", worst > 0.55
            )
        )
        last = max(whole, key=lambda r: r["batch_size"])
        out.append(
            Target(
                f"Needle fig. 1: > 62% at batch {last['batch_size']}",
                percent(last["peak_reduction_vs_none"]),
                last["peak_reduction_vs_none"] > 0.62,
            )
        )
    dff = sorted((r for r in rows if r["part"] == "needle_dff" and r["scope"] == "whole step"), key=lambda r: r["d_ff"])
    if dff:
        worst = min(r["peak_reduction_vs_none"] for r in dff)
        out.append(Target("Needle fig. 2 (whole step): > 60% at every d_ff", f"min {percent(worst)}", worst > 0.60))
        grows = all(a["peak_reduction_vs_none"] <= b["peak_reduction_vs_none"] for a, b in zip(dff, dff[1:]))
        out.append(
            Target(
                "Needle fig. 2: reduction grows with d_ff",
                " -> ".join(percent(r["peak_reduction_vs_none"]) for r in dff),
                grows,
                GROWS_NOTE,
            )
        )
    return out


def needle_tables(rows: list[dict], plots: Sequence[str], plot_dir: str) -> list[str]:
    """Figures 1 and 2: per point, ``none``'s peak and each scope's peak and reduction."""
    lines: list[str] = []
    for part, title in (
        ("needle_batch", "Needle figure 1: peak reduction vs batch size"),
        ("needle_dff", "Needle figure 2: peak reduction vs d_ff"),
    ):
        pts = [r for r in rows if r["part"] == part]
        if not pts:
            continue
        keys = list(dict.fromkeys((r["batch_size"], r["d_ff"]) for r in pts))
        scopes = [s for s in ("blocks", "head", "whole step") if any(r["scope"] == s for r in pts)]
        get = {(r["batch_size"], r["d_ff"], r["scope"]): r for r in pts}
        lines += [f"### {title}", ""]
        lines += table(
            ["batch", "d_ff", "peak none"] + [f"{s}: peak (reduction)" for s in scopes],
            [
                [b, d, format_bytes(get[(b, d, "none")]["peak_bytes"])]
                + [
                    f"{format_bytes(get[(b, d, s)]['peak_bytes'])} ({percent(get[(b, d, s)]['peak_reduction_vs_none'])})"
                    for s in scopes
                ]
                for b, d in keys
            ],
        )
        lines += image(f"{part}.png", plots, plot_dir)
    return lines


NEEDLE = Part(
    "needle",
    run_needle,
    (
        *ROW_COLUMNS,
        "k",
        *MEMORY_COLUMNS,
        "peak_reduction_vs_none",
        "flops",
        "xla_flops",
        "compile_s",
    ),
    needle_targets,
    needle_tables,
    row_parts=("needle_batch", "needle_dff"),
)


def run_needle_time(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Needle figure 3: step time of ``every_k:k=K`` vs ``none`` (K = 0), whole step."""
    configs, extra = {}, {}
    for k in sorted({0, *config.needle_ks}):
        spec = "none" if k == 0 else f"every_k:k={k}"
        configs[spec] = config.whole_step(needle_config(config, config.needle_d_ff, spec), spec)
        extra[spec] = {"k": k}
    log(f"[needle_time] timing {len(configs)} steps at batch {config.needle_time_batch}")
    return timed_rows(NEEDLE_TIME, "needle", configs, config.needle_time_batch, config, **extra)


K_TIME_NOTE = (
    "The Needle block is one layer of d_model 20 next to a vocabulary-10000 head, so the recompute is a small "
    "part of the step: the FLOPs bound column differs by a few percent between the smallest and largest k, and "
    "the measured step time does not follow k."
)


def needle_time_targets(rows: list[dict]) -> list[Target]:
    """Figure 3: the largest k's step slower than the smallest's (needs two k > 0)."""
    nt = sorted((r for r in rows if r["k"]), key=lambda r: r["k"])
    if len(nt) < 2:
        return []
    return [
        Target(
            "Needle fig. 3: step time grows with k (largest k slower than smallest)",
            " -> ".join(f"{r['time_ratio_vs_none']:.2f}" for r in nt),
            nt[-1]["time_ratio_vs_none"] > nt[0]["time_ratio_vs_none"],
            K_TIME_NOTE,
        )
    ]


def needle_time_tables(rows: list[dict], plots: Sequence[str], plot_dir: str) -> list[str]:
    """Figure 3: time ratio, FLOPs bound, peak and absolute figures per k."""
    pts = sorted(rows, key=lambda r: r["k"])
    if not pts:
        return []
    lines = [
        f"### Needle figure 3: step time vs k (batch {pts[0]['batch_size']}, d_ff {pts[0]['d_ff']}, whole step)",
        "",
    ]
    lines += table(
        ("k", "time / none (quartiles)", "FLOPs bound", "peak", *ABSOLUTE_HEADER),
        [(r["k"], quartiles(r), ratio(r["flops_bound"]), format_bytes(r["peak_bytes"]), *absolute(r)) for r in pts],
    )
    return lines + image("needle_k_time.png", plots, plot_dir)


NEEDLE_TIME = Part(
    "needle_time", run_needle_time, (*ROW_COLUMNS, "k", *TIMED_COLUMNS), needle_time_targets, needle_time_tables
)
