"""jremat.collectives_report: collectives of a compiled program, per device, on 8 simulated devices.

The 8-device checks need ``--xla_force_host_platform_device_count=8`` before JAX starts, so they
run once in a subprocess (tests/jremat/mesh_checks.py) whose JSON figures the tests below assert
on; the HLO reading itself is tested in-process on hand-written HLO text and on one device.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat._measure import collectives as _collectives
from tests.conftest import REPO, TOLERANCE_XLA_FLAGS

# A hand-written module: an async all-gather pair (counted once), a reduce-scatter (operand
# bytes), and a while loop of 3 trips whose body all-reduces and whose condition holds none.
HLO = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%v), channel_id=1, to_apply=%add, metadata={op_name="jit(f)/transpose(jvp())/while/body/dot_general"}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%x), dimensions={0}, metadata={op_name="jit(f)/jvp()/sharding_constraint"}
  %agd = f32[64]{0} all-gather-done(%ags), metadata={op_name="jit(f)/jvp()/sharding_constraint"}
  %rs = f32[8]{0} reduce-scatter(%agd), dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/transpose(jvp())/checkpoint/rematted_computation/dot_general"}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %rs)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_hlo_collectives_counts_async_pairs_once_loops_by_trip_count_and_phases():
    report = _collectives.hlo_collectives(HLO, devices=8)
    assert report.by_kind() == {"all-gather": (1, 256), "reduce-scatter": (1, 256), "all-reduce": (3, 96)}
    assert report.count("all-gather", "forward") == 1
    assert report.count("reduce-scatter", "recompute") == 1
    assert report.count("all-reduce", "backward") == 3 and report.bytes("all-reduce", "forward") == 0
    assert report.devices == 8 and not report.notes
    # Without a known trip count the body counts once, and a note says so.
    unknown = _collectives.hlo_collectives(HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""))
    assert unknown.count("all-reduce") == 1 and "no known trip count" in unknown.notes[0]
    # The difference from a baseline, per kind.
    base = _collectives.CollectivesReport(tuple(c for c in report.collectives if c.kind != "all-gather"))
    assert report.reissued(base) == {"all-gather": (1, 256)}
    assert "all-gather: 1 per step, 256 B per device (forward 1); +1 (+256 B) vs without remat" in report.text(base)


def test_reissued_leaves_the_cotangent_tie_out_and_tie_lines_names_it():
    tied = HLO.replace("while/body/dot_general", "while/body/jvp(jremat_cotangent_tie)/squeeze")
    report, base = _collectives.hlo_collectives(tied), _collectives.hlo_collectives(HLO.replace("%ar = ", "%ar0 = "))
    base = _collectives.CollectivesReport(tuple(c for c in base.collectives if c.kind != "all-reduce"))
    assert report.count("all-reduce", _collectives.TIE) == 3 and report.count("all-reduce", "backward") == 0
    assert report.reissued(base) == {}
    assert _collectives.tie_lines("f", report) == [
        "cotangent tie (f): the cotangent tie adds 3 all-reduces of 32 B (96 B per step per device), one per tied "
        "checkpoint's backward step; they keep each recomputation in that step, which straight-line code needs; "
        "inside a lax.scan of more than one step, pass prevent_cse=False (as to jax.checkpoint there) to drop them"
    ]
    assert _collectives.tie_lines("f", base) == [] and _collectives.reissued_lines("f", report, base) == []


def test_shape_bytes_reads_every_element_width():
    assert (
        _collectives.shape_bytes("(f32[2]{0}, bf16[4], f8e4m3fn[8], pred[2], s4[4], c64[1])") == 8 + 8 + 8 + 2 + 2 + 8
    )
    assert _collectives.shape_bytes("f32[]") == 4 and _collectives.shape_bytes("token[]") == 0


def test_report_rejects_unknown_kinds_phases_and_non_hlo():
    report = _collectives.hlo_collectives(HLO)
    with pytest.raises(ValueError, match="unknown collective kind 'gather'; valid kinds: all-gather"):
        report.count("gather")
    with pytest.raises(ValueError, match="unknown phase 'fwd'; valid phases: forward, backward, recompute"):
        report.bytes(phase="fwd")
    with pytest.raises(ValueError, match="no ENTRY computation"):
        _collectives.hlo_collectives("not hlo")
    with pytest.raises(TypeError, match="collectives_report needs a callable, got int"):
        jremat.collectives_report(3)


def test_one_device_has_no_collectives():
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    report = jremat.collectives_report(jax.grad(lambda w: jnp.sum(jnp.tanh(w @ w))), x)
    assert report.collectives == () and report.text() == "no collectives (1 device)"


def _mesh_checks(*names: str, module: str = "tests.jremat.mesh_checks") -> dict:
    """``module``'s checks ``names`` (tests/jremat/mesh_checks.py's by default) on 8 simulated CPU
    devices: their JSON figures."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *names],
        cwd=REPO,
        env=dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {TOLERANCE_XLA_FLAGS}"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("device_count") == 8
    return result


