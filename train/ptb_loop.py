"""The training loop of ``python -m train.ptb``: the optimizer steps of a prepared run, then its final evaluation.

:func:`train.ptb.prepare_run` makes a :class:`PreparedRun` (data, training state, compiled steps);
:func:`train_loop` runs the steps (validation, metrics rows, saves, the stop on a non-finite loss
or a signal); :func:`finish_run` gives the final perplexities and the summary table.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jremat.train import data as data_lib
from jremat.train import distributed as distributed_lib
from jremat.train import interrupts
from jremat.train import step as step_lib
from jremat.train.config import TrainConfig
from jremat.train.metrics import MetricsFile
from jremat.train.state_files import StateFiles, pack_state, state_meta


@dataclasses.dataclass
class RunResult:
    """What a finished (or stopped) run produced.

    Attributes:
      status: ``"done"``, ``"interrupted"`` or ``"nonfinite"``.
      steps_done: optimizer steps completed (including those before a resume).
      losses: per-step training losses of the steps run in this process, by step number.
      valid_ppl / test_ppl: final perplexities (``None`` if not reached).
      valid_history: ``(step, valid perplexity)`` of the periodic evaluations.
      moe_aux: an MoE model's final router losses on the valid split (load balance, router
        z-loss: :func:`models.moe_aux_losses`), ``None`` for a dense model.
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
    moe_aux: dict[str, float] | None = None


@dataclasses.dataclass
class PreparedRun:
    """What the training loop starts from (:func:`prepare_run`); ``params`` and ``opt_state`` are
    updated in place by :func:`train_loop`.

    Attributes:
      cfg: the run's configuration (with ``--batch-size auto``, the batch the search chose).
      model_cfg: the model under the run's policy (an ``auto`` policy: its plan).
      corpus: the data; ``train_batches`` / ``valid_batches`` / ``test_batches`` this process's batches.
      total_steps: the optimizer steps of the whole run; ``start_step`` those already done (``--resume``).
      opt_cfg: the optimizer and its schedule.
      put: places a host batch (on the mesh, sharded; else as it is).
      params / opt_state / base_key: the training state.
      metrics: the metrics file (process 0, with ``--metrics-file``), or ``None``.
      train_step / eval_step: the compiled steps.
      moe_aux_step: an MoE model's router losses (:func:`train.step.make_moe_aux_step`), ``None`` if dense.
    """

    cfg: TrainConfig
    model_cfg: Any
    corpus: data_lib.Corpus
    train_batches: data_lib.Batches
    valid_batches: data_lib.Batches
    test_batches: data_lib.Batches
    total_steps: int
    opt_cfg: step_lib.OptimizerConfig
    put: Callable
    params: Any
    opt_state: Any
    base_key: Any
    start_step: int
    metrics: MetricsFile | None
    train_step: Callable
    eval_step: Callable
    moe_aux_step: Callable | None = None

    @property
    def per_epoch(self) -> int:
        """Micro-batches per pass over the training split."""
        return len(self.train_batches)

    def save(self, state_files: StateFiles, step: int) -> None:
        """Save the training state of ``step`` with its metadata."""
        state_files.save(
            step,
            pack_state(self.params, self.opt_state, self.base_key),
            state_meta(self.cfg, self.model_cfg, self.corpus, step, self.per_epoch, self.total_steps),
        )


