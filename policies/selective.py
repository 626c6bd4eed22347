"""``selective``: Megatron-LM's selective activation recomputation.

Korthikanti et al. (2022) keep every activation of a transformer layer except the *attention
core*: the scores ``q·kᵀ`` (with scale and causal mask), the softmax, the attention dropout and
the probabilities-times-``V`` product. Those are the ``[batch, heads, seq, seq]`` tensors, by
far the largest per byte of compute, and are recomputed in the backward pass from the saved
``q``, ``k``, ``v``.

Under a fused attention kernel (:func:`jremat.attention.blockwise_attention`, cuDNN through
``jax.nn.dot_product_attention``) there is no such tensor, and recomputing the kernel would run
it again for no memory. There ``selective`` recomputes nothing of the attention and keeps what
``none`` keeps (dropout masks aside, which it always regenerates): for ``blockwise`` that is its
output and log-sum-exp, so the kernel is not run again; for a Pallas attention kernel (JAX's
``mha``, a ``custom_vjp`` whose forward ``pallas_call`` is named like attention) the forward rule
is run in the checkpointed program (:func:`jremat.kernels.split_kernels`), so the
output and log-sum-exp it hands its backward rule are kept too (a grouped matmul kernel's output,
megablox ``gmm``'s, likewise); JAX's cuDNN kernel names none of its
statistics, so no policy can keep them and its backward pass runs the kernel again.

Otherwise the core is found in one of two ways (:func:`find_attention_core` says which):

* **by tag**, where the model tags its attention with :mod:`jremat.names` (the reference GPT):
  every equation on a data path from a value tagged ``q``, ``k`` or ``v`` to a value tagged
  ``attn_context`` (not followed past those tags, so several attention layers in one checkpoint
  each get their own core);
* **by structure**, in any other model (Flax's ``nnx.MultiHeadAttention`` and Linen's
  ``MultiHeadDotProductAttention``, ``jax.nn.softmax`` in plain JAX, Equinox): a *scores*
  ``dot_general``, a softmax over its output (``exp``, a ``reduce_sum`` of it and the division
  by that sum, or a product with its reciprocal; scaling, masking and the max subtraction may
  sit between), and the ``dot_general``
  of the normalized probabilities (after dropout, if any) with the values. The core is both
  ``dot_general`` equations and every equation on a data path between them.

In a mixture-of-experts block, ``selective`` recomputes the experts' activation only (what
Megatron-LM calls ``moe_act`` recompute) and keeps the grouped matmul outputs and the routing:
:func:`moe_activations` finds, by structure, every equation on an elementwise path from a grouped
matmul's output (``jax.lax.ragged_dot``) to another grouped matmul's rows (the activation between
an expert's grouped matmuls, its name tags included: a GELU between two, or SwiGLU's
``silu(gate) * up`` between the gate and up projections, or the halves of one fused gate-and-up
projection (kept, not split again), and the down projection), in a model that tags its MoE tensors
(:data:`jremat.names.MOE_NAMES`) or not.

``modules`` chooses what is recomputed, by Megatron-LM's ``--recompute-modules`` names:
``core_attn`` (the attention core), ``moe_act`` (the experts' activation), or both (the default,
``selective:modules=core_attn+moe_act``). ``selective:modules=moe_act`` keeps the attention's
``[seq, seq]`` tensors, as a Megatron-LM run with ``--recompute-modules moe_act`` does: where the
sequence is short beside the head width, the scores product costs more to recompute than the
memory it frees is worth.

Every other computed value is saveable; JAX then keeps those the backward pass needs. Values
derived only from PRNG keys (dropout masks) are never saved: they are regenerated from the
threaded key. A checkpointed function with none of the chosen modules is an error naming what was
looked for (``selective`` would keep everything there, like
``none``); in a layer stack checkpointed per sublayer, the MLP sublayer needs none as long as
the attention sublayer has one.
"""

from __future__ import annotations

import dataclasses

from jax.extend import core as jcore

from jremat import Plan, PlanPolicy, Program, attention, kernels, names, register
from jremat.internal import BUILTIN_PARAMS, SELECTIVE_MODULES
from jremat.internal import jaxpr as _jaxpr

#: Names of the attention core's inputs (paths start after them) and output (paths end at it).
CORE_INPUTS = (names.QUERY, names.KEY, names.VALUE)
CORE_OUTPUT = names.ATTN_CONTEXT


