"""Per device on a mesh: saved residuals, explain, the timeline's gathered weights, the live
reading and the planner's table, on 8 simulated devices (tests/jremat/per_device_checks.py, in a
subprocess; the model is tests/jremat/mesh_checks.py's 4-layer MLP, batch rows over ``data, fsdp``)."""

import pytest

import jremat
from tests.jremat._measure.test_collectives import _mesh_checks

#: Multi-device runs in subprocesses: CI runs them after the default suite (``-m heavy``).
pytestmark = pytest.mark.heavy

LAYERS = 4  # tests/jremat/mesh_checks.py's model (not imported here: it sets the 8-device flag)


@pytest.fixture(scope="module")
def checks():
    return _mesh_checks(
        "residuals",
        "explain",
        "timeline",
        "timeline_kinds",
        "live",
        "keep_gathered_remat3",
        module="tests.jremat.per_device_checks",
    )


def _rows(checks, key) -> dict:
    """``(label, shape) -> [bytes, device_bytes]`` of one report (one row per distinct pair)."""
    return {(label, tuple(shape)): [b, d] for label, shape, b, d in checks["residuals"][key]["residuals"]}


@pytest.mark.parametrize("engine", ["classic", "remat3"])
@pytest.mark.parametrize("mesh", ["fsdp", "fsdp_explicit"])
def test_an_fsdp_sharded_activation_is_an_eighth_on_each_device_and_a_gathered_weight_whole(checks, mesh, engine):
    rows = _rows(checks, f"{mesh}/unrolled/{engine}/none")
    gathered = "reshard:float32" if mesh.endswith("explicit") else "sharding_constraint:float32"
    assert rows[("tanh:float32", (16, 64))] == [4096, 512]  # batch rows over fsdp=8
    assert rows[(gathered, (16, 64))] == [4096, 4096]  # the gathered w1: replicated
    report = checks["residuals"][f"{mesh}/unrolled/{engine}/none"]
    assert report["devices"] == 8 and report["computed"] == [69632, 37376]
    assert "bytes/device" in report["table"] and "per device (each device's shard on 8 devices)" in report["table"]
    # dots keeps the sharded weights themselves: an eighth each.
    assert all(d * 8 == b for b, d in _rows(checks, f"{mesh}/unrolled/{engine}/dots").values())


@pytest.mark.parametrize("engine", ["classic", "remat3"])
def test_scanned_fsdp_and_tensor_parallel_residuals_are_their_shards(checks, engine):
    scanned = _rows(checks, f"fsdp/scanned/{engine}/none")
    assert scanned[("scan:float32", (4, 16, 16))] == [4096, 512]  # stacked layer inputs, rows over fsdp
    # Megatron column-parallel hidden over (data=2, tensor=4); w1 gathered to its columns over tensor=4.
    tp = _rows(checks, f"tp/unrolled/{engine}/none")
    assert tp[("tanh:float32", (16, 64))] == [4096, 512]
    assert tp[("sharding_constraint:float32", (16, 64))] == [4096, 1024]
    assert tp[("argument:float32", (16, 16))] == [1024, 512]  # x: rows over data=2


def test_explain_compiles_the_gradient_of_a_block_with_a_sharded_output_on_explicit_axes(checks):
    # No remat: the gathered weight (1 KiB, whole) + tanh and its derivative (an eighth of 512 B each).
    assert checks["explain"]["explicit"]["saved"] == [1024 + 64 + 64, 0]


@pytest.mark.parametrize("engine", ["classic", "remat3"])
def test_explain_gives_residuals_per_device_with_the_global_figure_beside(checks, engine):
    explained = checks["explain"][engine]
    # One block, no remat: w1 and w2 gathered (4 KiB each, whole) + tanh and its derivative (an eighth each).
    assert explained["saved"] == [4096 + 4096 + 512 + 512, 0]
    assert explained["global_saved"] == [4 * 4096, 0]
    assert (
        "residuals for the backward pass per device: 9.00 KiB without remat, 0 B with the policy "
        "(global 16.00 KiB and 0 B)" in explained["text"]
    )


@pytest.mark.parametrize(
    ("layout", "engine"), [("unrolled", "classic"), ("unrolled", "remat3"), ("scanned", "classic")]
)
def test_timeline_labels_every_all_gathered_weight_and_its_copies_gathered_not_recomputation(checks, layout, engine):
    timeline = checks["timeline"][f"{layout}/{engine}"]
    gathered = [b for b in timeline["buffers"].values() if b[0] == "gathered weight"]
    # Full re-gathers each weight for the backward: unrolled, 8 gathers in the forward and 8 again;
    # scanned, the two of the forward loop's body and the two of the backward loop's.
    assert sum(1 for kind, _, opcode in gathered if opcode == "all-gather") == (16 if layout == "unrolled" else 4)
    for kind, op_name, opcode in timeline["buffers"].values():
        if opcode == "all-gather" or "rematted_computation" in op_name:
            assert kind == "gathered weight", (op_name, opcode)
    assert any(n.startswith("per device: one device's share") for n in timeline["notes"])
    assert timeline["devices"] == 8 and " per device (8 devices) at position " in timeline["header"]


