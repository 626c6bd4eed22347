"""jremat._measure.live: the allocator's peak after one run, or why the device cannot report it."""

import jax
import pytest

import jremat


def test_live_memory_on_cpu_says_not_available():
    if jax.devices()[0].memory_stats():
        pytest.skip("this device reports allocator statistics; the CPU path is not exercised")
    ran = []
    result = jremat.live_memory(lambda: ran.append(1))
    assert not result.available and result.peak_bytes_in_use is None
    assert "memory_stats() is None" in result.reason and ran == []
