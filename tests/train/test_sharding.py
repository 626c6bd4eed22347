"""train.sharding: mesh specs, logical axis rules, multi-host environment, and 8-device checks.

The 8-device checks need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX
starts, so they run once in a subprocess (tests/train/sharded_checks.py) whose JSON figures
the tests below assert on; everything else runs in-process on one device.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from jremat.models import GPT, cross_entropy_loss, preset
from jremat.train import distributed as dist
from jremat.train import sharding as sh
from tests.conftest import REPO, TOLERANCE_XLA_FLAGS

#: Multi-device runs in subprocesses: CI runs them after the default suite (``-m heavy``).
pytestmark = pytest.mark.heavy


def abstract_mesh(**sizes):
    """A device-free mesh with the four axes (for the rule tables, which only read axis sizes)."""
    shape = tuple(sizes.get(a, 1) for a in sh.MESH_AXES)
    return AbstractMesh(shape, sh.MESH_AXES, axis_types=(AxisType.Auto,) * 4)


def path(*names):
    """The pytree key path of an NNX parameter ``names[0]/.../names[-1]`` (with its ``value`` attribute)."""
    return tuple(jax.tree_util.DictKey(n) for n in names) + (jax.tree_util.GetAttrKey("value"),)


# ----------------------------------------------------------------------------- mesh spec parsing


def test_parse_mesh_fills_missing_axes_with_one_in_mesh_order():
    assert sh.parse_mesh("fsdp=2, data=4") == {"data": 4, "fsdp": 2, "tensor": 1, "sequence": 1}
    assert list(sh.parse_mesh("sequence=2")) == list(sh.MESH_AXES)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "empty mesh spec"),
        ("data=4,model=2", "unknown mesh axis 'model'"),
        ("data=4,data=2", "given twice"),
        ("data=0", "positive integer, got '0'"),
        ("data=two", "positive integer, got 'two'"),
        ("data=-1", "positive integer"),
        ("data", "is not AXIS=SIZE"),
        ("data=4,,fsdp=2", "is not AXIS=SIZE"),
    ],
)
def test_parse_mesh_rejects_bad_specs_with_specific_messages(text, fragment):
    with pytest.raises(ValueError, match=fragment) as err:
        sh.parse_mesh(text)
    if "unknown" in fragment or "AXIS=SIZE" in fragment:
        assert "data, fsdp, tensor, sequence" in str(err.value)


def test_make_mesh_needs_sizes_multiplying_to_the_device_count():
    devices = jax.devices()[:1]
    with pytest.raises(ValueError, match=r"mesh data=2 has 2 devices but only 1 is available .*multiply to 1"):
        sh.make_mesh(sh.parse_mesh("data=2"), devices)
    with pytest.raises(ValueError, match=r"mesh data=4 has 4 devices but only 2 are available .*multiply to 2"):
        sh.make_mesh(sh.parse_mesh("data=4"), devices * 2)
    with pytest.raises(ValueError, match=r"mesh all sizes 1 has 1 device but 2 are available .*multiply to 2"):
        sh.make_mesh({}, devices * 2)
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        sh.make_mesh({"model": 1}, devices)
    mesh = sh.make_mesh(sh.parse_mesh("data=1"), devices)
    assert mesh.axis_names == sh.MESH_AXES and mesh.size == 1 and sh.format_mesh(mesh) == "data=1"
    assert sh.mesh_from_flag(None) is None


def test_check_batch_names_the_valid_multiples():
    mesh = abstract_mesh(data=2, fsdp=2, sequence=2)
    sh.check_batch(mesh, 8, 16)
    with pytest.raises(ValueError, match=r"batch size 6 .* data x fsdp = 2 x 2 = 4 devices; use a multiple of 4"):
        sh.check_batch(mesh, 6, 16)
    with pytest.raises(ValueError, match=r"sequence length 15 .* size 2; use a multiple of 2"):
        sh.check_batch(mesh, 8, 15)


# ----------------------------------------------------------------------------- logical axis rules


def test_fsdp_takes_the_largest_divisible_dim_but_never_the_layer_axis():
    mesh = abstract_mesh(fsdp=4)
    # [layers, d_model, d_ff]: d_ff is largest
    assert sh.param_partition_spec(path("blocks", "mlp", "fc_in", "kernel"), (8, 32, 64), mesh) == P(None, None, "fsdp")
    # the layer axis (8) is never split, even when it is the largest dimension
    assert sh.param_partition_spec(path("blocks", "ln1", "scale"), (8, 4), mesh) == P(None, "fsdp")
    # nothing divisible: replicated
    assert sh.param_partition_spec(path("head", "bias"), (10,), mesh) == P(None)
    # the vocabulary table [vocab, d_model]
    assert sh.param_partition_spec(path("token_embed", "embedding"), (64, 32), mesh) == P("fsdp", None)


def test_tensor_axis_follows_the_logical_rules_and_fsdp_takes_what_is_left():
    mesh = abstract_mesh(fsdp=2, tensor=2)
    q = sh.param_partition_spec(path("blocks", "attn", "q_proj", "kernel"), (2, 32, 64), mesh)
    out = sh.param_partition_spec(path("blocks", "attn", "out_proj", "kernel"), (2, 64, 32), mesh)
    fc_out = sh.param_partition_spec(path("blocks", "mlp", "fc_out", "kernel"), (2, 64, 32), mesh)
    head = sh.param_partition_spec(path("head", "kernel"), (32, 64), mesh)
    assert (q, out, fc_out, head) == (
        P(None, "fsdp", "tensor"),
        P(None, "tensor", "fsdp"),
        P(None, "tensor", "fsdp"),
        P("fsdp", "tensor"),
    )


def test_optimizer_state_leaves_match_their_parameter_by_path_suffix():
    mesh = abstract_mesh(fsdp=2, tensor=2)
    opt_path = (
        jax.tree_util.GetAttrKey("inner_opt_state"),
        jax.tree_util.SequenceKey(0),
        jax.tree_util.GetAttrKey("mu"),
    ) + path("blocks", "mlp", "fc_in", "kernel")
    assert sh.param_partition_spec(opt_path, (2, 32, 64), mesh) == P(None, "fsdp", "tensor")
    count = (jax.tree_util.GetAttrKey("count"),)
    assert sh.param_partition_spec(count, (), mesh) == P()


def test_every_gpt_parameter_has_logical_axes():
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(preset("tiny"), rngs=nnx.Rngs(0))))
    for p, leaf in jax.tree_util.tree_leaves_with_path(params):
        axes = sh.param_logical_axes(p, len(leaf.shape))
        assert None not in axes, (sh.path_names(p), axes)
        assert (axes[0] == "layers") == ("blocks" in sh.path_names(p))


def test_unknown_logical_axis_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown logical axis 'width'; known: act_batch"):
        sh.logical_to_spec(("width",), (4,), abstract_mesh())
    with pytest.raises(ValueError, match=r"do not match a tensor of shape \(4, 4\)"):
        sh.logical_to_spec(("embed",), (4, 4), abstract_mesh())


# ----------------------------------------------------------------------------- the model hook


def test_activation_hook_sees_the_residual_stream_between_sublayers():
    cfg = preset("tiny", remat_policy="full")
    seen = []

    def record(x):
        seen.append(x.shape)
        return x

    model = GPT(cfg, rngs=nnx.Rngs(0), activation_sharding=record)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    jax.eval_shape(lambda t: cross_entropy_loss(model, t, t), tokens)  # trace only
    # block input, between attention and MLP, block output (each traced once for the scan body,
    # and again where the checkpointed block is traced)
    assert len(seen) >= 3 and len(seen) % 3 == 0 and set(seen) == {(2, 8, cfg.d_model)}
    assert GPT(cfg, rngs=nnx.Rngs(0)).activation_sharding is None


# ----------------------------------------------------------------------------- multi-host environment


def test_distributed_config_reads_the_three_variables():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert dist.distributed_config(env) == dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
    assert dist.distributed_config({}) is None
    assert dist.distributed_config({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert dist.distributed_config({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) == {}
    assert dist.distributed_config({"OMPI_COMM_WORLD_SIZE": "2"}) == {}
    assert dist.initialize_distributed({}) is False


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_NUM_PROCESSES, JAX_PROCESS_ID missing"),
        ({"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "HOST:PORT"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "must be integers"),
        ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "0 <= JAX_PROCESS_ID"),
    ],
)
def test_distributed_config_rejects_partial_or_bad_environments(env, fragment):
    with pytest.raises(ValueError, match=fragment):
        dist.distributed_config(env)


# ----------------------------------------------------------------------------- 8 simulated devices


@pytest.fixture(scope="module")
def checks():
    """Run tests/train/sharded_checks.py on 8 simulated CPU devices; its JSON figures.

    Two processes at once: most of the time is XLA compilation. Both compile with
    ``TOLERANCE_XLA_FLAGS``: the gradient and train-step checks compare runs compiled the same
    way within a tolerance, and the memory check only compiles (as ``ANALYSIS_CPU_OPTIONS``).
    """
    xla_flags = f"--xla_force_host_platform_device_count=8 {TOLERANCE_XLA_FLAGS}"
    groups = ("grads train_step", "sequence_memory errors")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.train.sharded_checks", *group.split()],
            cwd=REPO,
            env=dict(os.environ, XLA_FLAGS=xla_flags),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for group in groups
    ]
    result = {}
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        part = json.loads(out.strip().splitlines()[-1])
        assert part.pop("device_count") == 8
        result.setdefault("seconds", {}).update(part.pop("seconds"))
        result.update(part)
    return result


@pytest.mark.parametrize("policy", ["none", "full", "every_k:k=4", "selective", "full:keep_gathered=true"])
def test_sharded_gradients_equal_single_device_for_each_policy(checks, policy):
    grads = checks["grads"]
    entry = grads[policy]
    assert "skipped" not in entry, entry
    assert entry["loss_sharded"] == pytest.approx(grads["loss_single"], rel=1e-6)
    assert entry["grad_max_rel_diff"] < 1e-5
    assert any("fsdp" in spec for spec in entry["grad_specs"])  # the gradients come out sharded like params


def test_all_axes_at_once_give_the_same_gradients(checks):
    entry = checks["grads"]["fsdp=2,tensor=2,sequence=2"]
    assert entry["loss_sharded"] == pytest.approx(checks["grads"]["loss_single"], rel=1e-6)
    assert entry["grad_max_rel_diff"] < 1e-5
    assert any("tensor" in spec for spec in entry["grad_specs"])


def test_the_loss_heads_chunks_on_each_device_give_the_same_gradients_and_a_broken_head_is_caught(checks):
    head = checks["grads"]["head_chunks"]
    for case in (
        "data=4,fsdp=2 full",
        "data=4,fsdp=2 full:keep_collectives=true",
        "fsdp=2,tensor=2,sequence=2 full:keep_collectives=true",
    ):
        assert head[case]["loss_sharded"] == pytest.approx(checks["grads"]["loss_single"], rel=1e-6), case
        assert head[case]["grad_max_rel_diff"] < 1e-5, case
    # Every target taken for one in each device's own vocabulary share: the loss and gradients differ.
    assert head["broken"]["loss_sharded"] != pytest.approx(checks["grads"]["loss_single"], rel=1e-2)
    assert head["broken"]["grad_max_rel_diff"] > 1e-2


def test_sharded_train_step_matches_one_device(checks):
    t = checks["train_step"]
    assert t["losses_sharded"] == pytest.approx(t["losses_single"], rel=1e-6)
    assert t["params_max_rel_diff"] < 1e-5 and t["init_max_rel_diff"] < 1e-5
    assert t["eval_sharded"] == pytest.approx(t["eval_single"], rel=1e-6)
    # ZeRO-3: every tiny parameter has a dimension divisible by 2, so each device holds half
    assert t["fsdp_sharded_params"] == t["n_params"]
    assert t["param_shard_bytes"] * 2 == t["param_bytes"]
    # AdamW moments and MultiSteps' gradient accumulator are sharded like their parameters
    assert t["opt_moments_matched"] == 3 * t["n_params"] and t["opt_moments_mismatched"] == []


def test_sequence_parallel_halves_per_device_activation_memory(checks):
    m = checks["sequence_memory"]
    assert 0.4 < m["temp_ratio"] < 0.6, m
    assert m["with_sequence_2"]["peak"] < m["without"]["peak"]


def test_bad_meshes_and_batches_on_eight_devices(checks):
    e = checks["errors"]
    assert (
        e["product"]
        == "mesh data=4,fsdp=4 has 16 devices but only 8 are available (cpu); the axis sizes must multiply to 8; "
        "on a CPU, simulate 16 devices by starting with XLA_FLAGS=--xla_force_host_platform_device_count=16"
    )
    assert "mesh data=2 has 2 devices but 8" in e["too_few"]
    assert e["unknown_axis"].startswith("unknown mesh axis 'model'")
    assert "batch size 6" in e["batch"] and "use a multiple of 8" in e["batch"]
    assert "sequence length 15" in e["seq"]
    assert "batch size 4" in e["memory_batch"]
