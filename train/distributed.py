"""Joining a multi-process run: the ``jax.distributed`` environment, coordinator checks, process-0 helpers.

Call :func:`initialize_distributed` before anything else touches JAX; it calls
``jax.distributed.initialize`` when ``JAX_COORDINATOR_ADDRESS`` (with ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID``) or a cluster scheduler (SLURM, Open MPI) is found in the environment. With
the explicit variables, every process first shakes hands with process 0 on the coordinator
port, so a coordinator that cannot be reached, a port already taken and processes that disagree
on the process count are one-line errors instead of hangs. See docs/multiprocess.md.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

#: The variables that name a multi-process run explicitly (all three, or none).
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def distributed_config(env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The ``jax.distributed.initialize`` arguments the environment asks for, or ``None`` (single process).

    * ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES`` and
      ``JAX_PROCESS_ID``: explicit; returns those three arguments.
    * otherwise a multi-task SLURM job (``SLURM_JOB_ID`` with ``SLURM_NTASKS`` > 1) or Open MPI
      run (``OMPI_COMM_WORLD_SIZE`` > 1): returns ``{}`` (JAX detects the rest itself).

    Raises:
      ValueError: if only some of :data:`DISTRIBUTED_ENV` are set, or a number is malformed
        or out of range.
    """
    env = os.environ if env is None else env
    given = [v for v in DISTRIBUTED_ENV if env.get(v)]
    if given:
        missing = [v for v in DISTRIBUTED_ENV if v not in given]
        if missing:
            raise ValueError(
                f"multi-host setup: {', '.join(given)} set but {', '.join(missing)} missing; set all of "
                f"{', '.join(DISTRIBUTED_ENV)} (or none for a single process)"
            )
        address = env["JAX_COORDINATOR_ADDRESS"]
        if not re.match(r"^[^:\s]+:\d+$", address):
            raise ValueError(f"JAX_COORDINATOR_ADDRESS must be HOST:PORT of process 0, got {address!r}")
        try:
            n, pid = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
        except ValueError:
            raise ValueError(
                f"JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers, got "
                f"{env['JAX_NUM_PROCESSES']!r} and {env['JAX_PROCESS_ID']!r}"
            ) from None
        if n < 1 or not 0 <= pid < n:
            raise ValueError(
                f"need JAX_NUM_PROCESSES >= 1 and 0 <= JAX_PROCESS_ID < JAX_NUM_PROCESSES, got {n} and {pid}"
            )
        return dict(coordinator_address=address, num_processes=n, process_id=pid)

    def count(name):
        try:
            return int(env.get(name, "1"))
        except ValueError:
            return 1

    if (env.get("SLURM_JOB_ID") and count("SLURM_NTASKS") > 1) or count("OMPI_COMM_WORLD_SIZE") > 1:
        return {}
    return None


class DistributedSetupError(ValueError):
    """A multi-process run cannot start: coordinator unreachable, port taken, or inconsistent process counts."""


#: Seconds between connection attempts while waiting for the coordinator.
_POLL_INTERVAL_S = 0.2

#: Extra seconds JAX's own initialization deadline gets beyond ``timeout_s``, so that the
#: watchdog of :func:`initialize_distributed` (a clear one-line message) fires before JAX
#: aborts the process (a fatal C++ log with a stack trace).
_JAX_DEADLINE_GRACE_S = 15

#: Extra seconds a process waits for process 0's answer beyond ``timeout_s``, so that process 0's
#: own verdict (which names the missing or mismatched processes) arrives first.
_REPLY_GRACE_S = 5

#: First word of a process's greeting to process 0 (longer than an HTTP/2 preface, so that a
#: coordinator which is not a jremat process rejects it at once instead of waiting for more).
_HELLO = "jremat-start-handshake"


def _split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _not_every_process(address: str, timeout_s: float, num_processes: int, process_id: int, detail: str = "") -> str:
    return (
        f"not every process reached the coordinator at {address} within {timeout_s:g} s "
        f"(this is process {process_id}{detail}); start all JAX_NUM_PROCESSES={num_processes} processes, "
        "each with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES and its own JAX_PROCESS_ID, "
        "or allow longer with --init-timeout-s"
    )


