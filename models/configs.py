"""The built-in models' configs: each model's one schema (`models.schema`), JAX-free.

The Flax modules (`models.vit`, `models.audio`, `models.llm`) take these dataclasses and
re-export them; the launch config (`maestro_jax.config`) generates its `models.<name>` entries
from them without importing JAX, which is why they live in their own module beside the models.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from maestro_jax.models.schema import NonNegativeInt, PositiveFloat, PositiveInt, Rule, enforce


@dataclasses.dataclass(frozen=True, kw_only=True)
class ViTConfig:
    """The tower's one schema (`models.schema`): the launch config's `models.<name>` of kind
    `vit` is generated from these fields, their types, defaults and `RULES`."""

    scan_layers: bool = False  # layers under nn.scan: stacked parameters, compile time flat in depth
    patch: PositiveInt
    channels: PositiveInt = 3
    width: PositiveInt
    depth: PositiveInt
    heads: PositiveInt
    mlp: PositiveInt
    out_width: PositiveInt  # the consumer's width (image tokens enter the LLM)
    merge: PositiveInt = 2
    max_grid: PositiveInt = 64
    # frames one patch spans in time (Qwen-VL's temporal_patch_size, 2; 1 elsewhere): a patch's features
    # are `frames` frames of it, a still image's frame repeated (workloads.vlm.patchify), a clip's its own
    frames: PositiveInt = 1
    # row_col: learned row and column embeddings; table: one per grid cell (SigLIP's layout); rope2d: no
    # learned positions, a 2-D rotary embedding of each patch's row and column (Qwen2.5-VL's);
    # table_rope2d: a learned table of table_grid x table_grid resampled to each image's grid, and
    # rope2d (Qwen3-VL's): see the module docstring
    pos_embed: Literal["row_col", "table", "rope2d", "table_rope2d"] = "row_col"
    # pos_embed table_rope2d: the learned table's side (num_position_embeddings ** 0.5)
    table_grid: NonNegativeInt = 0
    # layernorm: LayerNorm and GELU-MLP blocks (SigLIP, CLIP, Qwen3-VL); rmsnorm_glu: RMSNorm and
    # gated-MLP blocks with biases (Qwen2.5-VL, with pos_embed rope2d and projector patch_merger)
    block: Literal["layernorm", "rmsnorm_glu"] = "layernorm"
    rope_theta: PositiveFloat = 10000.0  # pos_embed rope2d / table_rope2d: the rotary base
    window: NonNegativeInt = 0  # > 0: the side, in patches, of the windows the blocks attend within (Qwen2.5-VL)
    full_layers: tuple[NonNegativeInt, ...] = ()  # with window: the blocks that attend over whole images
    norm_eps: PositiveFloat = 1e-6  # every LayerNorm's epsilon (SigLIP: layer_norm_eps)
    # the blocks' MLP activation, by Hugging Face's names (layers.ACTIVATIONS; quick_gelu: CLIP's,
    # silu: Qwen2.5-VL's gated MLP)
    act: Literal["gelu_pytorch_tanh", "gelu", "quick_gelu", "silu"] = "gelu_pytorch_tanh"
    # CLIP's layout (LLaVA's tower): a class token per image, dropped before the merger (module docstring)
    class_token: bool = False
    # the hidden state the merger reads, HF's numbering (LLaVA's vision_feature_layer, e.g. -2); the
    # blocks after it are not held (module docstring)
    feature_layer: int = -1
    # what maps each merge x merge window to the LLM width: merger (an MLP over the concatenated window,
    # Qwen2-VL's), avg_pool (the window's mean, RMSNorm, a projection: Gemma 3's) or patch_merger
    # (Qwen2.5-VL's and Qwen3-VL's: RMSNorm per patch, an MLP width * merge**2 wide, exact GELU)
    projector: Literal["merger", "avg_pool", "patch_merger"] = "merger"
    # Qwen3-VL's DeepStack (deepstack_visual_indexes): blocks whose outputs go, each through a merger
    # of its own, to the LLM beside the image tokens; the LLM's deepstack_layers counts them
    deepstack_layers: tuple[NonNegativeInt, ...] = ()
    # per-layer activation checkpointing (layers.remat_layer): the config sets it from the section's
    # layer_remat (`schema.SECTION_FIELDS`)
    remat: Literal["none", "full", "dots"] = "none"

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "class_token",
            lambda v: (
                v["class_token"]
                and v.get("pos_embed") != "table"
                and f"CLIP's layout needs pos_embed='table', not {v.get('pos_embed')!r}"
            ),
        ),
        Rule(
            "feature_layer",
            lambda v: (
                v.get("depth") is not None
                and not (-v["depth"] <= v["feature_layer"] <= v["depth"] and v["feature_layer"] != 0)
                and f"a tower of depth {v['depth']} has block outputs -{v['depth']}..-1 or 1..{v['depth']}"
            ),
        ),
    )

    def __post_init__(self):
        enforce(self)

    @property
    def patch_features(self) -> int:
        """A patch's input features: `frames` x patch x patch x channels, in that order."""
        return self.frames * self.patch * self.patch * self.channels

    @property
    def token_width(self) -> int:
        """The width of each image token the tower sends: `out_width`, and as much again for each
        DeepStack block."""
        return self.out_width * (1 + len(self.deepstack_layers))

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class AudioConfig:
    """The encoder's one schema (`models.schema`): the launch config's `models.<name>` of kind
    `audio` is generated from these fields, their types, defaults and `RULES`."""

    scan_layers: bool = False  # layers under nn.scan: stacked parameters, compile time flat in depth
    mel: PositiveInt = 16  # features per frame
    frames_per_token: PositiveInt = 4  # frames grouped into one audio token
    width: PositiveInt
    depth: PositiveInt
    heads: PositiveInt
    mlp: PositiveInt
    out_width: PositiveInt  # the consumer's width (audio tokens enter the LLM)
    max_tokens: PositiveInt = 1500  # learned positions: the longest clip, in tokens
    # dense: a linear map per frame group; conv: Whisper's two convolutions over time (module docstring)
    stem: Literal["dense", "conv"] = "dense"
    norm_eps: PositiveFloat = 1e-6  # every LayerNorm's epsilon (Whisper: 1e-5)
    # the blocks' (and the conv stem's) MLP activation, by Hugging Face's names (layers.ACTIVATIONS)
    act: Literal["gelu_pytorch_tanh", "gelu"] = "gelu_pytorch_tanh"
    # per-layer activation checkpointing (layers.remat_layer): the config sets it from the section's
    # layer_remat (`schema.SECTION_FIELDS`)
    remat: Literal["none", "full", "dots"] = "none"

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "stem",
            lambda v: (
                v["stem"] == "conv"
                and v.get("frames_per_token") != 2
                and (
                    "Whisper's stem makes one token of 2 frames (stride 2); set frames_per_token=2, "
                    f"not {v.get('frames_per_token')}"
                )
            ),
        ),
    )

    def __post_init__(self):
        enforce(self)

    @property
    def token_features(self) -> int:
        return self.frames_per_token * self.mel
