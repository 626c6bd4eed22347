"""The model flags the CLIs share, declared once: frozen dataclasses that a CLI's config inherits.

:class:`ComputeFlags` (``--attention``, ``--attention-block-size``, ``--dtype``,
``--remat-head-chunks``, and the mixture-of-experts flags of :class:`MoEFlags`: ``--moe-experts``, ...)
is in every CLI that builds the model (``train.ptb``, ``train.memory``, ``train.bench``);
:class:`ModelFlags` adds the flags of the one preset model that ``train.ptb`` and ``train.memory`` build (``--preset``, ``--seq-len``, ``--max-seq-len``, ``--dropout``,
``--granularity``, ``--unrolled``). A config inherits the group, so its fields become flags through
the one mechanism of :mod:`train.cli` (inherited fields come first); a CLI gives a shared flag its
own default with :func:`cli_default`, which keeps the flag's declaration (help, choices).
``train.bench`` has none of :class:`ModelFlags`' own flags: each bench model keeps its own preset,
positions and sequence length. :func:`model_overrides` turns the attention and MoE flags and
``--max-seq-len`` into :class:`~jremat.models.ModelConfig` overrides.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jremat
from jremat.models import PRESETS, ModelConfig
from jremat.models.config import ATTENTIONS, DTYPES, check_attention_backend
from jremat.train.cli import UsageError, option
from jremat.train.value_checks import require, require_choice, require_int, require_number


@dataclasses.dataclass(frozen=True)
class AttentionFlags:
    """``--attention`` and ``--attention-block-size``: how the model computes attention."""

    attention: str = option("explicit", "how attention is computed (docs/attention.md)", choices=ATTENTIONS)
    attention_block_size: int = option(
        128, "query and key block length of --attention blockwise and of the forward kernel of pallas"
    )


@dataclasses.dataclass(frozen=True)
class MoEFlags:
    """The mixture-of-experts flags (docs/moe.md): ``--moe-experts E`` (0: the dense MLP) and how the
    experts are routed, trained and dispatched; the :class:`~jremat.models.ModelConfig` fields of the
    same names."""

    moe_experts: int = option(0, "experts of a mixture-of-experts FFN in every block; 0: the dense MLP (docs/moe.md)")
    moe_top_k: int = option(2, "with --moe-experts: experts each token is routed to (softmax top-k router)")
    moe_capacity_factor: float = option(
        1.25,
        "with --moe-experts on a --mesh with an expert axis: slots per expert each device sends, as a multiple "
        "of its even share; assignments beyond them are dropped (one device: dropless)",
    )
    moe_load_balance_coef: float = option(0.01, "with --moe-experts: weight of the load-balancing loss")
    moe_router_z_coef: float = option(0.001, "with --moe-experts: weight of the router z-loss")
    moe_shared_expert: bool = option(False, "with --moe-experts: add a dense shared expert every token goes through")

    def check_moe_flags(self) -> None:
        """Check the MoE flags' values (the expert axis of ``--mesh``: :func:`check_expert_mesh`).

        Raises:
          UsageError: the first bad value, naming its flag.
        """
        require_int("moe_experts", self.moe_experts, minimum=0)
        require_int("moe_top_k", self.moe_top_k)
        require(
            not self.moe_experts or self.moe_top_k <= self.moe_experts,
            f"--moe-top-k {self.moe_top_k} is more than --moe-experts {self.moe_experts}: a token is routed to "
            f"at most every expert; use --moe-top-k {self.moe_experts} or less",
        )
        require_number("moe_capacity_factor", self.moe_capacity_factor)
        require_number("moe_load_balance_coef", self.moe_load_balance_coef, inclusive=True)
        require_number("moe_router_z_coef", self.moe_router_z_coef, inclusive=True)


def moe_overrides(config) -> dict[str, Any]:
    """The :class:`~jremat.models.ModelConfig` fields of the MoE flags (:class:`MoEFlags`)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(MoEFlags)}


def check_expert_mesh(mesh: str, moe_experts: int) -> None:
    """The ``expert`` axis of ``--mesh`` fits ``--moe-experts`` (:func:`train.experts.check_expert_axis`).

    Raises:
      UsageError: a bad mesh spec, an expert axis for a dense model, or one that does not divide the experts.
    """
    from jremat.train import experts, sharding  # imports JAX: only for a run that gives --mesh

    try:
        size = sharding.parse_mesh(mesh).get(sharding.EXPERT_AXIS, 1)
        experts.check_expert_axis(size, moe_experts)
    except ValueError as err:
        raise UsageError(f"--mesh {mesh}: {err}") from None


@dataclasses.dataclass(frozen=True)
class ComputeFlags(MoEFlags, AttentionFlags):
    """``--dtype`` and ``--remat-head-chunks`` (with the attention and MoE flags): how every CLI's model computes.

    Declared with no default; each CLI gives its own with :func:`cli_default`.
    """

    dtype: str | None = option(None, "compute dtype; parameters stay float32", choices=DTYPES)
    remat_head_chunks: int | None = option(
        None, "remat the final LayerNorm, head and loss over N sequence chunks; 0 keeps their logits"
    )


def cli_default(name: str, default: Any, note: str = "") -> Any:
    """The :class:`ComputeFlags` field ``name`` with a CLI's own ``default``, its help ending in ``note``.

    The flag's declaration (help, choices) stays the one of :class:`ComputeFlags`; assign the
    result to the same field name in the CLI's config.

    Raises:
      KeyError: if ``name`` is not a field of :class:`ComputeFlags`.
    """
    meta = {f.name: f for f in dataclasses.fields(ComputeFlags)}[name].metadata
    help_text = f"{meta['help']}; {note}" if note else meta["help"]
    return option(default, help_text, choices=meta["choices"], metavar=meta["metavar"])


