"""Where remat applies inside a layer stack (:attr:`jremat.RematConfig.granularity`).

A module of its own, free of JAX, so that the CLIs offer and check ``--granularity`` before JAX is imported.
"""

#: ``none``: no remat; ``block``: one checkpoint per layer; ``sublayer``: one per attention and MLP half.
GRANULARITIES = ("none", "block", "sublayer")
