"""Ctrl-C (SIGINT) and SIGTERM end a CLI run cleanly at any moment.

Imports nothing but the standard library, so a CLI installs it before it imports JAX: an
interrupt during the imports, the set-up or an XLA compile ends the process at once with one
line and exit code 130 (SIGINT) or 143 (SIGTERM), never a traceback and never a crash on the way
out. The process ends with :func:`os._exit`, which skips the interpreter's teardown (where XLA's
threads make a normal exit crash). During a long call into C++ (an XLA compile) Python runs no
signal handler; the signal's number also goes to a pipe (:func:`signal.set_wakeup_fd`), and a
watcher thread ends the process when the handler has not run within :data:`HANDLER_GRACE_S`.

Inside :meth:`Interrupts.deferred` (the training loop, a checkpoint write) a first signal only
sets a flag: the loop finishes the step, saves it and stops with the same exit code. A second
signal there stops at once (:class:`KeyboardInterrupt`, or the watcher thread ends the process
if the main thread is blocked in C++), leaving the last checkpoint intact: orbax writes a
checkpoint into a temporary directory and renames it only when complete.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

#: Exit code for each handled signal (128 + its number, as shells report).
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
#: How long the watcher thread waits for Python's handler before it ends the process itself.
HANDLER_GRACE_S = 0.2


class _WatchState:
    """What one installation's watcher thread and Python handler share."""

    def __init__(self):
        self.acknowledged = 0  # signals Python's handler has run for
        self.stopping = False  # uninstalled: ignore what is left in the pipe


class Interrupts:
    """The process's SIGINT/SIGTERM handling (see the module docstring); one per process.

    Attributes:
      signum: the first signal received (``None`` before any).
      startup_note: what an interrupt outside :meth:`deferred` leaves behind, for its one line.
    """

    def __init__(self):
        self.signum: int | None = None
        self.startup_note = "stopped at once; nothing was written"
        self._deferring = False
        self._installed = False
        self._previous: dict = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._state = _WatchState()
        self._before_exit: list = []

    @property
    def requested(self) -> bool:
        """Whether a signal arrived."""
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """130 after SIGINT, 143 after SIGTERM."""
        return EXIT_CODES.get(self.signum, 130)

    def install(self) -> bool:
        """Handle SIGINT and SIGTERM from now on (main thread only; a no-op elsewhere or if installed).

        Returns:
          Whether this call installed the handling (and so should :meth:`uninstall` it).
        """
        if self._installed or threading.current_thread() is not threading.main_thread():
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._python_handler)
        self._pipe = (read_fd, write_fd)
        self._installed = True
        self._state = _WatchState()
        threading.Thread(target=self._watch, args=(read_fd, self._state), name="jremat-interrupts", daemon=True).start()
        return True

    def uninstall(self) -> None:
        """Restore the handlers and wakeup fd found by :meth:`install`; the watcher thread ends."""
        if not self._installed:
            return
        self._state.stopping = True  # bytes still unread were handled while installed
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._pipe[1])  # the watcher reads end-of-file and returns
        self._installed, self._previous, self._pipe = False, {}, None
        self.signum, self._deferring = None, False

    def before_exit(self, cleanup) -> None:
        """Run ``cleanup()`` if a signal ends the process at once (releasing a lock, say)."""
        self._before_exit.append(cleanup)

    def forget(self, cleanup) -> None:
        """Undo :meth:`before_exit` (the cleanup has been done the normal way)."""
        with contextlib.suppress(ValueError):
            self._before_exit.remove(cleanup)

    @contextlib.contextmanager
    def deferred(self):
        """Inside: a first signal sets :attr:`requested` for the caller to save and stop."""
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    def _python_handler(self, signum, frame):
        # Runs in the main thread between bytecodes, so it sees the state at the moment of the
        # signal: outside deferred() it ends the process; inside, the first signal is recorded
        # and a second stops at once. The watcher thread acts only if this does not run in time.
        self._state.acknowledged += 1
        if not self._deferring:
            self._exit_now(signum)
        if self.signum is None:
            self.signum = signum
            return
        raise KeyboardInterrupt

    def _watch(self, read_fd: int, state: _WatchState) -> None:
        seen = 0
        try:
            while True:
                data = os.read(read_fd, 64)
                if not data:
                    return
                seen += sum(1 for s in data if s in EXIT_CODES)
                # The main thread may be inside a long C++ call (an XLA compile) and not run the
                # Python handler: then, unless a training step is in flight, end the process here.
                deadline = time.monotonic() + HANDLER_GRACE_S
                while state.acknowledged < seen and time.monotonic() < deadline:
                    time.sleep(0.01)
                # Inside deferred() the first signal waits for the step to end; a second one
                # stops at once even while the main thread is blocked (a step, a save).
                unhandled = state.acknowledged < seen and not state.stopping
                if unhandled and (not self._deferring or seen >= 2):
                    self._exit_now(next(s for s in data if s in EXIT_CODES))
        finally:
            os.close(read_fd)

    def _exit_now(self, signum: int) -> None:
        self.signum = signum
        for cleanup in list(self._before_exit):
            with contextlib.suppress(Exception):
                cleanup()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            os.write(2, f"\ninterrupted ({signal.Signals(signum).name}): {self.startup_note}\n".encode())
        os._exit(EXIT_CODES[signum])


#: The process's one :class:`Interrupts`.
INTERRUPTS = Interrupts()


@contextlib.contextmanager
def handled():
    """Handle SIGINT/SIGTERM for the duration (kept if a CLI's ``__main__`` installed it earlier)."""
    installed_here = INTERRUPTS.install()
    try:
        yield INTERRUPTS
    finally:
        if installed_here:
            INTERRUPTS.uninstall()
