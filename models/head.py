"""The loss head of :class:`models.GPT`: final LayerNorm, vocabulary projection and summed
cross-entropy, in rematerialized sequence chunks; on a mesh, each device's own share under
:func:`jax.shard_map`.

Left to XLA, a chunked head on a mesh reduces in every chunk what one pass reduces once: the
loss and the head's gradient over the batch (an all-reduce per chunk each), and with the
vocabulary split over ``tensor`` each chunk's log-softmax, which the chunk's recomputation
reduces again. :class:`ShardedHead` runs the chunks on each device's tokens and vocabulary share
instead, and reduces once:

* a chunk gives each of its tokens two numbers of this device's vocabulary share, its
  log-sum-exp and its target logit (:func:`token_statistics`), and issues no collective, so its
  recomputation issues none either;
* after the chunks, one ``psum`` over the vocabulary's axis combines every device's statistics,
  and one over the tokens' axes sums the loss;
* the head's gradient, and with the vocabulary split the hidden state's, are reduced once: the
  inputs are cast to varying over those axes before the chunks, and the casts' transposes
  reduce the gradients the chunks summed locally.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

import jremat


def summed_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The summed next-token cross-entropy of ``logits`` ``[..., vocab]`` at ``targets`` ``[...]``, in float32."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


def chunked_summed_loss(graphdef: Any, params: Any, x: jax.Array, targets: jax.Array, n_chunks: int) -> jax.Array:
    """The summed loss of ``x`` ``[batch, seq, d_model]`` at ``targets`` in ``n_chunks`` sequence
    chunks, each recomputed in the backward pass (:func:`jremat.rematerialized_chunks`).

    Args:
      graphdef: the graph definition of ``{"ln_f": LayerNorm, "head": Linear}``.
      params: their parameters.
      x, targets: the final hidden state and the next tokens.
      n_chunks: chunks of the sequence.

    Raises:
      ValueError: if ``n_chunks`` does not divide the sequence length.
    """

    def chunk_loss(head_params, x_chunk, target_chunk):
        return summed_token_loss(_logits(graphdef, head_params, x_chunk), target_chunk)

    return jremat.rematerialized_chunks(chunk_loss, params, x, targets, n_chunks=n_chunks)


def token_statistics(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per token, ``[log-sum-exp, target logit]`` of a share of the vocabulary, float32 ``[..., 2]``.

    Args:
      logits: ``[..., V/n]``: the logits of one share of the vocabulary's entries.
      targets: the next tokens, as indices into that share (outside ``[0, V/n)`` where the
        target is in another share).

    Returns:
      The log-sum-exp over the share, and the target's logit where the target is in the share (0
      elsewhere): summed over every share by log-sum-exp and by sum, the whole vocabulary's, so
      the loss of a token is ``logsumexp(lse) - sum(target logit)`` over the shares.
    """
    logits = logits.astype(jnp.float32)
    share = logits.shape[-1]
    picked = jnp.take_along_axis(logits, jnp.clip(targets, 0, share - 1)[..., None], axis=-1)[..., 0]
    here = (targets >= 0) & (targets < share)
    return jnp.stack([jax.nn.logsumexp(logits, axis=-1), jnp.where(here, picked, 0.0)], axis=-1)


