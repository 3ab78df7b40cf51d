"""Hugging Face checkpoints of encoder towers: SigLIP's, CLIP's and Qwen2.5-VL's and Qwen3-VL's
vision towers (with their mergers, and Qwen3-VL's DeepStack mergers) and a Gemma 3 VLM's tower and
projector into `models.vit.VisionEncoder`, Whisper's encoder into `models.audio.AudioEncoder`, and
back (whole Gemma 3, Qwen2.5-VL and Qwen3-VL folders with their language model: `save_gemma3_vlm`,
`save_qwen_vl`).

It reuses `models.hf`'s safetensors access and sharded placement. A tower's config fields
(`vit_fields`, `audio_fields`, from `maestro_jax.hf_config`, which the config reads too) set
the encoder to the checkpoint's architecture (`pos_embed: table`, `stem: conv`, the checkpoint's
LayerNorm epsilon and GELU); the projector after the tower (`merger_fc1/2`, `out_proj`: no
checkpoint of a tower holds it) keeps the values it was initialised with, except a Gemma 3
VLM's (`projector: avg_pool`), which its checkpoint holds:
  multi_modal_projector.mm_soft_emb_norm.weight   -> proj_norm.scale (Gemma's `1 + weight`: + 1)
  multi_modal_projector.mm_input_projection_weight [D, text width] -> proj.kernel
under `model.` or none, as the tower sits under `model.vision_tower.` or `vision_tower.`.

SigLIP (`SiglipVisionModel`, or a whole `SiglipModel`: its `vision_model.` tensors), D = width,
H heads of K = D/H, p = patch, C = channels, F = mlp:
  embeddings.patch_embedding.weight [D, C, p, p]  -> patch_embed.kernel [p*p*C, D] (+ bias [D])
  embeddings.position_embedding.weight [G*G, D]   -> pos [G*G, D] (G = image_size / patch)
  encoder.layers.i.layer_norm{1,2}                -> block_i.{attn,mlp}_norm.{scale,bias}
  encoder.layers.i.self_attn.{q,k,v}_proj [D, D]  -> block_i.{q,k,v}.kernel [D, H, K] (+ bias [H, K])
  encoder.layers.i.self_attn.out_proj [D, D]      -> block_i.o.kernel [H, K, D] (+ bias [D])
  encoder.layers.i.mlp.fc{1,2}                    -> block_i.fc{1,2}.{kernel,bias}
  post_layernorm                                  -> merge_norm.{scale,bias}
The attention-pooling `head` is not imported (the VLM merges patches instead); export writes
`vision_use_head: false` and prefixes `vision_model.`, which transformers 4 and 5 both load.

CLIP (`CLIPVisionModel`, a whole `CLIPModel`, or a LLaVA checkpoint's `vision_tower`) loads into
the `class_token` layout (models/vit.py): SigLIP's tensors and names, and
  embeddings.patch_embedding.weight (no bias)     -> patch_embed.kernel
  embeddings.class_embedding [D]                  -> class_embed
  embeddings.position_embedding.weight [1+G*G, D] -> pos (row 0: the class token's)
  pre_layrnorm                                    -> pre_norm.{scale,bias}
  post_layernorm                                  -> merge_norm.{scale,bias}
A LLaVA config's `vision_feature_layer` becomes `feature_layer` (its strategy must be `default`:
patches without the class token). Only the blocks up to `feature_layer` are held, so a tower
cut at -2 exports its `depth - 1` blocks, `num_hidden_layers` saying so: its `hidden_states[-1]`
are the features the VLM read.

Whisper (`WhisperEncoder`, or a whole `WhisperModel` / `WhisperForConditionalGeneration`: its
`encoder.` / `model.encoder.` tensors), M = num_mel_bins:
  conv1.weight [D, M, 3], conv2.weight [D, D, 3]  -> stem.conv{1,2}_kernel [3, in, out] (+ bias [D])
  embed_positions.weight [S, D]                   -> pos [S, D] (S = max_source_positions)
  layers.i.self_attn_layer_norm, final_layer_norm -> block_i.{attn,mlp}_norm.{scale,bias}
  layers.i.self_attn.{q,v,out}_proj, k_proj       -> block_i.{q,v,o,k} as SigLIP's (k: no bias)
  layers.i.fc{1,2}                                -> block_i.fc{1,2}.{kernel,bias}
  layer_norm                                      -> out_norm.{scale,bias}
Whisper's key projection has no bias; the block's `k.bias` loads as zeros and is not exported.
That is exact whatever its trained value: a key bias adds the same q.b to every score of a
query's row, which the softmax cancels (its gradient is zero too). Whisper keeps its sinusoidal
positions frozen; here `pos` is an ordinary parameter and trains with the tower.

Qwen2-Audio (a `Qwen2AudioForConditionalGeneration` folder: the encoder under `audio_tower.`, or
`model.audio_tower.`) is Whisper's encoder with its tokens average-pooled in pairs before
`layer_norm` (`pool: 2`, models/audio.py), and its projector onto the language model's width:
  multi_modal_projector.linear.{weight, bias}     -> out_proj.{kernel, bias}

Qwen2.5-VL (a `Qwen2_5_VLForConditionalGeneration` folder: the tower under `visual.`, as the Hub
and transformers 5.24 save it, or `model.visual.`, transformers 5's module names) loads into the
`rmsnorm_glu` / `rope2d` / `patch_merger` layout (models/vit.py), T = temporal_patch_size:
  patch_embed.proj.weight [D, C, T, p, p]         -> patch_embed.kernel [T*p*p*C, D] (`frames` T)
  blocks.i.norm{1,2}.weight                       -> block_i.{attn,mlp}_norm.scale
  blocks.i.attn.qkv.{weight [3D, D], bias [3D]}   -> block_i.{q,k,v}.{kernel,bias}, a third each
  blocks.i.attn.proj                              -> block_i.o.{kernel,bias}
  blocks.i.mlp.{gate,up,down}_proj                -> block_i.{gate,up,down}.{kernel,bias}
  merger.ln_q.weight                              -> merge_norm.scale
  merger.mlp.{0,2}                                -> merger_fc{1,2}.{kernel,bias}
Each of the T frames' kernels is kept (and exported as it was read): a still image's patch is
its frame repeated T times, as its image processor writes it (`workloads.vlm.patchify`), and a
video clip's temporal patch is its own T frames (`data.video.VideoSampling.patches`).

A scanned encoder (`scan_layers`) stacks every `block_i` leaf under `blocks/layer`, as in `models.hf`.

A Gemma 3 VLM (`save_gemma3_vlm`) is written whole: the tower and its projector as above under the
Hub's `vision_tower.vision_model.` and `multi_modal_projector.`, the language model as
`gemma3_text` (`models.hf`) under `language_model.model.`.

Qwen3-VL (a `Qwen3VLForConditionalGeneration` folder, the tower under `model.visual.` or `visual.`)
loads into the `layernorm` / `table_rope2d` / `patch_merger` layout with `deepstack_layers`
(models/vit.py), its patch embedding as Qwen2.5-VL's (each of T frames' kernels) plus its bias, J = its
`deepstack_visual_indexes`:
  pos_embed.weight [G*G, D]                       -> pos (G = table_grid)
  blocks.i.norm{1,2}.{weight,bias}                -> block_i.{attn,mlp}_norm.{scale,bias}
  blocks.i.attn.{qkv,proj}                        -> block_i.{q,k,v,o} as Qwen2.5-VL's
  blocks.i.mlp.linear_fc{1,2}                     -> block_i.fc{1,2}.{kernel,bias}
  merger.norm, merger.linear_fc{1,2}              -> merge_norm, merger_fc{1,2}
  deepstack_merger_list.j.{norm,linear_fc1,linear_fc2} -> deepstack_j.{norm,fc1,fc2} (j < len(J))
`save_qwen_vl` writes either whole folder, the language model (`models.hf`) under `model.` beside
Qwen2.5-VL's tower, under `model.language_model.` beside Qwen3-VL's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from maestro_jax.models.configs import ViTConfig, held_layers
from maestro_jax.models.hf import _at, _put, _scanned_path, _set, _Tensors, llm_tensors, write_weights

from maestro_jax.hf_config import VIT_ACTIVATIONS, WHISPER_LAYER_NORM_EPS, HFError
from maestro_jax.hf_config import audio_fields as audio_fields  # the folder's fields: this module's API too
from maestro_jax.hf_config import vit_fields as vit_fields

# One tensor's two directions: (HF array -> Flax array, Flax array -> HF array).
Layout = tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]
_SAME: Layout = (lambda w: w, lambda w: w)
_LINEAR: Layout = (np.transpose, np.transpose)  # HF Linear weights are out x in, Flax kernels in x out
_CONV1D: Layout = (lambda w: w.transpose(2, 1, 0), lambda w: w.transpose(2, 1, 0))  # [out, in, k] <-> [k, in, out]
_GEMMA_NORM: Layout = (lambda w: w + np.float32(1), lambda w: w - np.float32(1))  # Gemma scales by 1 + weight


def _heads(h: int, k: int) -> tuple[Layout, Layout, Layout]:
    """The q/k/v kernel, q/k/v bias and output kernel layouts of attention with `h` heads of `k`."""
    return (
        (lambda w: w.T.reshape(w.shape[1], h, k), lambda w: w.reshape(w.shape[0], h * k).T),
        (lambda w: w.reshape(h, k), lambda w: w.reshape(h * k)),
        (lambda w: w.T.reshape(h, k, w.shape[0]), lambda w: w.reshape(h * k, w.shape[-1]).T),
    )


def _blocks(f: dict, depth: int, hf_layer: Callable[[int], str], names: dict[str, str], key_bias: bool) -> dict:
    """The first `depth` encoder blocks' entries; `names` maps the block's parts to their names in
    HF's layer `hf_layer(i)`. Without `key_bias` the block's `k.bias` has no tensor (None: it loads
    as zeros)."""
    qkv, qkv_bias, out = _heads(f["heads"], f["width"] // f["heads"])
    layouts = {"q": qkv, "k": qkv, "v": qkv, "o": out, "fc1": _LINEAR, "fc2": _LINEAR}
    m = {}
    for i in range(depth):
        b, layer = f"block_{i}", hf_layer(i)
        for part in ("attn_norm", "mlp_norm"):
            m[(b, part, "scale")] = (f"{layer}.{names[part]}.weight", _SAME)
            m[(b, part, "bias")] = (f"{layer}.{names[part]}.bias", _SAME)
        for part in ("q", "k", "v", "o", "fc1", "fc2"):
            m[(b, part, "kernel")] = (f"{layer}.{names[part]}.weight", layouts[part])
            bias = None if part == "k" and not key_bias else f"{layer}.{names[part]}.bias"
            m[(b, part, "bias")] = (bias, qkv_bias if part in "qkv" else _SAME)
    return m


def _prefix(path, tensors: _Tensors, first: str, prefixes: tuple[str, ...]) -> str:
    """The prefix a whole model's checkpoint puts before the tower's tensors ('' for the tower's own)."""
    for p in prefixes:
        if f"{p}{first}" in tensors:
            return p
    raise HFError(f"{path}: tensor {first!r} is missing from the checkpoint (looked under prefixes {list(prefixes)})")


# SigLIP's own, and a Gemma 3 checkpoint's tower: `vision_tower.vision_model.` (the Hub's, transformers 4's),
# `vision_tower.` (transformers 5.24 saves), `model.vision_tower.(vision_model.)` (transformers 5's module names)
SIGLIP_PREFIXES = (
    "vision_model.",
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.",
    "model.vision_model.",  # a SmolVLM or Idefics3 checkpoint's
    "",
)
# CLIP's own and a LLaVA checkpoint's (transformers >= 4.52 writes `model.vision_tower.`)
CLIP_PREFIXES = ("vision_model.", "model.vision_tower.vision_model.", "vision_tower.vision_model.", "")
WHISPER_PREFIXES = ("model.encoder.", "encoder.", "")
# A Qwen2-Audio checkpoint's encoder: `audio_tower.` (the Hub's; transformers 5 saves it so),
# `model.audio_tower.` (transformers 5's module names); its projector beside it
QWEN2_AUDIO_PREFIXES = ("audio_tower.", "model.audio_tower.")


def vit_layers(f: dict) -> int:
    """The blocks a vision tower with fields `f` holds: those up to its `feature_layer`."""
    return held_layers(f["depth"], f.get("feature_layer", -1))


def vit_mapping(
    f: dict, prefix: str = "vision_model.", projector: str | None = None
) -> dict[tuple[str, ...], tuple[str | None, Layout]]:
    """Flax path -> (HF tensor name, layouts) of a SigLIP vision tower with fields `f`, or a CLIP one
    (`class_token`); with `projector` (the prefix of a Gemma 3 or PaliGemma checkpoint's
    `multi_modal_projector`) its average-pooling projector's (`projector: avg_pool`) or its linear
    one's (`projector: linear`) too."""
    p, c, d = f["patch"], f["channels"], f["width"]
    patch: Layout = (
        lambda w: w.transpose(2, 3, 1, 0).reshape(p * p * c, d),  # conv [D, C, p, p] -> rows in patchify's (y, x, c)
        lambda w: w.reshape(p, p, c, d).transpose(3, 2, 0, 1),
    )
    m = {
        ("patch_embed", "kernel"): (f"{prefix}embeddings.patch_embedding.weight", patch),
        ("pos",): (f"{prefix}embeddings.position_embedding.weight", _SAME),
        ("merge_norm", "scale"): (f"{prefix}post_layernorm.weight", _SAME),
        ("merge_norm", "bias"): (f"{prefix}post_layernorm.bias", _SAME),
    }
    if f.get("class_token"):
        m[("class_embed",)] = (f"{prefix}embeddings.class_embedding", _SAME)
        m[("pre_norm", "scale")] = (f"{prefix}pre_layrnorm.weight", _SAME)
        m[("pre_norm", "bias")] = (f"{prefix}pre_layrnorm.bias", _SAME)
    else:
        m[("patch_embed", "bias")] = (f"{prefix}embeddings.patch_embedding.bias", _SAME)
    if projector is not None and f.get("projector") == "linear" and not f.get("projector_bias", True):
        m[("proj", "kernel")] = (f"{projector}proj.weight", _LINEAR)  # SmolVLM's and Idefics3's connector
    elif projector is not None and f.get("projector") == "linear":  # PaliGemma's
        _linear(m, ("proj",), f"{projector}linear")
    elif projector is not None:
        m[("proj_norm", "scale")] = (f"{projector}mm_soft_emb_norm.weight", _GEMMA_NORM)
        m[("proj", "kernel")] = (f"{projector}mm_input_projection_weight", _SAME)  # [vision width, text width]
    names = {"attn_norm": "layer_norm1", "mlp_norm": "layer_norm2", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    names.update({x: f"self_attn.{x}_proj" for x in "qkv"}, o="self_attn.out_proj")
    return m | _blocks(f, vit_layers(f), lambda i: f"{prefix}encoder.layers.{i}", names, key_bias=True)


QWEN_VL_PREFIXES = ("visual.", "model.visual.")


def _qwen_patch(f: dict) -> Layout:
    """A Qwen-VL tower's Conv3d patch kernel [D, C, T, p, p] <-> the patch embedding's [T*p*p*C, D],
    rows in patchify's (frame, y, x, channel) order: each of the T frames' kernels kept, both ways."""
    p, c, d, t = f["patch"], f["channels"], f["width"], f["frames"]
    return (
        lambda w: w.transpose(2, 3, 4, 1, 0).reshape(t * p * p * c, d),
        lambda w: w.reshape(t, p, p, c, d).transpose(4, 3, 0, 1, 2),
    )


def _qwen_attention(f: dict, block: str, layer: str) -> dict:
    """A Qwen-VL vision block's attention entries: the fused `qkv` tensor once for each of q, k
    and v, each taking its third (export joins the parts in this order, `_tensors`), and `proj`."""
    d, h = f["width"], f["heads"]
    qkv, qkv_bias, out = _heads(h, d // h)

    def third(j: int, layout: Layout) -> Layout:
        return (lambda w: layout[0](w[j * d : (j + 1) * d]), layout[1])

    m = {}
    for j, part in enumerate("qkv"):
        m[(block, part, "kernel")] = (f"{layer}.attn.qkv.weight", third(j, qkv))
        m[(block, part, "bias")] = (f"{layer}.attn.qkv.bias", third(j, qkv_bias))
    m[(block, "o", "kernel")] = (f"{layer}.attn.proj.weight", out)
    m[(block, "o", "bias")] = (f"{layer}.attn.proj.bias", _SAME)
    return m


def _linear(m: dict, path: tuple[str, ...], name: str) -> None:
    """A Linear with a bias: `name`.{weight, bias} <-> `path`.{kernel, bias}."""
    m[(*path, "kernel")] = (f"{name}.weight", _LINEAR)
    m[(*path, "bias")] = (f"{name}.bias", _SAME)


def _layer_norm(m: dict, path: tuple[str, ...], name: str) -> None:
    m[(*path, "scale")] = (f"{name}.weight", _SAME)
    m[(*path, "bias")] = (f"{name}.bias", _SAME)


def qwen_vit_mapping(f: dict, prefix: str = "visual.") -> dict[tuple[str, ...], tuple[str | None, Layout]]:
    """Flax path -> (HF tensor name, layouts) of a Qwen2.5-VL vision tower with fields `f`."""
    m = {
        ("patch_embed", "kernel"): (f"{prefix}patch_embed.proj.weight", _qwen_patch(f)),
        ("merge_norm", "scale"): (f"{prefix}merger.ln_q.weight", _SAME),
    }
    _linear(m, ("merger_fc1",), f"{prefix}merger.mlp.0")
    _linear(m, ("merger_fc2",), f"{prefix}merger.mlp.2")
    for i in range(vit_layers(f)):
        b, layer = f"block_{i}", f"{prefix}blocks.{i}"
        m[(b, "attn_norm", "scale")] = (f"{layer}.norm1.weight", _SAME)
        m[(b, "mlp_norm", "scale")] = (f"{layer}.norm2.weight", _SAME)
        m |= _qwen_attention(f, b, layer)
        for part in ("gate", "up", "down"):
            _linear(m, (b, part), f"{layer}.mlp.{part}_proj")
    return m


def qwen3_vit_mapping(f: dict, prefix: str = "model.visual.") -> dict[tuple[str, ...], tuple[str | None, Layout]]:
    """Flax path -> (HF tensor name, layouts) of a Qwen3-VL vision tower with fields `f`: its blocks,
    its learned position table, the merger and each DeepStack merger (`deepstack_merger_list`)."""
    m = {
        ("patch_embed", "kernel"): (f"{prefix}patch_embed.proj.weight", _qwen_patch(f)),
        ("patch_embed", "bias"): (f"{prefix}patch_embed.proj.bias", _SAME),
        ("pos",): (f"{prefix}pos_embed.weight", _SAME),
    }
    _layer_norm(m, ("merge_norm",), f"{prefix}merger.norm")
    _linear(m, ("merger_fc1",), f"{prefix}merger.linear_fc1")
    _linear(m, ("merger_fc2",), f"{prefix}merger.linear_fc2")
    for j in range(len(f.get("deepstack_layers", ()))):
        merger = f"{prefix}deepstack_merger_list.{j}"
        _layer_norm(m, (f"deepstack_{j}", "norm"), f"{merger}.norm")
        _linear(m, (f"deepstack_{j}", "fc1"), f"{merger}.linear_fc1")
        _linear(m, (f"deepstack_{j}", "fc2"), f"{merger}.linear_fc2")
    for i in range(vit_layers(f)):
        b, layer = f"block_{i}", f"{prefix}blocks.{i}"
        _layer_norm(m, (b, "attn_norm"), f"{layer}.norm1")
        _layer_norm(m, (b, "mlp_norm"), f"{layer}.norm2")
        m |= _qwen_attention(f, b, layer)
        _linear(m, (b, "fc1"), f"{layer}.mlp.linear_fc1")
        _linear(m, (b, "fc2"), f"{layer}.mlp.linear_fc2")
    return m


def gemma3_projector_prefix(tower_prefix: str) -> str | None:
    """Where a Gemma 3 or PaliGemma checkpoint keeps the projector (a SmolVLM or Idefics3 one its
    connector's projection), given where it keeps the tower (None: a tower's own checkpoint, which
    holds no projector)."""
    if tower_prefix == "model.vision_model.":
        return "model.connector.modality_projection."
    for tower in ("vision_tower.vision_model.", "vision_tower."):
        if tower_prefix.endswith(tower):
            return tower_prefix.removesuffix(tower) + "multi_modal_projector."
    return None


def audio_mapping(
    f: dict, prefix: str = "", projector: str | None = None
) -> dict[tuple[str, ...], tuple[str | None, Layout]]:
    """Flax path -> (HF tensor name, layouts) of a Whisper encoder with fields `f`; with
    `projector` (the prefix of a Qwen2-Audio checkpoint's `multi_modal_projector.`) its linear
    projection onto the language model's width as `out_proj`."""
    m = {
        ("stem", "conv1_kernel"): (f"{prefix}conv1.weight", _CONV1D),
        ("stem", "conv1_bias"): (f"{prefix}conv1.bias", _SAME),
        ("stem", "conv2_kernel"): (f"{prefix}conv2.weight", _CONV1D),
        ("stem", "conv2_bias"): (f"{prefix}conv2.bias", _SAME),
        ("pos",): (f"{prefix}embed_positions.weight", _SAME),
        ("out_norm", "scale"): (f"{prefix}layer_norm.weight", _SAME),
        ("out_norm", "bias"): (f"{prefix}layer_norm.bias", _SAME),
    }
    names = {"attn_norm": "self_attn_layer_norm", "mlp_norm": "final_layer_norm", "fc1": "fc1", "fc2": "fc2"}
    names.update({x: f"self_attn.{x}_proj" for x in "qkv"}, o="self_attn.out_proj")
    if projector is not None:
        _linear(m, ("out_proj",), f"{projector}linear")
    return m | _blocks(f, f["depth"], lambda i: f"{prefix}layers.{i}", names, key_bias=False)


def _audio_mapping(path: Path, tensors: _Tensors, fields: dict) -> dict:
    """What `load_audio` reads: a Whisper encoder's tensors under the prefix the folder saved them
    with; a Qwen2-Audio folder's encoder (`audio_tower.`) and its projector."""
    prefix = _prefix(path, tensors, "conv1.weight", WHISPER_PREFIXES + QWEN2_AUDIO_PREFIXES)
    projector = None
    if prefix in QWEN2_AUDIO_PREFIXES:
        projector = prefix.removesuffix("audio_tower.") + "multi_modal_projector."
    return audio_mapping(fields, prefix, projector)


def _load(path: Path, tensors: _Tensors, target: dict, mapping: dict) -> dict:
    """`target` (the tower's initialised params, arrays) with every mapped leaf replaced by the
    checkpoint's weight in the leaf's sharding; unmapped leaves (the projector) stay as they are."""
    scanned = "blocks" in target
    layers: dict[tuple[str, ...], dict[int, np.ndarray]] = {}
    out = jax.tree.map(lambda x: x, target)
    for flax_path, (name, (to_flax, to_hf)) in mapping.items():
        where, layer = _scanned_path(flax_path) if scanned else (flax_path, None)
        like = _at(target, where)
        shape = tuple(like.shape if layer is None else like.shape[1:])
        if name is None:
            value = np.zeros(shape, np.float32)
        else:
            try:
                w = tensors.get(name)
            except HFError as err:
                raise HFError(f"{path}: {err}") from None
            try:
                value = to_flax(w)
            except ValueError:  # a reshape the tensor's size does not allow
                value = None
            if value is None or tuple(value.shape) != shape:
                raise HFError(
                    f"{path}: tensor {name!r} has shape {tuple(w.shape)}; the model's {'.'.join(flax_path)} "
                    f"needs {tuple(to_hf(np.zeros(shape, np.float32)).shape)}"
                )
        if layer is None:
            _set(out, where, _put(value, like))
        else:
            layers.setdefault(where, {})[layer] = value
    for where, stack in layers.items():
        _set(out, where, _put(np.stack([stack[i] for i in range(len(stack))]), _at(target, where)))
    return out


def _held_blocks(params: dict) -> int:
    if "blocks" in params:
        return len(jax.tree.leaves(params["blocks"])[0])
    return sum(k.startswith("block_") for k in params)


def load_vit(path: str | Path, target: dict, fields: dict) -> dict:
    """The SigLIP, CLIP, Qwen2.5-VL or Qwen3-VL tower's weights in `target`, the `VisionEncoder`
    params (shaped and sharded): as many of the checkpoint's blocks as `target` holds (those up to
    its model's `feature_layer`, which the checkpoint's own config need not name); from a Gemma 3
    folder, its projector too (`projector: avg_pool`), from a Qwen-VL one its merger (and
    Qwen3-VL's DeepStack mergers)."""
    path, tensors = Path(path), _Tensors(Path(path))
    held = _held_blocks(target)
    if held > fields["depth"]:
        raise HFError(f"{path}: the checkpoint has {fields['depth']} blocks; the model holds {held}")
    return _load(path, tensors, target, _tower_mapping(path, tensors, fields, held))


def _tower_mapping(path: Path, tensors: _Tensors, fields: dict, held: int) -> dict:
    """What `load_vit` reads for a tower of `held` blocks: the mapping of its kind (SigLIP, CLIP,
    Qwen2.5-VL, Qwen3-VL) under the prefix the folder's tensors are saved with."""
    if fields.get("block") == "rmsnorm_glu" or fields.get("pos_embed") == "table_rope2d":
        prefix = _prefix(path, tensors, "patch_embed.proj.weight", QWEN_VL_PREFIXES)
        mapping = qwen_vit_mapping if fields.get("block") == "rmsnorm_glu" else qwen3_vit_mapping
        return mapping({**fields, "feature_layer": held}, prefix)
    prefixes = CLIP_PREFIXES if fields.get("class_token") else SIGLIP_PREFIXES
    prefix = _prefix(path, tensors, "embeddings.patch_embedding.weight", prefixes)
    projector = gemma3_projector_prefix(prefix) if fields.get("projector") in ("avg_pool", "linear") else None
    return vit_mapping({**fields, "feature_layer": held}, prefix, projector)


def vit_tensors(path: str | Path, fields: dict, held: int) -> list[str | None]:
    """The tensors `load_vit` reads from the folder for a tower of `held` blocks."""
    path = Path(path)
    return [name for name, _ in _tower_mapping(path, _Tensors(path), fields, held).values()]


def tensors_read(kind: str, path: str | Path, fields: dict, model: dict | None = None) -> list[str | None]:
    """The tensors the loader of a model of `kind` ('llm', 'vit', 'audio') reads from the folder,
    `fields` the folder's own; `model`: the fields of the model it loads into (a tower holds the
    blocks up to its `feature_layer`), the folder's by default."""
    if kind == "llm":
        return llm_tensors(path, fields)
    if kind == "vit":
        return vit_tensors(path, fields, vit_layers(model or fields))
    return audio_tensors(path, fields)


def audio_tensors(path: str | Path, fields: dict) -> list[str | None]:
    """The tensors `load_audio` reads from the folder."""
    path = Path(path)
    return [name for name, _ in _audio_mapping(path, _Tensors(path), fields).values()]


def load_audio(path: str | Path, target: dict, fields: dict) -> dict:
    """The Whisper (or Qwen2-Audio) encoder's weights in `target`, the `AudioEncoder` params
    (shaped and sharded); a Qwen2-Audio folder's projector too."""
    path, tensors = Path(path), _Tensors(Path(path))
    return _load(path, tensors, target, _audio_mapping(path, tensors, fields))


def _tensors(params: dict, mapping: dict) -> dict[str, np.ndarray]:
    """HF name -> array of every mapped leaf of `params` (a scanned tree's layers unstacked); a
    name several leaves map to (Qwen's fused `qkv`) joins their arrays along its first axis, in
    the mapping's order."""
    scanned = "blocks" in params
    out = {}
    for flax_path, (name, (_, to_hf)) in mapping.items():
        if name is None:
            continue
        where, layer = _scanned_path(flax_path) if scanned else (flax_path, None)
        w = np.asarray(jax.device_get(_at(params, where)), np.float32)
        part = np.ascontiguousarray(to_hf(w if layer is None else w[layer]))
        out[name] = np.concatenate([out[name], part]) if name in out else part
    return out


def _write(path: str | Path, tensors: dict, config: dict, max_shard_bytes: int) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_weights(path, tensors, max_shard_bytes)
    (path / "config.json").write_text(json.dumps(config, indent=2))


def save_vit(path: str | Path, params: dict, fields: dict, max_shard_bytes: int = 4 << 30) -> None:
    """Write a `VisionEncoder`'s tower with a position table as a folder that transformers loads:
    `SiglipVisionModel`, or `CLIPVisionModel` for the `class_token` layout, with the blocks it
    holds (`feature_layer`); the merger is not part of either and is left out."""
    if fields.get("pos_embed") != "table" or fields.get("act") not in VIT_ACTIVATIONS:
        raise HFError(
            f"pos_embed={fields.get('pos_embed')!r}, act={fields.get('act')!r}: only a tower with "
            f"pos_embed='table' and act in {list(VIT_ACTIVATIONS)} exports as SigLIP or CLIP"
        )
    _write(path, _tensors(params, vit_mapping(fields)), _vit_config(fields), max_shard_bytes)


def _vit_config(fields: dict) -> dict:
    clip = bool(fields.get("class_token"))
    return {
        "architectures": ["CLIPVisionModel" if clip else "SiglipVisionModel"],
        "model_type": "clip_vision_model" if clip else "siglip_vision_model",
        "hidden_size": fields["width"],
        "intermediate_size": fields["mlp"],
        "num_hidden_layers": vit_layers(fields),
        "num_attention_heads": fields["heads"],
        "num_channels": fields["channels"],
        "image_size": fields["max_grid"] * fields["patch"],
        "patch_size": fields["patch"],
        "hidden_act": fields["act"],
        "layer_norm_eps": fields["norm_eps"],
        **({} if clip else {"vision_use_head": False}),
        "torch_dtype": "float32",
    }


def _nested(config: dict) -> dict:
    """A model's config.json as a whole model's `text_config` / `vision_config`: without the
    top-level keys (`architectures`, `torch_dtype`) the whole folder's config holds."""
    return {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}


def _check_vlm_tower(vit_fields: dict, llm_fields: dict, folder: str, **wanted) -> None:
    """The tower a whole VLM folder holds: SigLIP's (no class token) with the `wanted` fields, a merge
    that divides `max_grid`, and image tokens of the language model's width; HFError naming them."""
    got = {k: vit_fields.get(k, ViTConfig.__dataclass_fields__[k].default) for k in (*wanted, "class_token")}
    if got != {**wanted, "class_token": False} or vit_fields["max_grid"] % vit_fields["merge"]:
        said = ", ".join(f"{k}={v!r}" for k, v in got.items())
        raise HFError(
            f"{said}, max_grid={vit_fields['max_grid']}, merge={vit_fields['merge']}: {folder} tower is SigLIP's "
            f"with {', '.join(f'{k}={v!r}' for k, v in wanted.items())} and a merge that divides max_grid"
        )
    if vit_fields["out_width"] != llm_fields["width"]:
        raise HFError(f"the tower's out_width={vit_fields['out_width']} is not the LLM's width={llm_fields['width']}")


def save_gemma3_vlm(
    path: str | Path,
    vit_params: dict,
    vit_fields: dict,
    llm_params: dict,
    llm_fields: dict,
    image_token: int,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write a VLM's tower (SigLIP with `projector: avg_pool`) and language model (Gemma 3's) as one
    `Gemma3ForConditionalGeneration` folder, with the Hub's tensor names: `vision_tower.vision_model.`,
    `multi_modal_projector.`, `language_model.model.` (and `language_model.lm_head.` when untied).
    `image_token` is the placeholder id the VLM was trained with (`image_token_index`)."""
    from maestro_jax.models.hf import llm_checkpoint

    side = vit_fields["max_grid"] // vit_fields["merge"]
    _check_vlm_tower(vit_fields, llm_fields, "a Gemma 3 VLM's", projector="avg_pool")
    text, text_config = llm_checkpoint(llm_params, llm_fields, "gemma3_text", prefix="language_model.model.")
    tower = _tensors(vit_params, vit_mapping(vit_fields, "vision_tower.vision_model.", "multi_modal_projector."))
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": _nested(text_config),
        "vision_config": _nested(_vit_config(vit_fields)),
        "mm_tokens_per_image": side * side,
        "image_token_index": image_token,
        "tie_word_embeddings": llm_fields["tie_embeddings"],
        "torch_dtype": "float32",
    }
    _write(path, {**text, **tower}, config, max_shard_bytes)


def save_paligemma(
    path: str | Path,
    vit_params: dict,
    vit_fields: dict,
    llm_params: dict,
    llm_fields: dict,
    image_token: int,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write a VLM's tower (SigLIP with `projector: linear`, merge 1) and language model (Gemma 2's,
    or Gemma 1's for PaliGemma 1, with `prefix_lm`) as one PaliGemma folder (`PaliGemmaForConditionalGeneration`), with the
    Hub's tensor names: `vision_tower.vision_model.`, `multi_modal_projector.linear.`,
    `language_model.model.`. `image_token` is the placeholder id the VLM was trained with
    (`image_token_index`)."""
    from maestro_jax.models.hf import llm_checkpoint

    if vit_fields.get("projector") != "linear" or vit_fields.get("merge") != 1 or vit_fields.get("class_token"):
        raise HFError(
            f"projector={vit_fields.get('projector')!r}, merge={vit_fields.get('merge')}, class_token="
            f"{vit_fields.get('class_token', False)}: a PaliGemma tower is SigLIP's with projector='linear' and merge=1"
        )
    if not llm_fields.get("prefix_lm") or vit_fields["out_width"] != llm_fields["width"]:
        raise HFError(
            f"prefix_lm={llm_fields.get('prefix_lm', False)}, the tower's out_width={vit_fields['out_width']}, the "
            f"LLM's width={llm_fields['width']}: a PaliGemma language model is a prefix-LM of the tower's width"
        )
    text_type = "gemma2" if llm_fields.get("post_norms") else "gemma"  # PaliGemma 2's, or PaliGemma 1's
    text, text_config = llm_checkpoint(llm_params, llm_fields, text_type, prefix="language_model.model.")
    tower = _tensors(vit_params, vit_mapping(vit_fields, "vision_tower.vision_model.", "multi_modal_projector."))
    vision = _nested(_vit_config(vit_fields))
    grid = vit_fields["max_grid"]
    config = {
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "model_type": "paligemma",
        "text_config": {
            **_nested(text_config),
            "num_image_tokens": grid * grid,
        },
        "vision_config": {**vision, "projection_dim": llm_fields["width"]},
        "projection_dim": llm_fields["width"],
        "image_token_index": image_token,
        "tie_word_embeddings": llm_fields["tie_embeddings"],
        "torch_dtype": "float32",
    }
    _write(path, {**text, **tower}, config, max_shard_bytes)


def save_smolvlm(
    path: str | Path,
    vit_params: dict,
    vit_fields: dict,
    llm_params: dict,
    llm_fields: dict,
    image_token: int,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write a VLM's tower (SigLIP's layout with `projector: linear`, `projector_bias: false`: the
    connector, its merge window the pixel shuffle's `scale_factor`) and language model (Llama's) as
    one `SmolVLMForConditionalGeneration` folder, with the Hub's tensor names:
    `model.vision_model.`, `model.connector.modality_projection.proj`, `model.text_model.`,
    `lm_head`. `image_token` is the placeholder id the VLM was trained with (`image_token_id`)."""
    from maestro_jax.models.hf import llm_checkpoint

    _check_vlm_tower(vit_fields, llm_fields, "a SmolVLM", projector="linear", projector_bias=False)
    text, text_config = llm_checkpoint(llm_params, llm_fields, "llama", prefix="model.text_model.")
    tower = _tensors(vit_params, vit_mapping(vit_fields, "model.vision_model.", "model.connector.modality_projection."))
    vision = {k: v for k, v in _nested(_vit_config(vit_fields)).items() if k != "vision_use_head"}
    config = {
        "architectures": ["SmolVLMForConditionalGeneration"],
        "model_type": "smolvlm",
        "text_config": _nested(text_config),
        "vision_config": {**vision, "model_type": "smolvlm_vision"},
        "scale_factor": vit_fields["merge"],
        "image_token_id": image_token,
        "tie_word_embeddings": llm_fields["tie_embeddings"],
        "torch_dtype": "float32",
    }
    _write(path, {**text, **tower}, config, max_shard_bytes)


# what each Qwen-VL folder's architecture is: its tower's block and position layout, its text model
QWEN_VL_TYPES = {
    "qwen2_5_vl": {"block": "rmsnorm_glu", "pos_embed": "rope2d", "text": "qwen2", "interleaved": False},
    "qwen3_vl": {"block": "layernorm", "pos_embed": "table_rope2d", "text": "qwen3", "interleaved": True},
}


def qwen_vl_type(vit_fields: dict) -> str | None:
    """The Qwen-VL folder type a tower with `vit_fields` exports in (None: not a Qwen-VL tower)."""
    layout = (vit_fields.get("block"), vit_fields.get("pos_embed"), vit_fields.get("projector"))
    return next(
        (t for t, v in QWEN_VL_TYPES.items() if layout == (v["block"], v["pos_embed"], "patch_merger")),
        None,
    )


def save_qwen_vl(
    path: str | Path,
    vit_params: dict,
    vit_fields: dict,
    llm_params: dict,
    llm_fields: dict,
    image_token: int,
    video_token: int | None = None,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write a VLM's Qwen-VL tower and its M-RoPE language model as one folder of the tower's type
    (`qwen_vl_type`): a `Qwen2_5_VLForConditionalGeneration` with the Hub's tensor names (`visual.`,
    `model.`, `lm_head.`), or a `Qwen3VLForConditionalGeneration` with transformers 5's
    (`model.visual.`, `model.language_model.`, `lm_head.`), its DeepStack mergers and interleaved
    M-RoPE; transformers 5's nested `text_config` either way. `image_token` is the placeholder id
    the VLM was trained with (`image_token_id`), `video_token` its clips' (`video_token_id`; None:
    the VLM took no video, and the folder keeps transformers' default id); Qwen2.5-VL's
    `tokens_per_second` is the LLM's `video_tokens_per_second`."""
    model_type = qwen_vl_type(vit_fields)
    _check_qwen_vl_pair(model_type, vit_fields, llm_fields)
    qwen3 = model_type == "qwen3_vl"
    text, text_config = _qwen_vl_text(llm_params, llm_fields, model_type)
    tower, vision = _qwen_vl_vision(vit_params, vit_fields, llm_fields, model_type)
    config = {
        "architectures": ["Qwen3VLForConditionalGeneration" if qwen3 else "Qwen2_5_VLForConditionalGeneration"],
        "model_type": model_type,
        "text_config": text_config,
        "vision_config": vision,
        "image_token_id": image_token,
        **({} if video_token is None else {"video_token_id": video_token}),
        "tie_word_embeddings": llm_fields["tie_embeddings"],
        "torch_dtype": "float32",
    }
    _write(path, {**text, **tower}, config, max_shard_bytes)


def _check_qwen_vl_pair(model_type: str | None, vit_fields: dict, llm_fields: dict) -> None:
    """A tower and language model that make a Qwen2.5-VL or a Qwen3-VL, else an HFError naming
    the fields."""
    f = vit_fields
    own = QWEN_VL_TYPES.get(model_type or "", {})
    qwen3 = model_type == "qwen3_vl"
    if (
        model_type is None
        or not llm_fields.get("mrope_section")
        or llm_fields["rope_scaling"]
        or bool(llm_fields.get("mrope_interleaved")) != own["interleaved"]
        or (qwen3 and (not llm_fields["qk_norm"] or llm_fields["qkv_bias"]))
        or llm_fields.get("deepstack_layers", 0) != len(f.get("deepstack_layers", ()))
    ):
        raise HFError(
            f"block={f.get('block')!r}, pos_embed={f.get('pos_embed')!r}, projector={f.get('projector')!r}, "
            f"mrope_section={llm_fields.get('mrope_section')}, mrope_interleaved={llm_fields.get('mrope_interleaved')}, "
            f"rope_scaling={llm_fields.get('rope_scaling')}: a Qwen2.5-VL's tower has block='rmsnorm_glu' and "
            f"pos_embed='rope2d', a Qwen3-VL's block='layernorm' and pos_embed='table_rope2d' (and as many "
            f"deepstack_layers as its language model, which has qk_norm and no qkv_bias), both projector="
            f"'patch_merger'; the language model an mrope_section (interleaved for Qwen3-VL) and no rope_scaling"
        )
    if f["out_width"] != llm_fields["width"]:
        raise HFError(f"the tower's out_width={f['out_width']} is not the LLM's width={llm_fields['width']}")


def _qwen_vl_text(llm_params: dict, llm_fields: dict, model_type: str) -> tuple[dict, dict]:
    """The language model's tensors under the family's names and its nested `text_config`, with
    the family's M-RoPE."""
    from maestro_jax.models.hf import llm_checkpoint

    own, qwen3 = QWEN_VL_TYPES[model_type], model_type == "qwen3_vl"
    text, text_config = llm_checkpoint(
        llm_params, llm_fields, own["text"], prefix="model.language_model." if qwen3 else "model."
    )
    text_config = {k: v for k, v in text_config.items() if k not in ("architectures", "torch_dtype", "rope_scaling")}
    section = list(llm_fields["mrope_section"])
    if qwen3:
        theta = text_config.pop("rope_theta")
        text_config |= {
            "model_type": "qwen3_vl_text",
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": theta,
                "mrope_section": section,
                "mrope_interleaved": True,
            },
        }
    else:
        text_config |= {"model_type": "qwen2_5_vl_text", "rope_scaling": {"type": "mrope", "mrope_section": section}}
    return text, text_config


def _qwen_vl_vision(vit_params: dict, f: dict, llm_fields: dict, model_type: str) -> tuple[dict, dict]:
    """The tower's tensors under the family's names and its `vision_config`."""
    qwen3 = model_type == "qwen3_vl"
    vision = {
        "model_type": f"{model_type}_vision",
        "depth": vit_layers(f),
        "hidden_size": f["width"],
        "hidden_act": f["act"],
        "intermediate_size": f["mlp"],
        "num_heads": f["heads"],
        "in_channels": f["channels"],
        "patch_size": f["patch"],
        "spatial_merge_size": f["merge"],
        "temporal_patch_size": f["frames"],
        "out_hidden_size": f["out_width"],
        "rope_parameters": {"rope_type": "axial", "rope_theta": f["rope_theta"]},
    }
    if qwen3:
        vision |= {
            "num_position_embeddings": f["table_grid"] ** 2,
            "deepstack_visual_indexes": list(f["deepstack_layers"]),
        }
        tower = _tensors(vit_params, qwen3_vit_mapping(f))
    else:
        vision |= {"window_size": f["window"] * f["patch"], "fullatt_block_indexes": list(f["full_layers"])}
        step = llm_fields.get("video_tokens_per_second", 4.0)  # an int in transformers' config class
        vision["tokens_per_second"] = int(step) if float(step).is_integer() else step
        tower = _tensors(vit_params, qwen_vit_mapping(f))
    return tower, vision


def save_audio(path: str | Path, params: dict, fields: dict, max_shard_bytes: int = 4 << 30) -> None:
    """Write a Whisper-layout `AudioEncoder` (`stem: conv`) as a folder that
    `transformers.WhisperEncoder` loads; `out_proj` is not part of Whisper and is left out."""
    _check_whisper_layout(fields, "Whisper")
    if fields.get("pool", 1) != 1:
        raise HFError(
            f"pool={fields['pool']}: Whisper's encoder does not pool its tokens; a pool of 2 exports with its "
            f"language model as one qwen2_audio folder (--section audio,llm)"
        )
    config = {
        "architectures": ["WhisperEncoder"],
        "model_type": "whisper",
        **_whisper_config(fields),
        "torch_dtype": "float32",
    }
    _write(path, _tensors(params, audio_mapping(fields)), config, max_shard_bytes)


def _check_whisper_layout(fields: dict, what: str) -> None:
    if fields.get("stem") != "conv" or fields.get("norm_eps") != WHISPER_LAYER_NORM_EPS:
        raise HFError(
            f"stem={fields.get('stem')!r}, norm_eps={fields.get('norm_eps')!r}: only a Whisper-layout encoder "
            f"(stem='conv', norm_eps={WHISPER_LAYER_NORM_EPS}) exports as {what}"
        )


def save_qwen2_audio(
    path: str | Path,
    audio_params: dict,
    audio_fields: dict,
    llm_params: dict,
    llm_fields: dict,
    audio_token: int,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write an audio LLM's encoder (Whisper's layout, `pool: 2`, its `out_proj` the projector) and
    language model (Qwen2's) as one `Qwen2AudioForConditionalGeneration` folder, with the Hub's
    tensor names: `audio_tower.`, `multi_modal_projector.linear.`, `language_model.model.` (and
    `language_model.lm_head.` when untied). `audio_token` is the placeholder id the model was
    trained with (`audio_token_index`)."""
    from maestro_jax.models.hf import llm_checkpoint

    from maestro_jax.hf_config import QWEN2_AUDIO_POOL

    _check_whisper_layout(audio_fields, "Qwen2-Audio's encoder")
    if audio_fields.get("pool", 1) != QWEN2_AUDIO_POOL:
        raise HFError(f"pool={audio_fields.get('pool', 1)}: Qwen2-Audio's encoder pools pairs of tokens (pool=2)")
    if audio_fields["out_width"] != llm_fields["width"]:
        raise HFError(
            f"the encoder's out_width={audio_fields['out_width']} is not the LLM's width={llm_fields['width']}"
        )
    text, text_config = llm_checkpoint(llm_params, llm_fields, "qwen2", prefix="language_model.model.")
    encoder = _tensors(audio_params, audio_mapping(audio_fields, "audio_tower.", "multi_modal_projector."))
    config = {
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "audio_config": {"model_type": "qwen2_audio_encoder", **_whisper_config(audio_fields)},
        "text_config": _nested(text_config),
        "audio_token_index": audio_token,
        "torch_dtype": "float32",
    }
    _write(path, {**text, **encoder}, config, max_shard_bytes)


def _whisper_config(fields: dict) -> dict:
    """A Whisper-layout encoder's config.json fields."""
    return {
        "num_mel_bins": fields["mel"],
        "d_model": fields["width"],
        "encoder_layers": fields["depth"],
        "encoder_attention_heads": fields["heads"],
        "encoder_ffn_dim": fields["mlp"],
        "max_source_positions": fields["max_tokens"],
        "activation_function": fields["act"],
    }
