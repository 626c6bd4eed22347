"""``python -m train.memory``: compile-only memory report of the GPT's gradient step, one row per policy.

``python -m train.memory --preset gpt2-small --batch-size 8 --dtype bfloat16 --policy none
--policy full --policy every_k:k=4 --policy selective`` compiles ``jremat.jit(jax.grad(loss))`` of
the GPT model for each policy (nothing is executed: parameters and tokens are shapes only) and
prints peak and temp bytes, saved activation bytes per layer, ratios to ``none`` and the
policy's recompute FLOPs as a fraction of the step's FLOPs.

The measurement is :func:`models.policy_memory.compare_policies` (its fields are documented on
:class:`models.policy_memory.PolicyMemory`); this module holds the command line: its
configuration, the table, JSON and plot output, and ``--live`` (one fresh process per policy).
"""

from __future__ import annotations

if __name__ == "__main__":  # the CLI: Ctrl-C and SIGTERM end it at once, from before JAX is imported
    from jremat.train.usage import exit_without_train_extra

    exit_without_train_extra("train.memory")  # one error line on a core install, before any import fails
    from jremat.train.interrupts import INTERRUPTS

    INTERRUPTS.install()

import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence

import jremat
from jremat import parse_budget, registry
from jremat.models import PRESETS, ModelConfig
from jremat.models import preset as model_preset
from jremat.models.config import whole_step_head_chunks
from jremat.train import cli, interrupts, model_flags
from jremat.train.cli import (
    UsageError,
    apply_policy_keys,
    check_mesh_flag,
    option,
    require,
    require_choice,
    require_int,
    require_one_budget,
)
from jremat.train.usage import program_name

