"""The fit search on the reference GPT: the policy and batch that train fastest in a memory budget.

:class:`GPTStepBuilder` gives :func:`jremat.fit_search` the train step that ``train.ptb`` runs
(AdamW with clipping under ``optax.MultiSteps``, parameters and optimizer state donated) for a
policy label, a micro-batch size and a micro-batch count. Labels are policy specs, and
``auto:budget=N`` for the budget planner's plan at that batch (:mod:`train.planning`), so what
the search measured is exactly what trains. ``train.memory --fit`` prints and plots the search;
``train.ptb --batch-size auto`` trains with its winner.

On a mesh (``GPTStepBuilder(..., mesh=...)``) the step is ``train.ptb``'s sharded train step
(:func:`train.sharded_steps.abstract_train_step`); the batch the search chooses is per
data-parallel shard (the global batch is that times the ``data x fsdp`` devices), peaks and the
budget are per device, the collectives are priced on the mesh and, under ``fsdp``, the policies'
``keep_gathered=true`` variants are candidates (:func:`jremat.fit_search`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

from jax.sharding import Mesh

import jremat
from jremat import registry
from jremat.fit import compile_figures
from jremat.models import ModelConfig
from jremat.train import sharded_steps, sharding
from jremat.train.planning import keep_gathered_of, plan_for_budget
from jremat.train.programs import adam_train_step
from jremat.train.step import OptimizerConfig, make_train_step

#: The built-in policies searched by default, in tie order.
FIT_POLICIES = ("none", "full", "every_k:k=2", "selective", "dots", "dots_no_batch")

#: The optimizer of a search run outside ``train.ptb`` (``train.ptb``'s defaults; the rates do
#: not change memory or time).
SEARCH_OPTIMIZER = OptimizerConfig(lr=3e-3, warmup_steps=0, total_steps=1, clip=1.0, weight_decay=0.01, accum=1)


def auto_label(budget_bytes: int) -> str:
    """The label of the budget planner's plan for ``budget_bytes``."""
    return f"auto:budget={budget_bytes}"


