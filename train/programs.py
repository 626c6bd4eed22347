"""The GPT's programs on shape structs: what the memory report, the planner, the bench and the tests compile.

Nothing here allocates: parameters and tokens are :class:`jax.ShapeDtypeStruct` pytrees.

* :func:`loss_program`, :func:`step_program` (``jax.grad`` of the loss), :func:`block_program`
  (one transformer block as the model runs it);
* :func:`train_step_fn`, :func:`eval_step_fn` (unjitted; ``train.step`` jits them) and
  :func:`adam_train_step` (the Adam train step with its abstract arguments);
* :func:`step_residuals`, :func:`step_flops` and :func:`traced_step_bytes`: traced figures of
  the gradient step; :func:`step_memory_report`: its compiled figures; :func:`analytic_peak_bytes`:
  its peak from the traced bytes at full depth and the working set of a shallow copy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jremat
from jremat import ResidualsReport
from jremat.internal import parse_layer_policies
from jremat.models.config import FUSED_ATTENTIONS, ModelConfig
from jremat.models.gpt import GPT, Block, cross_entropy_loss, make_block_fn

#: Arguments of :func:`train_step_fn` a training loop donates: the parameters and optimizer state.
TRAIN_STEP_DONATE = (0, 1)


def key_shape():
    """The shape struct of a PRNG key (``jax.random.key``)."""
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
    graphdef, params = _abstract_gpt(model_cfg)
    params = jax.tree.map(lambda leaf: leaf, params)  # the caller's own tree: the cached one stays as built
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)

    def loss(p, tok, tgt, key):
        return cross_entropy_loss(nnx.merge(graphdef, p), tok, tgt, key)

    return loss, (params, tokens, tokens, key_shape())


@functools.lru_cache(maxsize=64)
def _abstract_gpt(model_cfg: ModelConfig):
    """``nnx.split`` of ``GPT(model_cfg)`` on shape structs, once per config (building it traces every initializer)."""
    return nnx.split(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0))))


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


def attention_forward_passes(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> float:
    """Fused attention forward kernels per layer in a training step (value and gradient), averaged
    over the layers.

    1 when every layer's backward pass reads the kernel's saved output and statistics, 2 when every
    layer runs the kernel again, in between when layer groups differ (``"1:full,rest:none"``, an
    ``auto`` plan); 0 for attentions without a fused kernel (``explicit``, ``xla``), which are not
    traced. Counted on the traced step (:func:`jremat.attention.count_forward_passes`, a kernel in
    the layer scan once per layer); nothing runs.
    """
    if model_cfg.attention not in FUSED_ATTENTIONS:
        return 0.0
    loss, args = loss_program(model_cfg, batch_size, seq_len)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(*args)
    return jremat.attention.count_forward_passes(jaxpr, loop_iterations=True) / model_cfg.n_layers


def block_program(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None):
    """One transformer block as the model runs it, and its abstract arguments.

    Returns:
      ``(block_fn, (block_params, x, key))`` with ``block_fn = models.gpt.make_block_fn(...)``
      under the config's policy and granularity. As in the model's layer stack
      (:func:`jremat.run_layers`), the tag names the policy lists are checked over the whole
      block, not per sublayer (:func:`jremat.names.deferred_name_checks`): with granularity
      ``sublayer``, ``names:save=q+k+v`` is valid although the MLP sublayer tags none of them.
    """
    seq_len = model_cfg.max_seq_len if seq_len is None else seq_len
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Block(model_cfg, rngs=nnx.Rngs(0))))
    remat = model_cfg.remat_config()
    block_fn = make_block_fn(graphdef, remat, remat.resolved_policy())

    @functools.wraps(block_fn)
    def fn(params, x, key):
        with jremat.names.deferred_name_checks():
            return block_fn(params, x, key)

    x = jax.ShapeDtypeStruct((batch_size, seq_len, model_cfg.d_model), jnp.dtype(model_cfg.dtype))
    return fn, (params, x, key_shape())


def step_memory_report(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> jremat.MemoryReport:
    """XLA's memory figures of the compiled gradient step (:func:`jremat.memory_report`); nothing runs.

    Cached per ``(model_cfg, batch_size, seq_len)`` and remat engine (``jax_remat3``): the planner
    behind ``--policy auto`` compiles its chosen plan while planning, and the report's ``auto``
    row is that same step.

    Raises:
      ValueError: on a non-positive batch size or a too-long sequence.
    """
    seq_len = model_cfg.max_seq_len if seq_len is None else seq_len
    return _step_memory_report(model_cfg, batch_size, seq_len, getattr(jax.config, "jax_remat3", None))


@functools.lru_cache(maxsize=256)
def _step_memory_report(model_cfg: ModelConfig, batch_size: int, seq_len: int, _remat3) -> jremat.MemoryReport:
    grad_fn, args = step_program(model_cfg, batch_size, seq_len)
    return jremat.memory_report(grad_fn, *args)


def step_residuals(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> ResidualsReport:
    """Every value the whole step keeps for its backward pass (:func:`jremat.saved_residuals_report`)."""
    loss, args = loss_program(model_cfg, batch_size, seq_len)
    return jremat.saved_residuals_report(loss, *args, n_layers=model_cfg.n_layers, param_argnums=(0,))


def step_flops(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> float:
    """Cost-model FLOPs of the gradient step (:func:`jremat.program_flops`); traced, not compiled."""
    grad_fn, args = step_program(model_cfg, batch_size, seq_len)
    return jremat.program_flops(grad_fn, *args)


def shallow_config(model_cfg: ModelConfig) -> ModelConfig:
    """The same model with at most two layers per layer group: what :func:`analytic_peak_bytes` compiles.

    Every group of :attr:`ModelConfig.remat_layer_policies` (and the layers no group covers)
    keeps ``min(count, 2)`` layers, so each group's layer loop and the head stay as they are.
    Two kinds of stack are kept whole: nested checkpointing (``nested:...``), whose groups are
    the structure, and unrolled layers (``scan_layers=False``), which XLA schedules as one
    straight-line program whose buffers do not grow with depth as the traced residuals do.
    """
    remat = model_cfg.remat_config()
    if remat.nest is not None or not model_cfg.scan_layers:
        return model_cfg
    groups = parse_layer_policies(model_cfg.remat_layer_policies)
    used, kept, parts = 0, 0, []
    for count, spec in groups:
        count = model_cfg.n_layers - used if count is None else count
        used += count
        if min(count, 2):
            parts.append(f"{min(count, 2)}:{spec}")
            kept += min(count, 2)
    kept += min(model_cfg.n_layers - used, 2)
    return model_cfg.replace(n_layers=kept, remat_layer_policies=",".join(parts))


def traced_step_bytes(
    model_cfg: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    *,
    residuals: ResidualsReport | None = None,
) -> int:
    """Bytes of the gradient step that grow with depth, from shapes and the traced residuals; no compile.

    Parameters and tokens (arguments) + parameter gradients (outputs, same size as the
    parameters) + every residual the forward pass computes
    (:attr:`jremat.ResidualsReport.computed_bytes`: non-constant residuals that are not arguments).

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
    return int(param_bytes + token_bytes + param_bytes + residuals.computed_bytes)


