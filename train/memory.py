"""Compile-only memory report of the reference model's gradient step, one row per policy.

``python -m train.memory --preset gpt2-small --batch-size 8 --dtype bfloat16 --policy none
--policy full --policy every_k:k=4 --policy selective`` compiles ``jremat.jit(jax.grad(loss))`` of
the GPT model for each policy (nothing is executed: parameters and tokens are shapes only) and
prints peak and temp bytes, saved activation bytes per layer, ratios to ``none`` and the
policy's recompute FLOPs as a fraction of the step's FLOPs.

The measured program is the gradient step (forward + backward, f32 parameter gradients out),
without an optimizer update: optimizer state adds ``2 x`` parameter bytes of arguments (AdamW)
independently of the policy.

Figures per policy:

* ``peak_bytes`` / ``temp_bytes`` / ``argument_bytes`` / ... — XLA's compiled buffer assignment
  (:func:`jremat.memory.memory_report`).
* ``saved_bytes_per_layer`` — activations one block keeps for the backward pass, from
  :func:`jremat.memory.saved_residuals_report` of ``models.gpt.make_block_fn`` (names intact);
  ``saved_bytes`` — the same for the whole step (embeddings, head and all layers).
* ``recompute_flops_fraction`` — ``(FLOPs(grad under policy) - FLOPs(grad under none)) /
  FLOPs(grad under none)`` with the cost model of :func:`jremat.memory.program_flops`.
* ``analytic_peak_bytes`` — an estimate from shapes and the traced residuals only, no compile
  (:func:`analytic_peak_bytes`).

:func:`policy_memory` and :func:`summary_vs_none` are the reusable entry points (the PTB trainer
prints the latter at start).
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from typing import Sequence

import jremat
import jax
import jax.numpy as jnp
from flax import nnx

from jremat import memory as jmem
from jremat.memory import format_bytes
from jremat import registry
from jremat import timeline as jtl
from jremat.explain import Explanation, explain_applied
from policies.auto import parse_budget
from models import GPT, PRESETS, ModelConfig, cross_entropy_loss
from models import preset as model_preset
from models.config import DTYPES, whole_step_head_chunks
from models.gpt import Block, make_block_fn
from train import cli
from train.cli import UsageError, apply_policy_keys, option, require, require_choice, require_int
from train import timeline_plot


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """What ``python -m train.memory`` measures; one field per command-line flag (``a_b`` <-> ``--a-b``).

    ``policy_keys`` collects the per-policy-key flags (``--k 4``); each applies to every
    ``--policy`` that takes the key. Model overrides left ``None`` keep the preset's value.
    """

    preset: str = option("small", "model preset", choices=tuple(PRESETS))
    batch_size: int = option(8, "sequences per batch")
    seq_len: int | None = option(None, "tokens per sequence (<= the preset's max_seq_len; default: equal)")
    dtype: str | None = option(None, "compute dtype (default: the preset's)", choices=DTYPES)
    policy: tuple[str, ...] = option(("none", "full"), "policy spec NAME or NAME:key=value, one report row each",
                                     metavar="SPEC")
    policy_keys: tuple = option((), "policy keys given as separate flags, as (key, raw value) pairs", cli=False)
    layers: int | None = option(None, "override the number of layers")
    d_model: int | None = option(None, "override d_model")
    d_ff: int | None = option(None, "override the MLP width")
    heads: int | None = option(None, "override the head count (head_dim = d_model / heads unless --head-dim)")
    head_dim: int | None = option(None, "override head_dim")
    dropout: float | None = option(None, "attention and residual dropout rate")
    granularity: str | None = option(None, "remat granularity", choices=jremat.GRANULARITIES)
    unrolled: bool = option(False, "unroll the layer loop instead of lax.scan")
    policy_module: tuple[str, ...] = option((), "import a module that registers policies", metavar="MODULE")
    json: bool = option(False, "print a JSON list, one object per policy")
    plot: str | None = option(None, "write a bar chart (PNG) of peak and saved bytes per policy", metavar="PNG")
    memory_budget: str | None = option(
        None, "budget for --policy auto: 6GiB, 512MiB, bytes, or a fraction in (0, 1] (of none's peak above full's)"
    )
    remat_head_chunks: int | None = option(
        None, "remat the final LayerNorm, head and loss over N sequence chunks (0: keep their logits; "
        "default: 4 for every policy but none, models.config.whole_step_head_chunks)"
    )
    live: bool = option(
        False, "also run one step per policy (a fresh process each) and report the allocator's peak (GPU/TPU)"
    )
    live_child: bool = option(False, "measure the first policy's live peak here and print it as JSON", hidden=True)
    timeline: str | None = option(
        None, "write live bytes over the compiled schedule per policy (peaks marked, top-10 buffers at each peak) "
        "to this PNG file, and print the top-10 tables", metavar="PNG",
    )

    def __post_init__(self):
        if self.timeline is not None:
            problem = timeline_plot.png_path_problem(self.timeline)
            if problem:
                raise UsageError(f"--timeline {self.timeline!r}: {problem}")
        require_choice("preset", self.preset, tuple(PRESETS))
        if self.remat_head_chunks is not None:
            require_int("remat_head_chunks", self.remat_head_chunks, minimum=0)
            require(not self.remat_head_chunks or self.resolved_seq_len % self.remat_head_chunks == 0,
                    f"--remat-head-chunks {self.remat_head_chunks} does not divide the sequence length "
                    f"{self.resolved_seq_len}")
        for field in ("batch_size", "seq_len", "layers", "d_model", "d_ff", "heads", "head_dim"):
            if getattr(self, field) is not None:
                require_int(field, getattr(self, field))
        if self.dtype is not None:
            require_choice("dtype", self.dtype, DTYPES)
        require(self.dropout is None or 0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout!r}")
        if self.granularity is not None:
            require_choice("granularity", self.granularity, jremat.GRANULARITIES)
        require(bool(self.policy), "give at least one --policy")
        if self.memory_budget is not None:
            try:
                parse_budget(self.memory_budget)
            except ValueError as err:
                raise UsageError(str(err)) from None
        if self.heads is not None and self.head_dim is None:
            d_model = self.d_model if self.d_model is not None else PRESETS[self.preset].d_model
            require(d_model % self.heads == 0,
                    f"--heads {self.heads} does not divide d_model {d_model}; give --head-dim or "
                    "a head count that divides d_model")
        max_seq = PRESETS[self.preset].max_seq_len
        require(self.seq_len is None or self.seq_len <= max_seq,
                f"--seq-len {self.seq_len} exceeds preset {self.preset!r}'s max_seq_len {max_seq}")
        for module in self.policy_module:
            try:
                registry.load_module(module)
            except ValueError as err:
                raise UsageError(f"bad --policy-module: {err}") from None
        object.__setattr__(self, "policy", apply_policy_keys(self.policy, self.policy_keys))
        object.__setattr__(self, "policy_keys", ())

    def model_config(self, policy: str) -> ModelConfig:
        """The :class:`ModelConfig` for one policy spec, with every override applied.

        Raises:
          UsageError: if the policy spec or the resulting model shape is invalid.
        """
        overrides: dict = {"remat_policy": policy}
        if self.dtype is not None:
            overrides["dtype"] = self.dtype
        if self.layers is not None:
            overrides["n_layers"] = self.layers
        if self.d_model is not None:
            overrides["d_model"] = self.d_model
        if self.d_ff is not None:
            overrides["d_ff"] = self.d_ff
        if self.heads is not None:
            overrides["n_heads"] = self.heads
            d_model = self.d_model if self.d_model is not None else PRESETS[self.preset].d_model
            overrides["head_dim"] = self.head_dim if self.head_dim is not None else d_model // self.heads
        elif self.head_dim is not None:
            overrides["head_dim"] = self.head_dim
        if self.dropout is not None:
            overrides["attn_dropout"] = overrides["resid_dropout"] = self.dropout
        if self.granularity is not None:
            overrides["remat_granularity"] = self.granularity
        if self.unrolled:
            overrides["scan_layers"] = False
        overrides["remat_head_chunks"] = (self.remat_head_chunks if self.remat_head_chunks is not None
                                          else whole_step_head_chunks(policy, self.resolved_seq_len))
        try:
            return model_preset(self.preset, **overrides)
        except ValueError as err:
            raise UsageError(str(err)) from None

    @property
    def resolved_seq_len(self) -> int:
        """``seq_len``, or the preset's ``max_seq_len`` when unset."""
        return self.seq_len if self.seq_len is not None else PRESETS[self.preset].max_seq_len

    def model_argv(self) -> list[str]:
        """The flags that rebuild this config's model and budget (not its policies or outputs)."""
        argv = []
        for field in ("preset", "batch_size", "seq_len", "dtype", "layers", "d_model", "d_ff", "heads", "head_dim",
                      "dropout", "granularity", "remat_head_chunks", "memory_budget"):
            value = getattr(self, field)
            if value is not None:
                argv += [f"--{field.replace('_', '-')}", str(value)]
        for module in self.policy_module:
            argv += ["--policy-module", module]
        return argv + (["--unrolled"] if self.unrolled else [])


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


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
      peak_source: how :attr:`peak_bytes` was obtained (see :mod:`jremat.memory`).
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
      recompute_flops: FLOPs added by recomputation (vs ``none``).
      recompute_flops_fraction: :attr:`recompute_flops` / FLOPs of the step under ``none``.
      analytic_peak_bytes: :func:`analytic_peak_bytes`.
      notes: caveats (backend, truthfulness checks).
      live_peak_bytes: the device allocator's peak over one executed step (``--live``), or ``None``.
      explanation: what the policy did to the step (:func:`explain_step`), or ``None``.
      timeline: the :class:`jremat.timeline.MemoryTimeline` of the compiled step (``--timeline``),
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
    analytic_peak_bytes: int
    notes: tuple[str, ...] = ()
    live_peak_bytes: int | None = None
    timeline: jtl.MemoryTimeline | None = None
    explanation: Explanation | None = None

    def to_json(self, baseline: "PolicyMemory | None" = None) -> dict:
        """A JSON-ready dict of every field, plus ratios to ``baseline`` when given."""
        out = dataclasses.asdict(dataclasses.replace(self, timeline=None, explanation=None))
        out.pop("explanation")
        out["notes"] = list(self.notes)
        out["timeline"] = timeline_plot.timeline_json(self.timeline) if self.timeline is not None else None
        if self.explanation is not None:
            out["explain"] = self.explanation.to_json()
        if baseline is not None:
            out["peak_ratio_vs_none"] = _ratio(self.peak_bytes, baseline.peak_bytes)
            out["temp_ratio_vs_none"] = _ratio(self.temp_bytes, baseline.temp_bytes)
            out["saved_ratio_vs_none"] = _ratio(self.saved_bytes_per_layer, baseline.saved_bytes_per_layer)
        return out