class GPTStepBuilder:
    """``(policy, batch_size, micro_batches) -> jremat.FitStep`` for the GPT's train step.

    Args:
      model_config: a policy spec -> the :class:`ModelConfig` under it (the CLI's mapping, which
        sets the head chunks per policy).
      seq_len: tokens per sequence.
      optimizer: the optimizer; its ``accum`` is replaced by the micro-batch count.
      mesh: a device mesh (:func:`train.sharding.make_mesh`): build the sharded train step, with
        ``batch_size`` sequences per data-parallel shard; ``None``: one device.
    """

    def __init__(
        self,
        model_config: Callable[[str], ModelConfig],
        seq_len: int,
        optimizer: OptimizerConfig,
        mesh: Mesh | None = None,
    ):
        self.model_config = model_config
        self.seq_len = seq_len
        self.optimizer = optimizer
        self.mesh = mesh
        #: Sequences of the global batch per sequence of ``batch_size`` (the data-parallel shards).
        self.data_shards = 1 if mesh is None else sharding.data_parallel_size(mesh)
        self._configs: dict[tuple, ModelConfig | None] = {}
        self._steps: dict[tuple, jremat.FitStep] = {}
        self.layer_plans: dict[tuple, jremat.LayerPlan] = {}

    def step(self, cfg: ModelConfig, batch_size: int, micro_batches: int) -> jremat.FitStep:
        """The jitted train step of ``cfg`` and its abstract arguments (one object per config and
        shape, so that a compile the planner made is the search's too). Its program is the
        config: one config at several batches is one candidate."""
        key = (cfg, batch_size, micro_batches)
        if key not in self._steps:
            tx = dataclasses.replace(self.optimizer, accum=micro_batches).build()
            if self.mesh is None:
                _, graphdef, tx, args = adam_train_step(cfg, batch_size, self.seq_len, tx=tx)
                step = make_train_step(graphdef, tx)
            else:
                step, args = sharded_steps.abstract_train_step(
                    cfg, self.mesh, batch_size * self.data_shards, self.seq_len, tx
                )
            program = hashlib.sha1(repr(cfg).encode()).hexdigest()[:12]
            fit_step = jremat.FitStep(step, args, carry=(0, 1), program=f"config {program}")
            self._steps.setdefault(key, fit_step)
        return self._steps[key]

    def peak_bytes(self, cfg: ModelConfig, batch_size: int, micro_batches: int) -> int:
        """The compiled peak of ``cfg``'s train step (kept with the step): the auto planner's measurement."""
        return compile_figures(self.step(cfg, batch_size, micro_batches))[0]

    def config(self, policy: str, batch_size: int, micro_batches: int) -> ModelConfig | None:
        """The model config of a label at a batch; ``None`` when an ``auto`` budget has no plan there."""
        key = (policy, batch_size, micro_batches)
        if key not in self._configs:
            name, values = registry.parse_spec(policy)
            if name != "auto":
                self._configs[key] = self.model_config(policy)
            else:
                base = self.model_config("auto")
                try:
                    plan = plan_for_budget(
                        base,
                        batch_size * self.data_shards,
                        values["budget"],
                        self.seq_len,
                        measure_peak_bytes=lambda c: self.peak_bytes(c, batch_size, micro_batches),
                        keep_gathered=keep_gathered_of(values),
                        **self._mesh_plan_options(),
                    )
                except ValueError:  # no plan fits this batch
                    self._configs[key] = None
                else:
                    self.layer_plans[key] = plan
                    self._configs[key] = plan.config
        return self._configs[key]

    def _mesh_plan_options(self) -> dict:
        """On a mesh: no offloading, re-gathering priced (:func:`train.sharded_steps.regather_price`, once)."""
        if self.mesh is None:
            return {}
        if not hasattr(self, "_regather_flops"):  # threads racing here share one cached measurement
            self._regather_flops = sharded_steps.regather_price(self.model_config("none"), self.mesh)[1]
        return {"offload": False, "regather_flops": self._regather_flops}

    def describe(self, policy: str, batch_size: int, micro_batches: int) -> str:
        """The label, and for an ``auto`` layer plan what it keeps."""
        plan = self.layer_plans.get((policy, batch_size, micro_batches))
        return policy if plan is None else f"{policy} = {plan.candidate.describe(plan.n_layers)}"

    def __call__(self, policy: str, batch_size: int, micro_batches: int) -> jremat.FitStep | None:
        cfg = self.config(policy, batch_size, micro_batches)
        return None if cfg is None else self.step(cfg, batch_size, micro_batches)


#: Batches this close (a fraction of the larger) get one ``auto`` plan, at the larger: a plan a
#: few percent of batch apart is not worth its compiles.
PLAN_BATCH_TOLERANCE = 0.03


def auto_candidates(budget_bytes: int, searched) -> list[tuple[str, int, int]]:
    """The ``auto`` candidates (the planner's layer plan) at each batch where a searched policy ended above ``none``'s largest
    fitting batch (at or below it, the plan is ``none``, already a candidate), one per group of
    batches within :data:`PLAN_BATCH_TOLERANCE` of the group's largest."""
    none_batch = max((p.batch_size for p in searched if p.policy == "none"), default=0)
    shapes = sorted({(p.batch_size, p.micro_batches) for p in searched if p.batch_size > none_batch}, reverse=True)
    kept: list[tuple[int, int]] = []
    for batch, micro in shapes:
        if not any(m == micro and b - batch <= b * PLAN_BATCH_TOLERANCE for b, m in kept):
            kept.append((batch, micro))
    return [(auto_label(budget_bytes), batch, micro) for batch, micro in sorted(kept)]


def tqdm_progress(enabled: bool, label: str = "fit search") -> tuple[Callable[[str], None], Callable[[], None]]:
    """``(progress, close)``: a tqdm counter of the search's compiles and timed rounds on stderr
    (when ``enabled`` and stderr is a terminal)."""
    from tqdm import tqdm

    bar = tqdm(desc=label, unit=" step", disable=None if enabled else True, leave=False)  # None: off unless a TTY

    def progress(message: str) -> None:
        bar.set_postfix_str(message, refresh=False)
        bar.update(1)

    return progress, bar.close


