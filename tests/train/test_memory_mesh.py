"""``python -m train.memory --mesh``: per-device memory and collectives of the sharded step, per policy.

Runs the CLI in a subprocess on 8 simulated CPU devices (the device count is fixed before JAX
starts); bad input is checked in-process, before any compile.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from jremat.train import memory, sharded_steps
from tests.compile_flags import FAST_COMPILE_XLA_FLAGS
from tests.conftest import REPO, TOLERANCE_XLA_FLAGS

#: Multi-device runs in subprocesses: CI runs them after the default suite (``-m heavy``).
pytestmark = pytest.mark.heavy


def _run_memory(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """``python -m train.memory argv`` on 8 simulated CPU devices, with ``env`` added to the environment."""
    return subprocess.run(
        [sys.executable, "-m", "train.memory", *argv],
        cwd=REPO,
        env=dict(
            os.environ,
            XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {TOLERANCE_XLA_FLAGS} {FAST_COMPILE_XLA_FLAGS}",
            **env,
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )


MESH_ARGV = ["--preset", "tiny", "--batch-size", "8", "--mesh", "fsdp=8", "--remat-head-chunks", "0", "--unrolled"]
#: The auto rows of the one run, in order: auto's own choice, keep_gathered=true, keep_gathered=false.
AUTO_POLICIES = ("auto", "auto:keep_gathered=true", "auto:keep_gathered=false")


def _mesh_run(remat3: str = "0") -> tuple[dict, str]:
    """One ``train.memory --mesh fsdp=8 --json`` run: its rows by policy (the auto rows by
    :data:`AUTO_POLICIES`), and its stderr."""
    argv = [*MESH_ARGV, "--policy", "none", "--policy", "full", "--policy", "full:keep_gathered=true", "--json"]
    for spec in AUTO_POLICIES:
        argv += ["--policy", spec]
    proc = _run_memory([*argv, "--memory-budget", "0.5"], JAX_REMAT3=remat3)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    auto_rows = [row for row in rows if row["policy"].startswith("auto")]
    by_policy = {row["policy"]: row for row in rows if not row["policy"].startswith("auto")}
    by_policy.update(zip(AUTO_POLICIES, auto_rows, strict=True))
    return by_policy, proc.stderr


@pytest.fixture(scope="module")
def mesh_run():
    return _mesh_run()


@pytest.fixture(scope="module")
def mesh_rows(mesh_run):
    return mesh_run[0]


def test_mesh_rows_are_per_device_with_collectives(mesh_rows):
    none, full = mesh_rows["none"], mesh_rows["full"]
    assert none["devices"] == 8 and none["mesh"] == "fsdp=8"
    assert 0 < full["temp"] < none["temp"] and full["peak"] < none["peak"]
    gathers = {p: r["collectives"]["kinds"]["all-gather"]["count"] for p, r in mesh_rows.items()}
    # full gathers the layers' weights again in the backward pass; keep_gathered keeps them.
    assert gathers["full"] > gathers["none"] >= gathers["full:keep_gathered=true"]
    assert mesh_rows["full"]["collectives"]["kinds"]["all-gather"]["phases"]["recompute"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--mesh", "fsdp=8", "--fit", "--memory-budget", "1GiB", "--global-batch", "12"],
            "--global-batch 12 does not split over --mesh fsdp=8",
        ),
        (["--mesh", "model=2"], "--mesh: unknown mesh axis 'model'"),
        (["--mesh", "fsdp=3", "--batch-size", "8"], "--batch-size 8 does not split over --mesh fsdp=3"),
    ],
)
def test_bad_mesh_input_exits_2_with_one_line(argv, message, capsys):
    assert memory.main(["--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_timeline_and_live_on_a_mesh_are_per_device_and_show_gathered_weights(tmp_path):
    png = tmp_path / "timeline.png"
    argv = ["--preset", "tiny", "--batch-size", "8", "--mesh", "fsdp=8", "--remat-head-chunks", "0", "--unrolled"]
    proc = _run_memory([*argv, "--policy", "none", "--timeline", str(png), "--live"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert out.startswith("policy ") and "per device" in out
    assert "timelines per device: one device's share of the sharded gradient step on mesh fsdp=8 (8 devices)" in out
    # none keeps every gathered weight to its backward pass: the sharded timeline labels them at the peak.
    at_peak = {line.split("[")[1].split("]")[0]: line for line in out.splitlines() if line.startswith("per device at")}
    assert set(at_peak) == {"none"} and "gathered weight" in at_peak["none"]
    assert "timeline [none]: peak" in out and "per device (8 devices)" in out and png.stat().st_size > 0
    # --live on a mesh runs where the device reports allocator statistics; XLA:CPU does not, and says so.
    assert "live: cpu device" in proc.stderr and "only compiled figures are shown" in proc.stderr


def test_a_mesh_the_devices_do_not_fit_exits_2(capsys):
    assert memory.main(["--preset", "tiny", "--batch-size", "8", "--mesh", "fsdp=8"]) == 2
    err = capsys.readouterr().err
    assert "--mesh: mesh fsdp=8 has 8 devices but only 1 is available" in err
    assert "simulate 8 devices by starting with XLA_FLAGS=--xla_force_host_platform_device_count=8" in err


def test_auto_on_a_mesh_fits_a_per_device_budget_and_reissues_less_than_full(mesh_rows):
    none, full, auto = mesh_rows["none"], mesh_rows["full"], mesh_rows["auto"]
    budget = full["peak"] + 0.5 * (none["peak"] - full["peak"])  # --memory-budget 0.5, per device
    assert auto["peak"] <= budget
    regathered = {
        p: r["collectives"]["kinds"]["all-gather"]["bytes"] - none["collectives"]["kinds"]["all-gather"]["bytes"]
        for p, r in mesh_rows.items()
    }
    assert regathered["auto"] < regathered["full"]
    assert auto["policy"].startswith("auto: ")  # the row names the plan it chose


def test_json_rows_give_the_collectives_reissued_beyond_none_per_device(mesh_rows):
    none, full = mesh_rows["none"], mesh_rows["full"]
    assert none["reissued_beyond_none"] == {}
    gathers = {p: r["collectives"]["kinds"]["all-gather"] for p, r in mesh_rows.items()}
    extra = full["reissued_beyond_none"]["all-gather"]
    assert extra == {
        "count": gathers["full"]["count"] - gathers["none"]["count"],
        "bytes": gathers["full"]["bytes"] - gathers["none"]["bytes"],
    }
    assert extra["count"] > 0 and extra["bytes"] > 0
    assert mesh_rows["full:keep_gathered=true"]["reissued_beyond_none"].get("all-gather", {"count": 0})["count"] <= 0


def _check_auto_keep_gathered(rows: dict, stderr: str) -> None:
    kept, regathered = rows["auto:keep_gathered=true"], rows["auto:keep_gathered=false"]
    assert "keep_gathered=true" in kept["policy"] and "keep_gathered" not in regathered["policy"]
    assert kept["reissued_beyond_none"].get("all-gather", {"count": 0})["count"] <= 0
    assert regathered["reissued_beyond_none"]["all-gather"]["count"] > 0
    assert "; keeps gathered weights, as asked (keep_gathered=true)" in stderr
    assert "; re-gathers weights, as asked (keep_gathered=false)" in stderr


def test_auto_keep_gathered_true_keeps_and_false_regathers_on_a_mesh(mesh_run):
    _check_auto_keep_gathered(*mesh_run)


def test_expert_parallel_mesh_keeps_the_all_to_alls_and_auto_prices_them():
    argv = ["--preset", "tiny", "--moe-experts", "8", "--moe-top-k", "2", "--mesh", "expert=8", "--json"]
    policies = [
        "none",
        "full",
        "full:keep_collectives=true",
        "auto:budget=0.6",
        "auto:budget=0.6,keep_collectives=false",
    ]
    proc = _run_memory([*argv, *(a for p in policies for a in ("--policy", p))])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    by_policy = {row["policy"]: row for row in rows[:3]}
    exchanged = {p: r["reissued_beyond_none"].get("all-to-all", {"count": 0})["count"] for p, r in by_policy.items()}
    assert exchanged["full"] > 0 and exchanged["full:keep_collectives=true"] == 0
    # Keeping the exchanged buffers costs little beside full's temporaries (docs/sharding.md's target).
    assert by_policy["full:keep_collectives=true"]["temp"] <= 1.10 * by_policy["full"]["temp"], by_policy
    auto, regathering = rows[3], rows[4]
    # The all-to-alls are priced: auto keeps them; told not to, it re-issues them.
    assert "keep_collectives=true" in auto["policy"] and "all-to-all" not in auto["reissued_beyond_none"]
    assert "keep_collectives" not in regathering["policy"]
    assert "; keeps collectives: cheaper than re-issuing them" in proc.stderr
    assert "; re-issues collectives, as asked (keep_collectives=false)" in proc.stderr


def test_auto_on_a_tensor_parallel_mesh_prices_the_reissued_all_reduces():
    argv = ["--preset", "tiny", "--mesh", "fsdp=4,tensor=2", "--unrolled", "--json"]
    policies = ["none", "auto:budget=0.6", "auto:budget=0.6,keep_collectives=false"]
    proc = _run_memory([*argv, *(a for p in policies for a in ("--policy", p))])
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, auto, reducing = json.loads(proc.stdout)
    # The row-parallel all-reduces are priced (the key's plans set keep_collectives, not
    # keep_gathered): auto keeps them; told not to, it re-issues them.
    assert "keep_collectives=true" in auto["policy"]
    assert auto["reissued_beyond_none"].get("all-reduce", {"count": 0})["count"] <= 0
    assert "keep_collectives" not in reducing["policy"] and reducing["reissued_beyond_none"]["all-reduce"]["count"] > 0
    assert "; keeps collectives: cheaper than re-issuing them" in proc.stderr


@pytest.mark.slow  # the planner's keep_gathered choice is engine-free (tests/jremat/_plan/test_planner.py)
def test_auto_keep_gathered_on_a_mesh_under_remat3():
    _check_auto_keep_gathered(*_mesh_run(remat3="1"))


#: Per device, between full's train-step peak at batch 1 per data shard (190,724 B on XLA:CPU) and
#: none's (253,124 B): the test checks that it still is.
FIT_BUDGET_BYTES = 245_000


@pytest.mark.slow  # a whole CLI search on 8 devices; fit_search on a mesh is tested in tests/jremat/_measure/test_collectives.py
def test_fit_on_a_mesh_fits_a_per_device_budget_and_searches_keeping_gathered_weights():
    argv = ["--preset", "tiny", "--mesh", "fsdp=8", "--remat-head-chunks", "0", "--unrolled", "--fit"]
    argv += ["--memory-budget", str(FIT_BUDGET_BYTES), "--policy", "none", "--policy", "full", "--finalists", "1"]
    proc = _run_memory([*argv, "--json"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    probes = {(p["policy"], p["batch_size"]): p for p in out["probes"]}
    assert probes[("full", 1)]["peak_bytes"] <= FIT_BUDGET_BYTES < probes[("none", 1)]["peak_bytes"]
    assert out["per_device"] and out["mesh"] == "fsdp=8" and out["data_shards"] == 8
    winner = out["winner"]
    assert winner["peak_bytes"] <= FIT_BUDGET_BYTES and winner["devices"] == 8
    # FSDP all-gathers: full's keep_gathered variant was searched, and issues fewer all-gathers than full.
    gathers = {k: dict((c[0], c[1]) for c in p["collectives"])["all-gather"] for k, p in probes.items()}
    assert gathers[("full:keep_gathered=true", 1)] < gathers[("full", 1)]
    assert dict(out["time_model"]["collective_s_per_byte"])["all-gather"] > 0  # measured on the mesh
    assert "per device" in proc.stderr


def test_a_one_device_mesh_is_worded_in_the_singular(capsys):
    argv = ["--preset", "tiny", "--mesh", "fsdp=1", "--batch-size", "2", "--seq-len", "8", "--policy", "full"]
    assert memory.main(argv) == 0
    assert "gradient step on mesh data=1 (1 device), compiled only;" in capsys.readouterr().out
    one = sharded_steps.DeviceMemory("data=1", 1, 0, 0, 0, 0, 218_172, "argument + output - alias + temp")
    assert one.format().startswith("mesh data=1 (1 device), per device: peak 213.06 KiB, temp 0 B")
    assert dataclasses.replace(one, mesh="fsdp=8", devices=8).format().startswith("mesh fsdp=8 (8 devices), per")


def _kinds(row: dict) -> dict:
    return row["collectives"]["kinds"]


@pytest.mark.parametrize("mesh", ["fsdp=8", "fsdp=4,tensor=2"])
@pytest.mark.parametrize("layout", [[], ["--unrolled"]], ids=["scanned", "unrolled"])
def test_keep_collectives_on_the_reference_model_reissues_nothing_below_nones_peak(mesh, layout):
    # The command: gathers left to XLA in the blocks (scanned) or written by the model, the
    # head's 4 chunks (the default) each device's own (models.head.ShardedHead); the default batch.
    argv = ["--preset", "tiny", "--mesh", mesh, *layout, "--json"]
    proc = _run_memory([*argv, "--policy", "none", "--policy", "full", "--policy", "full:keep_collectives=true"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {row["policy"]: row for row in json.loads(proc.stdout)}
    none, full, kept = rows["none"], rows["full"], rows["full:keep_collectives=true"]
    assert (
        _kinds(full)["all-gather"]["count"] > _kinds(none)["all-gather"]["count"] >= _kinds(kept)["all-gather"]["count"]
    )
    # Nothing beyond none (the cotangent tie's 4-byte all-reduces left out): the head reduces its
    # loss, its gradient and its vocabulary's statistics once, not per chunk.
    reissued = kept["reissued_beyond_none"]
    assert all(entry["count"] <= 0 for entry in reissued.values()), reissued
    recomputed = {kind for kind, entry in _kinds(kept).items() if "recompute" in entry["phases"]}
    # Scanned: the matrices the backward pass reads are gathered in the recomputation, as without remat.
    assert recomputed == ({"all-gather"} if layout == [] else set())
    if mesh != "fsdp=8":  # the row-parallel matmuls' all-reduces: full re-issues them, the key keeps them
        assert _kinds(full)["all-reduce"]["phases"].get("recompute", 0) > 0
    assert kept["peak"] < none["peak"]
