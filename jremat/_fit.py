"""Throughput at a memory budget: the (policy, batch) that trains fastest in a device's memory.

:func:`fit_search` takes a step builder ``build(policy, batch_size, micro_batches)`` for any
model and searches, per policy, the largest batch (or the fewest micro-batches of a fixed
global batch) whose compiled peak fits the budget, compile-only. The batch search follows the
line through its probes (a compiled peak grows close to linearly in the batch): batch 1, then 16,
then where the line crosses the budget (at most 16 times the largest fitting batch), a bisection
every third step while the line does not close in, and it stops when the largest fitting batch
is known to within ``batch_tolerance``. Candidates that are one program at several batches count
once (the largest batch), as do labels that compile to the same program. A time model (FLOPs and
bytes over two device rates measured once, and on a mesh each collective's bytes over its rate
measured once on the mesh) ranks the candidates; the best few are run on the
device in interleaved rounds. The fastest measured wins, unless others are within the noise of
its rounds: then a fixed rule chooses among them (fewer FLOPs per example, then the larger batch,
then the time model's order), and the result says so.

Every figure in the decision but the finalists' measured times is deterministic: compiled
peaks, traced FLOPs, XLA's byte counts and the time model's rates, which are rounded to powers of
two, so hosts of one kind rank the same candidates.

On a mesh (a step whose arguments are sharded over several devices) every figure is per device:
the compiled peak of an SPMD program is one device's, so the budget is a device's memory; FLOPs
are the traced (global) FLOPs over the device count; the collectives the compiled program issues
(:func:`jremat.collectives_report`) are priced at seconds per byte measured on the mesh
(:func:`jremat.collective_s_per_byte`), so a policy that gathers weights again in the backward
pass is predicted slower than one that keeps them; and when the steps all-gather (FSDP), the
``keep_gathered=true`` variant of every policy spec that takes the key (:func:`keep_gathered_variants`)
is a candidate too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jremat import registry
from jremat._budget import Budget, as_budget
from jremat._collectives import KINDS, TIMED_KINDS, collective_s_per_byte, compiled_collectives_report
from jremat._compile import cost_analysis, fast_analysis_compile, hlo_fingerprint
from jremat._flops import jaxpr_flops
from jremat._memory import compiled_memory_report, format_bytes

#: ``build(policy, batch_size, micro_batches)`` -> a :class:`FitStep`, a ``(step, args)`` pair,
#: or ``None`` when ``policy`` has no program at that batch.
StepBuilder = Callable[[str, int, int], Any]


class FitError(ValueError):
    """Nothing fits the budget, or a budget or builder the search cannot use."""


@dataclasses.dataclass(frozen=True)
class FitStep:
    """One train step the search compiles and times.

    Attributes:
      step: a jitted function (``jax.jit``, :func:`jremat.jit`): it must have ``lower``.
      args: its arguments: arrays, or :class:`jax.ShapeDtypeStruct` (filled with zeros when
        timed; a PRNG key with the default implementation's ``key(0)``).
      carry: argument positions fed back from the outputs at the same positions between timed
        calls, e.g. ``(0, 1)`` for ``(params, opt_state, batch...) -> (params, opt_state, loss)``;
        needed when the step donates those arguments.
      program: what the step computes apart from its batch (default: the policy label). Fitting
        candidates with one program and micro-batch count are one candidate, the largest batch:
        e.g. a planner's plan, the same at batches 107 and 108, is timed once.
    """

    step: Callable
    args: tuple
    carry: tuple[int, ...] = ()
    program: str | None = None


@dataclasses.dataclass(frozen=True)
class TimeModel:
    """Predicted step seconds ``flops / flops_per_s + bytes / bytes_per_s``, plus on a mesh each
    collective's bytes times its seconds per byte (rates are powers of two).

    Attributes:
      flops_per_s: one device's matmul FLOP rate.
      bytes_per_s: one device's copy bandwidth.
      collective_s_per_byte: ``((kind, seconds per byte per device), ...)`` measured on the mesh
        (:func:`jremat.collective_s_per_byte`); a kind not listed is priced as an all-gather.
        ``()``: no mesh.
    """

    flops_per_s: float
    bytes_per_s: float
    collective_s_per_byte: tuple[tuple[str, float], ...] = ()

    def collective_s(self, collectives: Sequence[tuple[str, int, int]]) -> float:
        """Predicted seconds of ``(kind, count, bytes per device)`` collectives (:attr:`FitProbe.collectives`).

        Raises:
          FitError: collectives to price and no rate for them (a model without ``collective_s_per_byte``).
        """
        total = sum(b for _, _, b in collectives)
        if not total:
            return 0.0
        rates = dict(self.collective_s_per_byte)
        if not rates:
            raise FitError("the time model has no collective rates (collective_s_per_byte) to price a mesh's step")
        fallback = rates.get("all-gather", max(rates.values()))
        return sum(b * rates.get(kind, fallback) for kind, _, b in collectives)

    def step_s(self, flops: float, bytes_accessed: float, collectives: Sequence[tuple[str, int, int]] = ()) -> float:
        """The predicted seconds of a step with these FLOPs and bytes moved (per device), and
        these collectives (:meth:`collective_s`)."""
        return flops / self.flops_per_s + bytes_accessed / self.bytes_per_s + self.collective_s(collectives)

    def probe_s(self, probe: FitProbe) -> float:
        """The predicted seconds of one call of a probe's step, per device (FLOPs over its devices)."""
        return self.step_s(probe.flops / probe.devices, probe.bytes_accessed, probe.collectives)


@dataclasses.dataclass(frozen=True)
class FitProbe:
    """One compiled (policy, batch, micro-batches): what the search knows of it.

    Attributes:
      policy: the policy label given to the builder.
      batch_size: sequences (examples) per micro-batch.
      micro_batches: micro-batches per optimizer step (1 without a global batch).
      peak_bytes: the compiled peak (:func:`jremat.compiled_memory_report`); ``None`` when the
        builder had no program for it.
      flops: traced FLOPs of one call (scan bodies times their length, recompute included).
      bytes_accessed: XLA's bytes accessed, scaled by ``flops / XLA's FLOPs`` where XLA counts a
        loop body once.
      fingerprint: the optimized HLO's hash (:func:`jremat._compile.hlo_fingerprint`): two labels
        with the same one are the same program, and only the first is a candidate.
      program: :attr:`FitStep.program`, or the policy label.
      devices: the devices the step's arguments span (1: no mesh); :attr:`peak_bytes` and
        :attr:`bytes_accessed` are one device's, :attr:`flops` the whole program's.
      collectives: ``(kind, count, bytes per device)`` per collective kind the compiled step issues
        per call (:func:`jremat.collectives_report`); ``()`` on one device.
    """

    policy: str
    batch_size: int
    micro_batches: int
    peak_bytes: int | None
    flops: float = 0.0
    bytes_accessed: float = 0.0
    fingerprint: str = ""
    program: str = ""
    devices: int = 1
    collectives: tuple[tuple[str, int, int], ...] = ()

    @property
    def collective_bytes(self) -> int:
        """Bytes per device of every collective of one call."""
        return sum(b for _, _, b in self.collectives)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.policy, self.batch_size, self.micro_batches)

    @property
    def flops_per_example(self) -> float:
        """Traced FLOPs of one call per example: the recompute a policy adds, and the optimizer's share."""
        return self.flops / self.batch_size


