"""Decoder-only LLM in the Llama/Qwen/Mistral/Gemma 3 family: RMSNorm, RoPE, grouped-query
attention, a gated MLP (SwiGLU, or Gemma's GeGLU), sliding windows on all or some layers."""

import functools
import logging
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from maestro_jax.models.attention import Mask
from maestro_jax.models.configs import (  # noqa: F401  the config and its dispatch choice, exported here too
    AUTO_DISPATCH,
    LLMConfig,
    RopeScaling,
    _log_dispatch,
    moe_dispatch_for,
    windowed_layer,
)
from maestro_jax.models.layers import (
    _ACTIVATION_RULES,
    ACTIVATIONS,
    Dense,
    DenseGeneral,
    RMSNorm,
    attention,
    balanced_order,
    constrain,
    context_split,
    layer_stack,
    partitioned,
    rotary,
    shard_sequence,
)

log = logging.getLogger(__name__)

_init = nn.initializers.normal(0.02)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE style: softmax router, top-k weights renormalised).

    Four dispatches (`moe_dispatch`), all dropless and equal up to float rounding; parameter
    shapes (what the planner reads) are the same:
      dense: every expert sees every token and the router's combine weights (zero outside a
        token's top k) select the result: `experts / experts_per_token` times the sparse FFN
        FLOPs, simple and exact. Under an `expert` mesh axis the expert weights are sharded over
        it (it also shards the batch); tokens are gathered over that axis (`expert_batch` keeps
        them sharded over data and fsdp only), each device runs its own experts on the whole
        group's tokens, and the combine's sum over experts is reduce-scattered back.
      ragged: (token, slot) pairs sorted by expert through `jax.lax.ragged_dot` (`ragged_experts`).
        XLA:CPU in jax 0.10.2 lowers ragged_dot to a product masked per group, so it runs
        `experts` times the sparse FLOPs there; the expert weights are used whole.
      sparse: the pairs through block-sparse tiles (`tiled_ffn`), only the chosen experts'
        FLOPs on every backend, and expert parallel: under an `expert` axis > 1 tokens travel
        to their experts' devices and back with all-to-alls (`sparse_experts`, whose buffers and
        per-device FLOPs are sized for the worst case); without one it is `ragged_experts`.
      grouped: `sparse` with each device's experts through a grouped GEMM (`grouped_ffn`:
        tokamax's `ragged_dot`, its Mosaic GPU kernels for the forward and both gradients on
        Hopper), which reads each expert's weights once where `tiled_ffn` gathers them per tile.
    `auto` (the config's default) is resolved where the workload is built (`moe_dispatch_for`).

    Load balancing: with `router_aux_loss` > 0 each layer sows, into the `losses` collection,
    the Switch-Transformer balance loss `experts * sum_e f_e * P_e` computed per sequence over
    its valid tokens (f_e: the share of routed slots going to expert e, P_e: its mean router
    probability) and weighted by the sequence's valid-token count. Per-sequence terms add up
    over any split of the batch into micro-batches, so the step stays equal to the monolithic
    one whatever the schedule; a batch-wide balance loss would not."""

    cfg: LLMConfig

    @nn.compact
    def __call__(self, h_BLD, valid_BL, segments_BL=None):
        c = self.cfg
        router = self.param("router", partitioned(_init, "embed", "expert"), (c.width, c.experts))
        gate = self.param("gate", partitioned(_init, "expert", "embed", "mlp"), (c.experts, c.width, c.expert_mlp))
        up = self.param("up", partitioned(_init, "expert", "embed", "mlp"), (c.experts, c.width, c.expert_mlp))
        down = self.param("down", partitioned(_init, "expert", "mlp", "embed"), (c.experts, c.expert_mlp, c.width))
        logits_BLE = h_BLD @ router
        if c.expert_bias:
            logits_BLE = logits_BLE + self.param(
                "router_bias", partitioned(nn.initializers.zeros, "expert"), (c.experts,)
            )
        probs_BLE = jax.nn.softmax(logits_BLE.astype(jnp.float32), axis=-1)
        top, index = jax.lax.top_k(probs_BLE, c.experts_per_token)
        weights = top / jnp.sum(top, axis=-1, keepdims=True) if c.moe_renormalize else top
        chosen_BLE = jnp.sum(jax.nn.one_hot(index, c.experts), axis=-2)
        combine_BLE = jnp.sum(jax.nn.one_hot(index, c.experts) * weights[..., None], axis=-2).astype(h_BLD.dtype)
        if c.router_aux_loss:
            self.sow(
                "losses",
                "router_balance",
                c.router_aux_loss
                * balance_loss_rows(probs_BLE, chosen_BLE, valid_BL, c.experts_per_token, segments_BL),
            )
        if c.moe_dispatch == "ragged":
            return shard_sequence(ragged_experts(h_BLD, index, weights.astype(h_BLD.dtype), gate, up, down))
        if c.moe_dispatch in ("sparse", "grouped"):
            ffn = grouped_ffn if c.moe_dispatch == "grouped" else tiled_ffn
            return shard_sequence(sparse_experts(h_BLD, index, weights.astype(h_BLD.dtype), gate, up, down, ffn))
        group = ("expert_batch", "length", "act_embed")
        h_BLD = constrain(h_BLD, group)
        combine_BLE = constrain(combine_BLE, ("expert_batch", "length", "expert"))
        g, u = jnp.einsum("bld,edf->blef", h_BLD, gate), jnp.einsum("bld,edf->blef", h_BLD, up)
        if c.expert_bias:
            g, u = g + self._bias("gate_bias", "mlp"), u + self._bias("up_bias", "mlp")
        act = constrain(expert_glu(c, g, u), ("expert_batch", "length", "expert", "mlp"))
        y = jnp.einsum("blef,efd,ble->bld", act, down, combine_BLE)
        if c.expert_bias:  # each chosen expert's down bias, by its router weight
            y = y + jnp.einsum("ble,ed->bld", combine_BLE, self._bias("down_bias", "embed"))
        return shard_sequence(y)

    def _bias(self, name: str, axis: str):
        """An expert's bias over `axis` (`mlp`: its gate or up projection's; `embed`: its down's)."""
        c = self.cfg
        size = c.expert_mlp if axis == "mlp" else c.width
        return self.param(name, partitioned(nn.initializers.zeros, "expert", axis), (c.experts, size))


def expert_glu(c: LLMConfig, gate, up):
    """An expert's gated activation: silu(gate) * up, or GPT-OSS's clamped SwiGLU (`swiglu_limit`:
    the gate clamped above at the limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha *
    gate)), computed as transformers' GptOssExperts does."""
    if c.swiglu_limit is None:
        return nn.silu(gate) * up
    gate, up = jnp.minimum(gate, c.swiglu_limit), jnp.clip(up, -c.swiglu_limit, c.swiglu_limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * c.swiglu_alpha))


