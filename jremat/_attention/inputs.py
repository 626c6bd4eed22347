"""The attention kernels' arguments: their checks, and the dropout masks a dropout key gives,
block by block (:func:`jremat.attention.blockwise_attention` draws the masks
:func:`jremat.attention.reference_attention` draws over the whole probabilities)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry_2x32


def check_inputs(q, k, v) -> None:
    """Raise ``ValueError`` unless ``q``, ``k``, ``v`` are self-attention operands: 4-D
    ``[batch, seq, heads, head_dim]`` arrays of one floating dtype, ``k`` of ``q``'s shape, ``v``
    matching in batch, seq and heads, no dimension empty."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array [batch, seq, heads, head_dim], got {type(x).__name__}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k and v must be [batch, seq, heads, head_dim], got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != q.shape:
        raise ValueError(
            f"k must have q's shape (self-attention: the same batch, seq, heads and head_dim), "
            f"got q {q.shape} and k {k.shape}"
        )
    if q.shape[1] == 0:
        raise ValueError(f"the sequence must not be empty, got q {q.shape}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must match q in batch, seq and heads, got q {q.shape} and v {v.shape}")
    empty = [
        name for name, size in zip(("batch", "heads", "head_dim"), (q.shape[0], q.shape[2], q.shape[3])) if not size
    ]
    if empty or not v.shape[3]:
        raise ValueError(
            f"q, k and v must have a nonzero batch, heads, head_dim and value_dim, got q {q.shape} and v {v.shape}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k and v must have one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def static_float(value, what: str) -> float:
    """``value`` as a Python float; a traced value or a non-number is a ``ValueError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating, np.ndarray, jax.Array)
    ):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        return float(value)
    except (jax.errors.ConcretizationTypeError, TypeError) as err:
        raise ValueError(
            f"{what} must be a static Python number (it fixes the kernel's program), got a traced or "
            f"non-scalar value {getattr(value, 'aval', value)}; pass it as a constant, not as a jit argument"
        ) from err


def check_not_float64(q) -> None:
    """Raise ``ValueError`` for float64 inputs (the blockwise kernel computes in float32)."""
    if jax.dtypes.canonicalize_dtype(q.dtype).itemsize > 4:  # float64 only where x64 is on
        raise ValueError(
            f"blockwise attention computes its scores and softmax in float32; got {q.dtype} inputs, which "
            "would lose precision silently: pass float32, bfloat16 or float16 (reference_attention takes float64)"
        )


def check_rate(rate) -> float:
    """A dropout rate as a Python float; ``ValueError`` unless a static number in ``[0, 1)``."""
    rate = static_float(rate, "dropout rate")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    return rate


def static_bool(value, what: str) -> bool:
    """``value`` as a Python bool; a traced value is a ``ValueError`` naming ``what``."""
    try:
        return bool(value)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError) as err:
        raise ValueError(f"{what} must be a static Python bool, got a traced value; pass it as a constant") from err


def scale_or_default(scale, head_dim: int) -> float:
    """``scale`` as a Python float, ``1 / sqrt(head_dim)`` if ``None``; ``ValueError`` if not a static number."""
    return 1.0 / math.sqrt(head_dim) if scale is None else static_float(scale, "scale")


def threefry_key_data(key) -> jax.Array:
    """The ``uint32[2]`` data of a single threefry2x32 key, which the kernel hashes block by block."""
    if not jax.config.jax_threefry_partitionable:  # type: ignore[attr-defined]
        raise ValueError(
            "attention dropout regenerates masks block by block, which needs jax_threefry_partitionable=True "
            "(the default); it is off"
        )
    if not hasattr(key, "dtype"):
        raise ValueError(f"dropout_key must be a PRNG key (jax.random.key(seed)), got {type(key).__name__} {key!r}")
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32:
            raise ValueError(f"dropout_key must be a PRNG key (jax.random.key), got an array of dtype {key.dtype}")
        if key.shape != (2,):
            raise ValueError(
                f"a raw uint32 dropout_key must be one threefry key of shape (2,) (jax.random.PRNGKey), "
                f"got shape {key.shape}; pass jax.random.key(seed)"
            )
        key = jax.random.wrap_key_data(key)  # a legacy raw key: the default implementation's
    impl = str(jax.random.key_impl(key))
    if impl != "threefry2x32":
        raise ValueError(
            f"attention dropout needs a threefry2x32 key (jax.random.key(seed), the default), got a {impl!r} key"
        )
    if key.shape != ():
        raise ValueError(f"dropout_key must be a single key, got a key array of shape {key.shape}")
    return jax.random.key_data(key)


# ---------------------------------------------------------------------------------------------
# Dropout masks, block by block


def mul_add_u64(a: jax.Array, c: int, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a * c + b`` as 64-bit ``(high, low)`` uint32 words, for uint32 ``a``, ``b`` and ``c < 2**32``."""
    u32 = lambda x: jnp.asarray(x, jnp.uint32)
    mask16 = u32(0xFFFF)
    a1, a0 = a >> u32(16), a & mask16
    c1, c0 = u32(c >> 16), u32(c & 0xFFFF)
    p00, p01, p10, p11 = a0 * c0, a0 * c1, a1 * c0, a1 * c1  # each < 2**32
    mid = p01 + p10
    mid_carry = (mid < p01).astype(jnp.uint32)
    low = p00 + (mid << u32(16))
    low_carry = (low < p00).astype(jnp.uint32)
    high = p11 + (mid >> u32(16)) + (mid_carry << u32(16)) + low_carry
    low_b = low + b
    high = high + (low_b < low).astype(jnp.uint32)
    return high, low_b


def keep_block(key_data, rate: float, shape, q_start, k_start, rows: int, cols: int, *, wide=None):
    """Block ``[:, :, q_start:q_start+rows, k_start:k_start+cols]`` of
    ``jax.random.bernoulli(key, 1 - rate, shape)`` for ``shape = (batch, heads, seq, seq)``.

    With ``jax_threefry_partitionable``, element ``n`` (row-major flat index, a 64-bit count
    split into two words) of a threefry random-bits array is ``threefry2x32(key, (n_high, n_low))``
    with the two output words xor-ed (64-bit bits: concatenated), as JAX's threefry random bits
    compute it; ``uniform`` keeps the top mantissa bits of that as a float in ``[1, 2)`` minus 1,
    and ``bernoulli`` compares it with ``p``. Positions past the sequence (padding) get some
    value; the caller masks them.

    Args:
      wide: compute 64-bit counts even if every count fits in 32 bits (for tests); ``None``: when needed.
    """
    batch, heads, seq_q, seq_k = shape
    u32 = lambda x: jnp.asarray(x, jnp.uint32)
    b = lax.broadcasted_iota(jnp.uint32, (batch, heads, rows, cols), 0)
    h = lax.broadcasted_iota(jnp.uint32, (batch, heads, rows, cols), 1)
    i = lax.broadcasted_iota(jnp.uint32, (batch, heads, rows, cols), 2) + u32(q_start)
    j = lax.broadcasted_iota(jnp.uint32, (batch, heads, rows, cols), 3) + u32(k_start)
    row = (b * u32(heads) + h) * u32(seq_q) + i  # < 2**32, checked by the caller
    if wide is None:
        wide = batch * heads * seq_q * seq_k >= 2**32
    if wide:
        high, low = mul_add_u64(row, seq_k, j)
    else:
        high, low = jnp.zeros_like(row), row * u32(seq_k) + j
    n = high.size
    bits = threefry_2x32((key_data[0], key_data[1]), jnp.concatenate([high.ravel(), low.ravel()]))
    bits1, bits2 = bits[:n].reshape(high.shape), bits[n:].reshape(high.shape)
    float_dtype = jax.dtypes.canonicalize_dtype(jnp.float64)  # bernoulli's p: a Python float's dtype
    if float_dtype == jnp.float64:
        u64 = lambda x: jnp.asarray(x, jnp.uint64)
        word = (bits1.astype(jnp.uint64) << u64(32)) | bits2.astype(jnp.uint64)
        mantissa = (word >> u64(64 - 52)) | u64(np.array(1.0, np.float64).view(np.uint64))
        uniform = lax.bitcast_convert_type(mantissa, jnp.float64) - jnp.float64(1.0)
    else:
        word = bits1 ^ bits2
        mantissa = (word >> u32(32 - 23)) | u32(np.array(1.0, np.float32).view(np.uint32))
        uniform = lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0)
    return uniform < jnp.asarray(1.0 - rate, float_dtype)
