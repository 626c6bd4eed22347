"""Train the reference GPT on word-level Penn Treebank: ``python -m train.ptb --policy every_k --k 4``.

Flags map one to one onto :class:`train.config.TrainConfig` fields; every key of every
registered remat policy is also a flag (``--k``, ``--skip-cheap``, ...) passed to
``jremat.resolve`` only when given. See docs/training.md.

Exit codes: 0 done; 2 bad input (message, nothing written is lost); 1 the loss became NaN/inf
(the last good checkpoint is kept); 130 interrupted with Ctrl-C, 143 stopped by SIGTERM (during
training, the finished step is saved first when ``--ckpt-dir`` is set; before training, the run
ends at once: :mod:`train.interrupts`).

Multi-process runs (``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, SLURM or
Open MPI; ``python -m train.launch`` on one machine): every process runs the same command with
``--mesh`` over all devices; process 0 alone prints and writes the metrics file; every process
saves and restores its own checkpoint shards. See docs/multiprocess.md.
"""

from __future__ import annotations

if __name__ == "__main__":  # the CLI: Ctrl-C, SIGTERM and argument mistakes are handled before JAX is imported
    from jremat.train.usage import exit_without_train_extra

    exit_without_train_extra("train.ptb")  # one error line on a core install, before any import fails
    from jremat.train.interrupts import INTERRUPTS

    INTERRUPTS.install()
    from jremat.train.cli import exit_on_argument_error
    from jremat.train.config import TrainConfig

    exit_on_argument_error(TrainConfig, "train.ptb")

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

import jremat
from jremat import parse_budget
from jremat.models import PRESETS
from jremat.models.config import ModelConfig, whole_step_head_chunks
from jremat.train import cli, interrupts, model_flags, policy_memory, sharded_steps
from jremat.train import data as data_lib
from jremat.train import distributed as distributed_lib
from jremat.train import fit as fit_lib
from jremat.train import sharding as sharding_lib
from jremat.train import step as step_lib
from jremat.train.config import AUTO_BATCH, TrainConfig, resume_differences
from jremat.train.metrics import MetricsFile
from jremat.train.ptb_loop import PreparedRun, RunResult, finish_run, signal_name, train_loop
from jremat.train.state_files import (
    StateFiles,
    StateFilesError,
    jsonable,
    no_state_error,
    pack_state,
    resume_from_newest_good,
    unpack_state,
)
from jremat.train.usage import EXIT_USAGE, UsageError, program_name

EXIT_OK, EXIT_NONFINITE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 130, 143

#: Multi-process runs: how long the processes wait for each other to finish compiling.
COMPILE_BARRIER_TIMEOUT_S = 3600


# ----------------------------------------------------------------------------- command line


DESCRIPTION = "Train the reference GPT on word-level Penn Treebank with a remat policy."


def epilog() -> str:
    """The help's epilog: the registered policies (their keys are also flags) and the exit codes."""
    return (
        "Registered policies (spec keys are also flags):\n"
        + jremat.describe()
        + "\n\nExit codes: 0 done, 1 loss became NaN/inf, 2 bad input, 130 interrupted (Ctrl-C), 143 SIGTERM."
    )


def parse_config(argv: Sequence[str] | None) -> TrainConfig:
    """Parse command-line arguments into a validated :class:`TrainConfig` (see :func:`train.cli.parse`).

    Raises:
      SystemExit: ``--help`` (code 0).
      UsageError: on an unknown flag or an invalid value.
    """
    return cli.parse(TrainConfig, argv, prog=program_name("train.ptb"), description=DESCRIPTION, epilog=epilog())


# ----------------------------------------------------------------------------- reports


def memory_report(model_cfg, batch_size: int, seq_len: int, mesh=None) -> str:
    """The start-up memory report: peak estimate, saved bytes per layer and recompute, this policy vs ``none``.

    Compile-only (:func:`train.policy_memory.summary_vs_none`): nothing runs on the device. The
    figures are those of ``python -m train.memory``'s row for the same model, batch, sequence
    length, policy and head chunks, against the same ``none`` (no remat anywhere, head whole).
    With a ``mesh`` they are still those of the unsharded step of the whole (global) batch on one
    device, and the report says so (the per-device figures are :func:`train.sharded_steps.sharded_step_memory`'s).
    """
    summary = policy_memory.summary_vs_none(model_cfg, batch_size, seq_len)
    if mesh is None:
        return summary
    return f"one device, unsharded, global batch {batch_size}: {summary}"


