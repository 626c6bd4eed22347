"""The bench's measured rows: the column groups parts build their columns from, one row, one CSV file.

A row is a dict keyed by its part's columns (:attr:`train.bench.part.Part.columns`); ``""`` where
a column does not apply to that row. Each part's rows go to a CSV file of exactly its columns.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence

from jremat.models import ModelConfig
from jremat.train.files import write_text_atomically

#: The shape of the model a row measured (:func:`row_shape`).
SHAPE_COLUMNS = (
    "n_layers",
    "batch_size",
    "seq_len",
    "d_model",
    "d_ff",
    "vocab_size",
    "dtype",
    "attention",
    "attn_dropout",
    "head_chunks",
)
#: What every row has: its part, model, policy, scope and shape.
ROW_COLUMNS = ("part", "model", "policy", "scope", *SHAPE_COLUMNS)
#: The compiled step's memory (:func:`train.bench.harness.memory_fields`).
MEMORY_COLUMNS = ("peak_bytes", "temp_bytes", "argument_bytes", "output_bytes", "alias_bytes", "peak_source")
#: The absolute figures of a timed step (:func:`train.bench.flops.throughput_fields`).
THROUGHPUT_COLUMNS = ("step_s", "tokens_per_s", "model_flops", "model_tflops_per_s", "mfu", "peak_bf16_tflops")
#: A program timed against ``none`` in the same session (:func:`train.bench.timed.timed_fields`).
TIMED_COLUMNS = (
    "flops",
    "xla_flops",
    "flops_bound",
    "compile_s",
    "time_ratio_vs_none",
    "time_ratio_low",
    "time_ratio_high",
    "time_steps",
    "peak_reduction_vs_none",
    *MEMORY_COLUMNS,
    *THROUGHPUT_COLUMNS,
)


def row_shape(cfg: ModelConfig, batch: int, seq: int) -> dict:
    """The shape columns of ``cfg`` at ``batch`` x ``seq``."""
    return dict(
        n_layers=cfg.n_layers,
        batch_size=batch,
        seq_len=seq,
        d_model=cfg.d_model,
        d_ff=cfg.d_ff,
        vocab_size=cfg.vocab_size,
        dtype=cfg.dtype,
        attention=cfg.attention,
        attn_dropout=cfg.attn_dropout,
        head_chunks=cfg.remat_head_chunks,
    )


def make_row(columns: Sequence[str], part: str, policy: str, cfg: ModelConfig, batch: int, seq: int, **values) -> dict:
    """One row with ``columns``: the shape columns of ``cfg`` plus ``values`` ("" elsewhere).

    Raises:
      ValueError: if ``values`` names a column not in ``columns``.
    """
    foreign = [name for name in values if name not in columns]
    if foreign:
        raise ValueError(f"part {part!r} has no column {', '.join(foreign)}; its columns: {', '.join(columns)}")
    out = dict.fromkeys(columns, "")
    out.update(part=part, policy=policy, **row_shape(cfg, batch, seq))
    out.update(values)
    return out


def write_csv(rows: Sequence[dict], path: str, columns: Sequence[str]) -> None:
    """Write ``rows`` with exactly ``columns`` (atomically; floats to 6 significant digits).

    Raises:
      ValueError: if a row has a key not in ``columns``.
    """
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=list(columns))
    writer.writeheader()
    for r in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    write_text_atomically(path, buffer.getvalue())


def read_csv(path: str) -> list[dict]:
    """Rows written by :func:`write_csv`, with numbers as numbers ("" stays "")."""

    def value(text: str):
        if text in ("", "True", "False"):
            return {"True": True, "False": False}.get(text, text)
        try:
            return int(text)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return text

    with open(path, newline="") as f:
        return [{k: value(v) for k, v in r.items()} for r in csv.DictReader(f)]


def rows_by_part(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """``rows`` grouped by their ``part`` column, in first-seen order."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["part"], []).append(r)
    return out
