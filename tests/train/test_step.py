"""Optimizer and train step: warmup schedule, gradient accumulation, config defaults."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jremat.models import preset
from jremat.train.cli import UsageError
from jremat.train.config import TrainConfig
from jremat.train.step import OptimizerConfig, init_params, learning_rate_schedule, make_train_step


def test_schedule_warms_up_linearly_then_decays_to_a_tenth():
    schedule = learning_rate_schedule(1.0, warmup_steps=4, total_steps=14)
    with jax.numpy_dtype_promotion("standard"):
        values = [float(schedule(s)) for s in range(15)]
    np.testing.assert_allclose(values[:5], [0.0, 0.25, 0.5, 0.75, 1.0], atol=1e-6)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))
    assert values[14] == pytest.approx(0.1)


@pytest.mark.heavy
def test_accumulating_two_half_batches_equals_one_full_batch():
    cfg = preset("tiny", attn_dropout=0.0, resid_dropout=0.0, remat_policy="none")
    tokens = jax.random.randint(jax.random.key(1), (4, cfg.max_seq_len), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    key = jax.random.key(0)

    steps = {}
    graphdef, initial = init_params(cfg, 0)

    def run(accum, micro_batches):
        params = jax.tree.map(jnp.copy, initial)  # the step donates its inputs
        tx = OptimizerConfig(1e-2, 0, 10, 0.0, 0.01, accum).build()
        opt_state = tx.init(params)
        step = steps.setdefault(accum, make_train_step(graphdef, tx))
        for tok, tgt in micro_batches:
            params, opt_state, _ = step(params, opt_state, tok, tgt, key)
        return params, optax.tree_utils.tree_get(opt_state, "mu")

    # Adam's first moment is linear in the gradient, so it compares robustly (the update itself
    # is about lr * sign(g), which float noise flips for gradients that are zero in exact arithmetic).
    full_params, full_mu = run(1, [(tokens, targets)])
    halves_params, halves_mu = run(2, [(tokens[:2], targets[:2]), (tokens[2:], targets[2:])])
    scale = max(float(jnp.max(jnp.abs(m))) for m in jax.tree.leaves(full_mu))
    for a, b in zip(jax.tree.leaves(full_mu), jax.tree.leaves(halves_mu)):
        np.testing.assert_allclose(a, b, atol=1e-5 * scale)
    first_only_params, _ = run(2, [(tokens[:2], targets[:2])])
    for c, init in zip(jax.tree.leaves(first_only_params), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(c, init)  # no update until the accum-th micro-batch
    moved = [not np.allclose(a, i) for a, i in zip(jax.tree.leaves(halves_params), jax.tree.leaves(initial))]
    assert sum(moved) > len(moved) // 2


def test_train_config_defaults_and_model_config():
    cfg = TrainConfig(preset="needle", policy="every_k", policy_keys=(("k", "4"),), dtype="bfloat16", dropout=0.2)
    assert cfg.seq_len == preset("needle").max_seq_len and cfg.batch_size == 20 and cfg.steps == 1000
    model_cfg = cfg.model_config(vocab_size=123)
    assert model_cfg.vocab_size == 123 and model_cfg.remat_policy == "every_k:k=4"
    assert model_cfg.dtype == "bfloat16" and model_cfg.param_dtype == "float32"
    assert model_cfg.attn_dropout == model_cfg.resid_dropout == 0.2
    assert TrainConfig(preset="tiny", epochs=2.0).steps is None
    with pytest.raises(UsageError, match="unknown preset 'huge'; valid presets: tiny"):
        TrainConfig(preset="huge")
    with pytest.raises(UsageError, match="--dropout must be in"):
        TrainConfig(dropout=1.0)