def working_set_bytes(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> int:
    """The step's transient working set: the compiled peak of :func:`shallow_config` beyond its
    :func:`traced_step_bytes`.

    It is what the backward pass holds besides the residuals at its peak: one block's backward
    (recomputed activations, the ``[b, a, s, s]`` buffers of explicit attention, regenerated
    dropout bits, gradient buffers) or the head's (the logits gradient and its copies), whichever
    is larger; on a scanned stack it does not grow with depth (measured on XLA:CPU under
    :func:`jremat.jit`'s options; unrolled stacks are compiled whole for that reason).
    Compile-only, cached with :func:`step_memory_report`.

    Raises:
      RuntimeError: if the backend reports no compiled memory figures.
    """
    seq_len = model_cfg.max_seq_len if seq_len is None else seq_len
    shallow = shallow_config(model_cfg)
    report = step_memory_report(shallow, batch_size, seq_len)
    if not report.available:
        raise RuntimeError("; ".join(report.notes) or "the backend reports no compiled memory figures")
    return report.peak_bytes - traced_step_bytes(shallow, batch_size, seq_len)


def analytic_peak_bytes(
    model_cfg: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    *,
    residuals: ResidualsReport | None = None,
) -> int:
    """Peak memory of the gradient step: the full depth's traced bytes plus the working set of a shallow copy.

    Model: at the backward pass's peak every residual of the forward pass is alive, with the
    parameters, tokens and parameter gradients (:func:`traced_step_bytes`, counted at full depth
    from shapes), plus one transient working set, the largest of the head's backward and one
    block's backward (:func:`working_set_bytes`, compiled on :func:`shallow_config`: at most two
    scanned layers per group, so a deep scanned stack is never compiled). Where the shallow copy
    is the model itself (at most two layers per group, nested or unrolled stacks) the estimate
    is the compiled peak.

    It assumes the step is compiled as :func:`jremat.jit` compiles it (see
    :func:`jremat.compiler_options`) and that every scanned layer keeps what the traced
    residuals say (one slice of the scan's stacked residuals per layer).

    Args:
      model_cfg: the model, with its policy.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).
      residuals: the step's residuals if already traced (saves a trace).

    Raises:
      RuntimeError: if the backend reports no compiled memory figures.
    """
    traced = traced_step_bytes(model_cfg, batch_size, seq_len, residuals=residuals)
    return traced + working_set_bytes(model_cfg, batch_size, seq_len)


def train_step_fn(graphdef, tx: optax.GradientTransformation) -> Callable:
    """The unjitted ``(params, opt_state, tokens, targets, key) -> (params, opt_state, loss)``.

    Callers jit it themselves (with :func:`jremat.jit`, donating :data:`TRAIN_STEP_DONATE`, and
    shardings where they need them); JAX accepts compiler options only on the outermost jit.
    """

    def train_step(params, opt_state, tokens, targets, key):
        def loss_fn(p):
            return cross_entropy_loss(nnx.merge(graphdef, p), tokens, targets, key)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        # optax mixes Python floats with int32 step counts; allow that even under strict promotion.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return train_step


def eval_step_fn(graphdef) -> Callable:
    """The unjitted ``(params, tokens, targets) -> mean loss`` with dropout off."""

    def eval_step(params, tokens, targets):
        return cross_entropy_loss(nnx.merge(graphdef, params), tokens, targets, None)

    return eval_step


def adam_train_step(
    model_cfg: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    *,
    lr: float = 1e-3,
    tx: optax.GradientTransformation | None = None,
):
    """The Adam train step of ``GPT(model_cfg)`` and its abstract arguments; nothing is allocated.

    ``step(params, opt_state, tokens, targets, key) -> (params, opt_state, loss)``, unjitted: a
    training loop jits it donating the parameters and optimizer state
    (:data:`TRAIN_STEP_DONATE`), so the compiled program holds parameters, gradients and both
    Adam moments.

    Args:
      model_cfg: the model; its ``remat_policy`` is the policy measured.
      batch_size: sequences per batch.
      seq_len: tokens per sequence (default ``model_cfg.max_seq_len``).
      lr: Adam's learning rate.
      tx: another optimizer instead of Adam (e.g. ``train.ptb``'s clipped AdamW under
        ``optax.MultiSteps``); ``lr`` is then unused.

    Returns:
      ``(step, graphdef, tx, args)`` where ``args`` are :class:`jax.ShapeDtypeStruct` pytrees.
    """
    seq_len = model_cfg.max_seq_len if seq_len is None else seq_len
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0))))
    tx = optax.adam(lr) if tx is None else tx
    opt_state = jax.eval_shape(tx.init, params)

    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    return train_step_fn(graphdef, tx), graphdef, tx, (params, opt_state, tokens, tokens, key)


def adam_step_memory(model_cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> jremat.MemoryReport:
    """Compile-only memory report of :func:`adam_train_step`, donating as a training loop does.

    Raises:
      RuntimeError: if the backend reports no compiled memory figures.
    """
    step, _, _, args = adam_train_step(model_cfg, batch_size, seq_len)
    report = jremat.memory_report(step, *args, donate_argnums=TRAIN_STEP_DONATE)
    if not report.available:
        raise RuntimeError("; ".join(report.notes))
    return report


__all__ = [
    "TRAIN_STEP_DONATE",
    "adam_step_memory",
    "adam_train_step",
    "analytic_peak_bytes",
    "block_program",
    "eval_step_fn",
    "key_shape",
    "loss_program",
    "step_flops",
    "step_memory_report",
    "step_program",
    "step_residuals",
    "shallow_config",
    "train_step_fn",
    "traced_step_bytes",
    "working_set_bytes",
]
