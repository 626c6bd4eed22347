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
the same as a dict.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from jremat import _collectives, _decisions, _jax_compat, _memory, _program, _residuals, attention, kernels, registry
from jremat._decisions import DECISIONS, EXCLUDE, OFFLOAD, RECOMPUTE, SAVE, Decision
from jremat._decorator import policy as _decorate_with
from jremat._decorator import split_static
from jremat._policy import NoRemat, Policy
from jremat._tags import is_internal as is_internal_tag

#: Policy attributes holding the tensor names a policy mentions, and the role each gives them.
NAME_ROLES = (("save", SAVE), ("offload", OFFLOAD), ("exclude", EXCLUDE))


@dataclasses.dataclass(frozen=True)
class NameMatch:
    """One tensor name the policy mentions and what it matched in the traced function.

    Attributes:
      role: :data:`SAVE`, :data:`OFFLOAD` or :data:`EXCLUDE`.
      name: the name.
      count: values tagged with it (scan bodies counted once per iteration).
      bytes: their bytes, all iterations.
    """

    role: str
    name: str
    count: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class KernelRuns:
    """How often the value-and-gradient runs one kernel (:func:`jremat.kernels.count_kernel_runs`).

    Attributes:
      name: the kernel's name (a ``pallas_call``'s name, an FFI target, a ``custom_vjp`` function's name).
      kind: :data:`jremat.kernels.PALLAS`, :data:`~jremat.kernels.PALLAS_CALL`, :data:`~jremat.kernels.FFI_CALL`, ...
      runs: runs with the policy (a kernel inside a scan counts once; per layer where
        :func:`explain_applied` is given ``layers``).
      baseline_runs: runs without remat, likewise.
    """

    name: str
    kind: str
    runs: float
    baseline_runs: float


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What a policy did to a function (see :func:`explain`).

    Attributes:
      policy: the policy's spec.
      function: the function's name.
      checkpoints: how many checkpoints the rematerialized trace contains.
      decisions: one :class:`Decision` per (decision, place).
      names: one :class:`NameMatch` per name the policy mentions.
      names_found: every ``checkpoint_name`` tag in the traced function, in first-seen order.
      saved_bytes: residuals the forward pass computes for the backward pass, with the policy
        (:attr:`jremat.ResidualsReport.computed_bytes`); ``None`` when not measured.
      baseline_saved_bytes: the same without remat.
      temp_bytes: XLA's compiled temp bytes of the gradient with the policy (``None``: not compiled).
      baseline_temp_bytes: the same without remat.
      messages: one line per problem found: a name that matched nothing, no saving, more memory
        than without remat, a policy that could not be applied.
      matched: how the policy matched each checkpoint, one line per kind of match with the
        checkpoints' count and place (:meth:`jremat.Policy.describe_match`: ``selective``'s
        attention core found by tag or by structure).
      attention_forward_passes: fused attention forward kernels (blockwise, cuDNN) the
        value-and-gradient runs with the policy (:func:`jremat.attention.count_forward_passes`;
        a kernel inside a scan counts once; per layer where :func:`explain_applied` is given
        ``layers``); ``None`` when not measured.
      baseline_attention_forward_passes: the same without remat.
      stack_depth: :func:`explain` on a block whose output has the structure, shapes and dtypes
        of one positional argument: how many copies of it ran in sequence, the output of each
        fed to the next as that argument (``None``: not measured, the block does not chain).
      stack_argnum: the positional argument the output was fed back as.
      stack_temp_bytes: XLA's compiled temp bytes of that stack's gradient, each copy
        checkpointed under the policy: the block's saving as it is used, in a stack.
      baseline_stack_temp_bytes: the same stack without remat.
      collectives: the collectives the compiled gradient issues with the policy, per device
        (:func:`jremat.collectives_report`; empty on one device); ``None``: not compiled.
      baseline_collectives: the same without remat.
      devices: the devices the arguments' shardings span; on a mesh the residual and decision
        bytes are global (traced, unsharded values) and the compiled temp is per device.
      kernel_runs: every kernel the value-and-gradient runs (a ``pallas_call``, an FFI call, a
        ``custom_vjp`` kernel: :mod:`jremat.kernels`), with the policy and without remat; a kernel
        run more often than without remat also gets a message naming how to keep it.
    """

    policy: str
    function: str
    checkpoints: int
    decisions: tuple[Decision, ...]
    names: tuple[NameMatch, ...]
    names_found: tuple[str, ...]
    saved_bytes: int | None = None
    baseline_saved_bytes: int | None = None
    temp_bytes: int | None = None
    baseline_temp_bytes: int | None = None
    messages: tuple[str, ...] = ()
    matched: tuple[str, ...] = ()
    attention_forward_passes: int | None = None
    baseline_attention_forward_passes: int | None = None
    stack_depth: int | None = None
    stack_argnum: int | None = None
    stack_temp_bytes: int | None = None
    baseline_stack_temp_bytes: int | None = None
    collectives: _collectives.CollectivesReport | None = None
    baseline_collectives: _collectives.CollectivesReport | None = None
    devices: int = 1
    kernel_runs: tuple[KernelRuns, ...] = ()

    def count(self, decision: str) -> int:
        """Values given ``decision``, all places and iterations.

        Raises:
          ValueError: if ``decision`` is not one of :data:`DECISIONS`.
        """
        if decision not in DECISIONS:
            raise ValueError(f"unknown decision {decision!r}; valid decisions: {', '.join(DECISIONS)}")
        return sum(d.count * d.iterations for d in self.decisions if d.decision == decision)

    def text(self) -> str:
        """Plain text: a header, one line per decision and name, memory figures, then messages."""
        lines = [
            (
                f"policy {self.policy!r} on {self.function}: {self.checkpoints} checkpoint"
                f"{'' if self.checkpoints == 1 else 's'}"
            )
        ]
        for d in self.decisions:
            per = f" per iteration, x{d.iterations} = {_memory.format_bytes(d.total_bytes)}" if d.iterations > 1 else ""
            tagged = f"  [names: {', '.join(d.names)}]" if d.names else ""
            lines.append(
                f"  {d.decision:<9} {d.count:>5} values {_memory.format_bytes(d.bytes):>11}{per}  {d.where}{tagged}"
            )
        for m in self.names:
            lines.append(f"  name {m.role} {m.name!r}: {m.count} values, {_memory.format_bytes(m.bytes)}")
        lines.extend(f"  matched: {line}" for line in self.matched)
        mesh = self.devices > 1
        if mesh:
            lines.append(
                f"  on {self.devices} devices: values and residuals are global (all devices together, unsharded); "
                "compiled temp and collectives are per device"
            )
        if self.saved_bytes is not None:
            lines.append(
                f"  residuals for the backward pass{' (global)' if mesh else ''}: "
                f"{_memory.format_bytes(self.baseline_saved_bytes)} without remat, "
                f"{_memory.format_bytes(self.saved_bytes)} with the policy"
            )
        if self.attention_forward_passes:
            lines.append(
                f"  fused attention forward passes: {self.baseline_attention_forward_passes} without remat, "
                f"{self.attention_forward_passes} with the policy"
            )
        if self.kernel_runs:
            lines.append(
                "  kernel runs in the gradient: "
                + ", ".join(f"{k.name} {k.runs:g} (none {k.baseline_runs:g})" for k in self.kernel_runs)
            )
        if self.temp_bytes is not None:
            lines.append(
                f"  compiled temp of the gradient{' per device' if mesh else ''}: "
                f"{_memory.format_bytes(self.baseline_temp_bytes)} without remat, "
                f"{_memory.format_bytes(self.temp_bytes)} with the policy"
            )
        if self.stack_temp_bytes is not None:
            lines.append(
                f"  compiled temp of the gradient of {self.stack_depth} in sequence (output fed back as argument "
                f"{self.stack_argnum}): {_memory.format_bytes(self.baseline_stack_temp_bytes)} without remat, "
                f"{_memory.format_bytes(self.stack_temp_bytes)} with the policy on each"
            )
        if self.collectives is not None and self.collectives.collectives:
            lines.append(f"  collectives of the gradient, per device ({self.collectives.devices} devices):")
            lines.extend(f"    {line}" for line in self.collectives.text(self.baseline_collectives).splitlines())
        lines.extend(self.messages)
        return "\n".join(lines)

    __str__ = text

    def to_json(self) -> dict:
        """Every field as JSON-ready values (decisions and names as lists of dicts)."""
        out = dataclasses.asdict(self)
        out["decisions"] = [dataclasses.asdict(d) for d in self.decisions]
        out["names"] = [dataclasses.asdict(m) for m in self.names]
        out["names_found"] = list(self.names_found)
        out["messages"] = list(self.messages)
        out["matched"] = list(self.matched)
        out["kernel_runs"] = [dataclasses.asdict(k) for k in self.kernel_runs]
        for field in ("collectives", "baseline_collectives"):
            report = getattr(self, field)
            out[field] = None if report is None else report.to_json()
        return out


def mentioned_names(policy: Policy) -> list[tuple[str, str]]:
    """``(role, name)`` for every tensor name ``policy`` refers to.

    Read from the policy's ``save``, ``offload`` and ``exclude`` attributes (tuples of names;
    the name-based built-ins set them, and a custom policy may too).
    """
    found = []
    for attr, role in NAME_ROLES:
        value = getattr(policy, attr, None)
        if isinstance(value, (tuple, list)) and all(isinstance(n, str) for n in value):
            found.extend((role, n) for n in value)
    return found


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def _is_dynamic(leaf) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))


def _flatten(fn: Callable, args: tuple, kwargs: dict, param_argnums: Iterable[int]):
    """``(flat_fn, leaves, param_positions)``: ``fn`` as a function of its array leaves only.

    Leaves become shape structs; other leaves (bools, ints, strings) stay constants, as the
    decorator treats them. ``param_positions`` are the leaf positions of ``param_argnums``.
    """
    flat_fn, leaves, dynamic = split_static(fn, args, kwargs, _is_dynamic)
    owners = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    owners += [None] * (len(leaves) - len(owners))
    wanted = set(param_argnums)
    structs = [
        jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=_mesh_sharding(leaves[i])) for i in dynamic
    ]
    params = tuple(j for j, i in enumerate(dynamic) if owners[i] in wanted)
    return flat_fn, structs, params


def _mesh_sharding(leaf):
    """``leaf``'s sharding when it spans several devices (a mesh), else ``None``."""
    sharding = getattr(leaf, "sharding", None)
    return sharding if len(getattr(sharding, "device_set", ())) > 1 else None