def train_loop(run: PreparedRun, state_files, signals, primary: bool, progress: bool) -> RunResult:
    """The optimizer steps from ``run.start_step``: each step's loss and metrics row, periodic validation
    and saves, and the stop on a non-finite loss or a signal (the step finished and saved).

    Returns:
      The :class:`RunResult` so far: ``"done"`` (the last step saved), ``"nonfinite"`` or ``"interrupted"``.
    """
    from tqdm import tqdm

    cfg, step = run.cfg, run.start_step
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.accum
    result = RunResult(status="done", steps_done=step, losses={})
    step_times = []
    last_saved = step if cfg.resume else None
    bar = tqdm(
        total=run.total_steps,
        initial=step,
        desc="train",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
        file=sys.stderr,
    )
    try:
        with signals.deferred():
            while step < run.total_steps:
                t0 = time.perf_counter()
                micro_losses = []
                for micro in range(cfg.accum):
                    x, y = run.train_batches[(step * cfg.accum + micro) % run.per_epoch]
                    key = step_lib.dropout_key(run.base_key, step, micro)
                    run.params, run.opt_state, loss = run.train_step(
                        run.params, run.opt_state, run.put(x), run.put(y), key
                    )
                    micro_losses.append(loss)
                loss = float(np.mean([float(v) for v in micro_losses]))
                step_time_s = time.perf_counter() - t0
                if not math.isfinite(loss):
                    result.status, result.message = "nonfinite", nonfinite_message(loss, step + 1, state_files)
                    return result
                step += 1
                step_times.append(step_time_s)
                result.losses[step] = loss
                result.steps_done = step
                row = dict(
                    step=step,
                    loss=loss,
                    perplexity=perplexity(loss),
                    lr=run.opt_cfg.learning_rate(step - 1),
                    step_time_s=step_time_s,
                    tokens_per_s=tokens_per_step / step_time_s,
                )
                if cfg.eval_every and step % cfg.eval_every == 0 and step < run.total_steps:
                    valid_loss = evaluate(run.eval_step, run.params, run.valid_batches, cfg.eval_batches, run.put)
                    row.update(valid_loss=valid_loss, valid_ppl=perplexity(valid_loss))
                    if run.moe_aux_step is not None:
                        aux = moe_aux_means(run.moe_aux_step, run.params, run.valid_batches, cfg.eval_batches, run.put)
                        row.update(moe_load_balance=aux["load_balance"], moe_router_z=aux["router_z"])
                    result.valid_history.append((step, row["valid_ppl"]))
                    if primary:
                        bar.write(f"step {step}: valid perplexity {row['valid_ppl']:.2f}")
                if run.metrics:
                    run.metrics.write(row)
                bar.set_postfix(
                    loss=f"{loss:.3f}",
                    ppl=f"{row['perplexity']:.1f}",
                    tok_s=f"{row['tokens_per_s']:.0f}",
                    step_s=f"{step_time_s:.3f}",
                    refresh=False,
                )
                bar.update(1)
                if state_files and cfg.ckpt_every and step % cfg.ckpt_every == 0:
                    run.save(state_files, step)
                    last_saved = step
                if distributed_lib.agree_any(signals.requested):  # every process stops after the same step
                    if state_files and last_saved != step:
                        run.save(state_files, step)
                        last_saved = step
                    result.status = "interrupted"
                    result.message = f"interrupted ({signal_name(signals)}) after step {step}; " + (
                        f"checkpoint saved in {state_files.path}; continue with the same flags plus --resume"
                        if state_files
                        else "no --ckpt-dir, so nothing was saved"
                    )
                    return result
            if state_files and last_saved != step:
                run.save(state_files, step)
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
        if run.metrics:
            run.metrics.close()
        if step_times:
            result.mean_step_time_s = float(np.mean(step_times))
            result.tokens_per_s = tokens_per_step * len(step_times) / float(np.sum(step_times))
    return result


def nonfinite_message(loss: float, step: int, state_files) -> str:
    """How a run stopped on a non-finite loss at ``step`` ends: what was (not) saved, and what to try."""
    kept = state_files.latest_step() if state_files else None
    where = (
        f"the last good checkpoint is step {kept} in {state_files.path}"
        if kept is not None
        else ("no checkpoint was saved" + ("" if state_files else " (no --ckpt-dir)"))
    )
    return (
        f"training loss became {loss} at step {step}; stopped without saving this step; {where}. "
        "Try a lower --lr, a smaller --clip, longer --warmup or --dtype float32"
    )


def finish_run(run: PreparedRun, result: RunResult, signals, state_files, log) -> RunResult:
    """After the last step: the final validation and test perplexities and the summary table."""
    step = result.steps_done
    signals.startup_note = f"finished {step} steps" + (
        f"; the checkpoint of step {step} is saved" if state_files else ""
    )
    result.valid_ppl = perplexity(evaluate(run.eval_step, run.params, run.valid_batches, run.cfg.eval_batches, run.put))
    result.test_ppl = perplexity(evaluate(run.eval_step, run.params, run.test_batches, run.cfg.eval_batches, run.put))
    if run.moe_aux_step is not None:
        result.moe_aux = moe_aux_means(run.moe_aux_step, run.params, run.valid_batches, run.cfg.eval_batches, run.put)
    result.message = f"finished {step} steps"
    log(summary_table(run.cfg, run.model_cfg, result))
    return result


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


def moe_aux_means(
    aux_step: Callable, params, batches: data_lib.Batches, max_batches: int = 0, put: Callable = lambda a: a
) -> dict[str, float]:
    """Mean router losses of an MoE model over the split's inputs (the first ``max_batches`` if > 0), as :func:`evaluate`."""
    n = len(batches) if max_batches == 0 else min(max_batches, len(batches))
    totals: dict[str, float] = {}
    for i in range(n):
        for name, value in aux_step(params, put(batches[i][0])).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    return {name: total / n for name, total in totals.items()}


def perplexity(loss: float) -> float:
    """``exp(loss)``, infinite past float range."""
    return math.exp(loss) if loss < 700 else math.inf


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
        *(
            [
                ("MoE load balance (valid)", fmt(result.moe_aux["load_balance"], ".4f")),
                ("MoE router z-loss (valid)", fmt(result.moe_aux["router_z"], ".4f")),
            ]
            if result.moe_aux
            else []
        ),
        ("mean step time (s)", fmt(result.mean_step_time_s, ".4f")),
        ("tokens/s", fmt(result.tokens_per_s, ",.0f")),
    ]
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join(["summary", rule, *(f"{k:<{width}} | {v}" for k, v in rows), rule])


def signal_name(signals: interrupts.Interrupts) -> str:
    """``SIGINT`` or ``SIGTERM``: the signal that stopped the run."""
    return "SIGTERM" if signals.exit_code == interrupts.EXIT_CODES[signal.SIGTERM] else "SIGINT"
