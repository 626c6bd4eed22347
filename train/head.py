"""The reference model's loss head on a mesh: the tokens' and the vocabulary's mesh axes
(:class:`models.head.ShardedHead`)."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jremat.train.sharding import LOGICAL_AXIS_RULES, logical_to_spec


def sharded_head(mesh: Mesh, model_cfg: Any) -> Any:
    """The :class:`models.head.ShardedHead` of ``model_cfg``'s chunked loss head on ``mesh``, or
    ``None`` (one device, or a head without chunks: ``remat_head_chunks`` 0).

    Tokens are split as the residual stream is (:data:`LOGICAL_AXIS_RULES`'s ``act_batch`` and
    ``act_seq`` axes), the vocabulary as the head's kernel is (``vocab``, where it divides the
    vocabulary).
    """
    from jremat.models.head import ShardedHead

    if mesh.size <= 1 or not model_cfg.remat_head_chunks:
        return None
    vocab = logical_to_spec(("embed", "vocab"), (model_cfg.d_model, model_cfg.vocab_size), mesh)[1]
    vocab_axes = () if vocab is None else (vocab,) if isinstance(vocab, str) else tuple(vocab)
    if len(vocab_axes) > 1:
        raise ValueError(f"the head's vocabulary is split over one mesh axis, not {vocab_axes}")
    return ShardedHead(
        mesh,
        batch_axes=tuple(a for a in LOGICAL_AXIS_RULES["act_batch"] if a in mesh.shape),
        seq_axes=tuple(a for a in LOGICAL_AXIS_RULES["act_seq"] if a in mesh.shape),
        vocab_axis=vocab_axes[0] if vocab_axes else None,
    )
