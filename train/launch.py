"""Start a multi-process JAX run on this machine: ``python -m train.launch --processes 2 -- python -m train.ptb ...``.

For trying multi-host training on one box. Every process gets the environment that
:func:`train.distributed.initialize_distributed` reads on a real cluster:
``JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT`` (a free local port unless ``--port`` is given),
``JAX_NUM_PROCESSES`` and its own ``JAX_PROCESS_ID``; with ``--cpu-devices N`` also
``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (N simulated CPU
devices per process, which talk to the other processes through gloo collectives).

Process 0 writes to this terminal directly; the other processes' output is forwarded line by
line with a ``[process I]`` prefix. The processes run in their own process groups: Ctrl-C here is
forwarded to each of them once (``train.ptb`` saves a checkpoint and stops after the same step on
every process). When one process fails, the others get ``--grace-s`` seconds to end by
themselves (to finish a checkpoint, or fail with their own message), then SIGTERM, then SIGKILL.

Exit codes: 0 every process succeeded; otherwise the first failing process's code (128 + N when
it was killed by signal N); 2 bad launcher arguments; 124 ``--timeout-s`` ran out.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from jremat.train.usage import EXIT_USAGE, OneLineErrorParser, UsageError, exit_without_train_extra, program_name

EXIT_TIMEOUT = 124

#: Seconds between SIGTERM and SIGKILL when stopping processes.
_TERM_WAIT_S = 5.0

#: The loopback address the coordinator listens on for local runs.
LOCAL_HOST = "127.0.0.1"

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port(host: str = LOCAL_HOST) -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def process_env(
    base: Mapping[str, str], process_id: int, num_processes: int, port: int, cpu_devices: int | None = None
) -> dict[str, str]:
    """The environment of local process ``process_id``: ``base`` plus the multi-process variables.

    Args:
      base: the launcher's environment.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      num_processes: how many processes the run has.
      port: the coordinator's port on 127.0.0.1.
      cpu_devices: if set, simulate this many CPU devices in the process (``JAX_PLATFORMS=cpu``
        and the XLA device-count flag, replacing one already in ``XLA_FLAGS``).
    """
    env = dict(base)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"{LOCAL_HOST}:{port}",
        JAX_NUM_PROCESSES=str(num_processes),
        JAX_PROCESS_ID=str(process_id),
    )
    if cpu_devices is not None:
        flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={cpu_devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _forward(stream: IO[str], sink: IO[str], prefix: str) -> None:
    """Copy ``stream`` to ``sink`` line by line, each line prefixed, and close ``stream`` at its end."""
    with stream:
        for line in stream:
            sink.write(prefix + line)
            sink.flush()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Launch:
    """Local processes of one multi-process run, started together and stopped together.

    Args:
      command: the program to run in every process (``["python", "-m", "train.ptb", ...]``).
      num_processes: how many processes.
      cpu_devices: simulated CPU devices per process (``None``: leave the platform alone).
      port: the coordinator port on 127.0.0.1 (``None``: a free one).
      grace_s: after one process fails, seconds the others get to end by themselves before
        :meth:`stop`.
    """

    def __init__(
        self,
        command: Sequence[str],
        num_processes: int,
        *,
        cpu_devices: int | None = None,
        port: int | None = None,
        grace_s: float = 10.0,
    ):
        self.command = list(command)
        self.num_processes = num_processes
        self.cpu_devices = cpu_devices
        self.port = free_port() if port is None else port
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []

    def start(self, env: Mapping[str, str] | None = None) -> None:
        """Start every process (process 0 on this terminal, the others with prefixed output).

        Raises:
          UsageError: if the command cannot be started (not found, not executable).
        """
        base = os.environ if env is None else env
        for pid in range(self.num_processes):
            piped = pid > 0
            try:
                proc = subprocess.Popen(
                    self.command,
                    env=process_env(base, pid, self.num_processes, self.port, self.cpu_devices),
                    stdout=subprocess.PIPE if piped else None,
                    stderr=subprocess.PIPE if piped else None,
                    text=piped,
                    errors="replace" if piped else None,
                    start_new_session=True,
                )
            except OSError as err:
                self.stop()
                self._join_forwarders()
                raise UsageError(f"cannot start {self.command[0]!r}: {err.strerror or err}") from None
            self.procs.append(proc)
            if piped:
                for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                    thread = threading.Thread(target=_forward, args=(stream, sink, f"[process {pid}] "), daemon=True)
                    thread.start()
                    self._threads.append(thread)

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to every process still running."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def _wait_all(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        """SIGTERM every process still running, then SIGKILL those still there after a few seconds."""
        self.signal_all(signal.SIGTERM)
        self._wait_all(_TERM_WAIT_S)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def wait(self, timeout_s: float | None = None) -> tuple[int, str | None]:
        """Wait for the processes; stop the rest as soon as one fails.

        Args:
          timeout_s: stop every process after this many seconds (``None``: no limit).

        Returns:
          ``(exit code, message)``: ``(0, None)`` when every process succeeded; otherwise the
          first failing process's exit code (128 + N for signal N), or 124 on timeout, and a
          one-line description.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                failed = [(pid, c) for pid, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    pid, code = failed[0]
                    running = sum(c is None for c in codes)
                    ended = self._wait_all(self.grace_s)
                    self.stop()
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    extra = f"; stopped the {running} still running" if running and not ended else ""
                    return _exit_code(code), f"process {pid} {how}{extra}"
                if all(c == 0 for c in codes):
                    return 0, None
                if deadline is not None and time.monotonic() > deadline:
                    self.stop()
                    return EXIT_TIMEOUT, f"the processes did not finish within {timeout_s:g} s; stopped them"
                time.sleep(0.05)
        finally:
            self._join_forwarders()

    def _join_forwarders(self) -> None:
        # Each forwarding thread closes its pipe at end of file. A pipe still open after the wait
        # is held by a process the command started that outlived it; its daemon thread keeps
        # forwarding (closing the pipe here would block until that process exits).
        for thread in self._threads:
            thread.join(timeout=5)


def build_parser() -> OneLineErrorParser:
    """The launcher's argument parser (the command to run follows ``--``)."""
    parser = OneLineErrorParser(
        prog=program_name("train.launch"),
        description="Start N local processes of one multi-process JAX run (coordinator on 127.0.0.1).",
        epilog="Example: python -m train.launch --processes 2 --cpu-devices 4 -- "
        "python -m train.ptb --preset tiny --mesh data=4,fsdp=2 --batch-size 8",
        allow_abbrev=False,
    )
    parser.add_argument("--processes", type=int, required=True, help="number of processes to start")
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="simulate this many CPU devices per process (sets JAX_PLATFORMS=cpu)",
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--timeout-s", type=float, default=None, help="stop every process after this many seconds")
    parser.add_argument(
        "--grace-s",
        type=float,
        default=10.0,
        help="after one process fails, seconds the others get to end by themselves before SIGTERM (default 10)",
    )
    return parser


def parse_args(argv: Sequence[str]):
    """``(options, command)`` from the launcher's arguments; the command is everything after ``--``.

    Raises:
      UsageError: a malformed option, a missing or empty command, or an out-of-range value.
      SystemExit: ``--help`` (code 0, after printing the help).
    """
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    options = build_parser().parse_args(argv[:split])  # --help prints and exits here
    if split == len(argv):
        raise UsageError(
            "give the command to run after '--', e.g. python -m train.launch --processes 2 -- "
            "python -m train.ptb --mesh data=2"
        )
    command = argv[split + 1 :]
    if not command:
        raise UsageError("the command after '--' is empty; give the program every process runs")
    if options.processes < 1:
        raise UsageError(f"--processes must be a positive integer, got {options.processes}")
    if options.cpu_devices is not None and options.cpu_devices < 1:
        raise UsageError(f"--cpu-devices must be a positive integer, got {options.cpu_devices}")
    if options.port is not None and not 1 <= options.port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535, got {options.port}")
    if options.timeout_s is not None and not options.timeout_s > 0:
        raise UsageError(f"--timeout-s must be a positive number of seconds, got {options.timeout_s}")
    if not options.grace_s >= 0:
        raise UsageError(f"--grace-s must be >= 0, got {options.grace_s}")
    return options, command


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI entry point; returns the exit code (see the module docstring)."""
    try:
        options, command = parse_args(sys.argv[1:] if argv is None else argv)
        launch = Launch(
            command, options.processes, cpu_devices=options.cpu_devices, port=options.port, grace_s=options.grace_s
        )
        launch.start()
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE

    def forward(signum, frame):
        launch.signal_all(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code, message = launch.wait(options.timeout_s)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if message:
        print(f"{'error' if code else 'note'}: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    exit_without_train_extra("train.launch")  # the processes it starts run the [train] CLIs
    sys.exit(main())
