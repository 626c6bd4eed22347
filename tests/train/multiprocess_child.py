"""``python -m train.ptb`` that SIGKILLs its own process when the train step is called for the N-th time.

Run by tests/train/test_multiprocess.py under ``python -m train.launch`` to kill every process of
a multi-process run at the same point with no chance to clean up:
``python -m tests.train.multiprocess_child N -- <train.ptb flags>``. Call N starts optimizer
step N (with ``--accum 1``), so steps up to N - 1 have finished on every process (each step
is a collective over all of them) and a checkpoint saved after step N - 1 is complete.
"""

from __future__ import annotations

import os
import signal
import sys

from train import ptb


def kill_at_call(n: int) -> None:
    """Make the ``n``-th call of the compiled train step SIGKILL this process instead of running."""
    real = ptb.compiled_steps
    calls = [0]

    def patched(*args, **kwargs):
        train_step, eval_step = real(*args, **kwargs)

        def step(*step_args):
            calls[0] += 1
            if calls[0] == n:
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return train_step(*step_args)

        return step, eval_step

    ptb.compiled_steps = patched


def main(argv: list[str]) -> int:
    """``N -- FLAGS``: run ``train.ptb`` with ``FLAGS``, killed at the N-th train-step call."""
    if len(argv) < 2 or argv[1] != "--" or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python -m tests.train.multiprocess_child N -- TRAIN_PTB_FLAGS (N >= 1)", file=sys.stderr)
        return 2
    kill_at_call(int(argv[0]))
    return ptb.main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
