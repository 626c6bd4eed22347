"""``python -m train.bench``: see :mod:`train.bench`."""

import sys

from train.bench import main

sys.exit(main())
