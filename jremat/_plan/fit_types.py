"""The fit search's values: the step it compiles, its time model, each probe, and what it chose
(:func:`jremat.fit.fit_search`, :mod:`jremat._plan.fit`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jremat._spec.budget import format_bytes

#: ``build(policy, batch_size, micro_batches)`` -> a :class:`FitStep`, a ``(step, args)`` pair,
#: or ``None`` when ``policy`` has no program at that batch.
StepBuilder = Callable[[str, int, int], Any]

#: The rule that decides among finalists within the noise of the fastest, in words.
TIE_RULE = "fewer FLOPs per example (less recompute), then the larger batch, then the better predicted"


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
      fingerprint: the optimized HLO's hash (:func:`jremat._measure.compile.hlo_fingerprint`): two labels
        with the same one are the same program, and only the first is a candidate.
      program: :attr:`FitStep.program`, or the policy label.
      devices: the devices the step's arguments span (1: no mesh); :attr:`peak_bytes` and
        :attr:`bytes_accessed` are one device's, :attr:`flops` the whole program's.
      collectives: ``(kind, count, bytes per device)`` per collective kind the compiled step issues
        per call (:func:`jremat.collectives_report`); ``()`` on one device.
      recomputed: the collective kinds the step issues in a recomputation (phase ``recompute``);
        ``()`` on one device.
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
    recomputed: tuple[str, ...] = ()

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
        ``"plan"`` (from ``extra_candidates``) or ``"smaller budget"`` (a finalist of a smaller budget of the
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
            ratio = f"{r.tokens_per_s / best:.3f}" if r.tokens_per_s is not None and best is not None else "-"
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
        ratio_to_best=row.tokens_per_s / winner.tokens_per_s
        if row.tokens_per_s is not None and winner.tokens_per_s is not None
        else None,
    )
    return out