def search(
    builder: GPTStepBuilder,
    budgets: Sequence[int],
    policies: Sequence[str],
    *,
    auto: bool,
    global_batch: int | None = None,
    finalists: int = 3,
    rounds: int = 3,
    max_batch_size: int = 4096,
    progress: bool = True,
) -> list[jremat.FitResult]:
    """:func:`jremat.fit_search_budgets` of the GPT's train step (``auto`` adds the planner's layer plans).

    ``global_batch`` counts the sequences of the whole mesh (the builder's batches are per
    data-parallel shard).

    Raises:
      jremat.FitError: nothing fits a budget (the message gives the smallest peak found), or a
        global batch that does not split over the data-parallel shards.
    """
    if global_batch is not None and global_batch % builder.data_shards:
        raise jremat.FitError(
            f"global batch {global_batch} does not split over the mesh's {builder.data_shards} data-parallel shards "
            f"(data x fsdp); use a multiple of {builder.data_shards}"
        )
    shard_batch = None if global_batch is None else global_batch // builder.data_shards
    report, close = tqdm_progress(progress)
    try:
        return jremat.fit_search_budgets(
            builder,
            policies,
            budgets,
            extra_candidates=auto_candidates if auto else None,
            global_batch=shard_batch,
            tokens_per_example=builder.seq_len * builder.data_shards,
            max_batch_size=max_batch_size,
            finalists=finalists,
            rounds=rounds,
            dtype=builder.model_config("none").dtype,
            progress=report,
        )
    finally:
        close()


def format_result(result: jremat.FitResult, builder: GPTStepBuilder) -> str:
    """:meth:`jremat.FitResult.table`, then what each ``auto`` row's plan keeps (and on a mesh, what a batch is)."""
    lines = [result.table()]
    if builder.mesh is not None:
        lines.append(
            f"  mesh {sharding.format_mesh(builder.mesh)}: batch (and a global batch) = sequences per data-parallel shard "
            f"(global batch = batch x {builder.data_shards}); tokens/s of the global batch"
        )
    for r in result.rows:
        described = builder.describe(*r.probe.key)
        if described != r.probe.policy:
            lines.append(f"  {r.probe.policy} at batch {r.probe.batch_size}: {described.split(' = ', 1)[1]}")
    return "\n".join(lines)


def write_pareto_plot(result: jremat.FitResult, path: str) -> None:
    """A PNG of compiled peak vs tokens/s: every candidate (predicted, hollow; measured, filled),
    the measured Pareto front, the budget and the winner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result.rows:
        p = r.probe
        ax.scatter(p.peak_bytes / mib, r.predicted_tokens_per_s, facecolors="none", edgecolors="0.5", s=30)
        label = f"{p.policy.split(':budget=')[0]} b={p.batch_size}" + (
            f"x{p.micro_batches}" if p.micro_batches > 1 else ""
        )
        if r.tokens_per_s is not None:
            ax.scatter(p.peak_bytes / mib, r.tokens_per_s, color="C0", s=36, zorder=3)
            ax.annotate(
                label, (p.peak_bytes / mib, r.tokens_per_s), fontsize=7, xytext=(4, 3), textcoords="offset points"
            )
    measured = sorted((r.probe.peak_bytes, r.tokens_per_s) for r in result.rows if r.tokens_per_s is not None)
    front, best = [], 0.0
    for peak, tps in measured:
        if tps > best:
            front.append((peak / mib, tps))
            best = tps
    if front:
        ax.step(*zip(*front), where="post", color="C0", label="measured Pareto front")
    w = result.winner
    ax.scatter(w.probe.peak_bytes / mib, w.tokens_per_s, marker="*", s=200, color="C3", zorder=4, label="winner")
    ax.axvline(result.budget_bytes / mib, color="C3", linestyle="--", linewidth=1, label="budget")
    ax.scatter([], [], facecolors="none", edgecolors="0.5", label="predicted (time model)")
    ax.set_xlabel("compiled peak (MiB)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"fit search, budget {jremat.format_bytes(result.budget_bytes)}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "FIT_POLICIES",
    "GPTStepBuilder",
    "SEARCH_OPTIMIZER",
    "auto_candidates",
    "auto_label",
    "format_result",
    "search",
    "tqdm_progress",
    "write_pareto_plot",
]
