"""What jremat's own command-line tools (:mod:`jremat.train`) use from the library beyond its
public API, in one namespace (as :mod:`equinox.internal` keeps what Equinox's sibling libraries
use): no stability promise for other users. Imports no JAX.

- :func:`alias_installed`: run from a source checkout, the checkout's ``train`` is the installed
  ``jremat.train``.
- :func:`missing_modules`, :func:`train_extra_message`: whether the ``[train]`` extra is installed,
  and the error that says how to install it.
- :data:`BUILTIN_PARAMS`: the keys of the built-in policies, checked before JAX is imported.
"""

from jremat._apply.keys import BUILTIN_PARAMS
from jremat._checkout import alias_installed
from jremat._extras import missing_modules, train_extra_message

__all__ = ["BUILTIN_PARAMS", "alias_installed", "missing_modules", "train_extra_message"]
