"""What ``python -m train.bench`` runs: :class:`BenchConfig`, its sizes, and the command line."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jremat.models import PRESETS, ModelConfig
from jremat.models import preset as model_preset
from jremat.models.config import NO_DROPOUT_ATTENTIONS
from jremat.train import model_flags
from jremat.train.cli import UsageError, apply_policy_keys, option, parse
from jremat.train.usage import program_name
from jremat.train.value_checks import require_int

PARTS = ("needle", "needle_time", "megatron", "maxbatch", "time", "peers", "auto", "fit")

#: Policies of the ``time`` and ``auto`` parts, in table order.
DEFAULT_POLICIES = (
    "none",
    "full",
    "every_k:k=2",
    "every_k:k=4",
    "selective",
    "dots",
    "dots_no_batch",
    "nested:block=auto",
)
#: Policies of the ``megatron`` part (its analytic peak estimate is checked against the compile), and
#: the built-ins ``auto`` is timed against (those of ``--policy`` that are in this list).
MEGATRON_POLICIES = ("none", "selective", "every_k:k=4", "dots", "full")
#: Parts whose models take the MoE flags (``--moe-experts``): the others measure the dense model
#: against a reference that has no experts (the Needle study's figures, Megatron-LM's activation
#: formula, the Flax Linen and other libraries' dense blocks of ``peers``).
MOE_PARTS = ("time", "auto", "fit", "maxbatch")
#: Policies of the ``maxbatch`` part.
MAXBATCH_POLICIES = ("none", "full")

#: The block-dominated model of the ``time`` and ``peers`` parts (the head is small next to 6 blocks).
BLOCK_MODEL = dict(n_layers=6, d_model=256, n_heads=4, head_dim=64, d_ff=1024, vocab_size=256, max_seq_len=128)
#: Its ``--quick`` version.
BLOCK_MODEL_QUICK = dict(n_layers=2, d_model=32, n_heads=2, head_dim=16, d_ff=64, vocab_size=64, max_seq_len=16)

#: Sizes of ``--quick`` (the smoke test); every field left unset takes these, or FULL_SIZES.
QUICK_SIZES: dict[str, Any] = dict(
    needle_batches=(8, 16),
    needle_d_ff=64,
    needle_d_ffs=(32, 64),
    needle_batch=16,
    needle_ks=(0, 1, 2),
    needle_time_batch=4,
    megatron_preset="tiny",
    megatron_batch=2,
    megatron_seq=16,
    maxbatch_budget_gib=0.002,
    maxbatch_seq=16,
    time_preset="tiny",
    time_batch=4,
    block_batch=2,
    time_steps=5,
    time_rounds=1,
    auto_budget_fractions=(0.5,),
    fit_budget_fractions=(0.5,),
    fit_rounds=1,
)
FULL_SIZES: dict[str, Any] = dict(
    needle_batches=(256, 512, 1024, 2048),
    needle_d_ff=2048,
    needle_d_ffs=(256, 512, 1024, 2048),
    needle_batch=2048,
    needle_ks=(0, 1, 2, 4, 8),
    needle_time_batch=64,
    megatron_preset="gpt2-small",
    megatron_batch=8,
    megatron_seq=1024,
    maxbatch_budget_gib=16.0,
    maxbatch_seq=1024,
    time_preset="small",
    time_batch=20,
    block_batch=8,
    time_steps=20,
    time_rounds=20,
    auto_budget_fractions=(0.1, 0.5, 0.9),
    fit_budget_fractions=(0.25, 0.5, 0.75),
    fit_rounds=5,
)


def _sized(name: str, help: str, **kwargs) -> Any:
    """An :func:`~train.cli.option` defaulting to ``None``, whose help gives the full and quick sizes."""
    show = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return option(None, f"{help} (default {show(FULL_SIZES[name])}; with --quick {show(QUICK_SIZES[name])})", **kwargs)


@dataclasses.dataclass(frozen=True)
class BenchConfig(model_flags.ComputeFlags):
    """What ``python -m train.bench`` runs; one field per command-line flag (``a_b`` <-> ``--a-b``).

    Size fields left ``None`` take :data:`FULL_SIZES`, or :data:`QUICK_SIZES` with ``quick``.
    ``parts`` entries may be comma-separated (``--parts needle,time``). ``policy_keys`` collects
    the per-policy-key flags (``--k 4``); each applies to every ``--policy`` that takes the key.
    Every policy but ``none`` covers the whole step: the blocks, and the final LayerNorm, head
    and loss over ``remat_head_chunks`` sequence chunks (0: blocks only).
    """

    out: str = option("docs/results", "folder of the CSV and PNG plots")
    report: str = option("docs/RESULTS.md", "markdown report regenerated from this run (empty: none)")
    parts: tuple[str, ...] = option(PARTS, f"parts to run, comma-separated: {', '.join(PARTS)}", metavar="PART")
    policy: tuple[str, ...] = option(DEFAULT_POLICIES, "policy spec of the time and auto parts", metavar="SPEC")
    policy_keys: tuple = option((), "policy keys given as separate flags, as (key, raw value) pairs", cli=False)
    quick: bool = option(False, "tiny sizes (a smoke test)")
    needle_batches: tuple[int, ...] | None = _sized("needle_batches", "Needle figure 1 batch sizes")
    needle_d_ff: int | None = _sized("needle_d_ff", "Needle figures 1 and 3 d_ff")
    needle_d_ffs: tuple[int, ...] | None = _sized("needle_d_ffs", "Needle figure 2 d_ff values")
    needle_batch: int | None = _sized("needle_batch", "Needle figure 2 batch size")
    needle_ks: tuple[int, ...] | None = _sized("needle_ks", "Needle figure 3 k values (0 = none)")
    needle_time_batch: int | None = _sized("needle_time_batch", "Needle figure 3 batch size")
    megatron_preset: str | None = _sized(
        "megatron_preset", "model preset of the Megatron and max-batch parts", choices=tuple(PRESETS)
    )
    megatron_batch: int | None = _sized("megatron_batch", "Megatron batch size")
    megatron_seq: int | None = _sized("megatron_seq", "Megatron sequence length")
    maxbatch_budget_gib: float | None = _sized("maxbatch_budget_gib", "max-batch memory budget, GiB")
    maxbatch_seq: int | None = _sized("maxbatch_seq", "max-batch sequence length")
    time_preset: str | None = _sized("time_preset", "the head-dominated model of the time part", choices=tuple(PRESETS))
    time_batch: int | None = _sized("time_batch", "batch size of the head-dominated model")
    block_batch: int | None = _sized("block_batch", "batch size of the block-dominated model (time and peers)")
    time_steps: int | None = _sized("time_steps", "timed steps per program, after one warm-up step")
    time_rounds: int | None = _sized("time_rounds", "interleaved rounds the timed steps are split into")
    auto_budget_fractions: tuple[float, ...] | None = _sized(
        "auto_budget_fractions", "auto budgets, as fractions between full's (0) and none's (1) peak"
    )
    fit_budget_fractions: tuple[float, ...] | None = _sized(
        "fit_budget_fractions",
        "fit budgets, as fractions between full's (0) and none's (1) Adam-step peak at --time-batch",
    )
    fit_rounds: int | None = _sized("fit_rounds", "interleaved rounds of the fit part's timings (3 steps each)")
    dtype: str = model_flags.cli_default(
        "dtype",
        "float32",
        "used by the needle, needle_time, time, peers and auto models (megatron and maxbatch: bfloat16)",
    )
    seed: int = option(0, "parameter and data seed")
    remat_head_chunks: int = model_flags.cli_default("remat_head_chunks", 4, "under every policy but none")

    def __post_init__(self):
        self.check_arguments()
        object.__setattr__(self, "policy", apply_policy_keys(self.policy, self.policy_keys))
        object.__setattr__(self, "policy_keys", ())

    def check_arguments(self) -> None:
        """Fill in the sizes of ``--quick`` or the full run, and check every value but the policies (JAX
        only to ask for a GPU kernel's device).

        Run by ``__post_init__``, and by the CLI on its flags before JAX is imported
        (:func:`train.cli.check_before_imports`).

        Raises:
          UsageError: the first bad value.
        """
        object.__setattr__(self, "parts", tuple(p.strip() for item in self.parts for p in item.split(",") if p.strip()))
        for name, value in (QUICK_SIZES if self.quick else FULL_SIZES).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if not self.parts or any(p not in PARTS for p in self.parts):
            raise UsageError(
                f"--parts takes a comma-separated subset of {', '.join(PARTS)}, got {','.join(self.parts)!r}"
            )
        if not self.policy:
            raise UsageError("give at least one --policy")
        for name in (
            "needle_d_ff",
            "needle_batch",
            "needle_time_batch",
            "megatron_batch",
            "megatron_seq",
            "maxbatch_seq",
            "time_batch",
            "block_batch",
            "time_rounds",
            "time_steps",
        ):
            _positive(name, getattr(self, name))
        for name in ("needle_batches", "needle_d_ffs"):
            if not getattr(self, name):
                raise UsageError(f"--{name.replace('_', '-')} needs at least one value")
            for v in getattr(self, name):
                _positive(name, v)
        if not self.needle_ks or any(not isinstance(k, int) or k < 0 for k in self.needle_ks):
            raise UsageError(f"--needle-ks must be integers >= 0 (0 = none), got {self.needle_ks!r}")
        if self.time_rounds > self.time_steps:
            raise UsageError(
                f"--time-rounds {self.time_rounds} exceeds --time-steps {self.time_steps}: "
                "every round needs at least one step"
            )
        if not (
            isinstance(self.maxbatch_budget_gib, (int, float))
            and math.isfinite(self.maxbatch_budget_gib)
            and self.maxbatch_budget_gib > 0
        ):
            raise UsageError(f"--maxbatch-budget-gib must be a positive number, got {self.maxbatch_budget_gib!r}")
        for name in ("megatron_preset", "time_preset"):
            if getattr(self, name) not in PRESETS:
                raise UsageError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r} is not a preset; "
                    f"valid presets: {', '.join(PRESETS)}"
                )
        if not self.auto_budget_fractions or any(not 0 < f < 1 for f in self.auto_budget_fractions):
            raise UsageError(f"--auto-budget-fractions must be numbers in (0, 1), got {self.auto_budget_fractions!r}")
        if not self.fit_budget_fractions or any(not 0 < f < 1 for f in self.fit_budget_fractions):
            raise UsageError(f"--fit-budget-fractions must be numbers in (0, 1), got {self.fit_budget_fractions!r}")
        _positive("fit_rounds", self.fit_rounds)
        if not isinstance(self.remat_head_chunks, int) or self.remat_head_chunks < 0:
            raise UsageError(f"--remat-head-chunks must be an integer >= 0, got {self.remat_head_chunks!r}")
        self._check_models()
        for seq in (
            PRESETS["needle"].max_seq_len,
            self.maxbatch_seq,
            self.block_model().max_seq_len,
            PRESETS[self.time_preset].max_seq_len,
        ):
            if self.remat_head_chunks and seq % self.remat_head_chunks:
                raise UsageError(f"--remat-head-chunks {self.remat_head_chunks} does not divide sequence length {seq}")
        for name in ("megatron_seq", "maxbatch_seq"):
            limit = PRESETS[self.megatron_preset].max_seq_len
            if getattr(self, name) > limit:
                raise UsageError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} exceeds preset "
                    f"{self.megatron_preset!r}'s max_seq_len {limit}"
                )

    def _check_models(self) -> None:
        """The attention and MoE flags, then every model the parts build (``ModelConfig`` refuses bad combinations)."""
        require_int("attention_block_size", self.attention_block_size)
        self.check_moe_flags()
        dense_only = [p for p in self.parts if p not in MOE_PARTS]
        if self.moe_experts and dense_only:
            raise UsageError(
                f"--moe-experts applies to the parts {', '.join(MOE_PARTS)}; {', '.join(dense_only)} measure the "
                f"dense model against a reference without experts: give --parts {','.join(MOE_PARTS)} or a subset"
            )
        # The machine first: no use fixing flags for a kernel it lacks.
        for cfg in (PRESETS["needle"], PRESETS[self.time_preset], ModelConfig(**self._block_shapes())):
            model_flags.check_backend(self.attention, cfg.head_dim)
        if self.megatron_preset is not None:
            model_flags.check_backend(self.attention, PRESETS[self.megatron_preset].head_dim)
        try:
            self.model(PRESETS["needle"])
            self.time_model()
            self.block_model()
            self.megatron_config("none")
        except ValueError as err:
            raise UsageError(f"--attention {self.attention} --dtype {self.dtype}: {err}") from None

    def attention_changes(self) -> dict[str, Any]:
        """The ``--attention`` fields, and attention dropout 0 under ``xla`` / ``cudnn`` / ``pallas``;
        and the MoE fields (``--moe-experts`` ...: :data:`MOE_PARTS` only, :meth:`_check_models`).

        ``jax.nn.dot_product_attention`` (``xla``, ``cudnn``) and JAX's Pallas flash attention
        (``pallas``) have no attention dropout, so with those
        every bench model's ``attn_dropout`` is 0; residual dropout is kept. ``explicit`` and
        ``blockwise`` keep the model's attention dropout.
        """
        changes: dict[str, Any] = dict(attention=self.attention, attention_block_size=self.attention_block_size)
        changes.update(model_flags.moe_overrides(self))
        if self.attention in NO_DROPOUT_ATTENTIONS:
            changes["attn_dropout"] = 0.0
        return changes

    def model(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with ``--attention`` and the MoE flags (:meth:`attention_changes`) and ``--dtype`` (compute
        dtype) applied."""
        return cfg.replace(dtype=self.dtype, **self.attention_changes())

    def time_model(self) -> ModelConfig:
        """The head-dominated model of the ``time`` and ``auto`` parts: ``--time-preset`` under :meth:`model`."""
        return self.model(model_preset(self.time_preset))

    def whole_step(self, cfg: ModelConfig, policy: Any) -> ModelConfig:
        """``cfg`` under ``policy``, with the head and loss rematerialized too unless the policy is ``none``."""
        chunks = 0 if policy == "none" else self.remat_head_chunks
        return cfg.replace(remat_policy=policy, remat_head_chunks=chunks)

    def megatron_config(self, policy: str, **changes) -> ModelConfig:
        """The Megatron comparison's model: the preset in bf16 compute, f32 parameters, dropout 0.1.

        ``--attention`` applies (:meth:`attention_changes`: attention dropout 0 under ``xla`` and
        ``cudnn``); ``--dtype`` does not (Megatron-LM's accounting is of 16-bit activations).
        """
        overrides = dict(
            dtype="bfloat16",
            param_dtype="float32",
            attn_dropout=0.1,
            resid_dropout=0.1,
            remat_policy=policy,
            remat_granularity="block",
        )
        overrides.update(self.attention_changes())
        overrides.update(changes)
        return model_preset(self.megatron_preset, **overrides)

    def _block_shapes(self) -> dict[str, int]:
        return BLOCK_MODEL_QUICK if self.quick else BLOCK_MODEL

    def block_model(self, **changes) -> ModelConfig:
        """The block-dominated model (:data:`BLOCK_MODEL`, or its quick version), dropout 0, under :meth:`model`."""
        return self.model(ModelConfig(**self._block_shapes(), attn_dropout=0.0, resid_dropout=0.0)).replace(**changes)


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def parse_config(argv: Sequence[str] | None) -> BenchConfig:
    """Parse flags into a :class:`BenchConfig` (:func:`train.cli.parse`).

    Raises:
      UsageError: on a bad flag or value, or a malformed / unknown policy.
    """
    return parse(
        BenchConfig,
        argv,
        prog=program_name("train.bench"),
        description="Memory and time of every remat policy and its peers; regenerates docs/RESULTS.md.",
    )
