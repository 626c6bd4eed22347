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
is a candidate too, and when they issue all-to-alls (an expert-parallel MoE) or
collective-permutes, or all-reduce in a recomputation (a tensor-parallel step's row-parallel
matmuls), the ``keep_collectives=true`` variant (:func:`keep_collectives_variants`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence

from jremat._apply import registry
from jremat._plan.fit_types import FitError, FitProbe, FitResult, FitRow, StepBuilder, TimeModel
from jremat._plan.probe import _Search
from jremat._plan.time_model import calibrate_time_model, with_collective_rates
from jremat._spec.budget import Budget, as_budget, format_bytes


def key_variants(policies: Sequence[str], key: str) -> list[str]:
    """The ``key=true`` variant of each policy spec that takes ``key`` (a key every policy of one
    function takes, :data:`jremat.registry.UNIVERSAL_PARAMS`) and does not set it.

    Those are the registered policies of one function, but ``none`` (it keeps everything already)
    and ``auto`` (its layer plans choose it per layer); labels that are not policy specs have none.

    Raises:
      ValueError: a key that is not one of :data:`jremat.registry.UNIVERSAL_PARAMS`.
    """
    if key not in registry.UNIVERSAL_PARAMS:
        raise ValueError(f"unknown key {key!r}; valid keys: {', '.join(registry.UNIVERSAL_PARAMS)}")
    out = []
    for label in policies:
        try:
            name, values = registry.parse_spec(label)
            entry = registry.entries().get(name)
            if entry is None or entry.stack or name in ("none", "auto") or key in values:
                continue
            variant = registry.normalize_spec(label, **{key: True})
        except ValueError:
            continue
        if variant not in policies and variant not in out:
            out.append(variant)
    return out


def keep_gathered_variants(policies: Sequence[str]) -> list[str]:
    """The ``keep_gathered=true`` variant of each policy spec that takes the key and does not set it
    (:func:`key_variants`)."""
    return key_variants(policies, registry.KEEP_GATHERED)


def keep_collectives_variants(policies: Sequence[str]) -> list[str]:
    """The ``keep_collectives=true`` variant of each policy spec that takes the key and does not set
    it (:func:`key_variants`)."""
    return key_variants(policies, registry.KEEP_COLLECTIVES)


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
    extra_candidates: Callable[[int, Sequence[FitProbe]], Sequence[tuple[str, int, int]]] | None = None,
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
    keep_collectives: bool | None = None,
) -> list[FitResult]:
    """:func:`fit_search` for several budgets at once, smallest first, timed in one session.

    Each budget's finalists include the smaller budgets' finalists (they fit a larger budget
    too, and are kept at their own batch even where the same program fits a larger one), and
    all finalists are timed in the same interleaved rounds, so the winner's measured throughput
    falls as the budget grows by no more than the noise the tie rule allows. Arguments as
    :func:`fit_search`; returns one :class:`FitResult` per budget, in the order given.
    """
    _check_settings(policies, global_batch, finalists, rounds, calls_per_round, batch_tolerance, noise_tolerance)
    if plans is not None:
        if extra_candidates is not None:
            raise TypeError("give extra_candidates or plans (its alias), not both")
        extra_candidates = plans
    t0 = time.perf_counter()
    budget_list = _resolve_budgets(budgets)
    search = _Search(build, progress)
    models = [time_model]

    def model() -> TimeModel:
        # Calibrated once the first probes are compiled: on a mesh, the collectives are priced on its devices.
        current = models[-1]
        if current is None:
            search.progress("calibrate the time model")
            current = calibrate_time_model(dtype)
            models.append(current)
        if search.devices and not current.collective_s_per_byte:
            search.progress("measure the collectives' rates on the mesh")
            current = with_collective_rates(current, search.devices)
            models.append(current)
        return current

    def predicted(p: FitProbe) -> float:
        return p.batch_size * tokens_per_example / model().probe_s(p)

    policies = _with_kept_variants(search, list(policies), global_batch, keep_gathered, keep_collectives)
    chosen: dict[int, _Chosen] = {}
    earlier: list[tuple] = []  # the finalists of the smaller budgets: they fit this one too
    for budget in sorted(set(budget_list)):
        search.order = []
        fitting, origin = _fitting(
            search,
            budget,
            policies,
            extra_candidates,
            global_batch,
            max_batch_size,
            batch_tolerance,
            workers or os.cpu_count() or 1,
        )
        origin.update({k: "smaller budget" for k in earlier if k not in origin})
        fitting.extend(search.probes[k] for k in earlier)
        same_program: dict[str | tuple, FitProbe] = {}  # the first label of each compiled program stands for it
        for p in fitting:
            same_program.setdefault(p.fingerprint or p.key, p)
        fitting = list(same_program.values())
        ranked = sorted(range(len(fitting)), key=lambda i: (-predicted(fitting[i]), i))
        earlier = [same_program[search.probes[k].fingerprint or k].key for k in earlier]
        picked = list(dict.fromkeys([fitting[i].key for i in ranked[:finalists]] + earlier))
        chosen[budget] = _Chosen(fitting, picked, list(search.order), origin)
        earlier = picked

    timed_keys = list(dict.fromkeys(k for c in chosen.values() for k in c.picked))
    rounds_tps = search.time(timed_keys, rounds, calls_per_round, tokens_per_example)
    results = {
        budget: _result(
            search, budget, c, rounds_tps, predicted, model(), global_batch, tokens_per_example, noise_tolerance
        )
        for budget, c in sorted(chosen.items())
    }
    search_s = time.perf_counter() - t0
    return [dataclasses.replace(results[b], search_s=search_s) for b in budget_list]


