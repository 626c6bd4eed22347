"""jremat._measure.memory: the compiled memory report (compile-only, tiny) and the remat diagnosis."""

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat._measure import compile as _compile
from jremat._measure import memory as jmem
from jremat.models import preset
from jremat.train.programs import step_program
from tests.conftest import ANALYSIS_CPU_OPTIONS


def test_memory_report_fields_positive_and_consistent():
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    report = jremat.memory_report(jax.grad(f), w, x)
    assert report.available
    assert report.argument_bytes == (64 * 64 + 32 * 64) * 4
    assert report.output_bytes == 64 * 64 * 4
    assert report.temp_bytes > 0
    assert report.peak_bytes >= report.temp_bytes
    assert report.peak_bytes >= report.summed_peak_bytes - report.temp_bytes
    if report.peak_source == jmem.PEAK_FROM_SUM:
        assert report.peak_bytes == report.summed_peak_bytes


class _FakeStats:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _FakeCompiled:
    def __init__(self, stats):
        self.stats = stats

    def memory_analysis(self):
        return self.stats


def test_unavailable_memory_analysis_is_reported_not_zero():
    none = jmem.compiled_memory_report(_FakeCompiled(None), platform="tpu")
    assert not none.available and none.peak_bytes is None and "18954" in none.notes[0]
    zeros = _FakeStats(
        argument_size_in_bytes=0,
        output_size_in_bytes=0,
        alias_size_in_bytes=0,
        temp_size_in_bytes=0,
        generated_code_size_in_bytes=0,
    )
    report = jmem.compiled_memory_report(_FakeCompiled(zeros), platform="gpu")
    assert not report.available and report.temp_bytes is None and "zero" in report.notes[0]


def test_peak_source_backend_vs_sum():
    stats = dict(
        argument_size_in_bytes=100,
        output_size_in_bytes=50,
        alias_size_in_bytes=10,
        temp_size_in_bytes=1000,
        generated_code_size_in_bytes=0,
    )
    full_peak = jmem.compiled_memory_report(
        _FakeCompiled(_FakeStats(peak_memory_in_bytes=1200, **stats)), platform="gpu"
    )
    assert full_peak.peak_source == jmem.PEAK_FROM_BACKEND and full_peak.peak_bytes == 1200
    cpu_like = jmem.compiled_memory_report(_FakeCompiled(_FakeStats(peak_memory_in_bytes=150, **stats)), platform="cpu")
    assert cpu_like.peak_source == jmem.PEAK_FROM_SUM and cpu_like.peak_bytes == 100 + 50 - 10 + 1000
    assert "leaves temp buffers out" in cpu_like.notes[0]
    # XLA:CPU's argument + output can exceed a small temp; it still leaves temp out.
    small_temp = dict(stats, temp_size_in_bytes=40)
    cpu_big = jmem.compiled_memory_report(
        _FakeCompiled(_FakeStats(peak_memory_in_bytes=150, **small_temp)), platform="cpu"
    )
    assert cpu_big.peak_source == jmem.PEAK_FROM_SUM and cpu_big.peak_bytes == 100 + 50 - 10 + 40


def test_diagnose_remat_flags_temp_that_did_not_follow():
    note = jremat.diagnose_remat(100, 100, 10.0, 1000.0, scan_layers=False)
    assert note is not None and "concurrency" in note and "fell" in note
    assert jremat.diagnose_remat(50, 100, 10.0, 100.0, scan_layers=True) is None
    assert jremat.diagnose_remat(100, 100, 95.0, 100.0) is None  # residuals barely changed


@pytest.mark.parametrize(
    "policy, scan_layers", [("none", True), ("full", False)], ids=["none-scanned", "full-unrolled-tied"]
)
@pytest.mark.heavy
def test_suite_analysis_options_keep_the_default_buffer_assignment(policy, scan_layers):
    """The suite's memory analyses use :data:`conftest.ANALYSIS_CPU_OPTIONS`; users' use XLA's defaults.

    On these two programs the two differ only in temp, by at most 256 bytes.
    """
    if not ANALYSIS_CPU_OPTIONS:
        pytest.skip("the suite adds no analysis options here (not the CPU, or XLA lacks them)")
    assert _compile.analysis_options() == {**jremat.compiler_options(), **ANALYSIS_CPU_OPTIONS}
    cfg = preset("tiny", remat_policy=policy, remat_granularity="block", scan_layers=scan_layers)
    grad_fn, args = step_program(cfg, 4)
    suite = jremat.memory_report(grad_fn, *args)
    default = jremat.memory_report(grad_fn, *args, compiler_options=jremat.compiler_options())
    for field in ("argument_bytes", "output_bytes", "alias_bytes"):
        assert getattr(suite, field) == getattr(default, field), field
    assert abs(suite.temp_bytes - default.temp_bytes) <= 256, (suite.temp_bytes, default.temp_bytes)
    assert suite.notes == default.notes
