"""How the bench measures: one Adam train step per program, compiled once and timed in paired rounds.

A :class:`Program` is anything that builds a jitted Adam step ``step(params, opt_state, tokens,
targets, key) -> (params, opt_state, loss)`` with its abstract arguments and concrete initial
state. :func:`measure` compiles each program (timing the trace + lower + compile a user pays on
every start), reads XLA's buffer assignment and ``cost_analysis()`` FLOPs from the compiled step,
and optionally times the programs in interleaved rounds; :func:`time_ratios` turns the rounds
into medians and quartiles of paired per-round ratios.

Memory is compile-only (nothing is allocated for it). Times are compared as ratios between
programs measured in the same process; each program's median step time also gives the absolute
figures (tokens/s, model TFLOP/s, MFU: :mod:`train.bench.flops`).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jremat import MemoryReport, compiled_memory_report, jaxpr_flops
from jremat.diagnosis import PEAK_FROM_SUM, cost_analysis, hlo_fingerprint
from jremat.models import GPT, ModelConfig
from jremat.train.programs import adam_train_step
from jremat.train.step import make_train_step

GIB = 2**30
MIB = 2**20


def log(message: str) -> None:
    """Progress on stderr (the CSV and the report carry the results)."""
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Program:
    """One Adam train step to measure.

    Attributes:
      label: the row label.
      build: ``() -> (step, abstract_args)``; ``step`` is jitted and lowers on ``abstract_args``.
      init: ``(seed) -> (params, opt_state)``, the concrete state to time with.
      vocab_size: token range of the random batch.
      batch_size: sequences per batch.
      seq_len: tokens per sequence.
    """

    label: str
    build: Callable[[], tuple[Any, tuple]]
    init: Callable[[int], tuple[Any, Any]]
    vocab_size: int
    batch_size: int
    seq_len: int


def gpt_program(label: str, cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> Program:
    """The :class:`Program` of ``GPT(cfg)``'s Adam step (:func:`train.programs.adam_train_step`)."""
    seq_len = cfg.max_seq_len if seq_len is None else seq_len

    def build():
        _, graphdef, tx, args = adam_train_step(cfg, batch_size, seq_len)
        return make_train_step(graphdef, tx), args

    def init(seed):
        _, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(seed)))
        return params, optax.adam(1e-3).init(params)

    return Program(label, build, init, cfg.vocab_size, batch_size, seq_len)


@dataclasses.dataclass
class Measured:
    """What :func:`measure` found for one program.

    Attributes:
      memory: the compiled step's memory report.
      flops: FLOPs of the traced step (:func:`jremat.program_flops`: scan bodies times
        their length, recomputation included).
      xla_flops: ``compiled.cost_analysis()["flops"]`` (0.0 when the backend gives none); XLA
        counts a loop body once, so with scanned layers or a chunked head it undercounts.
      compile_s: seconds of trace + lower + compile.
      rounds: per interleaved round, the step seconds (empty when not timed).
      hlo_fingerprint: :func:`hlo_fingerprint` of the compiled step: equal for two programs
        that compile to the same optimized HLO ("" when not compiled here).
    """

    memory: MemoryReport
    flops: float
    xla_flops: float
    compile_s: float
    rounds: list[list[float]] = dataclasses.field(default_factory=list)
    hlo_fingerprint: str = ""

    @property
    def step_s(self) -> float | None:
        """The median of every timed step, in seconds (``None`` when not timed)."""
        steps = [t for block in self.rounds for t in block]
        return statistics.median(steps) if steps else None


def compiled_flops(compiled) -> float:
    """FLOPs XLA's cost analysis gives for a compiled program (0.0 if it gives none)."""
    return float(cost_analysis(compiled).get("flops", 0.0))


def bench_peak(report: MemoryReport) -> int:
    """The peak the bench reports: ``argument + output - alias + temp`` on XLA:CPU, else the report's.

    XLA:CPU's ``peak_memory_in_bytes`` counts arguments and outputs only, so the sum is used on
    CPU for every program alike so that rows compare.
    """
    return report.summed_peak_bytes if report.platform == "cpu" else report.peak_bytes


