"""One set of figures: train.ptb's start-up line, train.memory's table and explain measure against one ``none``."""

import jax
import pytest

from jremat import format_bytes
from jremat.models import PRESETS, preset
from jremat.train import memory as tm
from jremat.train import ptb
from jremat.train.policy_memory import compare_policies, config_for_spec, format_recompute, summary_line

SHAPE = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "8"]


@pytest.mark.heavy
def test_startup_line_and_memory_table_agree_for_one_configuration():
    train_cfg = ptb.parse_config(SHAPE + ["--policy", "every_k", "--k", "2"])
    model_cfg = train_cfg.model_config(PRESETS["tiny"].vocab_size)
    memory_cfg = tm.parse_config(SHAPE + ["--policy", "every_k:k=2"])
    assert model_cfg == config_for_spec(memory_cfg.model_config("every_k:k=2"), "every_k:k=2", 2, 8, whole_step=True)[0]
    (row,), base = tm.run(memory_cfg)
    assert row.head_chunks == model_cfg.remat_head_chunks == 4 and base.head_chunks == 0
    (log_row,), log_base = compare_policies(
        model_cfg, train_cfg.batch_size, [model_cfg.remat_policy], train_cfg.seq_len
    )
    for field in ("peak_bytes", "temp_bytes", "saved_bytes_per_layer", "analytic_peak_bytes", "step_flops"):
        assert getattr(log_row, field) == getattr(row, field), field
        assert getattr(log_base, field) == getattr(base, field), field
    assert abs(log_row.recompute_flops_fraction - row.recompute_flops_fraction) < 1e-3
    line = ptb.memory_report(model_cfg, train_cfg.batch_size, train_cfg.seq_len)
    assert line == summary_line(row, base)
    # On a mesh the same figures are the unsharded step's, beside the sharded step's per-device line: labelled.
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("fsdp",))
    on_mesh = ptb.memory_report(model_cfg, train_cfg.batch_size, train_cfg.seq_len, mesh)
    assert on_mesh == f"one device, unsharded, global batch {train_cfg.batch_size}: {line}"
    table = tm.format_table([row], base)
    for figure in (format_bytes(row.peak_bytes), format_recompute(row.recompute_flops_fraction), "4 chunks"):
        assert figure in line and figure in table, figure
    assert f"none: {format_bytes(base.peak_bytes)}" in line
    assert "head 4 chunks" in line and "none = no remat anywhere" in line and "none = no remat anywhere" in table


@pytest.mark.heavy
def test_explains_baseline_is_the_same_step_under_every_policy():
    # one report: none keeps its head whole, full chunks it; "without remat" is one step for both
    rows, base = compare_policies(preset("tiny"), 2, ["none", "full"], 8, compile=False, explain=True, whole_step=True)
    none, full = rows
    assert (none.head_chunks, full.head_chunks, base.head_chunks) == (0, 4, 0)
    assert none.explanation.baseline_saved_bytes == full.explanation.baseline_saved_bytes
    assert none.explanation.baseline_saved_bytes == none.explanation.saved_bytes > full.explanation.saved_bytes


def test_a_none_spec_with_a_chunked_head_is_its_own_row_against_the_whole_head():
    # --remat-head-chunks 4 --policy none: the head is recomputed, so it is not the baseline
    (row,), base = compare_policies(preset("tiny", remat_head_chunks=4), 2, ["none"], 8, compile=False)
    assert (row.policy, row.head_chunks, base.head_chunks) == ("none", 4, 0)
    assert row.recompute_flops_fraction > 0 == base.recompute_flops_fraction