@pytest.fixture(scope="module")
def checks():
    """Every check of tests/jremat/mesh_checks.py this module asserts on, in one process: collectives,
    gradients, the tie on every mesh and the advice about them; on the FSDP model, the keep_gathered
    target, explain, the timeline, the price and the fit search."""
    return _mesh_checks("collectives", "tie", "advice", "keep_gathered", "explain", "timeline", "price", "fit")


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_report_equals_a_direct_count_of_the_optimized_hlo(checks):
    rows = {k: v for k, v in checks["collectives"].items() if "/" in k}
    assert len(rows) >= 3 * 2 * 2 * 2  # meshes x layouts x engines x (at least two policies)
    for key, row in rows.items():
        assert row["report"] == row["direct"], key
        assert row["devices"] == 8, key


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_recomputation_reissues_the_fsdp_all_gathers(checks):
    rows = checks["collectives"]
    for layout in ("unrolled", "scanned"):
        for engine in ("classic", "remat3"):
            none = rows[f"fsdp/{layout}/{engine}/none"]["report"]["all-gather"]
            full = rows[f"fsdp/{layout}/{engine}/full"]["report"]["all-gather"]
            # 4 layers x 2 weights gathered in the forward; full gathers each again in the backward.
            assert none[0] == 8 and full[0] == 16 and full[1] == 2 * none[1], (layout, engine)
    unrolled = rows["fsdp/unrolled/classic/full"]["phases"]["all-gather"]
    assert unrolled == [8, 0, 8]  # forward, backward, recompute: the re-gathers are the recomputation's


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_gradients_under_every_policy_equal_no_remat_on_the_mesh(checks):
    rows = {k: v for k, v in checks["collectives"].items() if "/" in k}
    assert {k.rsplit("/", 1)[1] for k in rows} >= {"none", "full", "dots", "dots_no_batch"}
    for key, row in rows.items():
        assert row["grad_rel_error"] <= 1e-5, key
    # A wrong recomputation is caught, though its forward pass (the loss) is exact.
    assert checks["collectives"]["broken_grad_rel_error"] > 1e-4
    assert checks["collectives"]["broken_loss_rel_error"] == 0


@pytest.mark.parametrize("engine", ["classic", "remat3"])
@pytest.mark.heavy  # the 8-device checks' subprocess
def test_fit_search_on_fsdp_prices_reissued_all_gathers_and_considers_keeping_them(checks, engine):
    fit = checks["fit"][engine]
    # The first probe all-gathers, so full's keep_gathered variant joined the candidates by itself.
    assert "full:keep_gathered=true" in fit["rows"]
    probes = fit["probes"]
    assert all(p["devices"] == 8 for p in probes.values())
    gathers = {k: dict((kind, (n, b)) for kind, n, b in p["collectives"])["all-gather"] for k, p in probes.items()}
    assert gathers["full@4"][0] > gathers["full:keep_gathered=true@4"][0] == gathers["none@4"][0]
    # What each step issues in a recomputation: full's re-gathers, no all-reduce (the data-parallel
    # gradients' reductions are the backward pass's), so keep_collectives' variants were not searched.
    assert probes["none@4"]["recomputed"] == [] and "all-gather" in probes["full@4"]["recomputed"]
    assert "all-reduce" not in probes["full@4"]["recomputed"] and "full:keep_collectives=true" not in fit["rows"]
    # The time model prices them: re-gathering is predicted slower than keeping, all else equal.
    assert fit["collective_s"]["full"] > fit["collective_s"]["kept"] > 0
    assert fit["step_s_same_work"]["full"] > fit["step_s_same_work"]["kept"]
    assert fit["predicted_equals_model"]  # each row's prediction is the model's, collectives included
    assert "per device" in fit["table"] and "comm/device" in fit["table"]


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
@pytest.mark.heavy  # the 8-device checks' subprocess
def test_keep_gathered_issues_no_all_gather_more_than_none_at_full_s_temp(checks, layout):
    rows = {k.split("/", 1)[1]: v for k, v in checks["keep_gathered"].items() if k.startswith(layout)}
    none, full, kept = rows["none"], rows["full"], rows["full:keep_gathered=true"]
    assert full["all-gather"][0] == 2 * none["all-gather"][0]  # full re-gathers every weight
    assert kept["all-gather"] == none["all-gather"]  # 0 re-issued
    assert kept["temp"] <= 1.05 * full["temp"] and kept["temp"] < none["temp"]
    assert rows["dots:keep_gathered=true"]["all-gather"] == none["all-gather"]
    assert rows["dots"]["all-gather"][0] > none["all-gather"][0]


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_explain_of_full_names_the_reissued_all_gathers_and_how_to_avoid_them(checks):
    full = checks["explain"]["full"]
    assert "re-issued collectives (full): re-issues 8 all-gathers, 32.00 KiB per step per device more than none" in full
    assert "(e.g. 'full:keep_collectives=true')" in full and "keep_gathered=true keeps the gathered weights" in full
    assert "collectives of the gradient, per device (8 devices):" in full
    assert "on 8 devices: residuals, compiled temp and collectives are per device" in full
    assert (
        "residuals for the backward pass per device: " in full and "compiled temp of the gradient per device: " in full
    )
    kept = checks["explain"]["full:keep_gathered=true"]
    assert "all-gather: 8 per step" in kept and "all-gathers" not in kept.split("re-issued", 1)[-1]
    assert "keeps 2 gathered weights (sharding constraint -> matmul)" in kept
    # jremat.testing.assert_no_reissued_collectives: fails on full, naming the re-gathers; holds when kept.
    assert "re-issues 8 all-gathers" in checks["explain"]["full assert"]
    assert checks["explain"]["full:keep_gathered=true assert"] is None


