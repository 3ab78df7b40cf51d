"""The built-in models' configs: each model's one schema (`models.schema`), JAX-free.

The Flax modules (`models.vit`, `models.audio`, `models.llm`) take these dataclasses and
re-export them; the launch config (`maestro_jax.config`) generates its `models.<name>` entries
from them without importing JAX, which is why they live in their own module beside the models.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import ClassVar, Literal

from maestro_jax.models.schema import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Rule, enforce

from maestro_jax import fast_paths
from maestro_jax.hf_config import ROPE_DEFAULTS, ROPE_SCALINGS

log = logging.getLogger(__name__)


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
    # (Qwen2.5-VL's and Qwen3-VL's: RMSNorm per patch, an MLP width * merge**2 wide, exact GELU) or
    # linear (one projection of the concatenated window: PaliGemma's, merge 1, with a bias; SmolVLM's and
    # Idefics3's connector, its pixel shuffle of scale_factor as merge, without)
    projector: Literal["merger", "avg_pool", "patch_merger", "linear"] = "merger"
    projector_bias: bool = True  # projector linear: whether its projection has a bias
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
            "feature_layer", lambda v: v.get("depth") is not None and _no_block_output(v["depth"], v["feature_layer"])
        ),
        Rule(
            "projector_bias",
            lambda v: (
                not v["projector_bias"]
                and v.get("projector", "merger") != "linear"
                and f"only projector='linear' goes without a bias, not {v.get('projector', 'merger')!r}"
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


def _no_block_output(depth: int, feature_layer: int) -> str | None:
    """What is wrong with `feature_layer` (HF's numbering) in a `depth`-block tower, or None."""
    n = depth + 1 + feature_layer if feature_layer < 0 else feature_layer
    return None if 1 <= n <= depth else f"a tower of depth {depth} has block outputs -{depth}..-1 or 1..{depth}"


def held_layers(depth: int, feature_layer: int) -> int:
    """The blocks up to hidden state `feature_layer` (HF's numbering) of a `depth`-block tower."""
    problem = _no_block_output(depth, feature_layer)
    if problem:
        raise ValueError(f"feature_layer={feature_layer}: {problem}")
    return depth + 1 + feature_layer if feature_layer < 0 else feature_layer


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
    # > 1: after the last block, each run of `pool` tokens of a clip averaged into one (Qwen2-Audio's
    # avg_pooler: 2) before out_norm and out_proj; a clip then enters the LLM as tokens / pool
    pool: PositiveInt = 1
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

    @property
    def frames_per_output(self) -> int:
        """Frames per token the encoder sends on (one placeholder each): a clip's frame count is
        a multiple of it, so no pooled token straddles two clips packed in a row."""
        return self.frames_per_token * self.pool


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE's frequencies stretched past the pretraining context, Hugging Face's `rope_scaling`
    (`rope_parameters`) block under its own names (`models.<s>.rope_scaling`: copy it from
    config.json, or let `models.<s>.hf` fill it in). `linear`: every frequency divided by
    `factor`. `llama3` (Llama 3.1 and later): frequencies whose wavelength exceeds
    `original_max_position_embeddings / low_freq_factor` divided by `factor`, those under
    `original_max_position_embeddings / high_freq_factor` kept, and the band between blended
    linearly in `original / wavelength` (transformers' `_compute_llama3_parameters`). `yarn`
    (Qwen2.5/Qwen3 long context, DeepSeek): each frequency blends its original value and its value
    divided by `factor` along a linear ramp over the dimensions whose rotations in
    `original_max_position_embeddings` lie between `beta_slow` and `beta_fast`, and cos/sin are
    scaled by `attention_factor` (transformers' `_compute_yarn_parameters`). Defaults:
    `hf_config.ROPE_DEFAULTS`, transformers' own."""

    rope_type: Literal[ROPE_SCALINGS]
    factor: PositiveFloat
    low_freq_factor: PositiveFloat = ROPE_DEFAULTS["low_freq_factor"]
    high_freq_factor: PositiveFloat = ROPE_DEFAULTS["high_freq_factor"]
    original_max_position_embeddings: PositiveInt = ROPE_DEFAULTS["original_max_position_embeddings"]
    beta_fast: PositiveFloat = ROPE_DEFAULTS["beta_fast"]  # yarn's: the ramp between extrapolated and interpolated
    beta_slow: PositiveFloat = ROPE_DEFAULTS["beta_slow"]
    attention_factor: PositiveFloat | None = ROPE_DEFAULTS[
        "attention_factor"
    ]  # yarn's cos/sin scale; None: 0.1 ln(factor) + 1
    truncate: bool = ROPE_DEFAULTS["truncate"]  # yarn's ramp ends rounded to whole dimensions

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "high_freq_factor",
            lambda v: (
                v["rope_type"] == "llama3"
                and v["high_freq_factor"] <= v["low_freq_factor"]
                and (
                    f"llama3: high_freq_factor={v['high_freq_factor']} must exceed low_freq_factor="
                    f"{v['low_freq_factor']} (the band blended between them)"
                )
            ),
        ),
    )

    def __post_init__(self):
        enforce(self)


# What `moe_dispatch: auto` runs on each backend. On an NVIDIA GPU the fast-path table's choice
# (`maestro_jax.fast_paths`, "moe_dispatch auto (NVIDIA)": `sparse` until a GPU check times `grouped` at
# 1.1x it; `ragged` is XLA:GPU's dense expansion of ragged_dot, 128x the FLOPs there, xla
# ragged_dot_rewriter.cc; `dense` computes every expert). Elsewhere `dense`: exact, and on the
# CPU's small test models the simplest program. (`models.llm` exports it too.)
AUTO_DISPATCH = dict.fromkeys(("gpu", "cuda"), fast_paths.default("moe_dispatch auto (NVIDIA)"))


def moe_dispatch_for(requested: str, platform: str, dense_only: bool = False) -> str:
    """The dispatch that runs: `requested`, or for `auto` this backend's entry of AUTO_DISPATCH
    (`dense` where it has none, or where the experts run on it alone, `dense_only`: GPT-OSS's
    biases and clamp), logged once."""
    choice = requested if requested != "auto" else "dense" if dense_only else AUTO_DISPATCH.get(platform, "dense")
    _log_dispatch(requested, platform, choice)
    return choice


@functools.cache
def _log_dispatch(requested: str, platform: str, choice: str) -> None:
    if requested == "auto":
        log.info("moe_dispatch auto on %s: %s (models.llm.AUTO_DISPATCH)", platform, choice)


def _divides_heads(v) -> str | None:
    heads = v.get("heads")
    if heads is not None and heads % v["kv_heads"]:
        return f"must divide heads={heads} (each key/value head serves heads/kv_heads query heads)"
    return None


def _window_pattern(v) -> str | None:
    if v["global_every"] and v["sliding_window"] is None:
        return f"global_every={v['global_every']} needs a sliding_window (the other layers' window)"
    if v["rope_local_theta"] is not None and not v["global_every"]:
        return (
            f"rope_local_theta={v['rope_local_theta']} is the windowed layers' RoPE base beside global ones; "
            f"it needs global_every > 0 (with every layer windowed, set rope_theta)"
        )
    return None


def _gpt_oss_experts(v, key: str) -> str | None:
    """GPT-OSS's expert biases and clamped SwiGLU: only in a mixture of experts, and (so far) only
    on the dense dispatch (`auto` resolves to it for them)."""
    if not v.get(key):
        return None
    if not v.get("experts"):
        return "GPT-OSS's expert biases and clamped SwiGLU are a mixture of experts' (set experts > 0)"
    dispatch = v.get("moe_dispatch", "auto")
    if dispatch not in ("auto", "dense"):
        return (
            f"runs on moe_dispatch: dense only so far (moe_dispatch={dispatch}'s grouped products take no biases "
            f"or clamp yet); set moe_dispatch: dense or auto"
        )
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLMConfig:
    """The decoder's one schema (`models.schema`): the launch config's `models.<name>` of kind
    `llm` is generated from these fields, their types, defaults and `RULES`."""

    scan_layers: bool = False  # layers under nn.scan: stacked parameters, compile time flat in depth
    vocab: PositiveInt
    width: PositiveInt
    depth: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    mlp: PositiveInt
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # Llama 3.1+: {rope_type: llama3, factor: 8, ...}
    # Mistral's: each position attends to itself and the window - 1 before it
    sliding_window: PositiveInt | None = None
    # with sliding_window: every global_every-th layer (the last of each group of that many)
    # attends to every position, the others through the window (Gemma 3: 6, Gemma 2: 2); 0:
    # every layer is windowed (Mistral)
    global_every: NonNegativeInt = 0
    # the windowed layers' RoPE base, unscaled (Gemma 3's 10000); None: as the global layers'
    rope_local_theta: PositiveFloat | None = None
    act: Literal["silu", "gelu_pytorch_tanh"] = "silu"  # the gated MLP's activation (Gemma: gelu_pytorch_tanh)
    post_norms: bool = False  # Gemma 2/3: RMSNorm on the attention's and the MLP's outputs before each residual add
    # RMSNorm on the attention's and the MLP's inputs; False (OLMo 2): the blocks norm only their
    # outputs (`post_norms`)
    pre_norms: bool = True
    embed_scale: bool = False  # Gemma: token embeddings times sqrt(width)
    query_pre_attn_scalar: PositiveInt | None = None  # Gemma: scores times this ** -0.5 (None: head_dim ** -0.5)
    attn_softcap: PositiveFloat | None = None  # Gemma 2: attention scores capped as c * tanh(s / c), before the mask
    final_softcap: PositiveFloat | None = None  # Gemma 2: output logits capped as c * tanh(z / c)
    # Gemma 3's VLMs: each image's tokens attend to all of that image's tokens, later ones too (`body`)
    bidirectional_images: bool = False
    # PaliGemma's prefix-LM: each sample's prefix (its image and prompt: the positions up to the
    # first whose target carries loss) attends bidirectionally within itself, the rest causally;
    # the rows give the prefix as one block (`workloads.vlm.with_prefix_blocks`, `body`'s images_BL)
    prefix_lm: bool = False
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    out_bias: bool = False  # GPT-OSS: a bias on the attention's output projection too
    # GPT-OSS: one learned logit per query head that every row's softmax also runs over (a key that
    # takes weight and adds no value: `layers.attention`'s sinks)
    attention_sinks: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE
    # what each query and key norm spans: each head (Qwen3, Gemma 3) or the whole projection, every
    # head at once, as OLMo 2's q_norm and k_norm do
    qk_norm_over: Literal["head", "projection"] = "head"
    # Qwen2.5-VL's M-RoPE: each head's rotated pairs in three sections (temporal, row, column), each
    # turned by its own position axis; positions are then `B x L x 4` (`DecoderLM.body`, `mrope_positions`)
    mrope_section: tuple[PositiveInt, PositiveInt, PositiveInt] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL's: the sections' frequencies interleaved (layers.mrope_axes)
    # Qwen3-VL's DeepStack: image tokens arrive with this many more feature sets (the tower's
    # deepstack_layers), the j-th added to the image positions' hidden states after block j
    deepstack_layers: NonNegativeInt = 0
    # a video's M-RoPE temporal step (`mrope_positions`): Qwen2.5-VL's patch f sits at
    # f * video_tokens_per_second * its seconds per patch (vision_config.tokens_per_second,
    # transformers' default 4); Qwen3-VL (`video_timestamps`, whose text stamps each temporal patch)
    # positions each temporal patch afresh after its timestamp
    video_tokens_per_second: PositiveFloat = 4.0
    video_timestamps: bool = False
    experts: NonNegativeInt = 0  # > 0: a mixture-of-experts FFN in every block instead of the dense one
    experts_per_token: NonNegativeInt = 0
    expert_mlp: NonNegativeInt = 0
    router_aux_loss: NonNegativeFloat = 0.001  # weight of the load-balancing loss each MoE layer adds (Qwen3-MoE's)
    # the router's top-k weights renormalised to sum to 1 (Qwen3-MoE's `norm_topk_prob`, Mixtral's);
    # False: the softmax's own weights (Qwen2-MoE's default)
    moe_renormalize: bool = True
    # > 0: beside the routed experts, a dense SwiGLU expert of this width every token takes, its output
    # scaled by sigmoid(h @ shared_expert_gate) (Qwen2-MoE's shared expert)
    shared_expert_mlp: NonNegativeInt = 0
    # what each computes: models.llm.MoE; auto: resolved when the model config is built, for the
    # backend that builds it (AUTO_DISPATCH: sparse on an NVIDIA GPU, dense elsewhere), so every
    # built config holds the dispatch that runs (the cost model reads it)
    moe_dispatch: Literal["auto", "dense", "ragged", "sparse", "grouped"] = "auto"
    # GPT-OSS (after moe_dispatch, which their rule reads): biases on the router's logits and on
    # every expert's gate, up and down projections
    expert_bias: bool = False
    # GPT-OSS's clamped SwiGLU in the experts: gate clamped above at this limit, up to [-limit,
    # limit], out = (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: silu(gate) * up
    swiglu_limit: PositiveFloat | None = None
    swiglu_alpha: PositiveFloat = 1.702
    # per-layer activation checkpointing (layers.remat_layer): the config sets it from the section's
    # layer_remat (`schema.SECTION_FIELDS`)
    remat: Literal["none", "full", "dots"] = "none"
    # attention over a `context` split: ring (keys and values pass round the devices, causal work
    # balanced, empty blocks skipped) or gather (one all-gather of keys and values)
    context_attention: Literal["ring", "gather"] = "ring"

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("kv_heads", _divides_heads),
        Rule(
            "prefix_lm",
            lambda v: (
                v.get("prefix_lm")
                and v.get("bidirectional_images")
                and "a prefix-LM's prefix holds its images: set bidirectional_images=false"
            ),
        ),
        Rule(None, _window_pattern),
        Rule(
            "pre_norms",
            lambda v: (
                not v.get("pre_norms", True)
                and not v.get("post_norms")
                and "a block without norms before its attention and MLP norms their outputs: set post_norms: true"
            ),
        ),
        Rule(
            "qk_norm_over",
            lambda v: (
                v.get("qk_norm_over", "head") != "head"
                and not v.get("qk_norm")
                and "qk_norm_over says what the query and key norms span: set qk_norm: true with it"
            ),
        ),
        Rule(
            "experts_per_token",
            lambda v: (
                v.get("experts")
                and not 1 <= v["experts_per_token"] <= v["experts"]
                and f"with experts={v['experts']} each token goes to 1..{v['experts']} experts"
            ),
        ),
        Rule("expert_bias", lambda v: _gpt_oss_experts(v, "expert_bias")),
        Rule("swiglu_limit", lambda v: _gpt_oss_experts(v, "swiglu_limit")),
        Rule(
            "expert_mlp",
            lambda v: (
                v.get("experts")
                and v["expert_mlp"] <= 0
                and "a mixture-of-experts model needs its experts' hidden width (> 0)"
            ),
        ),
    )

    def __post_init__(self):
        enforce(self)
        if self.moe_dispatch == "auto":  # every config holds the dispatch that runs: the cost model reads it
            import jax  # only where a model is built: the config's schema needs no JAX

            dense_only = self.expert_bias or self.swiglu_limit is not None  # `_gpt_oss_experts`
            object.__setattr__(self, "moe_dispatch", moe_dispatch_for("auto", jax.default_backend(), dense_only))

    @classmethod
    def from_fields(cls, fields: dict, **extra) -> LLMConfig:
        """From `models.<s>`'s fields as plain data (the config's dump, `hf_config.llm_fields`):
        `kind` and `hf` dropped, and `moe_dispatch_strict` (how the config resolves `moe_dispatch`,
        no part of the model), `rope_scaling` as the frozen `RopeScaling`."""
        own = {k: v for k, v in fields.items() if k not in ("kind", "hf", "moe_dispatch_strict")} | extra
        scaling, section = own.get("rope_scaling"), own.get("mrope_section")
        if isinstance(scaling, dict):
            scaling = RopeScaling(**scaling)
        return cls(**own | {"rope_scaling": scaling, "mrope_section": section and tuple(section)})

    def windowed(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        return windowed_layer(layer, self.sliding_window, self.global_every)


def windowed_layer(layer: int, sliding_window: int | None, global_every: int) -> bool:
    """Whether `layer` attends through `sliding_window`: every layer (global_every 0), or all but
    every `global_every`-th (Gemma's pattern); none without a window."""
    return sliding_window is not None and (not global_every or (layer + 1) % global_every != 0)
