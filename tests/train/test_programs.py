"""train.programs: the GPT's programs on shape structs (traced and compiled, nothing allocated)."""

import jax
import pytest

import jremat
from jremat.models import preset
from jremat.train import programs
from jremat.train.programs import (
    TRAIN_STEP_DONATE,
    adam_step_memory,
    adam_train_step,
    analytic_peak_bytes,
    block_program,
    loss_program,
    shallow_config,
    step_flops,
    step_memory_report,
    step_program,
    step_residuals,
    traced_step_bytes,
)

BATCH = 2


@pytest.fixture(scope="module")
def tiny():
    return preset("tiny", n_layers=2)


def test_programs_take_shape_structs_only(tiny):
    loss, (params, tokens, targets, key) = loss_program(tiny, BATCH)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    assert tokens.shape == targets.shape == (BATCH, tiny.max_seq_len)
    assert jax.eval_shape(loss, params, tokens, targets, key).shape == ()
    grad_fn, args = step_program(tiny, BATCH, 8)
    grads = jax.eval_shape(grad_fn, *args)
    assert jax.tree.structure(grads) == jax.tree.structure(args[0])
    block_fn, (block_params, x, _) = block_program(tiny, BATCH, 8)
    assert x.shape == (BATCH, 8, tiny.d_model)
    assert jax.eval_shape(block_fn, block_params, x, key).shape == x.shape


@pytest.mark.parametrize(
    "batch, seq, message", [(0, 8, "must be positive"), (2, 10_000, "exceeds the model's max_seq_len")]
)
def test_loss_program_rejects_bad_shapes(tiny, batch, seq, message):
    with pytest.raises(ValueError, match=message):
        loss_program(tiny, batch, seq)


def test_traced_figures_follow_the_policy(tiny):
    none, full = tiny.replace(remat_policy="none"), tiny.replace(remat_policy="full")
    assert step_residuals(full, BATCH).saved_bytes < step_residuals(none, BATCH).saved_bytes
    assert step_flops(full, BATCH) > step_flops(none, BATCH)
    assert traced_step_bytes(full, BATCH) < traced_step_bytes(none, BATCH)


@pytest.mark.heavy
def test_adam_step_memory_counts_donated_state(tiny):
    step, _, _, args = adam_train_step(tiny, BATCH)
    report = adam_step_memory(tiny, BATCH)
    plain = jremat.memory_report(step, *args)
    assert report.available and report.alias_bytes > 0 and plain.alias_bytes == 0
    assert TRAIN_STEP_DONATE == (0, 1)


def test_step_memory_report_compiles_once_per_config_and_engine(tiny, monkeypatch):
    compiled = []
    monkeypatch.setattr(jremat, "memory_report", lambda fn, *args: compiled.append(args) or len(compiled))
    batch = 3
    before = jax.config.jax_remat3
    programs._step_memory_report.cache_clear()
    try:
        assert step_memory_report(tiny, batch) == step_memory_report(tiny, batch, tiny.max_seq_len) == 1
        assert step_memory_report(tiny.replace(remat_policy="none"), batch) == 2
        jax.config.update("jax_remat3", not before)
        assert step_memory_report(tiny, batch) == 3  # the other engine compiles another program
        jax.config.update("jax_remat3", before)
        assert step_memory_report(tiny, batch) == 1 and len(compiled) == 3
    finally:
        jax.config.update("jax_remat3", before)
        programs._step_memory_report.cache_clear()  # drop the fake reports


@pytest.mark.parametrize(
    "changes, layers, groups",
    [
        ({}, 2, ""),
        ({"remat_layer_policies": "1:full,3:dots"}, 5, "1:full,2:dots"),  # 8 uncovered layers keep 2
        ({"remat_layer_policies": "3:full,rest:none"}, 4, "2:full,2:none"),
        (
            {"remat_layer_policies": "2:every_k:k=2,skip_cheap=true,rest:none"},
            4,
            "2:every_k:k=2,skip_cheap=true,2:none",
        ),
        ({"remat_layer_policies": "12:full"}, 2, "2:full"),  # the groups cover the stack exactly
        ({"remat_policy": "nested:block=3,layer=full"}, 12, ""),  # nested groups are the structure
        ({"scan_layers": False}, 12, ""),  # unrolled: kept whole
    ],
)
def test_shallow_config_keeps_two_layers_per_group(changes, layers, groups):
    shallow = shallow_config(preset("tiny", n_layers=12, **changes))
    assert (shallow.n_layers, shallow.remat_layer_policies) == (layers, groups)
    assert shallow_config(preset("tiny", n_layers=1)).n_layers == 1


# A block's backward, not the head, sets the peak here: explicit attention's [b, a, s, s] buffers
# with a 64-token vocabulary. Four scanned layers, estimated from a two-layer copy.
WORKING_SET_CASES = [
    ("explicit", "full"),
    ("blockwise", "selective"),
    pytest.param("explicit", "selective", marks=pytest.mark.slow),
    pytest.param("explicit", "none", marks=pytest.mark.slow),
    pytest.param("blockwise", "full", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("attention, policy", WORKING_SET_CASES)
@pytest.mark.heavy
def test_analytic_peak_counts_one_blocks_backward_working_set(attention, policy, monkeypatch):
    cfg = preset("tiny", n_layers=4, max_seq_len=256, remat_policy=policy, attention=attention, attention_block_size=64)
    cfg = cfg.replace(remat_head_chunks=4 if policy != "none" else 0)
    compiled_depths = []
    compile_step = programs._step_memory_report

    def recording(model_cfg, *rest):
        compiled_depths.append(model_cfg.n_layers)
        return compile_step(model_cfg, *rest)

    monkeypatch.setattr(programs, "_step_memory_report", recording)
    estimate = analytic_peak_bytes(cfg, 2, 256)
    assert compiled_depths == [2]  # the estimate compiles the two-layer copy, never the model itself
    peak = step_memory_report(cfg, 2, 256).peak_bytes
    assert abs(estimate - peak) <= 0.10 * peak
    if attention == "explicit":  # without the working set the estimate would miss by far more than 10%
        assert traced_step_bytes(cfg, 2, 256) < 0.8 * peak