#: Parameters larger than this are refused up front: the report is of one device's step, and no
#: device holds a model this size (building one would take hours of Python before any compile).
MAX_PARAMETER_BYTES = 1 << 40

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryConfig(model_flags.ModelFlags):
    """What ``python -m train.memory`` measures; one field per command-line flag (``a_b`` <-> ``--a-b``).

    The model flags are :class:`train.model_flags.ModelFlags`'.

    ``policy_keys`` collects the per-policy-key flags (``--k 4``); each applies to every
    ``--policy`` that takes the key. Model overrides left ``None`` keep the preset's value.
    """

    batch_size: int = option(8, "sequences per batch")
    policy: tuple[str, ...] = option(
        (),
        "policy spec NAME or NAME:key=value, one report row each (default none and full; with --fit, the "
        "built-ins of train.fit.FIT_POLICIES and auto's plans)",
        metavar="SPEC",
    )
    policy_keys: tuple = option((), "policy keys given as separate flags, as (key, raw value) pairs", cli=False)
    layers: int | None = option(None, "override the number of layers")
    d_model: int | None = option(None, "override d_model")
    d_ff: int | None = option(None, "override the MLP width")
    heads: int | None = option(None, "override the head count (head_dim = d_model / heads unless --head-dim)")
    head_dim: int | None = option(None, "override head_dim")
    policy_module: tuple[str, ...] = option((), "import a module that registers policies", metavar="MODULE")
    json: bool = option(False, "print a JSON list, one object per policy")
    plot: str | None = option(
        None,
        "write a bar chart (PNG) of peak and saved bytes per policy; with --fit, the measured Pareto front of peak vs tokens/s",
        metavar="PNG",
    )
    memory_budget: str | None = option(
        None,
        "budget for --policy auto: 6GiB, 512MiB, bytes, or a fraction in (0, 1] (of none's peak above full's); "
        "for --fit, a size",
    )
    fit: bool = option(
        False,
        "search the policy and batch with the highest measured tokens/s whose compiled train step fits "
        "--memory-budget (a size): compile-only batch search, then the best few timed here (jremat.fit_search); "
        "--batch-size is not used",
    )
    global_batch: int | None = option(
        None, "with --fit: fix the sequences per optimizer step; choose the micro-batches"
    )
    finalists: int = option(3, "with --fit: how many candidates are timed")
    mesh: str | None = option(
        None,
        "device mesh AXIS=SIZE,... over data, fsdp, tensor, sequence, as train.ptb's --mesh: compile the sharded "
        "gradient step per policy and report per-device peak and temp and its collectives (count and bytes per "
        "device, and what each policy re-issues beside none); with --fit, search the sharded train step against a "
        "per-device budget, batches per data-parallel shard",
    )
    live: bool = option(
        False, "also run one step per policy (a fresh process each) and report the allocator's peak (GPU/TPU)"
    )
    live_child: bool = option(False, "measure the first policy's live peak here and print it as JSON", hidden=True)
    timeline: str | None = option(
        None,
        "write live bytes over the compiled schedule per policy (peaks marked, top-10 buffers at each peak) "
        "to this PNG file, and print the top-10 tables",
        metavar="PNG",
    )

    def __post_init__(self):
        self.check_arguments()
        for flag, path in (("--timeline", self.timeline), ("--plot", self.plot)):
            problem = None if path is None else timeline_plot.png_path_problem(path)
            if problem:
                raise UsageError(f"{flag} {path!r}: {problem}")
        if not self.policy:
            object.__setattr__(self, "policy", (*fit_lib.FIT_POLICIES, "auto") if self.fit else ("none", "full"))
        self._check_policies()

    def check_arguments(self) -> None:
        """Check every value that needs no policy and no model, as ``TrainConfig.check_arguments`` does
        (JAX only to ask for a GPU kernel's device); raises :class:`UsageError`."""
        require_choice("preset", self.preset, tuple(PRESETS))
        if self.mesh is not None:
            self._check_mesh()
        for field in ("batch_size", "seq_len", "layers", "d_model", "d_ff", "heads", "head_dim"):
            if getattr(self, field) is not None:
                require_int(field, getattr(self, field))
        self.check_model_flags()
        if self.memory_budget is not None:
            try:
                parse_budget(self.memory_budget)
            except ValueError as err:
                raise UsageError(str(err)) from None
        if self.fit:
            require(self.memory_budget is not None, "--fit needs --memory-budget, a size such as 12GiB")
            require(
                parse_budget(self.memory_budget).bytes is not None,
                f"--fit needs --memory-budget as a size (12GiB, 512MiB or bytes), not the fraction "
                f"{self.memory_budget!r}: the batch is chosen, so there is no single no-remat peak to take a share of",
            )
            require(not (self.live or self.timeline), "--fit does not combine with --live or --timeline")
            require_int("finalists", self.finalists)
        else:
            require(self.global_batch is None, "--global-batch applies only with --fit")
        if self.global_batch is not None:
            require_int("global_batch", self.global_batch)
        if self.heads is not None and self.head_dim is None:
            d_model = self.d_model if self.d_model is not None else PRESETS[self.preset].d_model
            require(
                d_model % self.heads == 0,
                f"--heads {self.heads} does not divide d_model {d_model}; give --head-dim or "
                "a head count that divides d_model",
            )
        model_flags.check(self, self.seq_len)
        if self.remat_head_chunks is not None:  # derived from the model flags: checked after them
            require_int("remat_head_chunks", self.remat_head_chunks, minimum=0)
            require(
                not self.remat_head_chunks or self.resolved_seq_len % self.remat_head_chunks == 0,
                f"--remat-head-chunks {self.remat_head_chunks} does not divide the sequence length "
                f"{self.resolved_seq_len}",
            )
        model_flags.check_backend(self.attention, self.resolved_head_dim)  # JAX only for a GPU kernel (cudnn, pallas)

    def _check_policies(self) -> None:
        """The checks that load the policies (and JAX): the specs and keys, the budget's policy, the model's size."""
        for module in self.policy_module:
            try:
                registry.load_module(module)
            except ValueError as err:
                raise UsageError(f"bad --policy-module: {err}") from None
        object.__setattr__(self, "policy", apply_policy_keys(self.policy, self.policy_keys))
        object.__setattr__(self, "policy_keys", ())
        if self.memory_budget is not None and not self.live_child:  # a live child gets the parent's flags
            require(
                self.fit or any(registry.parse_spec(s)[0] == "auto" for s in self.policy),
                "--memory-budget applies only to --policy auto or --fit, not to --policy "
                + ", ".join(repr(s) for s in self.policy),
            )
            require_one_budget(self.policy, self.memory_budget, "--fit" if self.fit else None)
        model_bytes = self.model_config("none").parameter_bytes()
        require(
            model_bytes <= MAX_PARAMETER_BYTES,
            f"the model is too large: its parameters alone take {format_bytes(model_bytes)}, more than "
            f"{format_bytes(MAX_PARAMETER_BYTES)}, and this report is for one device (the largest hold under "
            "300 GiB); choose fewer --layers or a smaller --d-model / --d-ff / --max-seq-len",
        )

    def _check_mesh(self) -> None:
        """``--mesh``: its syntax, the batch split, and the flags it does not combine with.

        Raises:
          UsageError: on a bad mesh, a batch (``--batch-size``, or with ``--fit`` ``--global-batch``)
            that does not split, or ``--live`` / ``--timeline``.
        """
        for flag, given in (("--live", self.live), ("--timeline", self.timeline)):
            require(not given, f"{flag} measures one device: drop --mesh or {flag}")
        if self.fit:  # --fit chooses the batch per data-parallel shard; a --global-batch must split
            check_mesh_flag(self.mesh, None, self.seq_len)
            if self.global_batch is not None:
                try:
                    check_mesh_flag(self.mesh, self.global_batch, None)
                except UsageError as err:
                    raise UsageError(str(err).replace("--batch-size", "--global-batch")) from None
        else:
            check_mesh_flag(self.mesh, self.batch_size, self.seq_len)

    def model_config(self, policy: str) -> ModelConfig:
        """The :class:`ModelConfig` for one policy spec, with every override applied.

        Raises:
          UsageError: if the policy spec or the resulting model shape is invalid.
        """
        overrides: dict = {"remat_policy": policy}
        if self.dtype is not None:
            overrides["dtype"] = self.dtype
        if self.layers is not None:
            overrides["n_layers"] = self.layers
        if self.d_model is not None:
            overrides["d_model"] = self.d_model
        if self.d_ff is not None:
            overrides["d_ff"] = self.d_ff
        if self.heads is not None:
            overrides["n_heads"] = self.heads
            overrides["head_dim"] = self.resolved_head_dim
        elif self.head_dim is not None:
            overrides["head_dim"] = self.head_dim
        if self.dropout is not None:
            overrides["attn_dropout"] = overrides["resid_dropout"] = self.dropout
        if self.granularity is not None:
            overrides["remat_granularity"] = self.granularity
        if self.unrolled:
            overrides["scan_layers"] = False
        overrides.update(model_flags.model_overrides(self))
        overrides["remat_head_chunks"] = (
            self.remat_head_chunks
            if self.remat_head_chunks is not None
            else whole_step_head_chunks(policy, self.resolved_seq_len)
        )
        try:
            return model_preset(self.preset, **overrides)
        except ValueError as err:
            raise UsageError(str(err)) from None

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim``, else ``d_model / heads`` when ``heads`` is given, else the preset's."""
        if self.head_dim is not None:
            return self.head_dim
        if self.heads is not None:
            return (self.d_model if self.d_model is not None else PRESETS[self.preset].d_model) // self.heads
        return PRESETS[self.preset].head_dim

    @property
    def resolved_seq_len(self) -> int:
        """``seq_len``, or the preset's ``max_seq_len`` when unset."""
        return self.seq_len if self.seq_len is not None else model_flags.positions(self)

    def model_argv(self) -> list[str]:
        """The flags that rebuild this config's model and budget (not its policies or outputs)."""
        argv = []
        for field in (
            "preset",
            "batch_size",
            "seq_len",
            "dtype",
            "layers",
            "d_model",
            "d_ff",
            "heads",
            "head_dim",
            "dropout",
            "attention",
            "attention_block_size",
            "max_seq_len",
            "granularity",
            "remat_head_chunks",
            "memory_budget",
        ):
            value = getattr(self, field)
            if value is not None:
                argv += [f"--{field.replace('_', '-')}", str(value)]
        for module in self.policy_module:
            argv += ["--policy-module", module]
        return argv + (["--unrolled"] if self.unrolled else [])


