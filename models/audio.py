"""Audio encoder over variable-length clips of log-mel frames, packed per row.

Each clip (T x mel, T a multiple of `frames_per_token`) is cut into groups of
`frames_per_token` consecutive frames; a group is one token. Tokens of all a sample's clips
are packed into one row with a segment id per clip; attention stays within each clip (the
Whisper-style encoder, with a learned position per token instead of a convolution stem).
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from models.layers import EncoderBlock, layer_stack, partitioned, segment_mask

_init = nn.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    mel: int  # features per frame
    frames_per_token: int
    width: int
    depth: int
    heads: int
    mlp: int
    out_width: int  # the consumer's width (audio tokens enter the LLM)
    max_tokens: int = 1500  # learned positions: the longest clip, in tokens
    remat: str = "none"  # per-layer activation checkpointing: none | full | dots (layers.remat_layer)
    scan_layers: bool = False  # layers under nn.scan: stacked parameters, compile time flat in depth

    @property
    def token_features(self) -> int:
        return self.frames_per_token * self.mel


class AudioEncoder(nn.Module):
    cfg: AudioConfig

    @nn.compact
    def __call__(self, frames_BNF, segments_BN, positions_BN1):
        """Frame groups -> audio tokens `B x N x out_width`."""
        c = self.cfg
        x = nn.Dense(
            c.width,
            name="frame_embed",
            kernel_init=partitioned(_init, "patch", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )(frames_BNF)
        pos = self.param("pos", partitioned(_init, "grid", "embed"), (c.max_tokens, c.width))
        x = x + jnp.take(pos, positions_BN1[..., 0], axis=0)
        mask = segment_mask(segments_BN)
        x = layer_stack(EncoderBlock, (c.width, c.heads, c.mlp), c.depth, c.remat, c.scan_layers)(x, mask)
        x = nn.LayerNorm(
            name="out_norm",
            scale_init=partitioned(nn.initializers.ones, "norm"),
            bias_init=partitioned(nn.initializers.zeros, "norm"),
        )(x)
        return nn.Dense(
            c.out_width,
            name="out_proj",
            kernel_init=partitioned(_init, "embed", "mlp"),
            bias_init=partitioned(nn.initializers.zeros, "mlp"),
        )(x)
