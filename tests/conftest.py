"""Shared fixtures and strict numerics for the whole suite."""

import contextlib
import functools
import glob
import os
import pathlib

from tests.compile_flags import FAST_COMPILE_XLA_FLAGS

# XLA reads XLA_FLAGS once, at backend start, so this must run before anything imports jax.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE_XLA_FLAGS).strip()
# Many tests compile the same small programs (the no-remat baseline above all), here and in the
# processes they start (CLIs, doc pages, 8-device checks): all share JAX's persistent cache in
# pytest's cache folder, which JAX reads from the environment when it starts. XLA's compiled
# memory figures are the same when an executable comes from the cache.
os.environ.update(
    JAX_COMPILATION_CACHE_DIR=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".pytest_cache", "jax"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jcore

import jremat
import jremat.testing
from jremat._engine.jax_compat import saved_residuals as _jax_saved_residuals
from jremat._measure import compile as _compile
from jremat._measure.memory import PEAK_FROM_SUM
from jremat.models import GPT, cross_entropy_loss, preset
from jremat.train import programs
from jremat.train.programs import step_program

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

#: The repository root: the working directory of the tests that start a Python subprocess.
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


#: Policies that mean nothing on a model without attention (its MLP-only user models): they
#: raise :class:`jremat.PolicyDoesNotApply` there instead of silently keeping everything.
ATTENTION_ONLY_POLICIES = frozenset({"selective"})


def expect_does_not_apply(policy: str):
    """A context manager: ``pytest.raises(PolicyDoesNotApply)`` for an attention-only policy, else nothing."""
    if policy.partition(":")[0] in ATTENTION_ONLY_POLICIES:
        return pytest.raises(jremat.PolicyDoesNotApply, match="no attention core")
    return contextlib.nullcontext()


def single_function_policies(tags=(), **kwargs) -> list:
    """:func:`jremat.testing.policies` without the layer-stack entry ``nested``, which wraps a stack
    of layers rather than one function (its gradients are checked on a layer stack in
    tests/policies/test_policy_gradients.py, its kernel runs in tests/jremat/_program/test_kernels.py)."""
    return [p for p in jremat.testing.policies(tags, **kwargs) if p.id != "nested"]


@pytest.fixture
def megablox_promotion():
    """JAX's standard dtype promotion inside the test: JAX's megablox kernels mix bools and ints,
    which the suite's strict promotion refuses."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@contextlib.contextmanager
def run_under_engine(name: str):
    """A context manager: JAX's ``"classic"`` or ``"remat3"`` remat engine inside, the flag restored after."""
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", name == "remat3")
    try:
        yield name
    finally:
        jax.config.update("jax_remat3", before)


@pytest.fixture(params=["classic", "remat3"])
def remat_engine(request):
    """Run the test under one of JAX's remat engines (``jax_remat3`` off or on), then restore the flag."""
    with run_under_engine(request.param) as name:
        yield name


@pytest.fixture
def classic_engine():
    """Run the test under JAX's classic remat engine whatever ``JAX_REMAT3`` says (a test of
    classic-only structure: ``remat2`` equations, JAX's classic errors), then restore the flag."""
    with run_under_engine("classic") as name:
        yield name


@pytest.fixture(autouse=True)
def _registry_restored():
    """Every test leaves the policy registry as it found it, whatever code under test registers."""
    with jremat.registry.scoped():
        yield


#: Files a test must never write: the committed benchmark results (train.bench's default outputs: the
#: report and one CSV per part).
_COMMITTED_RESULTS = (os.path.join(REPO, "docs", "RESULTS.md"), os.path.join(REPO, "docs", "results", "bench-*.csv"))


def _contents(patterns) -> dict:
    return {p: pathlib.Path(p).read_bytes() for pattern in patterns for p in glob.glob(pattern)}


@pytest.fixture(autouse=True)
def _committed_results_untouched():
    """Every test leaves docs/RESULTS.md and docs/results/bench-*.csv as they were (a bench run
    without ``--report`` / ``--out`` would rewrite them)."""
    before = _contents(_COMMITTED_RESULTS)
    yield
    assert _contents(_COMMITTED_RESULTS) == before, "the test rewrote the committed benchmark results"


@pytest.fixture
def tiny_config():
    """The ``tiny`` preset with heavy dropout, so that remat bugs in RNG threading show."""
    return preset("tiny", attn_dropout=0.5, resid_dropout=0.5)


def _ptb_offline_path() -> str:
    return os.path.abspath(os.path.join(SHARED_DATA, "ptb-offline"))


def pytest_terminal_summary(terminalreporter):
    """One line, even under ``-q``, when the tests that read the offline PTB data skipped for want of it."""
    skipped = terminalreporter.stats.get("skipped", [])
    missing = sum("offline PTB data not found" in str(report.longrepr) for report in skipped)
    if missing:
        terminalreporter.write_line(
            f"{missing} tests skipped: the offline PTB data is not at {_ptb_offline_path()} "
            "(clone the project beside ../shared: docs/install.md#running-the-tests)"
        )


@pytest.fixture(scope="session")
def ptb_offline_dir():
    """The offline PTB re-split in ../shared/data/ptb-offline (skips if absent)."""
    path = _ptb_offline_path()
    if not os.path.isdir(path):
        pytest.skip(f"offline PTB data not found at {path}")
    return path


def _cpu_compile_option_exists(name: str, value) -> bool:
    """Whether this jaxlib's XLA:CPU takes compile option ``name`` (newer XLA drops old switches)."""
    if jax.default_backend() != "cpu":
        return False
    try:
        jax.jit(lambda x: x + 1).lower(jnp.float32(0)).compile({name: value})
    except jax.errors.JaxRuntimeError as err:
        if "No such compile option" in str(err):
            return False
        raise
    return True


#: XLA:CPU options for tests that compare programs compiled the same way within a tolerance (the
#: gradient matrices, the multi-device and multi-process runs): the older fusion emitters compile
#: faster, where XLA still has them. They change the values computed, so bitwise checks and the
#: programs the CLI tests run compile with the defaults users get.
TOLERANCE_CPU_OPTIONS = (
    {"xla_cpu_use_fusion_emitters": False} if _cpu_compile_option_exists("xla_cpu_use_fusion_emitters", False) else {}
)
#: :data:`TOLERANCE_CPU_OPTIONS` as ``XLA_FLAGS`` words, for subprocesses.
TOLERANCE_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in TOLERANCE_CPU_OPTIONS.items())