def _ratio(a, b):
    return None if a is None or not b else a / b


def _key_shape():
    return jax.eval_shape(lambda: jax.random.key(0))


def loss_program(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None):
    """The loss of one step and its abstract arguments, without allocating anything.

    Args:
      model_cfg: the model (its ``remat_policy`` is the policy measured).
      batch_size: sequences per batch; must be positive.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).

    Returns:
      ``(loss_fn, (params, tokens, targets, key))``: ``loss_fn(params, tokens, targets, key)`` is
      the mean cross-entropy and the arguments are shape structs.

    Raises:
      ValueError: on a non-positive batch size or a too-long sequence.
    """
    seq_len = model_cfg.max_seq_len if seq_len is None else seq_len
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch size and sequence length must be positive, got {batch_size} and {seq_len}")
    if seq_len > model_cfg.max_seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    model = nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)

    def loss(p, tok, tgt, key):
        return cross_entropy_loss(nnx.merge(graphdef, p), tok, tgt, key)

    return loss, (params, tokens, tokens, _key_shape())


def step_program(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None):
    """The gradient step and its abstract arguments (see :func:`loss_program`).

    Returns:
      ``(grad_fn, (params, tokens, targets, key))`` with ``grad_fn = jax.grad(loss)`` with
      respect to ``params``.

    Raises:
      ValueError: on a non-positive batch size or a too-long sequence.
    """
    loss, args = loss_program(model_cfg, batch_size, seq_len)
    return jax.grad(loss), args