if __name__ == "__main__":  # argument mistakes are reported before JAX is imported (below)
    cli.exit_on_argument_error(MemoryConfig, "train.memory")

from jremat import allocator_stats_missing, format_bytes
from jremat.models.policy_memory import (
    NONE_DEFINITION,
    RECOMPUTE_DEFINITION,
    PolicyMemory,
    compare_policies,
    config_for_spec,
    format_recompute,
    head_label,
    live_step_memory,
    ratio,
)
from jremat.train import fit as fit_lib
from jremat.train import timeline_plot

# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def format_table(rows: Sequence[PolicyMemory], base: PolicyMemory) -> str:
    """The human-readable table: one line per policy, then notes."""
    live = any(r.live_peak_bytes is not None for r in rows)
    fused = any(r.attention_forward_passes for r in rows)
    header = (
        f"{'policy':<24} {'head':>9} {'peak':>11} {'temp':>11} {'saved/layer':>12} {'peak/none':>9} "
        f"{'saved/none':>10} {'recompute':>9} {'work set':>11} {'analytic':>11} {'anal.err':>8}"
        + (f" {'attn fwd':>8}" if fused else "")
        + (f" {'live peak':>11}" if live else "")
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        pr = ratio(r.peak_bytes, base.peak_bytes)
        sr = ratio(r.saved_bytes_per_layer, base.saved_bytes_per_layer)
        err = (
            ratio(r.analytic_peak_bytes - r.peak_bytes, r.peak_bytes)
            if r.peak_bytes and r.analytic_peak_bytes
            else None
        )
        lines.append(
            f"{r.policy:<24} {head_label(r.head_chunks):>9} {format_bytes(r.peak_bytes):>11} "
            f"{format_bytes(r.temp_bytes):>11} {format_bytes(r.saved_bytes_per_layer):>12} "
            f"{f'{pr:.3f}' if pr is not None else 'n/a':>9} {f'{sr:.3f}' if sr is not None else 'n/a':>10} "
            f"{format_recompute(r.recompute_flops_fraction):>9} "
            f"{format_bytes(r.working_set_bytes):>11} {format_bytes(r.analytic_peak_bytes):>11} "
            f"{f'{100 * err:+.1f}%' if err is not None else 'n/a':>8}"
            + (f" {r.attention_forward_passes:>8g}" if fused else "")
            + (f" {format_bytes(r.live_peak_bytes):>11}" if live else "")
        )
    first = rows[0]
    lines.append(
        f"gradient step of {first.n_layers} layers, batch {first.batch_size} x seq {first.seq_len}; "
        f"peak from: {first.peak_source}; {NONE_DEFINITION}; {RECOMPUTE_DEFINITION} ({base.step_flops:.3g}); "
        "head = the final LayerNorm, head and loss: whole, or recomputed over N sequence chunks"
        + "; work set = the backward pass's transient buffers at its peak, compiled on a copy with at most "
        "two layers per layer group (nested or unrolled stacks: the whole model); "
        "analytic = traced residuals, parameters and gradients at full depth + work set"
        + ("; attn fwd = fused attention forward passes per layer (1: not recomputed)" if fused else "")
    )
    seen = set()
    for r in rows:
        for n in r.notes:
            key = (r.policy, n) if "saved residuals fell" in n else n
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"note [{r.policy}]: {n}" if "saved residuals fell" in n else f"note: {n}")
    return "\n".join(lines)


