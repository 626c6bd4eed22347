"""What a user writes, read without JAX: policy spec text and its keys' types (:mod:`.text`),
memory budgets (:mod:`.budget`), remat granularities (:mod:`.granularity`), the reference
model's tensor names and the checks of a name list (:mod:`.names`, public as
:mod:`jremat.names`), and the error a policy raises where it does not apply (:mod:`.errors`).

Imports: nothing of jremat's (the lowest room); nothing here imports JAX, so the command-line
tools check a ``--policy`` before JAX starts.
"""