def block_program(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None):
    """One transformer block as the model runs it, and its abstract arguments.

    Returns:
      ``(block_fn, (block_params, x, key))`` with ``block_fn = models.gpt.make_block_fn(...)``
      under the config's policy and granularity.
    """
    seq_len = model_cfg.max_seq_len if seq_len is None else seq_len
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Block(model_cfg, rngs=nnx.Rngs(0))))
    remat = model_cfg.remat_config()
    fn = make_block_fn(graphdef, remat, remat.resolved_policy())
    x = jax.ShapeDtypeStruct((batch_size, seq_len, model_cfg.d_model), jnp.dtype(model_cfg.dtype))
    return fn, (params, x, _key_shape())


def analytic_peak_bytes(
    model_cfg: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    *,
    residuals: jmem.ResidualsReport | None = None,
) -> int:
    """Peak memory of the gradient step estimated from shapes and traced residuals; no compile.

    Model: the peak falls at the start of the backward pass, when every residual of the
    forward pass is alive together with the loss-side buffers. So peak = parameters + tokens
    (arguments) + parameter gradients (outputs, same size as parameters) + the residuals the
    forward pass computes (:attr:`jremat.memory.ResidualsReport.computed_bytes`: every
    non-constant residual that is not an argument) + the head's backward working set: the f32
    gradient of the logits plus the logits-sized buffer that feeds the two head matmuls (its
    cast to the compute dtype), ``(4 + itemsize(dtype)) x batch x seq x vocab`` bytes (divided
    by ``remat_head_chunks`` when the head is rematerialized in chunks).

    It assumes the step is compiled as :func:`jremat.jit` compiles it (on XLA:CPU, without
    loop-invariant code motion; see :mod:`jremat.xla_flags`). It leaves out the transient
    working set of one block's backward pass, so it underestimates when that, not the head,
    sets the peak (small vocabularies with long sequences; measured in docs/RESULTS.md).

    Args:
      model_cfg: the model, with its policy.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).
      residuals: the step's residuals if already traced (saves a trace).
    """
    seq_len = model_cfg.max_seq_len if seq_len is None else seq_len
    _, (params, *_rest) = step_program(model_cfg, batch_size, seq_len)
    param_bytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    token_bytes = 2 * batch_size * seq_len * 4 + 8
    if residuals is None:
        residuals = step_residuals(model_cfg, batch_size, seq_len)
    bytes_per_logit = 4 + jnp.dtype(model_cfg.dtype).itemsize
    head_work = bytes_per_logit * batch_size * seq_len * model_cfg.vocab_size // max(1, model_cfg.remat_head_chunks)
    return int(param_bytes + token_bytes + param_bytes + residuals.computed_bytes + head_work)


