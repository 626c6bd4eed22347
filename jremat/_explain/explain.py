"""What a policy did to a function: each decision, the names it matched, and whether memory fell.

:func:`explain` answers "did remat save anything?" for any function. It traces the function
under the policy and reads every checkpoint the trace contains (inside ``lax.scan`` bodies
too), asking the checkpoint's own policy about each value, exactly as JAX's partial evaluation
does. It reports:

* one line per decision (``save``, ``offload``, ``recompute``, ``exclude`` by name) and place
  (top level, or inside which scan): how many values, their bytes;
* the tensor names the policy mentions (``names:save=...``, ``names_except:exclude=...``,
  ``offload:names=...``) and how many values each matched; a name matching nothing gets a line
  of its own that lists the names the function actually tags;
* every kernel the value-and-gradient runs (a ``pallas_call``, an FFI call, a ``custom_vjp``
  kernel: :mod:`jremat.kernels`), with the policy and without remat, and a line for each one run
  more often, naming it and how to keep it (``kernel mha_forward: 2 runs, none: 1; ...``);
* with ``compile=True``, the residuals kept for the backward pass and XLA's compiled temp memory
  of the gradient, without and with the policy; when the temp did not fall although the policy
  recomputes (XLA merged the recomputation back, or the checkpoint covers the whole
  differentiated function) a line says so and names the likely cause
  (:func:`jremat.diagnose_remat`);
* for a block whose output can feed one of its arguments (a residual layer), the compiled temp
  of :data:`STACK_DEPTH` copies in sequence, each checkpointed, without and with the policy: a
  single checkpoint around the whole differentiated function cannot save, so this is what the
  block saves as it is used.

``print(jremat.explain(f, "full", w, x))`` prints plain text; :meth:`Explanation.to_json` gives
the same as a dict. The result types and their text are in :mod:`jremat._explain.explanation`, the
gradient program, the stack measurement and the wording of memory findings in
:mod:`jremat._explain.memory`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import jax

from jremat._apply import collectives as _kept_collectives
from jremat._apply import gathered as _gathered
from jremat._apply import registry
from jremat._apply.decorator import policy as _decorate_with
from jremat._apply.policy import NoRemat, Policy
from jremat._attention import functions as attention
from jremat._engine import jax_compat as _jax_compat
from jremat._engine import jaxpr as _jaxpr
from jremat._engine.tags import is_internal as is_internal_tag
from jremat._explain import decisions as _decisions
from jremat._explain import memory as _explain_memory
from jremat._explain import residuals as _residuals
from jremat._explain.decisions import DECISIONS, EXCLUDE, OFFLOAD, RECOMPUTE, SAVE, Decision
from jremat._explain.explanation import Explanation, KernelRuns, NameMatch
from jremat._explain.memory import STACK_DEPTH
from jremat._measure import collectives as _collectives
from jremat._measure import memory as _memory
from jremat._measure.mesh import mesh_devices
from jremat._program import kernels
from jremat._program import program as _program

#: Policy attributes holding the tensor names a policy mentions, and the role each gives them.
NAME_ROLES = (("save", SAVE), ("offload", OFFLOAD), ("exclude", EXCLUDE))


def _kept_kinds(policy) -> frozenset[str]:
    """The collective kinds ``policy`` keeps wherever the model writes them (``keep_gathered``,
    ``keep_collectives``)."""
    if isinstance(policy, _kept_collectives.KeepCollectives):
        return frozenset(_collectives.KINDS)
    if isinstance(policy, _gathered.KeepGathered):
        return frozenset({"all-gather"})
    return frozenset()


def mentioned_names(policy: Policy) -> list[tuple[str, str]]:
    """``(role, name)`` for every tensor name ``policy`` refers to.

    Read from the policy's ``save``, ``offload`` and ``exclude`` attributes (tuples of names;
    the name-based built-ins set them, and a custom policy may too).
    """
    found: list[tuple[str, str]] = []
    for attr, role in NAME_ROLES:
        value = getattr(policy, attr, None)
        if isinstance(value, (tuple, list)) and all(isinstance(n, str) for n in value):
            found.extend((role, n) for n in value)
    return found


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def explain(
    fn: Callable,
    policy: str | Policy,
    *args: Any,
    compile: bool = True,
    param_argnums: Iterable[int] = (),
    **kwargs: Any,
) -> Explanation:
    """Explain what ``policy`` does to ``fn(*args, **kwargs)``; nothing is executed.

    The policy is applied around ``fn`` as ``@jremat.policy(policy)`` would, positional
    arguments that hold no array (or shape struct) static. For a function that already contains
    its checkpoints (a model configured with a policy) use :func:`explain_applied`.

    Args:
      fn: a function of pytrees of arrays.
      policy: a spec string or :class:`jremat.Policy`.
      *args: arguments; arrays or :class:`jax.ShapeDtypeStruct`.
      compile: also compile the gradient (``jax.vjp`` with respect to every float argument)
        without and with the policy to compare XLA's temp memory; ``False`` only traces. When
        ``fn``'s output has the structure, shapes and dtypes of a positional argument, the
        gradient of :data:`STACK_DEPTH` calls in sequence (the output fed back as that argument)
        is compiled too, each call checkpointed or not: the block's saving in a stack.
      param_argnums: positions of arguments holding parameters (values derived only from
        them are not counted as saved activations; see :func:`jremat.saved_residuals_report`).
      **kwargs: keyword arguments of ``fn``.

    Returns:
      An :class:`Explanation`; ``print`` it for plain text.

    Raises:
      ValueError: on a bad policy spec.
    """
    chosen = registry.resolve(policy)
    label = chosen.spec or type(chosen).__name__
    # Positional arguments with no array in them (a layer count, an activation's name) are
    # static, as explain's own flattening keeps them.
    static = tuple(
        i for i, a in enumerate(args) if not any(_explain_memory.is_dynamic(leaf) for leaf in jax.tree.leaves(a))
    )
    try:
        remat_fn = _decorate_with(chosen, static_argnums=static)(fn)
    except ValueError as err:
        return _failed(label, fn, err)
    stack = None
    param_argnums = tuple(param_argnums)  # read twice below
    argnum = (
        _explain_memory.chain_argnum(fn, args, kwargs, param_argnums)
        if compile and not isinstance(chosen, NoRemat)
        else None
    )
    if argnum is not None:
        try:
            temps = _explain_memory.stack_temps(remat_fn, fn, argnum, args, kwargs, STACK_DEPTH)
        except ValueError:  # applying the policy failed: explain_applied reports it
            temps = None
        if temps is not None:
            stack = (argnum, *temps)
    return _explain_checkpointed(
        remat_fn,
        args,
        kwargs,
        chosen,
        label=label,
        name=getattr(fn, "__name__", repr(fn)),
        baseline=fn,
        compile=compile,
        param_argnums=param_argnums,
        whole_function=True,
        stack=stack,
    )


def _failed(label, fn, err) -> Explanation:
    return Explanation(
        label,
        getattr(fn, "__name__", repr(fn)),
        0,
        (),
        (),
        (),
        messages=(f"error ({label}): applying the policy raised: {err}",),
    )


def explain_applied(
    remat_fn: Callable,
    *args: Any,
    policy: str | Policy,
    baseline: Callable | None = None,
    compile: bool = True,
    param_argnums: Iterable[int] = (),
    temp_bytes: int | None = None,
    baseline_temp_bytes: int | None = None,
    whole_function: bool = False,
    scan_layers: bool | None = None,
    layers: int | None = None,
    label: str | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> Explanation:
    """Explain a function that already runs its checkpoints under ``policy``.

    Every checkpoint in ``remat_fn``'s trace (inside scans too) is read with its own policy;
    ``policy`` supplies the tensor names to check and the label.

    Args:
      remat_fn: the function with remat applied (a model configured with the policy).
      *args: its arguments; arrays or :class:`jax.ShapeDtypeStruct`.
      policy: the policy it applies (spec or :class:`jremat.Policy`).
      baseline: the same function without remat, for the memory comparison and the tags
        found; ``None`` uses ``remat_fn`` for the tags and skips the comparison.
      compile: compile both gradients to compare temp memory (needs ``baseline``).
      param_argnums: as in :func:`explain`.
      temp_bytes: the policy's compiled temp bytes if already measured (no compile then).
      baseline_temp_bytes: the baseline's, likewise.
      whole_function: whether one checkpoint wraps the whole differentiated function (names
        that cause when memory did not fall).
      scan_layers: whether the checkpoints run inside a scan over layers (``None``: unknown);
        chooses the causes named when memory did not fall.
      layers: the layers the function runs: kernel runs are then counted per layer (a kernel
        inside a ``scan`` once per iteration, the total divided by ``layers``); ``None``: a
        kernel inside a scan counts once.
      label: what the report calls the policy (default: its spec), e.g. the layer-stack spec
        (``nested:block=2,layer=full``) whose layers run ``policy``.
      name: what the report calls the function (default: its ``__name__``).
      **kwargs: keyword arguments of both functions.

    Returns:
      An :class:`Explanation`.

    Raises:
      ValueError: on a bad policy spec.
    """
    chosen = registry.resolve(policy)
    return _explain_checkpointed(
        remat_fn,
        args,
        kwargs,
        chosen,
        label=label or chosen.spec or type(chosen).__name__,
        name=name or str(getattr(remat_fn, "__name__", repr(remat_fn))),
        baseline=baseline,
        compile=compile,
        param_argnums=param_argnums,
        temp_bytes=temp_bytes,
        baseline_temp_bytes=baseline_temp_bytes,
        whole_function=whole_function,
        scan_layers=scan_layers,
        layers=layers,
    )


def _explain_checkpointed(
    remat_fn: Callable,
    args: tuple,
    kwargs: dict,
    chosen: Policy,
    *,
    label: str,
    name: str,
    baseline: Callable | None,
    compile: bool,
    param_argnums: Iterable[int],
    temp_bytes: int | None = None,
    baseline_temp_bytes: int | None = None,
    whole_function: bool = False,
    scan_layers: bool | None = None,
    layers: int | None = None,
    stack: tuple[int, int, int] | None = None,
) -> Explanation:
    """:func:`explain_applied` of a resolved policy; ``stack``: :func:`explain`'s ``(argnum,
    stacked temp, stacked baseline temp)`` of :data:`STACK_DEPTH` chained calls, if measured."""
    flat_remat, structs, params = _explain_memory.flatten(remat_fn, args, kwargs, param_argnums)
    flat_base = _explain_memory.flatten(baseline, args, kwargs, param_argnums)[0] if baseline is not None else None
    # Both remat engines save the same values (docs/remat-engines.md); the classic primitives
    # are the ones this module reads.
    with _jax_compat.classic_remat_context():
        tag_jaxpr = jax.make_jaxpr(flat_base or flat_remat)(*structs).jaxpr
        # A kernel's residuals are a name a policy can keep once its call is split (jremat.kernels).
        split_jaxpr = jax.make_jaxpr(kernels.split_kernels(flat_base or flat_remat))(*structs).jaxpr
    tags = [t for t in _decisions.tags(split_jaxpr) if not is_internal_tag(t[0])]
    found = tuple(dict.fromkeys(t[0] for t in tags))
    mentioned = mentioned_names(chosen)
    matches = []
    messages = []
    for role, tag in mentioned:
        hits = [t for t in tags if t[0] == tag]
        matches.append(NameMatch(role, tag, sum(it for _, _, it in hits), sum(b * it for _, b, it in hits)))
        if not hits:
            messages.append(
                f"unmatched name ({label}): {role} name {tag!r} matched nothing; the traced function tags "
                + (", ".join(found) if found else "no values (no checkpoint_name at all)")
            )
    try:
        with _jax_compat.classic_remat_context():
            jaxpr = jax.make_jaxpr(flat_remat)(*structs).jaxpr
    except ValueError as err:
        messages.append(f"error ({label}): applying the policy raised: {err}")
        return Explanation(label, name, 0, (), tuple(matches), found, messages=tuple(messages))
    excluded = frozenset(n for role, n in mentioned if role == EXCLUDE)
    n_checkpoints, decisions = _decisions.decisions(jaxpr, excluded, tag_jaxpr if flat_base is not None else None)
    if n_checkpoints == 0:
        why = "the policy keeps every value" if isinstance(chosen, NoRemat) else "nothing is rematerialized"
        messages.append(f"no checkpoint ({label}): the policy adds no checkpoint to the traced function; {why}")
    saved = base_saved = None
    global_saved: tuple[int | None, ...] = (None, None)
    collectives = baseline_collectives = None
    if flat_base is not None:
        residuals = [
            _residuals.saved_residuals_report(f, *structs, param_argnums=params) for f in (flat_remat, flat_base)
        ]
        # Per device: the figure compiled temp is compared with.
        saved, base_saved = (r.computed_device_bytes for r in residuals)
        global_saved = tuple(r.computed_bytes for r in residuals)
        if compile and (temp_bytes is None or baseline_temp_bytes is None):
            temps, comms = [], []
            for f in (flat_remat, flat_base):
                compiled, _ = _memory.compile_for_analysis(_explain_memory.gradient_program(f, structs), *structs)
                report = _memory.compiled_memory_report(compiled)
                temps.append(report.temp_bytes if report.available else None)
                comms.append(_collectives.compiled_collectives_report(compiled))
            temp_bytes, baseline_temp_bytes = temps
            collectives, baseline_collectives = comms
            messages.extend(
                _collectives.reissued_lines(label, collectives, baseline_collectives, kept_kinds=_kept_kinds(chosen))
            )
            messages.extend(_collectives.tie_lines(label, collectives))
    recomputed = sum(d.count * d.iterations for d in decisions if d.decision in (RECOMPUTE, EXCLUDE))
    messages.extend(_explain_memory.more_than_none_lines(label, saved, base_saved, temp_bytes, baseline_temp_bytes))
    passes = base_passes = None
    runs: tuple[KernelRuns, ...] = ()
    if flat_base is not None and kernels.count_kernel_runs(tag_jaxpr, primal=tag_jaxpr):
        runs = _kernel_runs(flat_remat, flat_base, structs, tag_jaxpr, layers)
        kinds = {k.name: k.kind for k in runs}
        reruns = kernels.kernel_reruns({k.name: k.runs for k in runs}, {k.name: k.baseline_runs for k in runs})
        per = " per layer" if layers else ""
        messages.extend(f"kernel re-run ({label}): {line}" for line in kernels.kernel_rerun_lines(reruns, kinds, per))
        forward = [k for k in runs if k.kind in attention.FORWARD_KINDS]
        if forward:
            passes, base_passes = sum(k.runs for k in forward), sum(k.baseline_runs for k in forward)
    if flat_base is not None and any(_jaxpr.is_grouped_matmul(eqn) for eqn in _jaxpr.equations(tag_jaxpr)):
        messages.extend(_grouped_matmul_lines(label, flat_remat, flat_base, structs, layers))
    matched = tuple(_match_lines(chosen, jaxpr))
    if (
        temp_bytes is not None
        and baseline_temp_bytes is not None
        and saved is not None
        and base_saved is not None
        and n_checkpoints
    ):
        line = _explain_memory.no_saving_line(
            label,
            recomputed,
            temp_bytes,
            baseline_temp_bytes,
            saved,
            base_saved,
            whole_function and n_checkpoints == 1,
            scan_layers,
            None if stack is None else (STACK_DEPTH, stack[1], stack[2]),
        )
        if line:
            messages.append(line)
    return Explanation(
        label,
        name,
        n_checkpoints,
        tuple(decisions),
        tuple(matches),
        found,
        saved,
        base_saved,
        temp_bytes,
        baseline_temp_bytes,
        tuple(messages),
        matched,
        passes,
        base_passes,
        None if stack is None else STACK_DEPTH,
        None if stack is None else stack[0],
        None if stack is None else stack[1],
        None if stack is None else stack[2],
        collectives,
        baseline_collectives,
        mesh_devices(structs),
        kernel_runs=runs,
        global_saved_bytes=global_saved[0],
        baseline_global_saved_bytes=global_saved[1],
    )


def _kernel_runs(flat_remat: Callable, flat_base: Callable, structs: list, primal, layers) -> tuple[KernelRuns, ...]:
    """Each kernel's runs in the value-and-gradient of ``flat_remat`` and of ``flat_base``
    (:func:`jremat.kernels.count_kernel_runs`; ``primal`` is the traced function, where its
    ``custom_vjp`` kernels are found; per layer given ``layers``), under the active remat engine:
    the engines differ here (remat3 recomputes a custom_vjp call whole)."""
    kinds: dict = {}
    counted = [
        kernels.count_kernel_runs(
            jax.make_jaxpr(_explain_memory.gradient_program(f, structs, True))(*structs),
            primal=primal,
            kinds=kinds,
            loop_iterations=bool(layers),
        )
        for f in (flat_remat, flat_base)
    ]
    per = layers or 1
    return tuple(
        KernelRuns(name, kinds[name], counted[0].get(name, 0) / per, counted[1].get(name, 0) / per)
        for name in sorted(set(counted[0]) | set(counted[1]))
    )


def _grouped_matmul_lines(label: str, flat_remat: Callable, flat_base: Callable, structs: list, layers) -> list[str]:
    """A line naming the grouped matmuls (a mixture of experts' ``jax.lax.ragged_dot``) that the
    policy's gradient runs beyond the gradient without remat, per layer given ``layers``; none if
    it runs no more."""
    runs, base = (
        kernels.count_grouped_matmuls(jax.make_jaxpr(_explain_memory.gradient_program(f, structs, True))(*structs))
        / (layers or 1)
        for f in (flat_remat, flat_base)
    )
    if runs <= base:
        return []
    per = " per layer" if layers else ""
    return [
        f"grouped matmul re-run ({label}): {runs:g} grouped matmuls (jax.lax.ragged_dot or a grouped matmul "
        f"kernel){per} in the gradient, none: {base:g}; the backward pass runs the experts' matmuls again "
        "(JAX's dots policies name dot_general only): dots, dots_no_batch, skip_cheap and selective keep them"
    ]


def _match_lines(chosen: Policy, jaxpr) -> list[str]:
    """How ``chosen`` matched each checkpoint of ``jaxpr`` (:meth:`jremat.Policy.describe_match`),
    the same line for several checkpoints given once with their count and place."""
    counts: dict = collections.Counter()
    for where, body in _decisions.checkpoint_bodies(jaxpr):
        try:
            lines = chosen.describe_match(_program.program_of_jaxpr(body))
        except (ValueError, TypeError):  # a body this policy cannot read (a model's own checkpoint)
            continue
        for line in lines:
            counts[(where, line)] += 1
    if any(not line.startswith("no ") for _, line in counts):  # a model's own checkpoints match nothing
        counts = collections.Counter({k: n for k, n in counts.items() if not k[1].startswith("no ")})
    return [f"{n} checkpoint{'' if n == 1 else 's'} ({where}): {line}" for (where, line), n in counts.items()]


__all__ = [
    "DECISIONS",
    "EXCLUDE",
    "OFFLOAD",
    "RECOMPUTE",
    "SAVE",
    "STACK_DEPTH",
    "Decision",
    "Explanation",
    "KernelRuns",
    "NameMatch",
    "explain",
    "explain_applied",
    "mentioned_names",
]
