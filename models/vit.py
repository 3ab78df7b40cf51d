"""ViT encoder over variable-size images, packed per row, with a 2x2 patch merger.

Images of any size (multiples of `patch * merge`) are cut into patches ordered so each
`merge x merge` window is contiguous; all patches of a sample's images are packed into one
row with a segment id per image, and attention is block-diagonal over segments. The projector
to the LLM width reads each window (`projector`): `merger` concatenates the window's patches and
runs a two-layer MLP (Qwen2-VL's merger); `avg_pool` averages them, RMS-normalises and projects
without a bias (Gemma 3's `multi_modal_projector`: its average pool of kernel `merge` over the
patch grid, its `mm_soft_emb_norm` and `mm_input_projection_weight`); `linear` projects the
window, with a bias (PaliGemma's `multi_modal_projector.linear`, one patch a token: merge 1) or
without (`projector_bias: false`: SmolVLM's and Idefics3's connector, whose pixel shuffle of
`scale_factor` concatenates each scale x scale window row by row, as the window order here does,
before `modality_projection.proj`).

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

`block: rmsnorm_glu` with `pos_embed: rope2d` and `projector: patch_merger` is Qwen2.5-VL's
tower (`Qwen2_5_VisionTransformerPretrainedModel`): blocks of RMSNorm, attention with biases and
a gated MLP with biases; no learned positions but a 2-D rotary embedding, the first half of each
head's rotated pairs turned by the patch's row and the second by its column (`rope2d_angles`);
with `window` > 0, every block but those of `full_layers` attends only within its window of
`window x window` patches (counted from each image's top-left corner, cut at its edges: Qwen's
window attention, whose reordering of patches into windows changes nothing here but attention's
mask), the others over whole images; `merge_norm` is then an RMSNorm (the merger's `ln_q`) and
the merger's MLP is `width * merge**2` wide with an exact GELU (`Qwen2_5_VLPatchMerger`).

`block: layernorm` with `pos_embed: table_rope2d` and `projector: patch_merger` is Qwen3-VL's
tower (`Qwen3VLVisionModel`): SigLIP's blocks (LayerNorm, attention and a GELU MLP, biases
everywhere) whose queries and keys are also turned by the 2-D rotary embedding, after a learned
`table_grid x table_grid` position table resampled to each image's patch grid (bilinear, corners
aligned, as transformers' `get_vision_interpolation_indices_and_weights`: an image of any size
takes the whole table) and added to the patch embeddings; the merger's norm is a LayerNorm.
`deepstack_layers` (Qwen3-VL's `deepstack_visual_indexes`) names blocks whose outputs each go
through a merger of their own (`DeepstackMerger`: its LayerNorm over a window's concatenated
patches, then the same MLP); the image tokens then carry, after their `out_width` features, each
such block's merged features in order (`B x T x (1 + len(deepstack_layers)) * out_width`), so one
edge brings all of them to the language model, which adds the k-th to its image positions after
its block k (`models.llm`, `deepstack_layers`).

`feature_layer` picks the hidden state the merger reads, numbered as Hugging Face's
`hidden_states` (LLaVA's `vision_feature_layer`): -1 the last block's output, -2 the one
before, k > 0 the k-th block's. The blocks after it are neither held nor run (`layers` of the
`depth`), so none sits idle in the optimizer.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from maestro_jax.models.attention import Mask
from maestro_jax.models.configs import ViTConfig
from maestro_jax.models.layers import (
    ACTIVATIONS,
    Dense,
    DenseGeneral,
    EncoderBlock,
    RMSNorm,
    apply_rotary,
    attention,
    item_mask,
    layer_stack,
    partitioned,
    rope_frequencies,
    segment_mask,
    shard_sequence,
)

_init = nn.initializers.normal(0.02)


class VisionEncoder(nn.Module):
    cfg: ViTConfig

    def setup(self):
        c = self.cfg
        if c.class_token and c.pos_embed != "table":
            raise ValueError(f"class_token (CLIP's layout) needs pos_embed='table', not {c.pos_embed!r}")
        layout = (c.block, c.pos_embed, c.projector)
        qwen = layout in (QWEN2_5_VL, QWEN3_VL)
        if c.block not in ("layernorm", "rmsnorm_glu") or (
            not qwen
            and (c.block == "rmsnorm_glu" or c.pos_embed in ("rope2d", "table_rope2d") or c.projector == "patch_merger")
        ):
            raise ValueError(
                f"block={c.block!r}, pos_embed={c.pos_embed!r}, projector={c.projector!r}: Qwen2.5-VL's tower takes "
                f"{QWEN2_5_VL} and Qwen3-VL's {QWEN3_VL} (block, pos_embed, projector) together"
            )
        taps = c.deepstack_layers
        if taps and (
            layout != QWEN3_VL
            or c.scan_layers
            or list(taps) != sorted(set(taps))
            or not 0 <= taps[0] <= taps[-1] < c.layers
        ):
            raise ValueError(
                f"deepstack_layers={list(taps)}: DeepStack taps increasing blocks 0..{c.layers - 1} of Qwen3-VL's tower "
                f"{QWEN3_VL} with scan_layers false (a scanned stack runs its blocks as one)"
            )
        self.patch_embed = Dense(
            c.width,
            use_bias=not c.class_token and layout != QWEN2_5_VL,
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
        elif c.pos_embed == "table_rope2d":
            if c.table_grid < 2:
                raise ValueError(
                    f"table_grid={c.table_grid}: pos_embed 'table_rope2d' resamples a table of 2 or more a side"
                )
            self.pos = self.param("pos", partitioned(_init, "grid", "embed"), (c.table_grid**2, c.width))
        elif c.pos_embed != "rope2d":
            self.pos_row = self.param("pos_row", partitioned(_init, "grid", "embed"), (c.max_grid, c.width))
            self.pos_col = self.param("pos_col", partitioned(_init, "grid", "embed"), (c.max_grid, c.width))
        if layout == QWEN2_5_VL:
            full = tuple(not c.window or i in c.full_layers for i in range(c.layers))
            self.blocks = layer_stack(
                GatedBlock, (c.width, c.heads, c.mlp, c.norm_eps, c.act), c.layers, c.remat, c.scan_layers, 0, full
            )
            self.merge_norm = RMSNorm(c.norm_eps)
        else:
            block = (c.width, c.heads, c.mlp, c.norm_eps, c.act)
            ends = sorted({*(i + 1 for i in taps), c.layers})  # runs of blocks, the DeepStack taps ending theirs
            self.runs = tuple(
                layer_stack(EncoderBlock, block, end - start, c.remat, c.scan_layers, start)
                for start, end in zip((0, *ends[:-1]), ends)
            )
            self.merge_norm = nn.LayerNorm(
                epsilon=c.norm_eps,
                scale_init=partitioned(nn.initializers.ones, "norm"),
                bias_init=partitioned(nn.initializers.zeros, "norm"),
            )
        self.deepstack = tuple(DeepstackMerger(c, name=f"deepstack_{j}") for j in range(len(taps)))
        self._setup_projector()

    def _setup_projector(self):
        """The projector's layers (`projector`), set up with the rest (called from `setup`)."""
        c = self.cfg
        if c.projector == "avg_pool":
            self.proj_norm = RMSNorm(c.norm_eps)
            self.proj = Dense(c.out_width, use_bias=False, kernel_init=partitioned(_init, "mlp", "embed"))
        elif c.projector == "linear":
            self.proj = Dense(
                c.out_width,
                use_bias=c.projector_bias,
                kernel_init=partitioned(_init, "mlp", "embed"),
                bias_init=partitioned(nn.initializers.zeros, "embed"),
            )
        elif c.projector in ("merger", "patch_merger"):
            self.merger_fc1 = Dense(
                c.out_width * 2 if c.projector == "merger" else c.width * c.merge * c.merge,
                kernel_init=partitioned(_init, "embed", "mlp"),
                bias_init=partitioned(nn.initializers.zeros, "mlp"),
            )
            self.merger_fc2 = Dense(
                c.out_width,
                kernel_init=partitioned(_init, "mlp", "embed"),
                bias_init=partitioned(nn.initializers.zeros, "embed"),
            )
        else:
            raise ValueError(f"projector={c.projector!r}: one of 'merger', 'avg_pool', 'patch_merger', 'linear'")

    def features(self, patches_BPC, segments_BP, grid_BP2, class_segments_BK=None, segment_lengths_BM=None):
        """patches -> (hidden state `feature_layer`, that state through `merge_norm`), `B x P x width`
        each, in the patches' order: SigLIP's `hidden_states[-1]` and `last_hidden_state`; with
        `class_token`, CLIP's `hidden_states[feature_layer][:, 1:]` (`class_segments_BK`: the
        image of each of the row's K class tokens, 0 for none; `segment_lengths_BM`: the host's
        per-image patch counts, `models.attention.segment_lengths`, where it sent them)."""
        x, _ = self._encode(patches_BPC, segments_BP, grid_BP2, class_segments_BK, segment_lengths_BM)
        return x, self.merge_norm(x)

    def _encode(self, patches_BPC, segments_BP, grid_BP2, class_segments_BK=None, segment_lengths_BM=None):
        """patches -> (hidden state `feature_layer`, the outputs of the `deepstack_layers` blocks)."""
        c = self.cfg
        x = self.patch_embed(patches_BPC)
        if c.pos_embed == "rope2d":
            mask = item_mask(segments_BP, segment_lengths_BM)
            window = mask.dense & window_mask(grid_BP2, c.window) if c.window else mask
            angles = rope2d_angles(grid_BP2, c.width // c.heads, c.rope_theta)
            return self.blocks(x, mask, window, angles), ()
        if c.pos_embed == "table_rope2d":
            x = x + resized_table(self.pos, grid_BP2, segments_BP, c.table_grid).astype(x.dtype)
            angles = rope2d_angles(grid_BP2, c.width // c.heads, c.rope_theta)
            return self._runs(x, item_mask(segments_BP, segment_lengths_BM), angles)
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
        # class tokens sit after the padding: only the dense mask says where they attend
        x, _ = self._runs(x, segment_mask(segments_BP) if c.class_token else item_mask(segments_BP, segment_lengths_BM))
        return x[:, :p], ()

    def _runs(self, x, *rest):
        """The blocks run after run (each DeepStack tap ends one), with the outputs of the taps."""
        taps = []
        for run in self.runs:
            x = run(x, *rest)
            taps.append(x)
        return x, tuple(taps[: len(self.cfg.deepstack_layers)])

    def __call__(self, patches_BPC, segments_BP, grid_BP2, class_segments_BK=None, segment_lengths_BM=None):
        """patches -> image tokens `B x P/merge**2 x token_width`, one per merge x merge window: the
        projector's `out_width` features, then each DeepStack block's."""
        c = self.cfg
        x, taps = self._encode(patches_BPC, segments_BP, grid_BP2, class_segments_BK, segment_lengths_BM)
        x = self.merge_norm(x)
        b, p, d = x.shape
        window = c.merge * c.merge
        if c.projector == "avg_pool":
            pooled = x.reshape(b, p // window, window, d).astype(jnp.float32).mean(axis=2).astype(x.dtype)
            return self.proj(self.proj_norm(pooled))
        if c.projector == "linear":
            return self.proj(x.reshape(b, p // window, window * d))
        h = self.merger_fc1(x.reshape(b, p // window, window * d))
        tokens = self.merger_fc2(nn.gelu(h, approximate=c.projector == "merger"))
        if not taps:
            return tokens
        extra = [merger(t.reshape(b, p // window, window * d)) for merger, t in zip(self.deepstack, taps)]
        return jnp.concatenate([tokens, *extra], axis=-1)


class DeepstackMerger(nn.Module):
    """One DeepStack block's merger (Qwen3-VL's `deepstack_merger_list` entry, its
    `use_postshuffle_norm`): a LayerNorm over each window's concatenated patches, then the patch
    merger's MLP (`width * merge**2` wide, exact GELU) to `out_width`."""

    cfg: ViTConfig

    @nn.compact
    def __call__(self, windows_BTW):
        c = self.cfg
        h = nn.LayerNorm(
            epsilon=c.norm_eps,
            name="norm",
            scale_init=partitioned(nn.initializers.ones, "norm"),
            bias_init=partitioned(nn.initializers.zeros, "norm"),
        )(windows_BTW)
        h = Dense(
            windows_BTW.shape[-1],
            name="fc1",
            kernel_init=partitioned(_init, "embed", "mlp"),
            bias_init=partitioned(nn.initializers.zeros, "mlp"),
        )(h)
        return Dense(
            c.out_width,
            name="fc2",
            kernel_init=partitioned(_init, "mlp", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )(nn.gelu(h, approximate=False))


QWEN2_5_VL = ("rmsnorm_glu", "rope2d", "patch_merger")  # (block, pos_embed, projector) of Qwen2.5-VL's tower
QWEN3_VL = ("layernorm", "table_rope2d", "patch_merger")  # and of Qwen3-VL's


def resized_table(table_GD, grid_BP2, segments_BP, side: int):
    """Each patch's position embedding from a learned `side x side` table (`table_GD`, row-major)
    resampled to its image's patch grid, bilinear with the corners aligned, in float32: Qwen3-VL's
    (transformers' `get_vision_interpolation_indices_and_weights`, `align_corners=True`). An image's
    grid is read off its patches (`segments_BP`: one id per image of the row), its last row and
    column mapping to the table's."""
    b, p = segments_BP.shape
    image = (jnp.arange(b)[:, None] * (p + 1) + segments_BP).reshape(-1)  # (row, image), one id each
    last = jax.ops.segment_max(grid_BP2.reshape(-1, 2), image, num_segments=b * (p + 1))[image].reshape(b, p, 2)
    src = grid_BP2.astype(jnp.float32) * (side - 1) / jnp.maximum(last, 1).astype(jnp.float32)
    taps = jnp.floor(src)[..., None] + jnp.arange(2, dtype=jnp.float32)  # B P 2(axis) 2(tap)
    weight = jnp.clip(1 - jnp.abs(src[..., None] - taps), 0)
    taps = jnp.clip(taps, 0, side - 1).astype(jnp.int32)
    cell = taps[..., 0, :, None] * side + taps[..., 1, None, :]  # B P 2 2: (row tap, column tap)
    both = weight[..., 0, :, None] * weight[..., 1, None, :]
    return jnp.sum(jnp.take(table_GD, cell, axis=0) * both[..., None], axis=(2, 3))


def rope2d_angles(grid_BP2, head_dim: int, theta: float):
    """Qwen2.5-VL's 2-D rotary angles, `B x P x head_dim/2` in float32: the head_dim/4
    frequencies of a head of head_dim/2 (transformers' `Qwen2_5_VLVisionRotaryEmbedding`) times
    the patch's row, then the same times its column."""
    freqs = jnp.asarray(rope_frequencies(head_dim // 4, theta))
    grid = grid_BP2.astype(jnp.float32)
    return jnp.concatenate([grid[..., :1] * freqs, grid[..., 1:] * freqs], axis=-1)


def window_mask(grid_BP2, side: int):
    """Whether two patches lie in the same `side x side` window of patches (counted from the
    image's top-left corner; combine with the segments' mask, which keeps images apart)."""
    cell = grid_BP2 // side
    same = cell[:, :, None, :] == cell[:, None, :, :]
    return same[..., 0] & same[..., 1]


class GatedBlock(nn.Module):
    """Qwen2.5-VL's vision block: pre-RMSNorm attention with biases and 2-D rotary queries and
    keys, then a gated MLP with biases; `full` says whether it attends over whole images (`mask`)
    or within windows (`window`): a Python bool unrolled, a traced one scanned."""

    width: int
    heads: int
    mlp: int
    norm_eps: float = 1e-6
    act: str = "silu"  # a key of ACTIVATIONS

    @nn.compact
    def __call__(self, x_BPD, full, mask_BPP, window_BPP, angles_BPF):
        hd = self.width // self.heads
        x_BPD = shard_sequence(x_BPD)
        if isinstance(full, bool):
            mask_BPP = mask_BPP if full else window_BPP
        else:  # a traced flag: only the dense masks can be chosen between
            mask_BPP = jnp.where(full, Mask.of(mask_BPP).dense, Mask.of(window_BPP).dense)
        h = RMSNorm(self.norm_eps, name="attn_norm")(x_BPD)
        q, k, v = (
            DenseGeneral(
                (self.heads, hd),
                name=n,
                kernel_init=partitioned(_init, "embed", "heads", "head_dim"),
                bias_init=partitioned(nn.initializers.zeros, "heads", "head_dim"),
            )(h)
            for n in ("q", "k", "v")
        )
        o = attention(apply_rotary(q, angles_BPF), apply_rotary(k, angles_BPF), v, mask_BPP)
        x_BPD = x_BPD + DenseGeneral(
            self.width,
            axis=(-2, -1),
            name="o",
            kernel_init=partitioned(_init, "heads", "head_dim", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )(o)
        h = RMSNorm(self.norm_eps, name="mlp_norm")(x_BPD)
        gate, up = (
            Dense(
                self.mlp,
                name=n,
                kernel_init=partitioned(_init, "embed", "mlp"),
                bias_init=partitioned(nn.initializers.zeros, "mlp"),
            )(h)
            for n in ("gate", "up")
        )
        down = Dense(
            self.width,
            name="down",
            kernel_init=partitioned(_init, "mlp", "embed"),
            bias_init=partitioned(nn.initializers.zeros, "embed"),
        )
        return shard_sequence(x_BPD + down(ACTIVATIONS[self.act](gate) * up))