def step_residuals(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> jmem.ResidualsReport:
    """Every value the whole step keeps for its backward pass (:func:`jremat.saved_residuals_report`)."""
    loss, args = loss_program(model_cfg, batch_size, seq_len)
    return jmem.saved_residuals_report(loss, *args, n_layers=model_cfg.n_layers, param_argnums=(0,))


def _step_flops(model_cfg, batch_size, seq_len) -> float:
    grad_fn, args = step_program(model_cfg, batch_size, seq_len)
    return jmem.program_flops(grad_fn, *args)


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

    Nothing is executed. ``compile=False`` skips XLA (only traced figures and the analytic
    estimate are filled; byte fields are ``None``).

    Args:
      model_cfg: the model, with the policy to measure in ``remat_policy``.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).
      compile: whether to compile for XLA's buffer assignment.
      baseline_step_flops: FLOPs of the same step under ``none`` (computed when omitted).
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
        step_timeline = jtl.memory_timeline(grad_fn, *args)
        report = step_timeline.report
        notes.extend(report.notes)
    elif compile:
        report = jmem.memory_report(grad_fn, *args)
        notes.extend(report.notes)
    else:
        report = None
    block_fn, block_args = block_program(model_cfg, batch_size, seq_len)
    block = jmem.saved_residuals_report(block_fn, *block_args, param_argnums=(0,))
    whole = step_residuals(model_cfg, batch_size, seq_len)
    cross = whole.layer_stacked_bytes / model_cfg.n_layers if model_cfg.scan_layers and model_cfg.n_layers > 1 else None
    flops = jmem.program_flops(grad_fn, *args)
    if baseline_step_flops is None:
        baseline_step_flops = _step_flops(model_cfg.replace(remat_policy="none"), batch_size, seq_len)
    recompute = max(0.0, flops - baseline_step_flops)
    get = (lambda name: getattr(report, name)) if report is not None and report.available else (lambda name: None)
    return PolicyMemory(
        policy=registry.resolve(model_cfg.remat_policy).spec or str(model_cfg.remat_policy),
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
        analytic_peak_bytes=analytic_peak_bytes(model_cfg, batch_size, seq_len, residuals=whole),
        notes=tuple(notes),
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
    """What ``model_cfg``'s policy does to the step (:func:`jremat.explain.explain_applied`); nothing runs.

    Reads every checkpoint of the traced loss (per layer, inside the layer scan) with its own
    policy, checks the names the policy mentions against the model's tags, and, given both temp
    figures, says when the compiled temp did not fall although the policy recomputes.

    Args:
      model_cfg: the model, with the policy in ``remat_policy``.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).
      temp_bytes: the step's compiled temp bytes under the policy, if measured.
      baseline_temp_bytes: the same under ``none``.
    """
    loss, args = loss_program(model_cfg, batch_size, seq_len)
    baseline, _ = loss_program(model_cfg.replace(remat_policy="none"), batch_size, seq_len)
    return explain_applied(
        loss, *args, policy=model_cfg.remat_policy, baseline=baseline, compile=False, param_argnums=(0,),
        temp_bytes=temp_bytes, baseline_temp_bytes=baseline_temp_bytes, scan_layers=model_cfg.scan_layers,
        _name="the gradient step",
    )


def config_for_spec(
    base_cfg: ModelConfig, spec: str, batch_size: int, seq_len: int | None = None, memory_budget: str | None = None,
    *, whole_step: bool = False,
):
    """``base_cfg`` under policy ``spec``; ``auto`` is planned against the compiled step.

    With ``whole_step`` the head and loss are rematerialized in chunks too, unless ``spec`` is
    ``none`` (:func:`models.config.whole_step_head_chunks`); otherwise ``base_cfg``'s chunks stay.

    Returns:
      ``(model_config, auto_plan)``; ``auto_plan`` is a :class:`train.auto.AutoPlan` for ``auto``
      specs (budget from ``memory_budget``, else the spec's ``budget=`` key), else ``None``.

    Raises:
      ValueError: on a bad spec or budget, or a budget no plan fits.
    """
    name, values = registry.parse_spec(spec)
    if whole_step:
        base_cfg = base_cfg.replace(
            remat_head_chunks=whole_step_head_chunks(spec, base_cfg.max_seq_len if seq_len is None else seq_len))
    if name != "auto":
        return base_cfg.replace(remat_policy=spec), None
    from train.auto import plan_for_budget  # train.auto builds on this module's step programs

    plan = plan_for_budget(base_cfg, batch_size, memory_budget or values.get("budget", "0.5"), seq_len)
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
) -> list[PolicyMemory]:
    """:func:`policy_memory` for each policy spec, with the truthfulness check against ``none``.

    ``none`` is measured too (first; returned as a row only if asked for) so that every row can
    be compared with it. A row whose temp memory did not follow its saved residuals gets a note
    naming the likely cause (:func:`jremat.memory.diagnose_remat`). ``timeline=True`` fills
    :attr:`PolicyMemory.timeline` of every row (see :func:`policy_memory`). With ``explain`` every
    row also gets :attr:`PolicyMemory.explanation` (:func:`explain_step`). ``whole_step`` gives
    every policy but ``none`` a chunked head (see :func:`config_for_spec`).

    Returns:
      ``(rows, none_row)``: one :class:`PolicyMemory` per distinct spec, in order, and ``none``'s.

    Raises:
      ValueError: on an unknown policy spec (the message lists the registered ones).
    """
    for spec in policies:
        registry.resolve(spec)
    none_cfg = base_cfg.replace(remat_policy="none", **({"remat_head_chunks": 0} if whole_step else {}))
    baseline_flops = _step_flops(none_cfg, batch_size, seq_len)
    rows = {}
    configs = {}
    wanted = list(dict.fromkeys(policies))
    order = wanted if "none" in wanted else ["none", *wanted]
    for spec in order:
        cfg, plan = config_for_spec(base_cfg, spec, batch_size, seq_len, memory_budget, whole_step=whole_step)
        row = policy_memory(cfg, batch_size, seq_len, compile=compile, baseline_step_flops=baseline_flops,
                            timeline=timeline and spec in wanted)
        if plan is not None:
            label = f"auto:budget={plan.budget_bytes} -> {plan.candidate.describe(cfg.n_layers)}"
            row = dataclasses.replace(row, policy=label, notes=row.notes + (plan.table(),))
        rows[spec] = row
        configs[spec] = cfg
    base = rows["none"]
    out = []
    for spec in wanted:
        row = rows[spec]
        if explain:
            row = dataclasses.replace(row, explanation=explain_step(
                configs[spec], batch_size, seq_len, temp_bytes=row.temp_bytes, baseline_temp_bytes=base.temp_bytes))
        if spec != "none" and row.temp_bytes is not None and base.temp_bytes is not None:
            note = jmem.diagnose_remat(
                row.temp_bytes, base.temp_bytes, row.saved_bytes, base.saved_bytes, scan_layers=base_cfg.scan_layers
            )
            if note:
                row = dataclasses.replace(row, notes=row.notes + (note,))
        out.append(row)
    return out, base


