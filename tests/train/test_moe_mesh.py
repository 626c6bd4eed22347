"""Expert parallelism on 8 simulated devices: the MoE model's loss and gradients on a mesh with an
``expert`` axis equal those of the dropless model on one device when no token is dropped.

The device count is fixed before JAX starts, so the checks run in a subprocess
(tests/train/moe_mesh_checks.py) whose JSON figures the tests assert on. The capacity dispatch
itself is checked on one device against a per-token reference in tests/models/test_moe.py.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, TOLERANCE_XLA_FLAGS
from tests.train.moe_mesh_checks import MESHES


@pytest.fixture(scope="module")
def checks():
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {TOLERANCE_XLA_FLAGS}")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.train.moe_mesh_checks"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("device_count") == 8
    return result


@pytest.mark.slow  # a subprocess compiling the gradient step on one device and on three 8-device meshes
@pytest.mark.parametrize("spec", [spec for spec, _ in MESHES])
def test_expert_parallel_gradients_equal_the_dropless_model_on_one_device(checks, spec):
    entry = checks["grads"][spec]
    assert entry["loss_sharded"] == pytest.approx(checks["grads"]["loss_single"], rel=1e-6)
    assert entry["grad_max_rel_diff"] < 1e-5
    assert entry["all_to_all"] >= 4  # dispatch and combine, forward and backward: the experts did not move
    assert any("'expert'" in spec for spec in entry["expert_grad_specs"]), entry  # expert weights' grads split


@pytest.mark.slow  # the same subprocess
def test_a_small_capacity_drops_tokens(checks):
    drops = checks["drops"]
    assert abs(drops["loss_sharded"] - drops["loss_single"]) > 1e-4 * abs(drops["loss_single"])
