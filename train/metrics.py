"""The per-step metrics file: JSON lines, or CSV when the name ends in ``.csv``.

One row per optimizer step with the columns of :data:`COLUMNS`; ``valid_loss`` / ``valid_ppl``
are filled on the steps where validation ran (JSONL omits them elsewhere, CSV leaves them
empty). On ``--resume`` the rows after the checkpoint's step are dropped (those steps run again
and produce the same values); a fresh run refuses to overwrite a non-empty file.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from jremat.train.cli import UsageError

COLUMNS = ("step", "loss", "perplexity", "lr", "step_time_s", "tokens_per_s", "valid_loss", "valid_ppl")


class MetricsFile:
    """Append-only writer of per-step metrics rows.

    Args:
      path: the file; ``.csv`` selects CSV, anything else JSON lines.
      resume_step: when resuming, keep the existing rows with ``step <= resume_step`` and
        append after them; ``None`` for a fresh run.

    Raises:
      UsageError: if the file cannot be written, or a fresh run would overwrite existing rows.
    """

    def __init__(self, path: str | os.PathLike, *, resume_step: int | None = None):
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
        kept = [r for r in read_rows(self.path) if int(r["step"]) <= resume_step] if exists else []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w", newline="") as handle:
                if self.is_csv:
                    writer = csv.DictWriter(handle, fieldnames=COLUMNS)
                    writer.writeheader()
                    writer.writerows(kept)
                else:
                    handle.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(tmp, self.path)
            self._handle = open(self.path, "a", newline="")
        except OSError as err:
            with contextlib.suppress(OSError, UnboundLocalError):
                tmp.unlink(missing_ok=True)  # never leave the half-made file behind
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


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a metrics file written by :class:`MetricsFile`, as dicts with numbers parsed."""
    path = Path(path)
    with open(path, newline="") as handle:
        if path.suffix.lower() == ".csv":
            rows = []
            for raw in csv.DictReader(handle):
                rows.append({k: (None if v == "" else (int(v) if k == "step" else float(v))) for k, v in raw.items()})
            return rows
        return [json.loads(line) for line in handle if line.strip()]
