"""ViT encoder over variable-size images, packed per row, with a 2x2 patch merger.

Images of any size (multiples of `patch * merge`) are cut into patches ordered so each
`merge x merge` window is contiguous; all patches of a sample's images are packed into one
row with a segment id per image, and attention is block-diagonal over segments. The merger
concatenates each window and projects it to the LLM width (Qwen2-VL style).

Position embeddings come in two layouts (`pos_embed`):
  row_col: a learned row table and a learned column table, added (any aspect ratio up to
    `max_grid` patches a side);
  table: one learned embedding per patch of a `max_grid x max_grid` grid, row-major, which is
    SigLIP's layout: with `norm_eps` and `act` from its config the encoder up to `merge_norm`
    (SigLIP's `post_layernorm`) is SigLIP's vision tower, and `models.hf_encoders` loads its
    weights. An image of the checkpoint's size (`max_grid * patch` a side) gets exactly SigLIP's
    features; a smaller one takes the top-left `h x w` part of the grid (SigLIP would resize
    the table bicubically, `interpolate_pos_encoding`).
Attention is permutation-equivariant and every position is added by its own grid coordinates,
so the merge-window patch order changes nothing but the order of the outputs.
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
from maestro_jax.models.layers import EncoderBlock, layer_stack, partitioned, segment_mask

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
    pos_embed: str = "row_col"  # row_col | table (SigLIP): see the module docstring
    norm_eps: float = 1e-6  # every LayerNorm's epsilon (SigLIP: layer_norm_eps)
    act: str = "gelu_pytorch_tanh"  # the blocks' MLP activation: a key of layers.ACTIVATIONS
    remat: str = "none"  # per-layer activation checkpointing: none | full | dots (layers.remat_layer)
    scan_layers: bool = False  # layers under nn.scan: stacked parameters, compile time flat in depth

    @property
    def patch_features(self) -> int:
        return self.patch * self.patch * self.channels


class VisionEncoder(nn.Module):
    cfg: ViTConfig

    def setup(self):
        c = self.cfg
        self.patch_embed = nn.Dense(
            c.width,
            kernel_init=partitioned(_init, "patch", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )
        if c.pos_embed == "table":
            self.pos = self.param("pos", partitioned(_init, "grid", "embed"), (c.max_grid * c.max_grid, c.width))
        else:
            self.pos_row = self.param("pos_row", partitioned(_init, "grid", "embed"), (c.max_grid, c.width))
            self.pos_col = self.param("pos_col", partitioned(_init, "grid", "embed"), (c.max_grid, c.width))
        self.blocks = layer_stack(
            EncoderBlock, (c.width, c.heads, c.mlp, c.norm_eps, c.act), c.depth, c.remat, c.scan_layers
        )
        self.merge_norm = nn.LayerNorm(
            epsilon=c.norm_eps,
            scale_init=partitioned(nn.initializers.ones, "norm"),
            bias_init=partitioned(nn.initializers.zeros, "norm"),
        )
        self.merger_fc1 = nn.Dense(
            c.out_width * 2,
            kernel_init=partitioned(_init, "embed", "mlp"),
            bias_init=partitioned(nn.initializers.zeros, "mlp"),
        )
        self.merger_fc2 = nn.Dense(
            c.out_width,
            kernel_init=partitioned(_init, "mlp", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )

    def features(self, patches_BPC, segments_BP, grid_BP2):
        """patches -> (the last block's output, that output through `merge_norm`), `B x P x width`
        each, in the patches' order: SigLIP's `hidden_states[-1]` and `last_hidden_state`."""
        c = self.cfg
        x = self.patch_embed(patches_BPC)
        if c.pos_embed == "table":
            x = x + jnp.take(self.pos, grid_BP2[..., 0] * c.max_grid + grid_BP2[..., 1], axis=0)
        else:
            x = x + jnp.take(self.pos_row, grid_BP2[..., 0], axis=0) + jnp.take(self.pos_col, grid_BP2[..., 1], axis=0)
        x = self.blocks(x, segment_mask(segments_BP))
        return x, self.merge_norm(x)

    def __call__(self, patches_BPC, segments_BP, grid_BP2):
        """patches -> merged image tokens `B x P/merge**2 x out_width`."""
        c = self.cfg
        _, x = self.features(patches_BPC, segments_BP, grid_BP2)
        b, p, d = x.shape
        window = c.merge * c.merge
        x = x.reshape(b, p // window, window * d)
        return self.merger_fc2(nn.gelu(self.merger_fc1(x)))
