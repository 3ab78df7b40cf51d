"""Shared building blocks: partitioned initialisers, norms, rotary embeddings, attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp


def partitioned(init, *axes):
    """An initialiser annotated with logical axis names (mapped to a mesh by `meshes/`)."""
    return nn.with_logical_partitioning(init, axes)


REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def remat_layer(cls, remat: str):
    """`cls` with per-layer activation checkpointing: `none` keeps every intermediate for the
    backward, `full` keeps only each layer's input and recomputes the rest, `dots` also keeps
    the outputs of weight matmuls (recomputing norms, activations and attention). The parameter
    tree is unchanged."""
    return cls if remat == "none" else nn.remat(cls, policy=REMAT_POLICIES[remat])


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
    cos = jnp.cos(angles)[:, :, None, :].astype(x_BLHK.dtype)  # angles in float32, applied in x's dtype
    sin = jnp.sin(angles)[:, :, None, :].astype(x_BLHK.dtype)
    x1, x2 = x_BLHK[..., :half], x_BLHK[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q_BLHK, k_BLGK, v_BLGK, mask_BQL):
    """Grouped-query attention (each of G key/value heads serves H/G query heads) through
    `jax.nn.dot_product_attention`: XLA's implementation on CPU, and on GPUs the fused cuDNN
    kernel where it applies. A query row with no key to attend (padding) gets the mean of the
    values, not NaN, exactly as a softmax over a large negative mask would."""
    return jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, mask=mask_BQL[:, None])


_init = nn.initializers.normal(0.02)


class EncoderBlock(nn.Module):
    """Pre-LayerNorm bidirectional transformer block (GELU MLP), used by the ViT and audio encoders."""

    width: int
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x_BPD, mask_BPP):
        hd = self.width // self.heads
        h = nn.LayerNorm(name="attn_norm", scale_init=partitioned(nn.initializers.ones, "norm"),
                         bias_init=partitioned(nn.initializers.zeros, "norm"))(x_BPD)
        qkv = [nn.DenseGeneral((self.heads, hd), name=n, kernel_init=partitioned(_init, "embed", "heads", "head_dim"),
                               bias_init=partitioned(nn.initializers.zeros, "heads", "head_dim"))(h)
               for n in ("q", "k", "v")]
        o = attention(*qkv, mask_BPP)
        x_BPD = x_BPD + nn.DenseGeneral(self.width, axis=(-2, -1), name="o",
                                        kernel_init=partitioned(_init, "heads", "head_dim", "embed"),
                                        bias_init=partitioned(nn.initializers.zeros, "embed"))(o)
        h = nn.LayerNorm(name="mlp_norm", scale_init=partitioned(nn.initializers.ones, "norm"),
                         bias_init=partitioned(nn.initializers.zeros, "norm"))(x_BPD)
        h = nn.Dense(self.mlp, name="fc1", kernel_init=partitioned(_init, "embed", "mlp"),
                     bias_init=partitioned(nn.initializers.zeros, "mlp"))(h)
        h = nn.Dense(self.width, name="fc2", kernel_init=partitioned(_init, "mlp", "embed"),
                     bias_init=partitioned(nn.initializers.zeros, "embed"))(nn.gelu(h))
        return x_BPD + h


def segment_mask(segments_BP):
    """Attention within each packed item (segment ids > 0); padding attends to nothing."""
    return (segments_BP[:, :, None] == segments_BP[:, None, :]) & (segments_BP[:, None, :] > 0)
