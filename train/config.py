"""Training configuration: a frozen :class:`TrainConfig`, per-preset defaults, and the CLI errors.

Every field of :class:`TrainConfig` is one command-line flag of ``python -m train.ptb``
(``batch_size`` <-> ``--batch-size``), except :attr:`TrainConfig.policy_keys`, which collects the
generated per-policy-key flags (``--k 4`` -> ``(("k", "4"),)``). Fields left at ``None`` by the
user take the defaults of the chosen model preset from :data:`TRAIN_PRESETS`.

Sequence length: ``--seq-len`` defaults to the preset's ``max_seq_len`` (its number of learned
positions) and may be set lower, never higher; the model's position table is never resized.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jremat import parse_budget, registry
from jremat.models import PRESETS, ModelConfig
from jremat.models import preset as model_preset
from jremat.models.config import NO_DROPOUT_ATTENTIONS, whole_step_head_chunks
from jremat.train import model_flags
from jremat.train.cli import SWITCH_KEYS, UsageError, option, registered_policy_params, require_keys_taken
from jremat.train.value_checks import check_mesh_flag, require, require_int, require_number, require_one_budget


@dataclasses.dataclass(frozen=True)
class TrainConfig(model_flags.ModelFlags):
    """Everything a PTB training run depends on (with the model preset it names).

    Attributes are documented by their ``metadata["help"]``, which is also the CLI help; the
    model flags are :class:`train.model_flags.ModelFlags`' (``--dtype`` and ``--granularity`` left
    unset take the preset's). ``ckpt_dir``, ``ckpt_every`` and ``keep_checkpoints`` are about the
    training-state files (:mod:`train.state_files`; each saved step is an orbax checkpoint, hence the
    flags' names), not about :func:`jremat.checkpoint`.
    """

    policy: str = option("full", "remat policy name or spec (NAME or NAME:key=value,...)", metavar="SPEC")
    policy_keys: tuple = option((), "policy keys given as separate flags, as (key, raw value) pairs", cli=False)
    policy_module: tuple[str, ...] = option(
        (), "import this module first (it may register custom policies)", metavar="MODULE"
    )
    batch_size: str | int | None = option(
        None,
        "sequences per micro-batch (preset default), or auto: the batch with the highest measured tokens/s "
        "whose train step fits --memory-budget (with --policy auto, the policy too; on --mesh, per device; train.fit)",
    )
    steps: int | None = option(None, "optimizer steps (preset default unless --epochs)")
    epochs: float | None = option(None, "passes over the training split instead of --steps")
    lr: float = option(3e-3, "peak AdamW learning rate")
    warmup: int | None = option(None, "linear warmup steps, then cosine decay to lr/10 (preset default)")
    clip: float = option(1.0, "global gradient-norm clip (0 disables)")
    weight_decay: float = option(0.01, "AdamW decoupled weight decay")
    accum: int = option(1, "micro-batches accumulated per optimizer step (optax.MultiSteps)")
    seed: int = option(0, "seed for initialization and dropout")
    eval_every: int | None = option(None, "valid perplexity every N steps (0: only at the end)")
    eval_batches: int = option(0, "limit each evaluation to N batches (0: the whole split)")
    ckpt_dir: str | None = option(None, "directory of the training-state files (none: save no training state)")
    ckpt_every: int = option(
        100, "save the training state every N steps (0: only at the end); also at the end and on Ctrl-C or SIGTERM"
    )
    keep_checkpoints: int = option(3, "how many most recent saved steps of the training state to keep")
    resume: bool = option(False, "continue from the latest saved step in --ckpt-dir")
    metrics_file: str | None = option(None, "per-step metrics file: JSON lines, or CSV if it ends in .csv")
    data_dir: str | None = option(None, "folder with ptb.{train,valid,test}.txt (else $JREMAT_PTB_DIR, else cache)")
    memory_report: bool = option(True, "print the compile-time memory report at start")
    mesh: str | None = option(
        None,
        "device mesh AXIS=SIZE,... over data, fsdp, tensor, sequence (and expert for --moe-experts), e.g. data=4,fsdp=2 "
        "(sizes multiply to the device count; default: one device, no sharding)",
    )
    init_timeout_s: float = option(
        300.0, "multi-process runs: seconds to wait for the coordinator and for every process to connect"
    )
    memory_budget: str | None = option(
        None,
        "budget for --policy auto: 6GiB, 512MiB, bytes, or a fraction in (0, 1] (of none's peak above full's); "
        "for --batch-size auto, a size",
    )

    def __post_init__(self):
        self.check_arguments()
        self._check_policy()

    def check_arguments(self) -> None:
        """Fill in the preset's defaults and check every value that needs no policy (nor JAX).

        Run by ``__post_init__``, and by the CLI on its flags before JAX is imported
        (:func:`train.cli.check_before_imports`).

        Raises:
          UsageError: the first bad value.
        """
        if isinstance(self.ckpt_dir, str) and self.ckpt_dir.strip().lower() in ("none", ""):
            object.__setattr__(self, "ckpt_dir", None)  # --ckpt-dir none: no checkpoints (not a folder named none)
        if self.preset not in PRESETS:
            raise UsageError(f"unknown preset {self.preset!r}; valid presets: {', '.join(PRESETS)}")
        defaults = TRAIN_PRESETS[self.preset]
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if isinstance(self.batch_size, str):
            text = self.batch_size.strip().lower()
            if text != AUTO_BATCH:
                try:
                    text = int(text)
                except ValueError:
                    raise UsageError(
                        f"--batch-size must be a positive whole number or {AUTO_BATCH}, got {self.batch_size!r}"
                    ) from None
            object.__setattr__(self, "batch_size", text)
        for name, preset_field in (("dtype", "dtype"), ("granularity", "remat_granularity")):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(PRESETS[self.preset], preset_field))
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", model_flags.positions(self))
        if self.steps is None and self.epochs is None:
            object.__setattr__(self, "steps", DEFAULT_STEPS[self.preset])
        if self.batch_size == AUTO_BATCH:
            require(
                self.memory_budget is not None,
                "--batch-size auto needs --memory-budget, a size such as 12GiB (the train step's compiled peak)",
            )
            require(self.accum == 1, "--batch-size auto chooses the batch of one optimizer step: leave --accum at 1")
            require(
                not self.resume,
                "--resume continues with the checkpoint's batch: give it as --batch-size N (the run that wrote "
                "the checkpoint logged it)",
            )
        else:
            require_int("batch_size", self.batch_size)
        model_flags.check(self, self.seq_len)  # --max-seq-len, then --seq-len (its default is --max-seq-len)
        require(self.steps is None or self.epochs is None, "give --steps or --epochs, not both")
        if self.steps is not None:
            require_int("steps", self.steps)
        if self.epochs is not None:
            require_number("epochs", self.epochs)
        require_number("lr", self.lr)
        require_int("warmup", self.warmup, minimum=0)
        require_number("clip", self.clip, inclusive=True)
        require_number("weight_decay", self.weight_decay, inclusive=True)
        require_int("accum", self.accum)
        self.check_model_flags()
        require_int("eval_every", self.eval_every, minimum=0)
        require_int("eval_batches", self.eval_batches, minimum=0)
        require_int("ckpt_every", self.ckpt_every, minimum=0)
        require_int("keep_checkpoints", self.keep_checkpoints)
        if self.remat_head_chunks is None:
            object.__setattr__(self, "remat_head_chunks", whole_step_head_chunks(self.policy, self.seq_len))
        require_int("remat_head_chunks", self.remat_head_chunks, minimum=0)
        require_number("init_timeout_s", self.init_timeout_s)
        require(
            self.remat_head_chunks == 0 or self.seq_len % self.remat_head_chunks == 0,
            f"--remat-head-chunks {self.remat_head_chunks} does not divide --seq-len {self.seq_len}",
        )
        require(not self.resume or self.ckpt_dir, "--resume needs --ckpt-dir (the directory to resume from)")

    def _check_policy(self) -> None:
        """The checks that read the policy registry (and so import JAX): the policy, --mesh, --memory-budget."""
        spec = self.policy_spec()  # raises UsageError on a bad policy
        if self.mesh is not None:  # syntax and divisibility here; the device count when the mesh is built
            check_mesh_flag(self.mesh, None if self.batch_size == AUTO_BATCH else self.batch_size, self.seq_len)
            model_flags.check_expert_mesh(self.mesh, self.moe_experts)
        if self.memory_budget is not None:
            require(
                self.resolved_policy().name == "auto" or self.batch_size == AUTO_BATCH,
                f"--memory-budget applies only to --policy auto or --batch-size auto, not to --policy {spec!r}",
            )
            require_one_budget(
                [spec], self.memory_budget, "--batch-size auto" if self.batch_size == AUTO_BATCH else None
            )
            try:
                budget = parse_budget(self.memory_budget)
            except ValueError as err:
                raise UsageError(str(err)) from None
            require(
                budget.bytes is not None or self.batch_size != AUTO_BATCH,
                f"--batch-size auto needs --memory-budget as a size (12GiB, 512MiB or bytes), not the fraction "
                f"{self.memory_budget!r}: the batch is chosen, so there is no single no-remat peak to take a share of",
            )

    def policy_spec(self) -> str:
        """The canonical policy spec of ``--policy`` with the per-key flags applied.

        Raises:
          UsageError: as :meth:`resolved_policy`.
        """
        return self.resolved_policy().spec

    def resolved_policy(self) -> registry.ResolvedSpec:
        """``--policy`` with the per-key flags applied, parsed and resolved once per config (the
        edge: what flows inward is this, not the text).

        Raises:
          UsageError: unknown policy or module, unknown key, or a bad value (message from the registry);
            a switch flag (``--keep-gathered``) the policy does not take (``none`` leaves it as it is).
        """
        if (cached := self.__dict__.get("_resolved_policy")) is not None:
            return cached
        try:
            for module in self.policy_module:
                registry.load_module(module)
            switches = [key for key, _ in self.policy_keys if key in SWITCH_KEYS]
            require_keys_taken([self.policy], switches, registered_policy_params())
            resolved = registry.resolve_spec(self.policy, **dict(self.policy_keys))
        except UsageError:
            raise
        except ValueError as err:
            raise UsageError(f"bad policy {self.policy!r}: {err}") from None
        # A cache of a frozen config: not a field (equality, hashing and asdict see the fields only).
        object.__setattr__(self, "_resolved_policy", resolved)
        return resolved

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The model preset with this run's vocabulary, policy, granularity, dtype and dropout.

        Args:
          vocab_size: number of words in the training vocabulary (replaces the preset's).
        """
        changes: dict[str, Any] = dict(
            vocab_size=vocab_size,
            # The resolved policy itself where there is one: the model config does not parse it again.
            remat_policy=self.resolved_policy().policy or self.policy_spec(),
            remat_granularity=self.granularity,
            scan_layers=not self.unrolled,
            remat_head_chunks=self.remat_head_chunks,
            dtype=self.dtype,
            param_dtype="float32",
        )
        if self.dropout is not None:
            changes.update(attn_dropout=self.dropout, resid_dropout=self.dropout)
        shape = {k: v for k, v in changes.items() if k in ("vocab_size", "dtype", "attn_dropout", "resid_dropout")}
        attn_dropout = shape.get("attn_dropout", PRESETS[self.preset].attn_dropout)
        if self.resume and self.attention in NO_DROPOUT_ATTENTIONS and attn_dropout > 0:  # --dropout 0 is no way out
            raise UsageError(
                f"attention {self.attention!r} has no attention dropout, but "
                f"attn_dropout is {attn_dropout}; a resumed run keeps the checkpoint's dropout: resume with the "
                "original run's --attention and --dropout, or use --attention blockwise, which drops out inside "
                "the kernel"
            )
        try:  # the attention first, so that its errors are not reported as the policy's
            model_preset(self.preset, **shape, **model_flags.model_overrides(self))
        except ValueError as err:
            raise UsageError(str(err)) from None
        changes.update(model_flags.model_overrides(self))
        try:
            return model_preset(self.preset, **changes)
        except ValueError as err:  # a policy or layer grouping that does not fit the preset's layers
            raise UsageError(
                f"--policy {changes['remat_policy']!r} does not fit preset {self.preset!r}: {err}"
            ) from None

    def replace(self, **changes) -> TrainConfig:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


#: ``--batch-size auto``: chosen by the fit search.
AUTO_BATCH = "auto"

#: Per-preset defaults for the fields a user leaves unset (``None``).
TRAIN_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(batch_size=4, warmup=2, eval_every=10),
    "small": dict(batch_size=20, warmup=50, eval_every=100),
    "needle": dict(batch_size=20, warmup=50, eval_every=200),
    "gpt2-small": dict(batch_size=8, warmup=200, eval_every=500),
}

