"""train.launch: per-process environment, argument errors, prefixed output, stopping every process."""

import os
import subprocess
import sys
import time

import pytest

from jremat.train import launch
from tests.conftest import REPO

#: Seconds a launched test command may run: a hang guard, not a speed claim.
HANG_GUARD_S = 120


def test_the_launcher_imports_no_jax():
    check = "import sys, jremat.train.launch; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_process_env_sets_the_coordinator_and_replaces_the_device_count():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0", "A": "1"}
    env = launch.process_env(base, 1, 2, 1234, cpu_devices=4)
    assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"], env["JAX_PLATFORMS"], env["A"]) == ("2", "1", "cpu", "1")
    assert env["XLA_FLAGS"].split() == [
        "--xla_backend_optimization_level=0",
        "--xla_force_host_platform_device_count=4",
    ]
    assert "JAX_PLATFORMS" not in launch.process_env({}, 0, 1, 1)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--processes", "2"], "give the command to run after '--'"),
        (["--processes", "2", "--"], "the command after '--' is empty"),
        (["--processes", "0", "--", "true"], "--processes must be a positive integer, got 0"),
        (["--processes", "2", "--cpu-devices", "0", "--", "true"], "--cpu-devices must be a positive integer"),
        (["--processes", "2", "--port", "70000", "--", "true"], "--port must be between 1 and 65535"),
        (["--processes", "two", "--", "true"], "argument --processes: invalid int value: 'two'"),
        (["--processes", "1", "--", "/no/such/program"], "cannot start '/no/such/program'"),
    ],
)
def test_launcher_bad_arguments_exit_2_with_one_line(capsys, argv, fragment):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_launcher_help_names_every_flag(capsys):
    assert launch.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--processes", "--cpu-devices", "--port", "--timeout-s", "--grace-s", "train.ptb --preset tiny"):
        assert flag in out


def test_launcher_prefixes_other_processes_and_stops_them_when_one_fails(capfd, monkeypatch, tmp_path):
    # Each process marks its greeting printed; process 1 fails only once all three have printed, so
    # a process that starts late is not stopped before it prints (no race with --grace-s).
    monkeypatch.setenv("JREMAT_TEST_MARKS", str(tmp_path))
    script = (
        "import os, sys, time\n"
        "pid = int(os.environ['JAX_PROCESS_ID'])\n"
        "marks = os.environ['JREMAT_TEST_MARKS']\n"
        "print('hello from', pid, 'of', os.environ['JAX_NUM_PROCESSES'], os.environ['JAX_COORDINATOR_ADDRESS'])\n"
        "sys.stdout.flush()\n"
        "open(os.path.join(marks, str(pid)), 'w').close()\n"
        f"deadline = time.monotonic() + {HANG_GUARD_S}\n"
        "while pid == 1 and len(os.listdir(marks)) < 3 and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        f"sys.exit(3) if pid == 1 else time.sleep({10 * HANG_GUARD_S})\n"
    )
    t0 = time.perf_counter()
    code = launch.main(["--processes", "3", "--grace-s", "0.2", "--", sys.executable, "-c", script])
    elapsed_s = time.perf_counter() - t0
    out, err = capfd.readouterr()
    assert sorted(os.listdir(tmp_path)) == ["0", "1", "2"]
    assert code == 3 and elapsed_s < 2 * HANG_GUARD_S  # stopped, not the others' sleep run out
    assert "error: process 1 exited with code 3; stopped the 2 still running" in err
    assert "[process 1] hello from 1 of 3 127.0.0.1:" in out and "[process 2] hello from 2 of 3" in out
    assert any(line.startswith("hello from 0 of 3") for line in out.splitlines())


def test_launcher_timeout_stops_everything():
    launch_ = launch.Launch([sys.executable, "-c", "import time; time.sleep(60)"], 2, grace_s=0.1)
    launch_.start()
    code, message = launch_.wait(timeout_s=0.5)
    assert code == launch.EXIT_TIMEOUT and "did not finish within 0.5 s" in message
    assert all(p.poll() is not None for p in launch_.procs)
