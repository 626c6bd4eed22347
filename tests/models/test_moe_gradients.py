"""Every registered policy gives the MoE model the gradients of no remat, with dropout on, under both
remat engines; a remat that draws a fresh dropout key on recompute is caught here too (``-m slow``).

The dense model's matrix is tests/policies/test_policy_gradients.py (its example specs are reused,
with MoE tags where they name MLP tags). In CI: ``full`` over a scanned stack of blocks under the
classic engine and ``names`` per sublayer over an unrolled stack under remat3; the rest with ``-m slow``.
"""

import pytest

import jremat
from jremat.models import preset
from tests.conftest import loss_and_grads, max_relative_error, run_under_engine
from tests.models.test_remat_gradients import FreshKeyOnRecompute
from tests.policies.test_policy_gradients import EXAMPLE_SPECS

#: :data:`EXAMPLE_SPECS` with the MoE block's tags in place of the dense MLP's (which it lacks).
MOE_SPECS = EXAMPLE_SPECS | {
    "names": "names:save=q+k+moe_hidden_up+moe_hidden",
    "names_except": "names_except:exclude=attn_probs+moe_hidden_pre_act",
    "offload": "offload:names=q+moe_dispatched,save=v",
}

TOLERANCE = 1e-5

#: ``(policy, granularity, scan_layers, engine)`` run in CI; every other combination is slow.
IN_CI = {("full", "block", True, "classic"), ("names", "sublayer", False, "remat3")}


def test_every_registered_policy_has_an_moe_example_spec():
    missing = sorted(set(jremat.available()) - set(MOE_SPECS))
    assert not missing, f"add example specs for {missing} to EXAMPLE_SPECS in tests/policies/test_policy_gradients.py"


@pytest.fixture(scope="module")
def moe_config():
    return preset("tiny", attn_dropout=0.5, resid_dropout=0.5, moe_experts=4, moe_top_k=2)


@pytest.fixture(scope="module")
def reference(moe_config):
    return loss_and_grads(moe_config.replace(remat_policy="none", remat_granularity="none"))


def _cases():
    for name in jremat.available():
        for granularity, scan in (("block", True), ("sublayer", False), ("block", False), ("sublayer", True)):
            for engine in ("classic", "remat3"):
                layout = f"{granularity}-{'scan' if scan else 'unrolled'}"
                marks = () if (name, granularity, scan, engine) in IN_CI else pytest.mark.slow
                yield pytest.param(name, granularity, scan, engine, id=f"{engine}-{name}-{layout}", marks=marks)


@pytest.mark.parametrize("name, granularity, scan_layers, engine", list(_cases()))
@pytest.mark.heavy
def test_moe_gradients_match_no_remat(name, granularity, scan_layers, engine, moe_config, reference):
    if name not in MOE_SPECS:
        pytest.fail(f"policy {name!r} has no example spec")
    cfg = moe_config.replace(remat_policy=MOE_SPECS[name], remat_granularity=granularity, scan_layers=scan_layers)
    with run_under_engine(engine):
        loss, grads = loss_and_grads(cfg)
    ref_loss, ref_grads = reference
    assert abs(float(loss) - float(ref_loss)) <= TOLERANCE * abs(float(ref_loss))
    assert max_relative_error(grads, ref_grads) <= TOLERANCE


@pytest.fixture
def broken_policy():
    with jremat.registry.scoped():
        jremat.register("test_fresh_key_on_recompute", doc="broken on purpose")(FreshKeyOnRecompute)
        yield "test_fresh_key_on_recompute"


@pytest.mark.slow  # the dense model's control runs in CI (tests/models/test_remat_gradients.py)
def test_fresh_dropout_key_on_recompute_is_caught_in_the_moe_model(moe_config, reference, broken_policy):
    loss, grads = loss_and_grads(moe_config.replace(remat_policy=broken_policy, remat_granularity="block"))
    assert abs(float(loss) - float(reference[0])) <= TOLERANCE * abs(float(reference[0]))  # the forward is untouched
    assert max_relative_error(grads, reference[1]) > 100 * TOLERANCE
