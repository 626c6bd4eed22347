"""Keep or re-issue: the ``keep_collectives`` key every built-in single-function policy takes.

On a mesh, a checkpoint that recomputes its forward pass in the backward pass issues its
collectives again: the all-gathers of FSDP's weights, an expert-parallel MoE's dispatch and
combine all-to-alls, a tensor-parallel block's all-reduces. ``keep_collectives=true`` adds the
output of every collective the recomputation would issue again to what the policy saves, so
the backward pass reads it instead:

* the collectives written inside :func:`jax.shard_map` (``all_gather``, ``all_to_all``,
  ``psum``/``pmean``/``pmax``/``pmin``, ``psum_scatter``, ``ppermute``; kinds in
  :data:`jremat._engine.jaxpr.COLLECTIVE_PRIMITIVES`), wherever they are: at the checkpoint's top
  level, inside ``shard_map`` and ``lax.scan`` bodies;
* the gathered weights the model writes (:func:`jremat._apply.gathered.gathered_weights`: a
  sharding constraint or reshard of an input that feeds a matmul), which is ``keep_gathered``.

* the weights XLA gathers on its own (placed by ``NamedSharding``, no gather in the model; the
  matrices, and the vectors such as LayerNorm scales and biases): found by :func:`xla_gathers`
  and, on a mesh of one split axis, gathered whole inside the checkpoint and kept (in a scan,
  the vectors and only the matrices the backward pass does not read, as the step without remat
  keeps none of them);
  where their placement cannot be found, :meth:`KeepCollectives.describe_match` names each in
  one line.

The backward pass's own collectives (the transposes: a ``psum``'s broadcast, an all-to-all back)
are not recomputation and stay. Other collectives XLA inserts on its own (around activations: a
reduction over a split dimension, a reshard) are not values of the traced program and cannot be
kept: :func:`jremat.explain_applied` names each kind it finds re-issued in the compiled step.

Memory: each checkpoint keeps its collectives' outputs (per device) from its forward pass to
its backward pass, as the step without remat keeps them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jremat._apply.gathered import KeepTagged, gathered_weights, weight_uses
from jremat._apply.policy import NoRemat, Policy
from jremat._engine import interpreter as _interpreter
from jremat._engine import jaxpr as _jaxpr
from jremat._engine.active import name_tag
from jremat._program import program as _program
from jremat._program.program import Program

#: The spec key that keeps the outputs of collectives.
KEY = "keep_collectives"
#: The checkpoint name a collective's output gets, so that the inner policy saves it wherever it is.
COLLECTIVE_TAG = "jremat_collective"


def collective_kind(eqn) -> str | None:
    """The HLO collective kind ``eqn`` issues (:data:`jremat._engine.jaxpr.COLLECTIVE_PRIMITIVES`), or ``None``."""
    return _jaxpr.COLLECTIVE_PRIMITIVES.get(eqn.primitive.name)


def _split_axes(entry, mesh) -> list[str]:
    """The mesh axes of size above 1 one entry of a :class:`PartitionSpec` splits a dimension over."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return [a for a in names if mesh.shape.get(a, 1) > 1]


def partial_sum_matmuls(program: Program) -> frozenset[int]:
    """Equation indices of ``program``'s matmuls whose output XLA all-reduces: a ``dot_general``
    one of whose operands is placed by a sharding constraint in the program (through dtype
    conversions) with a contracting dimension split over a mesh axis (a row-parallel matmul of
    Megatron's tensor parallelism). Keeping such a matmul's output keeps its all-reduce.

    Args:
      program: a checkpointed function's traced :class:`jremat.Program`.

    Returns:
      The indices of the ``dot_general`` equations found.
    """
    jaxpr = program.closed_jaxpr.jaxpr
    placed: dict = {}  # variable -> the sharding a constraint gives it
    found = set()
    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        if name == _jaxpr.SHARDING_CONSTRAINT:
            placed[eqn.outvars[0]] = eqn.params.get("sharding")
        elif name in _jaxpr.DTYPE_ONLY_PRIMITIVES and eqn.invars and eqn.invars[0] in placed:
            placed[eqn.outvars[0]] = placed[eqn.invars[0]]
        elif name == _jaxpr.DOT_GENERAL:
            contracting, _ = eqn.params["dimension_numbers"]  # ((lhs, rhs) contracting, (lhs, rhs) batch)
            for operand, dims in zip(eqn.invars[:2], contracting):
                sharding = placed.get(operand) if isinstance(operand, jcore.Var) else None
                spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
                if spec is not None and any(d < len(spec) and _split_axes(spec[d], mesh) for d in dims):
                    found.add(i)
    return frozenset(found)


