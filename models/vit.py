"""ViT encoder over variable-size images, packed per row, with a 2x2 patch merger.

Images of any size (multiples of `patch * merge`) are cut into patches ordered so each
`merge x merge` window is contiguous; all patches of a sample's images are packed into one
row with a segment id per image, and attention is block-diagonal over segments. The merger
concatenates each window and projects it to the LLM width (Qwen2-VL style).
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from models.layers import EncoderBlock, layer_stack, partitioned, segment_mask

_init = nn.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    patch: int
    channels: int
    width: int
    depth: int
    heads: int
    mlp: int
    out_width: int
    merge: int = 2
    max_grid: int = 64
    remat: str = "none"  # per-layer activation checkpointing: none | full | dots (layers.remat_layer)
    scan_layers: bool = False  # layers under nn.scan: stacked parameters, compile time flat in depth

    @property
    def patch_features(self) -> int:
        return self.patch * self.patch * self.channels


class VisionEncoder(nn.Module):
    cfg: ViTConfig

    @nn.compact
    def __call__(self, patches_BPC, segments_BP, grid_BP2):
        """patches -> merged image tokens `B x P/merge**2 x out_width`."""
        c = self.cfg
        x = nn.Dense(
            c.width,
            name="patch_embed",
            kernel_init=partitioned(_init, "patch", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )(patches_BPC)
        row = self.param("pos_row", partitioned(_init, "grid", "embed"), (c.max_grid, c.width))
        col = self.param("pos_col", partitioned(_init, "grid", "embed"), (c.max_grid, c.width))
        x = x + jnp.take(row, grid_BP2[..., 0], axis=0) + jnp.take(col, grid_BP2[..., 1], axis=0)
        mask_BPP = segment_mask(segments_BP)
        x = layer_stack(EncoderBlock, (c.width, c.heads, c.mlp), c.depth, c.remat, c.scan_layers)(x, mask_BPP)
        x = nn.LayerNorm(
            name="merge_norm",
            scale_init=partitioned(nn.initializers.ones, "norm"),
            bias_init=partitioned(nn.initializers.zeros, "norm"),
        )(x)
        b, p, d = x.shape
        window = c.merge * c.merge
        x = x.reshape(b, p // window, window * d)
        x = nn.Dense(
            c.out_width * 2,
            name="merger_fc1",
            kernel_init=partitioned(_init, "embed", "mlp"),
            bias_init=partitioned(nn.initializers.zeros, "mlp"),
        )(x)
        return nn.Dense(
            c.out_width,
            name="merger_fc2",
            kernel_init=partitioned(_init, "mlp", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )(nn.gelu(x))
