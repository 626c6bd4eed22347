"""Measured rows of every bench part, fixed by hand: the input of the report's golden files (tests/train/bench_golden)."""

from jremat.train.bench import parts
from jremat.train.bench.config import BenchConfig


def measured(part: str, policy: str, batch: int, seq: int, **values) -> dict:
    """One row as a part gives it: the shape of the quick block-dominated model at ``batch`` x ``seq``."""
    return parts.owner(part).row(policy, BenchConfig(quick=True).block_model(), batch, seq, part=part, **values)


def timed(t: float, bound: float, step_s: float | str = "", peak: float | str = "", **values) -> dict:
    """The timed columns of a row (quartiles 1% either side; absolute figures when ``step_s`` is given)."""
    absolute = {}
    if step_s != "":
        absolute = dict(
            step_s=step_s,
            tokens_per_s=1024 / step_s,
            model_flops=1.5e9,
            model_tflops_per_s=1.5e-3 / step_s,
            peak_bf16_tflops=peak,
            mfu="" if peak == "" else 1.5e-3 / step_s / peak,
        )
    return dict(
        time_ratio_vs_none=t,
        time_ratio_low=t - 0.01,
        time_ratio_high=t + 0.01,
        time_steps=20,
        flops_bound=bound,
        flops=1e9 * bound,
        xla_flops=9e8,
        **{"compile_s": 1.25, **absolute, **values},
    )


def measured_rows(miss: bool) -> list[dict]:
    """Rows of every part; with ``miss`` every kind of target misses (so every miss note shows)."""
    rows = []
    for part, key, values in (("needle_batch", "batch_size", (256, 2048)), ("needle_dff", "d_ff", (256, 2048))):
        for v in values:
            whole = (0.5 - v / 1e5) if miss else (0.7 + v / 1e5)
            for scope, red in (("none", 0.0), ("blocks", 0.05), ("head", 0.6), ("whole step", whole)):
                rows.append(
                    measured(
                        part,
                        "none" if scope in ("none", "head") else "every_k:k=4",
                        2048 if key == "d_ff" else v,
                        20,
                        model="needle",
                        scope=scope,
                        k=0 if scope in ("none", "head") else 4,
                        peak_reduction_vs_none=red,
                        peak_bytes=int(100e6 * (1 - red)),
                        temp_bytes=int(90e6 * (1 - red)),
                        compile_s=2.5,
                        **({"d_ff": v} if key == "d_ff" else {}),
                    )
                )
    for k, t in ((0, 1.0), (1, 1.1 if not miss else 1.2), (4, 1.2 if not miss else 1.1)):
        spec = "none" if k == 0 else f"every_k:k={k}"
        rows.append(
            measured("needle_time", spec, 64, 20, model="needle", k=k, peak_bytes=10**7, **timed(t, 1 + k / 50, 2e-3))
        )
    for spec, sbh, ref, err in (
        ("none", 120.0 if miss else 114.0, 114.0, -0.008),
        ("selective", 32.0, 34.0, 0.2 if miss else 0.02),
        ("every_k:k=4", 60.0, "", 0.01),
        ("full", 2.0, 2.0, 0.039),
    ):
        rows.append(
            measured(
                "megatron",
                spec,
                8,
                1024,
                model="gpt2-small",
                scope="blocks",
                saved_bytes_per_layer=int(sbh * 8 * 1024 * 768),
                saved_per_sbh=sbh,
                megatron_per_sbh=ref,
                peak_bytes=3 * 10**9,
                working_set_bytes=5 * 10**8,
                analytic_peak_bytes=int(3 * 10**9 * (1 + err)),
                analytic_error=err,
            )
        )
    for spec, batch in (("none", 8), ("full", 20 if miss else 48)):
        rows.append(
            measured(
                "maxbatch",
                spec,
                batch,
                1024,
                model="gpt2-small",
                budget_bytes=16 * 2**30,
                max_batch=batch,
                max_batch_verified=spec == "none",
                peak_bytes=15 * 2**30,
            )
        )
    for model in ("head-dominated (small)", "block-dominated"):
        for spec, t, bound in (
            ("none", 1.0, 1.0),
            ("selective", 1.01, 1.02),
            ("every_k:k=4", 1.05, 1.1),
            ("full", 1.5 if miss else 1.08, 1.24),
            ("dots", 1.03, 1.05),
        ):
            rows.append(
                measured(
                    "time",
                    spec,
                    8,
                    128,
                    model=model,
                    scope="whole step" if spec != "none" else "blocks",
                    peak_bytes=10**7,
                    peak_reduction_vs_none=0.1,
                    **timed(t, bound, 0.5e-3 * t, 989.4 if not miss else ""),
                )
            )
    for label, ours, t, peak, hlo in (
        ("none", "", 1.0, 100 * 2**20, "aa11"),
        ("full", "", 1.1, 50 * 2**20, "bb22"),
        ("jax.checkpoint", "full", 1.2, 50 * 2**20, "cc33"),
        ("nnx.remat", "full", 1.09, 50 * 2**20, "bb22"),
        ("linen nn.remat_scan", "full", 1.0 if miss else 1.3, 60 * 2**20, "dd44"),
        ("linen (no remat)", "none", 1.0, 100 * 2**20, ""),
    ):
        rows.append(
            measured(
                "peers",
                label,
                8,
                128,
                model="block-dominated",
                scope="blocks",
                compared_with=ours,
                peak_bytes=peak,
                temp_bytes=peak // 2,
                hlo_fingerprint=hlo,
                **timed(t, 1.2 if ours or label == "full" else 1.0, 1e-3 * t),
            )
        )
    for budget, plan_t, best in ((900 * 2**20, 1.2 if miss else 1.01, 1.0), (1200 * 2**20, 1.0, 1.05)):
        rows.append(
            measured(
                "auto",
                f"auto:budget={budget} (plan)",
                20,
                64,
                model="small",
                scope="whole step",
                budget_bytes=budget,
                peak_bytes=budget - 2**20,
                best_fitting_policy="full",
                best_fitting_time_ratio=best,
                **timed(plan_t, 1.1, 2e-3, compile_s=3.5),
            )
        )
    for budget, winner_tps, builtin_tps in ((2**30, 2.0e5, 1.9e5), (2 * 2**30, 1.5e5 if miss else 2.5e5, 2.4e5)):
        for role, policy, batch, tps in (
            ("winner (search)", "selective", 24, winner_tps),
            ("built-in", "full", 32, builtin_tps),
        ):
            rows.append(
                measured(
                    "fit",
                    f"{policy} b={batch}",
                    batch,
                    64,
                    model="small",
                    micro_batches=1,
                    fit_role=role,
                    fit_digest="0123abcd",
                    search_s=95.0,
                    budget_bytes=budget,
                    peak_bytes=budget - 2**20,
                    predicted_tokens_per_s=tps * 1.02,
                    tokens_per_s=tps,
                    time_steps=15,
                    best_fitting_policy=f"full b={32}",
                    best_fitting_time_ratio=(0.9 if miss and budget == 2**30 else winner_tps / builtin_tps),
                )
            )
    return rows