@dataclasses.dataclass(frozen=True)
class FitRow:
    """One fitting candidate of a budget.

    Attributes:
      probe: its compile.
      predicted_tokens_per_s: from the :class:`TimeModel`.
      finalist: whether it was timed for this budget.
      tokens_per_s: measured (median over rounds), ``None`` if not a finalist.
      rounds_tokens_per_s: the measured tokens/s of each round.
      origin: ``"search"`` (a policy's largest fitting batch, or fewest micro-batches),
        ``"plan"`` (from ``plans``) or ``"smaller budget"`` (a finalist of a smaller budget of the
        same search, kept so that throughput never falls as the budget grows, beyond the tie rule's noise).
    """

    probe: FitProbe
    predicted_tokens_per_s: float
    finalist: bool
    tokens_per_s: float | None = None
    rounds_tokens_per_s: tuple[float, ...] = ()
    origin: str = "search"


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What :func:`fit_search` chose for one budget.

    Attributes:
      budget_bytes: the budget.
      global_batch: the fixed global batch, or ``None`` (the batch was chosen).
      tokens_per_example: tokens of one example (1: rates are examples/s).
      rows: every fitting candidate, fastest first (measured, then predicted).
      winner: the fastest measured finalist, or, when others are within the noise of its rounds,
        the one :data:`TIE_RULE` picks among them (see ``within_noise``).
      margin: ``(low, high)`` quartiles of the per-round ratio of the runner-up's tokens/s to the
        winner's (``None`` with one finalist): how close the decision was. The runner-up is the
        fastest other finalist; above 1.0 when the tie rule chose a winner measured slower.
      time_model: the model that chose the finalists.
      digest: 12 hex digits over the probes, finalists and winner (equal inputs and times, equal digest).
      search_s: wall seconds of the whole search (shared by the budgets of one search).
      probes: every compile the search made for this budget (by policy, batch, micro-batches).
      within_noise: the keys of the finalists within the noise of the fastest (it among them),
        in the time model's order, when there are two or more: the tie rule chose among them;
        ``()`` when the fastest won outright.
    """

    budget_bytes: int
    global_batch: int | None
    tokens_per_example: int
    rows: tuple[FitRow, ...]
    winner: FitRow
    margin: tuple[float, float] | None
    time_model: TimeModel
    digest: str
    search_s: float
    probes: tuple[FitProbe, ...]
    within_noise: tuple[tuple[str, int, int], ...] = ()

    @property
    def decision(self) -> str:
        """How the winner was chosen, in one line."""
        w = self.winner.probe
        if not self.within_noise:
            return f"fastest measured: {w.policy} batch {w.batch_size} x {w.micro_batches}"
        tied = ", ".join(f"{p} batch {b} x {m}" for p, b, m in self.within_noise)
        return f"within noise ({tied}): chose {w.policy} batch {w.batch_size} x {w.micro_batches} by {TIE_RULE}"

    def table(self) -> str:
        """Policy, batch, micro-batches, compiled peak, tokens/s and ratio to the best, one line each."""
        unit = "tokens/s" if self.tokens_per_example > 1 else "examples/s"
        best = self.winner.tokens_per_s
        devices = max(r.probe.devices for r in self.rows)
        mesh = devices > 1
        lines = [
            f"fit for budget {format_bytes(self.budget_bytes)} ({self.budget_bytes:,} B)"
            + (" per device" if mesh else "")
            + (f", global batch {self.global_batch}" if self.global_batch else "")
            + f": {len(self.probes)} probes compiled, {sum(r.finalist for r in self.rows)} timed, "
            f"search {self.search_s:.1f} s, digest {self.digest}",
            f"  {'policy':<44} {'batch':>6} {'micro':>6} {'peak/device' if mesh else 'peak':>11} "
            + (f"{'comm/device':>11} " if mesh else "")
            + f"{'predicted ' + unit:>22} {'measured ' + unit:>22} {'ratio':>7}",
        ]
        for r in self.rows:
            p = r.probe
            measured = f"{r.tokens_per_s:,.1f}" if r.tokens_per_s is not None else "-"
            ratio = f"{r.tokens_per_s / best:.3f}" if r.tokens_per_s is not None else "-"
            mark = (" <- winner" if r is self.winner else "") + (f" ({r.origin})" if r.origin != "search" else "")
            lines.append(
                f"  {p.policy:<44} {p.batch_size:>6} {p.micro_batches:>6} {format_bytes(p.peak_bytes):>11} "
                + (f"{format_bytes(p.collective_bytes):>11} " if mesh else "")
                + f"{r.predicted_tokens_per_s:>22,.1f} {measured:>22} {ratio:>7}{mark}"
            )
        if self.margin is not None:
            lines.append(
                f"  runner-up / winner per round: {self.margin[0]:.3f}..{self.margin[1]:.3f} (quartiles); "
                "a range that holds 1.0 means the two are within the machine's noise"
            )
        if mesh:
            lines.append(
                f"  on a mesh of {devices} devices: peaks and the budget are per device (a compiled SPMD program's "
                "peak is one device's); comm/device = bytes of the collectives one call issues per device, priced "
                "in the prediction at the time model's rates per collective kind (measured on the mesh)"
            )
        lines.append(f"  {self.decision}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The result as JSON values (rows with their probe fields, and every probe compiled)."""
        return {
            "budget_bytes": self.budget_bytes,
            "global_batch": self.global_batch,
            "tokens_per_example": self.tokens_per_example,
            "digest": self.digest,
            "search_s": self.search_s,
            "compiles": len(self.probes),
            "time_model": dataclasses.asdict(self.time_model),
            "margin": list(self.margin) if self.margin else None,
            "within_noise": [list(k) for k in self.within_noise],
            "decision": self.decision,
            "winner": _row_json(self.winner, self.winner),
            "rows": [_row_json(r, self.winner) for r in self.rows],
            "probes": [dataclasses.asdict(p) for p in self.probes],
        }