def format_explanations(rows: Sequence[PolicyMemory]) -> str:
    """The explain section: per policy, its decisions, the names it matched and any problem, one line each."""
    parts = [r.explanation.text() for r in rows if r.explanation is not None]
    return "\n".join(["", "explain (what each policy did to the step; jremat.explain):", *parts]) if parts else ""


def write_plot(rows: Sequence[PolicyMemory], path: str) -> None:
    """Write a bar chart of peak bytes and saved bytes (whole step) per policy to ``path`` (PNG).

    Raises:
      UsageError: if the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.policy for r in rows]
    mib = 2**20
    xs = range(len(rows))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(rows)), 4.0))
    ax.bar([x - width / 2 for x in xs], [(r.peak_bytes or 0) / mib for r in rows], width, label="compiled peak")
    ax.bar([x + width / 2 for x in xs], [r.saved_bytes / mib for r in rows], width, label="saved activations")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel("MiB")
    first = rows[0]
    ax.set_title(f"gradient step memory, {first.n_layers} layers, batch {first.batch_size} x {first.seq_len}")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as err:
        raise UsageError(f"cannot write plot {path!r}: {err}") from None
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Live peaks
# ---------------------------------------------------------------------------------------------


def _allocator_stats_note() -> str | None:
    missing = allocator_stats_missing()
    return (
        None if missing is None else f"live: {missing}; --live needs a GPU or TPU, so only compiled figures are shown"
    )


def _run_live_child(config: MemoryConfig, spec: str) -> int | None:
    """The live peak of ``spec``, measured in a fresh Python process (``None`` if it failed)."""
    argv = [sys.executable, "-m", "jremat.train.memory", *config.model_argv(), "--policy", spec, "--live-child"]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    interrupts.INTERRUPTS.before_exit(child.kill)  # a signal that ends this process ends the child too
    try:
        out, _ = child.communicate()
    finally:
        interrupts.INTERRUPTS.forget(child.kill)
    lines = out.strip().splitlines()
    if child.returncode != 0 or not lines:
        return None
    return json.loads(lines[-1]).get("live_peak_bytes")


def add_live_peaks(config: MemoryConfig, rows: Sequence[PolicyMemory]) -> tuple[list[PolicyMemory], str | None]:
    """Fill :attr:`PolicyMemory.live_peak_bytes` of every row, one fresh process per policy.

    Returns:
      ``(rows, note)``: the rows, and a note when live figures could not be taken.
    """
    note = _allocator_stats_note()
    if note is not None:
        return list(rows), note
    specs = list(dict.fromkeys(config.policy))  # one row per distinct spec, as compare_policies
    peaks = [_run_live_child(config, spec) for spec in specs]
    failed = [spec for spec, peak in zip(specs, peaks) if peak is None]
    rows = [dataclasses.replace(r, live_peak_bytes=peak) for r, peak in zip(rows, peaks)]
    return rows, (f"live: the measurement failed for {', '.join(failed)}" if failed else None)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_config(argv: Sequence[str] | None) -> MemoryConfig:
    """Parse command-line flags into a :class:`MemoryConfig` (see :func:`train.cli.parse`).

    Raises:
      UsageError: on any bad flag or value.
      SystemExit: ``--help`` (code 0).
    """
    return cli.parse(
        MemoryConfig,
        argv,
        prog=program_name("train.memory"),
        description="Compile-only memory report of the GPT gradient step, one row per remat policy.",
        epilog="registered policies:\n" + registry.describe(),
    )


def run(config: MemoryConfig) -> tuple[list[PolicyMemory], PolicyMemory]:
    """Measure every policy of ``config``; returns the rows and the ``none`` baseline.

    Raises:
      UsageError: on an invalid model shape or policy.
    """
    base_cfg = config.model_config(config.policy[0])
    for spec in config.policy[1:]:
        config.model_config(spec)
    specs = list(dict.fromkeys(config.policy))
    print(
        f"compiling the gradient step under {len(specs)} {'policy' if len(specs) == 1 else 'policies'} ({', '.join(specs)})...",
        file=sys.stderr,
    )
    try:
        return compare_policies(
            base_cfg,
            config.batch_size,
            config.policy,
            config.resolved_seq_len,
            memory_budget=config.memory_budget,
            timeline=config.timeline is not None,
            explain=True,
            whole_step=config.remat_head_chunks is None,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def run_mesh(config: MemoryConfig) -> list[tuple[str, object]]:
    """``--mesh``: ``(policy, sharded_steps.DeviceMemory)`` per policy, compiled on the mesh (nothing runs).

    Raises:
      UsageError: on a mesh that does not fit the devices, or a batch or sequence that does not split.
    """
    from jremat.train import sharded_steps, sharding

    try:
        mesh = sharding.mesh_from_flag(config.mesh)
    except ValueError as err:
        raise UsageError(f"--mesh: {err}") from None
    specs = list(dict.fromkeys(config.policy))
    print(
        f"compiling the sharded gradient step under {len(specs)} polic{'y' if len(specs) == 1 else 'ies'} on --mesh {config.mesh}...",
        file=sys.stderr,
    )
    compiled: dict = {}

    def step_memory(model_cfg):
        if model_cfg not in compiled:
            compiled[model_cfg] = sharded_steps.sharded_step_memory(
                model_cfg, mesh, config.batch_size, config.resolved_seq_len
            )
        return compiled[model_cfg]

    rows = []
    for spec in specs:
        try:
            if registry.parse_spec(spec)[0] == "auto":
                plan, gathered, regather = mesh_auto_plan(config, spec, mesh, step_memory)
                rows.append((f"auto: {plan.candidate.describe(plan.n_layers)}", step_memory(plan.config)))
                priced = (
                    f"; re-gathering a layer's weights ({gathered:,} B per device) priced at {regather:,.0f} "
                    "FLOP-equivalents, keeping them at their bytes"
                    if gathered
                    else ""
                )
                print(
                    f"auto on mesh {config.mesh}: budget and peaks per device, tensor bytes/layer global (all devices "
                    f"together){priced}\n{plan.table()}",
                    file=sys.stderr,
                )
            else:
                rows.append((spec, step_memory(config.model_config(spec))))
        except ValueError as err:
            raise UsageError(str(err)) from None
    return rows


def mesh_auto_plan(config: MemoryConfig, spec: str, mesh, step_memory) -> tuple[jremat.LayerPlan, int, float]:
    """``(plan, gathered bytes per layer per device, their re-gathering price in FLOP-equivalents)``.

    ``auto`` on a mesh: the least-cost plan whose per-device compiled peak fits the budget (a size
    per device, or a fraction of the way from full's per-device peak to none's); under ``fsdp``,
    re-gathering weights is priced at the all-gather's cost measured on this mesh
    (:func:`jremat.collective_flops_per_byte`) and plans that keep gathered weights are candidates.

    Raises:
      ValueError: on a bad budget, or when no plan fits.
    """
    from jremat.models.planning import plan_for_budget
    from jremat.train import sharded_steps

    base = config.model_config("none")
    gathered, regather = sharded_steps.regather_price(base, mesh)
    budget = config.memory_budget or registry.parse_spec(spec)[1].get("budget", "0.5")
    plan = plan_for_budget(
        base,
        config.batch_size,
        budget,
        config.resolved_seq_len,
        measure_peak_bytes=lambda c: step_memory(c).peak,
        offload=False,
        regather_flops=regather,
    )
    return plan, gathered, regather


def format_mesh_table(rows: Sequence[tuple[str, object]]) -> str:
    """The ``--mesh`` table: per policy, per-device peak and temp, all-gathers and all-reduces (count and
    bytes per device per step), and the collectives it issues beyond ``none``'s (when ``none`` is a row)."""
    base = next((m for spec, m in rows if spec == "none"), None)
    width = max(28, *(len(spec) for spec, _ in rows))
    header = (
        f"{'policy':<{width}} {'peak/device':>12} {'temp/device':>12} {'all-gathers':>18} {'all-reduces':>18} "
        f"{'other':>14}  re-issued beyond none"
    )
    lines = [header, "-" * len(header)]
    for spec, m in rows:
        c = m.collectives
        cells = []
        for kinds in (("all-gather",), ("all-reduce",), ("reduce-scatter", "all-to-all", "collective-permute")):
            n, b = sum(c.count(k) for k in kinds), sum(c.bytes(k) for k in kinds)
            cells.append(f"{n} / {format_bytes(b)}" if n else "0")
        extra = c.reissued(base.collectives) if base is not None else {}
        reissued = ", ".join(
            f"{n:+d} {k} ({'+' if b >= 0 else '-'}{format_bytes(abs(b))})" for k, (n, b) in extra.items()
        ) or ("none" if base is not None else "n/a (no none row)")
        lines.append(
            f"{spec:<{width}} {format_bytes(m.peak):>12} {format_bytes(m.temp):>12} {cells[0]:>18} {cells[1]:>18} "
            f"{cells[2]:>14}  {reissued}"
        )
    first = rows[0][1]
    lines.append(
        f"gradient step on mesh {first.mesh} ({first.devices} devices), compiled only; every figure is per device "
        f"(one device's share of the SPMD program); collectives as count / bytes per step (jremat.collectives_report)"
    )
    return "\n".join(lines)