#: XLA:CPU options added to every compile-only analysis in the suite's process
#: (``jremat.memory_report``, ``jremat.memory_timeline``, so the CLIs' reports too): the older
#: fusion emitters again. Nothing runs, so only buffer assignment matters, and they leave it as it
#: is but for one small constant scratch buffer (docs/xla-notes.md);
#: tests/jremat/_measure/test_memory.py checks that against XLA's defaults.
ANALYSIS_CPU_OPTIONS = TOLERANCE_CPU_OPTIONS
#: The library's own ``jremat._measure.compile.analysis_options`` (what users get), before the suite's below.
library_analysis_options = _compile.analysis_options


def _suite_analysis_options():
    return {**library_analysis_options(), **ANALYSIS_CPU_OPTIONS}


_compile.analysis_options = _suite_analysis_options


def tolerance_jit(fn, **jit_kwargs):
    """``jax.jit(fn)`` with :data:`TOLERANCE_CPU_OPTIONS` on the CPU (other backends: the defaults)."""
    if jax.default_backend() == "cpu":
        jit_kwargs["compiler_options"] = {**TOLERANCE_CPU_OPTIONS, **jit_kwargs.get("compiler_options", {})}
    return jax.jit(fn, **jit_kwargs)


def loss_and_grads(cfg, *, batch_size=2, seed=0, token_seed=1):
    """Loss and parameter gradients of ``GPT(cfg)`` on fixed random tokens with dropout key ``seed``.

    Compiled by :func:`tolerance_jit`: for comparisons within a tolerance only.
    """
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(token_seed), (batch_size, cfg.max_seq_len), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)

    def loss(p):
        return cross_entropy_loss(nnx.merge(graphdef, p), tokens, targets, jax.random.key(seed))

    return tolerance_jit(jax.value_and_grad(loss))(params)


def max_relative_error(grads, reference):
    """max |g - ref| over all leaves, divided by max |ref| over all leaves.

    One global scale: some gradients are exactly zero in exact arithmetic (the key
    projection's bias, since softmax is shift-invariant), so a per-leaf ratio would divide
    float noise by float noise.
    """
    assert jax.tree.structure(grads) == jax.tree.structure(reference)
    # On the host: an eager jax.numpy op per leaf shape would compile a program for each.
    got = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
    expected = [np.asarray(r, np.float64) for r in jax.tree.leaves(reference)]
    scale = max(float(np.max(np.abs(r))) for r in expected)
    return max(float(np.max(np.abs(g - r))) for g, r in zip(got, expected)) / scale


