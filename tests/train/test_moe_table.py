"""train.bench.moe_table: its targets read from the rows, and bad input is one error line, exit 2
(the table itself is a command: docs/moe.md and docs/RESULTS.md hold what it printed)."""

from jremat.models import preset
from jremat.train.bench import moe_table


def _row(policy, peak, flops, grouped, residuals, peer=False):
    return dict(
        policy=policy,
        peer=peer,
        peak_bytes=peak,
        temp_bytes=peak // 2,
        residual_bytes=residuals,
        flops=flops,
        grouped_matmuls=grouped,
    )


def test_the_targets_read_the_rows():
    cfg = preset("tiny", moe_experts=8, moe_top_k=2)
    activation = moe_table.activation_bytes(cfg, 8)
    assert activation == cfg.n_layers * 8 * cfg.max_seq_len * 2 * cfg.d_ff * 4
    rows = [
        _row("none", 10 * activation, 1000.0, 12, 5 * activation),
        _row("dots", 9 * activation, 1010.0, 12, 4 * activation),
        _row("skip_cheap", 9 * activation, 1010.0, 14, 4 * activation),
        _row("selective", 8 * activation, 1015.0, 12, 3 * activation),
    ]
    lines = "\n".join(moe_table.markdown("tiny", cfg, 8, rows))
    assert "re-run no grouped matmul: MISSED (none runs 12; dots 12, skip_cheap 14)" in lines
    assert "recompute <= 2% of the step's FLOPs: met (1.50%)" in lines
    assert "by at least the experts' activation outputs" in lines and ": met (it is" in lines
    assert "selective:modules=moe_act" not in lines  # a variant not measured gets no target lines
    rows.append(_row("selective:modules=moe_act", 8 * activation, 1012.0, 12, 4 * activation))
    lines = "\n".join(moe_table.markdown("tiny", cfg, 8, rows))
    assert "`selective:modules=moe_act`'s recompute <= 2% of the step's FLOPs: met (1.20%)" in lines
    rows[3] = _row("selective", 10 * activation - 1, 1030.0, 12, 5 * activation - 1)
    lines = "\n".join(moe_table.markdown("tiny", cfg, 8, rows))
    assert (
        "FLOPs: MISSED (3.00%)" in lines and "activation outputs (" in lines and "): MISSED (it is 1 B below" in lines
    )


def test_bad_input_is_one_error_line_and_exit_2(capsys):
    assert moe_table.main(["--moe-experts", "4", "--moe-top-k", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: need --moe-experts >= 1, 1 <= --moe-top-k <= --moe-experts")
    assert moe_table.main(["--preset", "huge"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice: 'huge'" in err[0], err