def _row_json(row: FitRow, winner: FitRow) -> dict:
    out = dataclasses.asdict(row.probe)
    out.update(
        predicted_tokens_per_s=row.predicted_tokens_per_s,
        finalist=row.finalist,
        origin=row.origin,
        tokens_per_s=row.tokens_per_s,
        rounds_tokens_per_s=list(row.rounds_tokens_per_s),
        ratio_to_best=row.tokens_per_s / winner.tokens_per_s if row.tokens_per_s is not None else None,
    )
    return out


# ---------------------------------------------------------------------------------------------
# The time model
# ---------------------------------------------------------------------------------------------


def _power_of_two(x: float) -> float:
    return 2.0 ** round(math.log2(max(x, 1e-30)))


def _best_time_s(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def calibrate_time_model(dtype: str = "float32", devices: Sequence | None = None) -> TimeModel:
    """Measure this device's matmul FLOP rate in ``dtype`` and its copy bandwidth, rounded to powers of two;
    with two or more ``devices``, also each timed collective kind's seconds per byte across them
    (:func:`with_collective_rates`).

    The rounding makes machines of one kind agree on the model (the finalists it picks) unless a
    rate sits near a power of two.
    """
    accelerator = jax.default_backend() != "cpu"
    n = 4096 if accelerator else 1024
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x: x @ x)
    flops_per_s = 2 * n**3 / _best_time_s(matmul, a)
    x = jnp.ones((64 * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda v: v * 2.0)
    bytes_per_s = 2 * x.nbytes / _best_time_s(copy, x)
    model = TimeModel(_power_of_two(flops_per_s), _power_of_two(bytes_per_s))
    return with_collective_rates(model, devices) if devices is not None and len(devices) > 1 else model


def with_collective_rates(model: TimeModel, devices: Sequence) -> TimeModel:
    """``model`` with the seconds per byte of each timed collective kind across ``devices``
    (:func:`jremat.collective_s_per_byte`: measured once per mesh and cached), rounded to powers of two.

    Raises:
      ValueError: fewer than two devices.
    """
    rates = tuple((kind, _power_of_two(collective_s_per_byte(kind, devices))) for kind in TIMED_KINDS)
    return dataclasses.replace(model, collective_s_per_byte=rates)


def keep_gathered_variants(policies: Sequence[str]) -> list[str]:
    """The ``keep_gathered=true`` variant of each policy spec that takes the key and does not set it.

    Those are the registered policies of one function (:data:`jremat.registry.KEEP_GATHERED`), but
    ``none`` (it keeps everything already) and ``auto`` (its plans choose it per layer); labels that
    are not policy specs have none.
    """
    out = []
    for label in policies:
        try:
            name, values = registry.parse_spec(label)
            entry = registry.entries().get(name)
            if entry is None or entry.stack or name in ("none", "auto") or registry.KEEP_GATHERED in values:
                continue
            variant = registry.normalize_spec(label, **{registry.KEEP_GATHERED: True})
        except ValueError:
            continue
        if variant not in policies and variant not in out:
            out.append(variant)
    return out


# ---------------------------------------------------------------------------------------------
# Compiling and timing one candidate
# ---------------------------------------------------------------------------------------------


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


def _devices(tree) -> tuple:
    """The devices the shardings of ``tree``'s leaves span, by id (``()``: none sharded)."""
    found = set()
    for leaf in jax.tree.leaves(tree):
        found |= set(getattr(getattr(leaf, "sharding", None), "device_set", ()))
    return tuple(sorted(found, key=lambda d: d.id))


def _collectives(compiled) -> tuple[tuple[str, int, int], ...]:
    report = compiled_collectives_report(compiled)
    return tuple((k, report.count(k), report.bytes(k)) for k in KINDS if report.count(k))


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
    cost = cost_analysis(compiled)
    devices = max(len(_devices(fit_step.args)), 1)
    xla_flops = float(cost.get("flops", 0.0))  # one device's share on a mesh
    xla_bytes = float(cost.get("bytes accessed", 0.0))
    if flops and xla_flops:
        # XLA counts a loop body once; the trace counts every iteration (of the whole, unpartitioned program)
        xla_bytes *= max(1.0, flops / devices / xla_flops)
    collectives = _collectives(compiled) if devices > 1 else ()
    return (
        int(report.peak_bytes),
        flops or xla_flops * devices,
        xla_bytes,
        hlo_fingerprint(compiled),
        devices,
        collectives,
    )


def compile_figures(fit_step: FitStep) -> tuple[int, float, float, str, int, tuple]:
    """``(peak bytes, FLOPs, bytes accessed, HLO fingerprint, devices, collectives)`` of a step
    (as the fields of :class:`FitProbe`), compile-only, kept on the step: a builder that measured a step (e.g. a planner trying plans) and hands the search the
    same :class:`FitStep` object costs the search no second compile.

    Raises:
      FitError: the step has no ``.lower``, or the backend reports no compiled memory figures.
    """
    figures = fit_step.__dict__.get("_figures")
    if figures is None:  # two threads on one step compile it twice, no worse
        figures = _compile(fit_step)
        object.__setattr__(fit_step, "_figures", figures)
    return figures


def _filled(leaf):
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf.copy() if isinstance(leaf, jax.Array) else leaf
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        key = jax.random.key(0)
        if key.dtype != leaf.dtype:
            raise FitError(
                f"cannot make a PRNG key of dtype {leaf.dtype} for timing; give the step builder concrete keys"
            )
        value = jnp.broadcast_to(key, leaf.shape)
    else:
        value = jnp.zeros(leaf.shape, leaf.dtype)
    sharding = getattr(leaf, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else value


def _time_round(compiled, fit_step: FitStep, calls: int) -> float:
    """Seconds of ``calls`` calls after one untimed call, on fresh arguments (freed afterwards)."""
    args = list(jax.tree.map(_filled, fit_step.args, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)))

    def call():
        out = compiled(*args)
        for i in fit_step.carry:
            args[i] = out[i]
        return out

    jax.block_until_ready(call())
    t0 = time.perf_counter()
    for _ in range(calls):
        out = call()
    jax.block_until_ready(out)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------

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
                peak, flops, nbytes, fingerprint, devices, collectives = compile_figures(fit_step)
                program = fit_step.program if fit_step.program is not None else policy
                self.probes[key] = FitProbe(
                    policy, batch_size, micro_batches, peak, flops, nbytes, fingerprint, program, devices, collectives
                )
                self.steps[key] = fit_step
                if devices > 1 and not self.devices:
                    self.devices = _devices(fit_step.args)
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
                    self.executables[key] = fit_step.step.lower(*fit_step.args).compile()
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


def _digest(budget: int, global_batch, probes, finalists, winner: FitProbe) -> str:
    # The time model's rates are left out: on a busy host they can move by a power of two between
    # runs without changing the finalists, and the digest names the decision, not its inputs.
    record = {
        "budget": budget,
        "global_batch": global_batch,
        "probes": sorted([p.policy, p.batch_size, p.micro_batches, p.peak_bytes] for p in probes),
        "finalists": [list(k) for k in finalists],
        "winner": list(winner.key),
    }
    return hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]