def collective_counts(program: Program) -> dict[str, int]:
    """Collective equations of ``program`` that :class:`KeepCollectives` keeps, by HLO kind:
    those written in the program (inside ``shard_map`` and ``scan`` bodies too, each counted once,
    not per trip), its gathered weights (``all-gather``) and its matmuls over a split contracting
    dimension (``all-reduce``, :func:`partial_sum_matmuls`).

    Args:
      program: a checkpointed function's traced :class:`jremat.Program`.

    Returns:
      ``{kind: count}`` for the kinds found.
    """
    counts: dict[str, int] = {}
    tagged_inside = lambda eqn, _: _jaxpr.is_scan(eqn) or _jaxpr.is_shard_map(eqn)  # as tag_collectives reaches
    for eqn in _jaxpr.equations(program.closed_jaxpr.jaxpr, enter=tagged_inside):
        kind = collective_kind(eqn)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    gathered = len(gathered_weights(program)) + len(xla_gathers(program).placed)
    if gathered:
        counts["all-gather"] = counts.get("all-gather", 0) + gathered
    reduced = len(partial_sum_matmuls(program))
    if reduced:
        counts["all-reduce"] = counts.get("all-reduce", 0) + reduced
    return counts


@dataclasses.dataclass(frozen=True)
class XlaGathers:
    """The weights of a checkpoint that XLA gathers on its own (no gather in the traced program).

    Attributes:
      placed: input leaf index -> the :class:`jax.sharding.NamedSharding` it is gathered to.
      unplaced: one line per weight whose gathered placement cannot be found, naming it.
    """

    placed: dict[int, Any]
    unplaced: tuple[str, ...]


def _input_names(program: Program) -> list[str]:
    """A readable name per input leaf of ``program`` (``args[0]['w1']``), or ``input i``."""
    n = len(program.closed_jaxpr.jaxpr.invars)
    if program.in_tree is None:
        return [f"input {i}" for i in range(n)]
    paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(program.in_tree, range(n)))[0]
    names = []
    for path, _ in paths:
        (where, *rest) = path or (None,)
        head = "args" if getattr(where, "idx", None) == 0 else "kwargs"
        names.append(head + jax.tree_util.keystr(tuple(rest)))
    return names


def backward_reads(program: Program) -> frozenset[int]:
    """The input leaves of ``program`` that its backward pass without remat reads: the inputs
    (through shape-only ops) among the residuals :func:`jax.vjp` keeps for it.

    Args:
      program: a checkpointed function's traced :class:`jremat.Program`.

    Returns:
      Input leaf indices.
    """
    closed = program.closed_jaxpr
    avals = [v.aval for v in closed.jaxpr.invars]
    floats = [i for i, a in enumerate(avals) if jnp.issubdtype(getattr(a, "dtype", jnp.int32), jnp.inexact)]

    def residuals(*leaves):
        def run(*xs):
            given = list(leaves)
            for i, x in zip(floats, xs):
                given[i] = x
            return jcore.jaxpr_as_fun(closed)(*given)

        return jax.tree.leaves(jax.vjp(run, *(leaves[i] for i in floats))[1])

    traced = jax.make_jaxpr(residuals)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
    origin = dict(zip(traced.jaxpr.invars, range(len(avals))))
    for eqn in traced.jaxpr.eqns:
        operand = eqn.invars[0] if eqn.invars else None
        if (
            eqn.primitive.name in _jaxpr.GATHER_PASS_THROUGH_PRIMITIVES
            and isinstance(operand, jcore.Var)
            and operand in origin
        ):
            origin.update(dict.fromkeys(eqn.outvars, origin[operand]))
    return frozenset(origin[v] for v in traced.jaxpr.outvars if isinstance(v, jcore.Var) and v in origin)


