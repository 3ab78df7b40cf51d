"""Audio encoder over variable-length clips of log-mel frames, packed per row.

Each clip (T x mel, T a multiple of `frames_per_token`) is cut into groups of
`frames_per_token` consecutive frames; a group is one token. Tokens of all a sample's clips
are packed into one row with a segment id per clip; attention stays within each clip.

Two stems turn a group into a token (`stem`):
  dense: one linear map of the group's frames;
  conv: Whisper's two convolutions over time (kernel 3, stride 1 then 2, GELU after each),
    so a token also reads its neighbours' frames, zero-padded at the clip's edges exactly as
    the convolutions pad. Two frames make a token (`frames_per_token` = 2). With `norm_eps`
    and `act` from its config, the encoder up to `out_norm` (Whisper's final `layer_norm`) is
    `WhisperEncoder`, and `models.hf_encoders` loads its weights. A clip of the checkpoint's
    length (2 x `max_tokens` frames, 30 s) gets exactly Whisper's features; a shorter one is
    encoded without Whisper's padding to 30 s.
Positions are a learned table, one row per token (Whisper stores its sinusoids the same way).
With `pool` > 1 every `pool` consecutive tokens are averaged after the last block, before
`out_norm` (Qwen2-Audio's encoder: Whisper's with `AvgPool1d(2, 2)` there): a row of N tokens
leaves as N / pool. Clips hold a multiple of `pool` tokens and are packed from the row's start, so
each run of `pool` lies within one clip and pooled token j of the row is the clip's own.
"""

import flax.linen as nn
import jax.numpy as jnp
from maestro_jax.models.configs import AudioConfig
from maestro_jax.models.layers import ACTIVATIONS, Dense, EncoderBlock, item_mask, layer_stack, partitioned

_init = nn.initializers.normal(0.02)


def _neighbour(x_BNX, same_BN, step: int):
    """Each token's neighbour `step` along the row (-1: the previous one, +1: the next), zero where
    that neighbour belongs to another clip or is padding: a convolution's zero padding at the
    clip's edges. (`roll` wraps round the row; the row's first and last tokens are masked.)"""
    return jnp.where(same_BN[..., None], jnp.roll(x_BNX, -step, axis=1), 0)


def _pooled(x_BNW, pool: int):
    """Each run of `pool` tokens averaged (a row's padding to a multiple of `pool` pools apart)."""
    if pool == 1:
        return x_BNW
    b, n, w = x_BNW.shape
    x_BNW = jnp.pad(x_BNW, ((0, 0), (0, -n % pool), (0, 0)))
    return x_BNW.reshape(b, -1, pool, w).mean(axis=2)


class ConvStem(nn.Module):
    """Whisper's stem on packed two-frame tokens: conv1 (kernel 3, stride 1, pad 1) over frames,
    GELU, conv2 (kernel 3, stride 2, pad 1), GELU. Kernels are `[3, in, out]` (tap k reads frame
    f + k - 1), so token t = frames (2t, 2t + 1) reads frames 2t - 2 .. 2t + 2 of its clip."""

    mel: int
    width: int
    act: str

    @nn.compact
    def __call__(self, frames_BNF, segments_BN):
        act = ACTIVATIONS[self.act]
        w1 = self.param("conv1_kernel", partitioned(_init, None, "patch", "embed"), (3, self.mel, self.width))
        b1 = self.param("conv1_bias", partitioned(nn.initializers.zeros, "embed"), (self.width,))
        w2 = self.param("conv2_kernel", partitioned(_init, None, "mlp", "embed"), (3, self.width, self.width))
        b2 = self.param("conv2_bias", partitioned(nn.initializers.zeros, "embed"), (self.width,))
        b, n, _ = frames_BNF.shape
        even, odd = (frames_BNF.reshape(b, n, 2, self.mel)[:, :, i] for i in (0, 1))
        same_prev = jnp.pad(segments_BN[:, 1:] == segments_BN[:, :-1], ((0, 0), (1, 0))) & (segments_BN > 0)
        same_next = jnp.pad(segments_BN[:, :-1] == segments_BN[:, 1:], ((0, 0), (0, 1))) & (segments_BN > 0)
        h_even = act(_neighbour(odd, same_prev, -1) @ w1[0] + even @ w1[1] + odd @ w1[2] + b1)
        h_odd = act(even @ w1[0] + odd @ w1[1] + _neighbour(even, same_next, 1) @ w1[2] + b1)
        return act(_neighbour(h_odd, same_prev, -1) @ w2[0] + h_even @ w2[1] + h_odd @ w2[2] + b2)


class AudioEncoder(nn.Module):
    cfg: AudioConfig

    def setup(self):
        c = self.cfg
        if c.stem == "conv":
            self.stem = ConvStem(c.mel, c.width, c.act)
        else:
            self.frame_embed = Dense(
                c.width,
                kernel_init=partitioned(_init, "patch", "embed"),
                bias_init=partitioned(nn.initializers.zeros, "embed"),
            )
        self.pos = self.param("pos", partitioned(_init, "grid", "embed"), (c.max_tokens, c.width))
        self.blocks = layer_stack(
            EncoderBlock, (c.width, c.heads, c.mlp, c.norm_eps, c.act), c.depth, c.remat, c.scan_layers
        )
        self.out_norm = nn.LayerNorm(
            epsilon=c.norm_eps,
            scale_init=partitioned(nn.initializers.ones, "norm"),
            bias_init=partitioned(nn.initializers.zeros, "norm"),
        )
        self.out_proj = Dense(
            c.out_width,
            kernel_init=partitioned(_init, "embed", "mlp"),
            bias_init=partitioned(nn.initializers.zeros, "mlp"),
        )

    def features(self, frames_BNF, segments_BN, positions_BN1, segment_lengths_BM=None):
        """Frame groups -> the last block's output, pooled, through `out_norm`, `B x N / pool x
        width` (Whisper's and Qwen2-Audio's `last_hidden_state`); `segment_lengths_BM`: the host's
        per-clip token counts (`models.attention.segment_lengths`), where it sent them."""
        x = self.stem(frames_BNF, segments_BN) if self.cfg.stem == "conv" else self.frame_embed(frames_BNF)
        x = x + jnp.take(self.pos, positions_BN1[..., 0], axis=0)
        return self.out_norm(_pooled(self.blocks(x, item_mask(segments_BN, segment_lengths_BM)), self.cfg.pool))

    def __call__(self, frames_BNF, segments_BN, positions_BN1, segment_lengths_BM=None):
        """Frame groups -> audio tokens `B x N / pool x out_width`."""
        return self.out_proj(self.features(frames_BNF, segments_BN, positions_BN1, segment_lengths_BM))