GroupedFFN = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def ragged_dot_ffn(
    x_RD: jax.Array, sizes_G: jax.Array, gate_GDF: jax.Array, up_GDF: jax.Array, down_GFD: jax.Array
) -> jax.Array:
    """SwiGLU of rows sorted by expert (`sizes_G` rows each; rows after them give zeros) with
    `jax.lax.ragged_dot`: sparse where the backend has a grouped-matmul kernel."""
    act = nn.silu(jax.lax.ragged_dot(x_RD, gate_GDF, sizes_G)) * jax.lax.ragged_dot(x_RD, up_GDF, sizes_G)
    return jax.lax.ragged_dot(act, down_GFD, sizes_G)


def tiled_ffn(
    x_RD: jax.Array, sizes_G: jax.Array, gate_GDF: jax.Array, up_GDF: jax.Array, down_GFD: jax.Array
) -> jax.Array:
    """`ragged_dot_ffn` as a block-sparse product that is sparse on every backend: each expert's
    run of rows is padded to whole tiles and every tile goes through its own expert's weights in
    one batched matmul. Tiles are `expert_mlp` rows (at least 8), so the FLOPs are those of the
    rows plus at most `tile - 1` padding rows per expert, and the weights gathered per tile take
    about as much memory as the tiled rows."""
    rows, d = x_RD.shape
    groups, _, f = gate_GDF.shape
    tile = max(8, f)
    tiles = (rows + groups * (tile - 1)) // tile  # each group's rows rounded up to whole tiles
    ends, tiles_G = jnp.cumsum(sizes_G), (sizes_G + tile - 1) // tile
    row_R = jnp.arange(rows)
    group_R = jnp.searchsorted(ends, row_R, side="right")  # `groups` past the last group: not placed
    g = jnp.minimum(group_R, groups - 1)
    slot_R = jnp.where(
        group_R < groups, (jnp.cumsum(tiles_G) - tiles_G)[g] * tile + row_R - (ends - sizes_G)[g], tiles * tile
    )
    x_NTD = jnp.zeros((tiles * tile, d), x_RD.dtype).at[slot_R].set(x_RD, mode="drop").reshape(tiles, tile, d)
    expert_N = jnp.minimum(jnp.searchsorted(jnp.cumsum(tiles_G), jnp.arange(tiles), side="right"), groups - 1)
    act = nn.silu(jnp.einsum("ntd,ndf->ntf", x_NTD, gate_GDF[expert_N])) * jnp.einsum(
        "ntd,ndf->ntf", x_NTD, up_GDF[expert_N]
    )
    y = jnp.einsum("ntf,nfd->ntd", act, down_GFD[expert_N]).reshape(tiles * tile, d)
    return y.at[slot_R].get(mode="fill", fill_value=0)


# Which of tokamax's implementations `grouped_ffn` runs: "mosaic", its Pallas Mosaic GPU kernels.
# The CPU tests set "xla", tokamax's reference implementation, where tokamax installs (Python
# 3.12, jax >= 0.11.1: CI's newer interpreter), so the dispatch's wiring is checked against
# `dense` before any GPU runs the kernel.
GROUPED_GEMM_IMPLEMENTATION = "mosaic"


