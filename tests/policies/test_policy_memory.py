"""Compile-only memory ordering of the policies on a small multi-layer model (nothing runs)."""

import functools

import pytest

from jremat.models import preset
from tests.conftest import train_step_memory


@functools.cache
def temp_bytes(spec: str, layer_policies: str = "", scan_layers: bool = True) -> int:
    cfg = preset(
        "small",
        n_layers=4,
        vocab_size=256,
        remat_policy=spec,
        remat_granularity="block",
        remat_layer_policies=layer_policies,
        scan_layers=scan_layers,
    )
    return train_step_memory(cfg).temp_bytes


@pytest.mark.heavy
def test_every_k_orders_between_none_and_full():
    none, k2, k8, full = (temp_bytes(s) for s in ("none", "every_k:k=2", "every_k:k=8", "full"))
    assert none >= k2 >= k8 >= full
    assert none > full


def test_selective_uses_less_than_none():
    assert temp_bytes("selective") < temp_bytes("none")


@pytest.mark.heavy
def test_layer_groups_between_none_and_full():
    """Rematerializing 2 of 4 layers keeps less than none and more than full."""
    mixed = temp_bytes("none", "2:full")
    assert temp_bytes("full") < mixed < temp_bytes("none")


@pytest.mark.heavy
def test_nested_between_none_and_full():
    """√L groups: two group inputs plus one recomputed group's activations."""
    assert temp_bytes("full") < temp_bytes("nested:block=2") < temp_bytes("none")
