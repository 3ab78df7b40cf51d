"""Shared building blocks: partitioned initialisers, activation layouts, norms, rotary
embeddings, attention."""

import contextlib
import contextvars
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from maestro_jax.models import fp8
from maestro_jax.models.attention import Mask, fast_attention, kernel_for
from maestro_jax.models.configs import RopeScaling

from maestro_jax.hf_config import ROPE_SCALINGS, yarn_mscale


def partitioned(init, *axes):
    """An initialiser annotated with logical axis names (mapped to a mesh by `meshes/`)."""
    return nn.with_logical_partitioning(init, axes)


class Dense(nn.Dense):
    """`nn.Dense` that also takes a float8 kernel (`fp8.Fp8Weight`, stored by a frozen section at
    `precision: fp8`) through Flax's `promote_dtype` and `dot_general` hooks; the same layer,
    parameters and results as `nn.Dense` for any other kernel."""

    promote_dtype: Callable = fp8.promote_dtype
    dot_general: Callable | None = fp8.dot_general


class DenseGeneral(nn.DenseGeneral):
    """`nn.DenseGeneral` that also takes a float8 kernel, as `Dense` does."""

    promote_dtype: Callable = fp8.promote_dtype
    dot_general: Callable | None = fp8.dot_general


def apply_with_losses(module: nn.Module, variables, *args, method=None):
    """`module.apply` that also returns the sum of the terms its layers sow into the `losses`
    collection (auxiliary losses such as MoE load balancing; 0 when there are none). Each
    term is a sum over tokens, normalised with the main loss."""
    out, state = module.apply(variables, *args, method=method, mutable=["losses"])
    return out, sum((jnp.sum(x) for x in jax.tree.leaves(state)), jnp.zeros((), jnp.float32))


def apply_with_row_losses(module: nn.Module, variables, *args, method=None):
    """`apply_with_losses` with the terms kept per row ([B]): every term a layer sows is one
    value per row of its batch (the MoE balance loss), so a pipeline stage can send its rows'
    terms on with the rows."""
    out, state = module.apply(variables, *args, method=method, mutable=["losses"])
    b = jax.tree.leaves(out)[0].shape[0]
    return out, sum((jnp.sum(x.reshape(-1, b), axis=0) for x in jax.tree.leaves(state)), jnp.zeros((b,), jnp.float32))


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


class _ScanEachBody(nn.Module):
    """`_ScanBody` with a scanned per-layer value before the broadcast inputs (a tuple)."""

    layer: type
    args: tuple
    remat: str

    @nn.compact
    def __call__(self, x, mine, rest):
        return remat_layer(self.layer, self.remat)(*self.args, name="layer")(x, mine, *rest), None


