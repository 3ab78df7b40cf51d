"""Decoder-only LLM in the Llama/Qwen family: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.layers import (
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

_init = nn.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class LLMConfig:
    vocab: int
    width: int
    depth: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE
    experts: int = 0  # > 0: a mixture-of-experts FFN in every block instead of the dense one
    experts_per_token: int = 0
    expert_mlp: int = 0
    router_aux_loss: float = 0.0  # weight of the load-balancing loss each MoE layer adds (Qwen3-MoE: 0.001)
    moe_dispatch: str = "dense"  # dense: every expert sees every token (shards over `expert`); ragged: sorted, grouped matmuls
    remat: str = "none"  # per-layer activation checkpointing: none | full | dots (layers.remat_layer)
    scan_layers: bool = False  # layers under nn.scan: stacked parameters, compile time flat in depth
    context_attention: str = "ring"  # over a `context` split: ring (balanced, skips masked blocks) | gather


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE style: softmax router, top-k weights renormalised).

    Dispatch is dense and exact: every expert sees every token and the router's combine weights
    (zero outside a token's top k) select the result, so the output and gradients equal those of
    a dropless sparse dispatch. It costs `experts` times the compute of a sparse kernel: right
    for tests and small runs; parameter shapes (what the planner reads) are the real ones.

    Expert parallelism: expert weights are sharded over the `expert` mesh axis, which also
    shards the batch. Tokens are gathered over that axis (`expert_batch` keeps them sharded
    over data and fsdp only), each device runs its own experts on the whole group's tokens, and
    the combine's sum over experts is reduce-scattered back to the batch layout: the collective
    form of the all-to-all dispatch, each token crossing the axis once each way.

    Load balancing: with `router_aux_loss` > 0 each layer sows, into the `losses` collection,
    the Switch-Transformer balance loss `experts * sum_e f_e * P_e` computed per sequence over
    its valid tokens (f_e: the share of routed slots going to expert e, P_e: its mean router
    probability) and weighted by the sequence's valid-token count. Per-sequence terms add up
    over any split of the batch into micro-batches, so the step stays equal to the monolithic
    one whatever the schedule; a batch-wide balance loss would not."""

    cfg: LLMConfig

    @nn.compact
    def __call__(self, h_BLD, valid_BL):
        c = self.cfg
        router = self.param("router", partitioned(_init, "embed", "expert"), (c.width, c.experts))
        gate = self.param("gate", partitioned(_init, "expert", "embed", "mlp"), (c.experts, c.width, c.expert_mlp))
        up = self.param("up", partitioned(_init, "expert", "embed", "mlp"), (c.experts, c.width, c.expert_mlp))
        down = self.param("down", partitioned(_init, "expert", "mlp", "embed"), (c.experts, c.expert_mlp, c.width))
        probs_BLE = jax.nn.softmax((h_BLD @ router).astype(jnp.float32), axis=-1)
        top, index = jax.lax.top_k(probs_BLE, c.experts_per_token)
        weights = top / jnp.sum(top, axis=-1, keepdims=True)
        chosen_BLE = jnp.sum(jax.nn.one_hot(index, c.experts), axis=-2)
        combine_BLE = jnp.sum(jax.nn.one_hot(index, c.experts) * weights[..., None], axis=-2).astype(h_BLD.dtype)
        if c.router_aux_loss:
            self.sow("losses", "router_balance", c.router_aux_loss * balance_loss_sum(probs_BLE, chosen_BLE, valid_BL,
                                                                                      c.experts_per_token))
        if c.moe_dispatch == "ragged":
            return shard_sequence(ragged_experts(h_BLD, index, weights.astype(h_BLD.dtype), gate, up, down))
        group = ("expert_batch", "length", "act_embed")
        h_BLD = constrain(h_BLD, group)
        combine_BLE = constrain(combine_BLE, ("expert_batch", "length", "expert"))
        act = nn.silu(jnp.einsum("bld,edf->blef", h_BLD, gate)) * jnp.einsum("bld,edf->blef", h_BLD, up)
        act = constrain(act, ("expert_batch", "length", "expert", "mlp"))
        return shard_sequence(jnp.einsum("blef,efd,ble->bld", act, down, combine_BLE))


def ragged_experts(h_BLD, index_BLK, weights_BLK, gate_EDF, up_EDF, down_EFD):
    """Dropless sparse dispatch: the (token, expert) pairs sorted by expert, each expert's run of
    tokens through its weights with grouped matmuls (`jax.lax.ragged_dot`), and the results added
    back weighted. Only the chosen experts' FLOPs (experts_per_token per token); the same result
    as the dense dispatch up to summation order. Expert weights are used whole: under an
    `expert` axis the compiler gathers them, so expert parallelism wants the dense dispatch."""
    b, l, d = h_BLD.shape
    k, experts = index_BLK.shape[-1], gate_EDF.shape[0]
    h_TD = h_BLD.reshape(b * l, d)
    expert_of = index_BLK.reshape(-1)  # one entry per (token, slot)
    order = jnp.argsort(expert_of, stable=True)
    token_of = order // k
    x = h_TD[token_of]
    sizes = jnp.bincount(expert_of, length=experts).astype(jnp.int32)
    act = nn.silu(jax.lax.ragged_dot(x, gate_EDF, sizes)) * jax.lax.ragged_dot(x, up_EDF, sizes)
    y = jax.lax.ragged_dot(act, down_EFD, sizes) * weights_BLK.reshape(-1)[order][:, None]
    return jnp.zeros_like(h_TD).at[token_of].add(y).reshape(b, l, d)


