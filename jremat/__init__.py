"""jremat: activation rematerialization for JAX with fine-grained policies.

The public API is the names below, plus the public submodules :mod:`jremat.registry`,
:mod:`jremat.names`, :mod:`jremat.ops`, :mod:`jremat.attention` (memory-efficient attention),
:mod:`jremat.kernels` (kernels such as Pallas attention, recognised and kept), :mod:`jremat.testing`, :mod:`jremat.pytest_plugin`
(a pytest plugin), :mod:`jremat.policies` (the built-in policies) and, with the ``[train]``
extra, :mod:`jremat.models` (the reference GPT) and :mod:`jremat.train` (the command-line
tools). Every other module is private (``jremat._...``).

The names are loaded on first use (PEP 562), so ``import jremat`` and the pytest plugin import
no JAX until something is used.

What a policy saves is decided in :mod:`jremat._policy` (the kinds of :class:`Policy`: a
:class:`PlanPolicy`'s :meth:`~PlanPolicy.plan` of the whole program, or a JAX callback asked
per equation), a callback's answer read by :func:`jremat._tags.callback_decision`; each
built-in policy's choice is in its module under :mod:`jremat.policies`.
"""

import importlib as _importlib

from jremat._version import __version__ as __version__

#: Every public name, by the module that defines it.
_EXPORTS: dict[str, tuple[str, ...]] = {
    # Public submodules (beside the registry, below): the reference model's tensor names, remat-aware ops.
    "jremat.names": (),
    "jremat.ops": (),
    # Memory-efficient attention whose residuals carry names, and a count of fused forward passes.
    "jremat.attention": ("blockwise_attention", "count_forward_passes"),
    # Kernels the library did not write (Pallas, FFI, custom_vjp): recognised, kept, priced.
    "jremat.kernels": (),
    # Memory budgets: sizes and fractions such as "6GiB" or 0.5.
    "jremat._budget": ("Budget", "parse_budget"),
    # Collectives of a compiled program on a mesh, and what a policy re-issues.
    "jremat._collectives": (
        "Collective",
        "CollectivesReport",
        "collective_flops_per_byte",
        "collective_s_per_byte",
        "collectives_report",
        "compiled_collectives_report",
    ),
    # Compiling: jit with the XLA options under which remat's savings survive.
    "jremat._compile": ("compiler_options", "jit"),
    # Decorators: a policy applied to a function or module, and custom policies.
    "jremat._decorator": ("checkpoint", "custom_policy", "filter_checkpoint", "policy"),
    # What a policy did to a function: each decision, the names it matched, whether memory fell.
    "jremat._explain": ("Explanation", "explain", "explain_applied"),
    # Throughput at a memory budget: the (policy, batch) that trains fastest, measured.
    "jremat._fit": (
        "FitError",
        "FitProbe",
        "FitResult",
        "FitRow",
        "FitStep",
        "TimeModel",
        "calibrate_time_model",
        "fit_search",
        "fit_search_budgets",
        "keep_gathered_variants",
        "measure_throughput",
        "with_collective_rates",
    ),
    # FLOPs of traced programs (scan bodies times their length).
    "jremat._flops": ("jaxpr_flops", "program_flops"),
    # Kernels (pallas_call, FFI calls): their price for every policy and analysis, and declaring one.
    "jremat._kernel_cost": ("KernelCost", "kernel_cost", "register_kernel", "unregister_kernel"),
    # Host offload: whether the backend has host memory, and its cost in FLOPs per byte.
    "jremat._host_offload": ("host_offload_available", "offload_flops_per_byte"),
    # The allocator's live peak of a real run.
    "jremat._live": ("LiveMemory", "allocator_stats_missing", "live_memory"),
    # Memory: compiled reports and the remat diagnosis.
    "jremat._memory": ("MemoryReport", "compiled_memory_report", "diagnose_remat", "format_bytes", "memory_report"),
    # The budget planner: per-layer and per-name choices under a memory budget.
    "jremat._planner": ("Candidate", "LayerPlan", "NameCost", "name_costs", "plan_function", "plan_layers"),
    # Policies: the base classes, the plan a plan policy returns, and the offload precondition.
    "jremat._policy": (
        "CallbackPolicy",
        "NoRemat",
        "Plan",
        "PlanPolicy",
        "Policy",
        "PolicyDoesNotApply",
        "require_host_memory",
    ),
    # Programs: the traced equations a plan policy chooses from.
    "jremat._program": ("Op", "Program", "trace_program"),
    # Layer stacks: where remat applies, scanned or unrolled layers, chunked recomputation.
    "jremat._granularity": ("GRANULARITIES",),
    "jremat._remat": ("RematConfig", "remat_at", "rematerialized_chunks", "run_layers"),
    # What a policy keeps: saved residuals.
    "jremat._residuals": ("ResidualsReport", "saved_residuals_report"),
    # Randomness that recomputes identically.
    "jremat._rng": ("dropout", "layer_keys", "site_key"),
    # The memory timeline: live bytes over the compiled schedule.
    "jremat._timeline": ("MemoryTimeline", "TimelineBuffer", "build_timeline", "memory_timeline"),
    # The policy registry (a public submodule): specs, parameters, registration and lookup.
    "jremat.registry": ("Param", "available", "describe", "load_module", "register", "resolve"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_WHERE.update({module.rpartition(".")[2]: module for module in _EXPORTS if not module.startswith("jremat._")})

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'jremat' has no attribute {name!r}")
    loaded = _importlib.import_module(module)
    value = loaded if module == f"jremat.{name}" else getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
