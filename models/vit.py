"""ViT encoder over variable-size images, packed per row, with a 2x2 patch merger.

Images of any size (multiples of `patch * merge`) are cut into patches ordered so each
`merge x merge` window is contiguous; all patches of a sample's images are packed into one
row with a segment id per image, and attention is block-diagonal over segments. The projector
to the LLM width reads each window (`projector`): `merger` concatenates the window's patches and
runs a two-layer MLP (Qwen2-VL's merger); `avg_pool` averages them, RMS-normalises and projects
without a bias (Gemma 3's `multi_modal_projector`: its average pool of kernel `merge` over the
patch grid, its `mm_soft_emb_norm` and `mm_input_projection_weight`).

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

`class_token` (with `pos_embed: table`) is CLIP's layout, LLaVA's vision tower: each image gets
a learned class token (`class_embed` plus the table's first row; the patches take rows 1..G*G),
a LayerNorm (`pre_norm`, CLIP's `pre_layrnorm`) runs before the blocks, and the patch
projection has no bias. A row's class tokens sit after its patches, one per image (the host's
`class_segments` name their images); they take part in attention and are dropped after the
blocks, so the merger reads patch features only (LLaVA's `vision_feature_select_strategy:
default`) and its 2x2 windows stay whole. `merge_norm` is then CLIP's `post_layernorm`.

`feature_layer` picks the hidden state the merger reads, numbered as Hugging Face's
`hidden_states` (LLaVA's `vision_feature_layer`): -1 the last block's output, -2 the one
before, k > 0 the k-th block's. The blocks after it are neither held nor run (`layers` of the
`depth`), so none sits idle in the optimizer.
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
from maestro_jax.models.layers import Dense, EncoderBlock, RMSNorm, layer_stack, partitioned, segment_mask

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
    class_token: bool = False  # CLIP's layout: see the module docstring
    feature_layer: int = -1  # the hidden state the merger reads (HF's numbering): see the module docstring
    projector: str = "merger"  # merger (Qwen2-VL) | avg_pool (Gemma 3): see the module docstring
    remat: str = "none"  # per-layer activation checkpointing: none | full | dots (layers.remat_layer)
    scan_layers: bool = False  # layers under nn.scan: stacked parameters, compile time flat in depth

    @property
    def patch_features(self) -> int:
        return self.patch * self.patch * self.channels

    @property
    def layers(self) -> int:
        """The blocks held and run: those up to `feature_layer`."""
        return held_layers(self.depth, self.feature_layer)


def held_layers(depth: int, feature_layer: int) -> int:
    """The blocks up to hidden state `feature_layer` (HF's numbering) of a `depth`-block tower."""
    n = depth + 1 + feature_layer if feature_layer < 0 else feature_layer
    if not 1 <= n <= depth:
        raise ValueError(
            f"feature_layer={feature_layer}: a tower of depth {depth} has block outputs -{depth}..-1 or 1..{depth}"
        )
    return n


class VisionEncoder(nn.Module):
    cfg: ViTConfig

    def setup(self):
        c = self.cfg
        if c.class_token and c.pos_embed != "table":
            raise ValueError(f"class_token (CLIP's layout) needs pos_embed='table', not {c.pos_embed!r}")
        self.patch_embed = Dense(
            c.width,
            use_bias=not c.class_token,
            kernel_init=partitioned(_init, "patch", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )
        if c.class_token:
            self.class_embed = self.param("class_embed", partitioned(_init, "embed"), (c.width,))
            self.pre_norm = nn.LayerNorm(
                epsilon=c.norm_eps,
                scale_init=partitioned(nn.initializers.ones, "norm"),
                bias_init=partitioned(nn.initializers.zeros, "norm"),
            )
        if c.pos_embed == "table":
            cells = c.max_grid * c.max_grid + int(c.class_token)
            self.pos = self.param("pos", partitioned(_init, "grid", "embed"), (cells, c.width))
        else:
            self.pos_row = self.param("pos_row", partitioned(_init, "grid", "embed"), (c.max_grid, c.width))
            self.pos_col = self.param("pos_col", partitioned(_init, "grid", "embed"), (c.max_grid, c.width))
        self.blocks = layer_stack(
            EncoderBlock, (c.width, c.heads, c.mlp, c.norm_eps, c.act), c.layers, c.remat, c.scan_layers
        )
        self.merge_norm = nn.LayerNorm(
            epsilon=c.norm_eps,
            scale_init=partitioned(nn.initializers.ones, "norm"),
            bias_init=partitioned(nn.initializers.zeros, "norm"),
        )
        if c.projector == "avg_pool":
            self.proj_norm = RMSNorm(c.norm_eps)
            self.proj = Dense(c.out_width, use_bias=False, kernel_init=partitioned(_init, "mlp", "embed"))
        elif c.projector == "merger":
            self.merger_fc1 = Dense(
                c.out_width * 2,
                kernel_init=partitioned(_init, "embed", "mlp"),
                bias_init=partitioned(nn.initializers.zeros, "mlp"),
            )
            self.merger_fc2 = Dense(
                c.out_width,
                kernel_init=partitioned(_init, "mlp", "embed"),
                bias_init=partitioned(nn.initializers.zeros, "embed"),
            )
        else:
            raise ValueError(f"projector={c.projector!r}: one of 'merger', 'avg_pool'")

    def features(self, patches_BPC, segments_BP, grid_BP2, class_segments_BK=None):
        """patches -> (hidden state `feature_layer`, that state through `merge_norm`), `B x P x width`
        each, in the patches' order: SigLIP's `hidden_states[-1]` and `last_hidden_state`; with
        `class_token`, CLIP's `hidden_states[feature_layer][:, 1:]` (`class_segments_BK`: the
        image of each of the row's K class tokens, 0 for none)."""
        c = self.cfg
        x = self.patch_embed(patches_BPC)
        if c.pos_embed == "table":
            cell = grid_BP2[..., 0] * c.max_grid + grid_BP2[..., 1] + int(c.class_token)
            x = x + jnp.take(self.pos, cell, axis=0)
        else:
            x = x + jnp.take(self.pos_row, grid_BP2[..., 0], axis=0) + jnp.take(self.pos_col, grid_BP2[..., 1], axis=0)
        p = x.shape[1]
        if c.class_token:
            if class_segments_BK is None:
                raise ValueError("class_token: the encoder needs class_segments (one class token per image)")
            k = class_segments_BK.shape[1]
            cls = jnp.broadcast_to(self.class_embed + self.pos[0], (x.shape[0], k, c.width)).astype(x.dtype)
            x = self.pre_norm(jnp.concatenate([x, cls], axis=1))
            segments_BP = jnp.concatenate([segments_BP, class_segments_BK], axis=1)
        x = self.blocks(x, segment_mask(segments_BP))[:, :p]
        return x, self.merge_norm(x)

    def __call__(self, patches_BPC, segments_BP, grid_BP2, class_segments_BK=None):
        """patches -> image tokens `B x P/merge**2 x out_width`, one per merge x merge window."""
        c = self.cfg
        _, x = self.features(patches_BPC, segments_BP, grid_BP2, class_segments_BK)
        b, p, d = x.shape
        window = c.merge * c.merge
        if c.projector == "avg_pool":
            pooled = x.reshape(b, p // window, window, d).astype(jnp.float32).mean(axis=2).astype(x.dtype)
            return self.proj(self.proj_norm(pooled))
        return self.merger_fc2(nn.gelu(self.merger_fc1(x.reshape(b, p // window, window * d))))