def _check_settings(
    policies: Sequence[str],
    global_batch: int | None,
    finalists: int,
    rounds: int,
    calls_per_round: int,
    batch_tolerance: float,
    noise_tolerance: float,
) -> None:
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


#: The collectives whose re-issue only ``keep_collectives`` avoids (an all-gather: ``keep_gathered`` too;
#: an all-reduce: every data-parallel step's gradient reduction issues them).
_KEEP_COLLECTIVES_KINDS = frozenset({"all-to-all", "collective-permute"})


def _with_kept_variants(
    search: _Search,
    policies: list[str],
    global_batch: int | None,
    keep_gathered: bool | None,
    keep_collectives: bool | None,
) -> list[str]:
    """``policies``, then their ``keep_gathered=true`` variants when ``keep_gathered``, then their
    ``keep_collectives=true`` variants when ``keep_collectives`` (``None``: when the first
    policy's step all-gathers; issues all-to-alls or collective-permutes, or all-reduces where the
    first policy that takes the key all-reduces in a recomputation)."""
    gathered = keep_gathered_variants(policies) if keep_gathered is not False else []
    collectives = keep_collectives_variants(policies) if keep_collectives is not False else []
    if (gathered and keep_gathered is None) or (collectives and keep_collectives is None):
        # On the first probe of the search: which collectives does the step issue?
        first = search.probe(policies[0], 1 if global_batch is None else global_batch, 1)
        kinds = {kind for kind, _, _ in first.collectives}
        keep_gathered = "all-gather" in kinds if keep_gathered is None else keep_gathered
        if keep_collectives is None:
            keep_collectives = bool(kinds & _KEEP_COLLECTIVES_KINDS) or (
                "all-reduce" in kinds and _reduces_again(search, policies, 1 if global_batch is None else global_batch)
            )
    return policies + (gathered if keep_gathered else []) + (collectives if keep_collectives else [])


def _reduces_again(search: _Search, policies: list[str], global_batch: int) -> bool:
    """Whether the step of the first policy that takes ``keep_collectives`` all-reduces in a
    recomputation (a tensor-parallel row-parallel matmul's reduction), which the key avoids; a
    data-parallel step's gradient all-reduces are no reason to search the key's variants."""
    taking = [p for p in policies if keep_collectives_variants([p])]
    return bool(taking) and "all-reduce" in search.probe(taking[0], global_batch, 1).recomputed


def _fitting(
    search: _Search,
    budget: int,
    policies: Sequence[str],
    extra_candidates: Callable[[int, Sequence[FitProbe]], Sequence[tuple[str, int, int]]] | None,
    global_batch: int | None,
    max_batch_size: int,
    batch_tolerance: float,
    workers: int,
) -> tuple[list[FitProbe], dict[tuple, str]]:
    """The candidates that fit ``budget``, one per program (the searches' and the extra ones), and
    where each came from.

    Raises:
      FitError: none fits.
    """

    def searched(policy):
        if global_batch is None:
            return search.largest_batch(policy, budget, max_batch_size, batch_tolerance)
        return search.fewest_micro_batches(policy, budget, global_batch)

    # One policy's compiles depend on each other; different policies' do not, and XLA
    # compiles with the GIL released, so the policies are searched on parallel threads.
    with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(policies)))) as pool:
        fitting = [p for p in pool.map(searched, dict.fromkeys(policies)) if p is not None]
    extra_probes = []
    for key in dict.fromkeys(extra_candidates(budget, tuple(fitting)) if extra_candidates else ()):
        p = search.probe(*key)
        if p.peak_bytes is not None and p.peak_bytes <= budget:
            extra_probes.append(p)
    origin = {p.key: "search" for p in fitting}
    origin.update({p.key: "plan" for p in extra_probes if p.key not in origin})
    fitting = _one_per_program(fitting + extra_probes)
    if not fitting:
        raise _nothing_fits(budget, search.probes.values(), global_batch)
    return fitting, origin


