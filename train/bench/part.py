"""What a bench part is: :class:`Part` (its run, columns, targets, tables) and :class:`Target` (a verdict line and its miss note)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jremat.models import ModelConfig
from jremat.train.bench.config import BenchConfig
from jremat.train.bench.rows import make_row


@dataclasses.dataclass(frozen=True)
class Target:
    """One line of the verdict.

    Attributes:
      text: what is aimed at.
      measured: what the rows give.
      met: whether ``measured`` meets ``text``.
      miss_note: why this target can be missed; the report lists the notes of the missed targets
        ("" for none).
    """

    text: str
    measured: str
    met: bool
    miss_note: str = ""


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the bench: what it runs, the columns of its rows, its targets and its report tables.

    Attributes:
      name: the ``--parts`` name; its rows go to ``bench-<name>.csv`` (:attr:`csv_name`).
      run: ``(config, policies) -> rows``, each made by :meth:`row`.
      columns: the columns of its rows and of its CSV file, in order.
      targets: ``(its rows) -> [Target]``, the verdict lines its rows cover (none without rows).
      tables: ``(its rows, plot file names, plot folder) -> markdown lines``; called only for a part
        with rows (:func:`train.bench.parts.part_of_rows` leaves out the others).
      row_parts: the values of its rows' ``part`` column (default: ``(name,)``).
    """

    name: str
    run: Callable[[BenchConfig, Sequence[str]], list[dict]]
    columns: tuple[str, ...]
    targets: Callable[[list[dict]], list[Target]]
    tables: Callable[[list[dict], Sequence[str], str], list[str]]
    row_parts: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.row_parts:
            object.__setattr__(self, "row_parts", (self.name,))

    @property
    def csv_name(self) -> str:
        """The file name of its rows: ``bench-<name>.csv``."""
        return f"bench-{self.name}.csv"

    def row(self, policy: str, cfg: ModelConfig, batch: int, seq: int, *, part: str = "", **values) -> dict:
        """One row of this part (:func:`train.bench.rows.make_row`); ``part`` (default :attr:`name`) is one of
        :attr:`row_parts`.

        Raises:
          ValueError: for a ``part`` not in :attr:`row_parts`, or a value for a column this part does not have.
        """
        part = part or self.name
        if part not in self.row_parts:
            raise ValueError(f"part {self.name!r} writes rows of {', '.join(self.row_parts)}, not {part!r}")
        return make_row(self.columns, part, policy, cfg, batch, seq, **values)

    def own_rows(self, rows: Sequence[dict]) -> list[dict]:
        """The rows of ``rows`` that are this part's (by their ``part`` column), in order."""
        return [r for r in rows if r["part"] in self.row_parts]