def _is_var(v) -> bool:
    return not isinstance(v, jcore.Literal)


#: How the core was found.
BY_TAG = "tag"
BY_STRUCTURE = "structure"
#: A fused attention kernel (blockwise, cuDNN): no ``[seq, seq]`` tensor to drop.
BY_FUSED_KERNEL = "fused kernel"
#: The ``modules`` key's values (Megatron-LM's ``--recompute-modules`` names).
CORE_ATTN, MOE_ACT = SELECTIVE_MODULES
#: What ``selective`` looks for, per module, for error messages.
LOOKED_FOR = {
    CORE_ATTN: f"an attention core: values tagged {names.QUERY}/{names.KEY}/{names.VALUE} and "
    f"{names.ATTN_CONTEXT} (jremat.names), or by structure a scores dot_general, a softmax over it "
    "(exp, reduce_sum, divide or multiply by the reciprocal; scaling and masking allowed) and the dot_general "
    "of the probabilities with the values",
    MOE_ACT: "a mixture of experts' activation between two grouped matmuls (jax.lax.ragged_dot)",
}
MISSING = {CORE_ATTN: "no attention core", MOE_ACT: "no experts' activation"}


def _elementwise(eqn) -> bool:
    """Whether ``eqn`` is elementwise for :func:`moe_activations`: an elementwise primitive, a name
    tag, a shape-only op, a static selection (the ``split`` or slices of a fused gate-and-up
    projection), or a call (a ``jit``, a nested checkpoint such as :func:`jremat.ops.swiglu`, a
    custom derivative) whose body is all of these."""
    name = eqn.primitive.name
    passable = _jaxpr.ELEMENTWISE_PRIMITIVES | _jaxpr.SHAPE_ONLY_PRIMITIVES | _jaxpr.SELECTION_PRIMITIVES
    if name in passable or name == _jaxpr.NAME:
        return True
    bodies = _jaxpr.nested_jaxprs(eqn)
    return bool(bodies) and name != _jaxpr.SCAN and all(_elementwise(inner) for sub in bodies for inner in sub.eqns)


def moe_activations(program: Program) -> frozenset[int]:
    """Equation indices of the experts' activations in ``program`` (see the module docstring):
    every equation on a path of elementwise equations (:func:`_elementwise`) from a grouped
    matmul's output to the rows (first operand) of another grouped matmul, both matmuls excluded."""
    eqns = program.closed_jaxpr.jaxpr.eqns
    grouped = {i for i, e in enumerate(eqns) if _jaxpr.is_grouped_matmul(e)}
    if len(grouped) < 2:
        return frozenset()

    def passes(i: int) -> bool:
        op = program.ops[i]
        return op.is_elementwise or _elementwise(eqns[i])

    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    consumers: dict = {}
    for i, e in enumerate(eqns):
        for v in filter(_is_var, e.invars):
            consumers.setdefault(v, []).append(i)
    after: set[int] = set()  # reached forwards from a grouped matmul's output through passable ops
    stack = [j for g in grouped for v in eqns[g].outvars for j in consumers.get(v, ())]
    while stack:
        i = stack.pop()
        if i in after or i in grouped or not passes(i):
            continue
        after.add(i)
        stack += [j for v in eqns[i].outvars for j in consumers.get(v, ())]
    before: set[int] = set()  # reached backwards from a grouped matmul's rows through passable ops
    rows = [_jaxpr.grouped_matmul_rows(eqns[g]) for g in grouped]
    stack = [producer[v] for v in rows if _is_var(v) and v in producer]
    while stack:
        i = stack.pop()
        if i in before or i in grouped or not passes(i):
            continue
        before.add(i)
        stack += [producer[v] for v in filter(_is_var, eqns[i].invars) if v in producer]
    # A split's parts are kept, not recomputed from the whole: the same bytes, and on a mesh XLA may
    # move the parts between devices, which a recomputation would do again.
    return frozenset(i for i in after & before if eqns[i].primitive.name not in _jaxpr.SELECTION_PRIMITIVES)


