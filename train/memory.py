"""``python -m train.memory``: compile-only memory report of the GPT's gradient step, one row per policy.

``python -m train.memory --preset gpt2-small --batch-size 8 --dtype bfloat16 --policy none
--policy full --policy every_k:k=4 --policy selective`` compiles ``jremat.jit(jax.grad(loss))`` of
the GPT model for each policy (nothing is executed: parameters and tokens are shapes only) and
prints peak and temp bytes, saved activation bytes per layer, ratios to ``none`` and the
policy's recompute FLOPs as a fraction of the step's FLOPs.

The measurement is :func:`train.policy_memory.compare_policies` (its fields are documented on
:class:`train.policy_memory.PolicyMemory`); this module holds the command line: its
configuration and what it runs; the table is :mod:`train.memory_table`, ``--live`` :mod:`train.memory_live`,
``--mesh`` :mod:`train.memory_mesh`.
"""

from __future__ import annotations

if __name__ == "__main__":  # the CLI: Ctrl-C and SIGTERM end it at once, from before JAX is imported
    from jremat.train.usage import exit_without_train_extra

    exit_without_train_extra("train.memory")  # one error line on a core install, before any import fails
    from jremat.train.interrupts import INTERRUPTS

    INTERRUPTS.install()

import dataclasses
import json
import sys
from collections.abc import Sequence

import jremat
from jremat import parse_budget, registry
from jremat.models import PRESETS, ModelConfig
from jremat.models import preset as model_preset
from jremat.models.config import whole_step_head_chunks
from jremat.train import cli, interrupts, model_flags
from jremat.train.cli import UsageError, apply_policy_keys, option
from jremat.train.usage import program_name
from jremat.train.value_checks import check_mesh_flag, require, require_choice, require_int, require_one_budget

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
        "device mesh AXIS=SIZE,... over data, fsdp, tensor, sequence (and expert), as train.ptb's --mesh: compile the sharded "
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
        if self.mesh is not None:
            model_flags.check_expert_mesh(self.mesh, self.moe_experts)
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
          UsageError: on a bad mesh, or a batch (``--batch-size``, or with ``--fit`` ``--global-batch``)
            that does not split.
        """
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
            "mesh",
        ):
            value = getattr(self, field)
            if value is not None:
                argv += [f"--{field.replace('_', '-')}", str(value)]
        for module in self.policy_module:
            argv += ["--policy-module", module]
        if self.moe_experts:  # a dense model's MoE flags change nothing
            for field, value in model_flags.moe_overrides(self).items():
                flag = f"--{field.replace('_', '-')}"
                argv += ([flag] if value else []) if isinstance(value, bool) else [flag, str(value)]
        return argv + (["--unrolled"] if self.unrolled else [])


if __name__ == "__main__":  # argument mistakes are reported before JAX is imported (below)
    cli.exit_on_argument_error(MemoryConfig, "train.memory")

from jremat import format_bytes
from jremat.train import fit as fit_lib
from jremat.train import memory_live, memory_mesh, timeline_plot
from jremat.train.memory_table import format_explanations, format_table, write_plot
from jremat.train.policy_memory import PolicyMemory, compare_policies

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
        mesh = memory_mesh.mesh_of(config)
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


def report_mesh(config: MemoryConfig) -> int:
    """``--mesh``: the per-device table (or JSON) of every policy, with ``--live`` its live peaks and with
    ``--timeline`` its timelines (text and PNG), all per device; returns the exit code.

    Raises:
      UsageError: as :func:`train.memory_mesh.run_mesh`, or a timeline file that cannot be written.
    """
    rows = memory_mesh.run_mesh(config)
    if config.live:
        peaks, note = memory_live.live_peaks(config)
        for row, peak in zip(rows, peaks):
            row.live_peak_bytes = peak
        if note:
            print(note, file=sys.stderr)
    if config.json:
        none = memory_mesh.none_collectives(rows)
        print(json.dumps([memory_mesh.mesh_row_json(row, none) for row in rows], indent=2))
    else:
        print(memory_mesh.format_mesh_table(rows))
        if config.timeline:
            print(memory_mesh.format_mesh_timelines(rows))
    if config.timeline:
        write_timeline(config, rows, scope=f", per device on mesh {config.mesh}")
    return 0


def write_timeline(config: MemoryConfig, rows: Sequence, scope: str = "") -> None:
    """Draw the timelines of ``rows`` to ``--timeline`` (``scope`` ends the figure's title).

    Raises:
      UsageError: if the file cannot be written.
    """
    try:
        timeline_plot.write_timeline_png(rows, config.timeline, scope=scope)
    except OSError as err:
        raise UsageError(f"cannot write --timeline {config.timeline!r}: {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 on bad input, with a one-line error on stderr; 130/143
    when interrupted by SIGINT/SIGTERM, at once: nothing is written before the report is complete)."""
    with interrupts.handled():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        config = parse_config(argv)
        if config.live_child:
            print(json.dumps({"live_peak_bytes": memory_live.measure_here(config)}))
            return 0
        if config.fit:
            return run_fit(config)
        if config.mesh is not None:
            return report_mesh(config)
        rows, base = run(config)
        live_note = None
        if config.live:
            rows, live_note = memory_live.add_live_peaks(config, rows)
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
            write_timeline(config, rows)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