#: Optimizer steps when neither ``--steps`` nor ``--epochs`` is given: short runs on a 2-core CPU.
DEFAULT_STEPS: dict[str, int] = {"tiny": 20, "small": 300, "needle": 1000, "gpt2-small": 1000}

#: Model fields a resumed run may change: where and how remat applies, which changes no loss
#: beyond float rounding.
REMAT_FIELDS = ("remat_policy", "remat_granularity", "scan_layers", "remat_layer_policies", "remat_head_chunks")
#: Model fields that change how attention is computed, not its parameters or dropout masks: a
#: resumed run may change them too.
ATTENTION_FIELDS = ("attention", "attention_block_size")
#: Training fields that decide which tokens each step reads: a resume must keep them.
DATA_FIELDS = ("batch_size", "seq_len", "accum")
#: Optimizer and schedule fields: a resume may change them, with a warning (the losses differ).
OPTIMIZER_FIELDS = ("steps", "epochs", "lr", "warmup", "clip", "weight_decay")


def resume_differences(meta: dict, cfg: TrainConfig, model_fields: dict, vocab_md5: str) -> tuple[list[str], list[str]]:
    """What differs between a checkpoint and the run that resumes it.

    Args:
      meta: the checkpoint's metadata (``model``, ``train``, ``vocab_md5``).
      cfg: the resuming run's configuration.
      model_fields: the resuming run's model config as JSON values.
      vocab_md5: the resuming run's vocabulary fingerprint.

    Returns:
      ``(refused, notes)``: ``field: checkpoint X, this run Y`` for every model field but the
      remat ones, the data fields and the vocabulary (a resume must not change them); and lines
      to log for changed remat fields and optimizer fields.
    """
    stored_model, stored_train = meta.get("model", {}), meta.get("train", {})
    # A checkpoint written before a field existed holds the field's default.
    stored_model = {f.name: f.default for f in dataclasses.fields(ModelConfig)} | stored_model
    refused = [
        f"{k}: checkpoint {stored_model.get(k)!r}, this run {v!r}"
        for k, v in model_fields.items()
        if k not in REMAT_FIELDS + ATTENTION_FIELDS and stored_model.get(k) != v
    ]
    refused += [
        f"--{k.replace('_', '-')}: checkpoint {stored_train.get(k)!r}, this run {getattr(cfg, k)!r}"
        for k in DATA_FIELDS
        if stored_train.get(k) != getattr(cfg, k)
    ]
    if meta.get("vocab_md5") != vocab_md5:
        refused.append("vocabulary: another training text (use the original --data-dir)")
    remat = [
        f"{k}: {stored_model.get(k)!r} -> {model_fields[k]!r}"
        for k in REMAT_FIELDS + ATTENTION_FIELDS
        if k in model_fields and stored_model.get(k) != model_fields[k]
    ]
    optimizer = [k for k in OPTIMIZER_FIELDS if stored_train.get(k) != getattr(cfg, k)]
    notes = []
    if remat:
        notes.append(
            f"note: remat changed since the checkpoint ({'; '.join(remat)}); losses stay equal up to float rounding"
        )
    if optimizer:
        notes.append(
            f"warning: resuming with changed {', '.join(optimizer)}; losses will differ from an uninterrupted run"
        )
    if "seed" in stored_train and stored_train["seed"] != cfg.seed:
        notes.append(
            f"note: --seed {cfg.seed} differs from the checkpoint's {stored_train['seed']}; the run continues with "
            "the checkpoint's random key (the seed only starts a fresh run)"
        )
    return refused, notes
