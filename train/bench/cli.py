"""``python -m train.bench`` (installed: ``jremat-bench``): run the parts, write the CSV, plots and report.

What the parts measure: :mod:`jremat.train.bench`.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
import time
from collections.abc import Sequence

from jremat.train.bench.config import DEFAULT_POLICIES, PARTS, BenchConfig, parse_config
from jremat.train.bench.harness import bench_peak, measure, time_ratios
from jremat.train.bench.parts import BENCH_PARTS, check_policies
from jremat.train.bench.plots import write_plots
from jremat.train.bench.report import check_targets, kept_text, results_markdown
from jremat.train.bench.rows import write_csv
from jremat.train.cli import UsageError, run_main
from jremat.train.files import write_text_atomically

__all__ = [
    "BENCH_PARTS",
    "BenchConfig",
    "DEFAULT_POLICIES",
    "PARTS",
    "bench_peak",
    "check_targets",
    "main",
    "measure",
    "parse_config",
    "run",
    "time_ratios",
]

#: What the report says about scopes and the FLOPs bound (placed after the verdict).
READING_GUIDE = """\
## What each number covers

* **Scope.** `blocks`: the policy checkpoints the transformer blocks only. `head`: `none` on the blocks, the final
  LayerNorm, vocabulary head and loss recomputed over sequence chunks (`ModelConfig.remat_head_chunks`). `whole
  step`: both, as the Needle study checkpoints the whole graph. The bench applies every policy but `none` to the
  whole step (`--remat-head-chunks`, default 4); the Megatron and peer tables are blocks only, because the formulas
  and the peers cover blocks only.
* **Step.** Memory and time are of a full Adam train step (parameters, gradients, both moments; parameters and
  optimizer state donated), except the Megatron table, which is the gradient step that `python -m train.memory`
  reports and `analytic_peak_bytes` models.
* **FLOPs bound.** `1 + recompute FLOPs / step FLOPs`: the policy's step FLOPs over `none`'s, counted on the
  traced step (`jremat.program_flops`, which multiplies a scan body by its length). XLA:CPU's
  `cost_analysis()` of the compiled step counts a loop body once, so with scanned layers or a chunked head it
  undercounts (its figure is in the CSV, column `xla_flops`, and can fall below `none`'s). The bound is the time ratio if every FLOP cost the same. When the vocabulary head dominates the
  step (the head-dominated model), the recompute is a small share of the FLOPs, the bound is near 1, and no time
  ratio there says much about remat; the block-dominated model is where a policy's cost shows. Measured ratios
  below the bound mean the recomputed FLOPs are cheaper than the step's average FLOP on this machine (the Adam
  update, memory traffic and dispatch do not grow with recompute); ratios above it mean the recompute costs more
  than its FLOPs (extra passes over memory, lost fusion).
* **Below 1.** In the `time` and `needle_time` tables `none` keeps the head whole while every other policy
  runs it in chunks, so their ratios include that change too: a ratio below 1 means the chunked step ran faster
  than `none`'s on this machine, which the blocks' recompute cannot explain. The peers table (blocks only, no
  chunking) has no such term.
* **Absolute figures.** Every timed row also gives its median step time, tokens/s, model TFLOP/s per device
  and MFU. Model FLOPs are MaxText's count (6 x matmul weights + causal attention per token; docs/benchmark.md),
  the same for every policy of a model: recomputation is not counted, so a policy's TFLOP/s and MFU are `none`'s
  divided by its time ratio. MFU is against the device's published dense bf16 peak, for float32 runs too, and empty on a device
  with no published peak (every CPU).
* **Peers that recompute nothing.** A peer row whose FLOPs bound is 1.000 recomputes nothing and keeps `none`'s
  peak: its checkpoint did not survive into the compiled step. A row with a FLOPs bound above 1 and `none`'s peak
  recomputes but saves no memory: XLA scheduled the recomputation where it frees nothing. Either way the
  jremat row next to it is what the same request gives with jremat (the cotangent tie, `jremat._engine.tie`, keeps the
  recomputation in the backward pass).
"""


#: The folder, in ``--out``, of the CSV files of the parts one run has done so far (its start time and a
#: random tag fill ``{}``); removed when every part is done, kept when a part fails. No run touches another run's.
PARTIAL_DIR = "bench.partial-{}"


def run(config: BenchConfig, command: str) -> tuple[list[dict], list[str], list[str]]:
    """Run the configured parts; write each part's CSV (``bench-<part>.csv``) and the plots into
    ``config.out``, and the report.

    Every ``--policy`` is checked against the parts' models first (:func:`check_policies`). Each
    part's CSV goes to this run's :data:`PARTIAL_DIR` as the part finishes; the CSV files, the
    plots and the report in ``config.out`` are replaced only when every part is done (the CSV of
    a part this run did not run is removed then, as the report no longer covers it), so a run
    that fails midway leaves the last complete run's files as they were.

    Returns:
      ``(rows, plot file names, notes)``.

    Raises:
      UsageError: if ``config.out`` cannot be created, or a policy does not apply to a part's model.
    """
    policies, notes = list(config.policy), []
    check_policies(config)
    try:
        os.makedirs(config.out, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create --out {config.out!r}: {err}") from None
    rows: list[dict] = []
    done: dict[str, list[dict]] = {}
    started = time.perf_counter()
    partial = os.path.join(config.out, PARTIAL_DIR.format(f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"))
    for name in config.parts:
        part, t0 = BENCH_PARTS[name], time.perf_counter()
        try:
            part_rows = part.run(config, policies)
        except BaseException:
            print(
                f"[{name}] failed; the CSV files in {config.out} and the report are unchanged"
                + (f"; the finished parts' rows are in {partial}" if rows else ""),
                file=sys.stderr,
                flush=True,
            )
            raise
        print(f"[{name}] done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        rows += part_rows
        done.setdefault(name, []).extend(part_rows)
        os.makedirs(partial, exist_ok=True)  # keep what is done if a later part fails, beside the last complete run
        write_csv(done[name], os.path.join(partial, part.csv_name), part.columns)
    for name, part in BENCH_PARTS.items():  # this run's CSV files replace the last run's
        path = os.path.join(config.out, part.csv_name)
        if name in done:
            os.replace(os.path.join(partial, part.csv_name), path)
        elif os.path.exists(path):
            os.remove(path)
    os.rmdir(partial)  # this run's own: an earlier failed run's partial rows stay
    plots = write_plots(rows, config.out)
    if config.report:
        plot_dir = os.path.relpath(config.out, os.path.dirname(os.path.abspath(config.report)) or ".")
        text = results_markdown(rows, plots, plot_dir, command, time.perf_counter() - started, notes, READING_GUIDE)
        text += kept_text(config.report)
        write_text_atomically(config.report, text)
    return rows, plots, notes


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 on bad input, with a one-line error on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_main(lambda: _main(argv))


def _main(argv: list[str]) -> int:
    config = parse_config(argv)
    rows, plots, _ = run(config, "python -m train.bench" + "".join(" " + shlex.quote(a) for a in argv))
    print(
        f"wrote {len(rows)} rows to {', '.join(BENCH_PARTS[p].csv_name for p in dict.fromkeys(config.parts))} in "
        f"{config.out}, {len(plots)} plots" + (f" and {config.report}" if config.report else "")
    )
    for target in check_targets(rows):
        print(f"  {'met   ' if target.met else 'MISSED'} {target.text}: {target.measured}")
    return 0
