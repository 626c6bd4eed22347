"""Memory and time of every remat policy side by side: ``python -m train.bench``.

Reproduces the three figures of the Needle gradient-checkpointing study and the Megatron-LM
activation accounting, and writes into ``--out DIR`` (default ``results/``):

* ``bench.csv`` — one row per measurement (columns: :data:`CSV_COLUMNS`);
* PNG plots (matplotlib, Agg): ``needle_batch.png``, ``needle_dff.png``, ``needle_k_time.png``,
  ``megatron.png``, ``maxbatch.png``, ``pareto.png`` (those of the parts that ran);
* ``summary.md`` — markdown tables, targets met or missed, the machine, the JAX version and the
  exact command.

Parts (``--parts``, comma-separated; default all):

``needle``
    Compile-only peak memory of a full Adam train step (parameters, gradients and both Adam
    moments) of preset ``needle`` under ``every_k:k=4`` vs ``none``: against batch size at
    ``d_ff`` 2048 (figure 1) and against ``d_ff`` at batch 2048 (figure 2).
``needle_time``
    Step time of ``every_k:k=K`` (K = 1..8; K = 0 is ``none``) on preset ``needle`` at a small
    batch, as a ratio to ``none`` (figure 3).
``megatron``
    gpt2-small shapes in bf16 with dropout: activation bytes one block saves for the backward
    pass, per policy, in units of ``s*b*h`` next to Megatron-LM's formulas (no remat
    ``s*b*h*(34 + 5*a*s/h)``, selective ``34*s*b*h``, full ``2*s*b*h``), and the compiled peak of
    the Adam train step.
``maxbatch``
    The largest batch whose compiled Adam-step peak fits ``--maxbatch-budget-gib``, per policy
    (a linear fit of peak against batch from two compiles, then bisection, verified by compiling
    the answer and the answer + 1).
``time``
    Step time of every policy on preset ``small`` as a ratio to ``none`` (interleaved rounds,
    warm-up excluded, median of the paired per-round ratios), and the compiled peak of the same
    step: the Pareto plot.

Memory is always compile-only (``jremat.jit(...).lower(shapes).compile()``, XLA's buffer
assignment; nothing is allocated), so large shapes run on a CPU. Times are only reported as
ratios to ``none`` measured in the same process.

Policies: :data:`DEFAULT_POLICIES` plus two outside baselines, registered only while the bench
runs: ``baseline_jax_checkpoint`` (``jax.checkpoint`` with no policy) and ``baseline_nnx_remat``
(``flax.nnx.remat`` with its default policy), both around the same block function. Default
policies that are not registered are skipped with a note.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jremat
import jax
import jax.numpy as jnp
from flax import nnx

from jremat import memory as jmem
from jremat import registry
from models import GPT, PRESETS, ModelConfig
from models import preset as model_preset
from train.cli import OneLineErrorParser, UsageError
from jremat.memory import format_bytes
from models.planning import plan_for_budget
from models.programs import adam_step_memory, adam_train_step, block_program, step_residuals
from train.step import make_train_step

PARTS = ("needle", "needle_time", "megatron", "time", "maxbatch", "auto")

BASELINE_JAX = "baseline_jax_checkpoint"
BASELINE_NNX = "baseline_nnx_remat"

#: The policies compared by default, in table order.
DEFAULT_POLICIES = (
    "none",
    "full",
    "every_k:k=2",
    "every_k:k=4",
    "every_k:k=8",
    "every_k:k=4,skip_cheap=true",
    "skip_cheap",
    "selective",
    "dots",
    "dots_no_batch",
    "nested:block=auto",
    BASELINE_NNX,
    BASELINE_JAX,
)

CSV_COLUMNS = (
    "part", "policy", "preset", "n_layers", "batch_size", "seq_len", "d_model", "d_ff", "n_heads", "dtype",
    "k", "peak_bytes", "temp_bytes", "argument_bytes", "output_bytes", "alias_bytes", "peak_source",
    "peak_reduction_vs_none", "saved_bytes_per_layer", "saved_method", "saved_per_sbh", "megatron_per_sbh",
    "budget_bytes", "max_batch", "max_batch_verified", "time_ratio_vs_none", "time_ratio_low",
    "time_ratio_high", "time_steps", "best_fitting_policy", "best_fitting_time_ratio",
)

GIB = 2**30
MIB = 2**20


# ---------------------------------------------------------------------------------------------
# Outside baselines
# ---------------------------------------------------------------------------------------------


class JaxCheckpointBaseline(jremat.Policy):
    """``jax.checkpoint(fn)`` with no policy (JAX's default: save only the inputs)."""

    def checkpoint(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """Return ``jax.checkpoint(fn)``."""
        return jax.checkpoint(fn, prevent_cse=prevent_cse)

    def wrap(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """The peer as users write it: no cotangent tie."""
        return self.checkpoint(fn, prevent_cse=prevent_cse)


class NnxRematBaseline(jremat.Policy):
    """``flax.nnx.remat(fn)`` with Flax's default policy, around the function that merges the block."""

    def checkpoint(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """Return ``nnx.remat(fn)``."""
        return nnx.remat(fn, prevent_cse=prevent_cse)

    def wrap(self, fn: Callable, *, prevent_cse: bool = True) -> Callable:
        """The peer as users write it: no cotangent tie."""
        return self.checkpoint(fn, prevent_cse=prevent_cse)


def register_baselines() -> None:
    """Register the two outside baselines under their bench names (idempotent).

    They stay registered until removed: callers that must leave the global registry as they
    found it (tests, a bench run inside another program) wrap the run in
    ``jremat.registry.scoped()``, which restores the registry on exit::

        with registry.scoped():
            register_baselines()
            ...  # BASELINE_JAX / BASELINE_NNX resolve here, and are gone afterwards

    Where a Policy object will do, pass it instead of a spec: ``registry.resolve``,
    ``jremat.checkpoint`` and ``RematConfig(policy=...)`` accept one as is.
    """
    entries = registry.entries()
    if BASELINE_JAX not in entries:
        registry.register(BASELINE_JAX, doc="bench baseline: jax.checkpoint with no policy")(JaxCheckpointBaseline)
    if BASELINE_NNX not in entries:
        registry.register(BASELINE_NNX, doc="bench baseline: flax.nnx.remat with Flax's default policy")(
            NnxRematBaseline
        )


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

#: Sizes of ``--quick`` (the smoke test); every field left unset takes these, or FULL_SIZES.
QUICK_SIZES: dict[str, Any] = dict(
    needle_batches=(8, 16), needle_d_ff=64, needle_d_ffs=(32, 64), needle_batch=16, needle_ks=(0, 1, 2),
    needle_time_batch=4, megatron_preset="tiny", megatron_layers=None, megatron_batch=2, megatron_seq=16,
    maxbatch_budget_gib=0.002, maxbatch_seq=16, time_preset="tiny", time_batch=4, time_steps=5, time_rounds=1,
    auto_budget_fractions=(0.5,),
)
FULL_SIZES: dict[str, Any] = dict(
    needle_batches=(256, 512, 1024, 2048), needle_d_ff=2048, needle_d_ffs=(256, 512, 1024, 2048),
    needle_batch=2048, needle_ks=(0, 1, 2, 3, 4, 5, 6, 7, 8), needle_time_batch=64, megatron_preset="gpt2-small",
    megatron_layers=None, megatron_batch=8, megatron_seq=1024, maxbatch_budget_gib=16.0, maxbatch_seq=1024,
    time_preset="small", time_batch=20, time_steps=40, time_rounds=40,
    auto_budget_fractions=(0.1, 0.3, 0.5, 0.7, 0.9),
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What ``python -m train.bench`` runs; one field per command-line flag (``a_b`` <-> ``--a-b``).

    Size fields left ``None`` take :data:`FULL_SIZES`, or :data:`QUICK_SIZES` with ``quick``.

    Attributes:
      out: output folder.
      parts: parts to run, from :data:`PARTS`.
      policy: policy specs to compare (default :data:`DEFAULT_POLICIES`).
      quick: tiny sizes for a smoke test.
      needle_batches: batch sizes of figure 1.
      needle_d_ff: ``d_ff`` of figure 1.
      needle_d_ffs: ``d_ff`` values of figure 2.
      needle_batch: batch size of figure 2.
      needle_ks: the k values of figure 3 (0 = ``none``).
      needle_time_batch: batch size of figure 3.
      megatron_preset: model preset of the Megatron comparison.
      megatron_layers: overrides its number of layers.
      megatron_batch: its batch size.
      megatron_seq: its sequence length.
      maxbatch_budget_gib: the memory budget of the max-batch search, GiB.
      maxbatch_seq: sequence length of the max-batch search (megatron preset).
      time_preset: model preset of the timing part.
      time_batch: its batch size.
      time_steps: measured steps per policy (at least 5), after one warm-up step.
      time_rounds: interleaved rounds the steps are split into.
      auto_budget_fractions: where the ``auto`` part's budgets sit between full's (0) and none's (1) peak.
      seed: parameter-initialization and data seed.
      remat_head_chunks: in the memory parts (``needle``, ``maxbatch``), every policy except
        ``none`` also rematerializes the final LayerNorm, head and loss over this many sequence
        chunks (``ModelConfig.remat_head_chunks``), as the Needle study checkpoints the whole
        graph; 0 applies policies to the blocks only. Must divide both sequence lengths.
    """

    out: str = "results"
    parts: tuple[str, ...] = PARTS
    policy: tuple[str, ...] = DEFAULT_POLICIES
    quick: bool = False
    needle_batches: tuple[int, ...] | None = None
    needle_d_ff: int | None = None
    needle_d_ffs: tuple[int, ...] | None = None
    needle_batch: int | None = None
    needle_ks: tuple[int, ...] | None = None
    needle_time_batch: int | None = None
    megatron_preset: str | None = None
    megatron_layers: int | None = None
    megatron_batch: int | None = None
    megatron_seq: int | None = None
    maxbatch_budget_gib: float | None = None
    maxbatch_seq: int | None = None
    time_preset: str | None = None
    time_batch: int | None = None
    time_steps: int | None = None
    time_rounds: int | None = None
    auto_budget_fractions: tuple[float, ...] | None = None
    seed: int = 0
    remat_head_chunks: int = 4

    def __post_init__(self):
        sizes = QUICK_SIZES if self.quick else FULL_SIZES
        for name, value in sizes.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if not self.parts:
            raise UsageError(f"--parts needs at least one of {', '.join(PARTS)}")
        for part in self.parts:
            if part not in PARTS:
                raise UsageError(f"unknown part {part!r} in --parts; valid parts: {', '.join(PARTS)}")
        if not self.policy:
            raise UsageError("give at least one --policy")
        for name in ("needle_d_ff", "needle_batch", "needle_time_batch", "megatron_batch", "megatron_seq",
                     "maxbatch_seq", "time_batch", "time_rounds"):
            _positive(name, getattr(self, name))
        if self.megatron_layers is not None:
            _positive("megatron_layers", self.megatron_layers)
        for name in ("needle_batches", "needle_d_ffs"):
            values = getattr(self, name)
            if not values:
                raise UsageError(f"--{name.replace('_', '-')} needs at least one value")
            for v in values:
                _positive(name, v)
        if not self.needle_ks or any(not isinstance(k, int) or k < 0 for k in self.needle_ks):
            raise UsageError(f"--needle-ks must be integers >= 0 (0 = none), got {self.needle_ks!r}")
        if not isinstance(self.time_steps, int) or self.time_steps < 5:
            raise UsageError(f"--time-steps must be an integer >= 5 (medians of at least 5 steps), got {self.time_steps!r}")
        if self.time_rounds > self.time_steps:
            raise UsageError(f"--time-rounds {self.time_rounds} exceeds --time-steps {self.time_steps}: "
                             "every round needs at least one step")
        if not (isinstance(self.maxbatch_budget_gib, (int, float)) and math.isfinite(self.maxbatch_budget_gib)
                and self.maxbatch_budget_gib > 0):
            raise UsageError(f"--maxbatch-budget-gib must be a positive number, got {self.maxbatch_budget_gib!r}")
        for name in ("megatron_preset", "time_preset"):
            if getattr(self, name) not in PRESETS:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is not a preset; "
                                 f"valid presets: {', '.join(PRESETS)}")
        if not self.auto_budget_fractions or any(not 0 < f < 1 for f in self.auto_budget_fractions):
            raise UsageError(f"--auto-budget-fractions must be numbers in (0, 1), got {self.auto_budget_fractions!r}")
        if not isinstance(self.remat_head_chunks, int) or self.remat_head_chunks < 0:
            raise UsageError(f"--remat-head-chunks must be an integer >= 0, got {self.remat_head_chunks!r}")
        for seq in (PRESETS["needle"].max_seq_len, self.maxbatch_seq):
            if self.remat_head_chunks and seq % self.remat_head_chunks:
                raise UsageError(f"--remat-head-chunks {self.remat_head_chunks} does not divide sequence length {seq}")
        for name in ("megatron_seq", "maxbatch_seq"):
            limit = PRESETS[self.megatron_preset].max_seq_len
            if getattr(self, name) > limit:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)} exceeds preset "
                                 f"{self.megatron_preset!r}'s max_seq_len {limit}")

    def megatron_config(self, policy: str, **changes) -> ModelConfig:
        """The Megatron comparison's model: the preset in bf16 compute, f32 parameters, dropout 0.1."""
        overrides = dict(dtype="bfloat16", param_dtype="float32", attn_dropout=0.1, resid_dropout=0.1,
                         remat_policy=policy, remat_granularity="block")
        if self.megatron_layers is not None:
            overrides["n_layers"] = self.megatron_layers
        overrides.update(changes)
        return model_preset(self.megatron_preset, **overrides)


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


# ---------------------------------------------------------------------------------------------
# The measured program: one Adam train step
# ---------------------------------------------------------------------------------------------


_MEMORY_CACHE: dict = {}


def step_memory(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> jmem.MemoryReport:
    """:func:`models.programs.adam_step_memory`, cached per config and shape."""
    key = (model_cfg, batch_size, seq_len)
    if key not in _MEMORY_CACHE:
        _MEMORY_CACHE[key] = adam_step_memory(model_cfg, batch_size, seq_len)
    return _MEMORY_CACHE[key]


def time_steps(
    configs: dict[str, ModelConfig], batch_size: int, steps: int, rounds: int, *, seed: int = 0
) -> tuple[dict[str, list[list[float]]], dict[str, jmem.MemoryReport]]:
    """Run every config's Adam step and time it, interleaved (A, B, C, A, B, C, ...).

    Each config is compiled, run once (warm-up, not timed), then ``steps`` timed steps are made
    in ``rounds`` interleaved blocks on the same random tokens, so machine load affects all alike.

    Args:
      configs: label -> model config.
      batch_size: sequences per batch.
      steps: timed steps per config.
      rounds: interleaved blocks.
      seed: seed of the parameters and the tokens.

    Returns:
      ``(times, memory)``: per label, the per-round lists of step seconds; and the compiled
      memory report of each step.
    """
    runners, memory = {}, {}
    for label, cfg in configs.items():
        _, graphdef, tx, args = adam_train_step(cfg, batch_size)
        compiled = make_train_step(graphdef, tx).lower(*args).compile()
        memory[label] = jmem.compiled_memory_report(compiled)
        _, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(seed)))
        opt_state = tx.init(params)
        tokens = jax.random.randint(jax.random.key(seed + 1), (batch_size, cfg.max_seq_len), 0, cfg.vocab_size)
        targets = jnp.roll(tokens, -1, axis=1)
        params, opt_state, loss = compiled(params, opt_state, tokens, targets, jax.random.key(seed))
        jax.block_until_ready(loss)
        runners[label] = [compiled, params, opt_state, tokens, targets]
    times = {label: [] for label in configs}
    per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
    for r, count in enumerate(per_round):
        for label, runner in runners.items():
            compiled, params, opt_state, tokens, targets = runner
            block = []
            for i in range(count):
                t0 = time.perf_counter()
                params, opt_state, loss = compiled(params, opt_state, tokens, targets, jax.random.key(r * 1000 + i))
                jax.block_until_ready(loss)
                block.append(time.perf_counter() - t0)
            runner[1:3] = [params, opt_state]
            times[label].append(block)
    return times, memory


def time_ratios(times: dict[str, list[list[float]]], baseline: str) -> dict[str, tuple[float, float, float]]:
    """``(ratio, low, high)`` of each label's step time to ``baseline``'s, from paired rounds.

    Each interleaved round gives one paired ratio (the label's median step in that round over the
    baseline's in the same round), so drift in machine load cancels within the pair. The ratio is
    the median of the paired ratios; ``low`` and ``high`` are their lower and upper quartiles (a
    spread, not a bound; both equal the ratio when there is a single round).
    """
    out = {}
    for label, rounds in times.items():
        paired = [statistics.median(b) / statistics.median(bb) for b, bb in zip(rounds, times[baseline]) if b and bb]
        low, _, high = statistics.quantiles(paired, n=4, method="inclusive") if len(paired) > 1 else paired * 3
        out[label] = (statistics.median(paired), low, high)
    return out


# ---------------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------------


def _row(part: str, policy: str, cfg: ModelConfig, batch: int, seq: int, **values) -> dict:
    row = {c: "" for c in CSV_COLUMNS}
    row.update(part=part, policy=policy, preset="", n_layers=cfg.n_layers, batch_size=batch, seq_len=seq,
               d_model=cfg.d_model, d_ff=cfg.d_ff, n_heads=cfg.n_heads, dtype=cfg.dtype)
    row.update(values)
    return row


def bench_peak(report: jmem.MemoryReport) -> int:
    """The peak the bench reports: ``argument + output - alias + temp`` on XLA:CPU, else the report's.

    XLA:CPU's ``peak_memory_in_bytes`` counts arguments and outputs only, so when the temp size
    happens to be smaller it can look plausible while leaving temp out; the sum is used on CPU
    for every policy alike so that rows compare.
    """
    if report.platform == "cpu":
        return report.summed_peak_bytes
    return report.peak_bytes


def _peak_source(report: jmem.MemoryReport) -> str:
    return jmem.PEAK_FROM_SUM if report.platform == "cpu" else report.peak_source


def _memory_fields(report: jmem.MemoryReport) -> dict:
    return dict(peak_bytes=bench_peak(report), temp_bytes=report.temp_bytes, argument_bytes=report.argument_bytes,
                output_bytes=report.output_bytes, alias_bytes=report.alias_bytes, peak_source=_peak_source(report))


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def needle_config(d_ff: int, policy: str, head_chunks: int = 0) -> ModelConfig:
    """Preset ``needle`` with ``d_ff`` and ``policy`` at block granularity, its one layer unrolled.

    ``head_chunks`` becomes ``remat_head_chunks`` for every policy but ``none``.

    Unrolled, not under ``lax.scan``: XLA turns a scan of length 1 into straight-line code and
    then merges the recomputation with the forward pass, so remat saves nothing (measured with
    JAX 0.10.2 on XLA:CPU: identical temp bytes for ``none``, ``every_k:k=4`` and ``full``);
    unrolled layers get the cotangent tie (:mod:`jremat.tie`), which prevents that.
    """
    return model_preset("needle", d_ff=d_ff, remat_policy=policy, remat_granularity="block", scan_layers=False,
                        remat_head_chunks=0 if policy == "none" else head_chunks)


def part_needle(config: BenchConfig) -> list[dict]:
    """Figures 1 and 2 of the Needle study: Adam-step peak of ``every_k:k=4`` vs ``none``."""
    rows = []
    points = [("needle_batch", b, config.needle_d_ff) for b in config.needle_batches]
    points += [("needle_dff", config.needle_batch, d) for d in config.needle_d_ffs]
    for part, batch, d_ff in points:
        reports = {}
        for spec in ("none", "every_k:k=4"):
            cfg = needle_config(d_ff, spec, config.remat_head_chunks)
            t0 = time.perf_counter()
            reports[spec] = step_memory(cfg, batch)
            _log(f"[{part}] batch {batch} d_ff {d_ff} {spec}: peak {bench_peak(reports[spec]) / MIB:.1f} MiB "
                 f"({time.perf_counter() - t0:.1f} s)")
        base = bench_peak(reports["none"])
        for spec, report in reports.items():
            cfg = needle_config(d_ff, spec, config.remat_head_chunks)
            saved, method = saved_per_layer(cfg, batch, cfg.max_seq_len, needle_config(d_ff, "none"))
            rows.append(_row(part, spec, cfg, batch, cfg.max_seq_len, preset="needle", k=4 if spec != "none" else 0,
                             peak_reduction_vs_none=1 - bench_peak(report) / base, saved_bytes_per_layer=saved,
                             saved_method=method, saved_per_sbh=saved / (batch * cfg.max_seq_len * cfg.d_model),
                             **_memory_fields(report)))
    return rows


def part_needle_time(config: BenchConfig) -> list[dict]:
    """Figure 3 of the Needle study: step time of ``every_k:k=K`` vs ``none`` (K = 0)."""
    configs = {}
    for k in config.needle_ks:
        spec = "none" if k == 0 else f"every_k:k={k}"
        configs[spec] = needle_config(config.needle_d_ff, spec)
    if "none" not in configs:
        configs = {"none": needle_config(config.needle_d_ff, "none"), **configs}
    _log(f"[needle_time] timing {len(configs)} steps at batch {config.needle_time_batch}")
    times, memory = time_steps(configs, config.needle_time_batch, config.time_steps, config.time_rounds,
                               seed=config.seed)
    ratios = time_ratios(times, "none")
    rows = []
    for spec, cfg in configs.items():
        k = 0 if spec == "none" else int(spec.split("=")[1])
        ratio, low, high = ratios[spec]
        rows.append(_row("needle_time", spec, cfg, config.needle_time_batch, cfg.max_seq_len, preset="needle", k=k,
                         time_ratio_vs_none=ratio, time_ratio_low=low, time_ratio_high=high,
                         time_steps=config.time_steps, **_memory_fields(memory[spec])))
    return rows


def megatron_formulas(s: int, b: int, h: int, a: int) -> dict[str, float]:
    """Megatron-LM's activation bytes per layer (16-bit activations), in units of ``s*b*h``.

    ``none``: ``34 + 5*a*s/h``; ``selective``: 34; ``full``: 2 (Korthikanti et al. 2022, table 2).
    """
    return {"none": 34 + 5 * a * s / h, "selective": 34.0, "full": 2.0}


def _megatron_ref(spec: str, formulas: dict[str, float]) -> float | str:
    name = spec.split(":")[0]
    if name in formulas:
        return formulas[name]
    if name in (BASELINE_JAX, BASELINE_NNX):
        return formulas["full"]
    return ""


def saved_per_layer(cfg: ModelConfig, batch: int, seq: int, none_cfg: ModelConfig) -> tuple[float, str]:
    """Activation bytes one block keeps for its backward pass, and how it was obtained.

    For per-block policies: :func:`jremat.saved_residuals_report` of one block
    (``models.gpt.make_block_fn`` via ``models.programs.block_program``). For stack-level policies
    (``nested``), which have no per-block checkpoint: the whole step's saved activations minus
    those of ``none``, divided by the layers, plus ``none``'s per-block figure (embedding and
    head residuals are the same under every policy, so they cancel).
    """
    if cfg.remat_config().nest is not None:
        whole = step_residuals(cfg, batch, seq).saved_bytes
        whole_none = step_residuals(none_cfg, batch, seq).saved_bytes
        block_none, _ = saved_per_layer(none_cfg, batch, seq, none_cfg)
        return (whole - whole_none) / cfg.n_layers + block_none, "whole step - none, per layer"
    fn, args = block_program(cfg, batch, seq)
    return float(jmem.saved_residuals_report(fn, *args, param_argnums=(0,)).saved_bytes), "one block"


def part_megatron(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Per-layer saved activations and Adam-step peak of every policy vs Megatron-LM's formulas."""
    b, s = config.megatron_batch, config.megatron_seq
    none_cfg = config.megatron_config("none")
    h, a = none_cfg.d_model, none_cfg.n_heads
    sbh = s * b * h
    formulas = megatron_formulas(s, b, h, a)
    rows, base_peak = [], None
    for spec in ["none"] + [p for p in policies if p != "none"]:
        cfg = config.megatron_config(spec)
        t0 = time.perf_counter()
        saved, method = saved_per_layer(cfg, b, s, none_cfg)
        report = step_memory(cfg, b, s)
        base_peak = bench_peak(report) if spec == "none" else base_peak
        _log(f"[megatron] {spec}: saved/layer {saved / sbh:.2f} sbh, peak {bench_peak(report) / GIB:.2f} GiB "
             f"({time.perf_counter() - t0:.1f} s)")
        if spec not in policies:
            continue
        rows.append(_row("megatron", spec, cfg, b, s, preset=config.megatron_preset, saved_bytes_per_layer=saved,
                         saved_method=method, saved_per_sbh=saved / sbh, megatron_per_sbh=_megatron_ref(spec, formulas),
                         peak_reduction_vs_none=1 - bench_peak(report) / base_peak, **_memory_fields(report)))
    return rows


def max_batch(cfg: ModelConfig, budget: int, seq: int, *, max_compiles: int = 8) -> tuple[int, bool]:
    """Largest batch whose compiled Adam-step peak is at most ``budget`` bytes.

    Peak is close to affine in the batch size, so the answer is predicted from compiles at
    batch 1 and 8 and then checked: the search ends when a batch ``b`` fits and ``b + 1`` does
    not (both compiled). Falls back to bisection when the prediction is off.

    Returns:
      ``(batch, verified)``; ``verified`` is False if ``max_compiles`` ran out before the
      boundary was bracketed by two adjacent compiled batch sizes (``batch`` then fits, and is a
      lower bound). ``(0, True)`` if even batch 1 does not fit.
    """
    peaks: dict[int, int] = {}

    def peak(batch):
        if batch not in peaks:
            peaks[batch] = bench_peak(step_memory(cfg, batch, seq))
        return peaks[batch]

    if peak(1) > budget:
        return 0, True
    slope = max(1.0, (peak(8) - peak(1)) / 7)
    lo, hi = (8, None) if peak(8) <= budget else (1, 8)
    guess = max(1, int(1 + (budget - peak(1)) // slope))
    guided = 2  # the prediction and its neighbour; after that, bisect (no walking one batch at a time)
    while len(peaks) < max_compiles and not (hi is not None and hi == lo + 1):
        if hi is None:
            candidate = guess if guided > 0 and guess > lo else 2 * lo
        else:
            candidate = guess if guided > 0 and lo < guess < hi else (lo + hi) // 2
        guided -= 1
        if peak(candidate) <= budget:  # every candidate is new: strictly above lo, below hi
            lo, guess = candidate, candidate + 1
        else:
            hi, guess = candidate, candidate - 1
    return lo, hi is not None and hi == lo + 1


def part_maxbatch(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Largest batch per policy whose compiled Adam-step peak fits the budget."""
    budget = int(config.maxbatch_budget_gib * GIB)
    seq = config.maxbatch_seq
    rows = []
    for spec in policies:
        cfg = config.megatron_config(spec)
        if spec != "none":
            cfg = cfg.replace(remat_head_chunks=config.remat_head_chunks)
        t0 = time.perf_counter()
        batch, verified = max_batch(cfg, budget, seq)
        _log(f"[maxbatch] {spec}: {batch}{'' if verified else ' (lower bound)'} ({time.perf_counter() - t0:.1f} s)")
        report = step_memory(cfg, batch, seq) if batch else None
        rows.append(_row("maxbatch", spec, cfg, batch, seq, preset=config.megatron_preset, budget_bytes=budget,
                         max_batch=batch, max_batch_verified=verified, **(_memory_fields(report) if report else {})))
    return rows


def part_time(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """Step-time ratio to ``none`` and compiled peak of every policy on the timing preset."""
    configs = {spec: model_preset(config.time_preset, remat_policy=spec) for spec in ["none", *policies]}
    _log(f"[time] timing {len(configs)} policies on {config.time_preset} at batch {config.time_batch}")
    times, memory = time_steps(configs, config.time_batch, config.time_steps, config.time_rounds, seed=config.seed)
    ratios = time_ratios(times, "none")
    base_peak = bench_peak(memory["none"])
    rows = []
    for spec in policies:
        cfg = configs[spec]
        ratio, low, high = ratios[spec]
        rows.append(_row("time", spec, cfg, config.time_batch, cfg.max_seq_len, preset=config.time_preset,
                         time_ratio_vs_none=ratio, time_ratio_low=low, time_ratio_high=high,
                         time_steps=config.time_steps, peak_reduction_vs_none=1 - bench_peak(memory[spec]) / base_peak,
                         **_memory_fields(memory[spec])))
    return rows


def part_auto(config: BenchConfig, policies: Sequence[str]) -> list[dict]:
    """``auto`` at budgets between full's and none's Adam-step peak (five by default), timed against the built-ins.

    For each budget the plan is solved and verified on the same Adam step the bench measures;
    every built-in and every plan is then timed in one interleaved run, and each budget's row
    names the fastest built-in that also fits it.
    """
    cfg = model_preset(config.time_preset)
    batch = config.time_batch

    def peak(model_cfg: ModelConfig) -> int:
        return bench_peak(step_memory(model_cfg, batch))

    builtins = {spec: cfg.replace(remat_policy=spec) for spec in dict.fromkeys(["none", "full", *policies])}
    peaks = {spec: peak(c) for spec, c in builtins.items()}
    budgets = [int(peaks["full"] + f * (peaks["none"] - peaks["full"])) for f in config.auto_budget_fractions]
    plans = {}
    for budget in budgets:
        plan = plan_for_budget(cfg, batch, str(budget), measure_peak_bytes=peak)
        plans[f"auto:budget={budget} ({plan.candidate.describe(cfg.n_layers)})"] = plan
        _log(f"[auto] budget {budget:,} B -> {plan.candidate.describe(cfg.n_layers)}; "
             f"solved in {plan.solution.solve_s * 1e3:.0f} ms, {len(plan.solution.compiled)} verification compile(s)")
    configs = {**builtins, **{label: plan.config for label, plan in plans.items()}}
    _log(f"[auto] timing {len(configs)} configs on {config.time_preset} at batch {batch}")
    times, memory = time_steps(configs, batch, config.time_steps, config.time_rounds, seed=config.seed)
    ratios = time_ratios(times, "none")
    rows = []
    for (label, plan), budget in zip(plans.items(), budgets):
        fitting = [spec for spec in builtins if peaks[spec] <= budget]
        best = min(fitting, key=lambda spec: ratios[spec][0])
        ratio, low, high = ratios[label]
        rows.append(_row("auto", label, plan.config, batch, cfg.max_seq_len, preset=config.time_preset,
                         budget_bytes=budget, time_ratio_vs_none=ratio, time_ratio_low=low, time_ratio_high=high,
                         time_steps=config.time_steps, best_fitting_policy=best,
                         best_fitting_time_ratio=ratios[best][0],
                         peak_reduction_vs_none=1 - bench_peak(memory[label]) / peaks["none"],
                         **_memory_fields(memory[label])))
    return rows


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def write_csv(rows: Sequence[dict], path: str) -> None:
    """Write ``rows`` with the columns :data:`CSV_COLUMNS`."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("%.6g" % v if isinstance(v, float) else v) for k, v in row.items()})


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str, plt) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def write_plots(rows: Sequence[dict], out: str) -> list[str]:
    """Write the PNG plots of the parts present in ``rows``; returns their file names."""
    plt = _pyplot()
    written = []
    by_part: dict[str, list[dict]] = {}
    for r in rows:
        by_part.setdefault(r["part"], []).append(r)

    for part, xkey, xlabel, lines, title in (
        ("needle_batch", "batch_size", "batch size", ((0.55, "study: > 55%"), (0.62, "study at 2048: > 62%")),
         "Needle preset, Adam step: peak reduction of every_k:k=4 vs none"),
        ("needle_dff", "d_ff", "d_ff", ((0.60, "study: > 60%"),),
         "Needle preset, Adam step: peak reduction of every_k:k=4 vs none"),
    ):
        pts = [r for r in by_part.get(part, []) if r["policy"] != "none"]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r[xkey] for r in pts]
        ax.plot(xs, [100 * r["peak_reduction_vs_none"] for r in pts], "o-", label="compiled peak of the Adam step")
        none = {(r["batch_size"], r["d_ff"]): r for r in by_part[part] if r["policy"] == "none"}
        if all(r["saved_bytes_per_layer"] != "" for r in by_part[part]):
            ax.plot(xs, [100 * (1 - r["saved_bytes_per_layer"] / none[(r["batch_size"], r["d_ff"])]["saved_bytes_per_layer"])
                         for r in pts], "s--", label="activations the block saves")
        for value, label in lines:
            ax.axhline(100 * value, ls="--", lw=1, color="gray")
            ax.text(xs[0], 100 * value + 0.5, label, fontsize=8, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("peak memory reduction (%)")
        ax.set_ylim(0, 100)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        _save(fig, os.path.join(out, f"{part}.png"), plt)
        written.append(f"{part}.png")

    pts = by_part.get("needle_time", [])
    if pts:
        fig, ax = plt.subplots(figsize=(6, 4))
        pts = sorted(pts, key=lambda r: r["k"])
        ks = [r["k"] for r in pts]
        ax.errorbar(ks, [r["time_ratio_vs_none"] for r in pts],
                    yerr=[[r["time_ratio_vs_none"] - r["time_ratio_low"] for r in pts],
                          [r["time_ratio_high"] - r["time_ratio_vs_none"] for r in pts]], fmt="o-", capsize=3)
        ax.axhline(1.0, ls="--", lw=1, color="gray")
        ax.set_xticks(ks)
        ax.set_xlabel("k (0 = none)")
        ax.set_ylabel("step time / none (median of paired rounds; bars: quartiles)")
        ax.set_title(f"Needle preset, batch {pts[0]['batch_size']}, d_ff {pts[0]['d_ff']}: step time vs k", fontsize=9)
        _save(fig, os.path.join(out, "needle_k_time.png"), plt)
        written.append("needle_k_time.png")

    pts = by_part.get("megatron", [])
    if pts:
        fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(pts)), 4.5))
        xs = range(len(pts))
        ax.bar(xs, [r["saved_per_sbh"] for r in pts], label="jremat: saved activations / layer")
        refs = [r["megatron_per_sbh"] for r in pts]
        ax.scatter([x for x, v in zip(xs, refs) if v != ""], [v for v in refs if v != ""], color="red", marker="_",
                   s=400, zorder=3, label="Megatron-LM formula")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["policy"] for r in pts], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("bytes per layer / (s*b*h)")
        r0 = pts[0]
        ax.set_title(f"{r0['preset']} shapes, b={r0['batch_size']}, s={r0['seq_len']}, {r0['dtype']}, dropout 0.1",
                     fontsize=9)
        ax.legend(fontsize=8)
        _save(fig, os.path.join(out, "megatron.png"), plt)
        written.append("megatron.png")

    pts = by_part.get("maxbatch", [])
    if pts:
        fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(pts)), 4.5))
        xs = range(len(pts))
        ax.bar(xs, [r["max_batch"] for r in pts])
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["policy"] for r in pts], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("largest batch that fits")
        r0 = pts[0]
        ax.set_title(f"{r0['preset']} shapes, s={r0['seq_len']}, Adam step, budget {r0['budget_bytes'] / GIB:g} GiB",
                     fontsize=9)
        _save(fig, os.path.join(out, "maxbatch.png"), plt)
        written.append("maxbatch.png")

    pts = by_part.get("time", []) + by_part.get("auto", [])
    if pts:
        fig, ax = plt.subplots(figsize=(7, 5))
        for r in pts:
            ax.scatter(r["time_ratio_vs_none"], r["peak_bytes"] / MIB)
            ax.annotate(r["policy"], (r["time_ratio_vs_none"], r["peak_bytes"] / MIB), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("step time / none")
        ax.set_ylabel("compiled peak of the Adam step (MiB)")
        r0 = pts[0]
        ax.set_title(f"preset {r0['preset']}, batch {r0['batch_size']} x {r0['seq_len']}: memory vs time", fontsize=9)
        _save(fig, os.path.join(out, "pareto.png"), plt)
        written.append("pareto.png")
    return written


def _pct(x) -> str:
    return "n/a" if x in (None, "") else f"{100 * x:.1f}%"


def _table(header: Sequence[str], lines: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
    return out


def machine_description() -> str:
    """The machine and software that produced the figures, in one line."""
    device = jax.devices()[0]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = os.environ.get("XLA_FLAGS", "").strip()
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores visible, {usable} usable by this "
            f"process, JAX {jax.__version__} (backend {jax.default_backend()}, device {device.device_kind}), "
            f"Python {platform.python_version()}, XLA_FLAGS={flags or '(unset)'}")


def summary_markdown(rows: Sequence[dict], plots: Sequence[str], command: str, notes: Sequence[str]) -> str:
    """The markdown summary: machine, command, one table per part, targets met or missed, notes."""
    by_part: dict[str, list[dict]] = {}
    for r in rows:
        by_part.setdefault(r["part"], []).append(r)
    lines = ["# jremat benchmark results", "", f"- Machine: {machine_description()}", f"- Command: `{command}`",
             "- Memory: compile-only XLA buffer assignment of a full Adam train step (parameters, gradients, both "
             "moments; parameters and optimizer state donated); peak = " + (rows[0]["peak_source"] if rows else "n/a"),
             "- Times: ratios to `none` measured in the same process (warm-up excluded; the median over interleaved "
             "rounds of each round's paired ratio; low/high = the quartiles of those ratios). No absolute times are claimed.",
             ""]
    for part, title in (("needle_batch", "Needle figure 1: peak reduction vs batch size (every_k:k=4 vs none)"),
                        ("needle_dff", "Needle figure 2: peak reduction vs d_ff (every_k:k=4 vs none)")):
        pts = by_part.get(part, [])
        if not pts:
            continue
        none = {(r["batch_size"], r["d_ff"]): r for r in pts if r["policy"] == "none"}
        lines += [f"## {title}", ""]
        lines += _table(("batch", "d_ff", "peak none", "peak every_k:k=4", "peak reduction",
                         "block saved none", "block saved every_k:k=4", "block saved reduction"),
                        [(r["batch_size"], r["d_ff"], format_bytes(none[(r["batch_size"], r["d_ff"])]["peak_bytes"]),
                          format_bytes(r["peak_bytes"]), _pct(r["peak_reduction_vs_none"]),
                          format_bytes(none[(r["batch_size"], r["d_ff"])]["saved_bytes_per_layer"]),
                          format_bytes(r["saved_bytes_per_layer"]),
                          _pct(1 - r["saved_bytes_per_layer"] / none[(r["batch_size"], r["d_ff"])]["saved_bytes_per_layer"]))
                         for r in pts if r["policy"] != "none"])
        lines.append("")
    pts = by_part.get("needle_time", [])
    if pts:
        lines += [f"## Needle figure 3: step time vs k (batch {pts[0]['batch_size']}, d_ff {pts[0]['d_ff']})", ""]
        lines += _table(("k", "policy", "time / none", "low", "high", "peak"),
                        [(r["k"], r["policy"], f"{r['time_ratio_vs_none']:.3f}", f"{r['time_ratio_low']:.3f}",
                          f"{r['time_ratio_high']:.3f}", format_bytes(r["peak_bytes"]))
                         for r in sorted(pts, key=lambda r: r["k"])])
        lines.append("")
    pts = by_part.get("megatron", [])
    if pts:
        r0 = pts[0]
        lines += [f"## Megatron-LM accounting: {r0['preset']} shapes, {r0['n_layers']} layers, b={r0['batch_size']}, "
                  f"s={r0['seq_len']}, h={r0['d_model']}, a={r0['n_heads']}, {r0['dtype']}, dropout 0.1", ""]
        lines += _table(("policy", "saved / layer", "/ sbh", "Megatron / sbh", "how", "Adam-step peak", "peak vs none"),
                        [(r["policy"], format_bytes(r["saved_bytes_per_layer"]), f"{r['saved_per_sbh']:.2f}",
                          f"{r['megatron_per_sbh']:.1f}" if r["megatron_per_sbh"] != "" else "",
                          r["saved_method"], format_bytes(r["peak_bytes"]), _pct(-r["peak_reduction_vs_none"]))
                         for r in pts])
        lines.append("")
    pts = by_part.get("maxbatch", [])
    if pts:
        r0 = pts[0]
        lines += [f"## Max batch under {r0['budget_bytes'] / GIB:g} GiB: {r0['preset']} shapes, {r0['n_layers']} "
                  f"layers, s={r0['seq_len']}, Adam step", ""]
        none = next((r["max_batch"] for r in pts if r["policy"] == "none"), None)
        lines += _table(("policy", "max batch", "verified", "vs none", "peak at max batch"),
                        [(r["policy"], r["max_batch"], "yes" if r["max_batch_verified"] else "lower bound",
                          f"{r['max_batch'] / none:.2f}x" if none else "n/a", format_bytes(r["peak_bytes"]))
                         for r in pts])
        lines.append("")
    pts = by_part.get("time", [])
    if pts:
        r0 = pts[0]
        lines += [f"## Step time and peak: preset {r0['preset']}, {r0['n_layers']} layers, batch {r0['batch_size']} x "
                  f"{r0['seq_len']}, {r0['time_steps']} steps per policy", ""]
        lines += _table(("policy", "time / none", "low", "high", "peak", "peak reduction"),
                        [(r["policy"], f"{r['time_ratio_vs_none']:.3f}", f"{r['time_ratio_low']:.3f}",
                          f"{r['time_ratio_high']:.3f}", format_bytes(r["peak_bytes"]),
                          _pct(r["peak_reduction_vs_none"])) for r in pts])
        lines.append("")
    pts = by_part.get("auto", [])
    if pts:
        r0 = pts[0]
        lines += [f"## auto at {len(pts)} budgets: preset {r0['preset']}, batch {r0['batch_size']} x {r0['seq_len']}, "
                  "Adam step", ""]
        lines += _table(("budget", "auto plan", "auto peak", "auto time / none", "fastest fitting built-in",
                         "its time / none"),
                        [(format_bytes(r["budget_bytes"]), r["policy"], format_bytes(r["peak_bytes"]),
                          f"{r['time_ratio_vs_none']:.3f}", r["best_fitting_policy"],
                          f"{r['best_fitting_time_ratio']:.3f}") for r in pts])
        lines.append("")
    targets = check_targets(rows)
    if targets:
        lines += ["## Targets", ""]
        lines += _table(("target", "measured", "met"), [(t, m, "yes" if ok else "**no**") for t, m, ok in targets])
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def check_targets(rows: Sequence[dict]) -> list[tuple[str, str, bool]]:
    """The issue's targets that the measured rows cover: ``(target, measured, met)``."""
    out = []
    needle = [r for r in rows if r["part"] == "needle_batch" and r["policy"] != "none"]
    if needle:
        worst = min(r["peak_reduction_vs_none"] for r in needle)
        out.append(("Needle fig. 1: reduction > 55% at every batch", f"min {_pct(worst)}", worst > 0.55))
        largest = max(needle, key=lambda r: r["batch_size"])
        out.append((f"Needle fig. 1: reduction > 62% at batch {largest['batch_size']}",
                    _pct(largest["peak_reduction_vs_none"]), largest["peak_reduction_vs_none"] > 0.62))
    dff = sorted((r for r in rows if r["part"] == "needle_dff" and r["policy"] != "none"), key=lambda r: r["d_ff"])
    if dff:
        worst = min(r["peak_reduction_vs_none"] for r in dff)
        out.append(("Needle fig. 2: reduction > 60% at every d_ff", f"min {_pct(worst)}", worst > 0.60))
        growing = all(a["peak_reduction_vs_none"] <= b["peak_reduction_vs_none"] for a, b in zip(dff, dff[1:]))
        out.append(("Needle fig. 2: reduction grows with d_ff",
                    " -> ".join(_pct(r["peak_reduction_vs_none"]) for r in dff), growing))
    meg = {r["policy"]: r for r in rows if r["part"] == "megatron"}
    for spec, limit in (("selective", 32.0), ("full", 2.1)):
        if spec in meg:
            v = meg[spec]["saved_per_sbh"]
            out.append((f"Megatron: {spec} saves <= {limit:g} sbh per layer", f"{v:.2f} sbh", v <= limit))
    mb = {r["policy"]: r["max_batch"] for r in rows if r["part"] == "maxbatch"}
    if "none" in mb and "full" in mb:
        ratio = mb["full"] / mb["none"] if mb["none"] else math.inf
        out.append(("Max batch: full >= 5x none", f"{mb['full']} vs {mb['none']} ({ratio:.2f}x)", ratio >= 5))
    tm = {r["policy"]: r["time_ratio_vs_none"] for r in rows if r["part"] == "time"}
    for spec, limit in (("selective", 1.05), ("every_k:k=4", 1.15), ("full", 1.35)):
        if spec in tm:
            out.append((f"Time: {spec} <= {limit:.2f}x none", f"{tm[spec]:.3f}x", tm[spec] <= limit))
    for r in (r for r in rows if r["part"] == "auto"):
        out.append((f"auto fits budget {r['budget_bytes']:,} B", f"peak {r['peak_bytes']:,} B",
                    r["peak_bytes"] <= r["budget_bytes"]))
        out.append((f"auto at {r['budget_bytes']:,} B: time <= 1.03 x best fitting built-in",
                    f"{r['time_ratio_vs_none']:.3f}x vs {r['best_fitting_policy']} {r['best_fitting_time_ratio']:.3f}x",
                    r["time_ratio_vs_none"] <= 1.03 * r["best_fitting_time_ratio"]))
    return out


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; one flag per :class:`BenchConfig` field."""
    p = OneLineErrorParser(prog="python -m train.bench", description=__doc__.splitlines()[0],
                epilog="registered policies:\n" + registry.describe(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results", help="output folder (CSV, PNG plots, summary.md)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)}")
    p.add_argument("--policy", action="append", default=None,
                   help="policy spec to compare (repeatable; default: the built-in list plus the two baselines)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--needle-batches", type=_ints, default=None, help="figure 1 batch sizes, e.g. 256,512,1024,2048")
    p.add_argument("--needle-d-ff", type=int, default=None, help="figure 1 and 3 d_ff (default 2048)")
    p.add_argument("--needle-d-ffs", type=_ints, default=None, help="figure 2 d_ff values")
    p.add_argument("--needle-batch", type=int, default=None, help="figure 2 batch size (default 2048)")
    p.add_argument("--needle-ks", type=_ints, default=None, help="figure 3 k values, 0 = none (default 0..8)")
    p.add_argument("--needle-time-batch", type=int, default=None, help="figure 3 batch size (default 64)")
    p.add_argument("--megatron-preset", default=None, help="Megatron comparison preset (default gpt2-small)")
    p.add_argument("--megatron-layers", type=int, default=None, help="override its number of layers")
    p.add_argument("--megatron-batch", type=int, default=None, help="its batch size (default 8)")
    p.add_argument("--megatron-seq", type=int, default=None, help="its sequence length (default 1024)")
    p.add_argument("--maxbatch-budget-gib", type=float, default=None, help="max-batch memory budget (default 16)")
    p.add_argument("--maxbatch-seq", type=int, default=None, help="max-batch sequence length (default 1024)")
    p.add_argument("--time-preset", default=None, help="timing preset (default small)")
    p.add_argument("--time-batch", type=int, default=None, help="timing batch size (default 20)")
    p.add_argument("--time-steps", type=int, default=None, help="timed steps per policy, >= 5 (default 40)")
    p.add_argument("--time-rounds", type=int, default=None,
                   help="interleaved timing rounds, at most --time-steps (default 40: one step per round)")
    p.add_argument("--auto-budget-fractions", type=_floats, default=None,
                   help="auto part: budgets as fractions between full's and none's peak (default 0.1,0.3,0.5,0.7,0.9)")
    p.add_argument("--seed", type=int, default=0, help="parameter and data seed")
    p.add_argument("--remat-head-chunks", type=int, default=4,
                   help="memory parts: policies other than none also remat the head and loss in N chunks (0: blocks only)")
    return p


def parse_config(argv: Sequence[str] | None) -> BenchConfig:
    """Parse flags into a :class:`BenchConfig`.

    Raises:
      UsageError: on a bad flag or value, or a malformed / unknown explicitly given policy.
    """
    args = build_parser().parse_args(argv)
    values = vars(args)
    values["parts"] = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    register_baselines()
    if args.policy:
        for spec in args.policy:
            try:
                registry.normalize_spec(spec)  # nested included
            except ValueError as err:
                raise UsageError(f"bad --policy: {err}") from None
        values["policy"] = tuple(args.policy)
    else:
        values["policy"] = DEFAULT_POLICIES
    return BenchConfig(**values)


def usable_policies(specs: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``specs`` into those that resolve and notes about those that do not (skipped)."""
    ok, notes = [], []
    for spec in specs:
        try:
            registry.normalize_spec(spec)  # nested included
        except ValueError as err:
            notes.append(f"skipped policy {spec!r}: {err}")
            continue
        ok.append(spec)
    return ok, notes


def run(config: BenchConfig, command: str) -> tuple[list[dict], list[str], list[str]]:
    """Run the configured parts and write CSV, plots and summary into ``config.out``.

    Returns:
      ``(rows, plot file names, notes)``.
    """
    register_baselines()
    policies, notes = usable_policies(config.policy)
    for n in notes:
        print(f"note: {n}")
    try:
        os.makedirs(config.out, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create --out {config.out!r}: {err}") from None
    rows: list[dict] = []
    started = time.perf_counter()
    for part in config.parts:
        t0 = time.perf_counter()
        if part == "needle":
            rows += part_needle(config)
        elif part == "needle_time":
            rows += part_needle_time(config)
        elif part == "megatron":
            rows += part_megatron(config, policies)
        elif part == "maxbatch":
            rows += part_maxbatch(config, policies)
        elif part == "time":
            rows += part_time(config, policies)
        elif part == "auto":
            rows += part_auto(config, policies)
        _log(f"[{part}] done in {time.perf_counter() - t0:.0f} s")
        write_csv(rows, os.path.join(config.out, "bench.csv"))  # keep what is done if a later part fails
    plots = write_plots(rows, config.out)
    notes.append(f"total wall time of the run: {time.perf_counter() - started:.0f} s (compiles included)")
    with open(os.path.join(config.out, "summary.md"), "w") as f:
        f.write(summary_markdown(rows, plots, command, notes))
    return rows, plots, notes


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 on bad input, with a one-line error on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = parse_config(argv)
        command = "python -m train.bench" + "".join(" " + shlex.quote(a) for a in argv)
        rows, plots, _ = run(config, command)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    print(f"wrote {len(rows)} rows to {os.path.join(config.out, 'bench.csv')}, "
          f"{len(plots)} plots and summary.md")
    for target, measured, ok in check_targets(rows):
        print(f"  {'met   ' if ok else 'MISSED'} {target}: {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
