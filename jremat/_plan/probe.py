"""The fit search's probes: one candidate compiled for its figures, and the searches over batch
sizes and micro-batch counts that choose which candidates to compile (:mod:`jremat._plan.fit`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from jremat._measure.collectives import KINDS, RECOMPUTE, compiled_collectives_report
from jremat._measure.compile import cost_analysis, fast_analysis_compile, hlo_fingerprint
from jremat._measure.memory import compiled_memory_report
from jremat._measure.mesh import mesh_device_set
from jremat._plan.fit_types import FitError, FitProbe, FitStep, StepBuilder
from jremat._plan.time_model import _time_round
from jremat._program.flops import jaxpr_flops


def _as_fit_step(built, key) -> FitStep | None:
    if built is None or isinstance(built, FitStep):
        return built
    try:
        step, args = built
    except (TypeError, ValueError):
        raise FitError(
            f"the step builder returned {type(built).__name__} for {key}; expected a jremat.FitStep, "
            "a (jitted step, args) pair, or None"
        ) from None
    return FitStep(step, tuple(args))


def _collectives(compiled) -> tuple[tuple[tuple[str, int, int], ...], tuple[str, ...]]:
    """``(kind, count, bytes per device)`` per kind the step issues, and the kinds it issues in a recomputation."""
    report = compiled_collectives_report(compiled)
    counts = tuple((k, report.count(k), report.bytes(k)) for k in KINDS if report.count(k))
    return counts, tuple(k for k in KINDS if report.count(k, RECOMPUTE))


def _compile(fit_step: FitStep):
    """``(peak, flops, bytes accessed, fingerprint, devices, collectives)`` from a compile-only analysis.

    Nothing of the compile is kept: JAX caches an executable for as long as its lowering lives,
    and a search makes dozens (the step is lowered again to be run).
    """
    if not hasattr(fit_step.step, "lower"):
        raise FitError("the step builder's step has no .lower(): pass a jitted function (jax.jit, jremat.jit)")
    if hasattr(fit_step.step, "trace"):
        traced = fit_step.step.trace(*fit_step.args)
        flops, lowered = jaxpr_flops(traced.jaxpr), traced.lower()
    else:
        flops, lowered = 0.0, fit_step.step.lower(*fit_step.args)
    compiled = fast_analysis_compile(lowered)
    report = compiled_memory_report(compiled)
    if not report.available:
        raise FitError(f"this backend reports no compiled memory figures: {'; '.join(report.notes)}")
    assert report.peak_bytes is not None  # an available report has a peak
    cost = cost_analysis(compiled)
    devices = max(len(mesh_device_set(fit_step.args)), 1)
    xla_flops = float(cost.get("flops", 0.0))  # one device's share on a mesh
    xla_bytes = float(cost.get("bytes accessed", 0.0))
    if flops and xla_flops:
        # XLA counts a loop body once; the trace counts every iteration (of the whole, unpartitioned program)
        xla_bytes *= max(1.0, flops / devices / xla_flops)
    collectives, recomputed = _collectives(compiled) if devices > 1 else ((), ())
    return (
        int(report.peak_bytes),
        flops or xla_flops * devices,
        xla_bytes,
        hlo_fingerprint(compiled),
        devices,
        collectives,
        recomputed,
    )


def compile_figures(fit_step: FitStep) -> tuple[int, float, float, str, int, tuple]:
    """``(peak bytes, FLOPs, bytes accessed, HLO fingerprint, devices, collectives)`` of a step
    (as the fields of :class:`FitProbe`), compile-only, kept on the step: a builder that measured a step (e.g. a planner trying plans) and hands the search the
    same :class:`FitStep` object costs the search no second compile.

    Raises:
      FitError: the step has no ``.lower``, or the backend reports no compiled memory figures.
    """
    return _figures(fit_step)[:6]


def _figures(fit_step: FitStep) -> tuple:
    """:func:`compile_figures`, then the collective kinds the step issues in a recomputation."""
    figures = fit_step.__dict__.get("_figures")
    if figures is None:  # two threads on one step compile it twice, no worse
        figures = _compile(fit_step)
        object.__setattr__(fit_step, "_figures", figures)
    return figures


#: The batch search's second probe and its largest step up before a batch does not fit: a line
#: through small batches overshoots, and an overshoot costs one compile that brackets the
#: boundary, while each step short of it costs one that does not.
SEARCH_GROWTH = 16


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def largest_fitting(
    peak: Callable[[int], int | None],
    budget: int,
    *,
    limit: int,
    max_probes: int | None = None,
    tolerance: float = 0.0,
    growth: int = 4,
    second_probe: int = 2,
) -> tuple[int, bool]:
    """The largest ``n`` in ``1..limit`` with ``peak(n) <= budget``, in few calls of ``peak`` (each a compile).

    A compiled peak grows close to linearly in the batch, so each step probes where the line
    through the largest fitting ``n`` and the nearest probe crosses the budget (``second_probe``
    after 1), at
    most ``growth`` times the largest fitting ``n`` until one does not fit, then within the
    bracket; always at least ``max(1, floor(n * tolerance))`` above ``n``, and within the bracket
    every third step a bisection while the line does not close in. It ends when ``n`` fits and the smallest ``m`` known not to fit is at most that
    far above it (with ``tolerance=0``: ``n + 1`` does not fit), or at ``limit``.

    Args:
      peak: bytes at ``n``; ``None`` counts as not fitting.
      budget: the bytes allowed.
      limit: the largest ``n`` tried.
      max_probes: stop after this many calls of ``peak`` (``None``: no cap).
      tolerance: the fraction of ``n`` by which the answer may fall short of the largest fitting
        ``n`` (a few percent of batch is rarely worth another compile).
      growth: the largest factor between the largest fitting ``n`` and the next probe before one
        does not fit.
      second_probe: the probe after 1 (a compile costs about the same at any batch, and a line
        through 1 and a larger batch extrapolates better).

    Returns:
      ``(n, verified)``: ``n = 0`` if even 1 does not fit; ``verified`` is ``False`` when
      ``max_probes`` ran out before the boundary was found (``n`` fits and is a lower bound).

    Raises:
      ValueError: ``tolerance`` outside ``[0, 1)``, or ``growth`` or ``second_probe`` below 2.
    """
    if not 0.0 <= tolerance < 1.0 or growth < 2 or second_probe < 2:
        raise ValueError(
            f"tolerance must be in [0, 1), growth and second_probe at least 2, got {tolerance!r}, {growth!r}, "
            f"{second_probe!r}"
        )
    peaks: dict[int, float] = {}

    def fits(n):
        value = peak(n)
        peaks[n] = value if value is not None else budget + 1
        return peaks[n] <= budget

    if not fits(1):
        return 0, True
    lo, hi, line_steps = 1, None, 0
    while lo < limit and (hi is None or hi - lo > max(1, math.floor(lo * tolerance))):
        close = lo + max(1, math.floor(lo * tolerance))  # a probe there that does not fit ends the search
        if max_probes is not None and len(peaks) >= max_probes:
            return lo, False
        second = hi if hi is not None else max((n for n in peaks if n < lo), default=None)
        guess = None
        if second is not None and peaks[second] != peaks[lo]:
            slope = (peaks[second] - peaks[lo]) / (second - lo)
            guess = lo + int((budget - peaks[lo]) // slope) if slope > 0 else None
        if hi is None:  # capped: a line through small batches overshoots
            if guess is None:
                guess = second_probe if len(peaks) == 1 else 2 * lo
            else:
                guess = min(max(guess, close), growth * lo)
        elif guess is not None and guess <= close:  # the line puts the boundary within reach: check it
            guess = close
        elif guess is None or line_steps >= 2:  # the line is not closing in: bisect
            guess, line_steps = (lo + hi) // 2, 0
        else:
            guess, line_steps = min(max(guess, close), hi - 1), line_steps + 1
        guess = min(guess, limit)
        if fits(guess):
            lo = guess
        else:
            hi = guess
    return lo, True


class _Search:
    def __init__(self, build: StepBuilder, progress: Callable[[str], None] | None):
        self.build = build
        self.progress = progress or (lambda _msg: None)
        self.probes: dict[tuple[str, int, int], FitProbe] = {}
        self.steps: dict[tuple[str, int, int], FitStep] = {}
        self.order: list[tuple[str, int, int]] = []
        self.executables: dict[tuple[str, int, int], Any] = {}
        self.devices: tuple = ()  # the mesh's devices, once a step on several was compiled

    def probe(self, policy: str, batch_size: int, micro_batches: int) -> FitProbe:
        key = (policy, batch_size, micro_batches)
        if key not in self.probes:
            self.progress(f"compile {policy} batch {batch_size} x {micro_batches}")
            fit_step = _as_fit_step(self.build(policy, batch_size, micro_batches), key)
            if fit_step is None:
                self.probes[key] = FitProbe(policy, batch_size, micro_batches, None)
            else:
                peak, flops, nbytes, fingerprint, devices, collectives, recomputed = _figures(fit_step)
                program = fit_step.program if fit_step.program is not None else policy
                self.probes[key] = FitProbe(
                    policy,
                    batch_size,
                    micro_batches,
                    peak,
                    flops,
                    nbytes,
                    fingerprint,
                    program,
                    devices,
                    collectives,
                    recomputed,
                )
                self.steps[key] = fit_step
                if devices > 1 and not self.devices:
                    self.devices = mesh_device_set(fit_step.args)
        if key not in self.order:
            self.order.append(key)
        return self.probes[key]

    def time(self, keys, rounds: int, calls_per_round: int, tokens_per_example: int) -> dict[tuple, list[float]]:
        """Tokens/s of each probed key per round, in interleaved rounds (A, B, C, A, B, C, ...)."""
        out: dict[tuple, list[float]] = {k: [] for k in keys}
        for r in range(rounds):
            for key in keys:
                self.progress(f"time {key[0]} batch {key[1]} x {key[2]} (round {r + 1}/{rounds})")
                fit_step = self.steps[key]
                if key not in self.executables:
                    self.progress(f"compile {key[0]} batch {key[1]} x {key[2]} to run")
                    step: Any = fit_step.step  # its .lower was checked when it was compiled for its figures
                    self.executables[key] = step.lower(*fit_step.args).compile()
                compiled = self.executables[key]
                calls = -(-calls_per_round // key[2]) * key[2]  # whole optimizer steps
                seconds = _time_round(compiled, fit_step, calls)
                out[key].append(calls * key[1] * tokens_per_example / seconds)
        return out

    def largest_batch(self, policy: str, budget: int, max_batch_size: int, tolerance: float) -> FitProbe | None:
        """The probe of the largest batch whose peak fits (:func:`largest_fitting`, to within
        ``tolerance``), or ``None``."""
        batch, _ = largest_fitting(
            lambda b: self.probe(policy, b, 1).peak_bytes,
            budget,
            limit=max_batch_size,
            tolerance=tolerance,
            growth=SEARCH_GROWTH,
            second_probe=SEARCH_GROWTH,
        )
        return self.probes[(policy, batch, 1)] if batch else None

    def fewest_micro_batches(self, policy: str, budget: int, global_batch: int) -> FitProbe | None:
        """The probe of the fewest micro-batches (among the divisors of the global batch) that fits."""
        divisors = _divisors(global_batch)

        def fits(i):
            m = divisors[i]
            peak = self.probe(policy, global_batch // m, m).peak_bytes
            return peak is not None and peak <= budget

        lo, hi, i = None, 0, 0  # lo: largest index known not to fit; hi: an index that fits
        while True:
            if fits(i):
                hi = i
                break
            lo = i
            if i == len(divisors) - 1:
                return None
            nxt = next((j for j, d in enumerate(divisors) if d >= 2 * divisors[i]), len(divisors) - 1)
            i = nxt
        if lo is not None:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    hi = mid
                else:
                    lo = mid
        m = divisors[hi]
        return self.probes[(policy, global_batch // m, m)]
