"""train.interrupts: SIGINT/SIGTERM deferred during training, immediate (130/143, one line) elsewhere."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from jremat.train import interrupts
from tests.conftest import REPO


def test_deferred_signals_set_the_flag_and_a_second_stops_at_once():
    before_int, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupts.handled() as handling:
        with handling.deferred():
            signal.raise_signal(signal.SIGTERM)
            assert handling.requested and handling.exit_code == 143
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == (before_int, before_term)
    assert not interrupts.INTERRUPTS.requested  # a later run starts clean


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_outside_training_a_signal_ends_the_process_at_once(signum, code):
    script = (
        "import signal, time\n"
        "from jremat.train.interrupts import INTERRUPTS\n"
        "INTERRUPTS.install()\n"
        "INTERRUPTS.startup_note = 'nothing to save'\n"
        f"signal.raise_signal({int(signum)})\n"
        "time.sleep(30)\n"  # a long call into C: the watcher thread still ends the process
        "print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == code
    assert done.stderr.strip() == f"interrupted ({signal.Signals(signum).name}): nothing to save"
    assert "not reached" not in done.stdout


def test_a_second_signal_stops_at_once_while_the_main_thread_is_blocked():
    """Inside deferred(), a second signal ends the process even while the main thread is in a
    long C call (a training step, a checkpoint write) and cannot run Python's handler."""
    script = (
        "import hashlib, os, signal, threading, time\n"
        "from jremat.train.interrupts import INTERRUPTS\n"
        "INTERRUPTS.install()\n"
        "INTERRUPTS.startup_note = 'the last checkpoint is intact'\n"
        "with INTERRUPTS.deferred():\n"
        "    signal.raise_signal(signal.SIGTERM)\n"  # the first: recorded, the step goes on
        "    assert INTERRUPTS.requested\n"
        "    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
        "    hashlib.pbkdf2_hmac('sha256', b'x', b'y', 200_000_000)\n"  # about a minute in C, no handler runs
        "print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "interrupted (SIGINT): the last checkpoint is intact"
    assert "not reached" not in done.stdout
