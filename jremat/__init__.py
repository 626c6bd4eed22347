"""jremat: activation rematerialization for JAX with fine-grained policies."""

from jremat import names
from jremat.policy import CallbackPolicy, NoRemat, Plan, PlanPolicy, Policy
from jremat.program import Program, trace_program
from jremat.registry import Param, available, describe, load_module, register, resolve
from jremat.remat import GRANULARITIES, RematConfig, remat_at, run_layers
from jremat.rng import dropout, layer_keys, site_key
from jremat.compile import compiler_options, jit
# The decorator shadows the ``jremat.policy`` submodule attribute on purpose (``@jremat.policy``);
# import the submodule's names with ``from jremat.policy import ...``.
from jremat.decorator import checkpoint, custom_policy, policy
# Likewise ``jremat.explain`` is the function; import the module's names with ``from jremat.explain import ...``.
from jremat.explain import Explanation, explain
from jremat.memory import MemoryReport, compiled_memory_report, diagnose_remat, memory_report
from jremat.residuals import ResidualsReport, saved_residuals_report
from jremat.flops import program_flops
from jremat.live import LiveMemory, live_memory
from jremat.timeline import MemoryTimeline, memory_timeline

__all__ = [
    "CallbackPolicy",
    "Explanation",
    "GRANULARITIES",
    "LiveMemory",
    "MemoryReport",
    "MemoryTimeline",
    "NoRemat",
    "Param",
    "Plan",
    "PlanPolicy",
    "Policy",
    "Program",
    "RematConfig",
    "ResidualsReport",
    "available",
    "checkpoint",
    "compiled_memory_report",
    "compiler_options",
    "custom_policy",
    "describe",
    "diagnose_remat",
    "dropout",
    "explain",
    "jit",
    "layer_keys",
    "live_memory",
    "load_module",
    "memory_report",
    "memory_timeline",
    "names",
    "policy",
    "program_flops",
    "register",
    "remat_at",
    "resolve",
    "run_layers",
    "saved_residuals_report",
    "site_key",
    "trace_program",
]