def train_step_memory(cfg, batch_size=8) -> jremat.MemoryReport:
    """Compile-only memory report of the gradient step of ``GPT(cfg)`` (:func:`train.programs.step_program`)."""
    grad_fn, args = step_program(cfg, batch_size)
    return jremat.memory_report(grad_fn, *args)


def saved_residuals(fn, *args):
    """``[(aval, description)]`` of every value ``jax.vjp(fn, *args)`` keeps for the backward pass.

    The one place the suite touches JAX's private ``saved_residuals``.
    """
    return list(_jax_saved_residuals(fn, *args))


def traced_memory_report(fn, *args):
    """A compile-free stand-in for ``jremat.memory_report``: the bytes the traced program creates.

    Counted at the program's top level, where the forward scan's outputs hold the stacked
    residuals, so the figure falls as a policy keeps less, as XLA's peak does. The planner against
    real compiles is tested in tests/models/test_planning.py.
    """
    created = sum(
        v.aval.size * v.aval.dtype.itemsize
        for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns
        for v in eqn.outvars
        if jnp.issubdtype(v.aval.dtype, jnp.number)
    )
    return jremat.MemoryReport(
        available=True,
        platform="cpu",
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=created,
        generated_code_bytes=0,
        peak_bytes=created,
        peak_source=PEAK_FROM_SUM,
    )


@pytest.fixture
def traced_reports(monkeypatch):
    """``traced_memory_report`` behind a fresh report cache: no real report in, no fake one out."""
    monkeypatch.setattr(jremat, "memory_report", traced_memory_report)
    fresh = functools.lru_cache(maxsize=256)(programs._step_memory_report.__wrapped__)
    monkeypatch.setattr(programs, "_step_memory_report", fresh)
    return fresh


_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _live_runs(jaxpr, counted, used_outputs=None) -> tuple[int, list[bool]]:
    """How many equations of the ``counted`` primitives computing ``jaxpr``'s used outputs run (a ``scan``
    body's times its length) after dead-code elimination (a recomputation nothing reads is not
    run, as XLA runs it not), and which of ``jaxpr``'s inputs they read: ``(runs, reads)``.

    Written here on purpose, apart from ``jremat.kernels.count_grouped_matmuls`` and jremat's
    liveness: the truth of the tests."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    used = [True] * len(jaxpr.outvars) if used_outputs is None else list(used_outputs)
    live = {v for v, u in zip(jaxpr.outvars, used) if u and not isinstance(v, jcore.Literal)}
    runs = 0
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not any(outs) and not eqn.effects:
            continue
        reads = [True] * len(eqn.invars)
        if eqn.primitive.name in counted:
            runs += 1
        elif eqn.primitive.name == "scan":
            body, n_consts, n_carry = eqn.params["jaxpr"].jaxpr, eqn.params["num_consts"], eqn.params["num_carry"]
            body_used = list(outs)
            while True:  # a carry the body reads is an output of the previous iteration
                body_runs, reads = _live_runs(body, counted, body_used)
                grown = [i for i in range(n_carry) if reads[n_consts + i] and not body_used[i]]
                if not grown:
                    break
                for i in grown:
                    body_used[i] = True
            runs += eqn.params["length"] * body_runs
        else:
            subs = [getattr(eqn.params[k], "jaxpr", eqn.params[k]) for k in _CALL_PARAMS if k in eqn.params]
            call = subs[0] if len(subs) == 1 else None
            if call is not None and len(call.invars) == len(eqn.invars) and len(call.outvars) == len(eqn.outvars):
                body_runs, reads = _live_runs(call, counted, outs)
                runs += body_runs
            else:  # while, cond: everything inside runs
                for value in eqn.params.values():
                    for item in value if isinstance(value, (tuple, list)) else (value,):
                        if isinstance(item, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                            runs += _live_runs(item, counted)[0]
        live.update(v for v, r in zip(eqn.invars, reads) if r and not isinstance(v, jcore.Literal))
    return runs, [v in live for v in jaxpr.invars]


def live_runs(jaxpr, counted) -> int:
    """Equations of the primitives named in ``counted`` that a traced program (a gradient) runs:
    a ``scan`` body's times its length, after dead-code elimination (:func:`_live_runs`)."""
    return _live_runs(jaxpr, tuple(counted))[0]
