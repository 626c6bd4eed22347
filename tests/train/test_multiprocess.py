"""Multi-process training on one machine: train.launch, jax.distributed over gloo, sharded checkpoints.

The end-to-end checks start real processes (2 processes x 4 simulated CPU devices, coordinator
on 127.0.0.1) once per module, all with bounded waits: the single-process 8-device reference,
the 2-process run SIGKILLed after its step-2 checkpoint (each process records the batch rows it
feeds), and, at the same time, the start-up failures (coordinator unreachable, process 0 without
its peer, two processes with different JAX_NUM_PROCESSES, a mesh of the wrong size); then the
2-process resume. XLA's persistent compilation cache (in pytest's cache directory) lets
process 0 of the resume, and later sessions, reuse compiled programs.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from jremat.train import distributed as dist
from jremat.train import launch, ptb
from jremat.train import sharding as sh
from jremat.train.metrics import read_rows
from tests.compile_flags import FAST_COMPILE_XLA_FLAGS
from tests.conftest import REPO, TOLERANCE_XLA_FLAGS

#: Multi-device runs in subprocesses: CI runs them after the default suite (``-m heavy``).
pytestmark = pytest.mark.heavy

STEPS, CKPT_EVERY, KILL_AT_CALL = 4, 2, 4  # killed before step 4: steps 1-3 done, checkpoint of step 2 complete
RUN_TIMEOUT_S = 240  # each launch is bounded; the processes are killed past it
FAILURE_TIMEOUT_S = 90  # the start-up failures end in seconds
#: The start-up handshake's timeout where a test expects it to fail fast: a hang guard, not a speed claim.
HANG_GUARD_S = 120


def _base_env(cache_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
    env.update(
        # Faster compiles for these processes; every comparison is between runs under the same flags.
        XLA_FLAGS=f"{FAST_COMPILE_XLA_FLAGS} {TOLERANCE_XLA_FLAGS}",
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONUNBUFFERED="1",
    )
    return env


def _train_flags(ptb_offline_dir, *extra):
    return [
        "--preset",
        "tiny",
        "--steps",
        str(STEPS),
        "--batch-size",
        "8",
        "--dropout",
        "0.3",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--no-memory-report",
        "--data-dir",
        ptb_offline_dir,
        "--mesh",
        "data=4,fsdp=2",
        *extra,
    ]


def _popen(cmd, env):
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _finish(proc, timeout_s=RUN_TIMEOUT_S):
    """``(returncode, stdout, stderr)``; kills the process group if it runs past ``timeout_s``."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} ran past {timeout_s} s; killed. stderr tail:\n{err[-3000:]}")
    return proc.returncode, out, err