def grouped_ffn(
    x_RD: jax.Array, sizes_G: jax.Array, gate_GDF: jax.Array, up_GDF: jax.Array, down_GFD: jax.Array
) -> jax.Array:
    """`ragged_dot_ffn` through tokamax's grouped GEMM (`GROUPED_GEMM_IMPLEMENTATION`, "mosaic":
    Pallas Mosaic GPU kernels for the forward, the input gradient and the weight gradient on
    Hopper; tokamax 0.0.17 needs jax >= 0.11.1). `moe_dispatch_for` only resolves to it where
    `grouped_gemm_missing` finds nothing missing."""
    import tokamax  # the gpu extra; absent where jax is older than 0.11.1 (Python 3.11)

    def dot(lhs, rhs):
        return tokamax.ragged_dot(lhs, rhs, sizes_G, implementation=GROUPED_GEMM_IMPLEMENTATION)

    return dot(nn.silu(dot(x_RD, gate_GDF)) * dot(x_RD, up_GDF), down_GFD)


def grouped_gemm_missing(platform: str, compute_capability: float, jax_version: tuple[int, ...]) -> str | None:
    """What the grouped dispatch lacks here (None: nothing): tokamax, jax >= 0.11.1, an NVIDIA
    GPU of compute capability >= 9.0 (its Mosaic kernels are Hopper's)."""
    import importlib.util

    if platform not in ("gpu", "cuda") or compute_capability < 9.0:
        return f"an NVIDIA GPU of compute capability >= 9.0 (this is {platform}, capability {compute_capability})"
    if tuple(jax_version) < (0, 11, 1):
        return f"jax >= 0.11.1 (installed: {'.'.join(map(str, jax_version))})"
    if importlib.util.find_spec("tokamax") is None:
        return "tokamax (pip install 'maestro-jax[gpu]')"
    return None