def summary_vs_none(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> str:
    """One line for a trainer's start-up log: peak estimate and saved bytes per layer vs ``none``.

    Compiles the gradient step twice (the policy and ``none``); nothing runs.
    """
    rows, base = compare_policies(model_cfg, batch_size, [model_cfg.remat_policy], seq_len)
    row = rows[0]
    peak = format_bytes(row.peak_bytes)
    parts = [
        f"memory ({row.policy}): peak {peak} (none: {format_bytes(base.peak_bytes)}, "
        f"analytic {format_bytes(row.analytic_peak_bytes)}), saved/layer {format_bytes(row.saved_bytes_per_layer)} "
        f"(none: {format_bytes(base.saved_bytes_per_layer)}), recompute +{row.recompute_flops_fraction:.0%} FLOPs"
    ]
    parts.extend(f"  note: {n}" for n in row.notes)
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def format_table(rows: Sequence[PolicyMemory], base: PolicyMemory) -> str:
    """The human-readable table: one line per policy, then notes."""
    live = any(r.live_peak_bytes is not None for r in rows)
    header = (f"{'policy':<24} {'peak':>11} {'temp':>11} {'saved/layer':>12} {'peak/none':>9} "
              f"{'saved/none':>10} {'recompute':>9} {'analytic':>11} {'anal.err':>8}" + (f" {'live peak':>11}" if live else ""))
    lines = [header, "-" * len(header)]
    for r in rows:
        pr = _ratio(r.peak_bytes, base.peak_bytes)
        sr = _ratio(r.saved_bytes_per_layer, base.saved_bytes_per_layer)
        err = _ratio(r.analytic_peak_bytes - r.peak_bytes, r.peak_bytes) if r.peak_bytes else None
        lines.append(
            f"{r.policy:<24} {format_bytes(r.peak_bytes):>11} {format_bytes(r.temp_bytes):>11} "
            f"{format_bytes(r.saved_bytes_per_layer):>12} {('%.3f' % pr) if pr is not None else 'n/a':>9} "
            f"{('%.3f' % sr) if sr is not None else 'n/a':>10} {r.recompute_flops_fraction:>8.1%} "
            f"{format_bytes(r.analytic_peak_bytes):>11} {('%+.1f%%' % (100 * err)) if err is not None else 'n/a':>8}"
            + (f" {format_bytes(r.live_peak_bytes):>11}" if live else "")
        )
    first = rows[0]
    lines.append(
        f"gradient step of {first.n_layers} layers, batch {first.batch_size} x seq {first.seq_len}; "
        f"peak from: {first.peak_source}; recompute = extra FLOPs vs none / step FLOPs under none "
        f"({base.step_flops:.3g})"
    )
    seen = set()
    for r in rows:
        for n in r.notes:
            key = (r.policy, n) if "saved residuals fell" in n else n
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"note [{r.policy}]: {n}" if "saved residuals fell" in n else f"note: {n}")
    return "\n".join(lines)