def balance_loss_sum(probs_BLE, chosen_BLE, valid_BL, k: int):
    """Sum over sequences of (valid tokens) x (experts * sum_e f_e * P_e), in float32."""
    v = valid_BL.astype(jnp.float32)[..., None]
    count_B = jnp.sum(v, axis=(1, 2))  # an empty (padding) row has f = P = 0 and adds nothing
    n_B1 = jnp.maximum(count_B, 1.0)[:, None]
    f_BE = jnp.sum(chosen_BLE * v, axis=1) / (k * n_B1)
    p_BE = jnp.sum(probs_BLE * v, axis=1) / n_B1
    return jnp.sum(count_B * probs_BLE.shape[-1] * jnp.sum(f_BE * p_BE, axis=-1))


class DecoderBlock(nn.Module):
    cfg: LLMConfig

    @nn.compact
    def __call__(self, x_BLD, positions_BL, mask_BLL, valid_BL):
        c = self.cfg
        x_BLD = shard_sequence(x_BLD)
        h = RMSNorm(c.norm_eps, name="attn_norm")(x_BLD)
        q = nn.DenseGeneral((c.heads, c.head_dim), use_bias=c.qkv_bias, name="q",
                            kernel_init=partitioned(_init, "embed", "heads", "head_dim"),
                            bias_init=partitioned(nn.initializers.zeros, "heads", "head_dim"))(h)
        k = nn.DenseGeneral((c.kv_heads, c.head_dim), use_bias=c.qkv_bias, name="k",
                            kernel_init=partitioned(_init, "embed", "kv_heads", "head_dim"),
                            bias_init=partitioned(nn.initializers.zeros, "kv_heads", "head_dim"))(h)
        v = nn.DenseGeneral((c.kv_heads, c.head_dim), use_bias=c.qkv_bias, name="v",
                            kernel_init=partitioned(_init, "embed", "kv_heads", "head_dim"),
                            bias_init=partitioned(nn.initializers.zeros, "kv_heads", "head_dim"))(h)
        if c.qk_norm:
            q = RMSNorm(c.norm_eps, name="q_norm")(q)
            k = RMSNorm(c.norm_eps, name="k_norm")(k)
        q = rotary(q, positions_BL, c.rope_theta)
        k = rotary(k, positions_BL, c.rope_theta)
        o = attention(q, k, v, mask_BLL, ring=c.context_attention == "ring")
        x_BLD = x_BLD + nn.DenseGeneral(c.width, axis=(-2, -1), use_bias=False, name="o",
                                        kernel_init=partitioned(_init, "heads", "head_dim", "embed"))(o)
        h = RMSNorm(c.norm_eps, name="mlp_norm")(x_BLD)
        if c.experts:
            return x_BLD + MoE(c, name="moe")(h, valid_BL)
        gate = nn.Dense(c.mlp, use_bias=False, name="gate", kernel_init=partitioned(_init, "embed", "mlp"))(h)
        up = nn.Dense(c.mlp, use_bias=False, name="up", kernel_init=partitioned(_init, "embed", "mlp"))(h)
        down = nn.Dense(c.width, use_bias=False, name="down", kernel_init=partitioned(_init, "mlp", "embed"))
        return shard_sequence(x_BLD + down(nn.silu(gate) * up))


class DecoderLM(nn.Module):
    """A causal LM whose pieces can be called apart (`embed`, `hidden`, `logits`).

    The split matters for compound workloads: a VLM replaces some token embeddings with image
    embeddings between `embed` and `hidden`; a KD teacher section sends `hidden` and the
    student section applies the teacher's output layer.
    """

    cfg: LLMConfig
    with_head: bool = True  # False: a body whose output layer lives elsewhere (KD teacher section)

    def setup(self):
        c = self.cfg
        self.embedding = self.param("embedding", partitioned(_init, "vocab", "embed"), (c.vocab, c.width))
        self.blocks = layer_stack(DecoderBlock, (c,), c.depth, c.remat, c.scan_layers)
        self.final_norm = RMSNorm(c.norm_eps)
        if self.with_head and not c.tie_embeddings:
            self.lm_head = self.param("lm_head", partitioned(_init, "embed", "vocab"), (c.width, c.vocab))

    def embed(self, ids_BL):
        return jnp.take(self.embedding, ids_BL, axis=0)

    def hidden(self, x_BLD, positions_BL, valid_BL):
        """Final-normed hidden states from input embeddings (causal, padding masked).

        Under ring attention over a `context` split the positions are laid out in
        `balanced_order` for the layers (each device gets an early and a late chunk, so the
        causal work is even) and put back after: every other op is position-wise, and the mask
        and rotary embeddings follow the positions wherever they sit."""
        order = (balanced_order(x_BLD.shape[1], context_split())
                 if self.cfg.context_attention == "ring" else None)
        if order is not None:
            x_BLD, positions_BL, valid_BL = (t[:, order] for t in (x_BLD, positions_BL, valid_BL))
        causal = positions_BL[:, :, None] >= positions_BL[:, None, :]
        mask_BLL = causal & valid_BL[:, None, :]
        h_BLD = self.final_norm(self.blocks(x_BLD, positions_BL, mask_BLL, valid_BL))
        return h_BLD if order is None else h_BLD[:, np.argsort(order)]

    def output_weights(self):
        return self.embedding.T if self.cfg.tie_embeddings else self.lm_head

    def logits(self, h_BLD):
        return h_BLD @ self.output_weights()

    def __call__(self, ids_BL, positions_BL, valid_BL):
        return self.logits(self.hidden(self.embed(ids_BL), positions_BL, valid_BL))
