"""jremat.memory_timeline: live bytes over the compiled schedule of a small scanned program (compile-only)."""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.compilation_cache import compilation_cache

import jremat
from jremat._measure import compile as _compile
from jremat._measure import timeline as jtl

LAYERS, BATCH, WIDTH = 3, 64, 128


def _loss(policy):
    def layer(x, w):
        h = checkpoint_name(jnp.tanh(x @ w), "hidden")
        return checkpoint_name(jnp.sin(h) @ w.T, "layer_out"), None

    body = layer if policy is None else jax.checkpoint(layer, policy=policy)

    def loss(ws, x):
        y, _ = jax.lax.scan(body, x, ws)
        return jnp.sum(y * y)

    return loss


ARGS = (jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32), jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32))


@pytest.fixture(scope="module")
def timelines():
    return {
        "none": jremat.memory_timeline(jax.grad(_loss(None)), *ARGS),
        "full": jremat.memory_timeline(jax.grad(_loss(jax.checkpoint_policies.nothing_saveable)), *ARGS),
    }


@pytest.mark.parametrize("policy", ["none", "full"])
def test_maximum_matches_the_compiled_peak(timelines, policy):
    tl = timelines[policy]
    assert tl.peak_bytes == max(tl.live_bytes) == tl.live_bytes[tl.peak_position]
    assert abs(tl.peak_bytes - tl.compiled_peak_bytes) <= 0.02 * tl.compiled_peak_bytes
    assert tl.compiled_peak_bytes == tl.report.peak_bytes
    assert tl.argument_bytes == (LAYERS * WIDTH + BATCH) * WIDTH * 4


def test_peak_buffers_are_named_by_tag_and_kind(timelines):
    tl = timelines["none"]
    stacked = [b for b in tl.top_buffers if b.shape.startswith(f"f32[{LAYERS},{BATCH},{WIDTH}]")]
    assert stacked and {b.kind for b in stacked} == {jtl.FORWARD_RESIDUAL}
    assert {"hidden"} <= {b.name for b in stacked}
    assert sum(b.size_bytes for b in tl.top_buffers) >= tl.peak_bytes
    assert any(b.kind == jtl.ARGUMENT for b in tl.top_buffers)
    # Remat keeps no stacked hidden activation: the layer inputs are all it saves.
    full = timelines["full"]
    assert not [b for b in full.top_buffers if b.kind == jtl.FORWARD_RESIDUAL and b.name == "hidden"]
    assert full.peak_bytes < tl.peak_bytes


def test_loops_are_spans_with_trip_counts(timelines):
    tl = timelines["none"]
    assert [lp.trip_count for lp in tl.loops] == [LAYERS, LAYERS]
    forward, backward = tl.loops
    assert forward.end_position < backward.start_position <= backward.end_position < len(tl.live_bytes)
    assert "transpose(" in backward.op_name and "transpose(" not in forward.op_name
    text = tl.table(3)
    assert "timeline/compiled" in text and len(text.splitlines()) == 3 + 3  # peak line, header, rule, 3 rows


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="needs a callable"):
        jremat.memory_timeline(3)
    with pytest.raises(ValueError, match="top must be a positive integer"):
        jremat.memory_timeline(jnp.sin, 1.0, top=0)
    with pytest.raises(ValueError, match="not an XLA live-range dump"):
        jtl.build_timeline(BUFFERS, "BufferAssignment:", HLO)


BUFFERS = """BufferAssignment:
allocation 0: size 16, parameter 0, shape |f32[4]| at ShapeIndex {}:
 value: <0 p.1 @0> (size=16,offset=0): f32[4]{0}
allocation 1: size 16, output shape is |f32[4]|, maybe-live-out:
 value: <4 out.1 @0> (size=16,offset=0): f32[4]{0}
allocation 2: size 4, constant:
 value: <5 k.1 @0> (size=4,offset=0): f32[]
allocation 3: size 48, preallocated-temp:
 value: <1 a.1 @0> (size=32,offset=0): f32[8]{0}
 value: <2 b.1 @0> (size=32,offset=0): f32[8]{0}
 value: <3 c.1 @0> (size=16,offset=32): f32[4]{0}

Total bytes used: 84
"""
LIVE = """HloLiveRange (max 4):
  InstructionSequence:
    0:p.1
    1:a.1
    2:b.1
    3:c.1
    4:out.1
  BufferLiveRange:
    p.1{}:0-4
    a.1{}:1-2
    b.1{}:2-3
    c.1{}:3-4
    out.1{}:4-4
"""
HLO = """HloModule m, is_scheduled=true

ENTRY %main (p.1: f32[4]) -> f32[4] {
  %p.1 = f32[4]{0} parameter(0)
  %a.1 = f32[8]{0} broadcast(%p.1), metadata={op_name="jit(f)/jvp()/mul"}
  %b.1 = f32[8]{0} add(%a.1, %a.1), metadata={op_name="jit(f)/transpose(jvp())/add"}
  %c.1 = f32[4]{0} slice(%b.1), metadata={op_name="jit(f)/transpose(jvp())/slice"}
  ROOT %out.1 = f32[4]{0} add(%c.1, %p.1), metadata={op_name="jit(f)/transpose(jvp())/add"}
}
"""


def test_the_model_on_a_hand_written_dump():
    report = jremat.MemoryReport(True, "cpu", 16, 16, 0, 48, 0, 80, "argument + output - alias + temp")
    tl = jtl.build_timeline(BUFFERS, LIVE, HLO, report=report)
    # Arguments and outputs throughout; b updates a in place (same bytes), so they count once.
    assert tl.live_bytes == (32, 64, 64, 80, 48)
    assert (tl.peak_position, tl.peak_bytes, tl.agreement, tl.unmodelled_bytes) == (3, 80, 1.0, 4)
    kinds = {b.instruction: (b.kind, b.size_bytes) for b in tl.top_buffers}
    assert kinds == {"p.1": ("argument", 16), "b.1": ("gradient", 32), "c.1": ("gradient", 16), "out.1": ("output", 16)}


def test_timeline_compiles_past_the_persistent_cache(tmp_path):
    """A persistent-cache hit skips XLA and its dump; the timeline's compile must bypass the cache."""
    previous_dir = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compilation_cache.reset_cache()  # JAX opens the cache directory once
    try:
        grad = jax.grad(_loss(None))
        jax.jit(grad).lower(*ARGS).compile(_compile.analysis_options())  # the timeline's options: now in the cache
        assert list(tmp_path.iterdir()), "the compile was not cached, so this test checks nothing"
        timeline = jremat.memory_timeline(grad, *ARGS)
        assert timeline.peak_bytes > 0 and timeline.top_buffers
        jax.jit(grad).lower(*ARGS).compile(_compile.analysis_options())
        assert jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_compilation_cache_dir", previous_dir)
        compilation_cache.reset_cache()
