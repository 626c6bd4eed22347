"""``python -m train.bench``: see :mod:`train.bench`."""

import sys

from jremat.train.interrupts import INTERRUPTS

INTERRUPTS.install()  # Ctrl-C and SIGTERM end the bench at once, from before JAX is imported

from jremat.train.bench.config import BenchConfig  # noqa: E402
from jremat.train.cli import exit_on_argument_error  # noqa: E402

exit_on_argument_error(BenchConfig, "train.bench")  # argument mistakes, before JAX is imported

from jremat.train.bench.cli import main  # noqa: E402

sys.exit(main())
