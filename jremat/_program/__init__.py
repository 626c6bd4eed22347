"""The traced program a policy chooses from, and what its operations cost.

:mod:`.program` traces a function into a flat :class:`~.program.Program` of ops;
:mod:`.flop_model` gives each primitive's FLOPs, :mod:`.flops` a whole program's (scan bodies
times their length); :mod:`.kernel_cost` prices kernels jremat did not write (Pallas, FFI,
``custom_vjp``) and :mod:`.kernels` (public as :mod:`jremat.kernels`) finds them and counts
their runs.

Imports: :mod:`jremat._spec`, :mod:`jremat._engine`.
"""
