"""Every registered policy gives the gradients of no remat, with dropout on.

Parametrized from the registry: a newly registered policy is covered automatically, and this
file fails until the policy has an example spec in :data:`EXAMPLE_SPECS` (policies with required
keys cannot be built from their bare name).
"""

import pytest

import jremat
from tests.conftest import loss_and_grads, max_relative_error

#: One example spec per registered policy (the bare name where that is valid).
EXAMPLE_SPECS = {
    "none": "none",
    "full": "full",
    "dots": "dots",
    "dots_no_batch": "dots_no_batch",
    "every_k": "every_k:k=2",
    "skip_cheap": "skip_cheap",
    "selective": "selective",
    "names": "names:save=q+k+mlp_in",
    "names_except": "names_except:exclude=attn_probs+mlp_act",
    "offload": "offload:names=q+k,save=v",
    "nested": "nested:block=2",
    "auto": "auto",
}

TOLERANCE = 1e-5


def test_every_registered_policy_has_an_example_spec():
    missing = sorted(set(jremat.available()) - set(EXAMPLE_SPECS))
    assert not missing, f"add example specs for {missing} to EXAMPLE_SPECS in {__file__}"


@pytest.fixture(scope="module")
def reference(request):
    cfg = request.getfixturevalue("module_tiny_config")
    return loss_and_grads(cfg.replace(remat_policy="none", remat_granularity="none"))


@pytest.fixture(scope="module")
def module_tiny_config():
    from jremat.models import preset

    return preset("tiny", attn_dropout=0.5, resid_dropout=0.5)


# In CI: every policy at block granularity over a scanned stack (under both remat engines), and
# at sublayer granularity over an unrolled stack the policies whose saved sets differ most
# (:data:`UNROLLED_IN_CI`); the rest of the matrix runs with ``-m slow``.
UNROLLED_IN_CI = {"full", "every_k", "selective", "names", "offload", "auto"}


def _layouts(name):
    slow = pytest.mark.slow
    return [
        pytest.param(name, "block", True, id=f"{name}-block-scan"),
        pytest.param(
            name, "sublayer", False, id=f"{name}-sublayer-unrolled", marks=() if name in UNROLLED_IN_CI else slow
        ),
        pytest.param(name, "block", False, id=f"{name}-block-unrolled", marks=slow),
        pytest.param(name, "sublayer", True, id=f"{name}-sublayer-scan", marks=slow),
    ]


@pytest.mark.parametrize("name, granularity, scan_layers", [p for name in jremat.available() for p in _layouts(name)])
def test_gradients_match_no_remat(name, granularity, scan_layers, module_tiny_config, reference):
    if name not in EXAMPLE_SPECS:
        pytest.fail(f"policy {name!r} has no example spec in EXAMPLE_SPECS")
    cfg = module_tiny_config.replace(
        remat_policy=EXAMPLE_SPECS[name], remat_granularity=granularity, scan_layers=scan_layers
    )
    loss, grads = loss_and_grads(cfg)
    ref_loss, ref_grads = reference
    assert abs(float(loss) - float(ref_loss)) <= TOLERANCE * abs(float(ref_loss))
    assert max_relative_error(grads, ref_grads) <= TOLERANCE