def test_assert_no_reissued_collectives_rejects_unknown_kinds_and_holds_on_one_device():
    import jremat.testing

    x = jax.ShapeDtypeStruct((4, 4), jnp.float32)

    def f(w):
        return jnp.sum(jnp.tanh(w @ w))

    jremat.testing.assert_no_reissued_collectives(jax.grad(jremat.checkpoint(f, "full")), jax.grad(f), x)
    with pytest.raises(ValueError, match=r"unknown collective kinds \['gather'\]"):
        jremat.testing.assert_no_reissued_collectives(jax.grad(f), jax.grad(f), x, kinds=("gather",))


def test_keep_gathered_is_a_key_of_every_single_function_policy():
    assert jremat.registry.resolve("dots:keep_gathered=true").spec == "dots:keep_gathered=true"
    assert isinstance(jremat.registry.resolve("none:keep_gathered=true"), jremat.NoRemat)
    with pytest.raises(ValueError, match="keep_gathered must be true or false, got 'maybe'"):
        jremat.registry.resolve("full:keep_gathered=maybe")
    with pytest.raises(ValueError, match="valid keys: keep_gathered"):
        jremat.registry.resolve("full:keep=1")


def test_keep_gathered_saves_only_a_constrained_input_feeding_a_matmul():
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.AbstractMesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = jax.sharding.NamedSharding(mesh, P())

    def block(w, x):
        gathered = jax.lax.with_sharding_constraint(w, replicated)  # kept: an input feeding a matmul
        act = jax.lax.with_sharding_constraint(jnp.tanh(x), replicated)  # not kept: an activation
        return act @ gathered

    from jremat._apply import gathered as _gathered

    program = jremat.trace_program(block, jnp.ones((4, 4)), jnp.ones((2, 4)))
    found = _gathered.gathered_weights(program)
    assert [program.ops[i].primitive for i in found] == ["sharding_constraint"]
    assert min(found) == 0  # the weight's constraint, the first equation


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_the_tie_costs_one_scalar_all_reduce_per_checkpoint_and_works_on_explicit_meshes(checks):
    tie = checks["tie"]
    for mesh in ("fsdp", "tp", "fsdp_explicit"):
        # 4 tied checkpoints: one 4-byte all-reduce each (docs/sharding.md), none untied.
        assert tie[f"{mesh}/tied"]["all-reduce"] - tie[f"{mesh}/untied"]["all-reduce"] == 4, mesh
        # The report finds them by the tie's name scope: phase "cotangent tie", 4 B each.
        assert tie[f"{mesh}/tied"]["tie"] == [4, 16] and tie[f"{mesh}/untied"]["tie"] == [0, 0], mesh


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_the_tie_s_all_reduces_are_reported_apart_from_reissued_row_parallel_ones(checks):
    text = checks["advice"]["tp full"]
    # 4 row-parallel all-reduces re-run by the recomputation: the dots advice, the tie's 4 not among them.
    assert (
        "re-issued collectives (full): re-issues 4 all-reduces, 2.00 KiB per step per device more than none; the "
        "recomputation reduces again" in text
    )
    assert "for a row-parallel matmul whose output XLA all-reduces, save that matmul's output: dots" in text
    assert (
        "cotangent tie (full): the cotangent tie adds 4 all-reduces of 4 B (16 B per step per device)" in text
        and "pass prevent_cse=False" in text
    )
    assert "+4 (+2.00 KiB) vs without remat, the cotangent tie's 4 apart" in text


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_assert_no_reissued_collectives_holds_on_the_tie_alone(checks):
    # full:keep_gathered=true on FSDP re-issues nothing; its only extra all-reduces are the tie's.
    assert checks["advice"]["kept assert"] is None


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_keep_gathered_on_implicitly_gathered_weights_advises_an_explicit_gather(checks):
    text = checks["advice"]["implicit kept"]
    for said in (
        "no gathered weight (no sharding constraint on an input that feeds a matmul) to keep",
        "the policy keeps every all-gather written in the model, so XLA inserts these on its own",
        "jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec)) of a weight to its gathered placement",
        "jax.sharding.reshard on a mesh of explicit axes",
        "or keep_collectives=true, which gathers such weights itself on a mesh of one split axis",
    ):
        assert said in text, said
    assert "(e.g. 'full:keep_collectives=true')" not in text  # the advice for a policy without the key


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_a_user_s_scan_over_the_default_checkpoint_is_tied_and_prevent_cse_false_unties_it(checks):
    # [tie all-reduces, all all-reduces] per step of 4 scan iterations (docs/sharding.md).
    assert checks["advice"]["scan prevent_cse=True"] == [4, 8]
    assert checks["advice"]["scan prevent_cse=False"] == [0, 4]


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_timeline_on_a_mesh_says_it_is_per_device(checks):
    timeline = checks["timeline"]
    assert any(
        n.startswith("per device: one device's share of the SPMD program on 8 devices") for n in timeline["notes"]
    )


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_saved_residuals_report_on_a_mesh_says_its_bytes_are_per_device(checks):
    timeline = checks["timeline"]
    assert timeline["residuals_devices"] == 8
    assert timeline["residuals_table"].endswith(
        "bytes are per device (each device's shard on 8 devices); global bytes are the unsharded values, all "
        "devices together"
    )


