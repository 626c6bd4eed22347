"""Train the reference GPT on word-level Penn Treebank: ``python -m train.ptb --policy every_k --k 4``.

Flags map one to one onto :class:`train.config.TrainConfig` fields; every key of every
registered remat policy is also a flag (``--k``, ``--skip-cheap``, ...) passed to
``jremat.resolve`` only when given. See "Training on Penn Treebank" in README.md.

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
import math
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jremat
from jremat import parse_budget, registry
from jremat.models import PRESETS, policy_memory
from jremat.models.config import whole_step_head_chunks
from jremat.train import cli, interrupts, model_flags, sharded_steps
from jremat.train import data as data_lib
from jremat.train import distributed as distributed_lib
from jremat.train import fit as fit_lib
from jremat.train import sharding as sharding_lib
from jremat.train import step as step_lib
from jremat.train.config import AUTO_BATCH, TrainConfig, resume_differences
from jremat.train.metrics import MetricsFile
from jremat.train.state_files import (
    StateFiles,
    StateFilesError,
    jsonable,
    no_state_error,
    pack_state,
    resume_from_newest_good,
    state_meta,
    unpack_state,
)
from jremat.train.usage import EXIT_USAGE, UsageError, program_name

EXIT_OK, EXIT_NONFINITE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 130, 143

#: Multi-process runs: how long the processes wait for each other to finish compiling.
COMPILE_BARRIER_TIMEOUT_S = 3600


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite."""


@dataclasses.dataclass
class RunResult:
    """What a finished (or stopped) run produced.

    Attributes:
      status: ``"done"``, ``"interrupted"`` or ``"nonfinite"``.
      steps_done: optimizer steps completed (including those before a resume).
      losses: per-step training losses of the steps run in this process, by step number.
      valid_ppl / test_ppl: final perplexities (``None`` if not reached).
      valid_history: ``(step, valid perplexity)`` of the periodic evaluations.
      mean_step_time_s: mean wall time per optimizer step in this process (compile excluded).
      tokens_per_s: training tokens per second over those steps.
      message: a one-paragraph description of how the run ended.
    """

    status: str
    steps_done: int
    losses: dict[int, float]
    valid_ppl: float | None = None
    test_ppl: float | None = None
    valid_history: list = dataclasses.field(default_factory=list)
    mean_step_time_s: float | None = None
    tokens_per_s: float | None = None
    message: str = ""


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


def memory_report(model_cfg, batch_size: int, seq_len: int) -> str:
    """The start-up memory report: peak estimate, saved bytes per layer and recompute, this policy vs ``none``.

    Compile-only (:func:`models.policy_memory.summary_vs_none`): nothing runs on the device. The
    figures are those of ``python -m train.memory``'s row for the same model, batch, sequence
    length, policy and head chunks, against the same ``none`` (no remat anywhere, head whole).
    """
    return policy_memory.summary_vs_none(model_cfg, batch_size, seq_len)


