"""Training configuration: a frozen :class:`TrainConfig`, per-preset defaults, and the CLI errors.

Every field of :class:`TrainConfig` is one command-line flag of ``python -m train.ptb``
(``batch_size`` <-> ``--batch-size``), except :attr:`TrainConfig.policy_keys`, which collects the
generated per-policy-key flags (``--k 4`` -> ``(("k", "4"),)``). Fields left at ``None`` by the
user take the defaults of the chosen model preset from :data:`TRAIN_PRESETS`.

Sequence length: ``--seq-len`` defaults to the preset's ``max_seq_len`` (its number of learned
positions) and may be set lower, never higher; the model's position table is never resized.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import jremat
from jremat import registry
from models import PRESETS, ModelConfig
from models import preset as model_preset
from models.config import DTYPES
from train import sharding
from jremat.planner import parse_budget


class UsageError(ValueError):
    """Bad user input: the CLI prints the message and exits with code 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors raise :class:`UsageError` (one line, exit 2, no usage dump)."""

    def error(self, message):
        raise UsageError(message)


def _field(default, help_text: str, **cli):
    return dataclasses.field(default=default, metadata={"help": help_text, **cli})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a PTB training run depends on (with the model preset it names).

    Attributes are documented by their ``metadata["help"]``, which is also the CLI help.
    """

    preset: str = _field("small", "model preset", choices=tuple(PRESETS))
    policy: str = _field("full", "remat policy name or spec (NAME or NAME:key=value,...)")
    policy_keys: tuple = _field((), "policy keys given as separate flags, as (key, raw value) pairs", cli=False)
    policy_module: str | None = _field(None, "import this module first (it may register custom policies)")
    granularity: str = _field("block", "where remat applies", choices=jremat.GRANULARITIES)
    batch_size: int | None = _field(None, "sequences per micro-batch (preset default)", type=int)
    seq_len: int | None = _field(None, "tokens per sequence; <= the preset's max_seq_len (default: equal)", type=int)
    steps: int | None = _field(None, "optimizer steps (preset default unless --epochs)", type=int)
    epochs: float | None = _field(None, "passes over the training split instead of --steps", type=float)
    lr: float = _field(3e-3, "peak AdamW learning rate", type=float)
    warmup: int | None = _field(None, "linear warmup steps, then cosine decay to lr/10 (preset default)", type=int)
    clip: float = _field(1.0, "global gradient-norm clip (0 disables)", type=float)
    weight_decay: float = _field(0.01, "AdamW decoupled weight decay", type=float)
    dtype: str = _field("float32", "compute dtype; parameters stay float32", choices=DTYPES)
    accum: int = _field(1, "micro-batches accumulated per optimizer step (optax.MultiSteps)", type=int)
    seed: int = _field(0, "seed for initialization and dropout", type=int)
    dropout: float | None = _field(None, "attention and residual dropout rate (preset default)", type=float)
    eval_every: int | None = _field(None, "valid perplexity every N steps (0: only at the end)", type=int)
    eval_batches: int = _field(0, "limit each evaluation to N batches (0: the whole split)", type=int)
    ckpt_dir: str | None = _field(None, "orbax checkpoint directory (none: no checkpoints)")
    ckpt_every: int = _field(100, "checkpoint every N steps (also at the end and on Ctrl-C)", type=int)
    keep_checkpoints: int = _field(3, "how many most recent checkpoints to keep", type=int)
    resume: bool = _field(False, "continue from the latest checkpoint in --ckpt-dir", action="store_true")
    metrics_file: str | None = _field(None, "per-step metrics file: JSON lines, or CSV if it ends in .csv")
    unrolled: bool = _field(False, "unroll the layer loop instead of lax.scan", action="store_true")
    remat_head_chunks: int = _field(
        0, "remat the final LayerNorm, head and loss over N sequence chunks (0: keep their logits)", type=int
    )
    data_dir: str | None = _field(None, "folder with ptb.{train,valid,test}.txt (else $JREMAT_PTB_DIR, else cache)")
    memory_report: bool = _field(True, "print the compile-time memory report at start", action="bool")
    mesh: str | None = _field(None, "device mesh AXIS=SIZE,... over data, fsdp, tensor, sequence, e.g. data=4,fsdp=2 "
                                    "(sizes multiply to the device count; default: one device, no sharding)")
    init_timeout_s: float = _field(
        300.0, "multi-process runs: seconds to wait for the coordinator and for every process to connect", type=float
    )
    memory_budget: str | None = _field(
        None, "budget for --policy auto: 6GiB, 512MiB, bytes, or a fraction in (0, 1] (of none's peak above full's)"
    )

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise UsageError(f"unknown preset {self.preset!r}; valid presets: {', '.join(PRESETS)}")
        defaults = TRAIN_PRESETS[self.preset]
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", PRESETS[self.preset].max_seq_len)
        if self.steps is None and self.epochs is None:
            object.__setattr__(self, "steps", DEFAULT_STEPS[self.preset])
        self._validate()

    def _validate(self) -> None:
        def need(ok, message):
            if not ok:
                raise UsageError(message)

        def positive_int(name, value):
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")

        def non_negative_int(name, value):
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                 f"--{name.replace('_', '-')} must be an integer >= 0, got {value!r}")

        positive_int("batch_size", self.batch_size)
        positive_int("seq_len", self.seq_len)
        max_positions = PRESETS[self.preset].max_seq_len
        need(self.seq_len <= max_positions,
             f"--seq-len {self.seq_len} is longer than preset {self.preset!r} has positions "
             f"(max_seq_len {max_positions}); use --seq-len between 1 and {max_positions}")
        need(self.steps is None or self.epochs is None, "give --steps or --epochs, not both")
        if self.steps is not None:
            positive_int("steps", self.steps)
        if self.epochs is not None:
            need(math.isfinite(self.epochs) and self.epochs > 0, f"--epochs must be a positive number, got {self.epochs!r}")
        need(math.isfinite(self.lr) and self.lr > 0, f"--lr must be a positive number, got {self.lr!r}")
        non_negative_int("warmup", self.warmup)
        need(math.isfinite(self.clip) and self.clip >= 0, f"--clip must be >= 0 (0 disables), got {self.clip!r}")
        need(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
             f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        need(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        positive_int("accum", self.accum)
        need(self.dropout is None or 0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout!r}")
        non_negative_int("eval_every", self.eval_every)
        non_negative_int("eval_batches", self.eval_batches)
        non_negative_int("ckpt_every", self.ckpt_every)
        positive_int("keep_checkpoints", self.keep_checkpoints)
        non_negative_int("remat_head_chunks", self.remat_head_chunks)
        need(isinstance(self.init_timeout_s, (int, float)) and math.isfinite(self.init_timeout_s)
             and self.init_timeout_s > 0, f"--init-timeout-s must be a positive number of seconds, got {self.init_timeout_s!r}")
        need(self.remat_head_chunks == 0 or self.seq_len % self.remat_head_chunks == 0,
             f"--remat-head-chunks {self.remat_head_chunks} does not divide --seq-len {self.seq_len}")
        need(self.granularity in jremat.GRANULARITIES,
             f"--granularity must be one of {', '.join(jremat.GRANULARITIES)}, got {self.granularity!r}")
        need(not self.resume or self.ckpt_dir, "--resume needs --ckpt-dir (the directory to resume from)")
        spec = self.policy_spec()  # raises UsageError on a bad policy
        if self.mesh is not None:  # syntax and divisibility here; the device count when the mesh is built
            try:
                sizes = sharding.parse_mesh(self.mesh)
            except ValueError as err:
                raise UsageError(f"--mesh: {err}") from None
            ways = sizes["data"] * sizes["fsdp"]
            need(self.batch_size % ways == 0,
                 f"--batch-size {self.batch_size} does not split over --mesh {self.mesh} (data x fsdp = {ways}); "
                 f"use a multiple of {ways}")
            need(self.seq_len % sizes["sequence"] == 0,
                 f"--seq-len {self.seq_len} does not split over --mesh {self.mesh} (sequence = {sizes['sequence']}); "
                 f"use a multiple of {sizes['sequence']}")
        if self.memory_budget is not None:
            need(registry.parse_spec(spec)[0] == "auto",
                 f"--memory-budget applies only to --policy auto, not to {spec!r}")
            try:
                parse_budget(self.memory_budget)
            except ValueError as err:
                raise UsageError(str(err)) from None

    def policy_spec(self) -> str:
        """The canonical policy spec of ``--policy`` with the per-key flags applied.

        Raises:
          UsageError: unknown policy or module, unknown key, or a bad value (message from the registry).
        """
        try:
            if self.policy_module:
                registry.load_module(self.policy_module)
            return registry.resolve(self.policy, **dict(self.policy_keys)).spec
        except ValueError as err:
            raise UsageError(f"bad policy: {err}") from None

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The model preset with this run's vocabulary, policy, granularity, dtype and dropout.

        Args:
          vocab_size: number of words in the training vocabulary (replaces the preset's).
        """
        changes: dict[str, Any] = dict(
            vocab_size=vocab_size,
            remat_policy=self.policy_spec(),
            remat_granularity=self.granularity,
            scan_layers=not self.unrolled,
            remat_head_chunks=self.remat_head_chunks,
            dtype=self.dtype,
            param_dtype="float32",
        )
        if self.dropout is not None:
            changes.update(attn_dropout=self.dropout, resid_dropout=self.dropout)
        return model_preset(self.preset, **changes)

    def replace(self, **changes) -> "TrainConfig":
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


#: Per-preset defaults for the fields a user leaves unset (``None``).
TRAIN_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(batch_size=4, warmup=2, eval_every=10),
    "small": dict(batch_size=20, warmup=50, eval_every=100),
    "needle": dict(batch_size=20, warmup=50, eval_every=200),
    "gpt2-small": dict(batch_size=8, warmup=200, eval_every=500),
}

#: Optimizer steps when neither ``--steps`` nor ``--epochs`` is given: short runs on a 2-core CPU.
DEFAULT_STEPS: dict[str, int] = {"tiny": 20, "small": 300, "needle": 1000, "gpt2-small": 1000}

#: Fields whose change makes a resumed run's losses differ from an uninterrupted run's.
TRAJECTORY_FIELDS = (
    "batch_size", "seq_len", "steps", "epochs", "lr", "warmup", "clip", "weight_decay", "dtype", "accum",
    "seed", "dropout",
)


def config_fields() -> list[dataclasses.Field]:
    """The :class:`TrainConfig` fields that are command-line flags, in declaration order."""
    return [f for f in dataclasses.fields(TrainConfig) if f.metadata.get("cli", True)]


def flag_name(field_name: str) -> str:
    """``batch_size`` -> ``--batch-size``."""
    return "--" + field_name.replace("_", "-")