@dataclasses.dataclass(frozen=True)
class ModelFlags(ComputeFlags):
    """The flags of the preset model that ``train.ptb`` and ``train.memory`` build.

    Fields left ``None`` take the preset's value (``--seq-len``: its positions; ``--remat-head-chunks``:
    :func:`jremat.models.config.whole_step_head_chunks`).
    """

    preset: str = option("small", "model preset", choices=tuple(PRESETS))
    seq_len: int | None = option(None, "tokens per sequence; <= the model's positions, --max-seq-len (default: equal)")
    max_seq_len: int | None = option(None, "learned positions (default: the preset's); --seq-len may go up to it")
    dtype: str | None = cli_default("dtype", None, "default: the preset's")
    dropout: float | None = option(None, "attention and residual dropout rate (default: the preset's)")
    granularity: str | None = option(None, "where remat applies (default: the preset's)", choices=jremat.GRANULARITIES)
    unrolled: bool = option(False, "unroll the layer loop instead of lax.scan")
    remat_head_chunks: int | None = cli_default(
        "remat_head_chunks", None, "default: 4 for every policy but none, models.config.whole_step_head_chunks"
    )

    def check_model_flags(self) -> None:
        """Check the values of these flags that need no policy (the sequence against the positions:
        :func:`check`).

        Raises:
          UsageError: the first bad value.
        """
        if self.dtype is not None:
            require_choice("dtype", self.dtype, DTYPES)
        require(self.dropout is None or 0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout!r}")
        if self.granularity is not None:
            require_choice("granularity", self.granularity, jremat.GRANULARITIES)


def positions(config) -> int:
    """The model's learned positions: ``--max-seq-len``, or the preset's ``max_seq_len``."""
    return config.max_seq_len if config.max_seq_len is not None else PRESETS[config.preset].max_seq_len


def check(config, seq_len: int | None) -> None:
    """Check the shared flags and that ``seq_len`` fits the learned positions.

    Raises:
      UsageError: for an unknown attention, a bad MoE flag (:meth:`MoEFlags.check_moe_flags`), a
        block size, position count or ``seq_len`` that is not a positive integer, a sequence longer than the positions, or a sequence the
        ``pallas`` kernel's block does not suit. ``--max-seq-len`` is
        checked before ``seq_len``, which may be derived from it.
    """
    require_choice("attention", config.attention, ATTENTIONS)
    require_int("attention_block_size", config.attention_block_size)
    config.check_moe_flags()
    if config.max_seq_len is not None:
        require_int("max_seq_len", config.max_seq_len)
    if seq_len is not None:
        require_int("seq_len", seq_len)
    limit = positions(config)
    require(
        seq_len is None or seq_len <= limit,
        f"--seq-len {seq_len} is longer than the model has positions ({limit}); pass --max-seq-len {seq_len} "
        f"(or more) to give preset {config.preset!r} more learned positions, or a --seq-len up to {limit}",
    )
    if config.attention == "pallas":
        try:
            from jremat.attention import pallas_block_sizes  # imports JAX: after the argument checks

            pallas_block_sizes(config.attention_block_size, limit if seq_len is None else seq_len)
        except ValueError as err:
            raise UsageError(
                f"--attention pallas --attention-block-size {config.attention_block_size}: {err}"
            ) from None


def model_overrides(config) -> dict[str, Any]:
    """The :class:`~jremat.models.ModelConfig` fields these flags set."""
    overrides: dict[str, Any] = dict(attention=config.attention, attention_block_size=config.attention_block_size)
    overrides.update(moe_overrides(config))
    if config.max_seq_len is not None:
        overrides["max_seq_len"] = config.max_seq_len
    return overrides


def check_backend(attention: str, head_dim: int) -> None:
    """Check that this machine runs ``attention`` (``cudnn`` needs an NVIDIA GPU). Call it before
    anything traces the model, so the machine is named before any other flag is questioned.

    Raises:
      UsageError: naming what is missing and the attentions that run here.
    """
    try:
        check_attention_backend(attention, head_dim)
    except ValueError as err:
        raise UsageError(f"--attention: {err}") from None


#: Copies of the parameters a training step keeps at least: parameters, gradients, Adam's two moments.
TRAINING_STATE_COPIES = 4


def device_memory_bytes(device=None) -> int | None:
    """Memory of one device: the allocator's limit on an accelerator, the machine's physical
    memory on a CPU, ``None`` where neither is known."""
    import jax  # here: the flags above are read and checked before JAX is imported

    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def check_training_state_fits(model_cfg: ModelConfig, device=None) -> None:
    """Check that one device holds the parameters, gradients and optimizer state of a training
    step (:data:`TRAINING_STATE_COPIES` copies of the parameters); activations come on top.

    Raises:
      UsageError: naming the sizes and what makes the model smaller.
    """
    from jremat import format_bytes

    have = device_memory_bytes(device)
    param_bytes = model_cfg.parameter_bytes()
    need = TRAINING_STATE_COPIES * param_bytes
    require(
        have is None or need <= have,
        f"the model does not fit this device: its parameters take {format_bytes(param_bytes)} and training "
        f"keeps {TRAINING_STATE_COPIES} copies (parameters, gradients, Adam's two moments), "
        f"{format_bytes(need)}, more than the device's {format_bytes(have or 0)}; "
        "choose a smaller --max-seq-len or --preset",
    )
