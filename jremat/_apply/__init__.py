"""Applying a policy: the policy registry and spec resolution (:mod:`.registry`, public as
:mod:`jremat.registry`), the built-in policies' keys (:mod:`.keys`), the kinds of policy
(:mod:`.policy`), the decorator and drop-in ``checkpoint`` (:mod:`.decorator`,
:mod:`.decorated_call`), layer stacks and where remat applies (:mod:`.layers`), keys that
recompute dropout identically (:mod:`.rng`), keeping FSDP's gathered weights
(:mod:`.gathered`) and every collective's output (:mod:`.collectives`).

Imports: every room below it (:mod:`jremat._spec`, :mod:`jremat._engine`,
:mod:`jremat._program`, :mod:`jremat._attention`, :mod:`jremat._measure`). The registry and the
keys import no JAX when imported.
"""