@dataclasses.dataclass(frozen=True)
class ShardedHead:
    """Where the loss head's tokens and vocabulary live on a mesh (hashable: a static attribute of
    :class:`models.GPT`).

    Attributes:
      mesh: the device mesh.
      batch_axes: the mesh axes the batch dimension of the hidden state and targets is split over.
      seq_axes: the mesh axes their sequence dimension is split over.
      vocab_axis: the mesh axis the head's vocabulary dimension is split over, or ``None``.

    Raises:
      ValueError: if ``vocab_axis`` is among the tokens' axes.
    """

    mesh: Any
    batch_axes: tuple[str, ...]
    seq_axes: tuple[str, ...]
    vocab_axis: str | None = None

    def __post_init__(self):
        if self.vocab_axis is not None and self.vocab_axis in self.batch_axes + self.seq_axes:
            # The vocabulary's reduction would add up different tokens' statistics.
            raise ValueError(
                f"the vocabulary axis {self.vocab_axis!r} also splits the tokens "
                f"(batch {self.batch_axes}, sequence {self.seq_axes}); give it an axis of its own"
            )

    def summed_loss(self, graphdef: Any, params: Any, x: jax.Array, targets: jax.Array, n_chunks: int) -> jax.Array:
        """The summed loss of ``x`` ``[batch, seq, d_model]`` at ``targets``, every device its own
        tokens and vocabulary share, in ``n_chunks`` chunks of its sequence, each recomputed in the
        backward pass.

        Args:
          graphdef: the graph definition of ``{"ln_f": LayerNorm, "head": Linear}``.
          params: their parameters (placed anywhere: gathered to :meth:`param_spec`'s placement
            once, where the ``shard_map`` begins).
          x, targets: the final hidden state and the next tokens.
          n_chunks: chunks of each device's sequence.

        Raises:
          ValueError: if the batch, the sequence or the vocabulary does not split over its mesh
            axes, or ``n_chunks`` is not a positive divisor of each device's sequence length.
        """
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        param_specs = [self.param_spec(path, leaf) for path, leaf in leaves]
        batch, seq, vocab = (self._split(axes) for axes in (self.batch_axes, self.seq_axes, self._vocab_axes))
        tokens = (batch or None, seq or None)
        vocab_size = next(jnp.shape(leaf)[-1] for path, leaf in leaves if _in_projection(path) and jnp.ndim(leaf) == 2)
        for what, size, axes in (
            ("batch", x.shape[0], batch),
            ("sequence", x.shape[1], seq),
            ("vocabulary", vocab_size, vocab),
        ):
            if size % self._size(axes):
                raise ValueError(
                    f"the head's {what} of {size} does not split over the mesh axes {axes} ({self._size(axes)} devices)"
                )
        length = x.shape[1] // self._size(seq)
        if n_chunks <= 0 or length % n_chunks:
            raise ValueError(
                f"remat_head_chunks must be a positive divisor of each device's sequence length {length} "
                f"(sequence {x.shape[1]} over {self._size(seq)} devices), got {n_chunks}"
            )
        share = vocab_size // self._size(vocab)

        def body(leaves, x, targets):
            if vocab:  # the targets as indices into this device's share of the vocabulary
                targets = targets - jax.lax.axis_index(vocab[0]) * share
            # Varying over every split axis before the chunks: the gradients each chunk adds up
            # are reduced once, by these casts' transposes, not in every chunk; and no chunk
            # casts its inputs.
            leaves, x, targets = jax.tree.map(lambda v: _varying(v, batch + seq + vocab), (leaves, x, targets))
            head = jax.tree_util.tree_unflatten(treedef, leaves)

            def chunk_statistics(head_params, x_chunk, target_chunk):
                return token_statistics(_logits(graphdef, head_params, x_chunk), target_chunk)

            stats = jremat.rematerialized_chunks(chunk_statistics, head, x, targets, n_chunks=n_chunks, reduce=False)
            if vocab:  # each device's row of a [devices, ...] array, summed: every device's statistics
                rows = jax.nn.one_hot(jax.lax.axis_index(vocab[0]), self._size(vocab), dtype=stats.dtype)
                every = jax.lax.psum(rows.reshape((-1,) + (1,) * stats.ndim) * stats[None], vocab[0])
                lse, picked = jax.nn.logsumexp(every[..., 0], axis=0), jnp.sum(every[..., 1], axis=0)
            else:
                lse, picked = stats[..., 0], stats[..., 1]
            total = jnp.sum(lse - picked)
            return jax.lax.psum(total, batch + seq) if batch + seq else total

        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs, PartitionSpec(*tokens, None), PartitionSpec(*tokens)),
            out_specs=PartitionSpec(),
        )([leaf for _, leaf in leaves], x, targets)

    def param_spec(self, path: tuple, leaf: Any) -> PartitionSpec:
        """Where one head parameter is held in the body: the projection's vocabulary dimension (its
        kernel's last, its bias) split over :attr:`vocab_axis`, the rest whole."""
        vocab = self._split(self._vocab_axes)
        if not _in_projection(path) or not vocab:
            return PartitionSpec()
        return PartitionSpec(*(None,) * (jnp.ndim(leaf) - 1), vocab[0])

    @property
    def _vocab_axes(self) -> tuple[str, ...]:
        return (self.vocab_axis,) if self.vocab_axis else ()

    def _split(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``axes`` of size above 1. A value varying over an axis of size 1 would be
        reduced over it (a no-op all-reduce XLA still issues) wherever it meets one that does not."""
        return tuple(a for a in axes if self.mesh.shape[a] > 1)

    def _size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)


def _in_projection(path: tuple) -> bool:
    """Whether a parameter's path is the vocabulary projection's (``head``), not the LayerNorm's."""
    return any(getattr(key, "key", None) == "head" for key in path)


def _logits(graphdef: Any, params: Any, x: jax.Array) -> jax.Array:
    """The head's logits of ``x``: ``head(ln_f(x))``."""
    modules = nnx.merge(graphdef, params)
    return modules["head"](modules["ln_f"](x))


def _varying_axes(value: jax.Array) -> frozenset[str]:
    """The mesh axes ``value`` varies over in a ``shard_map`` body: its type's
    ``manual_axis_type.varying`` (JAX 0.10), or ``vma`` where a release spells it so."""
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else aval.vma)


def _varying(value: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``value`` cast to vary over ``axes`` (those it does not vary over already)."""
    missing = tuple(a for a in axes if a not in _varying_axes(value))
    return jax.lax.pcast(value, missing, to="varying") if missing else value


__all__ = ["ShardedHead", "chunked_summed_loss", "summed_token_loss", "token_statistics"]
