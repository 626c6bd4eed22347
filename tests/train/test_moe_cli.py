"""The MoE flags (``--moe-experts`` ...) in every CLI: declared once (:class:`train.model_flags.MoEFlags`),
listed by ``--help``, carried into each CLI's models; ``train.memory`` and ``train.ptb`` run an MoE model.

Their bad values are rows of tests/train/test_bad_input.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from jremat.train import memory, model_flags, ptb
from jremat.train.bench import cli as bench
from jremat.train.bench.config import BenchConfig, parse_config
from jremat.train.config import TrainConfig

MOE_FLAGS = [
    "--moe-experts",
    "--moe-top-k",
    "--moe-capacity-factor",
    "--moe-load-balance-coef",
    "--moe-router-z-coef",
    "--moe-shared-expert",
]
MOE_ARGV = ["--moe-experts", "4", "--moe-top-k", "1", "--moe-router-z-coef", "0.5", "--moe-shared-expert"]
MOE_FIELDS = dict(
    moe_experts=4,
    moe_top_k=1,
    moe_capacity_factor=1.25,
    moe_load_balance_coef=0.01,
    moe_router_z_coef=0.5,
    moe_shared_expert=True,
)


@pytest.mark.parametrize("main", [ptb.main, memory.main, bench.main], ids=["ptb", "memory", "bench"])
def test_every_cli_lists_the_moe_flags(main, capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(flag in text for flag in MOE_FLAGS)


def test_the_moe_flags_are_the_model_configs_fields():
    fields = [f.name for f in dataclasses.fields(model_flags.MoEFlags)]
    assert ["--" + name.replace("_", "-") for name in fields] == MOE_FLAGS
    defaults = {f.name: f.default for f in dataclasses.fields(model_flags.MoEFlags)}
    from jremat.models import ModelConfig

    assert defaults == {name: getattr(ModelConfig(), name) for name in fields}


def _moe_fields(cfg) -> dict:
    return {name: getattr(cfg, name) for name in MOE_FIELDS}


def test_the_moe_flags_reach_every_clis_models():
    train = ptb.parse_config(["--preset", "tiny", *MOE_ARGV])
    assert _moe_fields(train.model_config(64)) == MOE_FIELDS
    mem = memory.parse_config(["--preset", "tiny", *MOE_ARGV])
    assert _moe_fields(mem.model_config("full")) == MOE_FIELDS
    assert "--moe-shared-expert" in mem.model_argv() and "--moe-experts" in mem.model_argv()  # --live children
    assert memory.parse_config(["--preset", "tiny", *mem.model_argv()]).model_config("full") == mem.model_config("full")
    config = parse_config(["--quick", "--parts", "time,maxbatch", *MOE_ARGV])
    for cfg in (config.time_model(), config.block_model(), config.megatron_config("none")):
        assert _moe_fields(cfg) == MOE_FIELDS
    assert isinstance(config, BenchConfig) and isinstance(train, TrainConfig)
    assert ptb.parse_config(["--preset", "tiny"]).model_config(64).moe_experts == 0  # dense unless asked


@pytest.mark.heavy
def test_memory_reports_an_moe_model_under_each_policy(capsys, traced_reports):
    argv = ["--preset", "tiny", "--moe-experts", "4", "--moe-top-k", "2", "--policy", "none", "--policy", "full"]
    assert memory.main([*argv, "--batch-size", "2", "--json"]) == 0
    none, full = json.loads(capsys.readouterr().out)
    assert (none["policy"], full["policy"]) == ("none", "full")
    assert full["saved_bytes_per_layer"] == 2 * 16 * 32 * 4  # one float32 block input [2, 16, 32]
    assert full["saved_bytes_per_layer"] < none["saved_bytes_per_layer"]
    assert full["recompute_flops_fraction"] > 0 == none["recompute_flops_fraction"]


@pytest.mark.slow  # compiles and runs two policies' steps and the explanations (about 20 s)
def test_memory_cli_prints_rows_for_an_moe_model(capsys):
    argv = ["--preset", "tiny", "--moe-experts", "4", "--moe-top-k", "2", "--policy", "none", "--policy", "full"]
    assert memory.main(argv) == 0
    rows = [
        line.split()[0] for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["none"], ["full"])
    ]
    assert rows[:2] == ["none", "full"]


@pytest.mark.slow  # a few training steps and the evaluations (about 30 s)
def test_ptb_trains_an_moe_model_and_reports_its_router_losses(ptb_offline_dir, capsys, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--preset", "tiny", "--steps", "2", "--eval-batches", "1", "--eval-every", "1", "--no-memory-report"]
    argv += ["--data-dir", ptb_offline_dir, "--moe-experts", "4", "--moe-top-k", "2", "--moe-shared-expert"]
    assert ptb.main([*argv, "--metrics-file", str(metrics)]) == 0
    out = capsys.readouterr().out
    balance = float(out.split("MoE load balance (valid)")[1].split("|")[1].split()[0])
    router_z = float(out.split("MoE router z-loss (valid)")[1].split("|")[1].split()[0])
    assert 0 < balance <= 4 and router_z > 0  # E * sum_e f_e P_e is at most E (the f_e sum to 1)
    # The metrics file has them on the validation step (step 1; the last step's are the summary's).
    (first, last) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert 0 < first["moe_load_balance"] <= 4 and first["moe_router_z"] > 0, first
    assert "moe_load_balance" not in last and "valid_loss" not in last
