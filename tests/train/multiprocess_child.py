"""``python -m train.ptb`` that SIGKILLs its own process at a chosen point, with no chance to clean up.

``python -m tests.train.multiprocess_child N -- <train.ptb flags>`` dies when the train step is
called for the N-th time. Run by tests/train/test_multiprocess.py under ``python -m
train.launch`` to kill every process of a multi-process run at the same point: call N starts
optimizer step N (with ``--accum 1``), so steps up to N - 1 have finished on every process (each
step is a collective over all of them) and a checkpoint saved after step N - 1 is complete. The processes die in a fixed order, process 0
last: it hosts JAX's coordination service, and a process that outlives it logs the service's
fatal error before aborting (see :func:`die_in_order`).

``python -m tests.train.multiprocess_child save:N -- <flags>`` dies half-way through writing the
checkpoint of step N: its arrays are written into orbax's temporary directory, its metadata is
not, and nothing is committed (tests/train/test_ptb.py).

With ``JREMAT_TEST_ROWS_DIR`` set, each process also writes ``rows.<process>.json`` there: the
batch rows it was assigned and the rows it handed to ``train.sharding.shard_batch`` first.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import tempfile

import jax
import numpy as np

from jremat.train import ptb, sharding

#: The open lock file of :func:`hold_until_death` (kept open: the kernel releases its lock when this process dies).
_held: list = []


def _order_file() -> str | None:
    """The lock file every process of this run shares (named after its coordinator port); None with one process."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address or int(os.environ.get("JAX_NUM_PROCESSES", "1")) < 2:
        return None
    return os.path.join(tempfile.gettempdir(), f"jremat-kill-order-{address.rpartition(':')[2]}.lock")


def hold_until_death() -> None:
    """On processes 1.., hold a shared lock on the run's order file until the process dies.

    Taken before ``train.ptb`` starts, so before process 0's ``jax.distributed`` start-up can
    finish: by the time process 0 reaches any train step, every other process holds it.
    """
    path = _order_file()
    if path is None or os.environ.get("JAX_PROCESS_ID", "0") == "0":
        return
    handle = open(path, "a")
    fcntl.flock(handle, fcntl.LOCK_SH)
    _held.append(handle)


def die_in_order() -> None:
    """SIGKILL this process; process 0 first waits until every other process is dead.

    Process 0 hosts JAX's coordination service: a process that outlives it logs the service's
    fatal error to stderr before aborting, so a run killed in no fixed order would print it or
    not by chance. The exclusive lock is granted only once the kernel has released every other
    process's shared lock, at their death.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    path = _order_file()
    if path is not None and os.environ.get("JAX_PROCESS_ID", "0") == "0":
        with open(path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
        os.unlink(path)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at_call(n: int) -> None:
    """Make the ``n``-th call of the compiled train step SIGKILL this process instead of running
    (process 0 last, :func:`die_in_order`)."""
    hold_until_death()
    real = ptb.compiled_steps
    calls = [0]

    def patched(*args, **kwargs):
        train_step, eval_step = real(*args, **kwargs)

        def step(*step_args):
            calls[0] += 1
            if calls[0] == n:
                die_in_order()
            return train_step(*step_args)

        return step, eval_step

    ptb.compiled_steps = patched


def kill_while_saving(step: int) -> None:
    """SIGKILL this process while the checkpoint of ``step`` is being written (after its arrays)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    from jremat.train import state_files

    real_save, real_json = state_files.StateFiles.save, json_checkpoint_handler.JsonCheckpointHandler._save_fn
    saving = [None]

    def save(self, at_step, state, meta):
        saving[0] = at_step
        return real_save(self, at_step, state, meta)

    def json_save(self, *args, **kwargs):
        if saving[0] == step:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_json(self, *args, **kwargs)

    state_files.StateFiles.save = save
    json_checkpoint_handler.JsonCheckpointHandler._save_fn = json_save


def record_rows(directory: str) -> None:
    """Write this process's row range and the first rows it places to ``directory/rows.<process>.json``."""
    real_rows, real_shard = sharding.process_batch_rows, sharding.shard_batch
    seen = {}

    def rows(mesh, batch_size):
        own = real_rows(mesh, batch_size)
        seen["rows"] = [own.start, own.stop]
        return own

    def shard(mesh, local, batch_size=None):
        if "first" not in seen:
            seen["first"] = np.asarray(local).tolist()
            with open(os.path.join(directory, f"rows.{jax.process_index()}.json"), "w") as handle:
                json.dump(seen, handle)
        return real_shard(mesh, local, batch_size)

    sharding.process_batch_rows, sharding.shard_batch = rows, shard


def main(argv: list[str]) -> int:
    """``N -- FLAGS`` or ``save:N -- FLAGS``: run ``train.ptb`` with ``FLAGS``, killed at the
    N-th train-step call or while writing the checkpoint of step N."""
    where, _, number = argv[0].rpartition(":") if argv else ("", "", "")
    if len(argv) < 2 or argv[1] != "--" or where not in ("", "save") or not number.isdigit() or int(number) < 1:
        print("usage: python -m tests.train.multiprocess_child [save:]N -- TRAIN_PTB_FLAGS (N >= 1)", file=sys.stderr)
        return 2
    if where == "save":
        kill_while_saving(int(number))
    else:
        kill_at_call(int(number))
    if os.environ.get("JREMAT_TEST_ROWS_DIR"):
        record_rows(os.environ["JREMAT_TEST_ROWS_DIR"])
    return ptb.main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
