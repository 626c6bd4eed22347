"""Check a model of your own: are its results unchanged under a rematerialization policy?

:func:`assert_remat_exact` runs a function (or a Flax NNX / Linen module) once as written and
once under a policy, both compiled the same way (``jax.jit``), and compares the outputs, the
gradients with respect to chosen arguments and, for NNX objects among the arguments, the state
they end with (RNG counters, batch statistics). By default the comparison is bitwise.

:func:`policies` lists every registered policy with a usable example spec, as ``pytest``
parameters; the ones that cannot apply (to a single function, or on this backend) are skipped
with the reason instead of being left out. The ``jremat`` pytest plugin (loaded automatically
once jremat is installed) adds a ``remat_exact`` fixture that runs a test once per policy::

    def test_my_model(remat_exact):
        remat_exact(model, x, rngs=nnx.Rngs(dropout=0))
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jremat import registry
from jremat._apply.decorator import policy as _decorate_with
from jremat._apply.policy import Policy
from jremat._explain import exactness as _exactness
from jremat._explain.exactness import CAUSE_RANDOM, CAUSE_STATE, CAUSE_VALUE
from jremat._explain.explain import explain

# ---------------------------------------------------------------------------------------------
# Policies to test
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyExample:
    """One registered policy and how to test it.

    Attributes:
      name: the registered name.
      spec: a spec that builds it (``"every_k:k=2"``), or ``None`` when none can be given.
      skip_reason: why it cannot be tested here (``None`` when it can).
    """

    name: str
    spec: str | None
    skip_reason: str | None = None


#: Example keys for built-in policies whose defaults are not the interesting case.
_PREFERRED = {"every_k": "every_k:k=2"}
#: Policy keys that name tensors (``checkpoint_name`` tags) for the name-based built-ins.
_NAME_KEYS = {"names": "save", "names_except": "exclude", "offload": "names"}


def policy_examples(tags: Iterable[str] = (), *, examples: Mapping[str, str] | None = None) -> list[PolicyExample]:
    """Every registered policy with an example spec, or the reason it cannot be tested.

    Args:
      tags: ``checkpoint_name`` tags the tested function uses; the name-based policies
        (``names``, ``names_except``, ``offload``) are built from them. Without tags those
        policies are skipped (they would match nothing).
      examples: spec per policy name, overriding the generated example (needed for a custom
        policy with required keys).

    Returns:
      One :class:`PolicyExample` per registered policy, sorted by name.

    Raises:
      ValueError: if an entry of ``examples`` names no registered policy or does not parse.
    """
    tags = tuple(tags)
    if isinstance(tags, str) or any(not isinstance(t, str) or not t for t in tags):
        raise ValueError(f"tags must be a sequence of non-empty checkpoint_name strings, got {tags!r}")
    examples = dict(examples or {})
    entries = registry.entries()
    unknown = sorted(set(examples) - set(entries))
    if unknown:
        raise ValueError(f"examples for unknown policies {unknown}; registered policies: {', '.join(sorted(entries))}")
    out = []
    spec: str | None
    reason: str | None
    for name, entry in sorted(entries.items()):
        if entry.stack:
            out.append(
                PolicyExample(
                    name, name, f"policy {name!r} cannot wrap a single function: {registry.stack_error(name)}"
                )
            )
            continue
        if name in examples:
            spec, reason = examples[name], None
        elif name in _NAME_KEYS:
            key = _NAME_KEYS[name]
            spec = f"{name}:{key}={'+'.join(tags)}" if tags else None
            reason = (
                None
                if tags
                else (
                    f"policy {name!r} needs tensor names ({key}=): pass the checkpoint_name tags your function "
                    "uses, e.g. jremat.testing.policies(tags=['q', 'k'])"
                )
            )
        else:
            required = [k for k, p in entry.params.items() if p.default is registry.REQUIRED]
            spec = _PREFERRED.get(name, name) if not required else None
            reason = (
                None
                if not required
                else (
                    f"policy {name!r} needs key(s) {', '.join(required)}: give an example spec with "
                    f"jremat.testing.policies(examples={{{name!r}: '{name}:{required[0]}=...'}})"
                )
            )
        if spec is not None:
            try:
                built = registry.resolve(spec)
            except ValueError as err:
                if name in examples:
                    raise ValueError(f"example spec {spec!r} for policy {name!r}: {err}") from None
                built, reason = None, f"policy {name!r}: example spec {spec!r} does not build here: {err}"
            if built is not None:
                reason = _cannot_apply(built)
        out.append(PolicyExample(name, spec, reason))
    return out


def _cannot_apply(built: Policy) -> str | None:
    """Why ``built`` cannot wrap a single function on this backend, or ``None``."""
    try:
        built.wrap(lambda x: x)
    except ValueError as err:
        return f"policy {built.spec!r} cannot wrap a single function: {err}"
    return None


def policies(tags: Iterable[str] = (), *, examples: Mapping[str, str] | None = None) -> list:
    """Every registered policy as a ``pytest.param`` of its example spec, for ``parametrize``.

    ::

        @pytest.mark.parametrize("policy", jremat.testing.policies(tags=["q", "mlp_in"]))
        def test_exact(policy):
            jremat.testing.assert_remat_exact(loss, policy, params, x)

    Policies that cannot be tested (the layer-stack entry ``nested``, offloading on a backend without host
    memory, name-based policies without ``tags``) are kept as skipped parameters with the
    reason, never dropped silently.

    Args:
      tags: as in :func:`policy_examples`.
      examples: as in :func:`policy_examples`.

    Returns:
      A list of ``pytest.param(spec, id=name)``, skipped ones marked ``pytest.mark.skip``.

    Raises:
      ImportError: if pytest is not installed.
      ValueError: as :func:`policy_examples`.
    """
    import pytest

    return [
        pytest.param(ex.spec or ex.name, id=ex.name, marks=pytest.mark.skip(reason=ex.skip_reason))
        if ex.skip_reason
        else pytest.param(ex.spec, id=ex.name)
        for ex in policy_examples(tags, examples=examples)
    ]


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------


class RematMismatch(AssertionError):
    """Raised by :func:`assert_remat_exact`: a leaf differs with and without the policy.

    Attributes:
      where: ``"output"``, ``"state"`` or ``"gradient"``.
      path: the differing leaf's pytree path (``"gradient of args[0]['w1']"``).
      max_abs_error: largest absolute difference.
      max_rel_error: largest difference relative to the reference value (``inf`` where the
        reference is 0 and the value is not).
      mismatched: how many elements differ beyond the tolerance.
      size: the leaf's element count.
      cause: :data:`CAUSE_RANDOM`, :data:`CAUSE_STATE` or :data:`CAUSE_VALUE`.
    """

    def __init__(self, message, *, where, path, max_abs_error, max_rel_error, mismatched, size, cause):
        super().__init__(message)
        self.where = where
        self.path = path
        self.max_abs_error = max_abs_error
        self.max_rel_error = max_rel_error
        self.mismatched = mismatched
        self.size = size
        self.cause = cause


def _reference_apply(module):
    """``module.apply``, one bound method for Linen modules of one class with the same field values.

    A parametrized test builds its model anew for each policy; such modules then share one
    reference runner, so the reference compiles once. Field values are compared by ``repr`` too,
    since ``0.0 == -0.0`` and ``1 == True``; a module that cannot be hashed keeps its own ``apply``.
    """
    try:
        return _shared_apply(module, tuple(repr(getattr(module, f.name)) for f in dataclasses.fields(module)))
    except TypeError:
        return module.apply


@functools.lru_cache(maxsize=8)
def _shared_apply(module, field_reprs):
    return module.apply


def assert_remat_exact(
    fn: Callable,
    policy: str | Policy,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    rtol: float = 0.0,
    atol: float = 0.0,
    decorate: Callable | None = None,
    **kwargs: Any,
) -> None:
    """Assert that ``fn`` gives the same results with and without rematerialization under ``policy``.

    ``fn(*args, **kwargs)`` runs twice, as written and rematerialized (by default
    ``jremat.policy(policy)(fn)``), each inside ``jax.jit`` and under ``jax.vjp`` with the same
    constant cotangent (1 for a scalar output, seeded normal draws otherwise). Compared, in order:
    the outputs, the state of every NNX object among the arguments after the call (RNG
    counters, batch statistics), and the gradients with respect to ``argnums``.

    ``fn`` may be

    * a function of pytrees of arrays and NNX objects;
    * an NNX module instance: it is called as ``fn(*args, **kwargs)``, its ``nnx.Param``
      variables are always differentiated and ``argnums`` counts the call's own arguments;
    * a Linen module instance: ``fn.apply(*args, **kwargs)`` is compared with the same module
      built from ``jremat.policy(policy)(type(fn))`` (its RNG streams and variables lifted);
      pass ``rngs={"dropout": key}`` and ``mutable=[...]`` as for ``apply``.

    Arguments that are not arrays or NNX objects (bools, ints, strings) are constants.

    Args:
      fn: the function or module.
      policy: a spec string or :class:`jremat.Policy` (or, with ``decorate``, whatever it takes).
      *args: positional arguments of the call.
      argnums: positional argument(s) to differentiate: their float leaves, and the
        ``nnx.Param`` variables of NNX modules in them; integer leaves are held constant.
      rtol: relative tolerance; the default 0 with ``atol=0`` demands bitwise equality (which
        holds for float32 on one backend when the policy is correct; see the docs page).
      atol: absolute tolerance.
      decorate: ``(fn, policy) -> rematerialized fn``, to check another remat wrapper (for a
        Linen module it may return a module, whose ``apply`` is called); default
        ``jremat.policy(policy)(fn)``.
      **kwargs: keyword arguments of the call.

    Raises:
      RematMismatch: (an ``AssertionError``) naming the first differing leaf by its pytree
        path, with its largest absolute and relative error and the class of cause that fits:
        a random value drawn differently on recompute, state not written back, or a value that
        differs.
      ValueError: on a bad policy spec, bad ``argnums`` or tolerances, or nothing to
        differentiate.
    """
    if rtol < 0 or atol < 0:
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol!r}, atol={atol!r}")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if _is_flax_module(fn, "flax.nnx") and not args and argnums == 0:
        nums = ()  # a module called without positional arguments: its parameters alone
    if any(not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < len(args) for n in nums):
        raise ValueError(
            f"argnums={argnums!r} must be positions of positional arguments, 0 to {len(args) - 1} ({len(args)} given)"
            if args
            else f"argnums={argnums!r} given, but the call has no positional arguments"
        )
    if isinstance(policy, str):
        label = policy
    elif isinstance(policy, Policy) and policy.spec:
        label = policy.spec
    elif policy is None and decorate is not None:
        label = f"decorate={getattr(decorate, '__qualname__', decorate)}"
    else:
        label = repr(policy)
    if decorate is None:
        chosen = registry.resolve(policy)
        label = chosen.spec or label

        def decorate(f, _policy):
            if _is_flax_module(f, "flax.linen"):
                return _linen_rebuilt(f, chosen)
            return _decorate_with(chosen)(f)

    module_arg = _is_flax_module(fn, "flax.nnx")
    if module_arg:
        reference = _call_module
        remat = decorate(_call_module, policy)
        call = _exactness.Call(reference, (fn, *args), kwargs, (0, *(n + 1 for n in nums)), True)
    elif _is_flax_module(fn, "flax.linen"):
        built = decorate(fn, policy)
        reference = _reference_apply(fn)
        remat = built.apply if _is_flax_module(built, "flax.linen") else built
        call = _exactness.Call(reference, args, kwargs, nums, False)
    else:
        if not callable(fn):
            raise ValueError(f"assert_remat_exact needs a function, an NNX module or a Linen module, got {fn!r}")
        reference, remat = fn, decorate(fn, policy)
        call = _exactness.Call(reference, args, kwargs, nums, False)
    if not call.diff_nodes and not call.diff_arrays:
        raise ValueError(
            f"nothing to differentiate: argnums={argnums!r} selects no float array and no NNX module; "
            "choose the arguments holding parameters or float inputs"
        )

    graphdef, diff_state, other_state, arrays = call.split()
    initial_state = jax.tree.leaves(call.node_state())
    ref_out, ref_grads, ref_state = call.runner(reference, graphdef)(diff_state, other_state, arrays)
    graphdef2, diff_state2, other_state2, arrays2 = call.split()
    got_out, got_grads, got_state = call._runner(remat, graphdef2)(diff_state2, other_state2, arrays2)

    node_labels = [call.labels[i] for i in call.node_pos]
    array_labels = [call.labels[i] for j, i in enumerate(call.array_pos) if j in set(call.diff_arrays)]

    def state_label(path):
        return node_labels[path[0].key] + _exactness.path_text(path[1:])

    groups = [
        ("output", ref_out, got_out, lambda p: "output" + _exactness.path_text(p), None),
        ("state", ref_state, got_state, lambda p: "state of " + state_label(p), initial_state),
        ("gradient", ref_grads[0], got_grads[0], lambda p: "gradient of " + state_label(p), None),
        (
            "gradient",
            ref_grads[1],
            got_grads[1],
            lambda p: "gradient of " + array_labels[p[0].idx] + _exactness.path_text(p[1:]),
            None,
        ),
    ]
    for where, ref_tree, got_tree, name, initial in groups:
        ref_leaves = jax.tree_util.tree_flatten_with_path(ref_tree)[0]
        got_leaves = jax.tree.leaves(got_tree)
        # PyTreeDef comes from jaxlib's extension module, which has no type stub.
        if jax.tree.structure(ref_tree) != jax.tree.structure(got_tree):  # type: ignore[operator]
            raise RematMismatch(
                f"remat under {label}: the {where} has another structure with the policy "
                f"({jax.tree.structure(got_tree)}) than without ({jax.tree.structure(ref_tree)})",
                where=where,
                path=where,
                max_abs_error=float("inf"),
                max_rel_error=float("inf"),
                mismatched=0,
                size=0,
                cause=CAUSE_VALUE,
            )
        for k, ((path, ref_leaf), got_leaf) in enumerate(zip(ref_leaves, got_leaves)):
            bad, max_abs, max_rel = _exactness.compare(got_leaf, ref_leaf, rtol, atol)
            if not bad:
                continue
            closed = jax.make_jaxpr(lambda d, o, a: call.runner(reference, graphdef)(d, o, a))(
                diff_state, other_state, arrays
            )
            init = initial[k] if initial is not None and k < len(initial) else None
            cause, why = _exactness.mismatch_cause(
                where, got_leaf, ref_leaf, init, max_rel, _exactness.random_primitives(closed)
            )
            size = int(np.size(_exactness.as_numpy(ref_leaf)))
            tol = "bitwise" if rtol == 0 and atol == 0 else f"rtol={rtol:g}, atol={atol:g}"
            raise RematMismatch(
                f"remat under {label} changed {name(path)}: {bad} of {size} elements differ ({tol}), "
                f"max abs error {max_abs:.3g}, max rel error {max_rel:.3g}; likely cause: {cause}: {why}",
                where=where,
                path=name(path),
                max_abs_error=max_abs,
                max_rel_error=max_rel,
                mismatched=bad,
                size=size,
                cause=cause,
            )


class KernelRerun(AssertionError):
    """Raised by :func:`assert_kernels_not_rerun`: the gradient runs a kernel more often under the
    policy than without remat.

    Attributes:
      runs: kernel name -> ``(runs with the policy, runs without remat)``, for each re-run kernel.
    """

    def __init__(self, message, *, runs):
        super().__init__(message)
        self.runs = runs


def assert_kernels_not_rerun(fn: Callable, policy: str | Policy, *args: Any, **kwargs: Any) -> None:
    """Assert that the gradient of ``fn`` under ``policy`` runs no kernel more often than without remat.

    A kernel is a ``pallas_call``, an FFI call or a ``custom_vjp`` kernel written in JAX
    (:mod:`jremat.kernels`); each is counted by name in the traced value-and-gradient (with
    respect to every float argument), as :func:`jremat.explain` counts them. Nothing is compiled
    or run.

    Args:
      fn: a function of pytrees of arrays.
      policy: a spec string or :class:`jremat.Policy`.
      *args: arguments; arrays or :class:`jax.ShapeDtypeStruct`.
      **kwargs: keyword arguments of ``fn``.

    Raises:
      KernelRerun: (an ``AssertionError``) naming each kernel run more often, its runs with the
        policy and without, and how to keep it.
      ValueError: on a bad policy spec, or a policy that cannot apply to ``fn``.
    """

    explained = explain(fn, policy, *args, compile=False, **kwargs)
    errors = [m for m in explained.messages if m.startswith("error (")]
    if errors:
        raise ValueError(errors[0])
    runs = {k.name: (k.runs, k.baseline_runs) for k in explained.kernel_runs if k.runs > k.baseline_runs}
    if runs:
        lines = [m for m in explained.messages if m.startswith("kernel re-run (")]
        raise KernelRerun(
            f"remat under {explained.policy} runs {len(runs)} kernel{'s' if len(runs) != 1 else ''} again in the "
            "backward pass:\n  " + "\n  ".join(lines),
            runs=runs,
        )


def _call_module(module, *args, **kwargs):
    return module(*args, **kwargs)


def _is_flax_module(x, flax_api: str) -> bool:
    """Whether ``x`` is a ``flax.nnx`` or ``flax.linen`` module; never imports Flax (a module implies it is loaded)."""
    api = sys.modules.get(flax_api)
    return api is not None and isinstance(x, api.Module)


def _linen_rebuilt(module, chosen: Policy):
    """``module`` rebuilt from its class decorated with ``chosen`` (same fields, unbound)."""
    fields = {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.init and f.name not in ("parent", "name")
    }
    return _decorate_with(chosen)(type(module))(**fields)


def assert_no_reissued_collectives(
    remat_fn: Callable, baseline_fn: Callable, *args: Any, kinds: Iterable[str] | None = None, **kwargs: Any
) -> None:
    """Assert that ``remat_fn`` issues no more collectives of ``kinds`` per step than ``baseline_fn``.

    Both are compiled (nothing runs, :func:`jremat.collectives_report`) with the same arguments,
    whose shardings place them on a mesh: typically the gradient of a model with remat and the
    same gradient without it. On one device both issue none and the assertion holds. The 4-byte
    all-reduce jremat's cotangent tie adds per tied checkpoint is not re-issued work and is not
    counted (it keeps a recomputation in its backward step; :func:`jremat.explain_applied` names
    it, and ``prevent_cse=False`` inside a ``lax.scan`` drops it).

    Args:
      remat_fn: the function with remat applied.
      baseline_fn: the same function without remat.
      *args: arrays or :class:`jax.ShapeDtypeStruct` (with their ``sharding``).
      kinds: the collective kinds checked (default: every kind, :data:`jremat._measure.collectives.KINDS`:
        all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute).
      **kwargs: keyword arguments of both.

    Raises:
      AssertionError: naming each kind re-issued, its count and bytes per device per step beyond the
        baseline's, and how to avoid it.
      ValueError: on an unknown kind.
    """
    from jremat._measure import collectives as _collectives

    kinds = _collectives.KINDS if kinds is None else tuple(kinds)
    unknown = [k for k in kinds if k not in _collectives.KINDS]
    if unknown:
        raise ValueError(f"unknown collective kinds {unknown}; valid kinds: {', '.join(_collectives.KINDS)}")
    report = _collectives.collectives_report(remat_fn, *args, **kwargs)
    baseline = _collectives.collectives_report(baseline_fn, *args, **kwargs)
    wanted = dataclasses.replace(report, collectives=tuple(c for c in report.collectives if c.kind in kinds))
    base = dataclasses.replace(baseline, collectives=tuple(c for c in baseline.collectives if c.kind in kinds))
    lines = _collectives.reissued_lines(getattr(remat_fn, "__name__", "remat_fn"), wanted, base)
    if lines:
        raise AssertionError("\n".join(lines))


__all__ = [
    "CAUSE_RANDOM",
    "CAUSE_STATE",
    "CAUSE_VALUE",
    "KernelRerun",
    "PolicyExample",
    "RematMismatch",
    "assert_kernels_not_rerun",
    "assert_no_reissued_collectives",
    "assert_remat_exact",
    "policies",
    "policy_examples",
]
