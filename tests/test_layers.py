"""models/layers.py: attention through jax.nn.dot_product_attention against the formula."""

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import attention, segment_mask


def reference(q, k, v, mask):
    """softmax(q k^T / sqrt(d) + mask) v per head, key/value heads shared by groups of query heads."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bqhd,blhd->bhql", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None], scores, -1e30)
    return jnp.einsum("bhql,blhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def test_grouped_query_attention_with_packed_segments_and_padding():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 7, 6, 8), (2, 7, 3, 8), (2, 7, 3, 8)))
    mask = segment_mask(jnp.array([[1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]]))
    out, ref = np.asarray(attention(q, k, v, mask)), np.asarray(reference(q, k, v, mask))
    assert np.allclose(out, ref, atol=1e-5) and not np.isnan(out).any()  # padding rows: finite
    grad = jax.grad(lambda q: attention(q, k, v, mask)[:, :5].sum())(q)
    assert np.allclose(grad, jax.grad(lambda q: reference(q, k, v, mask)[:, :5].sum())(q), atol=1e-5)