def _nothing_fits(budget: int, probes, global_batch) -> FitError:
    tried = [p for p in probes if p.peak_bytes is not None]
    if not tried:
        return FitError(f"the step builder gave no program to compile for the budget {format_bytes(budget)}")
    small = min(tried, key=lambda p: (p.peak_bytes, p.policy))
    return FitError(
        f"nothing fits the budget {format_bytes(budget)} ({budget:,} B): the smallest compiled peak is "
        f"{format_bytes(small.peak_bytes)} ({small.peak_bytes:,} B), policy {small.policy!r} at batch "
        f"{small.batch_size}" + (f" x {small.micro_batches} micro-batches" if global_batch else "")
    )


def _resolve_budgets(budgets) -> list[int]:
    single = isinstance(budgets, (str, int, Budget))
    out = []
    for b in [budgets] if single else list(budgets):
        parsed = Budget(int(b), None, str(b)) if isinstance(b, int) else as_budget(b)
        if parsed.bytes is None:
            raise FitError(
                f"memory budget {parsed.text!r}: the fit search needs a size (12GiB, 512MiB or bytes), "
                "not a fraction (there is no single no-remat peak when the batch is chosen)"
            )
        out.append(parsed.bytes)
    if not out:
        raise FitError("give at least one memory budget")
    return out