def test_unrolled_layout_copies_of_regathered_weights_are_gathered_weights(checks):
    """XLA copies each re-gathered weight to the layout the backward matmul reads, under the
    sharding constraint's name: that copy is communication's buffer, not recomputed math."""
    buffers = checks["timeline"]["unrolled/classic"]["buffers"].values()
    copies = [k for k, op_name, opcode in buffers if opcode in ("copy", "fusion") and "rematted_computation" in op_name]
    assert copies and set(copies) == {"gathered weight"}


@pytest.mark.parametrize("engine", ["classic", "remat3"])
def test_timeline_under_none_labels_only_a_checkpoints_own_recomputation_not_forward_math(checks, engine):
    """Normed blocks on fsdp=8, unrolled: LayerNorm's backward (jremat.ops) reads forward values only,
    so XLA schedules parts of it inside the forward pass. The backward pass starts at the first
    instruction that reads a cotangent, so the forward's matmuls after those parts are forward
    residuals, and only LayerNorm's own checkpoint (its statistics) is recomputation."""
    none = checks["timeline_kinds"][f"{engine}/none"]
    recomputed = none["recomputation"]
    assert recomputed and all("rematted_computation" in op_name for _, op_name in recomputed), recomputed
    assert {op_name.rsplit("/", 1)[1] for _, op_name in recomputed} <= {"rsqrt", "div", "reduce_sum"}
    residual_ops = [op_name for _, op_name in none["forward residual"]]
    assert sum(op_name.endswith("jvp()/dot_general") for op_name in residual_ops) >= LAYERS
    # full recomputes every block, its matmuls included, and only recomputed ops are labelled so.
    full = checks["timeline_kinds"][f"{engine}/full"]["recomputation"]
    assert all("rematted_computation" in op_name for _, op_name in full), full
    assert sum(op_name.endswith("/dot_general") for _, op_name in full) == LAYERS


def test_live_memory_on_a_mesh_counts_its_devices_and_reads_one_per_device(checks):
    assert checks["live"]["devices"] == 8 and not checks["live"]["available"]
    assert "reports no allocator statistics" in checks["live"]["reason"]
    # From a device that reports its bytes: the one device's share of the step's gradients.
    read = checks["live"]["read"]
    assert read["available"] and read["devices"] == 8 and read["device"] == "cpu:0", read
    assert "per device (cpu:0, one of 8)" in read["text"], read
    assert checks["live"]["read_growth_bytes"] == checks["live"]["grads_bytes_per_device"]
    assert checks["live"]["grads_bytes_per_device"] * 8 == checks["live"]["grads_bytes"]  # each an eighth
    live = jremat.LiveMemory(True, "cuda:0", 3000, 1000, devices=8)
    assert live.text() == "live peak 3,000 bytes in use per device (cuda:0, one of 8); 1,000 in use before the run"
    assert jremat.LiveMemory(True, "cuda:0", 3000, 1000).text().startswith("live peak 3,000 bytes in use cuda:0;")


def test_plan_layers_table_on_a_mesh_says_per_device():
    from jremat._plan.planner import NameCost, plan_layers

    def plan(devices):
        return plan_layers(
            "800",
            costs=(NameCost("a", 100, 1e6),),
            n_layers=2,
            block_input_bytes=10,
            none_layer_bytes=110,
            measure_peak_bytes=lambda c: 1000 - 100 * c.remat_layers + 100 * len(c.save) * c.remat_layers,
            devices=devices,
        )

    table = plan(8).table()
    assert table.startswith("auto plan for budget 800 bytes per device (800 B) on 8 devices: ")
    assert "global B/layer" in table and "compiled peak 800 B per device" in table
    assert "per device" not in plan(1).table()
    with pytest.raises(ValueError, match="devices must be a positive integer, got 0"):
        plan(0)


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
def test_dots_keep_gathered_under_remat3_gathers_as_none_does_with_the_same_gradients(checks, layout):
    rows = {k.split("/", 1)[1]: v for k, v in checks["keep_gathered_remat3"].items() if k.startswith(layout)}
    assert rows["dots"]["all-gather"] == 2 * rows["none"]["all-gather"] == 16  # dots re-gathers every weight
    for policy in ("dots:keep_gathered=true", "dots_no_batch:keep_gathered=true"):
        assert rows[policy]["all-gather"] == rows["none"]["all-gather"], policy
        assert rows[policy]["grad_rel_error"] <= 1e-5, policy