def mesh_row_json(spec: str, memory) -> dict:
    """One ``--mesh --json`` object: the policy, per-device memory and collectives."""
    out = {k: v for k, v in dataclasses.asdict(memory).items() if k != "collectives"}
    return {"policy": spec, **out, "collectives": memory.collectives.to_json()}


def fit_policies(config: MemoryConfig) -> tuple[list[str], bool]:
    """The policies ``--fit`` searches, and whether ``auto``'s plans join them (``auto`` among them)."""
    auto = [s for s in config.policy if registry.parse_spec(s)[0] == "auto"]
    searched = [s for s in config.policy if s not in auto]
    if not searched:
        raise UsageError(
            "--fit with only --policy auto: add the built-ins to search beside its plans "
            "(--policy none --policy full --policy auto), or give no --policy for the default set"
        )
    return searched, bool(auto)


def run_fit(config: MemoryConfig) -> int:
    """``--fit``: search, print the table (or JSON), write the plot; exit 0, or 2 when nothing fits.

    With ``--mesh``: the sharded train step, a per-device budget and per-device peaks, collectives
    priced on the mesh and ``keep_gathered=true`` variants under ``fsdp`` (:class:`train.fit.GPTStepBuilder`).
    """
    policies, auto = fit_policies(config)
    seq_len = config.resolved_seq_len
    mesh = None
    if config.mesh is not None:
        from jremat.train import sharding

        try:
            mesh = sharding.mesh_from_flag(config.mesh)
        except ValueError as err:
            raise UsageError(f"--mesh: {err}") from None
        print(
            f"fit search on --mesh {config.mesh}: --memory-budget is per device, peaks are per device "
            "(one device's share of the SPMD program), batches per data-parallel shard",
            file=sys.stderr,
        )
    builder = fit_lib.GPTStepBuilder(config.model_config, seq_len, fit_lib.SEARCH_OPTIMIZER, mesh=mesh)
    try:
        (result,) = fit_lib.search(
            builder,
            [parse_budget(config.memory_budget).bytes],
            policies,
            auto=auto,
            global_batch=config.global_batch,
            finalists=config.finalists,
            progress=True,
        )
    except jremat.FitError as err:
        raise UsageError(str(err)) from None
    if config.json:
        out = result.to_json()
        for row in [out["winner"], *out["rows"]]:
            row["plan"] = builder.describe(row["policy"], row["batch_size"], row["micro_batches"])
        if mesh is not None:
            out.update(mesh=config.mesh, per_device=True, data_shards=builder.data_shards)
        print(json.dumps(out, indent=2))
    else:
        print(fit_lib.format_result(result, builder))
    if config.plot:
        fit_lib.write_pareto_plot(result, config.plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 on bad input, with a one-line error on stderr; 130/143
    when interrupted by SIGINT/SIGTERM, at once: nothing is written before the report is complete)."""
    with interrupts.handled():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        config = parse_config(argv)
        if config.live_child:
            spec = config.policy[0]
            cfg, _ = config_for_spec(
                config.model_config(spec),
                spec,
                config.batch_size,
                config.resolved_seq_len,
                config.memory_budget,
                whole_step=config.remat_head_chunks is None,
            )
            live = live_step_memory(cfg, config.batch_size, config.resolved_seq_len)
            print(json.dumps({"live_peak_bytes": live.peak_bytes_in_use if live.available else None}))
            return 0
        if config.fit:
            return run_fit(config)
        if config.mesh is not None:
            mesh_rows = run_mesh(config)
            if config.json:
                print(json.dumps([mesh_row_json(spec, m) for spec, m in mesh_rows], indent=2))
            else:
                print(format_mesh_table(mesh_rows))
            return 0
        rows, base = run(config)
        live_note = None
        if config.live:
            rows, live_note = add_live_peaks(config, rows)
            base = next((r for r in rows if (r.policy, r.head_chunks) == (base.policy, base.head_chunks)), base)
        if live_note:
            print(live_note, file=sys.stderr)
        if config.json:
            print(json.dumps([r.to_json(base, timeline_plot.timeline_json) for r in rows], indent=2))
        else:
            print(format_table(rows, base))
            explained = format_explanations(rows)
            if explained:
                print(explained)
        if config.plot:
            write_plot(rows, config.plot)
        if config.timeline:
            if not config.json:
                print(timeline_plot.format_timelines(rows))
            try:
                timeline_plot.write_timeline_png(rows, config.timeline)
            except OSError as err:
                raise UsageError(f"cannot write --timeline {config.timeline!r}: {err}") from None
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