def ragged_experts(
    h_ND: jax.Array,
    index_NK: jax.Array,
    weights_NK: jax.Array,
    gate_EDF: jax.Array,
    up_EDF: jax.Array,
    down_EFD: jax.Array,
    ffn: GroupedFFN = ragged_dot_ffn,
) -> jax.Array:
    """Dropless sparse dispatch on one device: the (token, slot) pairs sorted by expert, each
    expert's run of rows through its weights with the grouped `ffn`, and each token's results
    added with its router weights. Slots whose expert is out of range (>= experts) add nothing.
    The same result as the dense dispatch up to summation order."""
    d, k = h_ND.shape[-1], index_NK.shape[-1]
    expert_of = index_NK.reshape(-1)  # one entry per (token, slot)
    order = jnp.argsort(expert_of, stable=True)
    sizes = jnp.bincount(expert_of, length=gate_EDF.shape[0]).astype(jnp.int32)
    y = ffn(h_ND.reshape(-1, d)[order // k], sizes, gate_EDF, up_EDF, down_EFD)
    y = jnp.zeros_like(y).at[order].set(y).reshape(-1, k, d)  # back to (token, slot) order
    return jnp.einsum("tkd,tk->td", y, weights_NK.reshape(-1, k)).reshape(h_ND.shape)


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A partition-spec entry as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def sparse_experts(
    h_BLD: jax.Array,
    index_BLK: jax.Array,
    weights_BLK: jax.Array,
    gate_EDF: jax.Array,
    up_EDF: jax.Array,
    down_EFD: jax.Array,
    ffn: GroupedFFN = tiled_ffn,
) -> jax.Array:
    """The sparse dispatch: expert parallel over the `expert` mesh axis, dropless; each device's
    experts run through `ffn` (`tiled_ffn`; `grouped_ffn` for the grouped dispatch).

    A `shard_map` over the section's mesh. Each device keeps its tokens; a token goes once to
    every device holding one of its experts (with its local expert ids and router weights)
    through one `jax.lax.all_to_all`; each device runs its own experts on what it received
    (`tiled_ffn`), weights and adds each row's results, and a second all-to-all brings them
    back. Expert weights stay sharded over `expert` (their `embed` dimension is gathered like
    any fsdp weight); over `tensor` each device holds a slice of `expert_mlp` and the partial
    sums are added at the end.

    Dropless with static shapes costs the worst case: ragged_all_to_all does not run on XLA:CPU
    in jax 0.10.2, so each of the `expert` devices gets a chunk with a row for each of the T
    local tokens (every token might route there): send and receive buffers of
    `expert x T x width` each way, what an all-gather of the group's tokens holds and moves
    (and ids and weights, `expert x T x experts_per_token` each), and the receiver's FFN runs over
    `expert x T x experts_per_token` pair rows, `experts_per_token / (experts / expert)` of the
    dense dispatch's per-device FLOPs rather than `experts_per_token / experts`. Without an
    `expert` axis (or when the layout does not divide evenly) it is `ragged_experts` with
    `tiled_ffn`: exactly the chosen experts' rows."""
    rules, mesh = _ACTIVATION_RULES.get(), jax.sharding.get_abstract_mesh()
    local_experts = functools.partial(ragged_experts, ffn=ffn)
    if not rules or mesh.empty:
        return local_experts(h_BLD, index_BLK, weights_BLK, gate_EDF, up_EDF, down_EFD)

    def spec(*names: str | None) -> jax.sharding.PartitionSpec:
        return nn.logical_to_mesh_axes(names, rules)

    def split(entry: str | tuple[str, ...] | None) -> int:
        return math.prod(mesh.shape[a] for a in _axes(entry))

    token_spec, expert_axes, mlp_axes = spec("batch", "length", None), _axes(spec("expert")[0]), _axes(spec("mlp")[0])
    devices = split(expert_axes)
    if (
        devices == 1
        or gate_EDF.shape[0] % devices
        or h_BLD.shape[0] % split(token_spec[0])
        or h_BLD.shape[1] % split(token_spec[1])
    ):
        return local_experts(h_BLD, index_BLK, weights_BLK, gate_EDF, up_EDF, down_EFD)

    def local(
        h_BLD: jax.Array,
        index_BLK: jax.Array,
        weights_BLK: jax.Array,
        gate_EDF: jax.Array,
        up_EDF: jax.Array,
        down_EFD: jax.Array,
    ) -> jax.Array:
        b, l, d = h_BLD.shape  # noqa: E741 - the shape suffix letters (B, L, D)
        k, owned = index_BLK.shape[-1], gate_EDF.shape[0]
        t = b * l
        index_TK, weights_TK = index_BLK.reshape(t, k), weights_BLK.reshape(t, k)
        on_TPK = index_TK[:, None, :] // owned == jnp.arange(devices)[None, :, None]  # slot's expert on device p
        sent_TP = jnp.any(on_TPK, axis=-1)
        row_TP = jnp.where(sent_TP, jnp.arange(devices) * t + jnp.arange(t)[:, None], devices * t)  # chunk p, row t

        def exchange(x: jax.Array) -> jax.Array:  # chunk p of the leading axis to device p, chunk p from it here
            return jax.lax.all_to_all(x, expert_axes, 0, 0, tiled=True)

        def pack(fill: int, x_TP: jax.Array) -> jax.Array:  # the send buffer, `fill` where a token is not sent
            return jnp.full((devices * t, *x_TP.shape[2:]), fill, x_TP.dtype).at[row_TP].set(x_TP, mode="drop")

        x = exchange(pack(0, jnp.broadcast_to(h_BLD.reshape(t, 1, d), (t, devices, d))))
        ids = exchange(pack(owned, jnp.where(on_TPK, index_TK[:, None] % owned, owned)))  # `owned`: not here
        w = exchange(pack(0, jnp.broadcast_to(weights_TK[:, None], (t, devices, k))))
        y = exchange(local_experts(x, ids, w, gate_EDF, up_EDF, down_EFD))
        out = jnp.sum(y.at[row_TP].get(mode="fill", fill_value=0), axis=1)
        return (jax.lax.psum(out, mlp_axes) if mlp_axes else out).reshape(b, l, d)

    expert_in, expert_out = spec("expert", None, "mlp"), spec("expert", "mlp", None)
    run = jax.shard_map(
        local, in_specs=(token_spec, token_spec, token_spec, expert_in, expert_in, expert_out), out_specs=token_spec
    )
    return run(h_BLD, index_BLK, weights_BLK, gate_EDF, up_EDF, down_EFD)


def balance_loss_rows(probs_BLE, chosen_BLE, valid_BL, k: int, segments_BL=None):
    """Each row's sum over its sequences of (valid tokens) x (experts * sum_e f_e * P_e), in
    float32 ([B]). With `segments_BL` (packed rows) each sample of a row is its own sequence, as
    it is unpacked. Per row, so that a pipeline stage can send its rows' terms on with the rows
    (`workloads.staged`): they add up wherever the rows go."""
    if segments_BL is not None:
        b, length, e = probs_BLE.shape
        group = (jnp.arange(b)[:, None] * (length + 1) + segments_BL).reshape(-1)  # (row, sample)
        v = valid_BL.astype(jnp.float32).reshape(-1, 1)
        count_S = jax.ops.segment_sum(v[:, 0], group, b * (length + 1))
        n_S1 = jnp.maximum(count_S, 1.0)[:, None]
        f_SE = jax.ops.segment_sum(chosen_BLE.reshape(-1, e) * v, group, b * (length + 1)) / (k * n_S1)
        p_SE = jax.ops.segment_sum(probs_BLE.reshape(-1, e) * v, group, b * (length + 1)) / n_S1
        return jnp.sum((count_S * e * jnp.sum(f_SE * p_SE, axis=-1)).reshape(b, length + 1), axis=1)
    v = valid_BL.astype(jnp.float32)[..., None]
    count_B = jnp.sum(v, axis=(1, 2))  # an empty (padding) row has f = P = 0 and adds nothing
    n_B1 = jnp.maximum(count_B, 1.0)[:, None]
    f_BE = jnp.sum(chosen_BLE * v, axis=1) / (k * n_B1)
    p_BE = jnp.sum(probs_BLE * v, axis=1) / n_B1
    return count_B * probs_BLE.shape[-1] * jnp.sum(f_BE * p_BE, axis=-1)


def balance_loss_sum(probs_BLE, chosen_BLE, valid_BL, k: int, segments_BL=None):
    """`balance_loss_rows` summed over the rows."""
    return jnp.sum(balance_loss_rows(probs_BLE, chosen_BLE, valid_BL, k, segments_BL))


def _qk_norm(c: LLMConfig, name: str) -> Callable:
    """The query or key norm (`B x L x heads x head_dim` in and out): over each head, or over the
    whole projection at once (`qk_norm_over: projection`, OLMo 2's: one scale per projected
    feature, heads x head_dim of them)."""
    norm = RMSNorm(c.norm_eps, name=name)
    if c.qk_norm_over == "head":
        return norm
    return lambda t: norm(t.reshape(*t.shape[:-2], -1)).reshape(t.shape)


class DecoderBlock(nn.Module):
    cfg: LLMConfig

    @nn.compact
    def __call__(
        self, x_BLD, layer, positions_BL, mask: Mask, window_BLL, valid_BL, segments_BL=None, deepstack_JBLD=None
    ):
        """`layer`: this block's index in the whole model (a Python int in an unrolled stack, a
        traced one in a scanned stack), which says whether it attends through `window_BLL`
        (`LLMConfig.windowed`) and which DeepStack features (`deepstack_JBLD[layer]`, where
        `layer` < K) it adds to its output."""
        c = self.cfg
        x_BLD = shard_sequence(x_BLD)
        windowed = c.windowed(layer)  # a Python bool where `layer` is an int or every layer is alike
        if isinstance(windowed, bool):
            mask = mask.windowed(window_BLL, c.sliding_window) if windowed else mask
        else:
            mask = mask.windowed_where(windowed, window_BLL)
        h = RMSNorm(c.norm_eps, name="attn_norm")(x_BLD) if c.pre_norms else x_BLD
        o = self._attention(h, positions_BL, mask, windowed)
        x_BLD = x_BLD + (RMSNorm(c.norm_eps, name="post_attn_norm")(o) if c.post_norms else o)
        h = RMSNorm(c.norm_eps, name="mlp_norm")(x_BLD) if c.pre_norms else x_BLD
        y = self._feed_forward(h, valid_BL, segments_BL)
        y = RMSNorm(c.norm_eps, name="post_mlp_norm")(y) if c.post_norms else y
        x_BLD = x_BLD + y
        j = 0 if deepstack_JBLD is None else deepstack_JBLD.shape[0]
        if isinstance(layer, int) and layer < j:  # DeepStack: features zero at text positions
            x_BLD = x_BLD + deepstack_JBLD[layer].astype(x_BLD.dtype)
        elif j and not isinstance(layer, int):
            x_BLD = x_BLD + jnp.where(layer < j, deepstack_JBLD[jnp.minimum(layer, j - 1)], 0).astype(x_BLD.dtype)
        return x_BLD if c.experts else shard_sequence(x_BLD)

    def _attention(self, h, positions_BL, mask: Mask, windowed):
        """The attention of `h` (the block's input, normed where `pre_norms`), through its output
        projection: q, k and v (their norms where `qk_norm`), RoPE, then the attention chooser."""
        c = self.cfg
        q = DenseGeneral(
            (c.heads, c.head_dim),
            use_bias=c.qkv_bias,
            name="q",
            kernel_init=partitioned(_init, "embed", "heads", "head_dim"),
            bias_init=partitioned(nn.initializers.zeros, "heads", "head_dim"),
        )(h)
        k = DenseGeneral(
            (c.kv_heads, c.head_dim),
            use_bias=c.qkv_bias,
            name="k",
            kernel_init=partitioned(_init, "embed", "kv_heads", "head_dim"),
            bias_init=partitioned(nn.initializers.zeros, "kv_heads", "head_dim"),
        )(h)
        v = DenseGeneral(
            (c.kv_heads, c.head_dim),
            use_bias=c.qkv_bias,
            name="v",
            kernel_init=partitioned(_init, "embed", "kv_heads", "head_dim"),
            bias_init=partitioned(nn.initializers.zeros, "kv_heads", "head_dim"),
        )(h)
        if c.qk_norm:
            q, k = (_qk_norm(c, name)(t) for name, t in (("q_norm", q), ("k_norm", k)))
        q, k = (self._rope(t, positions_BL, windowed) for t in (q, k))
        scale = None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5
        sinks = self.param("sinks", partitioned(_init, "heads"), (c.heads,)) if c.attention_sinks else None
        ring = c.context_attention == "ring"
        o = attention(q, k, v, mask, ring=ring, scale=scale, softcap=c.attn_softcap, sinks_H=sinks)
        o = DenseGeneral(
            c.width,
            axis=(-2, -1),
            use_bias=c.out_bias,
            name="o",
            kernel_init=partitioned(_init, "heads", "head_dim", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )(o)
        return o

    def _feed_forward(self, h, valid_BL, segments_BL):
        """The MLP of `h`: the routed experts (and Qwen2-MoE's shared one), or the gated MLP."""
        c = self.cfg
        if c.experts:
            y = MoE(c, name="moe")(h, valid_BL, segments_BL)
            if c.shared_expert_mlp:  # Qwen2-MoE: a dense SwiGLU expert every token takes, behind a sigmoid gate
                f, embed_mlp = c.shared_expert_mlp, partitioned(_init, "embed", "mlp")
                gate = Dense(f, use_bias=False, name="shared_gate", kernel_init=embed_mlp)(h)
                up = Dense(f, use_bias=False, name="shared_up", kernel_init=embed_mlp)(h)
                down = Dense(
                    c.width, use_bias=False, name="shared_down", kernel_init=partitioned(_init, "mlp", "embed")
                )
                door = Dense(
                    1, use_bias=False, name="shared_expert_gate", kernel_init=partitioned(_init, "embed", None)
                )
                y = y + jax.nn.sigmoid(door(h)) * down(nn.silu(gate) * up)
        else:
            gate = Dense(c.mlp, use_bias=False, name="gate", kernel_init=partitioned(_init, "embed", "mlp"))(h)
            up = Dense(c.mlp, use_bias=False, name="up", kernel_init=partitioned(_init, "embed", "mlp"))(h)
            down = Dense(c.width, use_bias=False, name="down", kernel_init=partitioned(_init, "mlp", "embed"))
            y = down(ACTIVATIONS[c.act](gate) * up)
        return y

    def _rope(self, x_BLHK, positions_BL, windowed):
        """RoPE at the global layers' base and scaling, or the windowed layers' own base."""
        c = self.cfg
        if c.mrope_section is not None:  # the three M-RoPE axes after the order (`DecoderLM.body`)
            positions_BL = positions_BL[..., 1:]
        full = rotary(x_BLHK, positions_BL, c.rope_theta, c.rope_scaling, c.mrope_section, c.mrope_interleaved)
        if c.rope_local_theta is None or windowed is False:
            return full
        local = rotary(x_BLHK, positions_BL, c.rope_local_theta, None, c.mrope_section, c.mrope_interleaved)
        return local if windowed is True else jnp.where(windowed, local, full)


class DecoderLM(nn.Module):
    """A causal LM whose pieces can be called apart (`embed`, `body`, `hidden`, `logits`).

    The split matters for compound workloads: a VLM replaces some token embeddings with image
    embeddings between `embed` and `hidden`; a KD teacher section sends `hidden` and the
    student section applies the teacher's output layer.

    `layers=(a, b)` holds only blocks a..b-1 (a pipeline stage): the embedding only where a is 0,
    the final norm and the head only where b is the depth (or as `first` and `last` say, for a
    cut whose first or last stage holds no blocks). Blocks keep the whole model's names
    (`block_<i>`), so a stage's parameters are the matching subtree of the whole model's.
    """

    cfg: LLMConfig
    with_head: bool = True  # False: a body whose output layer lives elsewhere (KD teacher section)
    layers: tuple[int, int] | None = None  # the blocks held, [first, end); None: all
    # whether it holds the embedding / the final norm and head: the first / last pipeline stage
    # (None: where `layers` starts at 0 / ends at the depth; a cut may leave either stage no blocks)
    first: bool | None = None
    last: bool | None = None
    # True: the rows are laid as `workloads.rows.text_rows` lays them (one sample a row from position
    # 0, positions 0, 1, 2, ..., padding after it), so causal attention with key lengths says what
    # the mask says and a fused kernel may take that form; False (rows a caller builds any other
    # way, left padding included): the dense mask always
    rows_from_zero: bool = False

    def setup(self):
        c = self.cfg
        first, end = self.layers or (0, c.depth)
        if first == 0 if self.first is None else self.first:
            self.embedding = self.param("embedding", partitioned(_init, "vocab", "embed"), (c.vocab, c.width))
        self.blocks = layer_stack(DecoderBlock, (c,), end - first, c.remat, c.scan_layers, first, range(c.depth))
        if end == c.depth if self.last is None else self.last:
            self.final_norm = RMSNorm(c.norm_eps)
            if self.with_head and not c.tie_embeddings:
                self.lm_head = self.param("lm_head", partitioned(_init, "embed", "vocab"), (c.width, c.vocab))

    def embed(self, ids_BL):
        x = jnp.take(self.embedding, ids_BL, axis=0)
        if self.cfg.embed_scale:  # Gemma's, in the embedding's dtype as transformers rounds it
            x = x * jnp.asarray(self.cfg.width**0.5, x.dtype)
        return x

    def body(
        self,
        x_BLD,
        positions_BL,
        valid_BL,
        segments_BL=None,
        images_BL=None,
        deepstack_JBLD=None,
        segment_lengths_BM=None,
    ):
        """The held blocks applied to input embeddings (or the previous stage's output), causal
        and padding masked, without the final norm.

        With `images_BL` (`bidirectional_images`: 0 for a text token, k > 0 for the k-th run of
        image tokens in the row, `image_blocks`) an image token also attends to the later tokens
        of its own image, as Gemma 3's VLMs do: global layers see causal OR same image, windowed
        ones window AND (causal OR same image), the window bounding only how far back a key lies.
        With `prefix_lm` the block is each sample's prefix (PaliGemma's image and prompt,
        `workloads.vlm.with_prefix_blocks`), and windowed layers see (window AND causal) OR same
        block, as transformers' PaliGemma 2 does.

        With `sliding_window` a position attends to the `sliding_window` positions ending at its
        own (Mistral's window), counted in positions, so packed samples keep their own windows;
        with `global_every` only the layers `LLMConfig.windowed` names do (Gemma's).

        With `segments_BL` (sequence packing: each sample of a row numbered from 1, 0 padding)
        a position attends only within its own sample; its positions restart at 0, so RoPE and
        the causal order are the sample's own, and each sample's outputs are those it gets alone.

        Under ring attention over a `context` split the positions are laid out in
        `balanced_order` for the layers (each device gets an early and a late chunk, so the
        causal work is even) and put back after: every other op is position-wise, and the mask
        and rotary embeddings follow the positions wherever they sit.

        With `mrope_section` (Qwen2.5-VL's M-RoPE) `positions_BL` is `B x L x 4`: the position in
        the sample, which orders the causal mask and the windows as everywhere, then the
        (temporal, row, column) positions RoPE turns by (`mrope_positions`): an image's tokens
        share one temporal position, so the causal order cannot be read from them.

        With `deepstack_JBLD` (Qwen3-VL's DeepStack, `deepstack_layers`: J image feature sets at
        their image positions, zero elsewhere) block k adds the k-th to its output, as
        transformers' `Qwen3VLTextModel` adds them after its first K layers; a pipeline stage
        passes them where it holds those blocks.

        The mask goes to attention with the rows' structure (`models.attention.Mask`): rows
        without `segments_BL` hold one sample from position 0 with padding after it (as
        `workloads.rows.text_rows` lays them, `valid_BL` a prefix, positions 0, 1, 2, ...), so
        causal attention with key lengths says the same; packed rows with the host's
        `segment_lengths_BM` (`models.attention.segment_lengths`) say it per segment. Image
        blocks, and positions reordered for ring attention, leave only the dense mask."""
        order = balanced_order(x_BLD.shape[1], context_split()) if self.cfg.context_attention == "ring" else None
        if order is not None:
            x_BLD, positions_BL, valid_BL = (t[:, order] for t in (x_BLD, positions_BL, valid_BL))
            segments_BL = None if segments_BL is None else segments_BL[:, order]
            images_BL = None if images_BL is None else images_BL[:, order]
            deepstack_JBLD = None if deepstack_JBLD is None else deepstack_JBLD[:, :, order]
        order_BL = positions_BL[..., 0] if self.cfg.mrope_section is not None else positions_BL
        mask, window_BLL = decoder_mask(
            order_BL,
            valid_BL,
            self.cfg.sliding_window,
            segments_BL,
            images_BL,
            segment_lengths_BM,
            plain=order is None,
            from_zero=self.rows_from_zero,
            blocks_past_window=self.cfg.prefix_lm,
        )
        # the MoE balancing loss is per sample (segments); DeepStack's features after them
        extra = (segments_BL,) if segments_BL is not None else ()
        extra = extra if deepstack_JBLD is None else (segments_BL, deepstack_JBLD)
        h_BLD = self.blocks(x_BLD, positions_BL, mask, window_BLL, valid_BL, *extra)
        return h_BLD if order is None else h_BLD[:, np.argsort(order)]

    def hidden(
        self,
        x_BLD,
        positions_BL,
        valid_BL,
        segments_BL=None,
        images_BL=None,
        deepstack_JBLD=None,
        segment_lengths_BM=None,
    ):
        """Final-normed hidden states from input embeddings (`body`, then the final norm)."""
        h_BLD = self.body(x_BLD, positions_BL, valid_BL, segments_BL, images_BL, deepstack_JBLD, segment_lengths_BM)
        return self.final_norm(h_BLD)

    def final(self, h_BLD):
        """The final norm alone (the last pipeline stage applies it after its `body`)."""
        return self.final_norm(h_BLD)

    def output_weights(self):
        return self.embedding.T if self.cfg.tie_embeddings else self.lm_head

    def logits(self, h_BLD):
        return softcap(h_BLD @ self.output_weights(), self.cfg.final_softcap)

    def __call__(self, ids_BL, positions_BL, valid_BL, segments_BL=None, images_BL=None, segment_lengths_BM=None):
        x_BLD = self.embed(ids_BL)
        return self.logits(self.hidden(x_BLD, positions_BL, valid_BL, segments_BL, images_BL, None, segment_lengths_BM))


def decoder_mask(
    order_BL,
    valid_BL,
    sliding_window=None,
    segments_BL=None,
    images_BL=None,
    segment_lengths_BM=None,
    plain=True,
    from_zero=False,
    blocks_past_window=False,
) -> tuple[Mask, jax.Array]:
    """The decoder's attention mask and its windowed layers' window (`DecoderLM.body`): causal in
    `order_BL` (each position's place in its sample), image blocks bidirectional, padding keys
    masked, each packed sample to itself; with the rows' structure (`models.attention.Mask`)
    where no image blocks are given and the positions are in their own order (`plain`): the
    host's segment lengths of packed rows, or, for rows of one sample each laid from position 0
    (`from_zero`: `DecoderLM.rows_from_zero`), each row's length (its valid positions). With
    `blocks_past_window` (`prefix_lm`: PaliGemma 2's windowed layers, transformers' sliding causal
    mask OR its blocks) a block's keys are in every windowed layer's reach, however far back;
    otherwise (Gemma 3's) the window bounds how far back any key lies."""
    behind_BLL = order_BL[:, :, None] - order_BL[:, None, :]  # how far each key lies back
    mask_BLL = behind_BLL >= 0
    window = sliding_window or behind_BLL.shape[-1]  # transformers' `kv_idx > q_idx - sliding_window`
    window_BLL = behind_BLL < window  # applied by each windowed layer (DecoderBlock)
    if images_BL is not None:
        block_BLL = (images_BL[:, :, None] == images_BL[:, None, :]) & (images_BL[:, :, None] > 0)
        mask_BLL = mask_BLL | block_BLL
        window_BLL = window_BLL | block_BLL if blocks_past_window else window_BLL
    mask_BLL = mask_BLL & valid_BL[:, None, :]
    if segments_BL is not None:
        mask_BLL = mask_BLL & (segments_BL[:, :, None] == segments_BL[:, None, :])
    if not plain or images_BL is not None or (segments_BL is None and not from_zero):
        return Mask(mask_BLL), window_BLL
    if segments_BL is None:
        return Mask(mask_BLL, lengths=jnp.sum(valid_BL, axis=1, dtype=jnp.int32), causal=True), window_BLL
    return Mask(mask_BLL, segment_lengths=segment_lengths_BM, causal=True), window_BLL


def softcap(x, cap: float | None):
    """`cap * tanh(x / cap)` (Gemma 2's logit soft-capping), or `x` without a cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def image_blocks(image_BL: np.ndarray) -> np.ndarray:
    """Each token's image block (`DecoderLM.body`'s `images_BL`) from where a row's image tokens
    are: 0 for other tokens, k for the k-th run of consecutive image tokens (transformers' Gemma 3
    `token_type_ids` blocks; its processor puts other tokens between any two images)."""
    image_BL = np.asarray(image_BL, bool)
    starts = image_BL & ~np.pad(image_BL, ((0, 0), (1, 0)))[:, :-1]
    return np.where(image_BL, np.cumsum(starts, axis=1), 0).astype(np.int32)


def frame_by_frame(video_grids) -> list[tuple[int, int, int, float]]:
    """Qwen3-VL's clips as `mrope_positions` takes them: its processor writes a timestamp and
    vision markers before each temporal patch, so each is positioned as a clip of its own (one
    temporal patch at the block's start, as its `get_rope_index` splits `video_grid_thw`):
    `(frames, rows, columns)` per clip -> `frames` entries of `(1, rows, columns, 0.0)`."""
    return [(1, rows, cols, 0.0) for frames, rows, cols in video_grids for _ in range(frames)]


def mrope_positions(
    ids_L: np.ndarray, image_token: int, grids, video_token: int | None = None, video_grids=()
) -> np.ndarray:
    """A sample's `L x 4` positions for an M-RoPE model (`DecoderLM.body`): each token's place in
    the sample, then its (temporal, row, column) position as transformers' Qwen2.5-VL
    `get_rope_index` computes it (transformers 5.25). Text tokens count on from the last position,
    all three axes equal; an image's `rows x columns` tokens (`grids`: each image's merged grid,
    in order) all take the temporal position where the image starts, s, and rows s + row, columns
    s + column; the text after it resumes at s + max(rows, columns). A video's tokens
    (`video_grids`: each clip's `(frames, rows, columns, interval)` in order, `frames` its
    temporal patches, `interval` its `tokens_per_second * second_per_grid_t`) run frame by frame,
    frame f at temporal position s + floor(f * interval) (in float32), rows and columns as an image's; the
    text after it resumes at s + max(rows, columns) too, however long the clip. Images and videos
    are taken in the order their placeholders come."""
    ids_L = np.asarray(ids_L)
    n = len(ids_L)
    out = np.zeros((n, 4), np.int32)
    out[:, 0] = np.arange(n)
    kinds = {image_token: ("an image", iter((1, r, c, 0.0) for r, c in grids))}
    if video_token is not None:
        kinds[video_token] = ("a video", iter(video_grids))
    is_item = np.isin(ids_L, list(kinds))
    at, lag = 0, 0  # the next token; how far positions lag behind token indices from here
    while is_item[at:].any():
        start = at + int(np.argmax(is_item[at:]))
        what, grids_left = kinds[int(ids_L[start])]
        grid = next(grids_left, None)
        if grid is None:
            break
        frames, rows, cols, interval = grid
        k = frames * rows * cols
        if not (ids_L[start : start + k] == ids_L[start]).all() or start + k > n:
            held = int((ids_L[start : start + k] == ids_L[start]).sum())
            size = f"{frames}x{rows}x{cols}" if what == "a video" else f"{rows}x{cols}"
            raise ValueError(
                f"{what} of {size} tokens at position {start} has {held} placeholders there; each "
                f"{'clip' if what == 'a video' else 'image'} needs that many consecutive placeholders"
            )
        out[at:start, 1:] = (np.arange(at, start) - lag)[:, None]
        s = start - lag
        f, r, c = np.meshgrid(np.arange(frames), np.arange(rows), np.arange(cols), indexing="ij")
        # in float32 and truncated, as transformers computes it (`second_per_grid_ts` is float32)
        out[start : start + k, 1] = s + (f.reshape(-1).astype(np.float32) * np.float32(interval)).astype(np.int32)
        out[start : start + k, 2] = s + r.reshape(-1)
        out[start : start + k, 3] = s + c.reshape(-1)
        lag += k - max(rows, cols)
        at = start + k
    out[at:, 1:] = (np.arange(at, n) - lag)[:, None]
    return out
