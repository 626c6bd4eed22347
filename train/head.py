"""The reference model's loss head on a mesh: the tokens' and the vocabulary's mesh axes
(:class:`models.head.ShardedHead`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jax.sharding import Mesh

from jremat.train.sharding import logical_to_spec, token_axes

if TYPE_CHECKING:
    from jremat.models.head import ShardedHead


def sharded_head(mesh: Mesh, model_cfg: Any) -> ShardedHead | None:
    """The :class:`models.head.ShardedHead` of ``model_cfg``'s chunked loss head on ``mesh``, or
    ``None`` (one device, or a head without chunks: ``remat_head_chunks`` 0).

    Tokens are split as the residual stream is (:func:`train.sharding.token_axes`), the
    vocabulary as the head's kernel is (``vocab``, where it divides the vocabulary).

    Raises:
      ValueError: if the rules split the vocabulary over more than one mesh axis (the head
        reduces its statistics over one).
    """
    from jremat.models.head import ShardedHead

    if mesh.size <= 1 or not model_cfg.remat_head_chunks:
        return None
    vocab = logical_to_spec(("embed", "vocab"), (model_cfg.d_model, model_cfg.vocab_size), mesh)[1]
    vocab_axes = () if vocab is None else (vocab,) if isinstance(vocab, str) else tuple(vocab)
    if len(vocab_axes) > 1:
        raise ValueError(f"the head's vocabulary is split over one mesh axis, not {vocab_axes}")
    batch_axes, seq_axes = token_axes(mesh)
    return ShardedHead(mesh, batch_axes, seq_axes, vocab_axes[0] if vocab_axes else None)
