"""ModelConfig: the presets read without JAX; remat fields other than the defaults are checked."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from jremat.models import PRESETS, ModelConfig
from tests.conftest import REPO


def test_the_presets_and_config_read_without_jax_or_flax():
    script = (
        "import sys; from jremat.models import PRESETS; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_default_remat_fields_fit_every_preset(name):
    """The defaults ModelConfig does not check are valid for every preset's stack."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    preset = PRESETS[name]
    assert (preset.remat_policy, preset.remat_granularity, preset.remat_layer_policies) == (
        defaults["remat_policy"],
        defaults["remat_granularity"],
        defaults["remat_layer_policies"],
    )
    for n_layers in (1, 2, 3, preset.n_layers):
        preset.replace(n_layers=n_layers).remat_config().validate_layers(n_layers)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(remat_policy="nosuch"), "unknown policy 'nosuch'"),
        (dict(remat_policy="nested:block=3"), "block=3 does not divide the 2 layers"),
        (dict(remat_granularity="everywhere"), "unknown remat granularity 'everywhere'"),
    ],
)
def test_other_remat_fields_are_checked(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(n_layers=2, **changes)
