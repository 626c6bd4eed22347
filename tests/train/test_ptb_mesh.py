"""``python -m train.ptb --batch-size auto --mesh ...``: the batch chosen against a per-device budget.

The search runs in a subprocess on 8 simulated CPU devices (the device count is fixed before JAX
starts); the flags are checked in-process.
"""

import json
import os
import subprocess
import sys

import pytest

from jremat.train import ptb
from tests.compile_flags import FAST_COMPILE_XLA_FLAGS
from tests.conftest import REPO, TOLERANCE_XLA_FLAGS

#: Per device: above the sharded Adam step's peak of ``full`` at 1 sequence per data-parallel shard
#: and below its peak at 2 (178 KiB and about 249 KiB on XLA:CPU, 64 words, 16 tokens).
BUDGET_BYTES = 220_000

SEARCH = f"""
import json
from jremat.train import ptb, sharding
from jremat.train.config import TrainConfig

mesh = sharding.mesh_from_flag("fsdp=8")
cfg = TrainConfig(
    preset="tiny", policy="full", batch_size="auto", memory_budget="{BUDGET_BYTES}", seq_len=16,
    remat_head_chunks=0, unrolled=True, steps=1, mesh="fsdp=8",
)
chosen, model_cfg, table = ptb.fit_batch(cfg, 64, False, mesh)
print(table)
print(json.dumps({{"batch_size": chosen.batch_size, "policy": model_cfg.remat_policy}}))
"""


@pytest.mark.slow  # a fit search (4 compiles of the sharded train step, one timed) on 8 devices
def test_batch_size_auto_on_a_mesh_chooses_against_the_per_device_budget():
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {TOLERANCE_XLA_FLAGS} {FAST_COMPILE_XLA_FLAGS}",
    )
    proc = subprocess.run(
        [sys.executable, "-c", SEARCH], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    *table, last = proc.stdout.strip().splitlines()
    chosen = json.loads(last)
    # One sequence per shard fits the per-device budget, two do not: the global batch is 1 x 8 shards.
    assert chosen == {"batch_size": 8, "policy": "full"}
    said = "\n".join(table)
    assert f"fit for budget 214.84 KiB ({BUDGET_BYTES:,} B) per device" in said
    assert "fit: training with full at batch 1 per data-parallel shard, global batch 8 on --mesh fsdp=8" in said
    winner = next(line for line in table if line.rstrip().endswith("<- winner"))
    assert winner.split()[:2] == ["full", "1"]


def test_batch_size_auto_takes_a_mesh():
    argv = ["--preset", "tiny", "--batch-size", "auto", "--memory-budget", "1MiB", "--mesh", "fsdp=8"]
    assert ptb.parse_config(argv).batch_size == "auto"


def test_batch_size_auto_on_a_mesh_refuses_a_fractional_budget(capsys):
    argv = ["--preset", "tiny", "--batch-size", "auto", "--memory-budget", "0.5", "--mesh", "fsdp=8"]
    assert ptb.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --batch-size auto needs --memory-budget as a size") and err.count("\n") == 1
