"""What :func:`jremat.explain` returns: :class:`Explanation` and its parts, and their text.

:meth:`Explanation.text` is the plain text ``print(jremat.explain(...))`` shows; :meth:`Explanation.to_json`
the same as a dict. The measurement behind the figures is in :mod:`jremat._explain.explain`.
"""

from __future__ import annotations

import dataclasses

from jremat._explain.decisions import DECISIONS, Decision
from jremat._measure import collectives as _collectives
from jremat._spec.budget import format_bytes


@dataclasses.dataclass(frozen=True)
class NameMatch:
    """One tensor name the policy mentions and what it matched in the traced function.

    Attributes:
      role: :data:`jremat._explain.decisions.SAVE`, :data:`~jremat._explain.decisions.OFFLOAD` or :data:`~jremat._explain.decisions.EXCLUDE`.
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
        :func:`jremat.explain_applied` is given ``layers``).
      baseline_runs: runs without remat, likewise.
    """

    name: str
    kind: str
    runs: float
    baseline_runs: float


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What a policy did to a function (see :func:`jremat.explain`).

    Attributes:
      policy: the policy's spec.
      function: the function's name.
      checkpoints: how many checkpoints the rematerialized trace contains.
      decisions: one :class:`jremat._explain.decisions.Decision` per (decision, place).
      names: one :class:`NameMatch` per name the policy mentions.
      names_found: every ``checkpoint_name`` tag in the traced function, in first-seen order.
      saved_bytes: residuals the forward pass computes for the backward pass, with the policy, on
        one device (:attr:`jremat.ResidualsReport.computed_device_bytes`: each residual's shard on
        a mesh; off a mesh the whole value); ``None`` when not measured.
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
        a kernel inside a scan counts once; per layer where :func:`jremat.explain_applied` is given
        ``layers``); ``None`` when not measured.
      baseline_attention_forward_passes: the same without remat.
      stack_depth: :func:`jremat.explain` on a block whose output has the structure, shapes and dtypes
        of one positional argument: how many copies of it ran in sequence, the output of each
        fed to the next as that argument (``None``: not measured, the block does not chain).
      stack_argnum: the positional argument the output was fed back as.
      stack_temp_bytes: XLA's compiled temp bytes of that stack's gradient, each copy
        checkpointed under the policy: the block's saving as it is used, in a stack.
      baseline_stack_temp_bytes: the same stack without remat.
      collectives: the collectives the compiled gradient issues with the policy, per device
        (:func:`jremat.collectives_report`; empty on one device); ``None``: not compiled.
      baseline_collectives: the same without remat.
      devices: the devices the arguments' shardings span; on a mesh the residuals, the compiled
        temp and the collectives are per device, the decision and name bytes global (traced,
        unsharded values).
      kernel_runs: every kernel the value-and-gradient runs (a ``pallas_call``, an FFI call, a
        ``custom_vjp`` kernel: :mod:`jremat.kernels`), with the policy and without remat; a kernel
        run more often than without remat also gets a message naming how to keep it.
      global_saved_bytes: :attr:`saved_bytes` of all devices together (the unsharded values,
        :attr:`jremat.ResidualsReport.computed_bytes`); equal to it off a mesh.
      baseline_global_saved_bytes: the same without remat.
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
    attention_forward_passes: float | None = None
    baseline_attention_forward_passes: float | None = None
    stack_depth: int | None = None
    stack_argnum: int | None = None
    stack_temp_bytes: int | None = None
    baseline_stack_temp_bytes: int | None = None
    collectives: _collectives.CollectivesReport | None = None
    baseline_collectives: _collectives.CollectivesReport | None = None
    devices: int = 1
    kernel_runs: tuple[KernelRuns, ...] = ()
    global_saved_bytes: int | None = None
    baseline_global_saved_bytes: int | None = None

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
            per = f" per iteration, x{d.iterations} = {format_bytes(d.total_bytes)}" if d.iterations > 1 else ""
            tagged = f"  [names: {', '.join(d.names)}]" if d.names else ""
            lines.append(f"  {d.decision:<9} {d.count:>5} values {format_bytes(d.bytes):>11}{per}  {d.where}{tagged}")
        for m in self.names:
            lines.append(f"  name {m.role} {m.name!r}: {m.count} values, {format_bytes(m.bytes)}")
        lines.extend(f"  matched: {line}" for line in self.matched)
        mesh = self.devices > 1
        if mesh:
            lines.append(
                f"  on {self.devices} devices: residuals, compiled temp and collectives are per device; the "
                "values of the decisions and names are global (all devices together, unsharded)"
            )
        if self.saved_bytes is not None:
            lines.append(
                f"  residuals for the backward pass{' per device' if mesh else ''}: "
                f"{format_bytes(self.baseline_saved_bytes)} without remat, "
                f"{format_bytes(self.saved_bytes)} with the policy"
                + (
                    f" (global {format_bytes(self.baseline_global_saved_bytes)} and "
                    f"{format_bytes(self.global_saved_bytes)})"
                    if mesh and self.global_saved_bytes is not None
                    else ""
                )
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
                f"{format_bytes(self.baseline_temp_bytes)} without remat, "
                f"{format_bytes(self.temp_bytes)} with the policy"
            )
        if self.stack_temp_bytes is not None:
            lines.append(
                f"  compiled temp of the gradient of {self.stack_depth} in sequence (output fed back as argument "
                f"{self.stack_argnum}): {format_bytes(self.baseline_stack_temp_bytes)} without remat, "
                f"{format_bytes(self.stack_temp_bytes)} with the policy on each"
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


__all__ = ["Explanation", "KernelRuns", "NameMatch"]