@dataclasses.dataclass
class _Chosen:
    """One budget's candidates, its finalists (``picked``), the compiles made for it, and each candidate's origin."""

    fitting: list[FitProbe]
    picked: list[tuple]
    order: list[tuple[str, int, int]]
    origin: dict[tuple, str]


def _result(
    search: _Search,
    budget: int,
    chosen: _Chosen,
    rounds_tps: dict,
    predicted: Callable[[FitProbe], float],
    time_model: TimeModel,
    global_batch: int | None,
    tokens_per_example: int,
    noise_tolerance: float,
) -> FitResult:
    """The :class:`FitResult` of one budget from its finalists' measured rounds."""
    picked = chosen.picked
    by_prediction = sorted(picked, key=lambda k: -predicted(search.probes[k]))
    win_key, within_noise = _decide(by_prediction, rounds_tps, search.probes, noise_tolerance)
    rows = [
        FitRow(
            p,
            predicted(p),
            p.key in picked,
            statistics.median(rounds_tps[p.key]) if p.key in picked else None,
            tuple(rounds_tps[p.key]) if p.key in picked else (),
            chosen.origin[p.key],
        )
        for p in chosen.fitting
    ]
    rows.sort(key=lambda r: (r.tokens_per_s is None, -(r.tokens_per_s or 0.0), -r.predicted_tokens_per_s))
    winner = next(r for r in rows if r.probe.key == win_key)
    runner_up = next((r for r in rows if r.finalist and r is not winner), None)
    margin = None
    if runner_up is not None:
        margin = _quartiles([a / b for a, b in zip(runner_up.rounds_tokens_per_s, winner.rounds_tokens_per_s)])
    probes = tuple(sorted((search.probes[k] for k in chosen.order), key=lambda p: p.key))
    return FitResult(
        budget_bytes=budget,
        global_batch=global_batch,
        tokens_per_example=tokens_per_example,
        rows=tuple(rows),
        winner=winner,
        margin=margin,
        time_model=time_model,
        digest=_digest(budget, global_batch, probes, picked, winner.probe),
        search_s=0.0,
        probes=probes,
        within_noise=within_noise,
    )


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
    ``max_batch_size``: batch 1, 16, then where the line through the probes crosses the budget,
    see :func:`largest_fitting`) or, with ``global_batch``, the fewest micro-batches that divide
    it and fit; ``extra_candidates`` may add candidates at chosen batches. One program (:attr:`FitStep.program`)
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
      extra_candidates: ``extra_candidates(budget_bytes, searched)`` -> more
        ``(label, batch_size, micro_batches)`` candidates (e.g. the budget planner's layer plan at
        some of the batches where the searches of ``policies`` ended; ``searched`` holds their
        probes); those that fit join the candidates.
      plans: an alias of ``extra_candidates`` (give one of the two).
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
      keep_collectives: also search the ``keep_collectives=true`` variant of every policy spec
        that takes the key (:func:`keep_collectives_variants`), after those; ``None`` (default):
        when the first policy's step issues all-to-alls or collective-permutes (an
        expert-parallel MoE, a ring written in a ``shard_map``), or all-reduces where the first
        policy that takes the key all-reduces in a recomputation (tensor parallelism).

    Returns:
      A :class:`FitResult`.

    Raises:
      FitError: nothing fits (with the smallest compiled peak found and its policy and batch), a
        fractional budget, bad search settings (a tolerance outside ``[0, 1)``), a builder that returns something else, or a
        backend without compiled memory figures.
      TypeError: both ``extra_candidates`` and its alias ``plans``.
    """
    return fit_search_budgets(build, policies, [budget], **kwargs)[0]


__all__ = [
    "fit_search",
    "fit_search_budgets",
    "keep_collectives_variants",
    "keep_gathered_variants",
    "key_variants",
    "measure_throughput",
]