def resolve_auto_policy(cfg: TrainConfig, model_cfg):
    """Replace an ``auto`` policy by the budget planner's layer plan that fits the budget (see
    :mod:`train.planning`).

    Returns:
      ``(model_cfg, plan_table)``; the config unchanged and ``None`` for any other policy.

    Raises:
      UsageError: if no layer plan fits the budget (the message gives the smallest achievable peak).
    """
    if cfg.resolved_policy().name != "auto":
        return model_cfg, None
    try:
        planned, plan = policy_memory.config_for_spec(
            model_cfg, model_cfg.remat_policy, cfg.batch_size, cfg.seq_len, cfg.memory_budget
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    return planned, plan.table()


def fit_model_configs(cfg: TrainConfig, vocab_size: int) -> Callable[[str], ModelConfig]:
    """The fit search's mapping from a policy spec to the model config it compiles and trains.

    ``--remat-head-chunks`` as given applies to every policy searched; left at its default (the
    default of ``--policy``), each policy gets its own (:func:`models.config.whole_step_head_chunks`:
    0 for ``none``). With one policy searched the two are the same.
    """
    base = cfg.model_config(vocab_size)
    given = cfg.remat_head_chunks != whole_step_head_chunks(cfg.policy, cfg.seq_len)

    def model_config(spec: str) -> ModelConfig:
        chunks = cfg.remat_head_chunks if given else whole_step_head_chunks(spec, cfg.seq_len)
        return base.replace(remat_policy=spec, remat_head_chunks=chunks)

    return model_config


def fit_batch(cfg: TrainConfig, vocab_size: int, progress: bool, mesh=None):
    """``--batch-size auto``: the fit search's winner (:mod:`train.fit`) under ``--memory-budget``.

    With ``--policy auto`` the search covers :data:`train.fit.FIT_POLICIES` and the budget
    planner's plans; with another policy, only the batch is chosen. Each policy gets
    ``--remat-head-chunks`` (:func:`fit_model_configs`). On a ``mesh`` the search
    compiles the sharded train step: the budget is per device, every peak is one device's, the
    batch is searched per data-parallel shard and the run trains with that batch times the shards.

    Returns:
      ``(cfg with the chosen batch, the winner's model config, the search's table)``.

    Raises:
      UsageError: nothing fits the budget (the message gives the smallest peak found), or the run
        has several processes.
    """
    if jax.process_count() > 1:  # each process would time its own finalists and might choose another batch
        raise UsageError(
            f"--batch-size auto runs in one process; this run has {jax.process_count()}: search once with "
            "python -m train.memory --fit and pass the chosen --batch-size and --policy to every process"
        )
    base = cfg.model_config(vocab_size)
    model_config = fit_model_configs(cfg, vocab_size)
    auto = cfg.resolved_policy().name == "auto"
    optimizer = step_lib.OptimizerConfig(cfg.lr, cfg.warmup, 1, cfg.clip, cfg.weight_decay, 1)
    builder = fit_lib.GPTStepBuilder(model_config, cfg.seq_len, optimizer, mesh=mesh)
    try:
        (result,) = fit_lib.search(
            builder,
            [parse_budget(cfg.memory_budget).bytes],
            fit_lib.FIT_POLICIES if auto else [base.remat_policy],
            auto=auto,
            progress=progress,
        )
    except jremat.FitError as err:
        raise UsageError(f"--batch-size auto: {err}") from None
    winner = result.winner.probe
    batch_size = winner.batch_size * builder.data_shards
    table = fit_lib.format_result(result, builder)
    table += f"\nfit: training with {builder.describe(*winner.key)} at batch {winner.batch_size}"
    if mesh is not None:
        table += (
            f" per data-parallel shard, global batch {batch_size} on --mesh {cfg.mesh}; peak "
            f"{jremat.format_bytes(winner.peak_bytes)} per device within --memory-budget {cfg.memory_budget} per device"
        )
    # The budget is spent: under another policy than auto it would now be refused as a stray flag.
    chosen = cfg.replace(batch_size=batch_size, memory_budget=cfg.memory_budget if auto else None)
    return chosen, builder.config(*winner.key), table


def format_config(
    cfg: TrainConfig, model_cfg, corpus: data_lib.Corpus, source: str, total_steps: int, batches_per_epoch: int
) -> str:
    """The configuration block printed at start."""
    lines = ["train config:"]
    for field in dataclasses.fields(cfg):
        lines.append(f"  {field.name:<17} {getattr(cfg, field.name)!r}")
    lines.append("model config:")
    for field in dataclasses.fields(model_cfg):
        lines.append(f"  {field.name:<17} {getattr(model_cfg, field.name)!r}")
    lines.append(
        f"data: {source}; vocab {corpus.vocab_size}; tokens train {len(corpus.train):,} "
        f"valid {len(corpus.valid):,} test {len(corpus.test):,}"
    )
    lines.append(
        f"schedule: {total_steps} steps x {cfg.accum} micro-batch(es) of {cfg.batch_size} x {cfg.seq_len} "
        f"= {total_steps * cfg.accum / batches_per_epoch:.2f} epochs ({batches_per_epoch} batches per epoch)"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- training


_STEP_CACHE: dict = {}


def compiled_steps(
    model_cfg, opt_cfg: step_lib.OptimizerConfig, graphdef, params, opt_state, batch_size, seq_len, mesh=None
):
    """AOT-compiled ``(train_step, eval_step)`` for these configs and shapes (sharded on ``mesh``), cached per process."""
    key = (model_cfg, opt_cfg, batch_size, seq_len, mesh)
    if key not in _STEP_CACHE and mesh is not None:
        _STEP_CACHE[key] = sharded_steps.compile_steps(
            graphdef, opt_cfg.build(), mesh, params, opt_state, batch_size, seq_len
        )
    if key not in _STEP_CACHE:
        tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
        train = step_lib.make_train_step(graphdef, opt_cfg.build())
        train_c = train.lower(
            params, opt_state, tokens, tokens, step_lib.dropout_key(jax.random.key(0), 0, 0)
        ).compile()
        eval_c = step_lib.make_eval_step(graphdef).lower(params, tokens, tokens).compile()
        _STEP_CACHE[key] = (train_c, eval_c)
    return _STEP_CACHE[key]


def train(
    cfg: TrainConfig,
    *,
    log: Callable[[str], None] = print,
    progress: bool = True,
    signals: interrupts.Interrupts | None = None,
) -> RunResult:
    """Run training as configured; see the module docstring for the CLI around it.

    Args:
      cfg: the run's configuration.
      log: where lines go (process 0 only).
      progress: show a progress bar.
      signals: SIGINT/SIGTERM handling (:mod:`train.interrupts`, installed by :func:`main`); a
        signal during training ends the run after the step, saved. ``None`` (a call from Python):
        none installed, so Ctrl-C raises ``KeyboardInterrupt`` as usual.

    Raises:
      UsageError: bad input (data, checkpoint directory, resume target, metrics file, a policy
        that does not fit the model).
    """
    signals = interrupts.Interrupts() if signals is None else signals
    primary = distributed_lib.is_primary()  # process 0 prints, shows progress and writes the metrics file
    # The machine, then the model flags (attention, dropout, policy), before the checkpoint
    # directory is made and locked: a refused run leaves nothing behind.
    model_flags.check_backend(cfg.attention, PRESETS[cfg.preset].head_dim)
    model_cfg = cfg.model_config(PRESETS[cfg.preset].vocab_size)
    if cfg.mesh is None:  # a mesh may shard the parameters
        model_flags.check_training_state_fits(model_cfg)
    state_files = StateFiles(cfg.ckpt_dir, keep=cfg.keep_checkpoints, lock=primary) if cfg.ckpt_dir else None
    try:
        return _train(
            cfg, state_files, signals, primary, log if primary else (lambda _line: None), progress and primary
        )
    finally:
        if state_files:
            state_files.close()


def _train(cfg: TrainConfig, state_files, signals, primary: bool, log, progress: bool) -> RunResult:
    run = prepare_run(cfg, state_files, signals, primary, log, progress)
    result = train_loop(run, state_files, signals, primary, progress)
    return finish_run(run, result, signals, state_files, log) if result.status == "done" else result


def prepare_run(cfg: TrainConfig, state_files, signals, primary: bool, log, progress: bool) -> PreparedRun:
    """Everything before the first step: the state directory's checks, the data, the batch and policy
    (``--batch-size auto``, ``--policy auto``), the mesh, the training state (fresh or resumed), the
    configuration and memory report printed, the compiled steps.

    Raises:
      UsageError: bad input (data, state directory, resume target, metrics file, mesh, a policy
        that does not fit the model).
    """
    signals.startup_note = "nothing was trained, nothing to save"
    if state_files and state_files.lock is not None and state_files.lock.taken_over:
        log(f"note: took over the lock of a run that ended without releasing it ({state_files.lock.taken_over})")
    latest = state_files.latest_step() if state_files else None
    if cfg.resume and latest is None:
        raise no_state_error(state_files.path)
    if state_files and not cfg.resume and latest is not None:
        raise StateFilesError(
            f"--ckpt-dir {str(state_files.path)!r} already holds checkpoints (latest step {latest}) of an earlier "
            "run; pass --resume to continue it or choose another --ckpt-dir"
        )

    data_dir, source = data_lib.locate(cfg.data_dir, progress=progress)
    log(f"reading the corpus in {data_dir}...")
    corpus = data_lib.load_corpus(data_dir)
    try:
        mesh = sharding_lib.mesh_from_flag(cfg.mesh)
    except ValueError as err:
        raise UsageError(f"--mesh: {err}") from None
    if cfg.batch_size == AUTO_BATCH:
        cfg, model_cfg, plan_table = fit_batch(cfg, corpus.vocab_size, progress, mesh)
    else:
        model_cfg, plan_table = resolve_auto_policy(cfg, cfg.model_config(corpus.vocab_size))
    try:
        rows = None if mesh is None else sharding_lib.process_batch_rows(mesh, cfg.batch_size)  # this process's rows
    except ValueError as err:
        raise UsageError(f"--mesh: {err}") from None
    train_batches = data_lib.Batches(corpus.train, cfg.batch_size, cfg.seq_len, split="train", rows=rows)
    valid_batches = data_lib.Batches(corpus.valid, cfg.batch_size, cfg.seq_len, split="valid", rows=rows)
    test_batches = data_lib.Batches(corpus.test, cfg.batch_size, cfg.seq_len, split="test", rows=rows)
    per_epoch = len(train_batches)
    total_steps = cfg.steps if cfg.steps is not None else max(1, int(cfg.epochs * per_epoch) // cfg.accum)

    opt_cfg = step_lib.OptimizerConfig(cfg.lr, cfg.warmup, total_steps, cfg.clip, cfg.weight_decay, cfg.accum)
    tx = opt_cfg.build()
    put = (lambda a: a) if mesh is None else (lambda a: sharding_lib.shard_batch(mesh, a, cfg.batch_size))
    log("initializing the parameters and optimizer state...")
    if mesh is None:
        graphdef, params = step_lib.init_params(model_cfg, cfg.seed)
        opt_state = tx.init(params)
    else:
        graphdef, params = sharded_steps.init_params(model_cfg, cfg.seed, mesh)
        opt_state = sharded_steps.init_opt_state(tx, params, mesh)
    base_key = jax.random.key(cfg.seed) if mesh is None else sharding_lib.replicated_key(cfg.seed, mesh)

    start_step = 0
    if cfg.resume:
        start_step, params, opt_state, base_key = resume(
            cfg, model_cfg, corpus, state_files, (params, opt_state, base_key), total_steps, signals, primary, log
        )

    metrics = (
        MetricsFile(cfg.metrics_file, resume_step=start_step if cfg.resume else None, log=log)
        if cfg.metrics_file and primary
        else None
    )

    log(format_config(cfg, model_cfg, corpus, source, total_steps, per_epoch))
    if plan_table:
        log(plan_table)
    if cfg.memory_report and primary:
        log(f"compiling the memory report ({model_cfg.remat_policy} vs none; skip it with --no-memory-report)...")
    t_compile = time.perf_counter()
    try:  # a policy that does not fit this model (nested:block=3 on 2 layers, a name it does not tag)
        if cfg.memory_report and primary:
            log(memory_report(model_cfg, cfg.batch_size, cfg.seq_len, mesh))
            if mesh is not None:
                log(sharded_steps.sharded_step_memory(model_cfg, mesh, cfg.batch_size, cfg.seq_len, tx).format())
        log("compiling the train and eval steps...")
        train_step, eval_step = compiled_steps(
            model_cfg, opt_cfg, graphdef, params, opt_state, cfg.batch_size, cfg.seq_len, mesh
        )
    except ValueError as err:
        raise UsageError(f"--policy {model_cfg.remat_policy!r} does not fit this model: {err}") from None
    log(f"compiled train and eval steps in {time.perf_counter() - t_compile:.1f} s")
    distributed_lib.wait_for_all_processes("jremat-train-compiled", COMPILE_BARRIER_TIMEOUT_S)
    return PreparedRun(
        cfg, model_cfg, corpus, train_batches, valid_batches, test_batches, total_steps, opt_cfg, put,
        params, opt_state, base_key, start_step, metrics, train_step, eval_step,
        step_lib.make_moe_aux_step(graphdef) if model_cfg.moe_experts else None,
    )  # fmt: skip


def resume(cfg: TrainConfig, model_cfg, corpus, state_files, state, total_steps: int, signals, primary: bool, log):
    """``--resume``: ``(step, params, opt_state, base_key)`` from the newest intact training state that
    fits this run (``state``: the freshly made ``(params, opt_state, base_key)``, its template).

    Raises:
      StateFilesError: none intact, another model or data, or processes that disagree.
      UsageError: the saved state is already at ``total_steps``.
    """

    def check(meta):
        refused, notes = resume_differences(meta, cfg, jsonable(dataclasses.asdict(model_cfg)), corpus.vocab_md5())
        if refused:
            raise StateFilesError(
                f"cannot resume from {str(state_files.path)!r} (step {meta.get('step')}): the checkpoint is of another "
                f"model or data ({'; '.join(refused)}); resume with the flags and --data-dir of the original run, "
                "or start a fresh run in another --ckpt-dir"
            )
        return notes

    def agree(step):  # each process reads the directory itself
        if not distributed_lib.same_on_every_process(step):
            raise StateFilesError(
                f"--resume: this process's newest intact checkpoint in {str(state_files.path)!r} is step {step}, but "
                "other processes found another; every process must see the same --ckpt-dir (a shared file system)"
            )

    params, opt_state, base_key = state
    template = pack_state(params, opt_state, base_key)
    _, meta, tree = resume_from_newest_good(state_files, template, check, log, move=primary, agree=agree)
    params, opt_state, base_key = unpack_state(tree, params, opt_state)
    start_step = int(meta["step"])
    if start_step >= total_steps:
        raise UsageError(
            f"--resume: the checkpoint in {str(state_files.path)!r} is at step {start_step}, which --steps "
            f"{total_steps} already reaches; nothing is left to train: pass a larger --steps (or --epochs)"
        )
    signals.startup_note = f"the checkpoint of step {start_step} is unchanged"
    if int(meta["data_position"]) != start_step * cfg.accum:
        log(
            f"warning: checkpoint data position {meta['data_position']} != step x accum; continuing at "
            f"micro-batch {start_step * cfg.accum}"
        )
    log(f"resumed from {state_files.path} at step {start_step}")
    return start_step, params, opt_state, base_key


def start_distributed(cfg: TrainConfig) -> bool:
    """Join a multi-process run if the environment describes one (before anything starts the JAX backend).

    Returns:
      Whether ``jax.distributed`` was initialized.

    Raises:
      UsageError: an inconsistent multi-process environment, one without ``--mesh``, an
        unreachable coordinator, a coordinator port already taken, or a failed start-up
        handshake (processes missing, different ``JAX_NUM_PROCESSES``, a repeated process id).
        Failures inside JAX's own initialization end the process with a one-line error and
        exit code 2 (see :func:`train.distributed.initialize_distributed`).
    """
    try:
        distributed = distributed_lib.distributed_config()
        if distributed is None:
            return False
        if cfg.mesh is None:
            raise UsageError(
                "this is one process of a multi-process run (JAX_NUM_PROCESSES, SLURM or Open MPI environment) "
                "but --mesh is not given; pass --mesh over the devices of all processes, e.g. "
                "--mesh data=4,fsdp=2 for 2 processes with 4 devices each"
            )
        return distributed_lib.initialize_distributed(timeout_s=cfg.init_timeout_s)
    except distributed_lib.DistributedSetupError as err:
        raise UsageError(str(err)) from None
    except ValueError as err:
        if isinstance(err, UsageError):
            raise
        raise UsageError(f"multi-host environment: {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI entry point; returns the exit code (see the module docstring).

    It handles SIGINT and SIGTERM as the command line does, also when called from Python: an
    interrupt before or after training ends the process at once (:mod:`train.interrupts`). Call
    :func:`train` instead to keep Python's ``KeyboardInterrupt``.
    """
    with interrupts.handled() as signals:
        try:
            cfg = parse_config(argv)
            start_distributed(cfg)
            result = train(cfg, signals=signals)
        except SystemExit as exit_:  # --help
            return int(exit_.code or 0)
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:  # a second signal during training: stop at once
            print(
                f"interrupted again ({signal_name(signals)}): stopped at once; the checkpoints on disk are intact",
                file=sys.stderr,
            )
            return signals.exit_code
        if result.status == "nonfinite":
            if distributed_lib.is_primary():
                print(f"error: {result.message}", file=sys.stderr)
            return EXIT_NONFINITE
        if result.status == "interrupted":
            if distributed_lib.is_primary():
                print(result.message, file=sys.stderr)
            return signals.exit_code
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