@dataclasses.dataclass(frozen=True)
class AttentionCore:
    """The attention core(s) of a program.

    Attributes:
      equations: indices of the equations recomputed (scores, softmax, dropout, probabilities x V).
      matched_by: :data:`BY_TAG`, :data:`BY_STRUCTURE` or :data:`BY_FUSED_KERNEL` (nothing to
        recompute); ``None`` when no core was found.
      count: how many attention cores (one per scores ``dot_general``, or per fused kernel).
      kernels: the kinds of fused kernel found (:func:`jremat.attention.forward_kernel`).
    """

    equations: frozenset[int]
    matched_by: str | None
    count: int
    kernels: frozenset[str] = frozenset()


def find_attention_core(program: Program) -> AttentionCore:
    """The attention core(s) of ``program``: none to recompute where a fused attention kernel
    computes attention (:func:`jremat.attention.forward_kernel`), else by tag where it tags
    its attention, else by structure.

    Raises:
      ValueError: if the program tags attention tensors but not the core's boundary (see
        :func:`attention_core`).
    """
    kernels = [kind for eqn in program.closed_jaxpr.jaxpr.eqns if (kind := attention.forward_kernel(eqn))]
    if kernels:  # recomputing a fused kernel would run it again and free no S x S tensor
        return AttentionCore(frozenset(), BY_FUSED_KERNEL, len(kernels), frozenset(kernels))
    by_tag = attention_core(program)
    if by_tag:
        n_scores = sum(1 for i in by_tag if program.closed_jaxpr.jaxpr.eqns[i].primitive.name == _jaxpr.DOT_GENERAL)
        return AttentionCore(by_tag, BY_TAG, max(1, n_scores // 2))
    cores = structural_attention_cores(program)
    if not cores:
        return AttentionCore(frozenset(), None, 0)
    return AttentionCore(frozenset().union(*cores), BY_STRUCTURE, len(cores))


def _softmax_call(eqn) -> bool:
    """A custom-derivative call whose body is a softmax (exp, reduce_sum and div inside)."""
    if eqn.primitive.name not in _jaxpr.CUSTOM_DERIVATIVE_PRIMITIVES:  # jax.nn.softmax is a custom_jvp
        return False
    found = {inner.primitive.name for sub in _jaxpr.nested_jaxprs(eqn) for inner in _jaxpr.equations(sub)}
    return _jaxpr.SOFTMAX_PRIMITIVES <= found


def structural_attention_cores(program: Program) -> list[frozenset[int]]:
    """Attention cores found from the program's structure alone (no tags), one per softmax.

    For each ``exp`` whose output is summed (``reduce_sum``) and divided by that sum (``div``, or
    ``mul`` by its reciprocal), the scores
    ``dot_general`` equations are those reached backwards from the ``exp`` without crossing another
    matrix product, and the context ``dot_general`` equations those reached forwards from the division
    the same way. The core is those products and every equation on a data path between them.

    Returns:
      One frozenset of equation indices per softmax that has both products.
    """
    eqns = program.closed_jaxpr.jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    consumers: dict = {}
    for i, e in enumerate(eqns):
        for v in filter(_is_var, e.invars):
            consumers.setdefault(v, []).append(i)
    is_dot = lambda i: eqns[i].primitive.name == _jaxpr.DOT_GENERAL

    def reach(starts, step, stop) -> set[int]:
        """Equations reached from ``starts`` (excluded) by ``step``, not expanding past ``stop``."""
        seen: set[int] = set()
        stack = [j for i in starts for j in step(i)]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            if not stop(i):
                stack += step(i)
        return seen

    forward = lambda i: [j for v in eqns[i].outvars for j in consumers.get(v, ())]
    backward = lambda i: [producer[v] for v in filter(_is_var, eqns[i].invars) if v in producer]
    cores = []
    for e, eqn in enumerate(eqns):
        if eqn.primitive.name == _jaxpr.EXP:
            after_exp = reach([e], forward, is_dot)
            sums = [i for i in after_exp if eqns[i].primitive.name == _jaxpr.REDUCE_SUM]
            after_sums = reach(sums, forward, is_dot)
            normalized = [i for i in after_exp & after_sums if eqns[i].primitive.name in _jaxpr.NORMALIZING_PRIMITIVES]
        elif _softmax_call(eqn):
            normalized = [e]
        else:
            continue
        if not normalized:
            continue
        scores = {i for i in reach([e], backward, is_dot) if is_dot(i)}
        contexts = {i for i in reach(normalized, forward, is_dot) if is_dot(i)} - scores
        if not scores or not contexts:
            continue
        between = reach(scores, forward, contexts.__contains__) & reach(contexts, backward, scores.__contains__)
        # A mixture of experts' router (a dot_general, its softmax, the experts' grouped matmuls, and
        # the combine weighted by the router's probabilities) has this shape too: it is no attention.
        if any(eqns[i].primitive.name == _jaxpr.RAGGED_DOT_GENERAL for i in between):
            continue
        cores.append(frozenset(scores | contexts | between))
    return cores


def attention_core(program: Program) -> frozenset[int]:
    """Equation indices of the attention core(s) of ``program`` found by tag (see the module docstring).

    Raises:
      ValueError: if the program tags attention-core tensors (:data:`jremat.names.ATTENTION_CORE`)
        but not the core's boundary (``q``, ``k``, ``v`` and ``attn_context``), so that the core
        cannot be delimited.
    """
    eqns = program.closed_jaxpr.jaxpr.eqns

    def tagged(name_set):
        return {i for i, e in enumerate(eqns) if _jaxpr.name_tag(e) in name_set}

    starts, ends = tagged(CORE_INPUTS), tagged({CORE_OUTPUT})
    if not starts and not ends:
        if tagged(set(names.ATTENTION_CORE)):
            raise ValueError(
                "policy 'selective': the function tags attention-core tensors "
                f"({', '.join(names.ATTENTION_CORE)}) but not the core's inputs and output; tag them "
                f"with checkpoint_name as {', '.join(CORE_INPUTS)} and {CORE_OUTPUT} (jremat.names)"
            )
        return frozenset()
    if not starts or not ends:
        missing = ", ".join(CORE_INPUTS) if not starts else CORE_OUTPUT
        raise ValueError(
            f"policy 'selective': the function tags only one side of the attention core; tag {missing} "
            "with checkpoint_name too (jremat.names), or use another policy"
        )
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    consumers: dict = {}
    for i, e in enumerate(eqns):
        for v in filter(_is_var, e.invars):
            consumers.setdefault(v, []).append(i)

    downstream: set[int] = set()  # reached forwards from q/k/v, not past attn_context
    stack = [j for i in starts for v in eqns[i].outvars for j in consumers.get(v, ())]
    while stack:
        i = stack.pop()
        if i in downstream or i in starts:
            continue
        downstream.add(i)
        if i in ends:
            continue
        stack += [j for v in eqns[i].outvars for j in consumers.get(v, ())]
    upstream: set[int] = set()  # reached backwards from attn_context, not past q/k/v
    stack = [producer[v] for i in ends for v in filter(_is_var, eqns[i].invars) if v in producer]
    while stack:
        i = stack.pop()
        if i in upstream or i in starts or i in ends:
            continue
        upstream.add(i)
        stack += [producer[v] for v in filter(_is_var, eqns[i].invars) if v in producer]
    return frozenset(downstream & upstream)


def _kept_kernel_call(eqn) -> bool:
    """Whether ``eqn`` is a ``custom_vjp`` kernel call whose output selective keeps: an attention
    kernel (:func:`jremat.kernels.is_attention_call`) or a grouped matmul (megablox ``gmm``)."""
    return kernels.is_attention_call(eqn) or (
        eqn.primitive.name == _jaxpr.CUSTOM_VJP_CALL and _jaxpr.is_grouped_matmul(eqn)
    )


class Selective(PlanPolicy):
    """Save everything except the attention core and the experts' activation (those of
    ``modules``); never save dropout masks."""

    # An attention kernel's output and statistics, split inside a scan body too (jremat.kernels).
    saved_tags = (names.KERNEL_RESIDUALS,)

    def __init__(self, modules: tuple[str, ...] = SELECTIVE_MODULES):
        self.modules = tuple(modules)

    def checkpoint_untied(self, fn, *, prevent_cse=True):
        # A Pallas attention kernel's forward rule runs in the ordinary program, so that its
        # output and log-sum-exp are values the plan keeps (jremat.kernels); a grouped matmul
        # kernel's (megablox gmm) too, so that its output is kept.
        return super().checkpoint_untied(kernels.split_kernels(fn, _kept_kernel_call), prevent_cse=prevent_cse)

    def _recomputed(self, program: Program) -> tuple[AttentionCore, frozenset[int]]:
        """The attention core and the experts' activation this policy recomputes (per :attr:`modules`)."""
        found = find_attention_core(program) if CORE_ATTN in self.modules else AttentionCore(frozenset(), None, 0)
        activations = moe_activations(program) if MOE_ACT in self.modules else frozenset()
        return found, activations

    def plan(self, program: Program) -> Plan:
        found, activations = self._recomputed(program)
        looked_for = "; or ".join(LOOKED_FOR[m] for m in self.modules)
        names.check_requirement(
            ("selective", "attention core"),
            found.matched_by is not None or bool(activations),
            f"policy 'selective' (modules={'+'.join(self.modules)}): the checkpointed function has "
            f"{' and '.join(MISSING[m] for m in self.modules)}, so selective would keep everything, like 'none'; "
            f"it looks for {looked_for}. Use 'full', 'dots' or 'every_k:k=K' here, or apply selective only where there is "
            "attention or a mixture of experts",
        )
        core = found.equations | activations
        return Plan(
            save=frozenset(
                op.index
                for op in program.ops
                if (op.counted or op.primitive == _jaxpr.NAME) and not op.rng_derived and op.index not in core
            )
        )

    def describe_match(self, program: Program) -> list[str]:
        found, activations = self._recomputed(program)
        moe = (
            [
                f"expert activation found by structure (between grouped matmuls): {len(activations)} equations, "
                f"{sum(program.ops[i].out_bytes for i in activations):,} bytes recomputed; the grouped matmul "
                "outputs and the routing are kept"
            ]
            if activations
            else []
        )
        if CORE_ATTN in self.modules:
            return self._describe_attention(program, found, bool(activations)) + moe
        return moe + [
            f"attention core kept (modules={'+'.join(self.modules)}): not looked for, kept like any other value"
        ]

    def _describe_attention(self, program: Program, found: AttentionCore, has_moe: bool) -> list[str]:
        if found.matched_by is None:
            return [] if has_moe else [f"no attention core: looked for {LOOKED_FOR[CORE_ATTN]}"]
        if found.matched_by == BY_FUSED_KERNEL:
            lines = []
            if attention.BLOCKWISE in found.kernels:
                lines.append(
                    "fused attention kernel (blockwise): no [seq, seq] tensor to drop, so its output and statistics "
                    "are kept and the kernel is not run again (selective keeps what none keeps here, dropout masks aside)"
                )
            if attention.PALLAS in found.kernels:
                lines.append(
                    "fused attention kernel (Pallas): no [seq, seq] tensor to drop; its forward rule runs in the "
                    "program, so its output and log-sum-exp are kept and the kernel is not run again"
                )
            if kernels.CUSTOM_ATTENTION in found.kernels:
                lines.append(
                    "fused attention kernel (custom_vjp, an online softmax or declared): no [seq, seq] tensor to drop; "
                    "its forward rule runs in the program, so its output and statistics are kept and the kernel is "
                    "not run again"
                )
            if attention.CUDNN in found.kernels:
                lines.append(
                    "fused attention kernel (cuDNN): no [seq, seq] tensor to drop, so nothing of it is recomputed, "
                    "but JAX names none of its statistics, so no policy can keep them: the backward pass runs the "
                    "kernel again (attention 'blockwise' keeps them)"
                )
            return lines
        how = (
            f"between the {names.QUERY}/{names.KEY}/{names.VALUE} and {names.ATTN_CONTEXT} tags"
            if found.matched_by == BY_TAG
            else "scores dot_general, softmax, probabilities x values dot_general"
        )
        recomputed = sum(program.ops[i].out_bytes for i in found.equations)
        return [
            f"attention core found by {found.matched_by} ({how}): {found.count} core"
            f"{'' if found.count == 1 else 's'}, {len(found.equations)} equations, {recomputed:,} bytes recomputed"
        ]


@register(
    "selective",
    doc="Megatron-style selective recomputation: save everything except the attention core (scores, "
    "softmax, attention dropout, probabilities x V: between the q/k/v and attn_context tags, or found by "
    "structure in untagged models), which is recomputed from the saved q, k, v, and a mixture of experts' "
    "activation between its grouped matmuls; modules= chooses which (core_attn, moe_act); dropout masks are "
    "never saved; an error where the function has none of them.",
    params=BUILTIN_PARAMS["selective"],
)
def selective_policy(modules: tuple[str, ...]) -> Selective:
    """Build the ``selective`` policy recomputing ``modules`` (:data:`SELECTIVE_MODULES`)."""
    return Selective(modules)