def memory_fields(report: MemoryReport) -> dict:
    """The CSV memory columns of one report."""
    source = PEAK_FROM_SUM if report.platform == "cpu" else report.peak_source
    return dict(
        peak_bytes=bench_peak(report),
        temp_bytes=report.temp_bytes,
        argument_bytes=report.argument_bytes,
        output_bytes=report.output_bytes,
        alias_bytes=report.alias_bytes,
        peak_source=source,
    )


def compile_program(program: Program):
    """``(compiled, Measured without rounds)``: trace, lower and compile ``program``, timed."""
    t0 = time.perf_counter()
    step, args = program.build()
    traced = step.trace(*args)
    compiled = traced.lower().compile()
    compile_s = time.perf_counter() - t0
    report = compiled_memory_report(compiled)
    if not report.available:
        raise RuntimeError("; ".join(report.notes))
    flops = jaxpr_flops(traced.jaxpr)
    return compiled, Measured(
        report, flops, compiled_flops(compiled), compile_s, hlo_fingerprint=hlo_fingerprint(compiled)
    )


_MEMORY_CACHE: dict = {}


def step_memory(cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> Measured:
    """Compile-only :class:`Measured` of ``GPT(cfg)``'s Adam step (cached per config and shape)."""
    key = (cfg, batch_size, seq_len)
    if key not in _MEMORY_CACHE:
        _MEMORY_CACHE[key] = compile_program(gpt_program("", cfg, batch_size, seq_len))[1]
    return _MEMORY_CACHE[key]


def measure(programs: list[Program], *, steps: int = 0, rounds: int = 1, seed: int = 0) -> dict[str, Measured]:
    """Compile every program and, with ``steps > 0``, time them interleaved (A, B, C, A, B, C, ...).

    Each program is compiled, run once (warm-up, not timed), then ``steps`` timed steps are
    made in ``rounds`` interleaved blocks on the same random tokens, so machine load affects
    all alike.
    """
    out, runners = {}, {}
    for program in programs:
        compiled, measured = compile_program(program)
        out[program.label] = measured
        log(
            f"  {program.label}: compiled in {measured.compile_s:.1f} s, peak {bench_peak(measured.memory) / MIB:.1f} MiB"
        )
        if steps <= 0:
            continue
        params, opt_state = program.init(seed)
        tokens = jax.random.randint(
            jax.random.key(seed + 1), (program.batch_size, program.seq_len), 0, program.vocab_size
        )
        targets = jnp.roll(tokens, -1, axis=1)
        params, opt_state, loss = compiled(params, opt_state, tokens, targets, jax.random.key(seed))
        jax.block_until_ready(loss)
        runners[program.label] = [compiled, params, opt_state, tokens, targets]
    per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)] if steps > 0 else []
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
            out[label].rounds.append(block)
    return out


def time_ratios(times: dict[str, list[list[float]]], baseline: str) -> dict[str, tuple[float, float, float]]:
    """``(ratio, low, high)`` of each label's step time to ``baseline``'s, from paired rounds.

    Each interleaved round gives one paired ratio (the label's median step in that round over the
    baseline's in the same round), so drift in machine load cancels within the pair. The ratio is
    the median of the paired ratios; ``low`` and ``high`` are their lower and upper quartiles (a
    spread, not a bound; all three are equal with a single round).
    """
    out = {}
    for label, rounds in times.items():
        paired = [statistics.median(b) / statistics.median(bb) for b, bb in zip(rounds, times[baseline]) if b and bb]
        low, _, high = statistics.quantiles(paired, n=4, method="inclusive") if len(paired) > 1 else paired * 3
        out[label] = (statistics.median(paired), low, high)
    return out


def measured_ratios(measured: dict[str, Measured], baseline: str) -> dict[str, tuple[float, float, float]]:
    """:func:`time_ratios` of :func:`measure`'s timed results."""
    return time_ratios({label: m.rounds for label, m in measured.items()}, baseline)
