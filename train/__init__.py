"""jremat's command-line tools: ``python -m jremat.train.ptb`` (``jremat-ptb``), ``.memory``,
``.bench``, ``.launch``; in a checkout, also ``python -m train.ptb`` from its root.

Needs the ``[train]`` extra (Flax, optax, orbax, matplotlib, pooch, tqdm).
"""

if __name__ != "jremat.train":  # run from a checkout as `python -m train.X`
    from jremat.internal import alias_installed

    alias_installed(__name__)
