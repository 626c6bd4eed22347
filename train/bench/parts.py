"""The bench's parts, :data:`BENCH_PARTS` (one :class:`~train.bench.part.Part` each, in run order), and the
check of every ``--policy`` against the models of the parts that run it (:func:`check_policies`).

Each part lives in its own module: :mod:`~train.bench.part_needle` (``needle``, ``needle_time``),
:mod:`~train.bench.part_megatron`, :mod:`~train.bench.part_maxbatch`, :mod:`~train.bench.part_time`,
:mod:`~train.bench.part_peers`, :mod:`~train.bench.part_auto`, :mod:`~train.bench.part_fit`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jremat.models import ModelConfig
from jremat.train.bench.config import BenchConfig
from jremat.train.bench.part import Part
from jremat.train.bench.part_auto import AUTO, auto_part_specs
from jremat.train.bench.part_fit import FIT
from jremat.train.bench.part_maxbatch import MAXBATCH
from jremat.train.bench.part_megatron import MEGATRON
from jremat.train.bench.part_needle import NEEDLE, NEEDLE_TIME
from jremat.train.bench.part_peers import PEERS
from jremat.train.bench.part_time import TIME, time_models
from jremat.train.cli import UsageError
from jremat.train.programs import loss_program

#: Part name -> part, in run order (the names are :data:`train.bench.config.PARTS`).
BENCH_PARTS: dict[str, Part] = {p.name: p for p in (NEEDLE, NEEDLE_TIME, MEGATRON, MAXBATCH, TIME, PEERS, AUTO, FIT)}


def owner(row_part: str) -> Part:
    """The part whose rows carry ``row_part`` in their ``part`` column (``needle_batch``: ``needle``).

    Raises:
      KeyError: if no part writes such rows.
    """
    for part in BENCH_PARTS.values():
        if row_part in part.row_parts:
            return part
    raise KeyError(f"no bench part writes rows of {row_part!r}")


def part_of_rows(rows: list[dict]) -> dict[str, list[dict]]:
    """``rows`` grouped by the part that made them (its name -> its rows, in run order; parts without rows left out)."""
    grouped = {name: part.own_rows(rows) for name, part in BENCH_PARTS.items()}
    return {name: own for name, own in grouped.items() if own}


def policy_models(config: BenchConfig) -> list[tuple[str, str, str, Callable[[], ModelConfig]]]:
    """``(part, model, spec, build)`` of every ``--policy`` on every model of the requested parts
    that runs it (``time``: both of its models, whole step; ``auto``: its model); ``build()``
    gives the model config under the policy."""
    out = []
    if "time" in config.parts:
        for model, cfg, _ in time_models(config):
            out += [
                ("time", model, spec, lambda cfg=cfg, spec=spec: config.whole_step(cfg, spec)) for spec in config.policy
            ]
    if "auto" in config.parts:
        cfg = config.time_model()
        out += [
            ("auto", config.time_preset, spec, lambda spec=spec: cfg.replace(remat_policy=spec))
            for spec in auto_part_specs(config.policy)
        ]
    return out


def check_policies(config: BenchConfig) -> None:
    """Check every ``--policy`` against every model of the requested parts that runs it, before any
    part runs: the model is built and its loss traced at batch 1 (nothing is compiled).

    Raises:
      UsageError: for a policy that does not apply to such a model (``nested:block=3`` on 2 layers,
        ``names:save=`` a tag the model's attention does not have).
    """
    for part, model, spec, build in policy_models(config):
        try:
            loss, args = loss_program(build(), 1)
            jax.make_jaxpr(loss)(*args)
        except ValueError as err:
            raise UsageError(f"--policy {spec!r} does not apply to the {model} model of part {part}: {err}") from None
