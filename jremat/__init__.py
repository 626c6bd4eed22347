"""jremat: activation rematerialization for JAX with fine-grained policies.

Import this package before running any JAX computation: on XLA:CPU it sets the scheduler flag
that lets remat save memory in unrolled programs (see :mod:`jremat.xla_flags`).
"""

from jremat import xla_flags as _xla_flags

CPU_SCHEDULER_FLAG_ACTIVE = _xla_flags.configure()

from jremat import names  # noqa: E402
from jremat.policy import CallbackPolicy, NoRemat, Plan, PlanPolicy, Policy  # noqa: E402
from jremat.program import Program, trace_program  # noqa: E402
from jremat.registry import Param, available, describe, load_module, register, resolve  # noqa: E402
from jremat.remat import GRANULARITIES, RematConfig, checkpoint, remat_at, run_layers  # noqa: E402
from jremat.rng import dropout, layer_keys, site_key  # noqa: E402

__all__ = [
    "CallbackPolicy",
    "GRANULARITIES",
    "NoRemat",
    "Param",
    "Plan",
    "PlanPolicy",
    "Policy",
    "Program",
    "RematConfig",
    "available",
    "checkpoint",
    "describe",
    "dropout",
    "layer_keys",
    "load_module",
    "names",
    "register",
    "remat_at",
    "resolve",
    "run_layers",
    "site_key",
    "trace_program",
]