def _one_per_program(probes: Sequence[FitProbe]) -> list[FitProbe]:
    """One probe per (program, micro-batches): the largest batch (the first listed among equals),
    in the order of each program's first probe."""
    best: dict[tuple[str, int], FitProbe] = {}
    for p in probes:
        group = (p.program or p.policy, p.micro_batches)
        if group not in best or p.batch_size > best[group].batch_size:
            best[group] = p
    return list(best.values())


#: The rule that decides among finalists within the noise of the fastest, in words.
TIE_RULE = "fewer FLOPs per example (less recompute), then the larger batch, then the better predicted"


def _decide(picked: Sequence[tuple], rounds_tps: dict, probes: dict, noise_tolerance: float) -> tuple[tuple, tuple]:
    """``(winner key, keys within noise of the fastest)``: the fastest median, or by :data:`TIE_RULE`
    among the finalists whose per-round ratio to the fastest has an upper quartile of at least
    ``1 - noise_tolerance`` (``picked`` is in the time model's order)."""
    fastest = min(picked, key=lambda k: (-statistics.median(rounds_tps[k]), picked.index(k)))
    tied = [fastest]
    for key in picked:
        if key != fastest:
            ratios = [a / b for a, b in zip(rounds_tps[key], rounds_tps[fastest])]
            if _quartiles(ratios)[1] >= 1.0 - noise_tolerance:
                tied.append(key)
    if len(tied) == 1:
        return fastest, ()
    winner = min(
        tied,
        key=lambda k: (probes[k].flops_per_example, -probes[k].batch_size * probes[k].micro_batches, picked.index(k)),
    )
    return winner, tuple(k for k in picked if k in tied)


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) == 1:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, high