def plan_auto_policy(cfg: TrainConfig, model_cfg):
    """Replace an ``auto`` policy by the plan that fits the budget (see :mod:`models.planning`).

    Returns:
      ``(model_cfg, plan_table)``; the config unchanged and ``None`` for any other policy.

    Raises:
      UsageError: if no plan fits the budget (the message gives the smallest achievable peak).
    """
    if registry.parse_spec(model_cfg.remat_policy)[0] != "auto":
        return model_cfg, None
    try:
        planned, plan = policy_memory.config_for_spec(
            model_cfg, model_cfg.remat_policy, cfg.batch_size, cfg.seq_len, cfg.memory_budget
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    return planned, plan.table()


def fit_batch(cfg: TrainConfig, vocab_size: int, progress: bool):
    """``--batch-size auto``: the fit search's winner (:mod:`train.fit`) under ``--memory-budget``.

    With ``--policy auto`` the search covers :data:`train.fit.FIT_POLICIES` and the budget
    planner's plans; with another policy, only the batch is chosen. Each policy gets the CLI's
    default head chunks (:func:`models.config.whole_step_head_chunks`).

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

    def model_config(spec: str):
        return base.replace(remat_policy=spec, remat_head_chunks=whole_step_head_chunks(spec, cfg.seq_len))

    auto = registry.parse_spec(base.remat_policy)[0] == "auto"
    optimizer = step_lib.OptimizerConfig(cfg.lr, cfg.warmup, 1, cfg.clip, cfg.weight_decay, 1)
    builder = fit_lib.GPTStepBuilder(model_config, cfg.seq_len, optimizer)
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
    table = fit_lib.format_result(result, builder)
    table += f"\nfit: training with {builder.describe(*winner.key)} at batch {winner.batch_size}"
    # The budget is spent: under another policy than auto it would now be refused as a stray flag.
    chosen = cfg.replace(batch_size=winner.batch_size, memory_budget=cfg.memory_budget if auto else None)
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


def summary_table(cfg: TrainConfig, model_cfg, result: RunResult) -> str:
    """The final summary table."""

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    last = result.losses[max(result.losses)] if result.losses else None
    rows = [
        ("preset", cfg.preset),
        ("policy", model_cfg.remat_policy),
        ("granularity", cfg.granularity),
        ("steps", str(result.steps_done)),
        ("final train loss", fmt(last, ".4f")),
        ("valid perplexity", fmt(result.valid_ppl, ".2f")),
        ("test perplexity", fmt(result.test_ppl, ".2f")),
        ("mean step time (s)", fmt(result.mean_step_time_s, ".4f")),
        ("tokens/s", fmt(result.tokens_per_s, ",.0f")),
    ]
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join(["summary", rule, *(f"{k:<{width}} | {v}" for k, v in rows), rule])


# ----------------------------------------------------------------------------- training


def evaluate(
    eval_step: Callable, params, batches: data_lib.Batches, max_batches: int = 0, put: Callable = lambda a: a
) -> float:
    """Mean cross-entropy over the split's batches (the first ``max_batches`` if > 0); ``put`` places each array."""
    n = len(batches) if max_batches == 0 else min(max_batches, len(batches))
    total = 0.0
    for i in range(n):
        x, y = batches[i]
        total += float(eval_step(params, put(x), put(y)))
    return total / n


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


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
    from tqdm import tqdm

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
    if cfg.batch_size == AUTO_BATCH:
        cfg, model_cfg, plan_table = fit_batch(cfg, corpus.vocab_size, progress)
    else:
        model_cfg, plan_table = plan_auto_policy(cfg, cfg.model_config(corpus.vocab_size))
    try:
        mesh = sharding_lib.mesh_from_flag(cfg.mesh)
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

        def check(meta):
            refused, notes = resume_differences(meta, cfg, jsonable(dataclasses.asdict(model_cfg)), corpus.vocab_md5())
            if refused:
                raise StateFilesError(
                    f"cannot resume from {str(state_files.path)!r} (step {meta.get('step')}): the checkpoint is of another "
                    f"model or data ({'; '.join(refused)}); resume with the flags and --data-dir of the original run, "
                    "or start a fresh run in another --ckpt-dir"
                )
            return notes

        template = pack_state(params, opt_state, base_key)

        def agree(step):  # each process reads the directory itself
            if not distributed_lib.same_on_every_process(step):
                raise StateFilesError(
                    f"--resume: this process's newest intact checkpoint in {str(state_files.path)!r} is step {step}, but "
                    "other processes found another; every process must see the same --ckpt-dir (a shared file system)"
                )

        latest, meta, tree = resume_from_newest_good(state_files, template, check, log, move=primary, agree=agree)
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

    metrics = (
        MetricsFile(cfg.metrics_file, resume_step=start_step if cfg.resume else None, log=log)
        if cfg.metrics_file and primary
        else None
    )

    def save(step):
        state_files.save(
            step,
            pack_state(params, opt_state, base_key),
            state_meta(cfg, model_cfg, corpus, step, per_epoch, total_steps),
        )

    log(format_config(cfg, model_cfg, corpus, source, total_steps, per_epoch))
    if plan_table:
        log(plan_table)
    if cfg.memory_report and primary:
        log(f"compiling the memory report ({model_cfg.remat_policy} vs none; skip it with --no-memory-report)...")
    t_compile = time.perf_counter()
    try:  # a policy that does not fit this model (nested:block=3 on 2 layers, a name it does not tag)
        if cfg.memory_report and primary:
            log(memory_report(model_cfg, cfg.batch_size, cfg.seq_len))
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

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.accum
    result = RunResult(status="done", steps_done=start_step, losses={})
    step_times = []
    last_saved = start_step if cfg.resume else None
    bar = tqdm(
        total=total_steps,
        initial=start_step,
        desc="train",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
        file=sys.stderr,
    )
    step = start_step
    try:
        with signals.deferred():
            while step < total_steps:
                t0 = time.perf_counter()
                micro_losses = []
                for micro in range(cfg.accum):
                    x, y = train_batches[(step * cfg.accum + micro) % per_epoch]
                    key = step_lib.dropout_key(base_key, step, micro)
                    params, opt_state, loss = train_step(params, opt_state, put(x), put(y), key)
                    micro_losses.append(loss)
                loss = float(np.mean([float(v) for v in micro_losses]))
                step_time_s = time.perf_counter() - t0
                if not math.isfinite(loss):
                    kept = state_files.latest_step() if state_files else None
                    where = (
                        f"the last good checkpoint is step {kept} in {state_files.path}"
                        if kept is not None
                        else ("no checkpoint was saved" + ("" if state_files else " (no --ckpt-dir)"))
                    )
                    result.status = "nonfinite"
                    result.message = (
                        f"training loss became {loss} at step {step + 1}; stopped without saving this step; {where}. "
                        "Try a lower --lr, a smaller --clip, longer --warmup or --dtype float32"
                    )
                    return result
                step += 1
                step_times.append(step_time_s)
                result.losses[step] = loss
                result.steps_done = step
                row = dict(
                    step=step,
                    loss=loss,
                    perplexity=_perplexity(loss),
                    lr=opt_cfg.learning_rate(step - 1),
                    step_time_s=step_time_s,
                    tokens_per_s=tokens_per_step / step_time_s,
                )
                if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                    valid_loss = evaluate(eval_step, params, valid_batches, cfg.eval_batches, put)
                    row.update(valid_loss=valid_loss, valid_ppl=_perplexity(valid_loss))
                    result.valid_history.append((step, row["valid_ppl"]))
                    if primary:
                        bar.write(f"step {step}: valid perplexity {row['valid_ppl']:.2f}")
                if metrics:
                    metrics.write(row)
                bar.set_postfix(
                    loss=f"{loss:.3f}",
                    ppl=f"{row['perplexity']:.1f}",
                    tok_s=f"{row['tokens_per_s']:.0f}",
                    step_s=f"{step_time_s:.3f}",
                    refresh=False,
                )
                bar.update(1)
                if state_files and cfg.ckpt_every and step % cfg.ckpt_every == 0:
                    save(step)
                    last_saved = step
                if distributed_lib.agree_any(signals.requested):  # every process stops after the same step
                    if state_files and last_saved != step:
                        save(step)
                        last_saved = step
                    result.status = "interrupted"
                    result.message = f"interrupted ({signal_name(signals)}) after step {step}; " + (
                        f"checkpoint saved in {state_files.path}; continue with the same flags plus --resume"
                        if state_files
                        else "no --ckpt-dir, so nothing was saved"
                    )
                    return result
            if state_files and last_saved != step:
                save(step)
            if signals.requested:  # during the last step or its save: saved, but the user asked to stop
                result.status = "interrupted"
                result.message = f"interrupted ({signal_name(signals)}) after the last step, {step}; " + (
                    f"checkpoint saved in {state_files.path}; nothing left to train"
                    if state_files
                    else "nothing was saved"
                )
                return result
    finally:
        bar.close()
        if metrics:
            metrics.close()
        if step_times:
            result.mean_step_time_s = float(np.mean(step_times))
            result.tokens_per_s = tokens_per_step * len(step_times) / float(np.sum(step_times))

    signals.startup_note = f"finished {step} steps" + (
        f"; the checkpoint of step {step} is saved" if state_files else ""
    )
    result.valid_ppl = _perplexity(evaluate(eval_step, params, valid_batches, cfg.eval_batches, put))
    result.test_ppl = _perplexity(evaluate(eval_step, params, test_batches, cfg.eval_batches, put))
    result.message = f"finished {step} steps"
    log(summary_table(cfg, model_cfg, result))
    return result


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


def signal_name(signals: interrupts.Interrupts) -> str:
    """``SIGINT`` or ``SIGTERM``: the signal that stopped the run."""
    return "SIGTERM" if signals.exit_code == EXIT_TERMINATED else "SIGINT"


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
