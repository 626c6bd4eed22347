"""``python -m train.bench``: see :mod:`train.bench`."""

import sys

from jremat.train.usage import exit_without_train_extra

exit_without_train_extra("train.bench")  # one error line on a core install, before any import fails

from jremat.train.interrupts import INTERRUPTS  # noqa: E402

INTERRUPTS.install()  # Ctrl-C and SIGTERM end the bench at once, from before JAX is imported

from jremat.train.bench.config import BenchConfig  # noqa: E402
from jremat.train.cli import exit_on_argument_error  # noqa: E402

exit_on_argument_error(BenchConfig, "train.bench")  # argument mistakes, before JAX is imported

from jremat.train.bench.cli import main  # noqa: E402

sys.exit(main())
