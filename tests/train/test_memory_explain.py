"""The explain section of ``python -m train.memory``: text after the table, an ``explain`` object per JSON row."""

import json

import pytest

import jremat.train.memory as tm
from jremat.models import preset
from jremat.train.policy_memory import compare_policies


@pytest.mark.heavy
def test_explain_section_reports_decisions_and_names_per_policy():
    cfg = preset("tiny", remat_policy="none")
    rows, _ = compare_policies(cfg, 2, ["names:save=q+mlp_act", "full"], compile=False, explain=True)
    names, full = (r.explanation for r in rows)
    # The names policy saves exactly its two tags, once per layer, inside the layer scan.
    (save,) = [d for d in names.decisions if d.decision == "save"]
    assert save.names == ("q", "mlp_act") and save.count == 2 and save.iterations == cfg.n_layers
    assert save.where.startswith("inside scan(length=2)")
    assert [(m.name, m.count) for m in names.names] == [("q", 2), ("mlp_act", 2)]
    # The model's own checkpoints (LayerNorm, softmax, GELU) are not counted as the policy's.
    assert names.checkpoints == full.checkpoints == 1
    assert full.count("save") == 0 and full.count("recompute") > 0
    text = tm.format_explanations(rows)
    assert "policy 'names:save=q+mlp_act' on the gradient step: 1 checkpoint" in text
    assert "  name save 'mlp_act': 2 values" in text
    row = json.loads(json.dumps(rows[0].to_json()))
    assert row["explain"]["names"] == [
        {"role": "save", "name": "q", "count": 2, "bytes": 2 * 2 * 16 * 32 * 4},
        {"role": "save", "name": "mlp_act", "count": 2, "bytes": 2 * 2 * 16 * 64 * 4},
    ]


@pytest.mark.heavy
def test_cli_prints_the_explain_section_and_json(capsys):
    argv = ["--preset", "tiny", "--batch-size", "2", "--layers", "1", "--policy", "none"]
    assert tm.main(argv + ["--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["explain"]["checkpoints"] == 0 and row["explain"]["messages"] == [
        "no checkpoint (none): the policy adds no checkpoint to the traced function; the policy keeps every value"
    ]
    assert tm.main(argv) == 0
    out = capsys.readouterr().out
    assert "explain (what each policy did to the step; jremat.explain):" in out
    assert "policy 'none' on the gradient step: 0 checkpoints" in out


@pytest.mark.heavy
def test_explain_section_names_each_kernel_run_again_per_layer():
    """Under ``--attention pallas`` the explain section and JSON name the Pallas forward kernel that
    ``full`` runs again (per layer, beside none's count) and list every kernel's runs; ``selective``
    runs each once."""
    cfg = preset("tiny", remat_policy="none", attention="pallas", attn_dropout=0.0, resid_dropout=0.0)
    rows, _ = compare_policies(cfg, 1, ["full", "selective"], compile=False, explain=True)
    text = tm.format_explanations(rows)
    assert "kernel re-run (full): kernel mha_forward: 2 runs per layer, none: 1; selective keeps" in text
    assert "kernel re-run (selective)" not in text
    full, selective = (json.loads(json.dumps(r.to_json()))["explain"]["kernel_runs"] for r in rows)
    runs = {k["name"]: (k["runs"], k["baseline_runs"]) for k in full}
    assert runs["mha_forward"] == (2, 1) and runs["mha_backward"] == (1, 1)
    assert all(k["runs"] == k["baseline_runs"] == 1 for k in selective)
