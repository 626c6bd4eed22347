"""``python -m train.bench``: see :mod:`train.bench`."""

import sys

from jremat.train.bench.cli import main

sys.exit(main())