def _connect(address: str, deadline: float, timeout_s: float):
    """A TCP connection to ``address``, retried until ``deadline``; raises :class:`DistributedSetupError`."""
    import socket
    import time

    host, port = _split_address(address)
    last = "no attempt"
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        except OSError as err:
            last = err.strerror or type(err).__name__
        if time.monotonic() >= deadline:
            raise DistributedSetupError(
                f"could not reach the coordinator at {address} within {timeout_s:g} s ({last}); start process 0 "
                "with the same JAX_COORDINATOR_ADDRESS, check that HOST:PORT names its host and an open port, "
                "or allow longer with --init-timeout-s"
            )
        time.sleep(_POLL_INTERVAL_S)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait until a TCP connection to the coordinator at ``address`` (``host:port``) succeeds.

    Raises:
      DistributedSetupError: if no connection succeeded within ``timeout_s``; the message names
        the address, the timeout and the last connection error.
    """
    import time

    _connect(address, time.monotonic() + timeout_s, timeout_s).close()


def _send(conn, line: str) -> None:
    try:
        conn.sendall(line.encode("utf-8") + b"\n")
    except OSError:
        pass


def _read_line(conn, deadline: float) -> str | None:
    """One line from ``conn`` (``None`` at end of stream, the raw bytes so far if no line comes).

    Raises:
      TimeoutError: nothing complete arrived before ``deadline``.
    """
    import time

    buf = b""
    while b"\n" not in buf and len(buf) < 4096:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(4096)
        except OSError as err:
            if isinstance(err, TimeoutError):
                raise
            chunk = b""
        if not chunk:
            return buf.decode("utf-8", "replace") if buf else None
        buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace")


def _open_coordinator_port(address: str):
    import socket

    _, port = _split_address(address)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("", port))
        listener.listen(1024)  # every other process connects at about the same time
    except OSError as err:
        listener.close()
        raise DistributedSetupError(
            f"process 0 cannot open the coordinator port {port} of JAX_COORDINATOR_ADDRESS={address} "
            f"({err.strerror or err}); choose a free port"
        ) from None
    return listener


def check_coordinator_port(address: str) -> None:
    """Check that process 0 can open the coordinator's port (it listens there on every interface).

    Raises:
      DistributedSetupError: if the port cannot be bound (typically: already in use).
    """
    _open_coordinator_port(address).close()


def coordinate_start(address: str, num_processes: int, timeout_s: float) -> None:
    """Process 0's side of the start-up handshake: hear from every other process before JAX starts.

    Listens on the coordinator port until processes ``1 .. num_processes - 1`` have each sent
    their ``JAX_PROCESS_ID`` and ``JAX_NUM_PROCESSES``, then answers all of them and frees the port
    for ``jax.distributed.initialize``. A process with another count or a repeated id stops the
    start-up at once: process 0 tells every waiting process why and raises.

    Raises:
      DistributedSetupError: the port cannot be opened, a process reports a different
        ``JAX_NUM_PROCESSES`` (the message names both counts) or a repeated ``JAX_PROCESS_ID``, or
        not every process arrived within ``timeout_s`` (the message names the missing ones).
    """
    import socket
    import time

    listener = _open_coordinator_port(address)
    peers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(peers) < num_processes - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = ", ".join(str(i) for i in range(1, num_processes) if i not in peers)
                raise DistributedSetupError(
                    _not_every_process(address, timeout_s, num_processes, 0, f"; no word from process {missing}")
                )
            listener.settimeout(remaining)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                line = _read_line(conn, min(deadline, time.monotonic() + 10))
            except TimeoutError:
                line = None
            parts = (line or "").split()
            if len(parts) != 3 or parts[0] != _HELLO or not (parts[1].isdigit() and parts[2].isdigit()):
                conn.close()  # not a process of this run (a port scanner, a health check)
                continue
            pid, count = int(parts[1]), int(parts[2])
            if count != num_processes:
                _send(conn, f"count {num_processes}")
                conn.close()
                raise DistributedSetupError(
                    f"JAX_NUM_PROCESSES={num_processes} on process 0 (the coordinator at {address}), but process "
                    f"{pid} was started with JAX_NUM_PROCESSES={count}; give every process the same JAX_NUM_PROCESSES"
                )
            if pid in peers or not 1 <= pid < num_processes:
                message = (
                    f"two processes were started with JAX_PROCESS_ID={pid}; give each process its own "
                    f"JAX_PROCESS_ID from 0 to {num_processes - 1}"
                )
                _send(conn, f"abort {message}")
                conn.close()
                raise DistributedSetupError(message)
            peers[pid] = conn
    except DistributedSetupError as err:
        listener.close()
        for conn in peers.values():
            _send(conn, f"abort {err}")
            conn.close()
        raise
    listener.close()  # before answering: a process that has its answer finds JAX's coordinator (or nothing) there
    for conn in peers.values():
        _send(conn, "ok")
    for conn in peers.values():  # let each process close first, so the port is left without lingering connections
        try:
            _read_line(conn, time.monotonic() + 2)
        except (TimeoutError, OSError):
            pass
        conn.close()


def join_start(address: str, process_id: int, num_processes: int, timeout_s: float) -> None:
    """A process's side of the start-up handshake (every process but 0): report to process 0, wait for its answer.

    Returns once process 0 has heard from every process; its port is then free for JAX's
    coordinator service (:func:`wait_for_coordinator` waits for that).

    Raises:
      DistributedSetupError: the coordinator was not reachable within ``timeout_s``, process 0
        has another ``JAX_NUM_PROCESSES`` (the message names both counts) or stopped the start-up,
        not every process arrived in time, or the coordinator is not a jremat process 0.
    """
    import time

    conn = _connect(address, time.monotonic() + timeout_s, timeout_s)
    with conn:
        _send(conn, f"{_HELLO} {process_id} {num_processes}")
        try:
            line = _read_line(conn, time.monotonic() + timeout_s + _REPLY_GRACE_S)
        except TimeoutError:
            raise DistributedSetupError(_not_every_process(address, timeout_s, num_processes, process_id)) from None
    word, _, rest = (line or "").partition(" ")
    if word == "ok":
        return
    if word == "count" and rest.isdigit():
        raise DistributedSetupError(
            f"JAX_NUM_PROCESSES={num_processes} on this process (process {process_id}), but process 0 (the "
            f"coordinator at {address}) has JAX_NUM_PROCESSES={rest}; give every process the same JAX_NUM_PROCESSES"
        )
    if word == "abort":
        raise DistributedSetupError(f"process 0 (the coordinator at {address}) stopped the start-up: {rest}")
    raise DistributedSetupError(
        f"the coordinator at {address} did not answer the start-up handshake; process 0 failed (see its message), "
        "is not a train.ptb process, or was started with JAX_NUM_PROCESSES=1"
    )


def _exit_with_message(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(2)


def initialize_distributed(
    env: Mapping[str, str] | None = None, *, timeout_s: float = 300, fail: Callable[[str], None] = _exit_with_message
) -> bool:
    """Call ``jax.distributed.initialize`` if :func:`distributed_config` finds a multi-process run.

    Must run before any other JAX call in the process. On CPU, cross-process collectives use
    gloo. With the explicit variables, every process first takes part in the start-up handshake
    on the coordinator port (:func:`coordinate_start` on process 0, :func:`join_start` on the
    others), which fails fast and on every process when the processes disagree on
    ``JAX_NUM_PROCESSES`` or one of them is missing; only then does JAX's runtime start.

    Failures once JAX's distributed runtime is running, where an ordinary exit would wait for (or
    be aborted by) the other processes, call ``fail(message)``, which must end the process: not
    every process connecting within ``timeout_s`` (from a watchdog thread; JAX itself would abort
    with a fatal log) and a process count other than ``JAX_NUM_PROCESSES``. The default prints
    ``error: message`` to stderr and exits at once with code 2.

    Args:
      env: the environment to read (default ``os.environ``).
      timeout_s: seconds to wait for the coordinator and for every process to connect.
      fail: called with a one-line message on the failures above; must not return.

    Returns:
      Whether it initialized (``False``: a single-process run, nothing done).

    Raises:
      ValueError: on an inconsistent environment (see :func:`distributed_config`).
      DistributedSetupError: the handshake failed (before JAX's runtime starts).
    """
    import threading

    config = distributed_config(env)
    if config is None:
        return False
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = config.get("coordinator_address")
    if address is not None and config["num_processes"] > 1:
        if config["process_id"] == 0:
            coordinate_start(address, config["num_processes"], timeout_s)
        else:
            join_start(address, config["process_id"], config["num_processes"], timeout_s)
            wait_for_coordinator(address, timeout_s)  # until JAX's coordinator service has taken over the port
    if address is not None:
        message = _not_every_process(address, timeout_s, config["num_processes"], config["process_id"])
    else:
        message = (
            f"not every process reached the coordinator found in the scheduler's environment within "
            f"{timeout_s:g} s; start all of the scheduler's tasks, or allow longer with --init-timeout-s"
        )
    done = threading.Event()

    def watchdog():
        if not done.wait(timeout_s):
            fail(message)

    threading.Thread(target=watchdog, name="jremat-distributed-watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(**config, initialization_timeout=math.ceil(timeout_s) + _JAX_DEADLINE_GRACE_S)
    finally:
        done.set()
    if address is not None and jax.process_count() != config["num_processes"]:
        fail(
            f"JAX_NUM_PROCESSES={config['num_processes']} on this process, but the coordinator at {address} runs "
            f"{jax.process_count()} processes; give every process the same JAX_NUM_PROCESSES"
        )
    return True


def is_primary() -> bool:
    """Whether this is process 0 (the one that prints, writes metrics and shows progress)."""
    return jax.process_index() == 0


def wait_for_all_processes(name: str, timeout_s: float) -> None:
    """Block until every process reaches the barrier ``name`` (nothing to do in a single process).

    A barrier of the coordination service (through orbax's multihost helpers), so it waits up to
    ``timeout_s``; used after compiling, where processes may finish far apart: the first CPU
    collective otherwise gives up when a peer is more than about 30 s late (gloo's connection
    timeout). Every process must call it with the same unique ``name``.

    Raises:
      jax.errors.JaxRuntimeError: if some process did not arrive within ``timeout_s``.
    """
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost

    multihost.get_barrier_sync_fn()(key=name, timeout_ms=int(timeout_s * 1000))


def agree_any(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (a small all-gather; the flag itself on one process).

    Every process must call it at the same point of the program.
    """
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(bool(flag)))))


def same_on_every_process(value: int) -> bool:
    """Whether the integer ``value`` is the same on every process (a small all-gather).

    Every process must call it at the same point of the program.
    """
    if jax.process_count() == 1:
        return True
    from jax.experimental import multihost_utils

    values = multihost_utils.process_allgather(np.asarray(int(value), np.int64))
    return bool(np.all(values == values.flat[0]))