def _gradient_program(flat_fn: Callable, structs: list, with_value: bool = False) -> Callable:
    """The VJP of ``flat_fn`` (cotangent 1) w.r.t. its float leaves, as a function of all leaves;
    with ``with_value``, ``(value, vjp)`` (a training step's shape: the forward's result is used)."""
    floats = [i for i, s in enumerate(structs) if not _program.is_key(s) and jnp.issubdtype(s.dtype, jnp.inexact)]

    def grad_fn(*values):
        def of_diff(*d):
            full = list(values)
            for i, value in zip(floats, d):
                full[i] = value
            return flat_fn(*full)

        out, vjp = jax.vjp(of_diff, *[values[i] for i in floats])
        grads = vjp(
            jax.tree.map(
                lambda o: (
                    jnp.ones(o.shape, o.dtype)
                    if jnp.issubdtype(o.dtype, jnp.inexact)
                    else jnp.zeros(o.shape, jax.dtypes.float0)
                ),
                out,
            )
        )
        return (out, grads) if with_value else grads

    return grad_fn


def _no_saving_line(
    label: str,
    recomputed: int,
    temp: int,
    base_temp: int,
    saved: int,
    base_saved: int,
    whole_function: bool,
    scan_layers: bool | None,
    stack: tuple[int, int, int] | None = None,
) -> str | None:
    """One line when compiled temp memory did not fall although the policy recomputes, else ``None``.

    Any fall of the residuals counts (:func:`jremat.diagnose_remat` with
    ``min_saved_drop=0``): the temp must show at least a quarter of it. ``stack`` is
    ``(depth, temp, baseline temp)`` of the function run ``depth`` times in sequence, each
    checkpointed (:func:`explain` on a block that chains), which says what the block saves as used.
    """
    if not recomputed:
        return None
    note = _memory.diagnose_remat(temp, base_temp, saved, base_saved, scan_layers=scan_layers, min_saved_drop=0.0)
    if note is None and temp < base_temp:
        return None
    if whole_function:  # the known cause: diagnose_remat's list of XLA causes does not apply first
        alone = (
            "a single checkpoint around the whole differentiated function cannot save: the backward pass starts "
            "right after the forward, so it recomputes all of it at once and every intermediate is alive again "
            f"(compiled temp {base_temp:,} -> {temp:,} bytes)"
        )
        if stack is not None and stack[1] < stack[2]:
            depth, stack_temp, base_stack_temp = stack
            return (
                f"one checkpoint ({label}): {alone}; as a block, {depth} in sequence each checkpointed, the "
                f"gradient's compiled temp falls {base_stack_temp:,} -> {stack_temp:,} bytes "
                f"({(base_stack_temp - stack_temp) // depth:,} per block): its saving where it is used in a stack"
            )
        in_stack = (
            f"; {stack[0]} in sequence each checkpointed did not save either ({stack[2]:,} -> {stack[1]:,} bytes)"
            if stack is not None
            else ""
        )
        return (
            f"no saving ({label}): residuals for the backward pass fell {base_saved:,} -> {saved:,} bytes but "
            f"{alone}{in_stack}; the residuals are the saving where the function is one of several differentiated "
            "together: checkpoint each block where the model calls it (@jremat.policy on the block, "
            "jremat.run_layers)"
        )
    if note is None:
        note = (
            f"the policy recomputes {recomputed} values but compiled temp memory did not fall "
            f"({base_temp:,} -> {temp:,} bytes); likely cause: XLA merged the recomputation back into the "
            "forward pass or scheduled it early"
        )
    return f"no saving ({label}): {note}"


