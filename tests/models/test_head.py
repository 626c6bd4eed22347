"""The loss head on a mesh (models/head.py); its 8-device values: tests/train/test_sharding.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from jremat.models import GPT, preset
from jremat.models.head import ShardedHead, chunked_summed_loss, summed_token_loss, token_statistics


def _head(vocab_size=64):
    model = GPT(preset("tiny", vocab_size=vocab_size), rngs=nnx.Rngs(0))
    return nnx.split({"ln_f": model.ln_f, "head": model.head})


def test_token_statistics_of_the_vocabulary_shares_give_the_whole_vocabularys_loss():
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 12)), jnp.float32)
    targets = jnp.asarray(rng.randint(0, 12, size=(3, 5)))
    shares = [token_statistics(logits[..., 4 * i : 4 * (i + 1)], targets - 4 * i) for i in range(3)]
    lse = jax.nn.logsumexp(jnp.stack([s[..., 0] for s in shares]), axis=0)
    picked = sum(s[..., 1] for s in shares)
    np.testing.assert_allclose(jnp.sum(lse - picked), summed_token_loss(logits, targets), rtol=1e-6)
    # A share holds the target's logit only where the target is in it.
    assert int(jnp.sum(shares[0][..., 1] != 0)) == int(jnp.sum(targets < 4))


def test_on_one_device_the_sharded_head_is_the_chunked_head():
    graphdef, params = _head()
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.float32)
    targets = jnp.asarray(rng.randint(0, 64, size=(2, 16)))
    mesh = jax.make_mesh((1, 1), ("fsdp", "sequence"), axis_types=(AxisType.Auto,) * 2)
    head = ShardedHead(mesh, ("fsdp",), ("sequence",))
    loss = lambda p, x: head.summed_loss(graphdef, p, x, targets, 4)
    expected = lambda p, x: chunked_summed_loss(graphdef, p, x, targets, 4)
    np.testing.assert_allclose(loss(params, x), expected(params, x), rtol=1e-6)
    got, want = jax.grad(loss, argnums=(0, 1))(params, x), jax.grad(expected, argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_sharded_head_names_what_does_not_split():
    graphdef, params = _head(vocab_size=63)  # 63 entries do not split over tensor=2
    mesh = AbstractMesh((2, 2, 2), ("fsdp", "tensor", "sequence"), axis_types=(AxisType.Auto,) * 3)
    head = ShardedHead(mesh, ("fsdp",), ("sequence",), "tensor")
    x, targets = jnp.zeros((4, 16, 32)), jnp.zeros((4, 16), jnp.int32)
    with pytest.raises(
        ValueError, match=r"the head's vocabulary of 63 does not split over the mesh axes \('tensor',\)"
    ):
        head.summed_loss(graphdef, params, x, targets, 4)
    graphdef, params = _head()
    with pytest.raises(ValueError, match="the head's sequence of 15 does not split"):
        head.summed_loss(graphdef, params, x[:, :15], targets[:, :15], 4)
    with pytest.raises(ValueError, match="positive divisor of each device's sequence length 8 .* got 3"):
        head.summed_loss(graphdef, params, x, targets, 3)
    with pytest.raises(ValueError, match="got 0"):
        head.summed_loss(graphdef, params, x, targets, 0)
    with pytest.raises(ValueError, match="the vocabulary axis 'fsdp' also splits the tokens"):
        ShardedHead(mesh, ("fsdp",), ("sequence",), "fsdp")