def fit_search_budgets(
    build: StepBuilder,
    policies: Sequence[str],
    budgets: Sequence[str | int | Budget],
    *,
    plans: Callable[[int, Sequence[FitProbe]], Sequence[tuple[str, int, int]]] | None = None,
    global_batch: int | None = None,
    tokens_per_example: int = 1,
    max_batch_size: int = 4096,
    finalists: int = 3,
    rounds: int = 3,
    calls_per_round: int = 3,
    time_model: TimeModel | None = None,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
    workers: int | None = None,
    batch_tolerance: float = 0.03,
    noise_tolerance: float = 0.03,
    keep_gathered: bool | None = None,
) -> list[FitResult]:
    """:func:`fit_search` for several budgets at once, smallest first, timed in one session.

    Each budget's finalists include the smaller budgets' finalists (they fit a larger budget
    too, and are kept at their own batch even where the same program fits a larger one), and
    all finalists are timed in the same interleaved rounds, so the winner's measured throughput
    falls as the budget grows by no more than the noise the tie rule allows. Arguments as
    :func:`fit_search`; returns one :class:`FitResult` per budget, in the order given.
    """
    if finalists < 1 or rounds < 1 or calls_per_round < 1:
        raise FitError(
            f"finalists, rounds and calls_per_round must be at least 1, got {finalists}, {rounds}, {calls_per_round}"
        )
    if global_batch is not None and (not isinstance(global_batch, int) or global_batch < 1):
        raise FitError(f"global batch must be a positive whole number, got {global_batch!r}")
    if not policies:
        raise FitError("give at least one policy to search")
    for name, value in (("batch_tolerance", batch_tolerance), ("noise_tolerance", noise_tolerance)):
        if not 0.0 <= value < 1.0:
            raise FitError(f"{name} must be a fraction in [0, 1), got {value!r}")
    t0 = time.perf_counter()
    workers = workers or os.cpu_count() or 1
    budget_list = _resolve_budgets(budgets)
    search = _Search(build, progress)
    models = [time_model]

    def model() -> TimeModel:
        # Calibrated once the first probes are compiled: on a mesh, the collectives are priced on its devices.
        if models[-1] is None:
            search.progress("calibrate the time model")
            models.append(calibrate_time_model(dtype))
        if search.devices and not models[-1].collective_s_per_byte:
            search.progress("measure the collectives' rates on the mesh")
            models.append(with_collective_rates(models[-1], search.devices))
        return models[-1]

    def predicted(p: FitProbe) -> float:
        return p.batch_size * tokens_per_example / model().probe_s(p)

    policies = list(policies)
    variants = keep_gathered_variants(policies) if keep_gathered is not False else []
    if variants and keep_gathered is None:  # on the first probe of the search: does the step all-gather?
        first = search.probe(policies[0], 1 if global_batch is None else global_batch, 1)
        keep_gathered = any(kind == "all-gather" for kind, _, _ in first.collectives)
    if keep_gathered:
        policies += variants

    chosen: dict[int, tuple[list[FitProbe], list[tuple], list[tuple], dict]] = {}
    earlier: list[tuple] = []  # the finalists of the smaller budgets: they fit this one too
    for budget in sorted(set(budget_list)):
        search.order = []

        def searched(policy, budget=budget):
            if global_batch is None:
                return search.largest_batch(policy, budget, max_batch_size, batch_tolerance)
            return search.fewest_micro_batches(policy, budget, global_batch)

        # One policy's compiles depend on each other; different policies' do not, and XLA
        # compiles with the GIL released, so the policies are searched on parallel threads.
        with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(policies)))) as pool:
            fitting = [p for p in pool.map(searched, dict.fromkeys(policies)) if p is not None]
        plan_probes = []
        for key in dict.fromkeys(plans(budget, tuple(fitting)) if plans else ()):
            p = search.probe(*key)
            if p.peak_bytes is not None and p.peak_bytes <= budget:
                plan_probes.append(p)
        origin = {p.key: "search" for p in fitting}
        origin.update({p.key: "plan" for p in plan_probes if p.key not in origin})
        fitting = _one_per_program(fitting + plan_probes)
        if not fitting:
            raise _nothing_fits(budget, search.probes.values(), global_batch)
        origin.update({k: "smaller budget" for k in earlier if k not in origin})
        fitting.extend(search.probes[k] for k in earlier)
        same_program: dict[str | tuple, FitProbe] = {}  # the first label of each compiled program stands for it
        for p in fitting:
            same_program.setdefault(p.fingerprint or p.key, p)
        fitting = list(same_program.values())
        ranked = sorted(range(len(fitting)), key=lambda i: (-predicted(fitting[i]), i))
        earlier = [same_program[search.probes[k].fingerprint or k].key for k in earlier]
        picked = list(dict.fromkeys([fitting[i].key for i in ranked[:finalists]] + earlier))
        chosen[budget] = (fitting, picked, list(search.order), origin)
        earlier = picked

    timed_keys = list(dict.fromkeys(k for _, picked, _, _ in chosen.values() for k in picked))
    rounds_tps = search.time(timed_keys, rounds, calls_per_round, tokens_per_example)

    def measured(key) -> float:
        return statistics.median(rounds_tps[key])

    results: dict[int, FitResult] = {}
    for budget in sorted(chosen):
        fitting, picked, order, origin = chosen[budget]
        by_prediction = sorted(picked, key=lambda k: -predicted(search.probes[k]))
        win_key, within_noise = _decide(by_prediction, rounds_tps, search.probes, noise_tolerance)
        rows = [
            FitRow(
                p,
                predicted(p),
                p.key in picked,
                measured(p.key) if p.key in picked else None,
                tuple(rounds_tps[p.key]) if p.key in picked else (),
                origin[p.key],
            )
            for p in fitting
        ]
        rows.sort(key=lambda r: (r.tokens_per_s is None, -(r.tokens_per_s or 0.0), -r.predicted_tokens_per_s))
        winner = next(r for r in rows if r.probe.key == win_key)
        runner_up = next((r for r in rows if r.finalist and r is not winner), None)
        margin = None
        if runner_up is not None:
            margin = _quartiles([a / b for a, b in zip(runner_up.rounds_tokens_per_s, winner.rounds_tokens_per_s)])
        probes = tuple(sorted((search.probes[k] for k in order), key=lambda p: p.key))
        results[budget] = FitResult(
            budget_bytes=budget,
            global_batch=global_batch,
            tokens_per_example=tokens_per_example,
            rows=tuple(rows),
            winner=winner,
            margin=margin,
            time_model=model(),
            digest=_digest(budget, global_batch, probes, picked, winner.probe),
            search_s=0.0,
            probes=probes,
            within_noise=within_noise,
        )
    search_s = time.perf_counter() - t0
    return [dataclasses.replace(results[b], search_s=search_s) for b in budget_list]


