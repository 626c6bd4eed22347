"""The per-policy memory report of the GPT's gradient step: compiled figures, residuals, recompute FLOPs.

:func:`policy_memory` measures one policy (XLA's buffer assignment through
:func:`jremat.memory_report`, the residuals of one block and of the whole step, the FLOPs the
policy adds and :func:`train.programs.analytic_peak_bytes`); :func:`compare_policies` measures
several against ``none``; :func:`summary_vs_none` is the trainer's start-up line. Nothing runs:
parameters and tokens are shapes. ``auto`` specs are planned first (:func:`config_for_spec`).

Every figure is compared with one baseline, ``none`` (:func:`baseline_config`): the same step with
no remat anywhere (policy ``none``, the head and loss whole, not chunked). Recompute is the FLOPs
a step adds over that baseline as a fraction of the baseline step's FLOPs (:data:`NONE_DEFINITION`,
:data:`RECOMPUTE_DEFINITION`: the wording the reports print).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import jremat
from jremat import (
    Explanation,
    LiveMemory,
    MemoryTimeline,
    allocator_stats_missing,
    explain_applied,
    format_bytes,
    registry,
)
from jremat.models.config import ModelConfig, whole_step_head_chunks
from jremat.models.gpt import GPT
from jremat.train.planning import keep_gathered_of, plan_for_budget
from jremat.train.programs import (
    attention_forward_passes,
    block_program,
    loss_program,
    shallow_config,
    step_flops,
    step_memory_report,
    step_program,
    step_residuals,
    traced_step_bytes,
    working_set_bytes,
)

#: What "none" means in every report (the memory table, the trainer's start-up line, explain's
#: "without remat"): the step of :func:`baseline_config`.
NONE_DEFINITION = "none = no remat anywhere (policy none, head and loss whole)"
#: What "recompute" means in every report: :attr:`PolicyMemory.recompute_flops_fraction`.
RECOMPUTE_DEFINITION = "recompute = FLOPs added over none / step FLOPs of none"


def baseline_config(model_cfg: ModelConfig) -> ModelConfig:
    """The step every report compares with: ``model_cfg`` with no remat anywhere.

    Policy ``none`` and ``remat_head_chunks=0`` (the final LayerNorm, head and loss whole: a
    chunked head is recomputed whatever the policy), everything else as in ``model_cfg``.
    """
    return model_cfg.replace(remat_policy="none", remat_head_chunks=0)


def head_label(head_chunks: int) -> str:
    """How the final LayerNorm, head and loss run: ``"whole"`` or ``"N chunks"`` (recomputed per chunk)."""
    return f"{head_chunks} chunks" if head_chunks else "whole"


def ratio(a, b):
    """``a / b``, or ``None`` when either is missing or ``b`` is zero."""
    return None if a is None or not b else a / b


@dataclasses.dataclass(frozen=True)
class PolicyMemory:
    """The memory report of one policy's gradient step.

    Byte fields come from XLA's compiled buffer assignment (``None`` when the backend reports
    none, or when compilation was skipped); residual and FLOP fields from tracing.

    Attributes:
      policy: the canonical policy spec.
      n_layers: transformer blocks.
      batch_size: sequences per batch.
      seq_len: tokens per sequence.
      peak_bytes: compiled peak estimate.
      peak_source: how :attr:`peak_bytes` was obtained (see :class:`jremat.MemoryReport`).
      temp_bytes: compiled temp bytes.
      argument_bytes: compiled argument bytes (parameters, tokens, key).
      output_bytes: compiled output bytes (parameter gradients).
      alias_bytes: compiled alias bytes.
      generated_code_bytes: compiled code bytes.
      saved_bytes: activation residuals of the whole step.
      saved_bytes_per_layer: activation residuals of one block.
      program_saved_bytes_per_layer: cross-check: stacked per-layer residuals of the whole step
        divided by ``n_layers`` under scan (``None`` when unrolled: names and layers are mixed).
      residual_total_bytes: every residual of the whole step, all kinds.
      step_flops: cost-model FLOPs of the gradient step under this policy.
      recompute_flops: FLOPs added by recomputation over the step of :func:`baseline_config`
        (``none``: no remat anywhere, head whole).
      recompute_flops_fraction: :attr:`recompute_flops` / FLOPs of that baseline step.
      analytic_peak_bytes: :func:`train.programs.analytic_peak_bytes` (traced bytes at full
        depth + :attr:`working_set_bytes`), or ``None`` when not compiled.
      working_set_bytes: :func:`train.programs.working_set_bytes`: the transient working set of
        the backward pass at its peak (the head's or one block's), measured on
        :func:`train.programs.shallow_config` (at most two layers per layer group; nested and
        unrolled stacks whole); ``None`` when not compiled.
      head_chunks: sequence chunks the final LayerNorm, head and loss are recomputed over
        (``remat_head_chunks``; 0: whole, as in ``none``).
      notes: caveats (backend, truthfulness checks).
      attention_forward_passes: fused attention forward kernels per layer in the training step,
        averaged over the layers (:func:`train.programs.attention_forward_passes`): 1 = the
        kernel is not recomputed, 2 = every layer's backward pass runs it again; 0 = no fused
        kernel (``explicit``, ``xla``).
      live_peak_bytes: the device allocator's peak over one executed step (``--live``), or ``None``.
      explanation: what the policy did to the step (:func:`explain_step`), or ``None``.
      timeline: the :class:`jremat.MemoryTimeline` of the compiled step (``--timeline``),
        or ``None``; JSON carries its summary, not the per-position curve.
    """

    policy: str
    n_layers: int
    batch_size: int
    seq_len: int
    peak_bytes: int | None
    peak_source: str
    temp_bytes: int | None
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    generated_code_bytes: int | None
    saved_bytes: int
    saved_bytes_per_layer: int
    program_saved_bytes_per_layer: float | None
    residual_total_bytes: int
    step_flops: float
    recompute_flops: float
    recompute_flops_fraction: float
    analytic_peak_bytes: int | None
    working_set_bytes: int | None = None
    head_chunks: int = 0
    notes: tuple[str, ...] = ()
    attention_forward_passes: float = 0.0
    live_peak_bytes: int | None = None
    timeline: MemoryTimeline | None = None
    explanation: Explanation | None = None

    def to_json(self, baseline: PolicyMemory | None = None, timeline_json: Callable | None = None) -> dict:
        """A JSON-ready dict of every field, plus ratios to ``baseline`` when given.

        Args:
          baseline: the ``none`` row to compare with.
          timeline_json: summarizes :attr:`timeline` for JSON; without it ``timeline`` is ``None``.
        """
        out = dataclasses.asdict(dataclasses.replace(self, timeline=None, explanation=None))
        out.pop("explanation")
        out["notes"] = list(self.notes)
        out["timeline"] = timeline_json(self.timeline) if self.timeline is not None and timeline_json else None
        if self.explanation is not None:
            out["explain"] = self.explanation.to_json()
        if baseline is not None:
            out["peak_ratio_vs_none"] = ratio(self.peak_bytes, baseline.peak_bytes)
            out["temp_ratio_vs_none"] = ratio(self.temp_bytes, baseline.temp_bytes)
            out["saved_ratio_vs_none"] = ratio(self.saved_bytes_per_layer, baseline.saved_bytes_per_layer)
        return out


def policy_memory(
    model_cfg: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    *,
    compile: bool = True,
    baseline_step_flops: float | None = None,
    timeline: bool = False,
) -> PolicyMemory:
    """Memory report of the gradient step of ``GPT(model_cfg)`` under ``model_cfg.remat_policy``.

    Nothing is executed. ``compile=False`` skips XLA (only traced figures are filled; compiled
    byte fields and the analytic estimate, which compiles a shallow copy of the model, are ``None``).

    Args:
      model_cfg: the model, with the policy to measure in ``remat_policy``.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).
      compile: whether to compile for XLA's buffer assignment.
      baseline_step_flops: FLOPs of the step of :func:`baseline_config` (computed when omitted).
      timeline: also read the compiled step's memory timeline (:func:`jremat.memory_timeline`);
        the byte fields then come from that same compile. Needs ``compile``.

    Returns:
      A :class:`PolicyMemory`.

    Raises:
      ValueError: on a bad batch size or sequence length.
    """
    seq_len = model_cfg.max_seq_len if seq_len is None else seq_len
    grad_fn, args = step_program(model_cfg, batch_size, seq_len)
    notes = []
    step_timeline = None
    if compile and timeline:
        step_timeline = jremat.memory_timeline(grad_fn, *args)
        report = step_timeline.report
        notes.extend(report.notes)
    elif compile:
        report = step_memory_report(model_cfg, batch_size, seq_len)
        notes.extend(report.notes)
    else:
        report = None
    block_fn, block_args = block_program(model_cfg, batch_size, seq_len)
    block = jremat.saved_residuals_report(block_fn, *block_args, param_argnums=(0,))
    whole = step_residuals(model_cfg, batch_size, seq_len)
    cross = whole.layer_stacked_bytes / model_cfg.n_layers if model_cfg.scan_layers and model_cfg.n_layers > 1 else None
    flops = jremat.program_flops(grad_fn, *args)
    if baseline_step_flops is None:
        baseline_step_flops = step_flops(baseline_config(model_cfg), batch_size, seq_len)
    recompute = max(0.0, flops - baseline_step_flops)
    passes = attention_forward_passes(model_cfg, batch_size, seq_len)
    if passes > 1:
        fix = (
            f"a policy that saves {jremat.names.ATTN_CONTEXT} and {jremat.names.ATTN_LSE} runs it once"
            if model_cfg.attention == "blockwise"
            else "JAX names none of cuDNN's statistics, so only none (or attention blockwise) runs it once"
        )
        notes.append(
            f"the backward pass runs the fused attention forward kernel again ({passes:g} passes per layer); {fix}"
        )
    get = (lambda name: getattr(report, name)) if report is not None and report.available else (lambda name: None)
    traced_bytes = traced_step_bytes(model_cfg, batch_size, seq_len, residuals=whole)
    if get("peak_bytes") is None:
        working_set = None
    elif shallow_config(model_cfg) == model_cfg:  # the shallow copy is this very step: no second compile
        working_set = report.peak_bytes - traced_bytes
    else:
        working_set = working_set_bytes(model_cfg, batch_size, seq_len)
    return PolicyMemory(
        policy=registry.normalize_spec(model_cfg.remat_policy),
        n_layers=model_cfg.n_layers,
        batch_size=batch_size,
        seq_len=seq_len,
        peak_bytes=get("peak_bytes"),
        peak_source=report.peak_source if report is not None else "not compiled",
        temp_bytes=get("temp_bytes"),
        argument_bytes=get("argument_bytes"),
        output_bytes=get("output_bytes"),
        alias_bytes=get("alias_bytes"),
        generated_code_bytes=get("generated_code_bytes"),
        saved_bytes=whole.saved_bytes,
        saved_bytes_per_layer=block.saved_bytes,
        program_saved_bytes_per_layer=cross,
        residual_total_bytes=whole.total_bytes,
        step_flops=flops,
        recompute_flops=recompute,
        recompute_flops_fraction=recompute / baseline_step_flops if baseline_step_flops else 0.0,
        analytic_peak_bytes=None if working_set is None else traced_bytes + working_set,
        working_set_bytes=working_set,
        head_chunks=model_cfg.remat_head_chunks,
        notes=tuple(notes),
        attention_forward_passes=passes,
        timeline=step_timeline,
    )


def explain_step(
    model_cfg: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    *,
    temp_bytes: int | None = None,
    baseline_temp_bytes: int | None = None,
) -> Explanation:
    """What ``model_cfg``'s policy does to the step (:func:`jremat.explain_applied`); nothing runs.

    Reads every checkpoint of the traced loss (per layer, inside the layer scan) with its own
    policy, checks the names the policy mentions against the model's tags, and, given both temp
    figures, says when the compiled temp did not fall although the policy recomputes.

    Args:
      model_cfg: the model, with the policy in ``remat_policy``.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).
      temp_bytes: the step's compiled temp bytes under the policy, if measured.
      baseline_temp_bytes: the same for the step of :func:`baseline_config`.

    Explain's "without remat" is that step (no remat anywhere, head whole) under every policy.
    """
    loss, args = loss_program(model_cfg, batch_size, seq_len)
    baseline, _ = loss_program(baseline_config(model_cfg), batch_size, seq_len)
    remat = model_cfg.remat_config()  # a nested: spec is the stack's: its layers run remat.policy
    return explain_applied(
        loss,
        *args,
        policy=remat.policy,
        label=registry.normalize_spec(model_cfg.remat_policy) if remat.nest is not None else None,
        baseline=baseline,
        compile=False,
        param_argnums=(0,),
        temp_bytes=temp_bytes,
        baseline_temp_bytes=baseline_temp_bytes,
        scan_layers=model_cfg.scan_layers,
        layers=model_cfg.n_layers,
        name="the gradient step",
    )


def config_for_spec(
    base_cfg: ModelConfig,
    spec: str,
    batch_size: int,
    seq_len: int | None = None,
    memory_budget: str | None = None,
    *,
    whole_step: bool = False,
):
    """``base_cfg`` under policy ``spec``; ``auto`` is planned against the compiled step.

    With ``whole_step`` the head and loss are rematerialized in chunks too, unless ``spec`` is
    ``none`` (:func:`models.config.whole_step_head_chunks`); otherwise ``base_cfg``'s chunks stay.

    Returns:
      ``(model_config, auto_plan)``; ``auto_plan`` is a :class:`jremat.LayerPlan` for ``auto``
      specs (budget from ``memory_budget``, else the spec's ``budget=`` key), else ``None``.

    Raises:
      ValueError: on a bad spec or budget, or a budget no plan fits.
    """
    if whole_step:
        base_cfg = base_cfg.replace(
            remat_head_chunks=whole_step_head_chunks(spec, base_cfg.max_seq_len if seq_len is None else seq_len)
        )
    name, values = registry.parse_spec(spec)
    if name != "auto":
        return base_cfg.replace(remat_policy=spec), None
    budget = memory_budget or values.get("budget", "0.5")
    plan = plan_for_budget(base_cfg, batch_size, budget, seq_len, keep_gathered=keep_gathered_of(values))
    return plan.config, plan


def compare_policies(
    base_cfg: ModelConfig,
    batch_size: int,
    policies: Sequence[str],
    seq_len: int | None = None,
    *,
    compile: bool = True,
    memory_budget: str | None = None,
    timeline: bool = False,
    explain: bool = False,
    whole_step: bool = False,
) -> tuple[list[PolicyMemory], PolicyMemory]:
    """:func:`policy_memory` for each policy spec, with the truthfulness check against ``none``.

    ``none`` is the step of :func:`baseline_config` (no remat anywhere, head and loss whole),
    whatever ``base_cfg``'s head chunks; it is measured too (returned as a row only if asked for)
    so that every row can be compared with it. A ``none`` spec whose step chunks the head (head
    chunks given, ``whole_step`` off) is a row of its own: it recomputes the head. A row whose temp memory did not follow its saved residuals gets a note
    naming the likely cause (:func:`jremat.diagnose_remat`). ``timeline=True`` fills
    :attr:`PolicyMemory.timeline` of every row (see :func:`policy_memory`). With ``explain`` every
    row also gets :attr:`PolicyMemory.explanation` (:func:`explain_step`). ``whole_step`` gives
    every policy but ``none`` a chunked head (see :func:`config_for_spec`).

    Returns:
      ``(rows, none_row)``: one :class:`PolicyMemory` per distinct spec, in order, and the baseline's.

    Raises:
      ValueError: on an unknown policy spec (the message lists the registered ones), or one that
        does not fit the model's layer stack (``nested:block=3`` on 2 layers).
    """
    for spec in policies:  # as the model's layer stack takes it: a nested: spec is a stack policy
        base_cfg.replace(remat_policy=spec).remat_config().validate_layers(base_cfg.n_layers)
    none_cfg = baseline_config(base_cfg)
    baseline_flops = step_flops(none_cfg, batch_size, seq_len)
    wanted = list(dict.fromkeys(policies))
    configs, plans = {}, {}
    for spec in wanted:
        configs[spec], plans[spec] = config_for_spec(
            base_cfg, spec, batch_size, seq_len, memory_budget, whole_step=whole_step
        )
    measured: dict[ModelConfig, PolicyMemory] = {}  # one measurement per distinct step

    def measure(cfg: ModelConfig) -> PolicyMemory:
        if cfg not in measured:
            measured[cfg] = policy_memory(
                cfg,
                batch_size,
                seq_len,
                compile=compile,
                baseline_step_flops=baseline_flops,
                timeline=timeline and cfg in configs.values(),
            )
        return measured[cfg]

    base = measure(none_cfg)
    rows = {}
    for spec in wanted:
        row, plan = measure(configs[spec]), plans[spec]
        if plan is not None:
            label = f"auto:budget={plan.budget_bytes} -> {plan.candidate.describe(configs[spec].n_layers)}"
            row = dataclasses.replace(row, policy=label, notes=row.notes + (plan.table(),))
        rows[spec] = row
    out = []
    for spec in wanted:
        row = rows[spec]
        if explain:
            row = dataclasses.replace(
                row,
                explanation=explain_step(
                    configs[spec], batch_size, seq_len, temp_bytes=row.temp_bytes, baseline_temp_bytes=base.temp_bytes
                ),
            )
        if spec != "none" and row.temp_bytes is not None and base.temp_bytes is not None:
            note = jremat.diagnose_remat(
                row.temp_bytes, base.temp_bytes, row.saved_bytes, base.saved_bytes, scan_layers=base_cfg.scan_layers
            )
            if note:
                row = dataclasses.replace(row, notes=row.notes + (note,))
        out.append(row)
    return out, base


def summary_line(row: PolicyMemory, base: PolicyMemory) -> str:
    """The trainer's start-up lines for ``row`` against the baseline ``base`` (see :func:`summary_vs_none`).

    The figures are printed as ``python -m train.memory`` prints them in its table, and the line
    says what ``none`` and recompute are (:data:`NONE_DEFINITION`, :data:`RECOMPUTE_DEFINITION`).
    """
    parts = [
        f"memory ({row.policy}, head {head_label(row.head_chunks)}): peak {format_bytes(row.peak_bytes)} "
        f"(none: {format_bytes(base.peak_bytes)}, analytic {format_bytes(row.analytic_peak_bytes)}), "
        f"saved/layer {format_bytes(row.saved_bytes_per_layer)} (none: {format_bytes(base.saved_bytes_per_layer)}), "
        f"recompute {format_recompute(row.recompute_flops_fraction)}",
        f"  {NONE_DEFINITION}; {RECOMPUTE_DEFINITION}",
    ]
    parts.extend(f"  note: {n}" for n in row.notes)
    return "\n".join(parts)


def format_recompute(fraction: float) -> str:
    """A recompute fraction as every report prints it (``22.9%``)."""
    return f"{fraction:.1%}"


def summary_vs_none(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> str:
    """A trainer's start-up log: peak estimate, saved bytes per layer and recompute vs ``none``.

    The figures are :func:`compare_policies`' for ``model_cfg`` (its policy and head chunks as
    given), the row ``python -m train.memory`` prints for the same configuration, against the
    same baseline (:func:`baseline_config`). Compiles the gradient step of the policy and of
    ``none`` (and, for stacks deeper than two layers per group, their shallow copies for the
    analytic estimate); nothing runs.

    Raises:
      ValueError: on a bad policy spec, batch size or sequence length.
    """
    rows, base = compare_policies(model_cfg, batch_size, [model_cfg.remat_policy], seq_len)
    return summary_line(rows[0], base)


def live_step_memory(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> LiveMemory:
    """Run the gradient step once on real arrays and read the allocator's peak (:func:`jremat.live_memory`).

    The allocator's peak only grows within a process, so measure one policy per process (the
    CLI's ``--live`` does).

    Args:
      model_cfg: the model, with its policy.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).

    Returns:
      The :class:`jremat.LiveMemory`; ``available`` is False, and nothing runs, on a
      backend without allocator statistics (XLA:CPU).
    """
    missing = allocator_stats_missing()
    if missing is not None:
        return LiveMemory(False, str(jax.devices()[0]), None, None, missing)
    grad_fn, (_, tokens, _, _) = step_program(model_cfg, batch_size, seq_len)
    _, params = nnx.split(GPT(model_cfg, rngs=nnx.Rngs(0)))
    batch = jnp.zeros(tokens.shape, tokens.dtype)
    return jremat.live_memory(jremat.jit(grad_fn), params, batch, batch, jax.random.key(0))


__all__ = [
    "NONE_DEFINITION",
    "RECOMPUTE_DEFINITION",
    "PolicyMemory",
    "baseline_config",
    "compare_policies",
    "config_for_spec",
    "explain_step",
    "format_recompute",
    "head_label",
    "live_step_memory",
    "policy_memory",
    "ratio",
    "summary_line",
    "summary_vs_none",
]