#: Copies of a block run in sequence to measure its saving in a stack (:func:`explain`).
STACK_DEPTH = 4


def _chain_argnum(fn: Callable, args: tuple, kwargs: dict, param_argnums: Iterable[int] = ()) -> int | None:
    """The first positional argument, not one of ``param_argnums``, whose structure, shapes and dtypes
    ``fn``'s output has, else ``None``: a block's output is fed back as its activations, never as its
    parameters."""
    params = set(param_argnums)
    flat_fn, structs, _ = _flatten(fn, args, kwargs, ())
    try:
        out = jax.eval_shape(flat_fn, *structs)
    except Exception:  # a function that does not trace here is reported by explain_applied
        return None
    out_avals = [(tuple(o.shape), str(o.dtype)) for o in jax.tree.leaves(out)]
    for i, arg in enumerate(args):
        leaves = jax.tree.leaves(arg)
        if (
            i not in params
            and leaves
            and all(_is_dynamic(leaf) for leaf in leaves)
            and jax.tree.structure(arg) == jax.tree.structure(out)
            and [(tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves] == out_avals
        ):
            return i
    return None


def _stack_temps(remat_fn, fn, argnum: int, args: tuple, kwargs: dict, depth: int) -> tuple[int, int] | None:
    """Compiled temp bytes of the gradient of ``depth`` calls in sequence, the output fed back as
    argument ``argnum``: ``(with the policy, without)``; ``None`` where the backend reports none."""

    def chained(block):
        def stack(*a, **kw):
            a = list(a)
            for _ in range(depth):
                a[argnum] = block(*a, **kw)
            return a[argnum]

        return stack

    temps = []
    for block in (remat_fn, fn):
        flat, structs, _ = _flatten(chained(block), args, kwargs, ())
        report = _memory.memory_report(_gradient_program(flat, structs), *structs)
        if not report.available:
            return None
        temps.append(report.temp_bytes)
    return temps[0], temps[1]


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
    static = tuple(i for i, a in enumerate(args) if not any(_is_dynamic(leaf) for leaf in jax.tree.leaves(a)))
    try:
        remat_fn = _decorate_with(chosen, static_argnums=static)(fn)
    except ValueError as err:
        return _failed(label, fn, err)
    stack = None
    param_argnums = tuple(param_argnums)  # read twice below
    argnum = _chain_argnum(fn, args, kwargs, param_argnums) if compile and not isinstance(chosen, NoRemat) else None
    if argnum is not None:
        try:
            temps = _stack_temps(remat_fn, fn, argnum, args, kwargs, STACK_DEPTH)
        except ValueError:  # applying the policy failed: explain_applied reports it
            temps = None
        if temps is not None:
            stack = (argnum, *temps)
    return explain_applied(
        remat_fn,
        *args,
        policy=chosen,
        baseline=fn,
        compile=compile,
        param_argnums=param_argnums,
        whole_function=True,
        _label=label,
        _name=getattr(fn, "__name__", repr(fn)),
        _stack=stack,
        **kwargs,
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
    _label: str | None = None,
    _name: str | None = None,
    _stack: tuple[int, int, int] | None = None,
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
      **kwargs: keyword arguments of both functions.

    Returns:
      An :class:`Explanation`.

    Raises:
      ValueError: on a bad policy spec.
    """
    chosen = registry.resolve(policy)
    label = _label or chosen.spec or type(chosen).__name__
    name = _name or getattr(remat_fn, "__name__", repr(remat_fn))
    flat_remat, structs, params = _flatten(remat_fn, args, kwargs, param_argnums)
    flat_base = _flatten(baseline, args, kwargs, param_argnums)[0] if baseline is not None else None
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
    collectives = baseline_collectives = None
    if flat_base is not None:
        saved = _residuals.saved_residuals_report(flat_remat, *structs, param_argnums=params).computed_bytes
        base_saved = _residuals.saved_residuals_report(flat_base, *structs, param_argnums=params).computed_bytes
        if compile and (temp_bytes is None or baseline_temp_bytes is None):
            temps, comms = [], []
            for f in (flat_remat, flat_base):
                compiled, _ = _memory.compile_for_analysis(_gradient_program(f, structs), *structs)
                report = _memory.compiled_memory_report(compiled)
                temps.append(report.temp_bytes if report.available else None)
                comms.append(_collectives.compiled_collectives_report(compiled))
            temp_bytes, baseline_temp_bytes = temps
            collectives, baseline_collectives = comms
            messages.extend(_collectives.reissued_lines(label, collectives, baseline_collectives))
    recomputed = sum(d.count * d.iterations for d in decisions if d.decision in (RECOMPUTE, EXCLUDE))
    messages.extend(_more_than_none_lines(label, saved, base_saved, temp_bytes, baseline_temp_bytes))
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
    matched = tuple(_match_lines(chosen, jaxpr))
    if None not in (temp_bytes, baseline_temp_bytes, saved, base_saved) and n_checkpoints:
        line = _no_saving_line(
            label,
            recomputed,
            temp_bytes,
            baseline_temp_bytes,
            saved,
            base_saved,
            whole_function and n_checkpoints == 1,
            scan_layers,
            None if _stack is None else (STACK_DEPTH, _stack[1], _stack[2]),
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
        *((None,) * 4 if _stack is None else (STACK_DEPTH, *_stack)),
        collectives,
        baseline_collectives,
        _collectives.mesh_devices(structs),
        kernel_runs=runs,
    )


def _kernel_runs(flat_remat: Callable, flat_base: Callable, structs: list, primal, layers) -> tuple[KernelRuns, ...]:
    """Each kernel's runs in the value-and-gradient of ``flat_remat`` and of ``flat_base``
    (:func:`jremat.kernels.count_kernel_runs`; ``primal`` is the traced function, where its
    ``custom_vjp`` kernels are found; per layer given ``layers``), under the active remat engine:
    the engines differ here (remat3 recomputes a custom_vjp call whole)."""
    kinds: dict = {}
    counted = [
        kernels.count_kernel_runs(
            jax.make_jaxpr(_gradient_program(f, structs, True))(*structs),
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


def _more_than_none_lines(label, saved, base_saved, temp, base_temp) -> list[str]:
    """A line for each measure by which the policy keeps *more* than no remat at all."""
    lines = []
    if None not in (saved, base_saved) and saved > base_saved:
        lines.append(
            f"more than none ({label}): the policy keeps {saved:,} bytes of residuals for the backward pass, "
            f"more than the {base_saved:,} without remat"
        )
    if None not in (temp, base_temp) and temp > base_temp:
        lines.append(
            f"more than none ({label}): compiled temp memory of the gradient is {temp:,} bytes with the policy, "
            f"more than the {base_temp:,} without remat"
        )
    return lines


__all__ = [
    "DECISIONS",
    "EXCLUDE",
    "OFFLOAD",
    "RECOMPUTE",
    "SAVE",
    "Decision",
    "Explanation",
    "KernelRuns",
    "NameMatch",
    "explain",
    "explain_applied",
    "mentioned_names",
]