def measure_throughput(
    build: StepBuilder,
    candidates: Sequence[tuple[str, int, int]],
    *,
    tokens_per_example: int = 1,
    rounds: int = 3,
    calls_per_round: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict[tuple[str, int, int], tuple[float, ...]]:
    """Compile and time ``(policy, batch_size, micro_batches)`` candidates in interleaved rounds.

    The timing :func:`fit_search` gives its finalists, for comparing other candidates in one
    process (each round: fresh arguments, one untimed call, then ``calls_per_round`` calls rounded
    up to whole optimizer steps).

    Returns:
      Per candidate, the tokens/s (examples/s when ``tokens_per_example`` is 1) of each round.

    Raises:
      FitError: the builder has no program for a candidate, or returns something else.
    """
    search = _Search(build, progress)
    for key in dict.fromkeys(candidates):
        if search.probe(*key).peak_bytes is None:
            raise FitError(f"the step builder gave no program for {key}")
    timed = search.time(list(dict.fromkeys(candidates)), rounds, calls_per_round, tokens_per_example)
    return {k: tuple(v) for k, v in timed.items()}


def fit_search(
    build: StepBuilder,
    policies: Sequence[str],
    budget: str | int | Budget,
    **kwargs,
) -> FitResult:
    """The (policy, batch) with the highest measured throughput whose compiled peak fits ``budget``.

    Per policy, the largest batch that fits to within ``batch_tolerance`` (compile-only, up to
    ``max_batch_size``: batch 1, 2, then where the line through the probes crosses the budget,
    see :func:`largest_fitting`) or, with ``global_batch``, the fewest micro-batches that divide
    it and fit; ``plans`` may add candidates at chosen batches. One program (:attr:`FitStep.program`)
    at several batches is one candidate, its largest batch, and labels that compile to the same
    program are one candidate, the first.
    The ``finalists`` best by the time model are run on the device in ``rounds`` interleaved
    rounds of ``calls_per_round`` calls (rounded up to whole optimizer steps). The fastest
    median wins, unless other finalists are within the noise: their per-round ratio to the
    fastest has an upper quartile of at least ``1 - noise_tolerance``. Then the winner among
    them is the one with the fewest traced FLOPs per example (the least recompute), then the
    larger batch, then the better predicted (:attr:`FitResult.within_noise` lists them, and
    :attr:`FitResult.decision` says so).

    Args:
      build: ``build(policy, batch_size, micro_batches)`` -> :class:`FitStep`, ``(step, args)``
        or ``None`` (no program there). ``batch_size`` is per micro-batch; one call of the step
        processes one micro-batch, so ``micro_batches`` calls make an optimizer step.
      policies: policy labels the builder understands, searched in this order (ties go to the
        earlier).
      budget: bytes (an int, ``"12GiB"``, ``"512MiB"``) of the compiled peak per device (on a
        mesh, one device's share of the SPMD program: see the module docstring).
      plans: ``plans(budget_bytes, searched)`` -> more ``(label, batch_size, micro_batches)``
        candidates (e.g. a budget planner's plan at some of the batches where the searches of
        ``policies`` ended; ``searched`` holds their probes); those that fit join the candidates.
      global_batch: fix the examples per optimizer step and choose the micro-batches.
      tokens_per_example: tokens per example (sequence length), for tokens/s.
      max_batch_size: the largest batch tried.
      finalists: how many candidates are timed.
      rounds, calls_per_round: the timing.
      time_model: skip the calibration (e.g. the model another host measured); on a mesh, a
        model without collective rates gets them measured there (:func:`with_collective_rates`).
      dtype: the dtype of the calibration's matmul.
      progress: called with a short line before each compile and each timed round.
      workers: threads that search policies at once (default: the CPU count); the result does
        not depend on it.
      batch_tolerance: the batch search stops once the largest fitting batch is known to within
        this fraction (a batch a few percent larger is not worth a compile); 0 finds it exactly.
      noise_tolerance: a finalist whose per-round tokens/s reach this fraction below the
        fastest's in at least a quarter of the rounds is within noise of it.
      keep_gathered: also search the ``keep_gathered=true`` variant of every policy spec that
        takes the key (:func:`keep_gathered_variants`), after ``policies``; ``None`` (default):
        when the first policy's step issues all-gathers (weights stored sharded, FSDP).

    Returns:
      A :class:`FitResult`.

    Raises:
      FitError: nothing fits (with the smallest compiled peak found and its policy and batch), a
        fractional budget, bad search settings (a tolerance outside ``[0, 1)``), a builder that returns something else, or a
        backend without compiled memory figures.
    """
    return fit_search_budgets(build, policies, [budget], **kwargs)[0]


__all__ = [
    "FitError",
    "FitResult",
    "FitRow",
    "FitStep",
    "FitProbe",
    "StepBuilder",
    "TimeModel",
    "calibrate_time_model",
    "fit_search",
    "fit_search_budgets",
    "keep_gathered_variants",
    "measure_throughput",
    "with_collective_rates",
]
