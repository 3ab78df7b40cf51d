"""What a work unit of the built-in models costs (`UnitCost`), from their configs.

Counted as the models compute: every matmul costs 2 FLOPs per weight per unit; attention
costs 2 x 2 x heads x head_dim per pair of positions (scores and the weighted sum), halved
for causal attention. Activation bytes follow what each block keeps for its backward in
float32 (`tests/test_workloads.py` checks the FLOPs against XLA's cost analysis).
"""

from __future__ import annotations

from maestro_jax.core.graph import UnitCost
from maestro_jax.models import AudioConfig, LLMConfig, ViTConfig

F32 = 4


def _encoder_layer(width: int, mlp: int) -> float:
    return 2 * 4 * width * width + 2 * 2 * width * mlp  # q, k, v, o; a two-matmul GELU MLP


def llm_cost(c: LLMConfig, head: bool, extra_flops: float = 0.0) -> UnitCost:
    """A decoder token; `head`: the output layer runs here (the sink). A mixture-of-experts FFN
    counts what its dispatch runs, plus the router: `dense` every expert on every token, and so
    does `ragged` (XLA:CPU and XLA:GPU expand jax.lax.ragged_dot into a product masked per
    expert, xla ragged_dot_rewriter.cc); `sparse` and `grouped` the token's experts_per_token
    experts (the sparse dispatch's tile
    padding and, under an `expert` axis, its worst-case buffers are left out)."""
    moe = c.experts > 0
    every = c.moe_dispatch in ("dense", "ragged")
    mlp = (c.experts if every else c.experts_per_token) * c.expert_mlp if moe else c.mlp
    mlp += c.shared_expert_mlp if moe else 0  # Qwen2-MoE's shared expert, every token's
    proj = 2 * c.width * (c.heads + 2 * c.kv_heads) * c.head_dim + 2 * c.heads * c.head_dim * c.width
    router = 2 * c.width * (c.experts + (1 if c.shared_expert_mlp else 0)) if moe else 0  # and its gate
    ffn = 3 * 2 * c.width * mlp + router
    linear = c.depth * (proj + ffn) + (2 * c.width * c.vocab if head else 0)
    return UnitCost(
        flops=float(linear + extra_flops),
        attention_flops=float(c.depth * 2 * 2 * c.heads * c.head_dim) / 2,
        width=c.width,
        layer_bytes=6 * c.width * F32,
        layer_bytes_sharded=3 * mlp * F32,
        layers=c.depth,
        logits=c.vocab if head else 0,
        kv_width=2 * c.kv_heads * c.head_dim,
        routed_width=c.experts_per_token * c.width if moe else 0,
        rate_kind="decoder_moe" if moe else "decoder",
    )


def vit_cost(c: ViTConfig, mean_patches_per_image: float) -> UnitCost:
    """A patch: the patch embedding, the blocks and its share of the projector (the merger's two
    layers over a concatenated window, the average pool's one projection, or the linear one of
    each window's patches; each DeepStack merger
    as much again); attention runs within each image, so its context is the mean image's patch count."""
    window = c.merge * c.merge
    if c.projector == "avg_pool":
        projector = 2 * c.width * c.out_width / window
    elif c.projector == "linear":
        projector = 2 * c.width * c.out_width
    else:
        projector = (2 * window * c.width * 2 * c.out_width + 2 * 2 * c.out_width * c.out_width) / window
    projector *= 1 + len(c.deepstack_layers)
    linear = 2 * c.patch_features * c.width + c.layers * _encoder_layer(c.width, c.mlp) + projector
    return UnitCost(
        flops=float(linear),
        attention_flops=float(c.layers * 2 * 2 * c.width),
        attention_span=mean_patches_per_image,
        width=c.width,
        layer_bytes=6 * c.width * F32,
        layer_bytes_sharded=3 * c.mlp * F32,
        layers=c.layers,
        kv_width=2 * c.width,
        rate_kind="vit",
    )


def audio_cost(c: AudioConfig, mean_tokens_per_clip: float) -> UnitCost:
    """An audio token (a group of frames); attention runs within each clip. Whisper's conv stem
    runs its first kernel-3 convolution on each of the token's 2 frames, its second once. Priced
    at the dense curve's rate (`rate_kind` decoder): no GPU row has timed an audio block."""
    stem = 2 * 3 * (2 * c.mel + c.width) * c.width if c.stem == "conv" else 2 * c.token_features * c.width
    linear = stem + c.depth * _encoder_layer(c.width, c.mlp) + 2 * c.width * c.out_width / c.pool  # pooled out
    return UnitCost(
        flops=float(linear),
        attention_flops=float(c.depth * 2 * 2 * c.width),
        attention_span=mean_tokens_per_clip,
        width=c.width,
        layer_bytes=6 * c.width * F32,
        layer_bytes_sharded=3 * c.mlp * F32,
        layers=c.depth,
        kv_width=2 * c.width,
    )