def test_plan_layers_prices_regathering_and_keeps_gathered_weights_where_they_fit():
    from jremat._plan.planner import Candidate, NameCost, plan_layers

    costs = (NameCost("a", 100, 1e6),)

    def plan(regather_flops, budget):
        return plan_layers(
            budget,
            costs=costs,
            n_layers=4,
            block_input_bytes=10,
            none_layer_bytes=110,
            measure_peak_bytes=lambda c: (
                1000
                + c.remat_layers * (10 if c.keep_gathered else 0)
                - 100 * c.remat_layers
                + (len(c.save) * 100 * c.remat_layers)
            ),
            regather_flops=regather_flops,
        )

    # Re-gathering priced: keeping the gathered weights (10 bytes a layer) costs no FLOPs.
    kept = plan(5e6, 700).candidate
    assert kept.keep_gathered and kept.remat_layers == 4 and kept.spec() == "full:keep_gathered=true"
    # Not priced (one device): no such candidate.
    assert not plan(0.0, 700).candidate.keep_gathered
    # A budget only plain full fits: full, re-gathering.
    assert plan(5e6, 600).candidate == Candidate((), 4)
    assert Candidate(("a",), 2, (), True).spec() == "names:save=a,keep_gathered=true"


def test_collective_flops_per_byte_needs_two_devices_and_a_known_kind():
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        jremat.collective_flops_per_byte("gather")
    with pytest.raises(ValueError, match="needs at least 2 devices, got 1"):
        jremat.collective_flops_per_byte("all-gather", jax.devices()[:1])


@pytest.mark.heavy  # the 8-device checks' subprocess
def test_collective_price_is_measured_once_and_shared_by_threads(checks):
    price = checks["price"]
    assert len(set(price["all-gather"])) == 1 and price["all-gather"][0] > 0  # one measurement, four threads
    assert price["threads_measured"] == 2  # one timed all-gather and one timed matmul for the four threads
    assert price["again"] == price["all-gather"][0] and price["again_measured"] == 0  # cached: nothing timed again
    assert price["all-reduce"] > 0
    assert price["all-to-all"] > 0  # timed (a reshard XLA lowers to an all-to-all), not an all-gather's