def xla_gathers(program: Program, *, in_scan: bool = False) -> XlaGathers:
    """The weights of ``program`` that XLA gathers on its own, and where to.

    A weight here is an input used only as a weight (:func:`jremat._apply.gathered.weight_uses`,
    through shape-only ops and calls): a floating input of at least 2 dimensions used only as an
    operand of matmuls (an activation also feeds the residual stream or a norm), or a floating
    vector used only as a matmul operand or given more dimensions to meet the activations (a
    LayerNorm scale, a bias). When both operands of a matmul are such inputs, which one is the
    weight is not guessed and both are named unplaced. Its
    gathered placement comes from the mesh its type carries (else the mesh in context): on a mesh
    of one axis of size above 1 (auto axes) it is gathered whole (``P()``, FSDP's gather); on a
    mesh of several such axes the placement depends on shardings that are not in the traced
    program (auto axes: a jit argument's type holds no spec), and the weight is named unplaced.
    On a mesh of explicit axes XLA inserts no gather a program did not write (``reshard``), nor
    over the manual axes of a :func:`jax.shard_map` body, where nothing is placed.

    In a ``lax.scan`` body the step without remat keeps no gather XLA inserts: its backward pass
    gathers again each weight it reads (:func:`backward_reads`), and a checkpoint's recomputation
    gathering a matrix serves that backward pass too. There (``in_scan``) the vectors and the
    matrices the backward pass does not read are gathered and kept: the other matrices' gathers
    are issued as often as without remat, and keeping them would hold every layer's gathered
    matrices at once (under FSDP, the whole model on each device). A vector the backward pass
    reads (a LayerNorm scale) is kept all the same: XLA gathers it once for the recomputation and
    again for the backward pass, and it costs a few bytes a layer.

    Args:
      program: a checkpointed function's traced :class:`jremat.Program`.
      in_scan: the checkpoint runs in a scan of more than one step (built with ``prevent_cse=False``).

    Returns:
      An :class:`XlaGathers`.
    """
    if AxisType.Manual in jax.sharding.get_abstract_mesh().axis_types:
        # A shard_map body: nothing over its manual axes, and over any auto ones the weights'
        # placement is not in the traced program.
        return XlaGathers(placed={}, unplaced=())
    jaxpr = program.closed_jaxpr.jaxpr
    candidates: dict[int, list] = {}
    origin_of: dict = {}
    for i, v in enumerate(jaxpr.invars):
        aval = v.aval
        if not (getattr(aval, "ndim", 0) >= 1 and jnp.issubdtype(aval.dtype, jnp.floating)):
            continue
        uses = weight_uses(jaxpr, v)
        # A vector given more dimensions is a per-feature parameter (a scale, a bias); a larger
        # input only when matmuls alone use it (an activation also feeds other ops).
        weight = uses.matmuls and not uses.raised if aval.ndim >= 2 else uses.matmuls or uses.raised
        if weight and not uses.other:
            candidates[i] = uses.matmuls
            origin_of.update(dict.fromkeys(uses.reached, i))
    names = _input_names(program)
    # A matmul of two such inputs: which is the weight (and which the activation, that gathering
    # whole would replicate) is not guessed.
    ambiguous: set[int] = set()
    for dots in candidates.values():
        for dot in dots:
            lhs, rhs = (origin_of.get(v) for v in dot.invars[:2])
            if lhs is not None and rhs is not None and lhs != rhs:
                ambiguous.update((lhs, rhs))
    if in_scan and candidates:
        # A vector is kept even when the backward pass reads it: XLA gathers such a vector once for
        # the recomputation and again for the backward pass, and holding it costs a few bytes a layer.
        read = backward_reads(program)
        candidates = {i: dots for i, dots in candidates.items() if i not in read or jaxpr.invars[i].aval.ndim == 1}
    placed, unplaced = {}, []
    for i in sorted(candidates):
        aval = jaxpr.invars[i].aval
        where = f"{names[i]} ({aval.str_short()})"
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        if mesh is None or mesh.empty:
            mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or AxisType.Explicit in mesh.axis_types:
            continue
        split = [a for a in mesh.axis_names if mesh.shape[a] > 1]
        if split and i in ambiguous:
            unplaced.append(f"{where}: a matmul of two inputs used only there; which one is the weight is not known")
        elif len(split) == 1:
            placed[i] = NamedSharding(mesh, PartitionSpec())
        elif split:
            axes = ",".join(f"{a}={mesh.shape[a]}" for a in split)
            unplaced.append(
                f"{where}: on a mesh of several axes ({axes}) where XLA gathers it is not in the traced program; "
                "gather it in the model (jax.lax.with_sharding_constraint to its gathered placement)"
            )
    return XlaGathers(placed=placed, unplaced=tuple(unplaced))


