"""The per-step metrics file: JSON lines, or CSV when the name ends in ``.csv``.

One row per optimizer step with the columns of :data:`COLUMNS`; ``valid_loss`` / ``valid_ppl``
are filled on the steps where validation ran, and with a mixture-of-experts model the router's
auxiliary losses on the valid split there too, ``moe_load_balance`` / ``moe_router_z``
(unweighted, means over the layers); JSONL omits them elsewhere, CSV leaves them empty. On
``--resume`` the rows after the checkpoint's step are dropped (those steps run again and
produce the same values); a fresh run refuses to overwrite a non-empty file. A last line
cut off by a killed run (no newline at its end, not a whole row) is dropped with a note; a
malformed line anywhere else stops the resume with the file untouched.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jremat.train.cli import UsageError
from jremat.train.files import write_text_atomically

COLUMNS = (
    "step",
    "loss",
    "perplexity",
    "lr",
    "step_time_s",
    "tokens_per_s",
    "valid_loss",
    "valid_ppl",
    "moe_load_balance",
    "moe_router_z",
)


class MetricsFile:
    """Append-only writer of per-step metrics rows.

    Args:
      path: the file; ``.csv`` selects CSV, anything else JSON lines.
      resume_step: when resuming, keep the existing rows with ``step <= resume_step`` and
        append after them; ``None`` for a fresh run.
      log: where the note about a cut-off last line goes (default: standard error).

    Raises:
      UsageError: if the file cannot be written, a fresh run would overwrite existing rows, or
        the existing file has a malformed line (:func:`read_rows`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        resume_step: int | None = None,
        log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    ):
        self.path = Path(path).expanduser().absolute()
        self.is_csv = self.path.suffix.lower() == ".csv"
        if self.path.is_dir():
            raise UsageError(f"--metrics-file {str(self.path)!r} is a directory; give a file path (.jsonl or .csv)")
        exists = self.path.is_file() and self.path.stat().st_size > 0
        if exists and resume_step is None:
            raise UsageError(
                f"metrics file {str(self.path)!r} already has rows from another run; delete it, choose "
                "another --metrics-file, or pass --resume to continue that run"
            )
        kept = [r for r in read_rows(self.path, log=log) if r["step"] <= resume_step] if exists else []
        text = io.StringIO(newline="")
        if self.is_csv:
            writer = csv.DictWriter(text, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(kept)
        else:
            text.writelines(json.dumps(r) + "\n" for r in kept)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(self.path, text.getvalue())  # leaves no half-made file behind
            self._handle = open(self.path, "a", newline="")
        except OSError as err:
            raise UsageError(f"cannot write metrics file {str(self.path)!r}: {err.strerror or err}") from None

    def write(self, row: dict[str, Any]) -> None:
        """Append one row (keys from :data:`COLUMNS`) and flush it to disk."""
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ValueError(f"unknown metrics columns {sorted(unknown)}; valid: {', '.join(COLUMNS)}")
        if self.is_csv:
            buffer = io.StringIO()
            csv.DictWriter(buffer, fieldnames=COLUMNS).writerow(row)
            self._handle.write(buffer.getvalue())
        else:
            self._handle.write(json.dumps(row) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


def read_rows(path: str | os.PathLike, *, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The rows of a metrics file written by :class:`MetricsFile`, as dicts with numbers parsed.

    A last line without a newline at its end that is not a whole row is what a killed writer
    leaves: it is dropped, with a note to ``log`` if given.

    Raises:
      UsageError: naming the file and line, for any other line that is not a row (bad JSON, not
        an object with an integer ``step``; in CSV, a header other than :data:`COLUMNS`, a wrong
        number of fields or a value that is not a number).
    """
    path = Path(path)
    is_csv = path.suffix.lower() == ".csv"
    with open(path, newline="") as handle:
        lines = handle.read().splitlines(keepends=True)
    if is_csv and lines and next(csv.reader([lines[0]]), []) != list(COLUMNS):
        raise UsageError(
            f"metrics file {str(path)!r} line 1: the header is not {','.join(COLUMNS)}; "
            "give a metrics file this trainer wrote, or another --metrics-file"
        )
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or (is_csv and number == 1):
            continue
        try:
            rows.append(_csv_row(line) if is_csv else _json_row(line))
        except ValueError as err:
            if number == len(lines) and not line.endswith(("\n", "\r")):
                if log is not None:
                    log(f"note: metrics file {str(path)!r}: dropped its last line, cut off by a killed run ({err})")
                break
            raise UsageError(
                f"metrics file {str(path)!r} line {number}: {err}; fix or delete that line, or give another "
                "--metrics-file"
            ) from None
    return rows


def _json_row(line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not a JSON row ({err.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
        raise ValueError("not a row: a JSON object with an integer 'step' is expected")
    return row


def _csv_row(line: str) -> dict[str, Any]:
    fields = next(csv.reader([line]), [])
    if len(fields) != len(COLUMNS):
        raise ValueError(f"{len(fields)} fields, {len(COLUMNS)} expected ({','.join(COLUMNS)})")
    try:
        return {k: (None if v == "" else (int(v) if k == "step" else float(v))) for k, v in zip(COLUMNS, fields)}
    except ValueError:
        raise ValueError(f"a value is not a number: {line.strip()!r}") from None
