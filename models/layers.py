"""Shared building blocks: partitioned initialisers, norms, rotary embeddings, attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp

MASK_VALUE = -1e9  # finite, so fully masked (padding) rows stay NaN-free


def partitioned(init, *axes):
    """An initialiser annotated with logical axis names (mapped to a mesh by `meshes/`)."""
    return nn.with_logical_partitioning(init, axes)


class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", partitioned(nn.initializers.ones, "norm"), (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(x.dtype)


def rotary(x_BLHK, positions_BL, theta: float):
    """Rotary position embedding (Llama/Qwen 'rotate half' convention)."""
    half = x_BLHK.shape[-1] // 2
    freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions_BL[..., None].astype(jnp.float32) * freqs  # B L K/2
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = x_BLHK[..., :half], x_BLHK[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q_BLHK, k_BLGK, v_BLGK, mask_BQL):
    """Grouped-query attention: each of G key/value heads serves H/G query heads."""
    b, length, h, k = q_BLHK.shape
    g = k_BLGK.shape[2]
    q = q_BLHK.reshape(b, length, g, h // g, k)
    scores = jnp.einsum("bqgrk,blgk->bgrql", q, k_BLGK) / jnp.sqrt(k).astype(q.dtype)
    scores = jnp.where(mask_BQL[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    out = jnp.einsum("bgrql,blgk->bqgrk", probs, v_BLGK)
    return out.reshape(b, length, h, k)