def _closed_port():
    """A local port with nothing listening on it."""
    return launch.free_port()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, ptb_offline_dir):
    """Every multi-process run of this module, its outputs, metrics and wall times."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    pytest_cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache = pytest_cache.mkdir("jremat-xla-cache") if pytest_cache else tmp / "xla-cache"
    env = _base_env(cache)
    ckpt = tmp / "ck"
    launcher = [
        sys.executable,
        "-m",
        "train.launch",
        "--processes",
        "2",
        "--cpu-devices",
        "4",
        "--timeout-s",
        str(RUN_TIMEOUT_S),
        "--grace-s",
        "30",
        "--",
    ]
    started = time.perf_counter()
    mismatch = dict(env, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{launch.free_port()}")
    checkpointed = ["--ckpt-dir", str(ckpt), "--ckpt-every", str(CKPT_EVERY), "--metrics-file", str(tmp / "mp.jsonl")]
    rows_dir = tmp / "rows"
    rows_dir.mkdir()
    procs = {
        "reference": _popen(
            [
                sys.executable,
                "-m",
                "train.ptb",
                *_train_flags(ptb_offline_dir, "--metrics-file", str(tmp / "ref.jsonl")),
            ],
            dict(env, XLA_FLAGS=env["XLA_FLAGS"] + " --xla_force_host_platform_device_count=8"),
        ),
        "killed": _popen(
            launcher
            + [
                sys.executable,
                "-m",
                "tests.train.multiprocess_child",
                str(KILL_AT_CALL),
                "--",
                *_train_flags(ptb_offline_dir, *checkpointed),
            ],
            dict(env, JREMAT_TEST_ROWS_DIR=str(rows_dir)),
        ),
        # process 1 of 2 whose coordinator never starts
        "unreachable": _popen(
            [sys.executable, "-m", "train.ptb", *_train_flags(ptb_offline_dir, "--init-timeout-s", "2")],
            dict(env, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_closed_port()}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1"),
        ),
        # process 0 of 2 whose process 1 never comes
        "alone": _popen(
            [sys.executable, "-m", "train.ptb", *_train_flags(ptb_offline_dir, "--init-timeout-s", "3")],
            dict(
                env,
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{launch.free_port()}",
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID="0",
            ),
        ),
        "bad_mesh": _popen(
            launcher + [sys.executable, "-m", "train.ptb", *_train_flags(ptb_offline_dir, "--mesh", "data=2,fsdp=2")],
            env,
        ),
        # process 0 believes the run has 2 processes, process 1 that it has 3
        "mismatch_0": _popen(
            [sys.executable, "-m", "train.ptb", *_train_flags(ptb_offline_dir, "--init-timeout-s", "60")],
            dict(mismatch, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0"),
        ),
        "mismatch_1": _popen(
            [sys.executable, "-m", "train.ptb", *_train_flags(ptb_offline_dir, "--init-timeout-s", "60")],
            dict(mismatch, JAX_NUM_PROCESSES="3", JAX_PROCESS_ID="1"),
        ),
    }
    out = {}
    for name, proc in procs.items():
        out[name] = _finish(proc, RUN_TIMEOUT_S if name in ("reference", "killed") else FAILURE_TIMEOUT_S)
    out["rows"] = {
        pid: json.loads((rows_dir / f"rows.{pid}.json").read_text())
        for pid in (0, 1)
        if (rows_dir / f"rows.{pid}.json").exists()
    }
    out["first_wave_s"] = time.perf_counter() - started
    with open(tmp / "mp.jsonl") as handle:
        out["killed_rows"] = handle.read()
    t0 = time.perf_counter()
    out["resumed"] = _finish(
        _popen(
            launcher
            + [
                sys.executable,
                "-m",
                "train.ptb",
                *_train_flags(ptb_offline_dir, *checkpointed, "--resume"),
            ],
            env,
        )
    )
    out["resume_s"] = time.perf_counter() - t0
    out["total_s"] = time.perf_counter() - started
    out["reference_losses"] = {r["step"]: r["loss"] for r in read_rows(tmp / "ref.jsonl")}
    out["mp_losses"] = {r["step"]: r["loss"] for r in read_rows(tmp / "mp.jsonl")}
    out["ckpt"] = ckpt
    killed = {
        r["step"]: r["loss"] for r in (json.loads(line) for line in out["killed_rows"].splitlines() if line.strip())
    }
    diffs = [
        _rel(losses[s], out["reference_losses"][s])
        for losses in (killed, out["mp_losses"])
        for s in losses
        if s in out["reference_losses"]
    ]
    print(
        f"multi-process runs: first wave {out['first_wave_s']:.1f} s, resume {out['resume_s']:.1f} s, "
        f"total {out['total_s']:.1f} s; max relative loss difference to one process {max(diffs, default=-1):.2e}"
    )
    return out


def _rel(a, b):
    return abs(a - b) / abs(b)


def test_two_processes_match_one_process_with_eight_devices_and_print_once(runs):
    code, _, err = runs["reference"]
    assert code == 0, err[-3000:]
    code, out, err = runs["killed"]
    assert code == 128 + signal.SIGKILL, err[-3000:]
    # every process kills itself at the same step; the launcher names the first it sees end
    assert re.search(r"error: process [01] was killed by signal 9", err), err[-3000:]
    ref = runs["reference_losses"]
    assert sorted(ref) == list(range(1, STEPS + 1))
    killed_rows = [r for r in runs["killed_rows"].splitlines() if r.strip()]
    assert len(killed_rows) == KILL_AT_CALL - 1  # process 0 alone writes the metrics file: one row per step
    for row in map(json.loads, killed_rows):
        assert _rel(row["loss"], ref[row["step"]]) <= 1e-5, (row, ref)
    # process 0 prints the run; process 1 only what native libraries write (gloo's connection lines)
    assert out.count("train config:") == 1
    others = [line for line in (out + err).splitlines() if line.startswith("[process 1]")]
    # gloo's C++ prints may be cut anywhere when both processes write at once (a rank's digit
    # lands on another line): remove the words of its connection messages from process 1's
    # output; nothing else may remain.
    joined = "".join(line[len("[process 1]") :] for line in others)
    gloo_words = r"\[Gloo\]|Rank|is connected to|peer ranks\.?|Expected number of connected|is\s*:|\d+|\s+"
    assert re.sub(gloo_words, "", joined) == "", others


def test_checkpoints_are_written_by_every_process(runs):
    state = runs["ckpt"] / str(CKPT_EVERY) / "state"
    for pid in (0, 1):
        shard_dir = state / f"ocdbt.process_{pid}"
        assert shard_dir.is_dir() and any((shard_dir / "d").iterdir()), sorted(os.listdir(state))


def test_kill_and_resume_gives_the_uninterrupted_losses(runs):
    code, out, err = runs["resumed"]
    assert code == 0, err[-3000:]
    assert f"resumed from {runs['ckpt']} at step {CKPT_EVERY}" in out
    ref, mp = runs["reference_losses"], runs["mp_losses"]
    assert sorted(mp) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert _rel(mp[step], ref[step]) <= 1e-5, (step, mp[step], ref[step])
    assert out.count("summary") == 1


def test_unreachable_coordinator_exits_2_with_one_line_naming_the_address(runs):
    code, out, err = runs["unreachable"]
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: could not reach the coordinator at 127.0.0.1:") and "within 2 s" in lines[0]
    assert out == ""


def test_process_zero_without_its_peers_exits_2_with_one_line(runs):
    code, _, err = runs["alone"]
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: not every process reached the coordinator at 127.0.0.1:")
    assert "within 3 s (this is process 0; no word from process 1)" in lines[0] and "JAX_NUM_PROCESSES=2" in lines[0]


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "mismatch_0",
            (
                "error: JAX_NUM_PROCESSES=2 on process 0 (the coordinator at 127.0.0.1:{port}), but process 1 "
                "was started with JAX_NUM_PROCESSES=3; give every process the same JAX_NUM_PROCESSES"
            ),
        ),
        (
            "mismatch_1",
            (
                "error: JAX_NUM_PROCESSES=3 on this process (process 1), but process 0 (the coordinator at "
                "127.0.0.1:{port}) has JAX_NUM_PROCESSES=2; give every process the same JAX_NUM_PROCESSES"
            ),
        ),
    ],
)
def test_processes_with_different_process_counts_both_exit_2_naming_both_counts(runs, name, message):
    code, out, err = runs[name]
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1, lines
    port = re.search(r"127\.0\.0\.1:(\d+)", lines[0]).group(1)
    assert lines[0] == message.format(port=port)
    assert out == ""


def test_each_process_feeds_only_its_own_rows_of_the_batch(runs, ptb_offline_dir):
    from jremat.train import data as data_lib

    rows = runs["rows"]
    assert sorted(rows) == [0, 1], rows
    assert rows[0]["rows"] == [0, 4] and rows[1]["rows"] == [4, 8]  # data=4,fsdp=2 over 2 x 4 devices, batch 8
    corpus = data_lib.load_corpus(ptb_offline_dir)
    seq_len = len(rows[0]["first"][0])
    first = data_lib.Batches(corpus.train, 8, seq_len, split="train")[0][0]
    for pid in (0, 1):
        lo, hi = rows[pid]["rows"]
        assert rows[pid]["first"] == first[lo:hi].tolist()  # 4 rows each, its own


def test_mesh_not_matching_the_devices_of_all_processes_exits_2(runs):
    code, out, err = runs["bad_mesh"]
    assert code == 2, err[-3000:]
    message = (
        "error: --mesh: mesh data=2,fsdp=2 has 4 devices but 8 are available "
        "(cpu, 2 processes with 4 each); the axis sizes must multiply to 8"
    )
    assert message in err.splitlines() and f"[process 1] {message}" in err.splitlines()
    assert "Traceback" not in err and "train config" not in out


# ----------------------------------------------------------------------------- without JAX processes


def test_wait_for_coordinator_times_out_naming_the_address():
    port = _closed_port()
    with pytest.raises(
        dist.DistributedSetupError,
        match=rf"could not reach the coordinator at 127.0.0.1:{port} "
        r"within 0.3 s",
    ):
        dist.wait_for_coordinator(f"127.0.0.1:{port}", 0.3)


def test_coordinator_port_in_use_is_refused():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(dist.DistributedSetupError, match=f"cannot open the coordinator port {port}"):
            dist.check_coordinator_port(f"127.0.0.1:{port}")


def test_multi_process_environment_needs_a_mesh(monkeypatch, capsys, ptb_offline_dir):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    flags = [f for f in _train_flags(ptb_offline_dir) if f not in ("--mesh", "data=4,fsdp=2")]
    assert ptb.main(flags) == 2
    err = capsys.readouterr().err
    assert "one process of a multi-process run" in err and "--mesh is not given" in err
    assert ptb.main(flags + ["--init-timeout-s", "0"]) == 2
    assert "--init-timeout-s must be a positive number of seconds, got 0.0" in capsys.readouterr().err


# ----------------------------------------------------------------------------- start-up handshake, in threads


def _handshake(counts, timeout_s=20):
    """Run process 0 (``coordinate_start``) and processes 1.. (``join_start``) in threads; each one's error or None.

    ``counts`` maps process id -> (its JAX_PROCESS_ID, its JAX_NUM_PROCESSES).
    """
    import threading

    address = f"127.0.0.1:{launch.free_port()}"
    errors = {}

    def run(key, pid, n):
        try:
            if pid == 0:
                dist.coordinate_start(address, n, timeout_s)
            else:
                dist.join_start(address, pid, n, timeout_s)
            errors[key] = None
        except dist.DistributedSetupError as err:
            errors[key] = str(err)

    threads = [threading.Thread(target=run, args=(key, pid, n)) for key, (pid, n) in counts.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    return address, errors


def test_handshake_lets_matching_processes_start():
    _, errors = _handshake({"a": (0, 3), "b": (1, 3), "c": (2, 3)})
    assert errors == {"a": None, "b": None, "c": None}


def test_process_zero_with_the_larger_count_fails_fast_on_every_process():
    t0 = time.perf_counter()
    address, errors = _handshake({"a": (0, 3), "b": (1, 2)}, timeout_s=HANG_GUARD_S)
    # Fast: the errors below name the mismatch, where a wait for the timeout would end in "not every process".
    assert time.perf_counter() - t0 < HANG_GUARD_S
    assert errors["a"] == (
        f"JAX_NUM_PROCESSES=3 on process 0 (the coordinator at {address}), but process 1 was "
        "started with JAX_NUM_PROCESSES=2; give every process the same JAX_NUM_PROCESSES"
    )
    assert errors["b"].startswith(
        f"JAX_NUM_PROCESSES=2 on this process (process 1), but process 0 (the coordinator "
        f"at {address}) has JAX_NUM_PROCESSES=3"
    )


def test_repeated_process_id_stops_every_waiting_process():
    address, errors = _handshake({"a": (0, 3), "b": (1, 3), "c": (1, 3)})
    message = "two processes were started with JAX_PROCESS_ID=1; give each process its own JAX_PROCESS_ID from 0 to 2"
    assert errors["a"] == message
    stopped = f"process 0 (the coordinator at {address}) stopped the start-up: {message}"
    assert errors["b"] == errors["c"] == stopped  # the one waiting, and the one refused


def test_process_zero_names_the_processes_that_never_came():
    address, errors = _handshake({"a": (0, 3), "b": (2, 3)}, timeout_s=1)
    assert errors["a"].startswith(
        f"not every process reached the coordinator at {address} within 1 s "
        "(this is process 0; no word from process 1); start all JAX_NUM_PROCESSES=3"
    )
    assert errors["b"].startswith(f"process 0 (the coordinator at {address}) stopped the start-up: not every process")


def test_a_coordinator_that_does_not_speak_the_handshake_is_named():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]

        def answer():
            conn, _ = other.accept()
            conn.recv(100)
            conn.sendall(b"\x00\x00\x08\x07garbage")
            conn.close()

        import threading

        thread = threading.Thread(target=answer)
        thread.start()
        with pytest.raises(
            dist.DistributedSetupError,
            match=f"the coordinator at 127.0.0.1:{port} did not answer the start-up handshake",
        ):
            dist.join_start(f"127.0.0.1:{port}", 1, 2, 5)
        thread.join()


# ----------------------------------------------------------------------------- per-process batch rows


def test_rows_held_joins_contiguous_spans_and_refuses_gaps():
    assert sh.rows_held([(4, 6), (6, 8), (4, 6)]) == slice(4, 8)
    with pytest.raises(ValueError, match="gap"):
        sh.rows_held([(0, 2), (4, 6)])
    with pytest.raises(ValueError, match="no device"):
        sh.rows_held([])


def test_one_process_holds_every_row_and_shard_batch_checks_the_share():
    import jax
    import numpy as np

    mesh = sh.make_mesh({"data": 1}, jax.devices()[:1])
    assert sh.process_batch_rows(mesh, 6) == slice(0, 6)
    batch = np.arange(12, dtype=np.int32).reshape(6, 2)
    assert (np.asarray(sh.shard_batch(mesh, batch)) == batch).all()
    with pytest.raises(ValueError, match=r"this process holds rows 0 to 5 of a batch of 6 \(6 rows\), got 3 rows"):
        sh.shard_batch(mesh, batch[:3], 6)


def test_batches_keep_only_the_rows_asked_for():
    import numpy as np

    from jremat.train import data as data_lib

    stream = np.arange(100, dtype=np.int32)
    full, own = (
        data_lib.Batches(stream, 4, 5, split="train"),
        data_lib.Batches(stream, 4, 5, split="train", rows=slice(2, 4)),
    )
    assert len(full) == len(own)
    for i in range(len(full)):
        assert (own[i][0] == full[i][0][2:4]).all() and (own[i][1] == full[i][1][2:4]).all()