def tag_collectives(fn: Callable, *, in_scan: bool = False) -> Callable:
    """``fn`` with the output of each collective and each gathered weight tagged
    :data:`COLLECTIVE_TAG` (:func:`collective_counts`); values and gradients unchanged. The
    weights XLA would gather on its own that :func:`xla_gathers` places are gathered first (a
    sharding constraint to their placement), and tagged; ``in_scan`` as :func:`xla_gathers` takes it.

    ``fn`` is traced once per input signature and its program evaluated with the tags (not
    called again: a second call would draw a Linen module's random values anew).
    """

    def build(prog: Program):
        eqns = prog.closed_jaxpr.jaxpr.eqns
        gathered = {id(eqns[i]) for i in gathered_weights(prog) | partial_sum_matmuls(prog)}
        placed = xla_gathers(prog, in_scan=in_scan).placed

        def tag_of(eqn):
            return COLLECTIVE_TAG if id(eqn) in gathered or collective_kind(eqn) is not None else None

        def run(*leaves):
            # The gathers XLA would insert, made values of the program: a sharding constraint of
            # each weight to its gathered placement, tagged.
            gathered_leaves = [
                name_tag(jax.lax.with_sharding_constraint(x, placed[i]), COLLECTIVE_TAG) if i in placed else x
                for i, x in enumerate(leaves)
            ]
            return _interpreter.evaluate_tagged_where(prog.closed_jaxpr, tag_of, gathered_leaves)

        return prog.out_tree, run

    return _program.run_traced_once(fn, build)


class KeepCollectives(KeepTagged):
    """``inner`` plus the outputs of every checkpoint's collectives (:func:`collective_counts`),
    tagged :data:`COLLECTIVE_TAG` (:class:`jremat._apply.gathered.KeepTagged`).

    Args:
      inner: a :class:`jremat.CallbackPolicy` or :class:`jremat.PlanPolicy`.

    Raises:
      ValueError: for another kind of policy (a layer-stack policy, ``none``).
    """

    key = KEY
    tag = COLLECTIVE_TAG

    def tagged(self, fn: Callable, *, in_scan: bool = False) -> Callable:
        return tag_collectives(fn, in_scan=in_scan)

    def describe_match(self, program: Program) -> list[str]:
        counts = collective_counts(program)
        lines = self.inner.describe_match(program)
        unplaced = [f"cannot keep the gather of {line}" for line in xla_gathers(program).unplaced]
        if not counts:
            return [
                *lines,
                "no collective to keep (none written in a shard_map, no gathered weight); other collectives XLA "
                "inserts on its own are not in the traced program",
                *unplaced,
            ]
        found = ", ".join(f"{n} {kind}{'s' if n != 1 else ''}" for kind, n in sorted(counts.items()))
        placed = xla_gathers(program).placed
        read = sorted(set(placed) - set(xla_gathers(program, in_scan=True).placed))
        in_scan = (
            [
                f"in a scan (prevent_cse=False) it does not keep the gathers of {', '.join(_input_names(program)[i] for i in read)}: "
                "the backward pass reads them, and XLA gathers them again for it, as without remat"
            ]
            if read
            else []
        )
        return [*lines, f"keeps the outputs of {found}", *in_scan, *unplaced]


def with_keep_collectives(policy: Policy, keep: bool) -> Policy:
    """``policy`` wrapped in :class:`KeepCollectives` when ``keep``; ``none`` keeps everything already.

    Raises:
      ValueError: as :class:`KeepCollectives`.
    """
    if not keep or isinstance(policy, NoRemat):
        return policy
    return KeepCollectives(policy)


__all__ = [
    "COLLECTIVE_TAG",
    "collective_kind",
    "KEY",
    "KeepCollectives",
    "collective_counts",
    "partial_sum_matmuls",
    "tag_collectives",
    "with_keep_collectives",
    "xla_gathers",
    "XlaGathers",
]
