"""Optimizer, train step and eval step (optax + Flax NNX, functional style).

The model is split once into a graph definition and a parameter ``State``; the steps are pure
jitted functions of ``(params, opt_state, batch, key)``. Gradient accumulation is
``optax.MultiSteps``: each call of the train step consumes one micro-batch and the parameters
change on every ``accum``-th call.

The step functions themselves are the model's programs (:func:`train.programs.train_step_fn`,
:func:`train.programs.eval_step_fn`); this module builds the optimizer and jits them.

Dropout keys are a pure function of the seed and the position in training,
``fold_in(fold_in(key(seed), step), micro_step)``, so a resumed run draws the same masks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

import jremat
from jremat.models import GPT, ModelConfig, moe_aux_losses
from jremat.train.programs import TRAIN_STEP_DONATE, eval_step_fn, train_step_fn


def learning_rate_schedule(peak_lr: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``peak_lr`` over ``warmup_steps``, then cosine decay to ``peak_lr / 10``.

    Args:
      peak_lr: the learning rate after warmup.
      warmup_steps: steps of linear warmup (0: none).
      total_steps: the run's optimizer steps; the decay ends there.
    """
    decay = optax.cosine_decay_schedule(peak_lr, max(1, total_steps - warmup_steps), alpha=0.1)
    if warmup_steps == 0:
        return decay
    warm = optax.linear_schedule(0.0, peak_lr, warmup_steps)
    return optax.join_schedules([warm, decay], [warmup_steps])


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer hyperparameters (hashable, so compiled steps can be cached on them)."""

    lr: float
    warmup_steps: int
    total_steps: int
    clip: float
    weight_decay: float
    accum: int

    def schedule(self) -> optax.Schedule:
        """The learning-rate schedule, a function of the optimizer step."""
        return learning_rate_schedule(self.lr, self.warmup_steps, self.total_steps)

    def learning_rate(self, step: int) -> float:
        """The learning rate of the update made at optimizer step ``step`` (0-based)."""
        with jax.numpy_dtype_promotion("standard"):
            return float(self.schedule()(step))

    def build(self) -> optax.GradientTransformation:
        """Clipping (if ``clip > 0``) + AdamW, wrapped in ``optax.MultiSteps(every_k=accum)``."""
        parts = [optax.clip_by_global_norm(self.clip)] if self.clip > 0 else []
        parts.append(optax.adamw(self.schedule(), weight_decay=self.weight_decay))
        return optax.MultiSteps(optax.chain(*parts), every_k_schedule=self.accum)


def init_params(model_cfg: ModelConfig, seed: int) -> tuple[Any, Any]:
    """``(graphdef, params)`` of a freshly initialized :class:`models.GPT`."""
    return nnx.split(GPT(model_cfg, rngs=nnx.Rngs(seed)))


def dropout_key(base_key: jax.Array, step: int, micro_step: int) -> jax.Array:
    """The dropout key of one micro-batch: ``fold_in(fold_in(base_key, step), micro_step)``.

    Args:
      base_key: the run's key, ``jax.random.key(seed)`` (a replicated global array when sharded).
      step: the optimizer step.
      micro_step: the micro-batch within the step (gradient accumulation).
    """
    return jax.random.fold_in(jax.random.fold_in(base_key, step), micro_step)


def make_train_step(graphdef, tx: optax.GradientTransformation) -> Callable:
    """:func:`train_step_fn` compiled by :func:`jremat.jit`; ``params`` and ``opt_state`` are donated."""
    return jremat.jit(train_step_fn(graphdef, tx), donate_argnums=TRAIN_STEP_DONATE)


def make_eval_step(graphdef) -> Callable:
    """:func:`eval_step_fn` compiled by :func:`jremat.jit`."""
    return jremat.jit(eval_step_fn(graphdef))


def make_moe_aux_step(graphdef) -> Callable:
    """``(params, tokens) -> {"load_balance", "router_z"}`` of an MoE model with dropout off
    (:func:`models.moe_aux_losses`: means over the layers), compiled by :func:`jremat.jit`."""
    return jremat.jit(lambda params, tokens: moe_aux_losses(nnx.merge(graphdef, params), tokens))
