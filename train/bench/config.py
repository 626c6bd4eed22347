"""What ``python -m train.bench`` runs: :class:`BenchConfig`, its sizes, and the command line."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Sequence

from jremat import registry
from models import PRESETS, ModelConfig
from models import preset as model_preset
from train.config import OneLineErrorParser, UsageError

PARTS = ("needle", "needle_time", "megatron", "maxbatch", "time", "peers", "auto")

#: Policies of the ``time`` and ``auto`` parts, in table order.
DEFAULT_POLICIES = (
    "none", "full", "every_k:k=2", "every_k:k=4", "selective", "dots", "dots_no_batch", "nested:block=auto",
)
#: Policies of the ``megatron`` part (its analytic peak estimate is checked against the compile), and
#: the built-ins ``auto`` is timed against (those of ``--policy`` that are in this list).
MEGATRON_POLICIES = ("none", "selective", "every_k:k=4", "dots", "full")
#: Policies of the ``maxbatch`` part.
MAXBATCH_POLICIES = ("none", "full")

#: The block-dominated model of the ``time`` and ``peers`` parts (the head is small next to 6 blocks).
BLOCK_MODEL = dict(n_layers=6, d_model=256, n_heads=4, head_dim=64, d_ff=1024, vocab_size=256, max_seq_len=128)
#: Its ``--quick`` version.
BLOCK_MODEL_QUICK = dict(n_layers=2, d_model=32, n_heads=2, head_dim=16, d_ff=64, vocab_size=64, max_seq_len=16)

#: Sizes of ``--quick`` (the smoke test); every field left unset takes these, or FULL_SIZES.
QUICK_SIZES: dict[str, Any] = dict(
    needle_batches=(8, 16), needle_d_ff=64, needle_d_ffs=(32, 64), needle_batch=16, needle_ks=(0, 1, 2),
    needle_time_batch=4, megatron_preset="tiny", megatron_batch=2, megatron_seq=16, maxbatch_budget_gib=0.002,
    maxbatch_seq=16, time_preset="tiny", time_batch=4, block_batch=2, time_steps=5, time_rounds=1,
    auto_budget_fractions=(0.5,),
)
FULL_SIZES: dict[str, Any] = dict(
    needle_batches=(256, 512, 1024, 2048), needle_d_ff=2048, needle_d_ffs=(256, 512, 1024, 2048),
    needle_batch=2048, needle_ks=(0, 1, 2, 4, 8), needle_time_batch=64, megatron_preset="gpt2-small",
    megatron_batch=8, megatron_seq=1024, maxbatch_budget_gib=16.0, maxbatch_seq=1024, time_preset="small",
    time_batch=20, block_batch=8, time_steps=20, time_rounds=20, auto_budget_fractions=(0.1, 0.5, 0.9),
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What ``python -m train.bench`` runs; one field per command-line flag (``a_b`` <-> ``--a-b``).

    Size fields left ``None`` take :data:`FULL_SIZES`, or :data:`QUICK_SIZES` with ``quick``.

    Attributes:
      out: folder of the CSV and PNG plots.
      report: the markdown report regenerated from this run ("" = none).
      parts: parts to run, from :data:`PARTS`.
      policy: policy specs of the ``time`` and ``auto`` parts.
      quick: tiny sizes for a smoke test.
      needle_batches: batch sizes of Needle figure 1.
      needle_d_ff: ``d_ff`` of Needle figures 1 and 3.
      needle_d_ffs: ``d_ff`` values of Needle figure 2.
      needle_batch: batch size of Needle figure 2.
      needle_ks: the k values of Needle figure 3 (0 = ``none``).
      needle_time_batch: batch size of Needle figure 3.
      megatron_preset: model preset of the Megatron comparison and the max-batch search.
      megatron_batch: its batch size.
      megatron_seq: its sequence length.
      maxbatch_budget_gib: the memory budget of the max-batch search, GiB.
      maxbatch_seq: sequence length of the max-batch search.
      time_preset: the head-dominated model of the ``time`` part.
      time_batch: its batch size.
      block_batch: batch size of the block-dominated model (:data:`BLOCK_MODEL`) in ``time`` and ``peers``.
      time_steps: timed steps per program, after one warm-up step.
      time_rounds: interleaved rounds the steps are split into.
      auto_budget_fractions: where the ``auto`` part's budgets sit between full's (0) and none's (1) peak.
      seed: parameter-initialization and data seed.
      remat_head_chunks: every policy except ``none`` also rematerializes the final LayerNorm,
        head and loss over this many sequence chunks, so a policy covers the whole step as the
        Needle study's does; 0 applies policies to the blocks only.
    """

    out: str = "docs/results"
    report: str = "docs/RESULTS.md"
    parts: tuple[str, ...] = PARTS
    policy: tuple[str, ...] = DEFAULT_POLICIES
    quick: bool = False
    needle_batches: tuple[int, ...] | None = None
    needle_d_ff: int | None = None
    needle_d_ffs: tuple[int, ...] | None = None
    needle_batch: int | None = None
    needle_ks: tuple[int, ...] | None = None
    needle_time_batch: int | None = None
    megatron_preset: str | None = None
    megatron_batch: int | None = None
    megatron_seq: int | None = None
    maxbatch_budget_gib: float | None = None
    maxbatch_seq: int | None = None
    time_preset: str | None = None
    time_batch: int | None = None
    block_batch: int | None = None
    time_steps: int | None = None
    time_rounds: int | None = None
    auto_budget_fractions: tuple[float, ...] | None = None
    seed: int = 0
    remat_head_chunks: int = 4

    def __post_init__(self):
        for name, value in (QUICK_SIZES if self.quick else FULL_SIZES).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if not self.parts or any(p not in PARTS for p in self.parts):
            raise UsageError(f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {','.join(self.parts)!r}")
        if not self.policy:
            raise UsageError("give at least one --policy")
        for name in ("needle_d_ff", "needle_batch", "needle_time_batch", "megatron_batch", "megatron_seq",
                     "maxbatch_seq", "time_batch", "block_batch", "time_rounds", "time_steps"):
            _positive(name, getattr(self, name))
        for name in ("needle_batches", "needle_d_ffs"):
            if not getattr(self, name):
                raise UsageError(f"--{name.replace('_', '-')} needs at least one value")
            for v in getattr(self, name):
                _positive(name, v)
        if not self.needle_ks or any(not isinstance(k, int) or k < 0 for k in self.needle_ks):
            raise UsageError(f"--needle-ks must be integers >= 0 (0 = none), got {self.needle_ks!r}")
        if self.time_rounds > self.time_steps:
            raise UsageError(f"--time-rounds {self.time_rounds} exceeds --time-steps {self.time_steps}: "
                             "every round needs at least one step")
        if not (isinstance(self.maxbatch_budget_gib, (int, float)) and math.isfinite(self.maxbatch_budget_gib)
                and self.maxbatch_budget_gib > 0):
            raise UsageError(f"--maxbatch-budget-gib must be a positive number, got {self.maxbatch_budget_gib!r}")
        for name in ("megatron_preset", "time_preset"):
            if getattr(self, name) not in PRESETS:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is not a preset; "
                                 f"valid presets: {', '.join(PRESETS)}")
        if not self.auto_budget_fractions or any(not 0 < f < 1 for f in self.auto_budget_fractions):
            raise UsageError(f"--auto-budget-fractions must be numbers in (0, 1), got {self.auto_budget_fractions!r}")
        if not isinstance(self.remat_head_chunks, int) or self.remat_head_chunks < 0:
            raise UsageError(f"--remat-head-chunks must be an integer >= 0, got {self.remat_head_chunks!r}")
        for seq in (PRESETS["needle"].max_seq_len, self.maxbatch_seq, self.block_model().max_seq_len,
                    PRESETS[self.time_preset].max_seq_len):
            if self.remat_head_chunks and seq % self.remat_head_chunks:
                raise UsageError(f"--remat-head-chunks {self.remat_head_chunks} does not divide sequence length {seq}")
        for name in ("megatron_seq", "maxbatch_seq"):
            limit = PRESETS[self.megatron_preset].max_seq_len
            if getattr(self, name) > limit:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)} exceeds preset "
                                 f"{self.megatron_preset!r}'s max_seq_len {limit}")

    def whole_step(self, cfg: ModelConfig, policy: Any) -> ModelConfig:
        """``cfg`` under ``policy``, with the head and loss rematerialized too unless the policy is ``none``."""
        chunks = 0 if policy == "none" else self.remat_head_chunks
        return cfg.replace(remat_policy=policy, remat_head_chunks=chunks)

    def megatron_config(self, policy: str, **changes) -> ModelConfig:
        """The Megatron comparison's model: the preset in bf16 compute, f32 parameters, dropout 0.1."""
        overrides = dict(dtype="bfloat16", param_dtype="float32", attn_dropout=0.1, resid_dropout=0.1,
                         remat_policy=policy, remat_granularity="block", **changes)
        return model_preset(self.megatron_preset, **overrides)

    def block_model(self, **changes) -> ModelConfig:
        """The block-dominated model (:data:`BLOCK_MODEL`, or its quick version), dropout 0."""
        shapes = BLOCK_MODEL_QUICK if self.quick else BLOCK_MODEL
        return ModelConfig(**{**shapes, "attn_dropout": 0.0, "resid_dropout": 0.0, **changes})


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; one flag per :class:`BenchConfig` field (help: the field's docstring line)."""
    p = OneLineErrorParser(prog="python -m train.bench", description="Memory and time of every remat policy and "
                           "its peers; regenerates docs/RESULTS.md.")
    kinds = {"tuple[int, ...] | None": _ints, "tuple[float, ...] | None": _floats, "int | None": int, "int": int,
             "float | None": float, "str | None": str, "str": str}
    for field in dataclasses.fields(BenchConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "parts":
            p.add_argument(flag, default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
        elif field.name == "policy":
            p.add_argument(flag, action="append", default=None, help="policy spec (repeatable)")
        elif field.type == "bool":
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=kinds[field.type], default=field.default)
    return p


def parse_config(argv: Sequence[str] | None) -> BenchConfig:
    """Parse flags into a :class:`BenchConfig`.

    Raises:
      UsageError: on a bad flag or value, or a malformed / unknown policy.
    """
    values = vars(build_parser().parse_args(argv))
    values["parts"] = tuple(p.strip() for p in values["parts"].split(",") if p.strip())
    for spec in values["policy"] or ():
        try:
            registry.resolve(spec)
        except ValueError as err:
            raise UsageError(f"bad --policy: {err}") from None
    values["policy"] = tuple(values["policy"] or DEFAULT_POLICIES)
    return BenchConfig(**values)
