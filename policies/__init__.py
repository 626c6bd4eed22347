"""Built-in rematerialization policies. Importing this package registers them all.

Found by :mod:`jremat.registry` through the ``jremat.policies`` entry point, so users never
need to import it themselves.
"""

from jremat.policies import auto, basic, every_k, names, nested, selective, skip_cheap  # noqa: F401
