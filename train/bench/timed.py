"""Rows of programs timed against a baseline in one session (the ``needle_time``, ``time``, ``peers`` and ``auto`` parts)."""

from __future__ import annotations

import jax

from jremat.models import ModelConfig
from jremat.train.bench import flops
from jremat.train.bench.config import BenchConfig
from jremat.train.bench.harness import Measured, bench_peak, gpt_program, measure, measured_ratios, memory_fields
from jremat.train.bench.part import Part


def device_peak_tflops() -> float | None:
    """The dense bf16 peak of the device the bench runs on (:func:`flops.peak_bf16_tflops`; ``None``: unknown)."""
    return flops.peak_bf16_tflops(jax.devices()[0].device_kind)


def timed_fields(
    m: Measured,
    base: Measured,
    timing: tuple[float, float, float],
    time_steps: int,
    cfg: ModelConfig,
    batch: int,
    seq: int,
) -> dict:
    """The :data:`~train.bench.rows.TIMED_COLUMNS` of one timed program: FLOPs and their bound, compile
    time, time ratio, memory, and the absolute figures of its median step (:func:`flops.throughput_fields`)."""
    ratio, low, high = timing
    absolute = flops.throughput_fields(cfg, batch, seq, m.step_s, device_peak_tflops()) if m.step_s else {}
    return dict(
        flops=m.flops,
        xla_flops=m.xla_flops,
        flops_bound=m.flops / base.flops if base.flops else "",
        compile_s=m.compile_s,
        time_ratio_vs_none=ratio,
        time_ratio_low=low,
        time_ratio_high=high,
        time_steps=time_steps,
        peak_reduction_vs_none=1 - bench_peak(m.memory) / bench_peak(base.memory),
        **memory_fields(m.memory),
        **absolute,
    )


def timed_rows(
    part: Part, model: str, configs: dict[str, ModelConfig], batch: int, config: BenchConfig, **extra
) -> list[dict]:
    """Time ``configs`` (label -> model; the first is the baseline) and give one row of ``part`` per label
    (``extra``: label -> more values of its row)."""
    programs = [gpt_program(label, cfg, batch) for label, cfg in configs.items()]
    measured = measure(programs, steps=config.time_steps, rounds=config.time_rounds, seed=config.seed)
    base = next(iter(configs))
    ratios = measured_ratios(measured, base)
    base_m = measured[base]
    rows = []
    for label, cfg in configs.items():
        m = measured[label]
        rows.append(
            part.row(
                label,
                cfg,
                batch,
                cfg.max_seq_len,
                model=model,
                scope="whole step" if cfg.remat_head_chunks else "blocks",
                **timed_fields(m, base_m, ratios[label], config.time_steps, cfg, batch, cfg.max_seq_len),
                **extra.get(label, {}),
            )
        )
    return rows
