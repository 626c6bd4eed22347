"""The flags every CLI that builds the model shares: attention and the number of learned positions.

Each config dataclass declares them with the factories below (one field each) and turns them into
:class:`~jremat.models.ModelConfig` overrides with :func:`model_overrides`, so ``train.ptb`` and
``train.memory`` read ``--attention``, ``--attention-block-size`` and ``--max-seq-len`` the same
way. ``train.bench`` takes ``--attention`` and ``--attention-block-size`` from here too (and
:func:`check_backend`); it has no ``--max-seq-len``: each bench model keeps its own positions.
"""

from __future__ import annotations

import os
from typing import Any

from jremat.models import PRESETS, ModelConfig
from jremat.models.config import ATTENTIONS, check_attention_backend
from jremat.train.cli import UsageError, option, require, require_choice, require_int


def attention_option() -> Any:
    """The ``--attention`` field."""
    return option("explicit", "how attention is computed (docs/attention.md)", choices=ATTENTIONS)


def attention_block_size_option() -> Any:
    """The ``--attention-block-size`` field."""
    return option(128, "query and key block length of --attention blockwise and of the forward kernel of pallas")


def max_seq_len_option() -> Any:
    """The ``--max-seq-len`` field."""
    return option(None, "learned positions (default: the preset's); --seq-len may go up to it")


def positions(config) -> int:
    """The model's learned positions: ``--max-seq-len``, or the preset's ``max_seq_len``."""
    return config.max_seq_len if config.max_seq_len is not None else PRESETS[config.preset].max_seq_len


def check(config, seq_len: int | None) -> None:
    """Check the shared flags and that ``seq_len`` fits the learned positions.

    Raises:
      UsageError: for an unknown attention, a block size, position count or ``seq_len`` that is
        not a positive integer, a sequence longer than the positions, or a sequence the
        ``pallas`` kernel's block does not suit. ``--max-seq-len`` is
        checked before ``seq_len``, which may be derived from it.
    """
    require_choice("attention", config.attention, ATTENTIONS)
    require_int("attention_block_size", config.attention_block_size)
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