def format_explanations(rows: Sequence[PolicyMemory]) -> str:
    """The explain section: per policy, its decisions, the names it matched and any problem, one line each."""
    parts = [r.explanation.text() for r in rows if r.explanation is not None]
    return "\n".join(["", "explain (what each policy did to the step; jremat.explain):", *parts]) if parts else ""


def write_plot(rows: Sequence[PolicyMemory], path: str) -> None:
    """Write a bar chart of peak bytes and saved bytes (whole step) per policy to ``path`` (PNG).

    Raises:
      UsageError: if the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.policy for r in rows]
    mib = 2**20
    xs = range(len(rows))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(rows)), 4.0))
    ax.bar([x - width / 2 for x in xs], [(r.peak_bytes or 0) / mib for r in rows], width, label="compiled peak")
    ax.bar([x + width / 2 for x in xs], [r.saved_bytes / mib for r in rows], width, label="saved activations")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel("MiB")
    first = rows[0]
    ax.set_title(f"gradient step memory, {first.n_layers} layers, batch {first.batch_size} x {first.seq_len}")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as err:
        raise UsageError(f"cannot write plot {path!r}: {err}") from None
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Live peaks
# ---------------------------------------------------------------------------------------------


def live_step_memory(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> jmem.LiveMemory:
    """Run the gradient step once on real arrays and read the allocator's peak (:func:`jremat.live_memory`).

    The allocator's peak only grows within a process, so measure one policy per process (the
    CLI's ``--live`` does).

    Args:
      model_cfg: the model, with its policy.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).

    Returns:
      The :class:`jremat.memory.LiveMemory`; ``available`` is False, and nothing runs, on a
      backend without allocator statistics (XLA:CPU).
    """
    missing = jmem.allocator_stats_missing()
    if missing is not None:
        return jmem.LiveMemory(False, str(jax.devices()[0]), None, None, missing)
    grad_fn, (_, tokens, _, _) = step_program(model_cfg, batch_size, seq_len)
    _, params = nnx.split(GPT(model_cfg, rngs=nnx.Rngs(0)))
    batch = jnp.zeros(tokens.shape, tokens.dtype)
    return jmem.live_memory(jremat.jit(grad_fn), params, batch, batch, jax.random.key(0))


def _allocator_stats_note() -> str | None:
    missing = jmem.allocator_stats_missing()
    return None if missing is None else f"live: {missing}; --live needs a GPU or TPU, so only compiled figures are shown"


def _run_live_child(config: MemoryConfig, spec: str) -> int | None:
    """The live peak of ``spec``, measured in a fresh Python process (``None`` if it failed)."""
    argv = [sys.executable, "-m", "train.memory", *config.model_argv(), "--policy", spec, "--live-child"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None
    return json.loads(lines[-1]).get("live_peak_bytes")


def add_live_peaks(config: MemoryConfig, rows: Sequence[PolicyMemory]) -> tuple[list[PolicyMemory], str | None]:
    """Fill :attr:`PolicyMemory.live_peak_bytes` of every row, one fresh process per policy.

    Returns:
      ``(rows, note)``: the rows, and a note when live figures could not be taken.
    """
    note = _allocator_stats_note()
    if note is not None:
        return list(rows), note
    specs = list(dict.fromkeys(config.policy))  # one row per distinct spec, as compare_policies
    peaks = [_run_live_child(config, spec) for spec in specs]
    failed = [spec for spec, peak in zip(specs, peaks) if peak is None]
    rows = [dataclasses.replace(r, live_peak_bytes=peak) for r, peak in zip(rows, peaks)]
    return rows, (f"live: the measurement failed for {', '.join(failed)}" if failed else None)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_config(argv: Sequence[str] | None) -> MemoryConfig:
    """Parse command-line flags into a :class:`MemoryConfig` (see :func:`train.cli.parse`).

    Raises:
      UsageError: on any bad flag or value.
      SystemExit: ``--help`` (code 0).
    """
    return cli.parse(
        MemoryConfig, argv, prog="python -m train.memory",
        description="Compile-only memory report of the GPT gradient step, one row per remat policy.",
        epilog="registered policies:\n" + registry.describe(),
    )


def run(config: MemoryConfig) -> tuple[list[PolicyMemory], PolicyMemory]:
    """Measure every policy of ``config``; returns the rows and the ``none`` baseline.

    Raises:
      UsageError: on an invalid model shape or policy.
    """
    base_cfg = config.model_config(config.policy[0])
    for spec in config.policy[1:]:
        config.model_config(spec)
    try:
        return compare_policies(
            base_cfg, config.batch_size, config.policy, config.resolved_seq_len, memory_budget=config.memory_budget,
            timeline=config.timeline is not None,
            explain=True, whole_step=config.remat_head_chunks is None,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 on bad input, with a one-line error on stderr)."""
    try:
        config = parse_config(argv)
        if config.live_child:
            spec = config.policy[0]
            cfg, _ = config_for_spec(config.model_config(spec), spec, config.batch_size, config.resolved_seq_len,
                                     config.memory_budget, whole_step=config.remat_head_chunks is None)
            live = live_step_memory(cfg, config.batch_size, config.resolved_seq_len)
            print(json.dumps({"live_peak_bytes": live.peak_bytes_in_use if live.available else None}))
            return 0
        rows, base = run(config)
        live_note = None
        if config.live:
            rows, live_note = add_live_peaks(config, rows)
            base = next((r for r in rows if r.policy == base.policy), base)
        if live_note:
            print(live_note, file=sys.stderr)
        if config.json:
            print(json.dumps([r.to_json(base) for r in rows], indent=2))
        else:
            print(format_table(rows, base))
            explained = format_explanations(rows)
            if explained:
                print(explained)
        if config.plot:
            write_plot(rows, config.plot)
        if config.timeline:
            if not config.json:
                print(timeline_plot.format_timelines(rows))
            try:
                timeline_plot.write_timeline_png(rows, config.timeline)
            except OSError as err:
                raise UsageError(f"cannot write --timeline {config.timeline!r}: {err}") from None
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
