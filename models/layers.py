"""Shared building blocks: partitioned initialisers, activation layouts, norms, rotary
embeddings, attention."""

import contextlib
import contextvars

import flax.linen as nn
import jax
import jax.numpy as jnp


def partitioned(init, *axes):
    """An initialiser annotated with logical axis names (mapped to a mesh by `meshes/`)."""
    return nn.with_logical_partitioning(init, axes)


def apply_with_losses(module: nn.Module, variables, *args, method=None):
    """`module.apply` that also returns the sum of the terms its layers sow into the `losses`
    collection (auxiliary losses such as MoE load balancing; 0 when there are none). Each
    term is a sum over tokens, normalised with the main loss."""
    out, state = module.apply(variables, *args, method=method, mutable=["losses"])
    return out, sum((jnp.sum(x) for x in jax.tree.leaves(state)), jnp.zeros((), jnp.float32))


REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def remat_layer(cls, remat: str):
    """`cls` with per-layer activation checkpointing: `none` keeps every intermediate for the
    backward, `full` keeps only each layer's input and recomputes the rest, `dots` also keeps
    the outputs of weight matmuls (recomputing norms, activations and attention). The parameter
    tree is unchanged."""
    return cls if remat == "none" else nn.remat(cls, policy=REMAT_POLICIES[remat])


class _ScanBody(nn.Module):
    """One layer in `nn.scan`'s shape: (carry, broadcast inputs) -> (carry, nothing)."""

    layer: type
    args: tuple
    remat: str

    @nn.compact
    def __call__(self, x, *rest):
        return remat_layer(self.layer, self.remat)(*self.args, name="layer")(x, *rest), None


def layer_stack(layer: type, args: tuple, depth: int, remat: str, scan: bool):
    """`depth` layers of `layer(*args)` applied in turn, as a callable `(x, *rest) -> x` built
    inside a parent's `setup` or compact method.

    Unrolled (`scan=False`): submodules `block_0 .. block_{depth-1}`, one traced copy each, so
    compile time grows with depth. Scanned: one `nn.scan` submodule `blocks` whose parameters
    (and sown `losses`) carry a leading `layers` axis; the layer is traced once whatever the
    depth. Both compute the same function; the parameter trees differ, so a checkpoint belongs
    to one form."""
    if not scan:
        blocks = [remat_layer(layer, remat)(*args, name=f"block_{i}") for i in range(depth)]

        def unrolled(x, *rest):
            for block in blocks:
                x = block(x, *rest)
            return x

        return unrolled
    stack = nn.scan(_ScanBody, variable_axes={"params": 0, "losses": 0}, split_rngs={"params": True},
                    in_axes=nn.broadcast, length=depth, metadata_params={nn.PARTITION_NAME: "layers"})
    blocks = stack(layer, args, remat, name="blocks")
    return lambda x, *rest: blocks(x, *rest)[0]


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


_ACTIVATION_RULES = contextvars.ContextVar("activation_rules", default=())


@contextlib.contextmanager
def activation_rules(rules):
    """Logical-axis rules the activation layouts below resolve through while tracing. Kept apart
    from `nn.logical_axis_rules`, which would also constrain parameters as Flax unboxes them
    (and fails on DenseGeneral's flattened kernels)."""
    token = _ACTIVATION_RULES.set(tuple(rules))
    try:
        yield
    finally:
        _ACTIVATION_RULES.reset(token)


def constrain(x, names: tuple):
    """`x` laid out by logical axis `names` on the current mesh; a no-op without rules or mesh."""
    rules = _ACTIVATION_RULES.get()
    return nn.with_logical_constraint(x, names, rules=rules) if rules else x


def shard_sequence(x_BLD):
    """An activation's layout: rows over the batch axes, positions over `context` (context
    parallelism), features whole."""
    return constrain(x_BLD, ("batch", "length", "act_embed"))


def attention(q_BLHK, k_BLGK, v_BLGK, mask_BQL):
    """Grouped-query attention (each of G key/value heads serves H/G query heads) through
    `jax.nn.dot_product_attention`: XLA's implementation on CPU, and on GPUs the fused cuDNN
    kernel where it applies. A query row with no key to attend (padding) gets the mean of the
    values, not NaN, exactly as a softmax over a large negative mask would.

    Context parallelism: queries (and the output) keep their positions sharded over `context`
    while keys and values are gathered whole, so each device attends its slice of queries to
    every key: one all-gather of K and V per layer, and the backward's reduce-scatter."""
    q_BLHK = constrain(q_BLHK, ("batch", "length", "heads", None))
    k_BLGK, v_BLGK = (constrain(t, ("batch", None, "kv_heads", None)) for t in (k_BLGK, v_BLGK))
    mask_BQL = constrain(mask_BQL, ("batch", "length", None))
    out = jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, mask=mask_BQL[:, None])
    return constrain(out, ("batch", "length", "heads", None))


_init = nn.initializers.normal(0.02)


class EncoderBlock(nn.Module):
    """Pre-LayerNorm bidirectional transformer block (GELU MLP), used by the ViT and audio encoders."""

    width: int
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x_BPD, mask_BPP):
        hd = self.width // self.heads
        x_BPD = shard_sequence(x_BPD)
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
        return shard_sequence(x_BPD + h)


def segment_mask(segments_BP):
    """Attention within each packed item (segment ids > 0); padding attends to nothing."""
    return (segments_BP[:, :, None] == segments_BP[:, None, :]) & (segments_BP[:, None, :] > 0)
