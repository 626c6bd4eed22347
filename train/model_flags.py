"""The flags every CLI that builds the model shares: attention and the number of learned positions.

Each config dataclass declares them with the factories below (one field each) and turns them into
:class:`~jremat.models.ModelConfig` overrides with :func:`model_overrides`, so ``train.ptb`` and
``train.memory`` read ``--attention``, ``--attention-block-size`` and ``--max-seq-len`` the same
way. ``train.bench`` takes ``--attention`` and ``--attention-block-size`` from here too (and
:func:`check_backend`); it has no ``--max-seq-len``: each bench model keeps its own positions.
"""

from __future__ import annotations

from typing import Any

from jremat.models import PRESETS
from jremat.models.config import ATTENTIONS, check_attention_backend
from jremat.train.cli import UsageError, option, require, require_choice, require_int


def attention_option() -> Any:
    """The ``--attention`` field."""
    return option("explicit", "how attention is computed (docs/attention.md)", choices=ATTENTIONS)


def attention_block_size_option() -> Any:
    """The ``--attention-block-size`` field."""
    return option(128, "query and key block length of --attention blockwise")


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
        not a positive integer, or a sequence longer than the positions. ``--max-seq-len`` is
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