def layer_stack(layer: type, args: tuple, depth: int, remat: str, scan: bool, first: int = 0, per_layer=None):
    """`depth` layers of `layer(*args)` applied in turn, as a callable `(x, *rest) -> x` built
    inside a parent's `setup` or compact method.

    `per_layer` (one value per layer of the whole stack, e.g. whether a layer attends locally)
    gives each layer its own: it is called `(x, per_layer[i], *rest)`, with the Python value
    when unrolled (a constant) and that layer's element of an array when scanned.

    Unrolled (`scan=False`): submodules `block_{first} .. block_{first + depth - 1}`, one traced
    copy each, so compile time grows with depth; a pipeline stage holding layers from `first` on
    names them as the whole stack does, so its parameters are a subtree of the whole model's. Scanned: one `nn.scan` submodule `blocks` whose parameters
    (and sown `losses`) carry a leading `layers` axis; the layer is traced once whatever the
    depth. Both compute the same function; the parameter trees differ, so a checkpoint belongs
    to one form."""
    if scan and first:
        raise ValueError("a scanned layer stack holds all its layers; a pipeline stage needs unrolled layers")
    if not scan:
        blocks = [remat_layer(layer, remat)(*args, name=f"block_{i}") for i in range(first, first + depth)]
        own = [()] * depth if per_layer is None else [(per_layer[i],) for i in range(first, first + depth)]

        def unrolled(x, *rest):
            for block, mine in zip(blocks, own, strict=True):
                x = block(x, *mine, *rest)
            return x

        return unrolled
    if per_layer is not None:
        stack = nn.scan(
            _ScanEachBody,
            variable_axes={"params": 0, "losses": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast),
            length=depth,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        blocks = stack(layer, args, remat, name="blocks")
        values = np.asarray(per_layer)
        return lambda x, *rest: blocks(x, values, rest)[0]
    stack = nn.scan(
        _ScanBody,
        variable_axes={"params": 0, "losses": 0},
        split_rngs={"params": True},
        in_axes=nn.broadcast,
        length=depth,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
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


def rope_frequencies(half: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The `half` rotation frequencies of a head of 2*half dimensions, float32 as transformers
    computes them (a trace-time constant)."""
    freqs = (1.0 / (np.float32(theta) ** (np.arange(half, dtype=np.float32) / np.float32(half)))).astype(np.float32)
    if scaling is None:
        return freqs
    if scaling.rope_type == "linear":
        return (freqs / np.float32(scaling.factor)).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(half, theta, scaling)
    if scaling.rope_type != "llama3":
        raise ValueError(f"rope_scaling.rope_type={scaling.rope_type!r}; valid: {', '.join(ROPE_SCALINGS)}")
    original, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * np.pi / freqs
    scaled = np.where(wavelength > original / low, freqs / scaling.factor, freqs)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return np.where(between, blended, scaled).astype(np.float32)


def _yarn_frequencies(half: int, theta: float, s: RopeScaling) -> np.ndarray:
    dim = 2 * half

    def rotations_dim(rotations: float) -> float:  # the dimension turning `rotations` times in the original context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = rotations_dim(s.beta_fast), rotations_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    base = (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    ramp = np.clip((np.arange(half, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: the original frequency (extrapolated), 0: divided by factor
    return ((1 / (np.float32(s.factor) * base)) * (1 - keep) + (1 / base) * keep).astype(np.float32)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The scale on cos and sin: yarn's `attention_factor` (by default 0.1 ln(factor) + 1), else 1."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return yarn_mscale(scaling.factor)


def rotary(
    x_BLHK,
    positions_BL,
    theta: float,
    scaling: RopeScaling | None = None,
    mrope_section=None,
    mrope_interleaved: bool = False,
):
    """Rotary position embedding (Llama/Qwen 'rotate half' convention).

    With `mrope_section` (Qwen2-VL's multimodal RoPE, M-RoPE) `positions_BL` is `B x L x 3`, a
    (temporal, row, column) position per token, and each of the head's frequencies is turned by
    one of those axes (`mrope_axes`)."""
    half = x_BLHK.shape[-1] // 2
    freqs = jnp.asarray(rope_frequencies(half, theta, scaling))
    if mrope_section is None:
        angles = positions_BL[..., None].astype(jnp.float32) * freqs  # B L K/2
    else:
        angles = positions_BL[..., mrope_axes(mrope_section, half, mrope_interleaved)].astype(jnp.float32) * freqs
    return apply_rotary(x_BLHK, angles, rope_attention_factor(scaling))


def mrope_axes(section, half: int, interleaved: bool = False) -> np.ndarray:
    """Which position axis (0 temporal, 1 row, 2 column) turns each of a head's `half` frequencies
    under M-RoPE: Qwen2.5-VL's three runs of `section` frequencies in order; `interleaved`
    (Qwen3-VL's `mrope_interleaved`) every third frequency from the second on the row's and from
    the third on the column's, up to 3 x their sections, the rest the temporal axis'
    (transformers' `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`)."""
    if sum(section) != half:
        raise ValueError(f"mrope_section={tuple(section)} must add up to head_dim / 2 = {half}")
    if not interleaved:
        return np.repeat(np.arange(len(section)), section)
    f = np.arange(half)
    return np.select([(f % 3 == 1) & (f < 3 * section[1]), (f % 3 == 2) & (f < 3 * section[2])], [1, 2], 0)


def apply_rotary(x_BLHK, angles_BLF, factor: float = 1.0):
    """`x` rotated by `angles` (one per pair of the head's halves, float32; 'rotate half'), the
    cosines and sines times `factor` in float32 as transformers scales them, applied in x's dtype."""
    half = x_BLHK.shape[-1] // 2
    cos, sin = jnp.cos(angles_BLF), jnp.sin(angles_BLF)
    if factor != 1.0:
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    cos = cos[:, :, None, :].astype(x_BLHK.dtype)
    sin = sin[:, :, None, :].astype(x_BLHK.dtype)
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


def context_split() -> int:
    """How many devices the current mesh splits a sequence over (the axes `length` maps to); 1
    outside a mesh or without activation rules."""
    rules, mesh = _ACTIVATION_RULES.get(), jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return 1
    axes = nn.logical_to_mesh_axes(("length",), rules)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in axes)


def balanced_order(length: int, split: int) -> np.ndarray | None:
    """The zig-zag order that balances causal attention over `split` devices: the sequence cut
    into 2 x split equal chunks, device i holding chunks i and 2 x split - 1 - i (an early one
    with little to attend to and a late one with much). None where it does not apply (no split,
    or a length that does not cut evenly)."""
    if split <= 1 or length % (2 * split):
        return None
    chunks = np.arange(length).reshape(2 * split, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * split - 1 - i]]) for i in range(split)])


def attention(
    q_BLHK,
    k_BLGK,
    v_BLGK,
    mask: Mask | jax.Array,
    ring: bool = False,
    scale: float | None = None,
    softcap=None,
    sinks_H=None,
):
    """Grouped-query attention (each of G key/value heads serves H/G query heads); scores are
    scaled by `scale` (default 1/sqrt(head_dim)) and, with `softcap` (Gemma 2's), capped as
    softcap * tanh(s / softcap) before the mask; with `sinks_H` (GPT-OSS's attention sinks, one
    learned logit per query head) each row's softmax also runs over its head's sink, a key that
    takes weight but adds no value, so a row may attend to nothing. No fused kernel does either:
    XLA's einsums then, the softmax in float32 as transformers' eager attention takes it.

    `mask`: a `models.attention.Mask` (the dense mask and, where the rows have one, the structure
    a fused kernel takes without it) or a bare B x Q x K boolean array. Without context
    parallelism (or with `ring` off) it is `jax.nn.dot_product_attention` in the implementation
    and form `models.attention.choose_kernel` picks: cuDNN's fused flash attention on NVIDIA GPUs
    for bfloat16 and float16 where its shape rules hold, XLA's otherwise; a causal, padded or
    packed form where the rows offer one and the kernel takes it, the dense mask otherwise.

    On the mask path, a query row its mask leaves empty (a padding patch or token) attends to
    every key instead: cuDNN's kernel returns NaN for an empty row (seen on an H200, jax 0.11.2),
    and that NaN, times the zero cotangent a padding row gets, would poison every gradient; no row
    with a key reads such a row, so the loss and gradients are those of the mask as given. Queries
    (and the output) keep their positions sharded over `context` while keys and values are
    gathered whole: one all-gather of K and V per layer, and every device computes its queries
    against every key.

    With `ring` and a sequence split over `context`, `ring_attention` runs instead: it skips
    blocks the mask leaves empty, which with a causal mask in `balanced_order` is nearly half of
    the work, spread evenly over the devices."""
    mask = Mask.of(mask)
    split = context_split()
    if ring and split > 1 and q_BLHK.shape[1] % split == 0:
        return ring_attention(q_BLHK, k_BLGK, v_BLGK, mask.dense, scale, softcap, sinks_H)
    q_BLHK = constrain(q_BLHK, ("batch", "length", "heads", None))
    k_BLGK, v_BLGK = (constrain(t, ("batch", None, "kv_heads", None)) for t in (k_BLGK, v_BLGK))
    if softcap is not None or sinks_H is not None:
        dense = constrain(rows_with_keys(mask.dense), ("batch", "length", None))
        out = _explicit_attention(q_BLHK, k_BLGK, v_BLGK, dense, scale, softcap, sinks_H)
        return constrain(out, ("batch", "length", "heads", None))
    kernel = kernel_for(q_BLHK, k_BLGK, mask, split)
    if kernel.form != "mask":
        out = fast_attention(q_BLHK, k_BLGK, v_BLGK, mask, kernel, scale)
        return constrain(out, ("batch", "length", "heads", None))
    dense = constrain(rows_with_keys(mask.dense), ("batch", "length", None))
    out = jax.nn.dot_product_attention(
        q_BLHK, k_BLGK, v_BLGK, mask=dense[:, None], scale=scale, implementation=kernel.implementation
    )
    return constrain(out, ("batch", "length", "heads", None))


def rows_with_keys(mask_BQL):
    """The mask with every empty query row (no key to attend: padding) opened to every key, so
    that no attention implementation sees a row it would turn into NaN (cuDNN's does); rows with
    a key are unchanged, and no such row reads an opened row's output."""
    return mask_BQL | ~jnp.any(mask_BQL, axis=-1, keepdims=True)


_MASKED = -0.7 * float(np.finfo(np.float32).max)  # jax.nn.dot_product_attention's mask value


def _explicit_attention(q_BLHK, k_BSGK, v_BSGK, mask_BQS, scale: float | None, softcap: float | None, sinks_H=None):
    """`attention` with soft-capped scores and/or attention sinks, spelled out: query head
    g * (H/G) + r reads key/value head g (transformers' `repeat_kv`), whose sink is `sinks_H` at
    that query head; the sink joins the softmax as one more column and is dropped after it."""
    b, lq, h, d = q_BLHK.shape
    g = k_BSGK.shape[2]
    q_BLGRK = q_BLHK.reshape(b, lq, g, h // g, d)
    s = jnp.einsum("blgrk,bsgk->bgrls", q_BLGRK, k_BSGK).astype(jnp.float32)
    s = s * (d**-0.5 if scale is None else scale)
    s = jnp.where(mask_BQS[:, None, None], s if softcap is None else softcap * jnp.tanh(s / softcap), _MASKED)
    if sinks_H is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks_H.astype(jnp.float32).reshape(1, g, h // g, 1, 1), (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bgrls,bsgk->blgrk", p.astype(v_BSGK.dtype), v_BSGK).reshape(b, lq, h, d)


def ring_attention(
    q_BLHK, k_BLGK, v_BLGK, mask_BQL, scale: float | None = None, softcap: float | None = None, sinks_H=None
):
    """Context-parallel attention as a ring: each device keeps its slice of queries, and the
    slices of keys and values pass round the `context` devices (one `ppermute` per step, which
    XLA can overlap with the step's compute), so no device holds the whole sequence's K and V.

    Each step splits the local queries and the visiting keys in halves and computes only the
    quarter blocks whose mask is not empty (`lax.cond`, decided per device). Softmax runs
    online in float32 (flash-attention style): running max, running sum, rescaled output.
    Rows with nothing to attend (padding) output zeros instead of the gather path's mean of
    the values; no valid position reads them, so loss and gradients are the same. A head's sink
    (`sinks_H`) joins each of its rows' softmax sums at the end: exp(sink - running max)."""
    rules = _ACTIVATION_RULES.get()

    def spec(*names):
        return nn.logical_to_mesh_axes(names, rules)

    ring_axes = spec("length")[0]
    split = context_split()
    q_spec, kv_spec = spec("batch", "length", "heads", None), spec("batch", "length", "kv_heads", None)

    def local(q_BQHK, k_BSGK, v_BSGK, mask_BQL, sinks_H):
        b, lq, h, d = q_BQHK.shape
        g = k_BSGK.shape[2]
        parts = 2 if lq % 2 == 0 else 1
        qh = lq // parts
        q_BQGRK = q_BQHK.reshape(b, lq, g, h // g, d).astype(jnp.float32)
        q_BQGRK = q_BQGRK / math.sqrt(d) if scale is None else q_BQGRK * scale
        me = jax.lax.axis_index(ring_axes)
        varying = tuple(jax.sharding.get_abstract_mesh().axis_names)  # each device's own running state
        acc = [jax.lax.pcast(_ring_start(b, g, h // g, qh, d), varying, to="varying") for _ in range(parts)]

        def block(state, qb, kb, vb, mb):
            m, total, out = state
            s = jnp.einsum("bqgrk,bsgk->bgrqs", qb, kb.astype(jnp.float32))
            s = s if softcap is None else softcap * jnp.tanh(s / softcap)
            s = jnp.where(mb[:, None, None], s, _MASKED)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            scale = jnp.exp(m - m_new)
            out = out * jnp.moveaxis(scale, -1, 1)[..., None] + jnp.einsum(
                "bgrqs,bsgk->bqgrk", p, vb.astype(jnp.float32)
            )
            return m_new, total * scale + p.sum(-1), out

        for step in range(split):
            source = (me - step) % split  # whose keys and values this device holds now
            for a in range(parts):
                for c in range(parts):
                    kb, vb = (t[:, c * qh : (c + 1) * qh] for t in (k_BSGK, v_BSGK))
                    mb = jax.lax.dynamic_slice_in_dim(mask_BQL[:, a * qh : (a + 1) * qh], source * lq + c * qh, qh, 2)
                    acc[a] = jax.lax.cond(
                        jnp.any(mb), block, lambda st, *_: st, acc[a], q_BQGRK[:, a * qh : (a + 1) * qh], kb, vb, mb
                    )
            if step < split - 1:
                perm = [(i, (i + 1) % split) for i in range(split)]
                k_BSGK, v_BSGK = (jax.lax.ppermute(t, ring_axes, perm) for t in (k_BSGK, v_BSGK))
        outs = [_ring_output(*state, sinks_H) for state in acc]
        return jnp.concatenate(outs, axis=1).reshape(b, lq, h, d).astype(q_BQHK.dtype)

    sinks_spec = None if sinks_H is None else spec("heads")  # each device's query heads' sinks
    run = jax.shard_map(
        local, in_specs=(q_spec, kv_spec, kv_spec, spec("batch", "length", None), sinks_spec), out_specs=q_spec
    )
    return run(q_BLHK, k_BLGK, v_BLGK, mask_BQL, sinks_H)


def _ring_start(b: int, g: int, r: int, q: int, d: int):
    """A ring's running softmax state before any key: (max, sum of weights, weighted values)."""
    return (
        jnp.full((b, g, r, q), _MASKED, jnp.float32),
        jnp.zeros((b, g, r, q), jnp.float32),
        jnp.zeros((b, q, g, r, d), jnp.float32),
    )


def _ring_output(m_BGRQ, total_BGRQ, out_BQGRK, sinks_H=None):
    """A ring's running softmax state as its output: the weighted values over the weights' sum,
    a head's sink (`sinks_H`) adding its weight exp(sink - running max) to the sum; zeros for a
    row with nothing to attend."""
    if sinks_H is not None:
        g, r = m_BGRQ.shape[1:3]
        total_BGRQ = total_BGRQ + jnp.exp(sinks_H.astype(jnp.float32).reshape(1, g, r, 1) - m_BGRQ)
    total = jnp.moveaxis(total_BGRQ, -1, 1)[..., None]
    return jnp.where(total > 0, out_BQGRK / jnp.where(total > 0, total, 1.0), 0.0)


_init = nn.initializers.normal(0.02)


# MLP activations, by the names Hugging Face configs use (`hidden_act`, `activation_function`):
# the decoders' gate (silu; Gemma's tanh-approximated gelu), SigLIP's tanh approximation and
# Whisper's exact erf form.
ACTIVATIONS = {
    "silu": nn.silu,
    "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "quick_gelu": lambda x: x * nn.sigmoid(1.702 * x),  # CLIP's
}


class EncoderBlock(nn.Module):
    """Pre-LayerNorm bidirectional transformer block (GELU MLP), used by the ViT and audio encoders.

    Biases on every projection and LayerNorm with `norm_eps`: the block of SigLIP's vision tower
    and Whisper's encoder, so their checkpoints load weight for weight (`models.hf_encoders`).
    With `angles_BPF` (Qwen3-VL's tower, `models.vit.rope2d_angles`) queries and keys are turned by
    them first, as Qwen3-VL's vision block does; without, the block has no positions of its own."""

    width: int
    heads: int
    mlp: int
    norm_eps: float = 1e-6
    act: str = "gelu_pytorch_tanh"  # a key of ACTIVATIONS

    @nn.compact
    def __call__(self, x_BPD, mask_BPP, angles_BPF=None):
        hd = self.width // self.heads
        x_BPD = shard_sequence(x_BPD)
        h = nn.LayerNorm(
            epsilon=self.norm_eps,
            name="attn_norm",
            scale_init=partitioned(nn.initializers.ones, "norm"),
            bias_init=partitioned(nn.initializers.zeros, "norm"),
        )(x_BPD)
        qkv = [
            DenseGeneral(
                (self.heads, hd),
                name=n,
                kernel_init=partitioned(_init, "embed", "heads", "head_dim"),
                bias_init=partitioned(nn.initializers.zeros, "heads", "head_dim"),
            )(h)
            for n in ("q", "k", "v")
        ]
        if angles_BPF is not None:
            qkv[0], qkv[1] = apply_rotary(qkv[0], angles_BPF), apply_rotary(qkv[1], angles_BPF)
        o = attention(*qkv, mask_BPP)
        x_BPD = x_BPD + DenseGeneral(
            self.width,
            axis=(-2, -1),
            name="o",
            kernel_init=partitioned(_init, "heads", "head_dim", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )(o)
        h = nn.LayerNorm(
            epsilon=self.norm_eps,
            name="mlp_norm",
            scale_init=partitioned(nn.initializers.ones, "norm"),
            bias_init=partitioned(nn.initializers.zeros, "norm"),
        )(x_BPD)
        h = Dense(
            self.mlp,
            name="fc1",
            kernel_init=partitioned(_init, "embed", "mlp"),
            bias_init=partitioned(nn.initializers.zeros, "mlp"),
        )(h)
        h = Dense(
            self.width,
            name="fc2",
            kernel_init=partitioned(_init, "mlp", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )(ACTIVATIONS[self.act](h))
        return shard_sequence(x_BPD + h)


def segment_mask(segments_BP):
    """Attention within each packed item (segment ids > 0); padding attends to nothing (`attention`
    then lets such a row read every key, which no other row reads back)."""
    return (segments_BP[:, :, None] == segments_BP[:, None, :]) & (segments_BP[:, None, :] > 0)


def item_mask(segments_BP, segment_lengths_BM=None) -> Mask:
    """`segment_mask` as a `Mask`, with the host's `segment_lengths` (`models.attention
    .segment_lengths`, where the row builder sent them: its items laid one after another from
    position 0) as the structure a fused kernel takes instead."""
    return Mask(segment_mask(segments_BP), segment_lengths=segment_lengths_BM)
